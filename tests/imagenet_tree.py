"""Miniature ImageNet trees in the exact layouts users have (real JPEGs written with Pillow):

- `ilsvrc(root)`: ILSVRC2012 as Kaggle ships it: root/ILSVRC/Data/CLS-LOC/train/<wnid>/<wnid>_<n>.JPEG (upper-case
  extension; one PNG and one CMYK JPEG among them, as ImageNet has), a flat root/ILSVRC/Data/CLS-LOC/val/
  ILSVRC2012_val_<8 digits>.JPEG, and root/LOC_val_solution.csv (ImageId,PredictionString) three folders above
  data.root. Also a hidden .ipynb_checkpoints folder in train/ and a nested folder inside one class.
Returns data.root (…/CLS-LOC) and the class names by label.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

WNIDS = ["n01440764", "n01443537", "n01484850"]


def _image(path: Path, k: int, i: int, fmt: str = "JPEG", mode: str = "RGB") -> None:
    """Class k's images lean to one colour, so a model can learn them in a few steps."""
    rng = np.random.default_rng(1000 * k + i)
    arr = rng.integers(0, 80, (48 + 8 * (i % 3), 64, 3), dtype=np.uint8)
    arr[..., k % 3] += 150
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).convert(mode).save(path, fmt, **({"quality": 90} if fmt == "JPEG" else {}))


def ilsvrc(base: Path, per_class: int = 6, val_per_class: int = 2) -> tuple[Path, list[str]]:
    root = base / "ILSVRC" / "Data" / "CLS-LOC"
    for k, wnid in enumerate(WNIDS):
        for i in range(per_class):
            _image(root / "train" / wnid / f"{wnid}_{i}.JPEG", k, i)
    _image(root / "train" / WNIDS[0] / f"{WNIDS[0]}_png.JPEG", 0, 90, fmt="PNG")         # a PNG named .JPEG
    _image(root / "train" / WNIDS[1] / f"{WNIDS[1]}_cmyk.JPEG", 1, 91, mode="CMYK")     # a CMYK JPEG
    _image(root / "train" / WNIDS[2] / "extra" / f"{WNIDS[2]}_nested.JPEG", 2, 92)      # a nested folder
    _image(root / "train" / ".ipynb_checkpoints" / "x.JPEG", 0, 93)                     # not a class
    lines = ["ImageId,PredictionString"]
    n = 0
    for k, wnid in enumerate(WNIDS):
        for i in range(val_per_class):
            n += 1
            name = f"ILSVRC2012_val_{n:08d}"
            _image(root / "val" / f"{name}.JPEG", k, 500 + i)
            lines.append(f"{name},{wnid} 10 10 40 40 {wnid} 5 5 20 20")
    (base / "LOC_val_solution.csv").write_text("\n".join(lines) + "\n")
    return root, WNIDS
