"""The CUDA-graph step (largebatch/graph.py) on CPU, with tests/fake_cuda.py standing in for torch.cuda: a capture
records the step's ATen ops and a replay re-runs them on the same tensors, so whatever the real graph would bake
in or lose shows up here.

- Replay equals the same steps run eagerly, bit for bit, over 20 steps across a batch phase change, the lr
  schedule, a skipped (non-finite) step and the EMA, for SGD, LARS and LAMB; with a loss scale too.
- Warm-up and capture share one stream; capture is thread_local; graphs of a phase share a pool, which is left
  once they are reset at a phase change; a short batch seen before is replayed, not captured again.
- After warm-up no parameter, gradient, optimizer state, lr, loss-scale, EMA or counter tensor moves or appears.
- A capture that fails is one sentence naming the first error (one hop under what the capture's exit raised,
  none where the context is suppressed) and train.cuda_graph=off; out of memory names batch.micro_batch.
- Gradients are zeroed in one multi-tensor call.
- Each trainer's graphs are synchronised and reset at its close, and freed then with the collector off: several
  trainers in one process leave no graph for the garbage collector (no GraphedStep <-> TrainStep cycle).
"""
from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from fake_cuda import FakeCuda
from torch.utils._python_dispatch import TorchDispatchMode

from largebatch import config, graph
from largebatch.errors import UserError
from largebatch.optim.sgd import SGD
from largebatch.step import local_step, set_lr

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]


def _trainer(tmp_path, optim: str, *sets: str):
    """A tiny model over a batch-phase change at epoch 1 (96 images: 6 steps of 16, then 3 of 32 an epoch)."""
    from largebatch.trainer import Trainer

    cfg = config.load("fashion_mnist", [
        "model.width=4", "data.dataset=synthetic", "data.synthetic_size=96", "data.image_size=12",
        "batch.global_batch=32", "batch.phases=[{start_epoch: 0, global_batch: 16}, {start_epoch: 1, global_batch: 32}]",
        "schedule.epochs=8", "schedule.warmup_epochs=1", "train.log_every=5", "train.plots=false", "train.ema=0.9",
        "train.label_smoothing=0.1", "train.channels_last=off", f"optim.name={optim}", "optim.weight_decay=5e-4",
        *sets])
    return Trainer(cfg, tmp_path, quiet=True)


def _state(trainer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in trainer.model.state_dict().items()}
    out.update({f"ema.{k}": v.detach().clone() for k, v in trainer.ema.state_dict().items()})
    for i, (p, st) in enumerate(trainer.optimizer.state.items()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"opt.{i}.{k}"] = v.detach().clone()
    out["counters"] = trainer.train_step.counters.clone()
    scale = getattr(trainer.scaler, "_scale", None)   # made at the first scale(), when the scaler is on
    out["scale"] = scale.clone() if scale is not None else torch.zeros(())
    return out


def _run(trainer, graphed: graph.GraphedStep, steps: int, losses: list, batches=None):
    trainer.train_step.graph = graphed
    for step, (phase, micros, _) in enumerate(batches or trainer.batches.steps(0, steps)):
        losses.append(trainer.train_step(step, micros, phase, trainer.plan.lr(step)).clone())


def _with_scaler(trainer) -> None:
    """A dynamic loss scale on CPU (torch.amp.GradScaler("cpu")), as fp16 has on CUDA."""
    trainer.scaler = trainer.train_step.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=4)


@pytest.mark.parametrize("optim, scaler", [("sgd", False), ("lars", False), ("lamb", False), ("lars", True)])
def test_replay_equals_eager_bit_for_bit_across_a_phase_change_a_skipped_step_and_the_ema(tmp_path, monkeypatch,
                                                                                          optim, scaler):
    monkeypatch.setenv("LARGEBATCH_FAULTS", "nan@0:8")   # a replayed step: the graph's poison scalar
    results = []
    for name, warmup in (("eager", 10 ** 6), ("graph", graph.WARMUP)):
        trainer = _trainer(tmp_path / name, optim)
        if scaler:
            _with_scaler(trainer)
        cuda = FakeCuda()
        graphed = graph.GraphedStep(trainer.train_step, cuda=cuda, warmup=warmup)
        losses: list = []
        _run(trainer, graphed, 20, losses)
        trainer.train_step.check()
        results.append((_state(trainer), losses, graphed, trainer.progress.nonfinite_total))
        trainer.close()
    (eager, eager_losses, g0, skipped0), (replayed, graph_losses, g1, skipped1) = results
    assert g0.captures == 0 and g1.captures == 2   # one per phase: 6 steps of 16, then 32 a step
    assert skipped0 == skipped1 == 1
    for a, b in zip(eager_losses, graph_losses):
        assert torch.equal(a, b) or (a.isnan() and b.isnan())
    assert eager.keys() == replayed.keys()
    for k in eager:
        assert torch.equal(eager[k], replayed[k]), k


