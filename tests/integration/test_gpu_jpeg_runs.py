"""GPU decoding asked for where it cannot run, through the command line."""
from __future__ import annotations

import pytest
import torch
from test_gpu_jpeg import _images  # the helpers of its unit tests, one copy

from largebatch import config
from largebatch.data.gpu_jpeg import (
    check_decode,
)
from largebatch.errors import UserError

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]


def test_data_decode_gpu_where_it_cannot_run_is_one_sentence(tmp_path, cli):
    if torch.cuda.is_available():
        pytest.skip("this machine can decode on the GPU; tests/integration/test_cuda.py covers it")
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

