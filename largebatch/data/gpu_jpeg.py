"""JPEG decoding on the GPU (`data.decode: gpu`), with an optional cache of decoded images in GPU memory
(`data.gpu_cache_gb`), as MLPerf's ResNet-50 input pipeline does with DALI and nvJPEG.

1. Plan (a loader worker, CPU): read the file, parse its header and draw the crop box and the flip bit with
   the CPU path's own `jpeg.plan_crop`, so both paths crop every image alike. A file nvJPEG does not take
   (CMYK or YCCK JPEGs, other formats) is decoded there by the CPU path and travels as finished pixels; a
   file whose header cannot be read is corrupt (`data.on_corrupt`), as on the CPU path.
2. Decode (the training process, GPU): the batch's JPEG bytes in one batched `torchvision.io.decode_jpeg`
   call on the device (nvJPEG; the hardware decoder where the GPU has one). When the batch fails, its images
   are decoded one by one, and one that fails is corrupt.
3. Finish, per image on the GPU: the crop box mapped to the decoded pixels as the CPU path maps it
   (`jpeg.finish_crop`), resized to S x S with the same antialiased bilinear filter in float32 and rounded,
   mirrored on the flip bit, written into the batch: N x S x S x 3 uint8 on the device (an NCHW view of NHWC
   memory, what the CPU path hands over; the model's Normalize layer scales it).
4. Cache: with `data.gpu_cache_gb`, decoded images (full size, HWC uint8) are kept in GPU memory up to that
   budget, first come first kept, never evicted; a cached image skips step 2 in later epochs (its file is
   still read by the worker, which does not know the cache). For data sets, or parts of them, that fit.
"""
from __future__ import annotations

from typing import Any

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
    """Steps 2-4 in the training process: a worker's planned batch -> (x, y, corrupt paths) on `device`."""

    def __init__(self, size: int, cache_gb: float, device: torch.device | None = None,
                 decode: Any = None) -> None:
        self.size = size
        self.device = device
        self.cache = DecodedCache(int(cache_gb * 2**30)) if cache_gb > 0 else None
        self._decode = decode   # (list of uint8 byte tensors, device) -> list of CHW uint8 tensors; tests pass one

    def decode(self, blobs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        if self._decode is not None:
            return self._decode(blobs, device)
        from torchvision.io import ImageReadMode, decode_jpeg

        return decode_jpeg(blobs, mode=ImageReadMode.RGB, device=device)

    def _decode_all(self, blobs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
        """Step 2: the batch in one call, or image by image when it fails (None: corrupt)."""
        if not blobs:
            return []
        try:
            return list(self.decode(blobs, device))
        except (RuntimeError, ValueError):   # torchvision raises RuntimeError on a bad JPEG
            out: list[torch.Tensor | None] = []
            for blob in blobs:
                try:
                    out.append(self.decode([blob], device)[0])
                except (RuntimeError, ValueError):
                    out.append(None)
            return out

    def __call__(self, item) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        blobs, plans, ready, y, kept, paths, corrupt = item
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
        for j, decoded in zip(todo, self._decode_all([blobs[j] for j in todo], device)):
            if decoded is None:
                continue
            image = decoded.permute(1, 2, 0)   # HWC view
            images[j] = image
            if self.cache is not None:
                self.cache.put(int(kept[j]), image.contiguous())
        keep = []
        for j in range(n):
            if blobs[j].numel() == 0:
                keep.append(j)
                continue
            found = images[j]
            if found is None:
                corrupt = [*corrupt, paths[j]]
                continue
            h, w, colorspace, box, k, flip = plans[j]
            out[j].copy_(jpeg.finish_crop(found, jpeg.CropPlan(h, w, colorspace, box, k, flip), s))
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

