"""JPEG decoding on the GPU (largebatch/data/gpu_jpeg.py), its CPU side: the workers plan every image's crop
exactly as the CPU path does (same box, same flip, same seed), the finishing step gives the CPU path's pixels
(bitwise where the CPU path decodes at full scale, with a real JPEG decoder, simplejpeg, standing in for nvJPEG
on this CPU machine), the decoded-image cache returns the same bytes and decodes each image once, a corrupt
image is dropped and named, and `data.decode gpu` where it cannot run is one sentence.

With fakes of torchvision's `decode_jpeg` and of nvImageCodec (their signatures and failure behaviour: torchvision
fails the whole batch for one image it rejects, nvImageCodec gives None for it) and of the CUDA stream calls
(`FakeOrder`): the order of the stream and event calls (item 5), nvImageCodec kept to its GPU back-ends and a
missing libnvjpeg said in one sentence (item 6), and a valid JPEG the GPU decoder rejects decoded by the CPU
path, over the corpus in tests/assets/jpeg_corpus (item 7). The GPU's own decoder is compared with the CPU path
in tests/integration/test_cuda.py."""
from __future__ import annotations

import contextlib
import enum
import itertools
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from largebatch.data import gpu_jpeg, jpeg
from largebatch.data.gpu_jpeg import (
    CudaOrder,
    GpuFinisher,
    NvImageCodecDecoder,
    PlanDecoder,
    PlannedBatch,
    TorchvisionDecoder,
    check_decode,
    crop_window,
    pick_decoder,
)
from largebatch.data.imagefolder import BatchDecoder
from largebatch.errors import UserError

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]
SIZE = 32
CORPUS = Path(__file__).resolve().parents[1] / "assets" / "jpeg_corpus"
CPU = torch.device("cpu")