def test_warmup_and_capture_share_a_stream_capture_is_thread_local_and_pools_follow_the_graphs(tmp_path):
    trainer = _trainer(tmp_path, "lars")
    cuda = FakeCuda()
    graphed = graph.GraphedStep(trainer.train_step, cuda=cuda)
    _run(trainer, graphed, 12, [])
    captures = [c for c in cuda.calls if c[0] == "capture"]
    assert len(captures) == 2
    assert all(stream is graphed.side and mode == "thread_local" for _, _, stream, mode in captures)
    first, second = captures[0][1], captures[1][1]
    assert first != second and cuda.pools_given == [first, second]   # a new pool after the phase change
    assert ("reset", first) in cuda.calls and graphed.released == 1
    resets = cuda.calls.index(("reset", first))
    assert cuda.calls[resets - 1] == ("synchronize",)   # the last replay finished before the reset
    trainer.close()


def test_a_short_batch_seen_before_is_replayed_not_captured_again(tmp_path):
    """Within one phase, a short batch (as a data set not divisible by the batch gives) gets its own graph once."""
    trainer = _trainer(tmp_path, "sgd", "batch.phases=null", "batch.global_batch=16")
    steps = list(trainer.batches.steps(0, 4))
    phase, micros, _ = steps[0]
    short = [(x[:10], y[:10]) for x, y in micros]
    cuda = FakeCuda()
    graphed = graph.GraphedStep(trainer.train_step, cuda=cuda)
    trainer.train_step.graph = graphed
    shapes = [micros] * 4 + [short] * 4 + [micros, short, micros, short]
    for step, m in enumerate(shapes):
        set_lr(trainer.optimizer, 0.1, static=True)
        graphed(step, m, phase, None)
    assert graphed.captures == 2 and len(graphed.graphs) == 2
    assert [c[1] for c in cuda.calls if c[0] == "capture"] == [cuda.pools_given[0]] * 2   # one pool, both alive
    assert sum(g.graph.replays for g in graphed.graphs.values()) == len(shapes) - 2 * graph.WARMUP
    trainer.close()


def _tensor_ptrs(trainer) -> dict[str, int]:
    """Every tensor a replay reads or writes, by name: its address."""
    opt = trainer.optimizer
    out = {}
    for i, p in enumerate(trainer.model.parameters()):
        out[f"param{i}"] = p.data_ptr()
        out[f"grad{i}"] = p.grad.data_ptr() if p.grad is not None else 0
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                out[f"state{i}.{k}"] = v.data_ptr()
    for j, g in enumerate(opt.param_groups):
        out[f"lr{j}"] = g["lr"].data_ptr()
    for j, v in getattr(opt, "_prev_lr", {}).items():
        out[f"prev_lr{j}"] = v.data_ptr()
    for k, v in trainer.ema.state_dict().items():
        out[f"ema.{k}"] = v.data_ptr()
    for k, v in trainer.model.state_dict().items():
        out[f"model.{k}"] = v.data_ptr()
    out["counters"] = trainer.train_step.counters.data_ptr()
    out["scale"] = trainer.scaler._scale.data_ptr()
    out["growth"] = trainer.scaler._growth_tracker.data_ptr()
    return out


@pytest.mark.parametrize("optim", ["sgd", "lars", "lamb"])
def test_after_warmup_no_state_tensor_moves_or_appears(tmp_path, optim):
    trainer = _trainer(tmp_path, optim, "batch.phases=null", "batch.global_batch=16")
    _with_scaler(trainer)
    graphed = graph.GraphedStep(trainer.train_step, cuda=FakeCuda())
    steps = list(trainer.batches.steps(0, 9))
    _run(trainer, graphed, 0, [], batches=steps[:graph.WARMUP])
    before = _tensor_ptrs(trainer)
    assert all(v != 0 for k, v in before.items() if k.startswith("grad"))
    trainer.train_step.graph = graphed
    for step, (phase, micros, _) in enumerate(steps[graph.WARMUP:], start=graph.WARMUP):
        trainer.train_step(step, micros, phase, trainer.plan.lr(step))
        assert _tensor_ptrs(trainer) == before, step
    assert graphed.captures == 1
    trainer.close()


