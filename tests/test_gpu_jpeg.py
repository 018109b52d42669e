"""JPEG decoding on the GPU (largebatch/data/gpu_jpeg.py), its CPU side: the workers plan every image's crop
exactly as the CPU path does (same box, same flip, same seed), the finishing step gives the CPU path's pixels
(bitwise where the CPU path decodes at full scale, with a real JPEG decoder, simplejpeg, standing in for nvJPEG
on this CPU machine), the decoded-image cache returns the same bytes and decodes each image once, a corrupt
image is dropped and named, and `data.decode gpu` where it cannot run is one sentence. The GPU's own decoder
is compared with the CPU path in tests/test_cuda.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from largebatch import config
from largebatch.data import jpeg
from largebatch.data.gpu_jpeg import GpuFinisher, PlanDecoder, check_decode, crop_window
from largebatch.data.imagefolder import BatchDecoder
from largebatch.errors import UserError

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]
SIZE = 32


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


@pytest.mark.slow   # a subprocess or a process group: make test, not make test-fast
def test_data_decode_gpu_where_it_cannot_run_is_one_sentence(tmp_path, cli):
    if torch.cuda.is_available():
        pytest.skip("this machine can decode on the GPU; tests/test_cuda.py covers it")
    with pytest.raises(UserError, match=r"^data.decode is gpu but it needs a CUDA device; set data.decode to cpu "
                                        r"or auto.$"):
        check_decode("gpu", "imagefolder")
    assert check_decode("auto", "imagefolder") is False and check_decode("cpu", "imagefolder") is False
    with pytest.raises(UserError, match=r"^data.decode gpu decodes JPEG folders \(data.dataset imagefolder\), not "
                                        r"shards; set data.decode to cpu or auto.$"):
        config.load("fashion_mnist", ["data.dataset=shards", "data.decode=gpu"])
    with pytest.raises(UserError, match=r"^data.gpu_cache_gb is -1.0; give 0 \(off\) to 4096 GiB.$"):
        config.load("fashion_mnist", ["data.gpu_cache_gb=-1"])
    # and a whole run says it in one line, exit 2, before any work
    _images(tmp_path)
    for split in ("train/a", "train/b", "val/a"):
        (tmp_path / split).mkdir(parents=True)
        (tmp_path / split / "x.jpg").write_bytes((tmp_path / "00.jpg").read_bytes())
    proc = cli("train", "fashion_mnist", "--run-dir", tmp_path / "run", "--set", "data.dataset=imagefolder",
               "--set", f"data.root={tmp_path}", "--set", "data.decode=gpu", "--set", "train.max_steps=1")
    assert proc.returncode == 2 and "data.decode is gpu but it needs a CUDA device" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
