"""The memory estimate against a real process's measured peak."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from largebatch import memory

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]


# The peak RSS of this process image: VmHWM, not getrusage's ru_maxrss, which Linux carries across execve from the
# forked parent (a pytest worker of a GB or more would be every child's peak).
PEAK_RSS = """
import sys, torch
from largebatch.models import build_model
torch.set_num_threads(1)
net = build_model("resnet50", 10, width=64, stem="imagenet")
net(torch.randint(0, 255, (int(sys.argv[1]), 3, 128, 128)).float()).float().sum().backward()
print(next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def test_the_estimate_per_image_is_within_20_percent_of_measured_memory():
    """ResNet-50 at 128 px in fp32 on the CPU: the growth of a forward and backward pass's peak RSS from 2 to 10
    images, against the estimate per image (saved activations, the backward's working set, the input)."""
    peaks = [int(subprocess.run([sys.executable, "-c", PEAK_RSS, str(b)], capture_output=True, text=True,
                                check=True, timeout=200).stdout) for b in (2, 10)]
    measured = (peaks[1] - peaks[0]) / 8
    with torch.device("meta"):
        from largebatch.models import build_model

        net = build_model("resnet50", 10, width=64, stem="imagenet")
    estimated, _ = memory.saved_bytes_per_image(net, 3, 128, "fp32")
    assert 0.8 <= estimated / measured <= 1.2, (estimated / 2**20, measured / 2**20)

