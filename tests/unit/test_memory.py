"""Memory per device and the micro-batch that fits it (largebatch/memory.py, `batch.micro_batch: auto`): the
estimate against measured memory, the 32K recipe on 8 GPUs of 80 GB, the conflicts refused in one sentence, a
forward batch that changes between phases said, and the out-of-memory retry with a fake device memory on CPU."""
from __future__ import annotations

import pytest
import torch

from largebatch import config
from largebatch.commands.train import dry_run
from largebatch.errors import UserError

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




def test_the_32k_recipe_on_8_gpus_of_80_gb_chooses_a_micro_batch_that_fits_and_says_how():
    cfg = config.load("imagenet_resnet50_lars_32k", ["train.device_memory_gb=80"])
    plan = dry_run(cfg, 8, "--world-size")
    assert (plan["per_worker_batch"], plan["micro_batch"], plan["accumulation"]) == (4096, 1024, 4)
    assert plan["global_batch"] == 32768 and "DOES NOT FIT" not in plan["memory"]
    assert plan["device"].startswith("cuda, 80.0 GiB per worker (train.device_memory_gb 80)")
    assert "auto" in plan["micro_batch_choice"]
    small = dry_run(config.load("imagenet_resnet50_lars_32k", ["train.device_memory_gb=16"]), 8, "--world-size")
    assert small["micro_batch"] < 1024 and small["micro_batch"] * small["accumulation"] == 4096
    fixed = dry_run(config.load("imagenet_resnet50_lars_32k", ["train.device_memory_gb=80", "batch.micro_batch=null"]),
                    8, "--world-size")
    assert fixed["micro_batch"] == 4096 and "DOES NOT FIT" in fixed["memory"]   # asked for: said, not changed


def test_a_micro_batch_and_an_accumulation_that_disagree_are_one_sentence(cli):
    with pytest.raises(UserError) as err:
        dry_run(config.load("imagenet_resnet50_lars_32k", ["batch.micro_batch=256", "batch.accumulation=4"]), 8,
                "--world-size")
    assert str(err.value) == ("batch.micro_batch = 256 and batch.accumulation = 4 make 1024 images per worker, but "
                              "batch.global_batch = 32768 over 8 workers is 4096; set one of them and leave the other "
                              "null (it is derived), or make them agree.")


def test_a_forward_batch_that_changes_between_phases_is_said():
    cfg = config.load("imagenet_resnet50_sony_batch_control", ["batch.micro_batch=null", "batch.accumulation=1"])
    plan = dry_run(cfg, 2176, "--world-size")
    assert plan["notes"] == ["the forward batch per worker changes from 16 to 32 images at epoch 5; set "
                             "batch.micro_batch to cap it"]


def _trainer(tmp_path, *sets):
    from largebatch.trainer import Trainer

    cfg = config.load("fashion_mnist", [
        "model.width=4", "data.dataset=synthetic", "data.synthetic_size=128", "data.image_size=12",
        "batch.global_batch=32", "train.plots=false", "train.log_every=1", *sets])
    return Trainer(cfg, tmp_path, quiet=True)


class FakeDeviceMemory:
    """A device with room for `limit` images a training forward pass: a larger batch raises
    torch.OutOfMemoryError, as the CUDA caching allocator does, here before any layer (and BatchNorm's statistics)
    has run; a real one may fail part-way, after some BatchNorm layers updated their running statistics."""

    def __init__(self, model, limit: int) -> None:
        self.limit, self.batches = limit, []
        model.register_forward_pre_hook(self.check)

    def check(self, module, args):
        if not module.training:   # evaluation batches are another matter (scoring.py)
            return
        self.batches.append(len(args[0]))
        if len(args[0]) > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(args[0])} images")


def test_an_early_out_of_memory_halves_the_forward_batch_and_trains_as_the_smaller_micro_batch(tmp_path, capsys):
    retried = _trainer(tmp_path / "a", "train.max_steps=4")
    fake = FakeDeviceMemory(retried.model, limit=10)
    retried.fit()
    err = capsys.readouterr().err
    assert "out of memory at step 0 with forward batches of 32 images per worker; retrying the step with 16" in err
    assert "retrying the step with 8" in err and retried.train_step.forward_cap == 8
    assert fake.batches[:3] == [32, 16, 8] and set(fake.batches[3:]) == {8}
    small = _trainer(tmp_path / "b", "train.max_steps=4", "batch.micro_batch=8")
    small.fit()
    for (k, a), b in zip(retried.model.state_dict().items(), small.model.state_dict().values()):
        assert torch.equal(a, b), k   # the same global batch, lr and forward batches: the same run
    retried.close()
    small.close()


