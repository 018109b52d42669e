"""JPEG decoding on the GPU (`data.decode: gpu`), with an optional cache of decoded images in GPU memory
(`data.gpu_cache_gb`), as MLPerf's ResNet-50 input pipeline does with DALI and nvJPEG.

1. Plan (a loader worker, CPU): read the file, parse its header and draw the crop box and the flip bit with
   the CPU path's own `jpeg.plan_crop`, so both paths crop every image alike. A file nvJPEG does not take
   (CMYK or YCCK JPEGs, other formats) is decoded there by the CPU path and travels as finished pixels; a
   file whose header cannot be read is corrupt (`data.on_corrupt`), as on the CPU path.
2. Decode (the training process, GPU), one batched call: with nvImageCodec (`data.gpu_decoder`
   nvimgcodec, the `nvidia-nvimgcodec-cu13` wheel) only each image's crop window is decoded, on the GPU's
   hardware JPEG decoder where it has one; with torchvision's `decode_jpeg` (nvJPEG on the CUDA cores) the
   whole image. `auto` takes nvImageCodec where it loads, saying once when it does not. When the batch
   fails, its images are decoded one by one, and one that fails is corrupt.
3. Finish, per image on the GPU: the crop box mapped to the decoded pixels as the CPU path maps it
   (`jpeg.finish_crop`), resized to S x S with the same antialiased bilinear filter in float32 and rounded,
   mirrored on the flip bit, written into the batch: N x S x S x 3 uint8 on the device (an NCHW view of NHWC
   memory, what the CPU path hands over; the model's Normalize layer scales it). A decoded window is the
   crop box's pixels as the CPU path takes them at full scale (`crop_window`).
4. Cache: with `data.gpu_cache_gb`, decoded images (full size, HWC uint8) are kept in GPU memory up to that
   budget, first come first kept, never evicted; a cached image skips step 2 in later epochs (its file is
   still read by the worker, which does not know the cache). For data sets, or parts of them, that fit. With
   a cache, whole images are decoded (a window is no use in the next epoch).
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np
import torch

from largebatch.data import jpeg
from largebatch.errors import UserError

NVJPEG_COLORSPACES = ("Gray", "YCbCr", "RGB")   # what nvJPEG decodes to RGB itself (simplejpeg's header names)


def gpu_decoder_available() -> str | None:
    """None when GPU decoding can run here, else the reason (a missing CUDA device or torchvision)."""
    if not torch.cuda.is_available():
        return "it needs a CUDA device"
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except ImportError:
        return "it needs torchvision (pip install torchvision, on the GPU image already)"
    return None


def crop_window(plan: jpeg.CropPlan) -> tuple[int, int, int, int]:
    """The crop box in whole pixels (y0, x0, y1, x1) of the full-scale image, as `jpeg.finish_crop` takes it."""
    return jpeg.crop_window(plan, plan.h, plan.w)


def window_plan(plan: jpeg.CropPlan) -> jpeg.CropPlan:
    """The plan of a decoded window: the whole of it is the box."""
    y0, x0, y1, x1 = crop_window(plan)
    return jpeg.CropPlan(y1 - y0, x1 - x0, plan.colorspace, (0.0, 0.0, float(y1 - y0), float(x1 - x0)), 1, plan.flip)


class TorchvisionDecoder:
    """Step 2 with torchvision's nvJPEG `decode_jpeg`: whole images, CHW uint8 on the device."""
    windows = False

    def __call__(self, blobs: list[torch.Tensor], plans: list[jpeg.CropPlan] | None, device: torch.device) -> list:
        from torchvision.io import ImageReadMode, decode_jpeg

        return list(decode_jpeg(blobs, mode=ImageReadMode.RGB, device=device))


