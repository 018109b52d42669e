"""The CUDA path: precisions, memory format, optimizers, the trainer, checkpoints across devices, every
comm algorithm and the DDP hook on CUDA tensors, NCCL, and the pinned-memory loader.

Marked `cuda` (`pytest -m cuda`, run by `scripts/gpu_check.sh` on a GPU machine) and skipped, saying so,
where no CUDA device is visible. Tolerances are stated where numerics differ by design (autocast).
"""
import datetime
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image

from largebatch import checkpoint, comm
from largebatch.config import OptimConfig, from_dict
from largebatch.dist import end_process
from largebatch.models import build_model
from largebatch.optim import build_optimizer

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible on this machine"),
              pytest.mark.timeout(600)]

CUDA = torch.device("cuda", 0)


def _cfg(precision: str = "fp32", channels_last: str = "off", device: str = "cuda", steps: int = 3, **train):
    return from_dict({
        "model": {"name": "resnet18", "width": 8},
        "data": {"dataset": "synthetic", "synthetic_size": 256, "image_size": 32, "num_classes": 10},
        "batch": {"global_batch": 32},
        "optim": {"lr": 0.05},
        "schedule": {"epochs": 4, "warmup_epochs": 0},
        "train": {"precision": precision, "channels_last": channels_last, "device": device, "max_steps": steps,
                  "plots": False, **train},
    })


def _fit(cfg, run_dir, resume=False):
    from largebatch.trainer import Trainer

    trainer = Trainer(cfg, run_dir, resume=resume, quiet=True)
    before = {k: v.detach().float().cpu().clone() for k, v in trainer.model.state_dict().items()}
    summary = trainer.fit()
    after = {k: v.detach().float().cpu().clone() for k, v in trainer.model.state_dict().items()}
    return trainer, summary, before, after


def _update_cosine(a_before, a_after, b_before, b_after) -> float:
    """Cosine similarity of two runs' total weight updates (all trainable tensors flattened)."""
    keys = [k for k in a_before if "running" not in k and "num_batches" not in k]
    da = torch.cat([(a_after[k] - a_before[k]).flatten() for k in keys])
    db = torch.cat([(b_after[k] - b_before[k]).flatten() for k in keys])
    return float(torch.nn.functional.cosine_similarity(da, db, dim=0))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_steps_follow_fp32(tmp_path, precision):
    """3 steps in fp16 (autocast + GradScaler) or bf16 (autocast) move the weights the way fp32 does:
    cosine similarity of the total update >= 0.98 (autocast rounds activations; it must not change the
    direction of training)."""
    _, s32, b32, a32 = _fit(_cfg("fp32"), tmp_path / "fp32")
    trainer, s, b, a = _fit(_cfg(precision), tmp_path / precision)
    assert s["steps"] == s32["steps"] == 3 and s["nonfinite_steps"] == 0
    assert _update_cosine(b32, a32, b, a) >= 0.98
    if precision == "fp16":
        assert trainer.scaler.is_enabled() and trainer.scaler.get_scale() > 0


def test_fp16_skips_a_non_finite_step_and_lowers_the_scale(tmp_path, monkeypatch):
    monkeypatch.setenv("LARGEBATCH_FAULTS", "nan@0:1")   # the loss of step 1 is NaN
    trainer, summary, _, after = _fit(_cfg("fp16", steps=4), tmp_path / "nan")
    assert summary["nonfinite_steps"] == 1
    assert trainer.scaler.get_scale() < 2.0 ** 16          # GradScaler halved its initial scale at the skip
    assert all(torch.isfinite(v).all() for v in after.values())


def test_channels_last_equals_contiguous(tmp_path):
    _, _, b0, a0 = _fit(_cfg(channels_last="off"), tmp_path / "nchw")
    trainer, _, b1, a1 = _fit(_cfg(channels_last="on"), tmp_path / "nhwc")
    assert trainer.channels_last
    assert _update_cosine(b0, a0, b1, a1) >= 0.995   # cuDNN picks other (TF32) kernels: rounding only


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_lars_and_lamb_on_cuda_equal_cpu(name):
    torch.manual_seed(0)
    cpu_model = build_model("resnet18", 10, width=8, stem="small")
    gpu_model = build_model("resnet18", 10, width=8, stem="small")
    gpu_model.load_state_dict(cpu_model.state_dict())
    gpu_model.to(CUDA)
    cfg = OptimConfig(name=name, lr=0.1, weight_decay=1e-4)
    opts = [build_optimizer(cfg, m, lr=0.1) for m in (cpu_model, gpu_model)]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for (_, pc), (_, pg) in zip(cpu_model.named_parameters(), gpu_model.named_parameters()):
            grad = torch.randn(pc.shape, generator=g)
            pc.grad, pg.grad = grad.clone(), grad.to(CUDA)
        for o in opts:
            o.step()
    for (n, pc), (_, pg) in zip(cpu_model.named_parameters(), gpu_model.named_parameters()):
        assert torch.allclose(pc, pg.cpu(), rtol=1e-5, atol=1e-6), n


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_trainer_runs_20_steps_in_each_precision(tmp_path, precision):
    _, summary, _, after = _fit(_cfg(precision, channels_last="auto", steps=20), tmp_path / precision)
    assert summary["steps"] == 20 and summary["nonfinite_steps"] == 0
    assert 0.0 <= summary["final_top1"] <= 1.0 and np.isfinite(summary["final_loss"])
    assert all(torch.isfinite(v).all() for v in after.values())


