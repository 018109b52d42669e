"""One run plan (largebatch/runplan.py): the trainer, `train --dry-run` and `plan` decide the memory, the micro-batch,
the accumulation and the steps per epoch in one function, and so agree on every figure they share."""
from __future__ import annotations

import json

import pytest

from largebatch import config, memory, runplan
from largebatch.commands import plan as plan_cmd
from largebatch.commands.train import dry_run

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]


def _need(text: str) -> str:
    """A memory description without where the device's figure came from: '1024 images a forward pass need 70.1
    GiB of 74.5 GiB' and the parts after the source."""
    head, rest = text.split(" (", 1)
    return head + " | " + rest.split("): ", 1)[1]


@pytest.mark.parametrize("recipe,devices", [("imagenet_resnet50_lars_32k", 8), ("imagenet_resnet50_lars_32k", 256),
                                             ("imagenet_resnet50_sony_batch_control", 64)])
def test_plan_and_the_dry_run_agree_on_every_figure_they_share(capsys, recipe, devices):
    """`plan RECIPE --device h100 --devices N` and the dry run of the same recipe on N workers of an H100's memory
    (the catalog's 80 GB): the same per-device batch, micro-batch, accumulation and steps per epoch, and the same
    memory figures (the estimate and what else the GPU holds)."""
    h100 = 80e9 / memory.GIB
    dry = dry_run(config.load(recipe, [f"train.device_memory_gb={h100!r}", "data.train_size=1281167"]), devices,
                  "--world-size")
    assert plan_cmd.main([recipe, "--device", "h100", "--devices", str(devices), "--devices-per-node", "8",
                          "--train-size", "1281167", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    phases = p["phases"] or [p]   # a run of one batch: its figures are the plan's own
    assert [(ph["global_batch"], ph["per_device_batch"], ph["micro_batch"], ph["accumulation"], ph["steps_per_epoch"])
            for ph in phases] == [(ph["global_batch"], ph["per_worker_batch"], ph["micro_batch"],
                                        ph["accumulation"], ph["steps_per_epoch"]) for ph in dry["phases"]]
    main = next(ph for ph in dry["phases"] if ph["per_worker_batch"] == p["per_device_batch"])
    assert (p["micro_batch"], p["accumulation"], p["steps_per_epoch"]) == (
        main["micro_batch"], main["accumulation"], main["steps_per_epoch"])
    assert _need(p["memory"]) == _need(dry["memory"])
    assert "NVIDIA H100" in p["memory"] and "train.device_memory_gb" in dry["memory"]


def test_the_trainer_runs_the_plan_its_dry_run_shows(tmp_path, capsys):
    """A run whose device memory makes `batch.micro_batch: auto` split its batch: the trainer's phases and memory
    are the dry run's, and it says the split as the dry run describes it."""
    from largebatch.trainer import Trainer

    tiny = ["data.dataset=synthetic", "data.synthetic_size=256", "data.image_size=16", "model.width=4",
            "batch.global_batch=64", "train.plots=false", "train.max_steps=1", "train.device=cpu"]
    probe = runplan.decide(config.load("fashion_mnist", tiny), _info(tiny), world_size=1, local_workers=1,
                           train_size=256, device_type="cpu", device_memory=(memory.GIB, "probe"))
    est = probe.estimate
    assert est is not None
    room = (est.state_bytes + 12 * est.per_image_bytes) / 0.8   # 12 images past the state, under the 20% margin
    cfg = config.load("fashion_mnist", [*tiny, f"train.device_memory_gb={room / memory.GIB!r}"])
    dry = dry_run(cfg, 1, "--world-size")
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        phases = [(p.global_batch, p.per_worker_batch, p.micro_batch, p.accumulation, p.steps_per_epoch)
                  for p in trainer.plan.phases]
        assert phases == [(ph["global_batch"], ph["per_worker_batch"], ph["micro_batch"], ph["accumulation"],
                           ph["steps_per_epoch"]) for ph in dry["phases"]]
        assert trainer.plan.total_steps == dry["total_steps"]
        assert 1 < phases[0][3] and phases[0][2] <= 12   # it did split: the test shows something
        assert trainer.memory is not None and trainer.memory.describe(phases[0][2]) == dry["memory"]
    finally:
        trainer.close()
    assert f"as {phases[0][3]} micro-batches of {phases[0][2]}" in capsys.readouterr().err


def _info(overrides):
    from largebatch.data import build_data

    return build_data(config.load("fashion_mnist", overrides).data, 0)[2]