def _images(root: Path) -> list[str]:
    """Photos-like JPEGs (smooth gradients plus noise) of many sizes and aspect ratios, some in grayscale and one
    CMYK; small ones decode at full scale on the CPU path (DCT factor 1), large ones at 1/2 to 1/8."""
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h) in enumerate([(40, 30), (33, 64), (48, 48), (50, 90), (64, 40), (120, 80), (300, 200),
                                (90, 260), (256, 256), (45, 45), (70, 35), (35, 70)]):
        yy, xx = np.mgrid[0:h, 0:w]
        arr = np.stack([(xx * 255 // w), (yy * 255 // h), ((xx + yy) * 127 // (w + h))], -1)
        arr = np.clip(arr + rng.integers(-20, 20, arr.shape), 0, 255).astype(np.uint8)
        img = Image.fromarray(arr)
        if i in (2, 9):
            img = img.convert("L")
        if i == 5:
            img = img.convert("CMYK")
        path = root / f"{i:02d}.jpg"
        img.save(path, "JPEG", quality=90)
        paths.append(str(path))
    return paths


def _cpu_decode(blobs, plans, device):
    """simplejpeg at full scale with the CPU path's flags, CHW as torchvision returns it."""
    return [torch.from_numpy(simplejpeg.decode_jpeg(b.numpy().tobytes(), "RGB", fastdct=True, fastupsample=True,
                                                    strict=True)).permute(2, 0, 1) for b in blobs]


class WindowDecode:
    """A window decoder as nvImageCodec is one (`windows`): the crop window of each image, here cut from
    simplejpeg's full-scale decode."""
    windows = True

    def __call__(self, blobs, plans, device):
        if plans is None:   # whole images asked for
            return _cpu_decode(blobs, plans, device)
        out = []
        for image, plan in zip(_cpu_decode(blobs, plans, device), plans):
            y0, x0, y1, x1 = crop_window(plan)
            out.append(image[:, y0:y1, x0:x1])
        return out


@pytest.mark.parametrize("train", [True, False])
def test_the_workers_plan_every_crop_as_the_cpu_path_does(tmp_path, train):
    paths = _images(tmp_path)
    labels = torch.arange(len(paths))
    planner = PlanDecoder(np.array(paths), labels, SIZE, 0.08, seed=7)
    for epoch in (0, 3):
        blobs, plans, ready, y, kept, names, corrupt = planner[(epoch, train, torch.arange(len(paths)))]
        assert corrupt == [] and kept.tolist() == list(range(len(paths))) and names == paths
        for i, plan in enumerate(plans):
            data = Path(paths[i]).read_bytes()
            want = jpeg.plan_crop(data, SIZE, train=train, min_scale=0.08, seed=7, epoch=epoch, index=i)
            assert plan == (want.h, want.w, want.colorspace, want.box, want.k, want.flip)
            assert want.flip == (train and jpeg.flip_bit(7, epoch, i))
        # the CMYK image was finished by the worker, the others travel as their file's bytes
        assert [b.numel() == 0 for b in blobs] == [i == 5 for i in range(len(paths))]
        assert bytes(blobs[0].numpy()) == Path(paths[0]).read_bytes()
    flips = [p[5] for p in planner[(0, True, torch.arange(len(paths)))][1]]
    assert 0 < sum(flips) < len(flips)   # both ways occur: the bit is drawn, not fixed


@pytest.mark.parametrize("train", [True, False])
def test_finishing_gives_the_cpu_paths_pixels(tmp_path, train):
    paths = _images(tmp_path)
    labels = torch.arange(len(paths))
    idx = torch.arange(len(paths))
    want, y_want, _ = BatchDecoder(np.array(paths), labels, SIZE, 0.08, seed=7)[(2, train, idx)]
    item = PlanDecoder(np.array(paths), labels, SIZE, 0.08, seed=7)[(2, train, idx)]
    got, y_got, corrupt = GpuFinisher(SIZE, 0.0, torch.device("cpu"), decode=_cpu_decode)(item)
    assert corrupt == [] and torch.equal(y_got, y_want) and got.shape == want.shape == (len(paths), 3, SIZE, SIZE)
    assert got.is_contiguous(memory_format=torch.channels_last)
    for i, plan in enumerate(item[1]):
        k = plan[4]
        if k == 1 or i == 5:   # the same decode at full scale (or the CPU path itself): the same bytes
            assert torch.equal(got[i], want[i]), i
        else:                  # full decode then resize, against a DCT-scaled decode: the same picture
            diff = (got[i].float() - want[i].float()).abs()
            assert diff.mean() < 4 and diff.max() < 64, (i, k, float(diff.mean()), float(diff.max()))
    assert sum(p[4] == 1 for p in item[1]) >= 4 and sum(p[4] > 1 for p in item[1]) >= 2   # both kinds were checked
    # a decoder of crop windows gives the same bytes as whole images cropped: the window is the box's pixels
    windowed, _, _ = GpuFinisher(SIZE, 0.0, torch.device("cpu"), decode=WindowDecode())(item)
    assert torch.equal(windowed, got)


def test_the_cache_returns_the_same_bytes_and_decodes_each_image_once(tmp_path):
    paths = _images(tmp_path)
    labels = torch.arange(len(paths))
    planner = PlanDecoder(np.array(paths), labels, SIZE, 0.08, seed=1)
    decoded: list[int] = []

    def counting(blobs, plans, device):
        decoded.append(len(blobs))
        return _cpu_decode(blobs, plans, device)

    cached = GpuFinisher(SIZE, 1.0, torch.device("cpu"), decode=counting)
    plain = GpuFinisher(SIZE, 0.0, torch.device("cpu"), decode=_cpu_decode)
    idx = torch.arange(len(paths))
    for epoch in range(3):
        item = planner[(epoch, True, idx)]
        a, _, _ = cached(item)
        b, _, _ = plain(item)
        assert torch.equal(a, b), epoch   # every epoch's new crops of the cached images: the same bytes
    assert decoded == [len(paths) - 1]   # the first epoch decoded the 11 JPEGs (the CMYK one is the worker's)
    assert cached.cache is not None and cached.cache.hits == 2 * (len(paths) - 1)
    # a budget that holds only some: the rest are decoded every time, and the bytes do not change
    small = GpuFinisher(SIZE, 40_000 / 2**30, torch.device("cpu"), decode=_cpu_decode)
    first, _, _ = small(planner[(0, False, idx)])
    again, _, _ = small(planner[(0, False, idx)])
    assert torch.equal(first, again)
    assert small.cache is not None and 0 < len(small.cache.images) < len(paths) - 1 and small.cache.used <= 40_000
    # with a cache a window decoder decodes whole images (to keep), and the bytes stay those of the plain path
    window_cached = GpuFinisher(SIZE, 1.0, torch.device("cpu"), decode=WindowDecode())
    assert not window_cached.windows
    a, _, _ = window_cached(planner[(0, True, idx)])
    assert torch.equal(a, plain(planner[(0, True, idx)])[0]) and len(window_cached.cache.images) == len(paths) - 1


def test_an_image_the_decoder_rejects_is_dropped_and_named(tmp_path):
    paths = _images(tmp_path)
    broken = Path(paths[3])
    broken.write_bytes(broken.read_bytes()[:400])   # the header parses, the scan data is cut
    labels = torch.arange(len(paths))
    item = PlanDecoder(np.array(paths), labels, SIZE, 0.08, seed=1)[(0, True, torch.arange(len(paths)))]
    x, y, corrupt = GpuFinisher(SIZE, 0.0, torch.device("cpu"), decode=_cpu_decode)(item)
    assert corrupt == [str(broken)]
    assert y.tolist() == [i for i in range(len(paths)) if i != 3] and x.shape[0] == len(paths) - 1




def test_only_the_images_decoded_on_the_cpu_travel_as_pixels_and_only_they_are_pinned(tmp_path, monkeypatch):
    """A planned batch carries one S x S x 3 row per image the worker decoded (the CMYK one), not one per image;
    the DataLoader's pin thread (torch's `pin_memory`, which calls a type's own `pin_memory`) pins those pixels and
    leaves the JPEG bytes as they are."""
    from torch.utils.data._utils.pin_memory import pin_memory

    paths = _images(tmp_path)
    item = PlanDecoder(np.array(paths), torch.arange(len(paths)), SIZE, 0.08, seed=1)[(0, True,
                                                                                      torch.arange(len(paths)))]
    assert item.ready.shape == (1, SIZE, SIZE, 3) and sum(b.numel() == 0 for b in item.blobs) == 1
    pinned: list[tuple] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: pinned.append(tuple(t.shape)) or t)
    assert isinstance(pin_memory(item), PlannedBatch)
    assert pinned == [(1, SIZE, SIZE, 3)]
    none_on_cpu = PlanDecoder(np.array(paths[:5]), torch.arange(5), SIZE, 0.08, seed=1)[(0, True, torch.arange(5))]
    assert none_on_cpu.ready.numel() == 0
    pin_memory(none_on_cpu)
    assert pinned == [(1, SIZE, SIZE, 3)]   # nothing to pin: no copy


def test_a_decoder_that_returns_fewer_images_than_asked_is_decoded_image_by_image(tmp_path):
    """nvImageCodec can return a shorter list than its request; zipping it with the request would shift every
    later image onto another's label. The batch is decoded one image at a time instead, with the same pixels."""
    paths = _images(tmp_path)
    item = PlanDecoder(np.array(paths), torch.arange(len(paths)), SIZE, 0.08, seed=1)[(0, True,
                                                                                      torch.arange(len(paths)))]
    calls: list[int] = []

    def short(blobs, plans, device):
        calls.append(len(blobs))
        out = _cpu_decode(blobs, plans, device)
        return out[1:] if len(out) > 1 else out   # drops the first image of a batch

    x, y, corrupt = GpuFinisher(SIZE, 0.0, CPU, decode=short)(item)
    want, y_want, _ = GpuFinisher(SIZE, 0.0, CPU, decode=_cpu_decode)(item)
    assert corrupt == [] and torch.equal(x, want) and torch.equal(y, y_want)
    assert calls[0] == len(paths) - 1 and calls[1:] == [1] * (len(paths) - 1)


# ------------------------------------------------------------------------------ fakes: CUDA streams, the decoders
class FakeStream:
    """A CUDA stream as torch.cuda.Stream shows it (`cuda_stream` handle, `wait_event`, `record_event`,
    `wait_stream`, `query`, `synchronize`), recording the calls in its order's log."""
    handles = itertools.count(0x7000)

    def __init__(self, name: str, order: FakeOrder) -> None:
        self.name, self.order, self.cuda_stream = name, order, next(self.handles)

    def wait_event(self, event) -> None:
        event.wait(self)

    def record_event(self, event=None):
        event = event or self.order.event()
        event.record(self)
        return event

    def wait_stream(self, stream) -> None:
        self.wait_event(stream.record_event())

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.order.log.append(("host waits for stream", self.name))


class FakeEvent:
    """torch.cuda.Event's documented API: `record(stream=None)` and `wait(stream=None)` (None: the current stream),
    `query`, `synchronize`, `elapsed_time` (made by FakeOrder.event(), which it logs to); records ('record' |
    'wait', event number, stream name). It orders nothing: see FakeOrder for what the fakes cannot show."""
    numbers = itertools.count(1)

    def __init__(self, order, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.order, self.number, self.recorded_on = order, next(self.numbers), None

    def record(self, stream=None) -> None:
        stream = stream or self.order.current
        self.recorded_on = stream
        self.order.log.append(("record", self.number, stream.name))

    def wait(self, stream=None) -> None:
        assert self.recorded_on is not None, "waiting for an event never recorded waits for nothing"
        self.order.log.append(("wait", self.number, (stream or self.order.current).name))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.order.log.append(("host waits for event", self.number))

    def elapsed_time(self, end_event) -> float:
        return 0.0


class FakeOrder(CudaOrder):
    """`CudaOrder` with fake streams and events, recording in `log`, in call order: the stream made, the stream
    made current and given back ('use', 'end use'), events recorded and waited for on which stream, tensors
    recorded on a stream ('keep'), and the fake decoders' calls with the stream current at each. `wait` is
    CudaOrder's own (event record, then wait).

    What it cannot show: that CUDA runs the kernels in the order these calls ask for, that torchvision and
    nvImageCodec order their internal streams as their source reads (tests/integration/test_cuda.py and scripts/gpu_check.sh
    run the real ones), that the caching allocator honours `record_stream`, or any race: on a CPU every call
    runs at once, in order."""

    def __init__(self) -> None:
        self.log: list = []
        self.made = 0
        self.current = FakeStream("default", self)

    def current_stream(self, device):
        return self.current

    def new_stream(self, device):
        self.made += 1
        stream = FakeStream(f"decode{self.made}", self)
        self.log.append(("new stream", stream.name))
        return stream

    def event(self):
        return FakeEvent(self)

    @contextlib.contextmanager
    def use(self, stream):
        before, self.current = self.current, stream
        self.log.append(("use", stream.name))
        try:
            yield stream
        finally:
            self.current = before
            self.log.append(("end use", stream.name))

    def keep(self, tensor, stream) -> None:
        self.log.append(("keep", stream.name))


def jpeg_frame(data: bytes) -> tuple[int, int, tuple[tuple[int, int], ...]] | None:
    """(SOF marker, sample precision, each component's (h, v) sampling factors) of a JPEG; None for no JPEG."""
    if data[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:   # fill byte
            i += 1
            continue
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):   # SOF0-15 (not DHT, JPG, DAC)
            seg = data[i + 4:i + 2 + length]
            return marker, seg[0], tuple((seg[7 + 3 * c] >> 4, seg[7 + 3 * c] & 15) for c in range(seg[5]))
        i += 2 + length
    return None


NVJPEG_SAMPLING = {((1, 1),), ((1, 1),) * 3, ((2, 1), (1, 1), (1, 1)), ((2, 2), (1, 1), (1, 1))}


def nvjpeg_takes(data: bytes) -> bool:
    """The fake GPU decoders' rule, the strictest of nvJPEG's versions and back-ends: a sequential Huffman JPEG
    (SOF0 or SOF1: not progressive, lossless, hierarchical or arithmetic-coded), 8-bit, grayscale or 3 components
    at 4:4:4, 4:2:2 or 4:2:0 (not 4:4:0, 4:1:1, CMYK or YCCK) that decodes (not truncated)."""
    frame = jpeg_frame(data)
    if frame is None or frame[0] not in (0xC0, 0xC1) or frame[1] != 8 or frame[2] not in NVJPEG_SAMPLING:
        return False
    try:
        simplejpeg.decode_jpeg(data, "RGB", fastdct=True, fastupsample=True, strict=True)
    except ValueError:
        return False
    return True


def _full(data: bytes) -> np.ndarray:
    """A JPEG at full scale with the CPU path's flags, HWC (what nvJPEG gives, to within the IDCT)."""
    return simplejpeg.decode_jpeg(data, "RGB", fastdct=True, fastupsample=True, strict=True)


def fake_torchvision(order: FakeOrder) -> dict[str, types.ModuleType]:
    """torchvision.io's `decode_jpeg(input, mode, device, apply_exif_orientation)` and `ImageReadMode` as of
    torchvision 0.19+: a list of CPU uint8 tensors in, a list of CHW uint8 tensors on `device` out; an image
    `nvjpeg_takes` refuses fails the whole call with RuntimeError (no partial results, as the real one). Logs
    ('decode_jpeg', current stream, images). What it cannot show: the real nvJPEG's rejections, its pixels
    (simplejpeg's here), its internal stream."""
    io_mod = types.ModuleType("torchvision.io")

    class ImageReadMode(enum.Enum):
        UNCHANGED, GRAY, GRAY_ALPHA, RGB, RGB_ALPHA = range(5)

    def decode_jpeg(input, mode=ImageReadMode.UNCHANGED, device="cpu", apply_exif_orientation=False):
        blobs = input if isinstance(input, list) else [input]
        assert all(b.device.type == "cpu" and b.dtype == torch.uint8 and b.dim() == 1 for b in blobs)
        assert mode == ImageReadMode.RGB and not apply_exif_orientation
        order.log.append(("decode_jpeg", order.current.name, len(blobs)))
        datas = [b.numpy().tobytes() for b in blobs]
        for i, data in enumerate(datas):
            if not nvjpeg_takes(data):
                raise RuntimeError(f"Error while decoding JPEG images: image {i} is not supported")
        out = [torch.from_numpy(_full(d)).permute(2, 0, 1).to(device) for d in datas]
        return out if isinstance(input, list) else out[0]

    io_mod.ImageReadMode, io_mod.decode_jpeg = ImageReadMode, decode_jpeg   # type: ignore[attr-defined]
    top = types.ModuleType("torchvision")
    top.io = io_mod   # type: ignore[attr-defined]
    return {"torchvision": top, "torchvision.io": io_mod}


def fake_nvimgcodec(nvjpeg_loads: bool = True) -> dict[str, types.ModuleType]:
    """nvidia.nvimgcodec as of 0.8/0.9: `Decoder(device_id, max_num_cpu_threads, backends, options)`,
    `Backend(backend_kind, load_hint, load_hint_policy)`, `BackendKind`, `CodeStream(array)` with
    `get_sub_code_stream(image_idx, region)`, `Region(start_y, start_x, end_y, end_x)`,
    `DecodeParams(apply_exif_orientation, color_spec, allow_any_depth)`, and `decode(srcs, *, images, params,
    cuda_stream)` returning a list with None where an image could not be decoded. Its JPEG back-ends, as the
    real ones: HW_GPU_ONLY and HYBRID_CPU_GPU (nvJPEG, here `nvjpeg_takes`; none without libnvjpeg,
    `nvjpeg_loads`), CPU_ONLY (libjpeg-turbo: everything, on the CPU); all when `backends` is None. The calls
    are kept in the module's `calls`.

    What it cannot show: which of the real back-ends takes an image (hardware or CUDA), that the real one finds
    libnvjpeg where the wheel puts it, its pixels (simplejpeg's here; the windows cut from the full decode) and
    its streams (its Image is a host numpy array; the real one is device memory, `__cuda_array_interface__`)."""
    nv = types.ModuleType("nvidia.nvimgcodec")
    nv.__version__ = "0.9.0"   # type: ignore[attr-defined]
    calls: list = []

    class BackendKind(enum.Enum):
        CPU_ONLY, GPU_ONLY, HYBRID_CPU_GPU, HW_GPU_ONLY = 1, 2, 3, 4

    class LoadHintPolicy(enum.Enum):
        IGNORE, FIXED, ADAPTIVE_MINIMIZE_IDLE_TIME = 1, 2, 3

    class Backend:
        def __init__(self, backend_kind=BackendKind.GPU_ONLY, load_hint=1.0, load_hint_policy=LoadHintPolicy.FIXED):
            self.backend_kind, self.load_hint, self.load_hint_policy = backend_kind, load_hint, load_hint_policy

    class Region:
        def __init__(self, start_y, start_x, end_y, end_x, out_of_bounds_sample=None):
            self.start, self.end = (start_y, start_x), (end_y, end_x)

    class CodeStream:
        def __init__(self, array, bitstream_offset=0, limit_images=0):
            self.data = bytes(array)
            self.region = None

        def get_sub_code_stream(self, image_idx=0, region=None, bitstream_offset=0, limit_images=0):
            sub = CodeStream(self.data)
            sub.region = region
            return sub

    class DecodeParams:
        def __init__(self, apply_exif_orientation=True, color_spec="SRGB", allow_any_depth=False):
            self.apply_exif_orientation, self.color_spec = apply_exif_orientation, color_spec

    class Image(np.ndarray):
        """HWC uint8, as nvimgcodec.Image's shape is."""

    class Decoder:
        def __init__(self, device_id=-1, max_num_cpu_threads=0, backends=None, options=":fancy_upsampling=0"):
            calls.append(("Decoder", dict(device_id=device_id, max_num_cpu_threads=max_num_cpu_threads,
                                          backends=backends, options=options)))
            self.kinds = set(BackendKind) if backends is None else {b.backend_kind for b in backends}

        def decode(self, srcs, *, images=None, params=None, cuda_stream=0):
            calls.append(("decode", len(srcs), cuda_stream, params))
            gpu = nvjpeg_loads and bool(self.kinds & {BackendKind.HW_GPU_ONLY, BackendKind.HYBRID_CPU_GPU})
            out = []
            for src in srcs:
                if gpu and nvjpeg_takes(src.data):
                    pixels = _full(src.data)
                elif BackendKind.CPU_ONLY in self.kinds:   # libjpeg-turbo on the CPU, saying nothing
                    try:
                        pixels = _full(src.data)
                    except ValueError:
                        out.append(None)
                        continue
                else:
                    out.append(None)
                    continue
                if src.region is not None:
                    (y0, x0), (y1, x1) = src.region.start, src.region.end
                    pixels = pixels[y0:y1, x0:x1]
                out.append(np.ascontiguousarray(pixels).view(Image))
            return out

    for cls in (BackendKind, LoadHintPolicy, Backend, Region, CodeStream, DecodeParams, Image, Decoder):
        setattr(nv, cls.__name__, cls)
    nv.calls = calls   # type: ignore[attr-defined]
    top = types.ModuleType("nvidia")
    top.nvimgcodec = nv   # type: ignore[attr-defined]
    return {"nvidia": top, "nvidia.nvimgcodec": nv}


@pytest.fixture
def said(monkeypatch):
    """gpu_jpeg's once-per-process messages, unsaid."""
    monkeypatch.setattr(gpu_jpeg, "_said", set())


def _install(monkeypatch, modules: dict) -> None:
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


# ------------------------------------------------------------------------------ 5: stream order
def test_torchvision_decodes_on_a_stream_of_ours_that_the_batch_stream_waits_for(tmp_path, monkeypatch):
    paths = _images(tmp_path)
    order = FakeOrder()
    _install(monkeypatch, fake_torchvision(order))
    order.current = FakeStream("side", order)   # layout.prefetch's side stream: the batch is made (and used) there
    planner = PlanDecoder(np.array(paths), torch.arange(len(paths)), SIZE, 0.08, seed=1)
    finisher = GpuFinisher(SIZE, 0.0, CPU, decode=TorchvisionDecoder(order), order=order)
    item = planner[(0, True, torch.arange(len(paths)))]
    x, _, corrupt = finisher(item)
    assert corrupt == [] and torch.equal(x, GpuFinisher(SIZE, 0.0, CPU, decode=_cpu_decode)(item)[0])
    n = len(paths) - 1   # the CMYK one is the worker's
    one_batch = [("use", "decode1"), ("decode_jpeg", "decode1", n), ("end use", "decode1"),
                 # after the decode: an event on the decode stream, waited for by the batch's stream, before the
                 # finishing kernels; each image recorded on the batch's stream for the caching allocator
                 ("record", None, "decode1"), ("wait", None, "side"), *[("keep", "side")] * n]

    def unnumbered(log):
        return [(e[0], None, e[2]) if e[0] in ("record", "wait") else e for e in log]

    assert unnumbered(order.log) == [("new stream", "decode1"), *one_batch]
    records = [e for e in order.log if e[0] in ("record", "wait")]
    assert records[0][1] == records[1][1]   # the event waited for is the one recorded
    order.log.clear()
    finisher(planner[(1, True, torch.arange(len(paths)))])   # the decode stream is made once
    assert unnumbered(order.log) == one_batch
    # a batch with an image the decoder rejects: torchvision fails the call, then each image is decoded on its own,
    # every call on the decode stream and waited for; nothing waits for a call that failed
    Path(paths[3]).write_bytes((CORPUS / "progressive_420.jpg").read_bytes())
    order.log.clear()
    finisher(planner[(2, True, torch.arange(len(paths)))])
    log = unnumbered(order.log)
    assert log[:3] == [("use", "decode1"), ("decode_jpeg", "decode1", n), ("end use", "decode1")]
    calls = [i for i, e in enumerate(log) if e[0] == "decode_jpeg"]
    assert len(calls) == 1 + n and all(log[i - 1] == ("use", "decode1") for i in calls)
    ok = [i for i in calls[1:] if log[i + 2] == ("record", None, "decode1")]
    assert len(ok) == n - 1 and all(log[i + 3:i + 5] == [("wait", None, "side"), ("keep", "side")] for i in ok)
    assert not any(e[0].startswith("host waits") for e in order.log)   # no host sync added


def test_nvimagecodec_decodes_in_the_order_of_the_batch_stream(tmp_path, monkeypatch, said):
    paths = _images(tmp_path)
    modules = fake_nvimgcodec()
    _install(monkeypatch, modules)
    order = FakeOrder()
    order.current = side = FakeStream("side", order)
    decoder = NvImageCodecDecoder(CPU, order)
    item = PlanDecoder(np.array(paths), torch.arange(len(paths)), SIZE, 0.08, seed=1)[(0, True, torch.arange(12))]
    x, _, corrupt = GpuFinisher(SIZE, 0.0, CPU, decode=decoder, order=order)(item)
    assert corrupt == [] and torch.equal(x, GpuFinisher(SIZE, 0.0, CPU, decode=WindowDecode())(item)[0])
    decodes = [c for c in modules["nvidia.nvimgcodec"].calls if c[0] == "decode"]   # type: ignore[attr-defined]
    # the probe and the batch, each on the batch's stream: nvImageCodec allocates there and orders its own streams
    # against it (its pre/post sync), so no event of ours is needed
    assert [(c[1], c[2]) for c in decodes] == [(1, side.cuda_stream), (len(paths) - 1, side.cuda_stream)]
    assert order.log == []


def test_a_cached_image_read_on_another_stream_waits_for_the_stream_that_wrote_it(tmp_path):
    paths = _images(tmp_path)
    order = FakeOrder()
    planner = PlanDecoder(np.array(paths), torch.arange(len(paths)), SIZE, 0.08, seed=1)
    cached = GpuFinisher(SIZE, 1.0, CPU, decode=_cpu_decode, order=order)
    idx = torch.arange(len(paths))
    order.current = side = FakeStream("side", order)   # training: the cache is filled on prefetch's side stream
    cached(planner[(0, True, idx)])
    assert order.log == [] and set(cached.cache.streams.values()) == {side}
    cached(planner[(1, True, idx)])   # read on the stream that wrote it: stream order suffices
    assert order.log == []
    order.current = FakeStream("default", order)   # e.g. the Collapsed Ensemble's pass on the default stream
    cached(planner[(2, True, idx)])
    n = len(paths) - 1
    assert [e[0] for e in order.log] == ["record", "wait", *["keep"] * n]   # one event for the batch's hits
    assert order.log[0][2] == "side" and order.log[1][2] == "default" and order.log[0][1] == order.log[1][1]


# ------------------------------------------------------------------------------ 6: nvImageCodec's back-ends
def test_nvimagecodec_decodes_on_its_gpu_back_ends_alone_with_two_cpu_threads(tmp_path, monkeypatch, capsys, said):
    modules = fake_nvimgcodec()
    nv = modules["nvidia.nvimgcodec"]
    _install(monkeypatch, modules)
    order = FakeOrder()
    decoder = pick_decoder("auto", torch.device("cuda", 1), order)
    pick_decoder("nvimgcodec", torch.device("cuda", 1), order)
    assert isinstance(decoder, NvImageCodecDecoder)
    made = [c[1] for c in nv.calls if c[0] == "Decoder"]   # type: ignore[attr-defined]
    assert len(made) == 2 and made[0]["device_id"] == 1 and made[0]["max_num_cpu_threads"] == 2
    kinds = [b.backend_kind for b in made[0]["backends"]]
    assert kinds == [nv.BackendKind.HW_GPU_ONLY, nv.BackendKind.GPU_ONLY, nv.BackendKind.HYBRID_CPU_GPU]
    assert made[0]["options"] == ":fancy_upsampling=0" and decoder.params.apply_exif_orientation is False
    err = capsys.readouterr().err
    assert err == ("largebatch: GPU JPEG decoding with nvImageCodec 0.9.0, back-ends HW_GPU_ONLY, GPU_ONLY, "
                   "HYBRID_CPU_GPU (2 CPU threads); an image they reject is decoded by the CPU path.\n")   # once
    # a valid JPEG its GPU back-ends reject comes back None (for the CPU path), where nvImageCodec's default back-ends
    # would decode it on the CPU, saying nothing
    progressive = torch.frombuffer(bytearray((CORPUS / "progressive_420.jpg").read_bytes()), dtype=torch.uint8)
    assert decoder([progressive], None, CPU) == [None]
    default = nv.Decoder()   # type: ignore[attr-defined]
    assert default.decode([nv.CodeStream(progressive.numpy())])[0] is not None   # type: ignore[attr-defined]


def test_nvimagecodec_without_libnvjpeg_is_one_sentence_and_auto_takes_torchvision_once(monkeypatch, capsys, said):
    _install(monkeypatch, fake_nvimgcodec(nvjpeg_loads=False))
    order, cuda = FakeOrder(), torch.device("cuda", 0)
    with pytest.raises(UserError, match=r"^data.gpu_decoder is nvimgcodec but nvImageCodec decodes no JPEG on the GPU "
                                        r"here, as libnvjpeg does not load; install the nvidia-nvjpeg wheel "
                                        r"\(make gpu-wheels\), or set data.gpu_decoder to torchvision.$"):
        pick_decoder("nvimgcodec", cuda, order)
    assert capsys.readouterr().err == ""
    assert isinstance(pick_decoder("auto", cuda, order), TorchvisionDecoder)
    assert isinstance(pick_decoder("auto", cuda, order), TorchvisionDecoder)
    assert capsys.readouterr().err == ("largebatch: nvImageCodec decodes no JPEG on the GPU here (libnvjpeg does not "
                                       "load: the nvidia-nvjpeg wheel); JPEGs are decoded whole by torchvision's "
                                       "nvJPEG.\n")   # once
    # not installed at all: as before
    _install(monkeypatch, {"nvidia": None, "nvidia.nvimgcodec": None})
    with pytest.raises(UserError, match=r"^data.gpu_decoder is nvimgcodec but it does not load here "
                                        r"\(ModuleNotFoundError: .*; install the nvidia-nvimgcodec-cu13 wheel"):
        pick_decoder("nvimgcodec", cuda, order)


# ------------------------------------------------------------------------------ 7: CPU fallback
@pytest.mark.parametrize("decoder", ["torchvision", "nvimgcodec"])
def test_a_valid_jpeg_the_gpu_decoder_rejects_is_decoded_by_the_cpu_path(tmp_path, monkeypatch, said, decoder):
    paths = _images(tmp_path)
    for i, name in ((4, "progressive_420.jpg"), (7, "subsampling_411.jpg")):   # valid, and rejected by the fakes
        Path(paths[i]).write_bytes((CORPUS / name).read_bytes())
    order = FakeOrder()
    _install(monkeypatch, {**fake_torchvision(order), **fake_nvimgcodec()})
    gpu = TorchvisionDecoder(order) if decoder == "torchvision" else NvImageCodecDecoder(CPU, order)
    asked: list[int] = []

    def counting(blobs, plans, device):
        asked.extend(b.numel() for b in blobs)
        return gpu(blobs, plans, device)

    counting.windows = gpu.windows   # type: ignore[attr-defined]
    labels, idx = torch.arange(len(paths)), torch.arange(len(paths))
    finisher = GpuFinisher(SIZE, 0.0, CPU, decode=counting, order=order)
    planner = PlanDecoder(np.array(paths), labels, SIZE, 0.08, seed=1)
    cpu = BatchDecoder(np.array(paths), labels, SIZE, 0.08, seed=1)
    for epoch in (0, 1):
        asked.clear()
        x, y, corrupt = finisher(planner[(epoch, True, idx)])
        want, y_want, _ = cpu[(epoch, True, idx)]
        assert corrupt == [] and torch.equal(y, y_want), epoch
        for i in (4, 7):   # the CPU path's own pixels: bitwise
            assert torch.equal(x[i], want[i]), (epoch, i)
        assert finisher.cpu_fallbacks == 2 * (epoch + 1) and finisher.rejected == {4, 7}
        if epoch == 1:   # remembered: the GPU decoder is not asked again
            sizes = {Path(paths[i]).stat().st_size for i in (4, 7)}
            assert len(asked) == len(paths) - 3 and not sizes & set(asked)
    # an image the CPU path rejects too is corrupt, as before
    broken = Path(paths[3])
    broken.write_bytes(broken.read_bytes()[:400])
    x, y, corrupt = finisher(planner[(2, True, idx)])
    assert corrupt == [str(broken)] and 3 not in y.tolist() and finisher.cpu_fallbacks == 6


def _corpus_tree(tmp_path) -> list[str]:
    paths = []
    for src in sorted(CORPUS.glob("*.jpg")):
        dst = tmp_path / src.name
        dst.write_bytes(src.read_bytes())
        paths.append(str(dst))
    return paths


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("decoder", ["torchvision", "nvimgcodec"])
def test_every_corpus_file_comes_out_of_the_gpu_path_as_out_of_the_cpu_path(tmp_path, monkeypatch, said, decoder,
                                                                             train):
    """Every file of tests/assets/jpeg_corpus through PlanDecoder + GpuFinisher with the real decoder classes over
    the fakes (which reject what `nvjpeg_takes` refuses) against the CPU path: the same files come out (the PNG
    named .jpg is decoded by both, through Pillow; the truncated JPEG is corrupt in both), with the CPU path's
    pixels (bitwise at full scale and for CPU-decoded images, within the IDCT tolerance when the CPU path scales
    the DCT), and the valid JPEGs the GPU decoder rejects are CPU fallbacks."""
    paths = _corpus_tree(tmp_path)
    names = [Path(p).name for p in paths]
    order = FakeOrder()
    _install(monkeypatch, {**fake_torchvision(order), **fake_nvimgcodec()})
    gpu = TorchvisionDecoder(order) if decoder == "torchvision" else NvImageCodecDecoder(CPU, order)
    labels, idx = torch.arange(len(paths)), torch.arange(len(paths))
    want, y_want, corrupt_want = BatchDecoder(np.array(paths), labels, SIZE, 0.08, seed=5)[(3, train, idx)]
    item = PlanDecoder(np.array(paths), labels, SIZE, 0.08, seed=5)[(3, train, idx)]
    finisher = GpuFinisher(SIZE, 0.0, CPU, decode=gpu, order=order)
    got, y_got, corrupt_got = finisher(item)
    assert corrupt_got == corrupt_want == [str(tmp_path / "truncated.jpg")]
    assert torch.equal(y_got, y_want) and got.shape == want.shape
    blobs, plans = item[0], item[1]
    on_worker = {names[i] for i, b in zip(item[4].tolist(), blobs) if b.numel() == 0}
    assert on_worker == {"cmyk.jpg", "ycck.jpg", "png_named.jpg"}
    rejected = {names[i] for i in finisher.rejected}
    assert rejected == {"progressive_420.jpg", "progressive_gray.jpg", "subsampling_440.jpg", "subsampling_411.jpg",
                        "truncated.jpg"}
    assert finisher.cpu_fallbacks == 4   # the valid ones; the truncated one is corrupt
    for row, i in enumerate(y_got.tolist()):
        bitwise = plans[row][4] == 1 or names[i] in on_worker or i in finisher.rejected
        if bitwise:
            assert torch.equal(got[row], want[row]), names[i]
        else:
            diff = (got[row].float() - want[row].float()).abs()
            assert diff.mean() < 4 and diff.max() < 64, (names[i], float(diff.mean()), float(diff.max()))
    assert any(p[4] > 1 for p in plans) or train   # the DCT-scaled comparison ran (large_420.jpg, eval)


def test_decode_auto_stays_on_the_cpu_until_a_gpu_check_verifies_gpu_decoding(monkeypatch, capsys):
    """Where GPU decoding could run (a CUDA device and torchvision, faked here), auto still decodes on the CPU and
    says how to turn the GPU on; `gpu` takes it; the one-line switch `AUTO_ON_CUDA` makes auto take it."""
    from largebatch.data import gpu_jpeg

    monkeypatch.setattr(gpu_jpeg, "gpu_decoder_available", lambda: None)
    assert check_decode("auto", "imagefolder") is False
    assert "set data.decode=gpu to decode on the GPU" in capsys.readouterr().err
    assert check_decode("gpu", "imagefolder") is True
    monkeypatch.setattr(gpu_jpeg, "AUTO_ON_CUDA", True)
    assert check_decode("auto", "imagefolder") is True
