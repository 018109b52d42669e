"""JPEG decoding on the GPU (`data.decode: gpu`), with an optional cache of decoded images in GPU memory
(`data.gpu_cache_gb`), as MLPerf's ResNet-50 input pipeline does with DALI and nvJPEG.

1. Plan (a loader worker, CPU): read the file, parse its header and draw the crop box and the flip bit with
   the CPU path's own `jpeg.plan_crop`, so both paths crop every image alike. A file nvJPEG does not take
   (CMYK or YCCK JPEGs, other formats) is decoded there by the CPU path and travels as finished pixels; a
   file whose header cannot be read is corrupt (`data.on_corrupt`), as on the CPU path.
2. Decode (the training process, GPU), one batched call, its results ready in the order of the stream current
   at the call (the batch's stream: `placement.prefetch`'s side stream in training), with no host sync of ours:
   with nvImageCodec (`data.gpu_decoder` nvimgcodec, the `nvidia-nvimgcodec-cu13` wheel; its JPEG back-ends
   need libnvjpeg, the `nvidia-nvjpeg` 13.x wheel) only each image's crop window is decoded, by its GPU
   back-ends alone (the GPU's hardware JPEG decoder where it has one, else nvJPEG's CUDA decoder; never its
   CPU back-end; 2 CPU threads), on that stream (`cuda_stream=`); with torchvision's `decode_jpeg` (nvJPEG)
   the whole image, on a decode stream of ours that the batch's stream then waits for (an event; the images
   `record_stream`ed on it). `auto` takes nvImageCodec where it loads and decodes on the GPU, saying once when
   it does not; the decoder in use is said once. Streams and events go through `CudaOrder`.
3. CPU fallback: an image the GPU decoder rejects (nvImageCodec: None for it; torchvision: the batch fails,
   then its images are tried one by one) is decoded and finished by the CPU path from its bytes with its plan
   (`cpu_decode`: the CPU path's own pixels), counted in `GpuFinisher.cpu_fallbacks` and remembered, so later
   epochs decode it on the CPU at once. nvJPEG rejects some valid files (grayscale in some versions, unusual
   subsampling, some progressive files, arithmetic coding); only an image the CPU path rejects too is corrupt.
4. Finish, per image on the GPU: the crop box mapped to the decoded pixels as the CPU path maps it
   (`jpeg.finish_crop`), resized to S x S with the same antialiased bilinear filter in float32 and rounded,
   mirrored on the flip bit, written into the batch: N x S x S x 3 uint8 on the device (an NCHW view of NHWC
   memory, what the CPU path hands over; the model's Normalize layer scales it). A decoded window is the
   crop box's pixels as the CPU path takes them at full scale (`crop_window`).
5. Cache: with `data.gpu_cache_gb`, decoded images (full size, HWC uint8) are kept in GPU memory up to that
   budget, first come first kept, never evicted; a cached image skips step 2 in later epochs (its file is
   still read by the worker, which does not know the cache). For data sets, or parts of them, that fit. With
   a cache, whole images are decoded (a window is no use in the next epoch). A cached image read on another
   stream than the one that filled it waits for that stream first (an event).
"""
from __future__ import annotations

import io
import os
import sys
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
from PIL import Image

from largebatch.data import jpeg
from largebatch.errors import UserError

NVJPEG_COLORSPACES = ("Gray", "YCbCr", "RGB")   # what nvJPEG decodes to RGB itself (simplejpeg's header names)
NVIMGCODEC_CPU_THREADS = 2   # nvImageCodec's default is a thread per CPU core; its GPU back-ends need few
NVIMGCODEC_BACKENDS = ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU")   # BackendKind names: no CPU_ONLY
NVJPEG_WHEEL = "nvidia-nvjpeg"   # 13.x for CUDA 13 (make gpu-wheels); the -cu13 name on PyPI is an empty placeholder
_said: set[str] = set()


def say_once(line: str) -> None:
    """Print `line` to stderr the first time this process is to say it."""
    if line not in _said:
        _said.add(line)
        print(line, file=sys.stderr, flush=True)


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


