"""The gradient noise scale: the estimator on a problem whose B_simple is known exactly, in one process and
across two gloo processes, and the trainer logging it."""
import datetime
import json
import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from largebatch.dist import end_process
from largebatch.noise_scale import NoiseScale, allreduce_with_norms, estimates

# Per-example gradient G + z, z ~ N(0, sigma^2 I_d): tr(Sigma) = d sigma^2, so B_simple = d sigma^2 / |G|^2.
D, SIGMA, G_VALUE = 1000, 1.0, 0.5
TRUE_B_SIMPLE = D * SIGMA ** 2 / (D * G_VALUE ** 2)   # 4.0


def _worker_gradient(gen: torch.Generator, batch: int) -> torch.Tensor:
    """The mean gradient of `batch` examples of the linear loss w . (G + z): exactly G + mean(z)."""
    z = torch.randn(batch, D, generator=gen, dtype=torch.float64) * SIGMA
    return (G_VALUE + z).mean(0)


def test_estimates_are_exact_on_expected_norms():
    g2, trace, b_small, b_big = 3.0, 50.0, 16, 64
    assert estimates(g2 + trace / b_small, g2 + trace / b_big, b_small, b_big) == pytest.approx((g2, trace))
    with pytest.raises(ValueError, match="2\\+ workers"):
        estimates(1.0, 1.0, 8, 8)


def test_one_process_two_simulated_workers_recover_the_known_noise_scale():
    gen = torch.Generator().manual_seed(0)
    b_small, workers = 32, 2
    g2s, traces = [], []
    noise = NoiseScale(decay=0.9)
    for _ in range(300):
        local = [_worker_gradient(gen, b_small) for _ in range(workers)]
        small_sq = float(sum(g.pow(2).sum() for g in local) / workers)
        big_sq = float((sum(local) / workers).pow(2).sum())
        g2, trace = estimates(small_sq, big_sq, b_small, b_small * workers)
        g2s.append(g2)
        traces.append(trace)
        rec = noise.update(small_sq, big_sq, b_small, b_small * workers)
    assert sum(traces) / sum(g2s) == pytest.approx(TRUE_B_SIMPLE, rel=0.05)
    assert rec["noise_scale"] == pytest.approx(TRUE_B_SIMPLE, rel=0.25)   # the EMA: a shorter window


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        gen = torch.Generator().manual_seed(100 + rank)   # each worker its own examples
        b_small = 32
        g2s, traces = [], []
        for _ in range(300):
            grad = _worker_gradient(gen, b_small).float()
            grads = [grad[:400].clone(), grad[400:].clone().reshape(20, 30)]   # two "parameters"
            small_sq, big_sq = allreduce_with_norms(grads, 2, scale=1.0)
            g2, trace = estimates(small_sq, big_sq, b_small, 2 * b_small)
            g2s.append(g2)
            traces.append(trace)
        check = grads[0].clone()
        dist.broadcast(check, 0)
        assert torch.equal(check, grads[0])    # the averaged gradient is written back, the same on both ranks
        out[rank] = sum(traces) / sum(g2s)
    finally:
        dist.destroy_process_group()
    end_process(0, ran_group=True)   # exit without interpreter finalization while gloo threads live (largebatch.dist)


def test_two_gloo_processes_recover_the_known_noise_scale():
    out = mp.Manager().dict()
    mp.spawn(_two_ranks, args=(_free_port(), out), nprocs=2, join=True)
    assert out[0] == pytest.approx(out[1], rel=1e-6)
    assert out[0] == pytest.approx(TRUE_B_SIMPLE, rel=0.05)


@pytest.mark.timeout(300)
def test_training_logs_and_plots_the_noise_scale(cli, tmp_path):
    run = tmp_path / "run"
    cli("train", "--nproc-per-node", "2", "--run-dir", run, "--set", "model.width=4", "--set", "data.dataset=synthetic",
        "--set", "data.synthetic_size=512", "--set", "data.image_size=8", "--set", "batch.global_batch=64",
        "--set", "schedule.epochs=1", "--set", "schedule.warmup_epochs=0", "--set", "train.log_every=2",
        "--set", "train.noise_scale=true", "--quiet", check=True)
    train = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    measured = [r for r in train if "noise_scale" in r]
    assert len(measured) == 4 and all(r["step"] % 2 == 0 for r in measured)   # every logging step
    # single-step estimates are noisy (either term can come out negative with 2 workers): finite, and averaged
    assert all(math.isfinite(r["grad_sq"]) and math.isfinite(r["grad_trace"]) for r in measured)
    from largebatch import checkpoint

    path, _ = checkpoint.latest(run / "checkpoints")
    assert checkpoint.load(path)["noise_scale"]["g2"] == pytest.approx(measured[-1]["grad_sq"])   # resumes with it
    assert (run / "plots" / "noise_scale.png").is_file()