def test_a_failed_capture_is_one_sentence_naming_the_first_error_and_cuda_graph_off(tmp_path):
    trainer = _trainer(tmp_path, "lars", "batch.phases=null", "batch.global_batch=16")
    graphed = graph.GraphedStep(trainer.train_step, cuda=FakeCuda())
    body = trainer.train_step.body
    calls = {"n": 0}

    def host_read_at_capture(*args, **kwargs):   # an op that cannot be captured: a host read, as .item() is
        calls["n"] += 1
        loss = body(*args, **kwargs)
        if calls["n"] > graph.WARMUP:
            float(loss)
        return loss
    trainer.train_step.body = host_read_at_capture
    trainer.train_step.graph = graphed
    with pytest.raises(UserError) as err:
        for step, (phase, micros, _) in enumerate(trainer.batches.steps(0, 5)):
            trainer.train_step(step, micros, phase, trainer.plan.lr(step))
    text = str(err.value)
    assert text.count(". ") == 0 and text.endswith("set train.cuda_graph=off to train without it.")
    assert "failed at step 3 (RuntimeError: CUDA error: operation not permitted when stream is capturing" in text
    assert graphed.captures == 0
    trainer.close()


class _ExitRaises(FakeCuda):
    """A capture whose exit raises after the body's error, as torch.cuda.graph's does (the capture is invalidated)."""

    @contextlib.contextmanager
    def graph(self, *args, **kwargs):
        with super().graph(*args, **kwargs):
            try:
                yield
            except Exception:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


def _fail_at_capture(tmp_path, cuda: FakeCuda, fail) -> str:
    """The UserError's text when `fail()` raises inside the capturing step's body (after its forward/backward)."""
    trainer = _trainer(tmp_path, "lars", "batch.phases=null", "batch.global_batch=16")
    graphed = graph.GraphedStep(trainer.train_step, cuda=cuda)
    body = trainer.train_step.body
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        loss = body(*args, **kwargs)
        if calls["n"] > graph.WARMUP:
            fail()
        return loss
    trainer.train_step.body = failing
    trainer.train_step.graph = graphed
    try:
        with pytest.raises(UserError) as err:
            for step, (phase, micros, _) in enumerate(trainer.batches.steps(0, 5)):
                trainer.train_step(step, micros, phase, trainer.plan.lr(step))
        assert graphed.captures == 0
    finally:
        trainer.close()
    text = str(err.value)
    assert text.replace("e.g. ", "").count(". ") == 0 and text.endswith(".")   # one sentence
    return text


def _raised_while_handling() -> None:
    try:
        raise KeyError("what the body handled on its way")
    except KeyError:
        raise ValueError("the capture's own error")


def _raised_from_none() -> None:
    try:
        raise KeyError("what the body handled on its way")
    except KeyError:
        raise ValueError("the capture's own error") from None


@pytest.mark.parametrize("cuda, fail", [(_ExitRaises, _raised_while_handling), (FakeCuda, _raised_from_none)],
                         ids=["one-hop-under-the-exit", "suppressed-context"])
def test_a_failed_capture_names_the_captures_own_error_not_the_deepest_context(tmp_path, cuda, fail):
    """One hop of __context__ (the body's error under the exit's), honouring __suppress_context__: the error the
    body handled on its way (KeyError) is not the failure."""
    text = _fail_at_capture(tmp_path, cuda(), fail)
    assert "failed at step 3 (ValueError: the capture's own error); set train.cuda_graph=off" in text
    assert "KeyError" not in text


def _oom() -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB")


def _oom_runtime() -> None:
    raise RuntimeError("CUDA error: out of memory")


@pytest.mark.parametrize("cuda", [FakeCuda, _ExitRaises], ids=["bare", "under-the-exit"])
@pytest.mark.parametrize("fail", [_oom, _oom_runtime], ids=["OutOfMemoryError", "RuntimeError"])
def test_out_of_memory_at_capture_names_a_smaller_micro_batch_not_the_graph(tmp_path, cuda, fail):
    text = _fail_at_capture(tmp_path, cuda(), fail)
    assert text.startswith("the device ran out of memory capturing the training step as a CUDA graph at step 3 "
                           "with forward batches of 16 images (")
    assert "out of memory" in text.split("(", 1)[1]   # the error's own words
    assert text.endswith("set batch.micro_batch below 16 (e.g. 8).") and "cuda_graph" not in text
    assert text.replace("e.g. ", "").count(". ") == 0   # one sentence: torch's "CUDA out of memory. Tried to allocate ..." cut to its clause


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("optim", ["sgd", "lars", "lamb"])
def test_gradients_are_zeroed_in_one_multi_tensor_call(tmp_path, optim):
    trainer = _trainer(tmp_path, optim, "batch.phases=null", "batch.global_batch=16")
    graphed = graph.GraphedStep(trainer.train_step, cuda=FakeCuda())
    _run(trainer, graphed, 2, [])   # warm-up steps: the gradients exist
    grads = [p.grad for p in trainer.model.parameters()]
    assert len(grads) > 2 and all(g is not None and g.abs().sum() > 0 for g in grads)
    with _Ops() as seen:
        graphed._zero_grads()
    assert seen.ops == [torch.ops.aten._foreach_zero_.default]
    assert all(p.grad is g and not g.any() for p, g in zip(trainer.model.parameters(), grads))
    trainer.close()