def cpu_decode(data: bytes, plan: jpeg.CropPlan, size: int, out: torch.Tensor) -> None:
    """Step 3: the CPU path's steps 4-5 (`jpeg.decode_crop`) for an image already planned, into `out` (S x S x 3
    uint8 on the CPU): the CPU path's pixels bitwise, as the plan is the one it draws. `jpeg.CorruptImage` when
    the CPU path rejects the image too."""
    try:
        pixels = jpeg._decode(data, plan.h, plan.w, plan.colorspace, plan.k)
    except (ValueError, OSError, SyntaxError, Image.DecompressionBombError) as err:
        raise jpeg.CorruptImage(str(err)) from None
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise jpeg.CorruptImage(f"decoded to shape {pixels.shape}")
    out.copy_(jpeg.finish_crop(torch.from_numpy(pixels), plan, size))


class CudaOrder:
    """The seam through which GPU decoding orders CUDA streams: torch.cuda's streams and events and
    `Tensor.record_stream`, and nothing else does (tests/unit/test_gpu_jpeg.py passes a fake that records the calls)."""

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def use(self, stream: Any) -> Any:
        """The context in which `stream` is the current stream (`torch.cuda.stream`)."""
        return torch.cuda.stream(stream)

    def keep(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that `stream` uses `tensor`, which another stream allocated, so that its
        memory is not reused before the work queued on `stream` until it is freed has run."""
        tensor.record_stream(stream)

    def wait(self, consumer: Any, producer: Any) -> None:
        """`consumer` runs the work queued on it next only after the work queued on `producer` so far: an event
        recorded on `producer`, waited for on `consumer` (on the GPU; the host does not wait)."""
        done = self.event()
        done.record(producer)
        done.wait(consumer)


class TorchvisionDecoder:
    """Step 2 with torchvision's nvJPEG `decode_jpeg`: whole images, CHW uint8 on the device, ready in the order
    of the stream current at the call (the consumer).

    What torchvision promises: its docs say that the input bytes stay on the CPU, that the CUDA version is made
    thread-safe and that it returns no partial results on an error (one image it rejects fails the whole batch,
    RuntimeError); nothing on streams. What its source does (torchvision/csrc/io/image/cuda/decode_jpegs_cuda.cpp,
    the batched GPU decoder of torchvision 0.19 on, as read on its main branch): it decodes under a lock on a CUDA
    stream of its own, taken from the pool when its decoder is made, into tensors it allocates with `torch.empty`,
    that is from the caching allocator's pool of the stream current at the call, without making its stream wait
    for that stream first; it waits on the host for its own stream (cudaStreamSynchronize) before and after
    decoding, and makes the current stream wait for an event recorded on its stream before it returns. So the
    images are complete when it returns, but it may write them into memory that the current stream freed while
    kernels queued on it still read it (the allocator reuses a block freed on the same stream at once, trusting
    stream order).

    Hence it is called with a decode stream of ours current, on which nothing else runs, so that its outputs
    come from that stream's pool; the consumer waits for an event recorded on the decode stream after the call,
    and each image is `record_stream`ed on the consumer, so that the allocator reuses its memory only after the
    consumer's work on it. This holds whichever stream torchvision decodes on (its single-image decoder before
    0.19 decoded on the current stream) and adds no host sync; torchvision's own host syncs stay."""
    windows = False

    def __init__(self, order: CudaOrder | None = None) -> None:
        self.order = order if order is not None else CudaOrder()
        self.streams: dict[torch.device, Any] = {}   # the decode stream, per device

    def __call__(self, blobs: list[torch.Tensor], plans: list[jpeg.CropPlan] | None, device: torch.device) -> list:
        from torchvision.io import ImageReadMode, decode_jpeg

        consumer = self.order.current_stream(device)
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = self.order.new_stream(device)
        with self.order.use(stream):
            images = list(decode_jpeg(blobs, mode=ImageReadMode.RGB, device=device))
        self.order.wait(consumer, stream)
        for image in images:
            self.order.keep(image, consumer)
        return images


class NoGpuBackend(RuntimeError):
    """nvImageCodec loads but decodes no JPEG on the GPU (its JPEG back-ends need libnvjpeg)."""