class NvImageCodecDecoder:
    """Step 2 with nvImageCodec: only each image's crop window (a Region of the code stream; whole images where
    `plans` is None), HWC uint8 on the device, decoded in stream order on the current CUDA stream; no EXIF
    rotation (as the CPU path)."""
    windows = True

    def __init__(self, device: torch.device) -> None:
        from nvidia import nvimgcodec

        self.nv = nvimgcodec
        self.decoder = nvimgcodec.Decoder(device_id=device.index or 0)
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False)

    def __call__(self, blobs: list[torch.Tensor], plans: list[jpeg.CropPlan] | None, device: torch.device) -> list:
        streams = []
        for i, blob in enumerate(blobs):
            stream_ = self.nv.CodeStream(blob.numpy())
            if plans is not None:
                y0, x0, y1, x1 = crop_window(plans[i])
                stream_ = stream_.get_sub_code_stream(region=self.nv.Region(y0, x0, y1, x1))
            streams.append(stream_)
        stream = torch.cuda.current_stream(device)
        images = self.decoder.decode(streams, params=self.params, cuda_stream=stream.cuda_stream)
        out = []
        for image in images:
            if image is None:
                raise RuntimeError("nvImageCodec could not decode an image of the batch")
            out.append(torch.as_tensor(image, device=device).permute(2, 0, 1))   # HWC -> CHW, as torchvision
        return out


def pick_decoder(choice: str, device: torch.device) -> Callable:
    """`data.gpu_decoder`: nvimgcodec, torchvision, or auto (nvImageCodec where it loads, else torchvision,
    saying so once)."""
    if choice == "torchvision":
        return TorchvisionDecoder()
    try:
        return NvImageCodecDecoder(device)
    except Exception as err:   # noqa: BLE001 - not installed, or its CUDA libraries do not load
        if choice == "nvimgcodec":
            raise UserError(f"data.gpu_decoder is nvimgcodec but it does not load here ({type(err).__name__}: "
                            f"{err}); install the nvidia-nvimgcodec-cu13 wheel, or set data.gpu_decoder to "
                            "torchvision or auto.") from None
        print(f"largebatch: nvImageCodec does not load ({type(err).__name__}: {err}); JPEGs are decoded whole "
              "by torchvision's nvJPEG.", file=sys.stderr, flush=True)
        return TorchvisionDecoder()


class PlanDecoder(torch.utils.data.Dataset):
    """Step 1: item (epoch, train, indices) -> (JPEG bytes per image, plans, CPU-finished pixels, labels, kept
    indices, corrupt paths). Bytes are uint8 tensors; an image decoded here has empty bytes and its pixels in
    `ready` (one S x S x 3 slot per image)."""

    def __init__(self, paths: np.ndarray, labels: torch.Tensor, size: int, min_scale: float, seed: int) -> None:
        self.paths, self.labels, self.size, self.min_scale, self.seed = paths, labels, size, min_scale, seed

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, item: tuple[int, bool, torch.Tensor]):
        epoch, train, indices = item
        ready = torch.empty((len(indices), self.size, self.size, 3), dtype=torch.uint8)
        blobs: list[torch.Tensor] = []
        plans: list[tuple] = []
        kept: list[int] = []
        corrupt: list[str] = []
        empty = torch.empty(0, dtype=torch.uint8)
        for i in indices.tolist():
            path = str(self.paths[i])
            try:
                with open(path, "rb") as f:
                    data = f.read()
                plan = jpeg.plan_crop(data, self.size, train=train, min_scale=self.min_scale, seed=self.seed,
                                      epoch=epoch, index=i)
                if plan.colorspace in NVJPEG_COLORSPACES:
                    blob = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                else:   # nvJPEG takes no CMYK/YCCK and no other format: the CPU path decodes it here
                    jpeg.decode_crop(data, self.size, train=train, min_scale=self.min_scale, seed=self.seed,
                                     epoch=epoch, index=i, out=ready[len(kept)])
                    blob = empty
            except (jpeg.CorruptImage, OSError):
                corrupt.append(path)
                continue
            blobs.append(blob)
            plans.append((plan.h, plan.w, plan.colorspace, plan.box, plan.k, plan.flip))
            kept.append(i)
        kept_t = torch.tensor(kept, dtype=torch.int64)
        return blobs, plans, ready[:len(kept)], self.labels[kept_t], kept_t, [str(self.paths[i]) for i in kept], \
            corrupt


