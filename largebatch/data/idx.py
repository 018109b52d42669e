"""Reader for the IDX format of MNIST and Fashion-MNIST (gzip or plain).

The layout (LeCun et al., http://yann.lecun.com/exdb/mnist/, "FILE FORMATS"):

1. Magic number: two zero bytes, one dtype code (0x08 = unsigned byte, 0x09 signed
   byte, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64), one byte with the number
   of dimensions.
2. One big-endian uint32 per dimension.
3. The data, row-major, big-endian, exactly prod(dims) * itemsize bytes.

Every check (magic, dtype code, dims, length) failing is a UserError that names the
file and the fix; the result is a CPU tensor (uint8 for images and labels).
"""
from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path

import numpy as np
import torch

from largebatch.errors import UserError

_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}
APT_HINT = "apt-get install -y dataset-fashion-mnist"


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise UserError(f"cannot read IDX file {path} ({err.strerror}); check the path and its permissions "
                        f"(Fashion-MNIST: {APT_HINT}).") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib.error):
            raise UserError(f"IDX file {path} is a truncated or corrupt gzip file; download it again "
                            f"(Fashion-MNIST: {APT_HINT} --reinstall).") from None
    return raw


def read_idx(path: str | Path) -> torch.Tensor:
    """Read one IDX file (steps 1-3) into a tensor of its dtype and dims."""
    path = Path(path)
    raw = _read_bytes(path)
    fix = f"replace the file (Fashion-MNIST: {APT_HINT} --reinstall)"
    # Step 1: magic number.
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise UserError(f"{path} is not an IDX file (bad magic number {raw[:4].hex() or 'empty'}); {fix}.")
    code, ndim = raw[2], raw[3]
    if code not in _DTYPES:
        raise UserError(f"{path} has unknown IDX dtype code 0x{code:02x}; {fix}.")
    if ndim == 0:
        raise UserError(f"{path} declares zero dimensions; {fix}.")
    # Step 2: dims.
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise UserError(f"{path} is truncated inside its header; {fix}.")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    # Step 3: data length must match the header exactly.
    dtype = _DTYPES[code]
    expected = header + math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "longer than its header says"
        raise UserError(f"{path} is {what} ({len(raw)} bytes, header says {expected}); {fix}.")
    array = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return torch.from_numpy(array.astype(dtype.newbyteorder("="), copy=True))


def find(root: Path, stem: str) -> Path:
    """`stem` or `stem.gz` in root, or a UserError with the install hint."""
    for name in (stem, stem + ".gz"):
        if (root / name).is_file():
            return root / name
    raise UserError(f"IDX file {root / stem}[.gz] is missing; install Fashion-MNIST with '{APT_HINT}' "
                    f"or point data.root at a directory with the MNIST-layout IDX files.")


def load_split(root: str | Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N x 1 x H x W uint8) and labels (N int64) of 'train' or 't10k'."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UserError(f"data.root {root} is a file, not a directory; set data.root to the directory that holds "
                        "the IDX files.")
    if not root.is_dir():
        raise UserError(f"IDX data directory {root} does not exist; install Fashion-MNIST with '{APT_HINT}' "
                        f"or set data.root to a directory with the IDX files.")
    images = read_idx(find(root, f"{split}-images-idx3-ubyte"))
    labels = read_idx(find(root, f"{split}-labels-idx1-ubyte"))
    if images.dtype != torch.uint8 or images.ndim != 3:
        raise UserError(f"{split} images in {root} must be uint8 N x H x W, got {images.dtype} {tuple(images.shape)}; "
                        f"use MNIST-layout image files.")
    if images.shape[0] == 0:
        raise UserError(f"{split} images in {root} hold 0 images; use IDX files with data in them.")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise UserError(f"{split} labels in {root} ({tuple(labels.shape)}) do not match the {images.shape[0]} images; "
                        f"use matching image and label files.")
    return images.unsqueeze(1).contiguous(), labels.to(torch.int64)