def test_each_trainers_graphs_are_released_at_its_close_not_by_the_garbage_collector(tmp_path):
    """Three graphed trainers in one process, closed one by one with the cyclic collector off: at each close its
    graphs are reset after a synchronize and freed, the others' untouched; a second close does nothing more."""
    gc.collect()
    gc.disable()
    try:
        trainers, cudas, graph_refs = [], [], []
        for i in range(3):
            trainer = _trainer(tmp_path / str(i), "lars", "batch.phases=null", "batch.global_batch=16")
            cuda = FakeCuda()
            graphed = graph.GraphedStep(trainer.train_step, cuda=cuda)
            _run(trainer, graphed, graph.WARMUP + 2, [])
            assert graphed.captures == 1
            trainers.append(trainer)
            cudas.append(cuda)
            graph_refs.append([weakref.ref(c.graph) for c in graphed.graphs.values()])
        del graphed
        for k, trainer in enumerate(trainers):
            pool = cudas[k].pools_given[0]
            trainer.close()
            assert cudas[k].calls[-2:] == [("synchronize",), ("reset", pool)]
            assert all(ref() is None for ref in graph_refs[k])   # freed at close, not left for the collector
            for j in range(k + 1, 3):
                assert not any(c[0] == "reset" for c in cudas[j].calls)
                assert all(ref() is not None for ref in graph_refs[j])
            n = len(cudas[k].calls)
            trainer.close()
            assert len(cudas[k].calls) == n
    finally:
        gc.enable()


def test_a_graphed_step_is_no_reference_cycle_with_its_train_step():
    """Dropped without a close, a step's GraphedStep and its graphs go with it by reference counting (the collector
    off): the GraphedStep holds its TrainStep weakly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    gc.collect()
    gc.disable()
    try:
        step = local_step(model, opt, device=torch.device("cpu"))
        graphed = graph.GraphedStep(step.train_step, cuda=FakeCuda())
        step.train_step.graph = graphed
        micros = [(torch.randn(8, 12), torch.randint(0, 3, (8,)))]
        for _ in range(graph.WARMUP + 2):
            step(micros, 0.1)
        assert graphed.captures == 1
        refs = [weakref.ref(step.train_step), weakref.ref(graphed)]
        refs += [weakref.ref(c.graph) for c in graphed.graphs.values()]
        del step, graphed
        assert [ref() for ref in refs] == [None] * len(refs)
    finally:
        gc.enable()


def test_auto_stays_eager_until_a_gpu_check_verifies_the_graph(monkeypatch):
    cuda = torch.device("cuda", 0)
    use, why = graph.plan("auto", cuda, 1, False)
    assert not use and why is not None and "set train.cuda_graph=on" in why and "docs/gpu.md" in why
    assert graph.plan("on", cuda, 1, False) == (True, None)
    assert graph.plan("auto", torch.device("cpu"), 1, False) == (False, None)
    monkeypatch.setattr(graph, "AUTO_ON_CUDA", True)   # the one-line change once a GPU check has passed
    assert graph.plan("auto", cuda, 1, False) == (True, None)


def test_cudnn_benchmark_is_on_for_cuda_training_unless_deterministic(tmp_path, monkeypatch):
    from largebatch import dist

    before = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = False
        dist.configure_backends(torch.device("cpu"), False)
        assert torch.backends.cudnn.benchmark is False
        dist.configure_backends(torch.device("cuda", 0), False)
        assert torch.backends.cudnn.benchmark is True
        dist.configure_backends(torch.device("cuda", 0), True)
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.backends.cudnn.benchmark = before
    seen = []
    monkeypatch.setattr(dist, "configure_backends", lambda device, deterministic: seen.append((device, deterministic)))
    _trainer(tmp_path, "sgd").close()
    assert seen == [(torch.device("cpu"), False)]   # the trainer sets it for the device it trains on