def probe_jpeg() -> torch.Tensor:
    """A 16 x 16 baseline JPEG's bytes, which any nvJPEG back-end decodes."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 160, 40)).save(buf, "JPEG", quality=90)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


class NvImageCodecDecoder:
    """Step 2 with nvImageCodec: only each image's crop window (a Region of the code stream; whole images where
    `plans` is None), HWC uint8 on the device (CHW views returned, as torchvision's), None for an image it
    rejects; no EXIF rotation and no fancy upsampling, as the CPU path (libjpeg-turbo's fast upsampling).

    Back-ends: the GPU ones alone (HW_GPU_ONLY: the GPU's hardware JPEG decoder; HYBRID_CPU_GPU: nvJPEG's CUDA
    decoder, Huffman decoding on the CPU; GPU_ONLY, which has no JPEG decoder in nvImageCodec 0.8 and costs
    nothing), never CPU_ONLY: by default nvImageCodec decodes on the CPU (libjpeg-turbo) what no GPU back-end
    takes, all of it when libnvjpeg is missing, saying nothing, with a thread per CPU core. Here an image the GPU
    back-ends reject comes back None and the CPU path decodes it (GpuFinisher, step 3). The Decoder is created
    even when no GPU back-end loads, so a probe JPEG decoded at start tells whether they do (`NoGpuBackend`).

    Streams: `decode(..., cuda_stream=)` is given the consumer's stream; nvImageCodec allocates each image on it
    (cudaMallocAsync, and cudaFreeAsync on it when the Image is dropped), makes its own decoding streams wait
    for it before decoding and makes it wait for them afterwards (events: the pre/post sync of nvImageCodec's
    generic codec, which its docs put as "cuda_stream: ... upon which synchronization must take place"), so the
    images are ready in the consumer's order and are freed in it."""
    windows = True

    def __init__(self, device: torch.device, order: CudaOrder | None = None) -> None:
        from nvidia import nvimgcodec

        self.nv = nvimgcodec
        self.order = order if order is not None else CudaOrder()
        kinds = [getattr(nvimgcodec.BackendKind, name) for name in NVIMGCODEC_BACKENDS]
        self.decoder = nvimgcodec.Decoder(device_id=device.index or 0, max_num_cpu_threads=NVIMGCODEC_CPU_THREADS,
                                          backends=[nvimgcodec.Backend(backend_kind=kind) for kind in kinds],
                                          options=":fancy_upsampling=0")
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False)
        if self.decode([probe_jpeg()], None, device)[0] is None:
            raise NoGpuBackend(f"its GPU back-ends decode no JPEG: libnvjpeg does not load (the {NVJPEG_WHEEL} "
                               "wheel)")
        say_once(f"largebatch: GPU JPEG decoding with nvImageCodec {getattr(nvimgcodec, '__version__', '?')}, "
                 f"back-ends {', '.join(NVIMGCODEC_BACKENDS)} ({NVIMGCODEC_CPU_THREADS} CPU threads); an image "
                 "they reject is decoded by the CPU path.")

    def decode(self, blobs: list[torch.Tensor], plans: list[jpeg.CropPlan] | None, device: torch.device) -> list:
        """nvImageCodec's Images (None for an image it rejects), ready in the order of the current stream."""
        sources = []
        for i, blob in enumerate(blobs):
            source = self.nv.CodeStream(blob.numpy())
            if plans is not None:
                y0, x0, y1, x1 = crop_window(plans[i])
                source = source.get_sub_code_stream(region=self.nv.Region(y0, x0, y1, x1))
            sources.append(source)
        consumer = self.order.current_stream(device)
        return list(self.decoder.decode(sources, params=self.params, cuda_stream=consumer.cuda_stream))

    def __call__(self, blobs: list[torch.Tensor], plans: list[jpeg.CropPlan] | None, device: torch.device
                 ) -> list[torch.Tensor | None]:
        return [None if image is None else torch.as_tensor(image, device=device).permute(2, 0, 1)  # HWC -> CHW
                for image in self.decode(blobs, plans, device)]


def pick_decoder(choice: str, device: torch.device, order: CudaOrder | None = None) -> Callable:
    """`data.gpu_decoder`: nvimgcodec, torchvision, or auto (nvImageCodec where it loads and decodes on the GPU,
    else torchvision, saying so once)."""
    if choice == "torchvision":
        return TorchvisionDecoder(order)
    try:
        return NvImageCodecDecoder(device, order)
    except NoGpuBackend:
        if choice == "nvimgcodec":
            raise UserError("data.gpu_decoder is nvimgcodec but nvImageCodec decodes no JPEG on the GPU here, as "
                            f"libnvjpeg does not load; install the {NVJPEG_WHEEL} wheel (make gpu-wheels), or set "
                            "data.gpu_decoder to torchvision.") from None
        say_once(f"largebatch: nvImageCodec decodes no JPEG on the GPU here (libnvjpeg does not load: the "
                 f"{NVJPEG_WHEEL} wheel); JPEGs are decoded whole by torchvision's nvJPEG.")
        return TorchvisionDecoder(order)
    except Exception as err:   # noqa: BLE001 - not installed, or its CUDA libraries do not load
        if choice == "nvimgcodec":
            raise UserError(f"data.gpu_decoder is nvimgcodec but it does not load here ({type(err).__name__}: "
                            f"{err}); install the nvidia-nvimgcodec-cu13 wheel, or set data.gpu_decoder to "
                            "torchvision or auto.") from None
        say_once(f"largebatch: nvImageCodec does not load ({type(err).__name__}: {err}); JPEGs are decoded whole "
                 "by torchvision's nvJPEG.")
        return TorchvisionDecoder(order)


class PlannedBatch(NamedTuple):
    """A worker's planned batch (step 1). `ready` holds only the images decoded on the CPU here, in the order of
    their empty `blobs`. `pin_memory` is what the DataLoader's pin thread calls on it (a type with its own
    `pin_memory`, torch.utils.data's documented hook): only `ready` is copied to the GPU, so only it is pinned;
    the JPEG bytes are read by the decoder from the host as they are."""
    blobs: list
    plans: list
    ready: torch.Tensor
    y: torch.Tensor
    kept: torch.Tensor
    paths: list
    corrupt: list

    def pin_memory(self, device: Any = None) -> PlannedBatch:
        return self._replace(ready=self.ready.pin_memory()) if self.ready.numel() else self


class PlanDecoder(torch.utils.data.Dataset):
    """Step 1: item (epoch, train, indices) -> `PlannedBatch`: JPEG bytes per image, plans, the pixels of the images
    decoded here (CMYK, YCCK, other formats: an empty blob each, their pixels in `ready` in order), labels, kept
    indices, corrupt paths."""

    def __init__(self, paths: np.ndarray, labels: torch.Tensor, size: int, min_scale: float, seed: int) -> None:
        self.paths, self.labels, self.size, self.min_scale, self.seed = paths, labels, size, min_scale, seed

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, item: tuple[int, bool, torch.Tensor]):
        epoch, train, indices = item
        slots = torch.empty((len(indices), self.size, self.size, 3), dtype=torch.uint8)
        on_cpu = 0
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
                                     epoch=epoch, index=i, out=slots[on_cpu])
                    blob = empty
                    on_cpu += 1
            except (jpeg.CorruptImage, OSError):
                corrupt.append(path)
                continue
            blobs.append(blob)
            plans.append((plan.h, plan.w, plan.colorspace, plan.box, plan.k, plan.flip))
            kept.append(i)
        kept_t = torch.tensor(kept, dtype=torch.int64)
        ready = slots[:on_cpu].clone() if on_cpu < len(indices) else slots   # a copy: not N slots through the pipe
        return PlannedBatch(blobs, plans, ready, self.labels[kept_t], kept_t, [str(self.paths[i]) for i in kept],
                            corrupt)


