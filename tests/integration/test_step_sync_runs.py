"""The CUDA graph asked for without CUDA, through the command line."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]


def test_cuda_graph_on_without_cuda_is_one_sentence_and_exit_2(tmp_path, cli):
    proc = cli("train", "fashion_mnist", "--run-dir", tmp_path / "run", "--set", "train.cuda_graph=on",
               "--set", "data.dataset=synthetic", "--set", "train.max_steps=1", "--set", "train.device=cpu")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "train.cuda_graph is on but CUDA graphs need a CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr

