"""`largebatch bench data` pieces: the DCT scale follows the crop, the plain baseline is torchvision's
transform (box rules, ToTensor + Normalize), and the command runs end to end on a tiny ImageFolder."""
from __future__ import annotations

import io
import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from largebatch.commands.bench import data as bench
from largebatch.data import jpeg
from largebatch.errors import UserError

pytestmark = pytest.mark.timeout(120)


def test_dct_factor_follows_the_crop_not_the_image():
    # A 1600 x 1200 photo: a small crop needs full-size decoding, a large one can use 1/2 or 1/4.
    assert jpeg.dct_factor(1200, 1600, (0, 0, 300, 300), 224) == 1
    assert jpeg.dct_factor(1200, 1600, (0, 0, 460, 500), 224) == 2
    assert jpeg.dct_factor(1200, 1600, (0, 0, 900, 1000), 224) == 4
    assert jpeg.dct_factor(1200, 1600, (0, 0, 1200, 1600), 128) == 8
    # ImageNet-size 500 x 375: even the whole image is < 2 x 224 tall, so never reduced.
    assert jpeg.dct_factor(375, 500, (0, 0, 375, 500), 224) == 1


def test_reduced_scale_decode_matches_full_scale():
    """A crop decoded at 1/4 scale and resized equals the full-scale decode + resize within a few levels."""
    img = bench.natural_image(3, 1024, 768)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    size, seed, epoch = 96, 0, 0
    index = next(i for i in range(500)  # an image index whose random box allows 1/4 scale
                 if jpeg.dct_factor(768, 1024, jpeg.rrc_box(768, 1024, 0.08, seed, epoch, i), size) == 4)
    out = torch.empty((size, size, 3), dtype=torch.uint8)
    jpeg.decode_crop(data, size, train=True, min_scale=0.08, seed=seed, epoch=epoch, index=index, out=out)
    top, left, ch, cw = (int(round(v)) for v in jpeg.rrc_box(768, 1024, 0.08, seed, epoch, index))
    full = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))[top:top + ch, left:left + cw])
    ref = F.interpolate(full.permute(2, 0, 1)[None].float(), size=(size, size), mode="bilinear", antialias=True)[0]
    if jpeg.flip_bit(seed, epoch, index):
        ref = ref.flip(2)
    err = (out.permute(2, 0, 1).float() - ref).abs()
    assert err.mean() < 3 and err.max() < 50  # measured 1.3 and 24: pixel noise is what 1/4 scale blurs


def test_baseline_crop_box_is_torchvisions():
    random.seed(0)
    for _ in range(300):
        top, left, ch, cw = bench.rrc_params(500, 375, 0.08)
        assert 0 <= top <= 375 - ch and 0 <= left <= 500 - cw
        assert 0.08 * 0.97 <= ch * cw / (500 * 375) <= 1.0
        assert 3 / 4 * 0.97 <= cw / ch <= 4 / 3 * 1.03
    # No trial fits a 1000 x 10 strip: centre crop with the ratio clamped to 4/3.
    assert bench.rrc_params(1000, 10, 0.08) == (0, (1000 - 13) // 2, 10, 13)


def test_baseline_outputs_normalised_float(tmp_path):
    path = tmp_path / "gray.jpg"
    Image.fromarray(np.full((60, 80, 3), 124, np.uint8)).save(path, "JPEG", quality=95)
    x, y = bench.PlainPillow([str(path)], [7], 32, 0.08)[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == 7
    expect = [(124 / 255 - m) / s for m, s in zip(bench.IMAGENET_MEAN, bench.IMAGENET_STD)]
    for c in range(3):
        assert math.isclose(x[c].mean().item(), expect[c], abs_tol=0.03)


def test_bench_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench.main(["--images", "16", "--batch", "8", "--workers", "0", "--passes", "1", "--width", "96",
                       "--height", "72", "--size", "32", "--stage-images", "4", "--no-memory",
                       "--dir", str(tmp_path / "imgs"), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["images"] == 16 and r["images_per_s"] > 0 and r["plain_images_per_s"] > 0
    assert r["cpu_images_per_s"] > 0 and r["stage_ms_per_image"]["largebatch"]["total"] > 0
    assert "speedup" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"--images is 4; give at least --batch \(8\)"):
        bench.main(["--images", "4", "--batch", "8"])


def test_generated_tree_is_the_same_from_one_process_or_several_and_leaves_no_partial_file(tmp_path):
    one, many = tmp_path / "one", tmp_path / "many"
    bench.write_imagefolder(one, 70, width=40, height=30, processes=1)
    bench.write_imagefolder(many, 70, width=40, height=30, processes=2)
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert len(files) == 70 + 10
    assert files == sorted(p.relative_to(many) for p in many.rglob("*") if p.is_file())   # no temporary file left
    assert all((one / f).read_bytes() == (many / f).read_bytes() for f in files)
    # an existing file is kept, not regenerated
    kept = many / files[0]
    kept.write_bytes(b"mine")
    bench.write_imagefolder(many, 70, width=40, height=30, processes=2)
    assert kept.read_bytes() == b"mine"