class DecodedCache:
    """Step 5: decoded images by index, within a byte budget; first come first kept, never evicted. `streams`:
    the stream each kept image was written on (None off CUDA)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget, self.used = budget_bytes, 0
        self.images: dict[int, torch.Tensor] = {}
        self.streams: dict[int, Any] = {}
        self.hits = self.misses = 0

    def get(self, index: int) -> torch.Tensor | None:
        image = self.images.get(index)
        if image is None:
            self.misses += 1
        else:
            self.hits += 1
        return image

    def put(self, index: int, image: torch.Tensor, stream: Any = None) -> bool:
        """Keep `image` (HWC uint8, written on `stream`) when it fits the budget; True when kept."""
        size = image.numel() * image.element_size()
        if index in self.images or self.used + size > self.budget:
            return False
        self.images[index] = image
        self.streams[index] = stream
        self.used += size
        return True


class GpuFinisher:
    """Steps 2-5 in the training process: a worker's planned batch -> (x, y, corrupt paths) on `device`.
    `decode(blobs, plans, device)` returns CHW uint8 tensors, None for an image it rejects (or raises for the
    batch): the plans' crop windows where it decodes windows (its `windows` is set) and `plans` are given, else
    whole images; by default the decoder `data.gpu_decoder` picks (tests pass a CPU one). `order`: the CUDA
    stream seam (`CudaOrder` on CUDA; tests pass a fake). `cpu_fallbacks`: the images the GPU decoder rejected
    that the CPU path decoded (step 3), each time; `rejected`: their indices, decoded on the CPU from then on."""

    def __init__(self, size: int, cache_gb: float, device: torch.device | None = None,
                 decode: Any = None, decoder: str = "auto", order: CudaOrder | None = None) -> None:
        self.size = size
        self.device = device
        self.cache = DecodedCache(int(cache_gb * 2**30)) if cache_gb > 0 else None
        self.choice = decoder
        self._decode = decode
        self.order = order
        self.cpu_fallbacks = 0
        self.rejected: set[int] = set()

    def stream_order(self, device: torch.device) -> CudaOrder | None:
        """The stream seam: the one given, else torch.cuda's on CUDA; None elsewhere (one stream of work)."""
        if self.order is None and device.type == "cuda":
            self.order = CudaOrder()
        return self.order

    def decode(self, blobs: list[torch.Tensor], plans: list[jpeg.CropPlan], device: torch.device) -> list:
        if self._decode is None:
            self._decode = pick_decoder(self.choice, device, self.stream_order(device))
        return self._decode(blobs, plans if self.windows else None, device)

    @property
    def windows(self) -> bool:
        """Whether crop windows are decoded (a window decoder, and no cache to fill with whole images)."""
        return bool(getattr(self._decode, "windows", False)) and self.cache is None

    def _decode_all(self, blobs: list[torch.Tensor], plans: list[jpeg.CropPlan], device: torch.device
                    ) -> list[torch.Tensor | None]:
        """Step 2: the batch in one call, or image by image when the call fails (torchvision fails the batch
        for one image it rejects) or returns another number of images than it was given (then which image is
        which is not known). None: an image the GPU decoder rejects."""
        if not blobs:
            return []
        try:
            got = list(self.decode(blobs, plans, device))
            if len(got) == len(blobs):
                return got
        except (RuntimeError, ValueError):   # torchvision raises RuntimeError on a JPEG it rejects
            pass
        out: list[torch.Tensor | None] = []
        for blob, plan in zip(blobs, plans):
            try:
                one = list(self.decode([blob], [plan], device))
                out.append(one[0] if len(one) == 1 else None)
            except (RuntimeError, ValueError):
                out.append(None)
        return out

    def _order_cache_hits(self, hits: list[int], device: torch.device) -> None:
        """Step 5: the current stream waits for each other stream that wrote a cached image it is to read."""
        order = self.stream_order(device)
        if order is None or self.cache is None or not hits:
            return
        consumer = order.current_stream(device)
        waited: list[Any] = []
        for index in hits:
            writer = self.cache.streams.get(index)
            if writer is None or writer == consumer:
                continue
            if not any(writer == w for w in waited):
                order.wait(consumer, writer)
                waited.append(writer)
            order.keep(self.cache.images[index], consumer)

    def _cpu_finish(self, blob: torch.Tensor, plan: jpeg.CropPlan, out: torch.Tensor, device: torch.device) -> None:
        """Step 3 for one image into `out` (a row of the batch); `jpeg.CorruptImage` when the CPU path rejects it
        too. Pinned memory on CUDA, so that the copy does not wait on the host."""
        pixels = torch.empty((self.size, self.size, 3), dtype=torch.uint8, pin_memory=device.type == "cuda")
        cpu_decode(blob.numpy().tobytes(), plan, self.size, pixels)
        out.copy_(pixels, non_blocking=True)
        self.cpu_fallbacks += 1

    def __call__(self, item) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        blobs, plan_tuples, ready, y, kept, paths, corrupt = item
        plans = [jpeg.CropPlan(*p) for p in plan_tuples]
        device = self.device or torch.device("cuda", torch.cuda.current_device())
        n, s = len(plans), self.size
        out = torch.empty((n, s, s, 3), dtype=torch.uint8, device=device)
        images: list[torch.Tensor | None] = [None] * n
        todo: list[int] = []
        hits: list[int] = []
        on_cpu: set[int] = set()
        row = 0   # the next of `ready`'s rows: the images the worker decoded, in order
        for j in range(n):
            if blobs[j].numel() == 0:
                out[j].copy_(ready[row], non_blocking=True)
                row += 1
                continue
            if int(kept[j]) in self.rejected:   # step 3 at once: the GPU decoder rejected it before
                on_cpu.add(j)
                continue
            cached = self.cache.get(int(kept[j])) if self.cache is not None else None
            if cached is None:
                todo.append(j)
            else:
                hits.append(int(kept[j]))
            images[j] = cached
        self._order_cache_hits(hits, device)
        decoded = self._decode_all([blobs[j] for j in todo], [plans[j] for j in todo], device)
        windows = self.windows
        order = self.stream_order(device)
        writer = order.current_stream(device) if order is not None and self.cache is not None else None
        for j, image in zip(todo, decoded):
            if image is None:
                self.rejected.add(int(kept[j]))
                on_cpu.add(j)
                continue
            hwc = image.permute(1, 2, 0)   # HWC view
            images[j] = hwc
            if windows:
                plans[j] = window_plan(plans[j])
            elif self.cache is not None:
                self.cache.put(int(kept[j]), hwc.contiguous(), writer)
        keep = []
        for j in range(n):
            if blobs[j].numel() == 0:
                keep.append(j)
                continue
            try:
                if j in on_cpu:
                    self._cpu_finish(blobs[j], plans[j], out[j], device)
                else:
                    found = images[j]
                    assert found is not None
                    out[j].copy_(jpeg.finish_crop(found, plans[j], s))
            except jpeg.CorruptImage:
                corrupt = [*corrupt, paths[j]]
                continue
            keep.append(j)
        if len(keep) < n:
            rows = torch.tensor(keep, dtype=torch.int64)
            out, y = out[rows.to(device)], y[rows]
        return out.permute(0, 3, 1, 2), y, corrupt


# Whether `data.decode: auto` decodes JPEG folders on the GPU where it can. Off until a GPU check has run the
# decode tests and the loader (make gpu-check) and docs/gpu.md records them passing; turning it on is this one
# line, with that evidence in its commit.
AUTO_ON_CUDA = False


def check_decode(choice: str, dataset: str) -> bool:
    """`data.decode` resolved: True for GPU decoding. `gpu` where it cannot run is one sentence; `auto` takes
    the GPU for JPEG folders where it can run once `AUTO_ON_CUDA` is set, and until then decodes on the CPU,
    saying so in one line where the GPU could have."""
    if choice == "cpu" or dataset != "imagefolder":   # gpu with another data set: refused by DataConfig.validate
        return False
    why = gpu_decoder_available()
    if why is not None:
        if choice == "gpu":
            raise UserError(f"data.decode is gpu but {why}; set data.decode to cpu or auto.")
        return False
    if choice == "auto" and not AUTO_ON_CUDA:
        if os.environ.get("RANK", "0") == "0":
            print("largebatch: data.decode auto decodes JPEGs on the CPU until a GPU check has verified GPU decoding "
                  "(docs/gpu.md); set data.decode=gpu to decode on the GPU.", file=sys.stderr, flush=True)
        return False
    return True