@pytest.mark.parametrize("first, second", [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_moves_between_cpu_and_cuda(tmp_path, first, second):
    run = tmp_path / "run"
    _fit(_cfg(device=first, steps=4, checkpoint_every=2), run)
    path, meta = checkpoint.latest(run / "checkpoints")
    assert meta["step"] == 4
    trainer, summary, before, after = _fit(_cfg(device=second, steps=6, checkpoint_every=2), run, resume=True)
    assert trainer.device.type == second and summary["steps"] == 6
    saved = checkpoint.load(path)["model"]
    assert all(torch.equal(saved[k].float().cpu(), before[k]) for k in saved)   # resumed exactly there
    assert all(torch.isfinite(v).all() for v in after.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks_on_one_gpu(rank: int, port: int) -> None:
    """Every algorithm (and compression) on CUDA tensors across 2 gloo processes sharing cuda:0, then the
    DDP hook with CUDA buckets against DDP's own all-reduce."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.cuda.set_device(0)
        g = [torch.Generator().manual_seed(100 + r) for r in range(2)]
        inputs = [torch.randn(10_007, generator=g[r], dtype=torch.float64) for r in range(2)]
        exact = (inputs[0] + inputs[1]).float()
        cases = [(a, {}) for a in comm.ALGORITHMS] + [("torus2d", {"impl": "p2p"}), ("hierarchical", {"impl": "p2p"}),
                                                      ("hierarchical", {"impl": "native", "inter": "native"})]
        for algorithm, extra in cases:
            options = {"grid": "2x1"} if algorithm == "torus2d" else {}
            if algorithm == "hierarchical":
                options = {"local_size": 2}
            options.update(extra)
            x = inputs[rank].float().to(CUDA)
            comm.allreduce(x, algorithm, **options)
            assert x.is_cuda and torch.allclose(x.cpu(), exact, rtol=1e-5, atol=1e-5), algorithm
            for compression in ("fp16", "bf16"):
                y = inputs[rank].float().to(CUDA)
                comm.allreduce(y, algorithm, compression=compression, **options)
                assert torch.allclose(y.cpu(), exact, rtol=2e-2, atol=2e-2), (algorithm, compression)
        # the DDP hook: CUDA buckets through the comm thread's stream, against DDP's own all-reduce
        torch.manual_seed(0)
        base = build_model("resnet18", 10, width=8, stem="small").to(CUDA)
        grads = {}
        for algorithm in ("native", "ring", "halving_doubling", "torus2d:native", "torus2d:p2p"):
            model = build_model("resnet18", 10, width=8, stem="small").to(CUDA)
            model.load_state_dict(base.state_dict())
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=None, bucket_cap_mb=0.05)
            name, _, impl = algorithm.partition(":")
            opts = {"impl": impl, "grid": "2x1", "small_bytes": 0} if impl else {}
            state = comm.register(ddp, comm.CommHookState(name, **opts)) if algorithm != "native" else None
            gen = torch.Generator().manual_seed(rank)
            x = torch.randn(8, 3, 32, 32, generator=gen).to(CUDA, non_blocking=True)
            y = torch.randint(0, 10, (8,), generator=gen).to(CUDA)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            torch.cuda.synchronize()
            grads[algorithm] = torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()
            if state is not None:
                state.close()
        for algorithm in ("ring", "halving_doubling", "torus2d:native", "torus2d:p2p"):   # CUDA buckets on gloo: on the thread
            assert torch.allclose(grads[algorithm], grads["native"], rtol=1e-4, atol=1e-6), algorithm
        dist.barrier()
    finally:
        dist.destroy_process_group()
    end_process(0, ran_group=True)   # exit without interpreter finalization while gloo threads live (largebatch.dist)


def test_comm_algorithms_and_ddp_hook_on_cuda_tensors():
    mp.spawn(_two_ranks_on_one_gpu, args=(_free_port(),), nprocs=2, join=True)


def test_nccl_at_world_size_1():
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=CUDA)
    try:
        for algorithm in comm.ALGORITHMS:
            options = {"grid": "1x1"} if algorithm == "torus2d" else {}
            if algorithm == "hierarchical":
                options = {"local_size": 1}
            x = torch.arange(1000.0, device=CUDA)
            comm.allreduce(x, algorithm, **options)
            assert torch.equal(x.cpu(), torch.arange(1000.0)), algorithm
        t = torch.ones(4, device=CUDA)
        dist.all_reduce(t)
        assert torch.equal(t.cpu(), torch.ones(4))
    finally:
        dist.destroy_process_group()


def test_pinned_loader_and_non_blocking_copies(tmp_path):
    from largebatch.data import build_data
    from largebatch.placement import to_model_layout

    for split in ("train", "val"):
        for c in range(2):
            folder = tmp_path / split / f"c{c}"
            folder.mkdir(parents=True)
            for i in range(8):
                pixels = np.random.default_rng(i + 10 * c).integers(0, 255, (48, 64, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.jpg")
    cfg = from_dict({"data": {"dataset": "imagefolder", "root": str(tmp_path), "image_size": 32,
                              "loader_workers": 2}})
    train, _, _ = build_data(cfg.data, seed=0)
    x, y = next(iter(train.batches([torch.arange(8)], train=False, epoch=0)))
    assert x.is_pinned() and y.is_pinned()
    for channels_last in (False, True):
        on_gpu = to_model_layout(x, CUDA, channels_last)
        torch.cuda.synchronize()
        assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), x)
        assert on_gpu.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    train.close()
    os.sync()


# ------------------------------------------------------------------------------ the step as a CUDA graph
def _graph_cfg(graph: str, precision: str, optim: str = "lars", steps: int = 20):
    """20 steps over a batch-phase change at step 8 (256 images: 8 steps of 32, then 64 a step), so that the
    graph is captured, replayed, released and captured again at the new shape."""
    return from_dict({
        "model": {"name": "resnet18", "width": 8},
        "data": {"dataset": "synthetic", "synthetic_size": 256, "image_size": 32, "num_classes": 10},
        "batch": {"global_batch": 64, "phases": [{"start_epoch": 0, "global_batch": 32},
                                                 {"start_epoch": 1, "global_batch": 64}]},
        "optim": {"name": optim, "lr": 0.1, "weight_decay": 5e-5},
        "schedule": {"epochs": 4, "warmup_epochs": 1},
        "train": {"precision": precision, "channels_last": "on", "device": "cuda", "max_steps": steps,
                  "plots": False, "label_smoothing": 0.1, "ema": 0.99, "cuda_graph": graph, "log_every": 5},
    })


@pytest.mark.parametrize("precision, optim", [("fp16", "lars"), ("bf16", "lars"), ("bf16", "lamb"), ("fp32", "sgd")])
def test_graph_replay_equals_eager_over_20_steps_across_a_phase_change(tmp_path, precision, optim):
    """The same 20 steps eagerly and as graphs (captured at steps 3 and 11, after 3 warm-up steps of each
    shape): the weights' total updates agree to a cosine >= 0.999 and every weight to 2e-3 of its scale (the
    kernels are the same; cuDNN may pick other algorithms at capture), the loss scale and counters equal."""
    eager, s0, b0, a0 = _fit(_graph_cfg("off", precision, optim), tmp_path / "eager")
    graphed, s1, b1, a1 = _fit(_graph_cfg("on", precision, optim), tmp_path / "graph")
    assert eager.train_step.graph is None and graphed.train_step.graph.captures == 2
    assert s0["steps"] == s1["steps"] == 20 and s0["nonfinite_steps"] == s1["nonfinite_steps"] == 0
    assert _update_cosine(b0, a0, b1, a1) >= 0.999
    for k in a0:
        scale = a0[k].abs().max().clamp(min=1e-3)
        assert (a0[k] - a1[k]).abs().max() <= 2e-3 * scale, k
    assert eager.scaler.get_scale() == graphed.scaler.get_scale()


def test_a_graph_still_skips_a_nonfinite_step_and_counts_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LARGEBATCH_FAULTS", "nan@0:6")   # a replayed step (captured at step 3)
    trainer, summary, _, after = _fit(_graph_cfg("on", "fp16", steps=10), tmp_path / "nan")
    assert trainer.train_step.graph.captures == 1
    assert summary["nonfinite_steps"] == 1
    assert trainer.scaler.get_scale() < 2.0 ** 16
    assert all(torch.isfinite(v).all() for v in after.values())


def test_prefetch_hands_out_the_sources_batches_on_the_device():
    from largebatch.placement import prefetch

    g = torch.Generator().manual_seed(0)
    steps = [("phase", [(torch.randint(0, 255, (4, 3, 8, 8), dtype=torch.uint8, generator=g).pin_memory(),
                         torch.arange(4).pin_memory())], 0.0) for _ in range(5)]
    got = list(prefetch(iter(steps), CUDA, channels_last=True))
    assert len(got) == 5
    for (_, want, _), (_, have, _) in zip(steps, got):
        x, y = have[0]
        assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(x.cpu(), want[0][0]) and torch.equal(y.cpu(), want[0][1])


# ------------------------------------------------------------------------------ JPEG decoding on the GPU
def _photo_tree(root, per_class=12):
    """Photo-like JPEGs (gradients and noise) of ImageNet-like sizes in 2 classes, train and val."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(2):
            for i in range(per_class):
                w, h = int(rng.integers(200, 500)), int(rng.integers(200, 500))
                yy, xx = np.mgrid[0:h, 0:w]
                arr = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy + 100 * c) % 256], -1)
                arr = np.clip(arr + rng.integers(-15, 15, arr.shape), 0, 255).astype(np.uint8)
                path = root / split / f"c{c}" / f"{i}.jpg"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(arr).save(path, "JPEG", quality=90)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("decoder", ["torchvision", "nvimgcodec"])