def test_a_later_out_of_memory_is_one_sentence_naming_micro_batch(tmp_path):
    trainer = _trainer(tmp_path, "train.max_steps=6")
    trainer.fit()   # 6 steps without trouble
    FakeDeviceMemory(trainer.model, limit=10)
    trainer.total_steps = 8
    with pytest.raises(UserError) as err:
        trainer.fit()
    assert "the device ran out of memory at step 6 with forward batches of 32 images per worker" in str(err.value)
    assert str(err.value).endswith("set batch.micro_batch below 32 (e.g. 16), or train.device_memory_gb to what the "
                                   "device can give and batch.micro_batch to auto.")
    trainer.close()


def test_plan_prints_memory_per_device_from_the_catalog_and_refuses_a_model_that_does_not_fit(capsys):
    """`largebatch plan` takes the device's memory from the catalog (with its source) and times the per-device
    batch as the micro-batches that fit; a model whose state alone does not fit gets no time, one sentence."""
    import json

    from largebatch.commands import plan

    assert plan.main(["imagenet_resnet50_lars_32k", "--device", "h100", "--devices", "8", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["per_device_batch"], p["micro_batch"], p["accumulation"]) == (4096, 1024, 4)
    assert "NVIDIA H100 SXM5 datasheet: 80 GB HBM3" in p["memory"] and "74.5 GiB" in p["memory"]
    assert plan.main(["imagenet_resnet50_lars_32k", "--device", "h100", "--devices", "256", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accumulation"] == 1   # 128 per device fits in one pass
    with pytest.raises(UserError, match=r"model resnet50 at width 640 does not fit in memory: its state alone \(.* GiB "
                                        r"with a .* GiB margin and NCCL buffers 0.5 GiB\) is more than the 14.9 GiB of NVIDIA Tesla V100"):
        plan.main(["--device", "v100", "--width", "640", "--json"])


def test_what_else_the_gpu_holds_is_subtracted_from_the_micro_batchs_memory_and_said():
    """NCCL's buffers (2+ workers) and data.decode gpu's cache and decoded images are held on the GPU besides the
    model: the micro-batch gets less, the dry run names each part; the cache is one budget for the run."""
    from largebatch import memory
    from largebatch.data.imagefolder import split_cache

    base = ["train.device_memory_gb=40", "data.dataset=imagefolder", "data.train_size=1281167", "train.precision=bf16"]
    alone = dry_run(config.load("imagenet_resnet50_lars_32k", base), 8, "--world-size")
    cached = dry_run(config.load("imagenet_resnet50_lars_32k", [*base, "data.decode=gpu", "data.gpu_cache_gb=12"]),
                     8, "--world-size")
    assert "NCCL buffers 0.5 GiB" in alone["memory"] and "data.gpu_cache_gb" not in alone["memory"]
    assert "data.gpu_cache_gb 12.0 GiB" in cached["memory"] and "decoded images" in cached["memory"]
    assert cached["micro_batch"] < alone["micro_batch"]
    assert cached["micro_batch"] * cached["accumulation"] == alone["per_worker_batch"]   # the batch as asked
    one = dry_run(config.load("imagenet_resnet50_lars_32k", base), 1, "--world-size")
    assert "NCCL" not in one["memory"]
    assert memory.others_on_device(config.load("fashion_mnist"), "cpu", 8, 256) == []
    train, test = split_cache(12.0, 1_281_167, 50_000)
    assert train + test == pytest.approx(12.0) and test == pytest.approx(12.0 * 50_000 / 1_331_167)
    assert split_cache(0.0, 10, 10) == (0.0, 0.0)


def test_a_gpu_is_planned_with_its_free_memory(monkeypatch):
    """In a run: the rank's own GPU's free memory (mem_get_info), not its total; in a dry run on a GPU host: the
    least free of the GPUs, read in a child process (`gpu_memory`); without a GPU the source says how to plan one."""
    from largebatch import memory

    gib = memory.GIB
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake H100")
    got, source = memory.device_memory("cuda", torch.device("cuda", 1), 8, None)
    assert got == 30 * gib and "30.0 of 80.0 GiB free" in source and "Fake H100" in source
    monkeypatch.setattr(memory, "gpu_memory", lambda: [("Fake H100", 70 * gib, 80 * gib), ("Fake H100", 60 * gib,
                                                                                             80 * gib)])
    got, source = memory.device_memory("cuda", None, 8, None)
    assert got == 60 * gib and "least of 2 GPUs" in source
    monkeypatch.setattr(memory, "gpu_memory", lambda: [])
    got, source = memory.device_memory("cuda", None, 8, None)
    assert "set train.device_memory_gb" in source
    assert memory.device_memory("cuda", None, 8, 80.0) == (80 * gib, "train.device_memory_gb 80")


def test_the_child_process_probe_lists_each_gpu(monkeypatch, capsys):
    """`gpu_memory`'s child program, run here against a stand-in torch.cuda of two GPUs: one [name, free, total]
    per device, the JSON `gpu_memory` parses."""
    import json

    from largebatch import memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"GPU{i}")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (10 + i, 80))
    exec(memory._PROBE, {})
    assert json.loads(capsys.readouterr().out) == [["GPU0", 10, 80], ["GPU1", 11, 80]]
