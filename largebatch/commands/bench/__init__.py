"""Benchmarks (`largebatch bench ...`); `machine()` names the machine every figure was taken on."""
from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

import torch

FLAGS_OF_NOTE = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def machine(device: torch.device) -> str:
    """The machine in words: the GPU, or the CPU model, the vector flags that decide CPU speed and the core
    count; and torch's version."""
    version = torch.__version__.split("+")[0]
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, torch {version}"
    model, flags = platform.processor() or "CPU", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    noted = " ".join(f for f in FLAGS_OF_NOTE if f in flags) or "none of " + " ".join(FLAGS_OF_NOTE)
    gpu = "GPU not used" if torch.cuda.is_available() else "no GPU"
    return f"{model} (flags: {noted}), {len(os.sched_getaffinity(0))} cores, {gpu}, torch {version}"