class DecodedCache:
    """Step 4: decoded images by index, within a byte budget; first come first kept, never evicted."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget, self.used = budget_bytes, 0
        self.images: dict[int, torch.Tensor] = {}
        self.hits = self.misses = 0

    def get(self, index: int) -> torch.Tensor | None:
        image = self.images.get(index)
        if image is None:
            self.misses += 1
        else:
            self.hits += 1
        return image

    def put(self, index: int, image: torch.Tensor) -> bool:
        """Keep `image` (HWC uint8) when it fits the budget; True when kept."""
        size = image.numel() * image.element_size()
        if index in self.images or self.used + size > self.budget:
            return False
        self.images[index] = image
        self.used += size
        return True


class GpuFinisher:
    """Steps 2-4 in the training process: a worker's planned batch -> (x, y, corrupt paths) on `device`.
    `decode(blobs, plans, device)` returns CHW uint8 tensors: the plans' crop windows where it decodes windows
    (its `windows` is set) and `plans` are given, else whole images; by default the decoder `data.gpu_decoder`
    picks (tests pass a CPU one)."""

    def __init__(self, size: int, cache_gb: float, device: torch.device | None = None,
                 decode: Any = None, decoder: str = "auto") -> None:
        self.size = size
        self.device = device
        self.cache = DecodedCache(int(cache_gb * 2**30)) if cache_gb > 0 else None
        self.choice = decoder
        self._decode = decode

    def decode(self, blobs: list[torch.Tensor], plans: list[jpeg.CropPlan], device: torch.device) -> list:
        if self._decode is None:
            self._decode = pick_decoder(self.choice, device)
        return self._decode(blobs, plans if self.windows else None, device)

    @property
    def windows(self) -> bool:
        """Whether crop windows are decoded (a window decoder, and no cache to fill with whole images)."""
        return bool(getattr(self._decode, "windows", False)) and self.cache is None

    def _decode_all(self, blobs: list[torch.Tensor], plans: list[jpeg.CropPlan], device: torch.device
                    ) -> list[torch.Tensor | None]:
        """Step 2: the batch in one call, or image by image when it fails (None: corrupt)."""
        if not blobs:
            return []
        try:
            return list(self.decode(blobs, plans, device))
        except (RuntimeError, ValueError):   # torchvision raises RuntimeError on a bad JPEG
            out: list[torch.Tensor | None] = []
            for blob, plan in zip(blobs, plans):
                try:
                    out.append(self.decode([blob], [plan], device)[0])
                except (RuntimeError, ValueError):
                    out.append(None)
            return out

    def __call__(self, item) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        blobs, plan_tuples, ready, y, kept, paths, corrupt = item
        plans = [jpeg.CropPlan(*p) for p in plan_tuples]
        device = self.device or torch.device("cuda", torch.cuda.current_device())
        n, s = len(plans), self.size
        out = torch.empty((n, s, s, 3), dtype=torch.uint8, device=device)
        images: list[torch.Tensor | None] = [None] * n
        todo: list[int] = []
        for j in range(n):
            if blobs[j].numel() == 0:
                out[j].copy_(ready[j], non_blocking=True)
                continue
            cached = self.cache.get(int(kept[j])) if self.cache is not None else None
            if cached is None:
                todo.append(j)
            images[j] = cached
        decoded = self._decode_all([blobs[j] for j in todo], [plans[j] for j in todo], device)
        windows = self.windows
        for j, image in zip(todo, decoded):
            if image is None:
                continue
            hwc = image.permute(1, 2, 0)   # HWC view
            images[j] = hwc
            if windows:
                plans[j] = window_plan(plans[j])
            elif self.cache is not None:
                self.cache.put(int(kept[j]), hwc.contiguous())
        keep = []
        for j in range(n):
            if blobs[j].numel() == 0:
                keep.append(j)
                continue
            found = images[j]
            if found is None:
                corrupt = [*corrupt, paths[j]]
                continue
            out[j].copy_(jpeg.finish_crop(found, plans[j], s))
            keep.append(j)
        if len(keep) < n:
            rows = torch.tensor(keep, dtype=torch.int64)
            out, y = out[rows.to(device)], y[rows]
        return out.permute(0, 3, 1, 2), y, corrupt


def check_decode(choice: str, dataset: str) -> bool:
    """`data.decode` resolved: True for GPU decoding. `gpu` where it cannot run is one sentence; `auto` takes
    the GPU for JPEG folders where it can run."""
    if choice == "cpu" or dataset != "imagefolder":   # gpu with another data set: refused by DataConfig.validate
        return False
    why = gpu_decoder_available()
    if why is not None:
        if choice == "gpu":
            raise UserError(f"data.decode is gpu but {why}; set data.decode to cpu or auto.")
        return False
    return True

