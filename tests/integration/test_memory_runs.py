"""The memory estimate against a real process's measured peak."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_memory import PEAK_RSS  # the helpers of its unit tests, one copy

from largebatch import memory

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]


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

