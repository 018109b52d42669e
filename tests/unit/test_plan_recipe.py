"""`largebatch plan` for a user's own run (issue 33): a recipe as input, the default software stack, the H200,
largebatch's own measured speed, P100 fp16 and where the time goes. Expected values are computed from the recipe
files, the catalog and the published figures, not copied from the code's output."""
from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
import yaml

from largebatch import cli
from largebatch.errors import UserError
from largebatch.perf import predict
from largebatch.perf.catalog import PACKAGE_CATALOG, default_stack, get_device, stack_factor

ROOT = Path(__file__).resolve().parents[2]
CATALOG = yaml.safe_load(PACKAGE_CATALOG.read_text())


def plan(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli.main(["plan", *map(str, argv)])
    return rc, buf.getvalue()


def plan_json(*argv: str) -> dict:
    rc, out = plan(*argv, "--json")
    assert rc == 0
    return json.loads(out)


def test_a_recipe_equals_the_same_plan_given_by_flags():
    """Done means: `plan recipes/imagenet_resnet50_lars_32k.yaml --devices 512 --devices-per-node 8 --device h100`
    equals the plan of the recipe's values given as flags (read here from the YAML, under the recipe's own names)."""
    path = ROOT / "recipes" / "imagenet_resnet50_lars_32k.yaml"
    r = yaml.safe_load(path.read_text())
    common = ["--devices", 512, "--devices-per-node", 8, "--device", "h100"]
    from_recipe = plan_json(path, *common)
    assert from_recipe.pop("recipe") == str(path)
    flags = plan_json(*common, "--model", r["model"]["name"], "--stem", r["model"]["stem"],
                      "--image-size", r["data"]["image_size"], "--train-size", r["data"]["train_size"],
                      "--global-batch", r["batch"]["global_batch"], "--epochs", r["schedule"]["epochs"],
                      "--precision", r["train"]["precision"], "--optimizer", r["optim"]["name"],
                      "--eval-every", 1)   # train.eval_every's default: the recipe evaluates every epoch
    assert from_recipe == flags
    assert from_recipe["global_batch"] == 32768 and from_recipe["epochs"] == 100 and from_recipe["devices"] == 512
    # a flag overrides the recipe's value of the same name
    over = plan_json(path, *common, "--global-batch", 16384)
    assert over["global_batch"] == 16384 and over["per_device_batch"] == 32


def test_a_recipe_s_batch_phases_and_grid():
    """Sony's recipe: 5 epochs at 34,816 then 85 at 69,632 cost what the two phases cost as two flag plans
    (evaluation aside); comm.grid's form XxY is --grid's; a grid that does not hold --devices is one sentence."""
    common = ["--device", "v100", "--devices", 2176, "--devices-per-node", 4, "--intra-node", "nvlink2",
              "--inter-node", "ib-edr:2", "--algorithm", "torus2d", "--grid", "4x544", "--eval-images", 0]
    whole = plan_json("imagenet_resnet50_sony_batch_control", *common)
    parts = [plan_json(*common, "--global-batch", gb, "--epochs", ep) for gb, ep in ((34816, 5), (69632, 85))]
    assert whole["time_to_train_s"] == pytest.approx(sum(p["time_to_train_s"] for p in parts), rel=1e-9)
    assert [ph["global_batch"] for ph in whole["phases"]] == [34816, 69632]
    assert whole["torus_grid"] == [4, 544]
    assert plan_json(*common, "--global-batch", 69632)["step_time_s"] == \
        plan_json(*[c for c in common if c not in ("--grid", "4x544")], "--torus-x", 4,
                  "--global-batch", 69632)["step_time_s"]
    assert cli.main(["plan", "imagenet_resnet50_sony_batch_control", "--devices", "2176", "--devices-per-node", "4",
                     "--algorithm", "torus2d", "--grid", "4x2"]) == 2


def _newest_release_with_a_figure(device: str) -> str:
    """The rule, written from the catalog's data: MLPerf release stacks holding a figure of `device` itself."""
    found = []
    for name, e in CATALOG["stacks"].items():
        own = (e.get("reference") or {}).get("device") == device or device in (e.get("devices") or {}) \
            or device in (e.get("figures") or [])
        if name.startswith("mlperf-") and own:
            found.append((e["released"], name))
    return max(found)[1] if found else "mlperf-2020"


@pytest.mark.parametrize("device", sorted(CATALOG["devices"]))
def test_the_default_stack_is_largebatch_where_measured_else_the_newest_release(device):
    measured = (CATALOG["stacks"]["largebatch"]["devices"].get(device) or {}).get("precisions") or {}
    for precision in CATALOG["devices"][device]["efficiency"]:
        name, why = default_stack(device, precision)
        expected = "largebatch" if precision in measured else _newest_release_with_a_figure(device)
        assert name == expected, (device, precision, why)
        if not measured:
            assert "largebatch" not in name
    assert ("largebatch" in {default_stack(device, p)[0] for p in CATALOG["devices"][device]["efficiency"]}) == \
        bool(measured)


def test_the_output_names_the_stack_and_how_to_pick_another():
    rc, text = plan("--device", "h100", "--devices", 8)
    assert rc == 0 and "mlperf-v3.0" in text and "--stack NAME" in text and "default: the newest MLPerf release" in text
    out = plan_json("--device", "h200", "--devices", 8, "--global-batch", 3200)
    assert out["stack"] == "largebatch" and "measured on h200 at fp16" in out["stack_reason"]
    given = plan_json("--device", "h200", "--devices", 8, "--global-batch", 3200, "--stack", "mlperf-v4.0")
    assert given["stack"] == "mlperf-v4.0" and given["stack_reason"] == "given"
    # the largebatch stack's figures are H200 ones: the H100 (measured by nobody here) does not default to it
    assert default_stack("h100", "fp16")[0] == "mlperf-v3.0" and default_stack("a100", "bf16")[0] == "mlperf-v2.0"


def test_h200_mlperf_v40_single_node_within_10_percent_and_largebatch_s_own_on_the_default_stack():
    """Done means: 8 H200 at 400 per GPU, 35 epochs, on mlperf-v4.0: MLPerf v4.0's 12.03 min within 10% (a FIT
    row); one H200 at 256 on the default stack: largebatch's measured 5,611 img/s (fp16) and 4,413 (bf16)."""
    run = dict(model="resnet50", device="h200", devices=8, devices_per_node=8, global_batch=3200, epochs=35,
               precision="fp16")
    v4 = predict(stack="mlperf-v4.0", **run)
    assert abs(v4.time_to_train_s / 60 / 12.03 - 1) < 0.10
    assert v4.images_per_s == pytest.approx(63608, rel=0.01)
    bench = json.loads((ROOT / "results" / "gpu" / "bench_train.json").read_text())
    assert bench["machine"].startswith("NVIDIA H200") and bench["batch"] == 256 and bench["model"] == "resnet50"
    for prec, cfg in (("fp16", "fp16-cl"), ("bf16", "bf16-cl")):
        own = predict(model="resnet50", device="h200", devices=1, global_batch=256, precision=prec)
        assert own.stack == "largebatch"
        assert own.images_per_s == pytest.approx(bench["configs"][cfg]["images_per_s"], rel=0.001)
    # --validate shows both, as FIT rows
    rc, text = plan("--validate")
    assert rc == 0
    rows = [line for line in text.splitlines() if "H200" in line]
    assert any("v4.0" in r and "time-to-train" in r and "FIT (input)" in r for r in rows)
    assert sum("largebatch bench train" in r and "FIT (input)" in r for r in rows) == 2


def test_h200_catalog_entry_has_datasheet_sources_and_nvlink4():
    h200 = CATALOG["devices"]["h200"]
    assert "H200 datasheet" in h200["peak_source"] and "4.8 TB/s" in h200["memory_source"]
    assert h200["default_intra"] == CATALOG["devices"]["h100"]["default_intra"] == "nvlink4"
    assert get_device("h200", "bf16").peak_flops == get_device("h100", "bf16").peak_flops
    src = CATALOG["stacks"]["largebatch"]["devices"]["h200"]["precisions"]["fp16"]["source"]
    assert "largebatch bench train" in src and "2026-11-26" in src and "results/gpu/bench_train.json" in src


def test_p100_fp16_is_the_published_v100_ratio():
    """P100 fp16 is derived (documented so) from Dell EMC's published V100/P100 fp16 ratio: V100 124% faster."""
    kw = dict(model="resnet50", devices=1, global_batch=64, precision="fp16", stack="mlperf-2020")
    p100, v100 = predict(device="p100", **kw), predict(device="v100", **kw)
    assert p100.images_per_s == pytest.approx(v100.images_per_s / 2.24, rel=1e-3)
    assert "derived" in CATALOG["devices"]["p100"]["efficiency"]["fp16"]["source"]
    assert plan("--device", "p100", "--precision", "fp16", "--devices", 8, "--global-batch", 256)[0] == 0


def test_where_the_time_goes_adds_up_and_a_slow_loader_shows_as_data():
    common = ["--device", "h200", "--devices", 8, "--global-batch", 3200, "--epochs", 35]
    out = plan_json(*common)
    parts = out["where_the_time_goes_s"]
    assert sum(parts.values()) == pytest.approx(out["time_to_train_s"], rel=1e-9) and parts["data"] == 0
    # a loader of 3,056 img/s per GPU (docs/gpu.md's 16-worker figure) under a step that could do more
    slow = plan_json(*common, "--data-images-per-s", 3056)
    assert slow["step_time_s"] == pytest.approx(400 / 3056, rel=1e-9)
    steps = 35 * 1281167 / 3200
    assert slow["where_the_time_goes_s"]["data"] == pytest.approx(
        steps * (400 / 3056 - out["step_time_s"]), rel=1e-9)
    assert slow["images_per_s"] == pytest.approx(8 * 3056, rel=1e-9)
    rc, text = plan(*common)
    for words in ("time to train", "images/s", "efficiency", "compute", "exposed communication", "evaluation",
                  "data"):
        assert words in text


def test_stack_factor_per_precision_and_carried_over():
    """The largebatch stack's H200 factor differs by precision (its bf16 step is slower); on a device it was not
    measured on, --stack largebatch carries the H200 fp16 factor over."""
    assert stack_factor("largebatch", "h200", "bf16") < stack_factor("largebatch", "h200", "fp16")
    assert stack_factor("largebatch", "a100", "fp16") == stack_factor("largebatch", "h200", "fp16")
    assert math.isclose(stack_factor("mlperf-v4.0", "h100"), stack_factor("mlperf-v3.0", "h100"))


def test_calibrate_device_choice_and_gpu_entries(monkeypatch):
    from largebatch.perf import calibrate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert calibrate.resolve_device("auto") == "cpu"
    with pytest.raises(UserError, match="calibration on cuda needs a CUDA device"):
        calibrate.resolve_device("cuda")
    # the GPU entry from timings: 2 GPUs, a 1024^3 bf16 matmul in 1 ms, steps of 10 ms at 64 and 34 ms at 256
    spec = dict(device="cuda", b1=64, b2=256, precision="bf16", matmul_n=1024, model="resnet18", stem="small",
                width=4, in_channels=1, image_size=28, num_classes=10, copy_bytes=2**30, sizes=[2**20, 2**24, 2**26],
                threads=8)
    res = [dict(matmul_s=1e-3, t1=0.010, t2=0.034, copy_s=1e-3, allreduce={2**20: 1e-4, 2**24: 1e-3, 2**26: 3e-3})] * 2
    e = calibrate.entries(res, spec, when="then", gpu_name="GPU X")
    dev = e["devices"]["this-machine"]
    assert dev["peak_tflops"] == {"bf16": pytest.approx(2 * 1024**3 / 1e-3 / 1e12)}
    assert dev["efficiency"]["bf16"]["b_half"] == pytest.approx(0.010 / (0.024 / 192) - 64)
    assert dev["default_intra"] == "this-machine-gpus" and "NCCL" in e["links"]["this-machine-gpus"]["source"]
    assert dev["memory_gbs"] == pytest.approx(2 * 2**30 / 1e-3 / 1e9)
    one = calibrate.entries(res[:1], spec, when="then", gpu_name="GPU X")
    assert "links" not in one and one["devices"]["this-machine"]["default_intra"] == "none"


def test_resolution_phases_cost_what_their_parts_cost(tmp_path):
    """data.resolution_phases (progressive resizing): 10 epochs at 128 px then 6 at 224 px cost the two plans'
    sum; a recipe file carrying them gives the same."""
    kw = dict(model="resnet50", device="a100", devices=8, global_batch=1024, precision="bf16", eval_every=0)
    whole = predict(epochs=16, image_size=224, resolution_phases=[(0, 128), (10, 224)], **kw)
    parts = predict(epochs=10, image_size=128, **kw).time_to_train_s + predict(epochs=6, image_size=224,
                                                                                **kw).time_to_train_s
    assert whole.time_to_train_s == pytest.approx(parts, rel=1e-9)
    assert [ph["image_size"] for ph in whole.phases] == [128, 224]
    recipe = tmp_path / "progressive.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name": "resnet50", "stem": "imagenet"},
        "data": {"dataset": "imagefolder", "image_size": 224, "train_size": 1281167,
                 "resolution_phases": [{"start_epoch": 0, "image_size": 128}, {"start_epoch": 10, "image_size": 224}]},
        "batch": {"global_batch": 1024}, "schedule": {"epochs": 16}, "train": {"precision": "bf16"}}))
    out = plan_json(recipe, "--device", "a100", "--devices", 8, "--eval-images", 0)
    assert out["time_to_train_s"] == pytest.approx(parts, rel=1e-9)
