"""Random-resized-crop and centre-crop straight from JPEG bytes, uint8 throughout.

Random-resized-crop (Szegedy et al., "Going deeper with convolutions", 2015; the
torchvision algorithm) and the evaluation resize + centre-crop, with decoding done at
the smallest JPEG DCT scale that still has enough pixels for the crop:

1. Read the JPEG header only (size, colour space) with simplejpeg.
2. Choose the crop box in original pixels. Train: up to 10 trials of area fraction
   ``U(min_scale, 1)`` and log-aspect ``U(log 3/4, log 4/3)``; the first box that fits
   is taken at a uniform position; else the centre crop with the ratio clamped. Eval:
   the square box that "resize the shorter side to round(S / 0.875), centre-crop S"
   maps back to (one resize instead of two). Every draw is ``keyed_random.uniform``
   of ``(seed, epoch, image index, stream)``, so a worker count never changes a pixel.
3. DCT scaling: libjpeg-turbo can run the inverse DCT at 1/2, 1/4, 1/8 of the size,
   skipping most of the IDCT and colour conversion work. Take the largest such factor
   for which the box still has at least S x S decoded pixels. (The other eighths,
   7/8 .. 3/8, run without SIMD and measured slower than full size here, so only the
   power-of-two factors are used.)
4. Decode (grayscale JPEGs come out as RGB from libjpeg-turbo; CMYK/YCCK and non-JPEG
   files go through Pillow's ``draft`` + ``convert('RGB')``), fast IDCT and fast
   chroma upsampling on.
5. Resize the box to S x S with torch's uint8 bilinear antialiased kernel on the
   channels-last (HWC) pixels, and mirror it when the flip bit is set, writing into
   the batch buffer. The decoded array is never converted to float.

Any decode error (truncated, corrupt, not an image) raises ``CorruptImage``.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import simplejpeg
import torch
import torch.nn.functional as F
from PIL import Image

from largebatch.data import keyed_random

EVAL_CROP_FRACTION = 0.875
_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))
_STREAM_FLIP = 3
_STREAM_TRIAL = 16  # streams 16.. are the random-resized-crop trials (4 draws each)


class CorruptImage(Exception):
    """The file could not be decoded."""


Box = tuple[float, float, float, float]  # top, left, height, width in original pixels


def rrc_box(h: int, w: int, min_scale: float, seed: int, epoch: int, index: int) -> Box:
    """Step 2 (train): the random-resized-crop box of image `index`."""
    area = h * w
    for trial in range(10):
        s = _STREAM_TRIAL + 4 * trial
        frac = min_scale + (1.0 - min_scale) * keyed_random.uniform(seed, epoch, index, s)
        log_r = _LOG_RATIO[0] + (_LOG_RATIO[1] - _LOG_RATIO[0]) * keyed_random.uniform(seed, epoch, index, s + 1)
        ratio = math.exp(log_r)
        cw = int(round(math.sqrt(area * frac * ratio)))
        ch = int(round(math.sqrt(area * frac / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            top = int(keyed_random.uniform(seed, epoch, index, s + 2) * (h - ch + 1))
            left = int(keyed_random.uniform(seed, epoch, index, s + 3) * (w - cw + 1))
            return float(top), float(left), float(ch), float(cw)
    top, left, ch, cw = rrc_fallback(h, w)
    return float(top), float(left), float(ch), float(cw)


def rrc_fallback(h: int, w: int) -> tuple[int, int, int, int]:
    """Random-resized-crop's fallback after 10 misses (torchvision's): the centre crop with the aspect
    ratio clamped to [3/4, 4/3], as (top, left, height, width)."""
    in_ratio = w / h
    if in_ratio < 3 / 4:
        cw, ch = w, int(round(w / (3 / 4)))
    elif in_ratio > 4 / 3:
        ch, cw = h, int(round(h * (4 / 3)))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def eval_box(h: int, w: int, size: int) -> Box:
    """Step 2 (eval): resize shorter side to round(size/0.875), centre-crop size."""
    resize = round(size / EVAL_CROP_FRACTION)
    side = size * min(h, w) / resize  # the crop, measured in original pixels
    side = min(side, float(min(h, w)))
    return (h - side) / 2, (w - side) / 2, side, side


def flip_bit(seed: int, epoch: int, index: int) -> bool:
    return bool(keyed_random.hash32(seed, epoch, index, _STREAM_FLIP) & 1)


def dct_factor(h: int, w: int, box: Box, size: int) -> int:
    """Step 3: largest k in (8, 4, 2, 1) with the box still >= size decoded pixels."""
    _, _, ch, cw = box
    for k in (8, 4, 2):
        if ch / k >= size and cw / k >= size:
            return k
    return 1


def _decode(data: bytes, h: int, w: int, colorspace: str, k: int) -> np.ndarray:
    """Step 4: RGB HWC uint8 at 1/k scale (Pillow for CMYK/YCCK)."""
    if colorspace in ("CMYK", "YCCK"):
        return _decode_pillow(data, math.ceil(w / k), math.ceil(h / k))
    return simplejpeg.decode_jpeg(data, "RGB", fastdct=True, fastupsample=True,
                                  min_height=math.ceil(h / k), min_width=math.ceil(w / k), strict=True)


def _decode_pillow(data: bytes, min_w: int, min_h: int) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        img.draft("RGB", (min_w, min_h))
        return np.array(img.convert("RGB"))


@dataclass(frozen=True)
class CropPlan:
    """Steps 1-3 for one image: its size and colour space, the crop box, the DCT factor, the flip."""
    h: int
    w: int
    colorspace: str
    box: Box
    k: int
    flip: bool


def plan_crop(data: bytes, size: int, *, train: bool, min_scale: float, seed: int, epoch: int, index: int
              ) -> CropPlan:
    """Steps 1-3: read the header, draw the box and the flip bit, choose the DCT factor. The GPU decoder
    (largebatch/data/gpu_jpeg.py) plans with this same function, so both paths crop alike."""
    try:
        try:
            h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            with Image.open(io.BytesIO(data)) as img:  # not a JPEG: let Pillow try
                w, h = img.size
            colorspace = "CMYK"  # route through Pillow
    except (ValueError, OSError, SyntaxError, Image.DecompressionBombError) as err:
        raise CorruptImage(str(err)) from None
    if h < 1 or w < 1:
        raise CorruptImage(f"header gives a size of {w} x {h}")
    box = rrc_box(h, w, min_scale, seed, epoch, index) if train else eval_box(h, w, size)
    return CropPlan(h, w, colorspace, box, dct_factor(h, w, box, size), bool(train and flip_bit(seed, epoch, index)))


def crop_window(plan: CropPlan, height: int, width: int) -> tuple[int, int, int, int]:
    """The crop box in whole pixels (y0, x0, y1, x1) of the image decoded at `height` x `width` (any scale;
    the GPU decoder's window is this at full scale)."""
    sy, sx = height / plan.h, width / plan.w
    top, left, ch, cw = plan.box
    y0, x0 = int(top * sy), int(left * sx)
    return (y0, x0, max(y0 + 1, min(height, int(round((top + ch) * sy)))),
            max(x0 + 1, min(width, int(round((left + cw) * sx)))))


def finish_crop(pixels: torch.Tensor, plan: CropPlan, size: int) -> torch.Tensor:
    """Step 5 on HWC uint8 `pixels` (decoded at any scale, on any device): the S x S x 3 uint8 crop (an HWC
    view). On CPU torch's uint8 antialiased bilinear kernel; elsewhere the same filter in float32, rounded."""
    y0, x0, y1, x1 = crop_window(plan, pixels.shape[0], pixels.shape[1])
    crop = pixels[y0:y1, x0:x1].permute(2, 0, 1).unsqueeze(0)
    if crop.device.type == "cpu":
        crop = crop.contiguous(memory_format=torch.channels_last)
        res = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    else:
        res = F.interpolate(crop.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        res = res.round_().clamp_(0, 255).to(torch.uint8)
    res = res[0].permute(1, 2, 0)  # HWC view
    return res.flip(1) if plan.flip else res


def decode_crop(data: bytes, size: int, *, train: bool, min_scale: float, seed: int, epoch: int,
                index: int, out: torch.Tensor) -> None:
    """Steps 1-5 for one image: write the S x S x 3 uint8 result into `out` (HWC)."""
    plan = plan_crop(data, size, train=train, min_scale=min_scale, seed=seed, epoch=epoch, index=index)
    try:
        pixels = _decode(data, plan.h, plan.w, plan.colorspace, plan.k)   # step 4, at reduced scale
    except (ValueError, OSError, SyntaxError, Image.DecompressionBombError) as err:
        raise CorruptImage(str(err)) from None
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise CorruptImage(f"decoded to shape {pixels.shape}")
    out.copy_(finish_crop(torch.from_numpy(pixels), plan, size))