def test_gpu_decode_equals_cpu_decode_within_the_idct_tolerance(tmp_path, train, decoder):
    """nvJPEG (torchvision: whole images; nvImageCodec: crop windows) then the GPU's float resize, against
    libjpeg-turbo's DCT-scaled decode and uint8 resize: the same crops (same boxes and flips), pixels within a
    few levels on average."""
    from largebatch.data import build_data
    from largebatch.config import DataConfig

    if decoder == "nvimgcodec":
        pytest.importorskip("nvidia.nvimgcodec", reason="nvImageCodec is not installed (make gpu-wheels carries it)")
    _photo_tree(tmp_path)
    cfg = dict(dataset="imagefolder", root=str(tmp_path), image_size=64, loader_workers=2, gpu_decoder=decoder)
    cpu_train, cpu_val, _ = build_data(DataConfig(**{**cfg, "gpu_decoder": "auto"}, decode="cpu"), seed=3)
    gpu_train, gpu_val, _ = build_data(DataConfig(**cfg, decode="gpu"), seed=3)
    cpu_src, gpu_src = (cpu_train, gpu_train) if train else (cpu_val, gpu_val)
    idx = [torch.arange(len(cpu_src))]
    xc, yc = next(iter(cpu_src.batches(idx, train=train, epoch=1)))
    xg, yg = next(iter(gpu_src.batches(idx, train=train, epoch=1)))
    assert xg.is_cuda and xg.dtype == torch.uint8 and xg.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(yc, yg.cpu())
    diff = (xc.float() - xg.cpu().float()).abs()
    assert diff.mean() < 4.0 and diff.flatten(1).mean(1).max() < 8.0, (float(diff.mean()), float(diff.max()))
    for s in (cpu_train, cpu_val, gpu_train, gpu_val):
        s.close()


def test_the_gpu_cache_returns_the_same_bytes_on_the_device(tmp_path):
    from largebatch.data import build_data
    from largebatch.config import DataConfig

    _photo_tree(tmp_path, per_class=6)
    cfg = dict(dataset="imagefolder", root=str(tmp_path), image_size=64, loader_workers=0, decode="gpu")
    plain, _, _ = build_data(DataConfig(**cfg), seed=3)
    cached, _, _ = build_data(DataConfig(**cfg, gpu_cache_gb=1.0), seed=3)
    idx = [torch.arange(len(plain))]
    for epoch in range(3):
        a, _ = next(iter(plain.batches(idx, train=True, epoch=epoch)))
        b, _ = next(iter(cached.batches(idx, train=True, epoch=epoch)))
        assert torch.equal(a, b), epoch
    cache = cached.finisher.cache
    assert cache.hits == 2 * len(plain) and len(cache.images) == len(plain)
    assert all(t.is_cuda for t in cache.images.values())
