"""Write tests/assets/jpeg_corpus/: small valid JPEGs of the kinds a GPU JPEG decoder (nvJPEG, nvImageCodec) may
reject although the CPU path (libjpeg-turbo via simplejpeg, Pillow for CMYK/YCCK and other formats) decodes them,
plus a PNG named .jpg and a truncated JPEG. tests/unit/test_gpu_jpeg.py runs every file through both paths.

    .venv/bin/python scripts/make_jpeg_corpus.py     # rewrites the folder (the committed files are the reference)

Files (photo-like: gradients, a disc, mild noise; 40 x 48 to 120 x 96 pixels, a few KB each):
  baseline_420.jpg, baseline_422.jpg, baseline_444.jpg   baseline Huffman, chroma subsampling 4:2:0 / 4:2:2 / 4:4:4
  gray.jpg                                               one component (grayscale)
  progressive_420.jpg, progressive_gray.jpg              progressive (SOF2)
  restart_420.jpg                                        restart markers (DRI, RSTn) every 2 MCU rows
  subsampling_440.jpg, subsampling_411.jpg               4:4:0 and 4:1:1 (written by simplejpeg: Pillow cannot)
  cmyk.jpg                                               Adobe CMYK (APP14 transform 0), by Pillow
  ycck.jpg                                               Adobe YCCK (APP14 transform 2), by simplejpeg's CMYK encoder
                                                         (Pillow cannot write YCCK)
  exif_orientation_6.jpg                                 EXIF orientation 6 (rotate 90 CW to view; both paths ignore it)
  large_420.jpg                                          120 x 96: the CPU path decodes it DCT-scaled (1/2)
  png_named.jpg                                          a PNG file with a .jpg name
  truncated.jpg                                          large_420.jpg cut at 3/5: its header parses, its scan is
                                                         cut short (corrupt)
Not here (neither Pillow nor simplejpeg writes them): arithmetic-coded, 12-bit and lossless JPEGs.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import simplejpeg
from PIL import Image

OUT = Path(__file__).resolve().parent.parent / "tests" / "assets" / "jpeg_corpus"


def picture(h: int, w: int, seed: int) -> np.ndarray:
    """RGB uint8: colour gradients, a disc, mild noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    arr = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (w + h) + 60], -1)
    disc = (yy - h / 2) ** 2 + (xx - w / 3) ** 2 < (min(h, w) / 4) ** 2
    arr[disc] = (220, 60, 30)
    arr += rng.normal(0, 4, arr.shape)
    return np.clip(arr, 0, 255).astype(np.uint8)


def pillow(img: Image.Image, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=85, **kwargs)
    return buf.getvalue()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.jpg"):
        old.unlink()
    rgb = Image.fromarray(picture(40, 48, 0))
    files: dict[str, bytes] = {
        "baseline_420.jpg": pillow(rgb, subsampling="4:2:0"),
        "baseline_422.jpg": pillow(rgb, subsampling="4:2:2"),
        "baseline_444.jpg": pillow(rgb, subsampling="4:4:4"),
        "gray.jpg": pillow(Image.fromarray(picture(48, 40, 1)).convert("L")),
        "progressive_420.jpg": pillow(Image.fromarray(picture(64, 56, 2)), subsampling="4:2:0", progressive=True),
        "progressive_gray.jpg": pillow(Image.fromarray(picture(40, 48, 3)).convert("L"), progressive=True),
        "restart_420.jpg": pillow(Image.fromarray(picture(64, 48, 4)), subsampling="4:2:0", restart_marker_rows=2),
        "subsampling_440.jpg": simplejpeg.encode_jpeg(picture(48, 40, 5), 85, "RGB", "440"),
        "subsampling_411.jpg": simplejpeg.encode_jpeg(picture(40, 64, 6), 85, "RGB", "411"),
        "cmyk.jpg": pillow(Image.fromarray(picture(40, 48, 7)).convert("CMYK")),
        "ycck.jpg": simplejpeg.encode_jpeg(np.asarray(Image.fromarray(picture(48, 40, 8)).convert("CMYK")), 85,
                                           "CMYK", "420"),
        "large_420.jpg": pillow(Image.fromarray(picture(96, 120, 9)), subsampling="4:2:0"),
    }
    exif = Image.Exif()
    exif[0x0112] = 6   # Orientation: the picture is stored rotated; view it turned 90 degrees clockwise
    files["exif_orientation_6.jpg"] = pillow(Image.fromarray(picture(40, 56, 10)), exif=exif.tobytes())
    png = io.BytesIO()
    Image.fromarray(picture(40, 40, 11)).save(png, "PNG")
    files["png_named.jpg"] = png.getvalue()
    large = files["large_420.jpg"]
    files["truncated.jpg"] = large[:len(large) * 3 // 5]   # the header parses; the scan data stops early
    for name, data in files.items():
        (OUT / name).write_bytes(data)
    total = sum(len(d) for d in files.values())
    print(f"{len(files)} files, {total / 1024:.1f} KiB in {OUT}")


if __name__ == "__main__":
    main()
