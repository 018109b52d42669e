"""`largebatch study batch-scaling`: the cell plan (lr grid x seeds, or a tuning study's choices), the
summary and its writers, and a tiny real study that is interrupted, resumed, then run as a final study."""
import json
import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_cli

from largebatch import config as config_mod
from largebatch.commands import study
from largebatch.commands.study import cells as cells_mod
from largebatch.commands.study import directory, plan, tables, verdict
from largebatch.commands.study import tuning as tuning_mod
from largebatch.commands.study.kinds import KINDS, parser
from largebatch.commands.study.summary import chosen_lrs, machines, mean_std, summarise
from largebatch.commands.study.summary import tables as summary_tables
from largebatch.errors import UserError

SCALING, ENSEMBLE = KINDS["batch-scaling"], KINDS["ensemble"]


def _layout(*flags: str) -> plan.Layout:
    return plan.scaling_layout(SCALING, parser("batch-scaling").parse_args(list(flags)))


def _cells_of(layout: plan.Layout, seeds: int, grid: dict, chosen: dict | None = None) -> list[tuple]:
    return [(*group.key, lr, s) for group, lr, s in plan.plan_cells(layout, seeds, grid, chosen)]

pytestmark = pytest.mark.timeout(300)


def test_plan_expands_the_lr_grid_and_seeds():
    grid = plan.lr_grid(["lars:1,2,4"], ["sgd", "lars"])
    assert grid == {"lars": [1.0, 2.0, 4.0]}
    cells = _cells_of(_layout("--batches", "64,384", "--optimizers", "sgd,lars"), 2, grid)
    assert len(cells) == 2 * 2 * (1 + 3)
    assert cells[:4] == [(64, "sgd", None, 0), (64, "lars", 1.0, 0), (64, "lars", 2.0, 0), (64, "lars", 4.0, 0)]
    assert {c[3] for c in cells[:8]} == {0}            # seeds outermost: a stopped study has whole seeds done
    chosen = _cells_of(_layout("--batches", "64", "--optimizers", "lars"), 3, {}, chosen={(64, "lars"): 2.0})
    assert chosen == [(64, "lars", 2.0, s) for s in range(3)]
    with pytest.raises(UserError, match="no choice for sgd at batch 64; tune that cell too"):
        _cells_of(_layout("--batches", "64", "--optimizers", "sgd"), 1, {}, chosen={(64, "lars"): 2.0})
    with pytest.raises(UserError, match="not one of --optimizers"):
        plan.lr_grid(["lamb:1"], ["sgd"])
    with pytest.raises(UserError, match="positive"):
        plan.lr_grid(["sgd:0.1,-1"], ["sgd"])
    assert plan.lr_grid("0.1,0.2", None) == {"*": [0.1, 0.2]} and plan.lr_grid(None, None) == {}   # the variants'
    with pytest.raises(UserError, match="--lr-grid is empty"):
        plan.lr_grid("", None)


def test_claims_only_keeps_the_baseline_and_each_claims_cell():
    pairs = plan.claim_cells([64, 384, 1536, 3072, 6144], ["sgd", "lars", "lamb"])
    assert pairs == {(64, "sgd"), (384, "sgd"), (3072, "sgd"), (1536, "lars"), (1536, "lamb")}
    assert plan.claim_cells([64, 1536], ["sgd", "lars"]) == {(64, "sgd"), (1536, "lars")}
    cells = _cells_of(_layout("--batches", "64,1536", "--optimizers", "sgd,lars", "--claims-only"), 2, {})
    assert cells == [(64, "sgd", None, 0), (1536, "lars", None, 0), (64, "sgd", None, 1), (1536, "lars", None, 1)]
    with pytest.raises(UserError, match="add sgd to --optimizers"):
        plan.claim_cells([64, 1536], ["lars"])
    with pytest.raises(UserError, match="no claim's cell is in --batches"):
        plan.claim_cells([64, 128], ["sgd", "lars"])


def test_the_claims_experiment_reruns_the_committed_final_cells_exactly(tmp_path):
    """experiments/claims.yaml re-checks docs/large_batch.md's claims from the committed tuning choices: the plan
    `largebatch study experiments/claims.yaml --dry-run` expands to is exactly the committed final cells the claims
    read (same lr, same --set list, from schedules stated as fractions of the run), 27 of them."""
    lb = Path(sys.executable).parent / "largebatch"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([str(lb), "study", "claims", "--dry-run", "--out", str(tmp_path / "claims")],   # by name
                          capture_output=True, cwd=tmp_path, text=True, timeout=240)   # paths: the file's own
    assert proc.returncode == 0, proc.stderr

    def without_run_dir(command: str) -> str:
        words = shlex.split(command)
        i = words.index("--run-dir")
        return shlex.join(words[:i] + words[i + 2:])

    listed = [without_run_dir(line.strip()) for line in proc.stderr.splitlines()
              if line.startswith("  largebatch train ")]
    assert not (tmp_path / "claims").exists()
    pairs = study.claim_cells([64, 384, 1536, 3072, 6144], ["sgd", "lars", "lamb"])
    committed = []
    for name in ("final", "batch_control/final", "ensemble/final"):
        cells = json.loads((root / "results/large_batch" / name / "study.json").read_text())["cells"]
        committed += [without_run_dir(c["command"]) for c in cells
                      if name != "final" or (c["batch"], c["optimizer"]) in pairs]
    assert len(listed) == 27 and sorted(listed) == sorted(committed)
    rerun = [without_run_dir(c["command"]) for name in ("batch_scaling", "batch_control", "ensemble")
             for c in json.loads((root / "results/large_batch/claims" / name / "study.json").read_text())["cells"]]
    assert sorted(rerun) == sorted(listed)   # and the committed re-check ran exactly these


def test_cell_overrides_and_directories():
    args = SimpleNamespace(opt_set=[], micro_batch=512, epochs=24, overrides=["model.width=8"], val_split=10000)
    sets = plan.cell_overrides(args, 384, "lars", 1, lr=4.0)
    assert sets[0] == "model.width=8" and "optim.lr=4" in sets and "data.val_split=10000" in sets
    assert "batch.global_batch=384" in sets and "train.seed=1" in sets and "schedule.epochs=24" in sets
    (group,) = _layout("--batches", "384", "--optimizers", "lars").groups
    assert group.fields == {"batch": 384, "optimizer": "lars"} and "optim.lr=4" in group.sets(4.0, 1)
    assert plan.cell_dir(Path("o"), group, 4.0, 1).name == "lars-b384-lr4-s1"
    assert plan.cell_dir(Path("o"), group, None, 1).name == "lars-b384-s1"   # without a grid: as before


def _cells():
    rows = []
    for lr, accs in ((1.0, [0.80, 0.82]), (2.0, [0.85, 0.87]), (4.0, [0.70, 0.60])):
        rows += [{"batch": 384, "optimizer": "lars", "lr": lr, "seed": s, "top1": a, "train_loss": 0.5}
                 for s, a in enumerate(accs)]
    rows.append({"batch": 64, "optimizer": "lars", "lr": 1.0, "seed": 0, "top1": None})   # not run yet
    return rows


def test_summary_marks_the_best_lr_and_the_writers_show_it(tmp_path):
    table = summarise(SCALING, _cells())
    assert set(table) == {"lars@384/lr1", "lars@384/lr2", "lars@384/lr4"}
    best = table["lars@384/lr2"]
    assert best["chosen"] and not table["lars@384/lr1"]["chosen"]
    assert best["top1_mean"] == pytest.approx(0.86) and best["top1_std"] == pytest.approx(0.01414, rel=1e-3)
    md = tables.grid_markdown(table, [64, 384], ["lars"], "validation")
    assert "lars validation top-1" in md and "| 384 | 86.00 ± 1.41 (n=2) | 2 (best of 3) |" in md
    assert "| 64 | (not run)" in md
    png = tmp_path / "s.png"
    tables.plot(table, ["lars"], png, train_size=50000, split="validation")
    assert png.stat().st_size > 1000
    # an optimum at the grid's edge is marked, and the noise scale of the chosen lr is tabled
    edge = [dict(c, top1=0.9, noise_scale=1500.0) if c.get("lr") == 4.0 else c for c in _cells()]
    md = tables.grid_markdown(summarise(SCALING, edge), [64, 384], ["lars"])
    assert "| 4 (best of 3, at the edge) |" in md and "| 384 | 1,500 |" in md
    # a diverged lr counts as tried: above the best, the best is no longer at the grid's edge
    gone = edge + [{"batch": 384, "optimizer": "lars", "lr": 8.0, "seed": 0, "top1": None, "diverged": True}]
    md = tables.grid_markdown(summarise(SCALING, gone), [64, 384], ["lars"])
    assert "| 4 (best of 4, 1 diverged) |" in md
    tuned = tmp_path / "study.json"
    tuned.write_text(json.dumps({"val_split": 10000, "table": table}))
    assert tuning_mod.chosen_lrs_of([tmp_path], SCALING) == {(384, "lars"): 2.0}
    assert chosen_lrs([(("a",), 0.5, 1.0), (("a",), 0.7, 2.0), (("a",), 0.7, 4.0)]) == {("a",): 2.0}   # ties: first
    tuned.write_text(json.dumps({"val_split": None, "table": table}))
    with pytest.raises(UserError, match="was not run with --val-split"):
        tuning_mod.chosen_lrs_of([tmp_path], SCALING)


def test_the_claims_table_judges_against_sgd_at_the_smallest_batch():
    cells = [{"batch": b, "optimizer": o, "lr": 1.0, "seed": s, "top1": t + 0.001 * s, "train_loss": 0.3}
             for b, o, t in ((64, "sgd", 0.930), (384, "sgd", 0.925), (3072, "sgd", 0.900), (1536, "lars", 0.915))
             for s in range(3)]
    rows = {(r["optimizer"], r["batch"]): r for r in verdict.judge(SCALING, summarise(SCALING, cells))}
    assert set(rows) == {("sgd", 384), ("sgd", 3072), ("lars", 1536)}          # LAMB did not run: no row
    assert rows[("sgd", 384)]["held"] and rows[("sgd", 384)]["difference"] == pytest.approx(-0.005)
    assert rows[("sgd", 3072)]["held"]                                          # the breakdown: 3 points below
    assert not rows[("lars", 1536)]["held"]                                     # 1.5 points below: not within 1
    md = tables.claims_markdown(list(rows.values()), "test")
    assert "| You et al.: LARS at ImageNet 32K" in md and "| -1.50 ± 0.10 | did not hold |" in md


def test_noise_scale_of_a_run_is_a_ratio_of_means_over_its_second_half(tmp_path):
    recs = [{"kind": "train", "step": i, "epoch": e, "grad_sq": g2, "grad_trace": tr, "loss": 1.0}
            for i, (e, g2, tr) in enumerate(((0.5, 1.0, 1000.0), (1.5, 2.0, 100.0), (2.0, 1.0, 500.0)))]
    eval_rec = {"kind": "eval", "step": 3, "top1": 0.5}
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs + [eval_rec]))
    assert cells_mod.noise_scale(tmp_path) == pytest.approx((100.0 + 500.0) / (2.0 + 1.0))   # epochs >= 1.0 only
    assert cells_mod.noise_scale(tmp_path / "missing") is None


def test_a_study_continues_with_a_grown_lr_grid_or_tuning_list_only():
    old = {"recipe": "fashion_mnist", "epochs": 8, "lr_grid": ["lars:1,2,4", "sgd:0.5"], "from_tuning": None}
    grown = {**old, "lr_grid": ["lars:1,2,4,8", "sgd:0.5"]}
    assert directory.same_study(old, grown, ["sgd", "lars"])
    assert directory.same_study(old, old, ["sgd", "lars"])
    assert not directory.same_study(grown, old, ["sgd", "lars"])                      # a value dropped
    assert not directory.same_study(old, {**grown, "epochs": 9}, ["sgd", "lars"])       # anything else changed
    # a final study takes a tuning study added at the end of its --from-tuning list (a re-run, a cell tuned later)
    final = {"recipe": "fashion_mnist", "epochs": 24, "lr_grid": [], "from_tuning": "t/a, t/b"}
    assert directory.same_study(final, {**final, "from_tuning": "t/a, t/b, t/rerun"}, ["sgd"])
    assert not directory.same_study(final, {**final, "from_tuning": "t/a"}, ["sgd"])               # one dropped
    assert not directory.same_study(final, {**final, "from_tuning": "t/rerun, t/a, t/b"}, ["sgd"])  # not at the end
    assert not directory.same_study(final, {**final, "from_tuning": "t/a, t/bc"}, ["sgd"])
    assert not directory.same_study({**final, "from_tuning": None}, final, ["sgd"])       # a grid study is not a final
    # the variant studies (batch-control, ensemble) follow the same rule with their one grid (--lr-grid A,B)
    variants = {"batch": 3072, "epochs": 8, "lr_grid": "0.03125,0.0625", "from_tuning": None}
    assert directory.same_study(variants, {**variants, "lr_grid": "0.03125,0.0625,0.125"})
    assert not directory.same_study(variants, {**variants, "lr_grid": "0.0625"})
    assert not directory.same_study(variants, {**variants, "batch": 1536})
    assert mean_std([0.5]) == (0.5, 0.0) and mean_std([1.0, 3.0]) == (2.0, math.sqrt(2.0))


def test_each_cell_keeps_the_machine_it_ran_on_when_a_study_moves(tmp_path):
    """A study resumed on another machine: a cell finished before summary.json named its machine keeps the one
    the study.json of that time gave (the machine then running the study), a new cell its summary's; study.md
    names both with their counts."""
    out = tmp_path / "final"
    old, new = out / "runs" / "sgd-b32-lr1-s0", out / "runs" / "sgd-b32-lr1-s1"
    for run_dir, machine in ((old, None), (new, "New CPU (flags: avx2 fma), 2 cores")):
        run_dir.mkdir(parents=True)
        summary = {"final_top1": 0.9, "final_top5": 1.0, "final_loss": 0.3, "steps": 10, "wall_s": 60.0, "epochs": 1.0}
        (run_dir / "summary.json").write_text(json.dumps({**summary, **({"machine": machine} if machine else {})}))
    (out / "study.json").write_text(json.dumps({"machine": "Old CPU (flags: avx2 fma avx512f), 2 cores", "cells": [
        {"run_dir": str(old), "top1": 0.9}, {"run_dir": str(new), "top1": None}]}))
    earlier = cells_mod.earlier_machines(out)
    assert earlier == {str(old): "Old CPU (flags: avx2 fma avx512f), 2 cores"}   # only finished cells
    args = SimpleNamespace(recipe="fashion_mnist", nproc_per_node=1, dry_run=False)
    cells = [cells_mod.run_cell(args, d, [], "cell", "1/2", None, earlier) for d in (old, new)]
    assert [c["machine"] for c in cells] == ["Old CPU (flags: avx2 fma avx512f), 2 cores",
                                             "New CPU (flags: avx2 fma), 2 cores"]
    assert machines(cells) == ("machines (each cell's in study.json): Old CPU (flags: avx2 fma avx512f), "
                                     "2 cores, 1 cell; New CPU (flags: avx2 fma), 2 cores, 1 cell")
    assert machines(cells[1:]) == "machine: New CPU (flags: avx2 fma), 2 cores"
    assert cells_mod.run_cell(args, old, [], "cell", "1/2", None)["machine"] is None   # no record: not guessed


def test_a_tiny_study_resumes_then_runs_the_chosen_lr_on_the_test_set(cli, tmp_path):
    common = ["--batches", "32", "--optimizers", "sgd", "--nproc-per-node", "1", "--epochs", "1",
              "--set", "data.dataset=synthetic", "--set", "data.synthetic_size=160", "--set", "data.image_size=8",
              "--set", "model.width=4", "--set", "schedule.warmup_epochs=0"]
    tune = tmp_path / "tune"
    cli("study", "batch-scaling", *common, "--lr-grid", "sgd:0.05,0.4", "--val-split", "32", "--out", tune,
        check=True)
    first = json.loads((tune / "study.json").read_text())
    assert [c["lr"] for c in first["cells"]] == [0.05, 0.4] and all(c["top1"] is not None for c in first["cells"])
    assert all("data.val_split=32" in c["command"] for c in first["cells"])
    # interrupt the second cell after the fact: its summary gone, its checkpoints kept
    kept = tune / "runs" / "sgd-b32-lr0.05-s0" / "summary.json"
    stamp = kept.stat().st_mtime_ns
    (tune / "runs" / "sgd-b32-lr0.4-s0" / "summary.json").unlink()
    again = cli("study", "batch-scaling", *common, "--lr-grid", "sgd:0.05,0.4", "--val-split", "32", "--out", tune,
                check=True)
    assert "(resuming)" in again.stderr and kept.stat().st_mtime_ns == stamp   # the finished cell is reused
    resumed = json.loads((tune / "study.json").read_text())
    assert all(c["top1"] is not None for c in resumed["cells"])
    from largebatch.metrics import machine   # each cell names the machine it ran on, from its summary.json
    import torch
    assert {c["machine"] for c in resumed["cells"]} == {machine(torch.device("cpu"))}
    # other settings in the same directory are refused
    other = cli("study", "batch-scaling", *common, "--out", tune)
    assert other.returncode == 2 and "holds a study with other settings" in other.stderr
    # the final study: the chosen lr, on the test set
    final = tmp_path / "final"
    cli("study", "batch-scaling", *common, "--from-tuning", tune, "--out", final, check=True)
    chosen = tuning_mod.chosen_lrs_of([tune], SCALING)[(32, "sgd")]
    (cell,) = json.loads((final / "study.json").read_text())["cells"]
    assert cell["lr"] == chosen and "val_split" not in cell["command"]
    assert "test top-1" in (final / "study.md").read_text()
    assert "machine time of the finished cells: " in (final / "study.md").read_text()
    # any cell re-runs from the command study.json recorded, to the same top-1 (training is deterministic)
    argv = shlex.split(cell["command"])[1:]
    argv[argv.index("--run-dir") + 1] = str(tmp_path / "rerun")
    cli(*argv, "--quiet", check=True)
    assert json.loads((tmp_path / "rerun" / "summary.json").read_text())["final_top1"] == cell["top1"]


def test_variant_studies_plan_summarise_and_judge(tmp_path):
    args = parser("batch-control").parse_args(["--epochs", "24", "--switch-epochs", "6"])
    control = plan.variants("batch-control", args)
    assert "batch.phases=[]" in control["fixed"]
    assert any(s.startswith("batch.phases=[{start_epoch: 0, global_batch: 384}, {start_epoch: 6, global_batch: 3072}]")
               for s in control["control"])
    with pytest.raises(UserError, match="--switch-epochs"):
        plan.variants("batch-control", parser("batch-control").parse_args(["--switch-epochs", "30"]))
    ens = plan.variants("ensemble", parser("ensemble").parse_args(["--epochs", "24", "--cycles", "2",
                                                                    "--cycle-epochs", "4"]))
    assert "schedule.epochs=16" in ens["ensemble"] and "ensemble.cycles=2" in ens["ensemble"]
    assert "schedule.epochs=24" in ens["single"] and "ensemble.cycles=0" in ens["single"]
    cells = ([{"variant": "single", "seed": s, "top1": t} for s, t in enumerate([0.90, 0.91, 0.92])]
             + [{"variant": "ensemble", "seed": s, "top1": 0.0, "ensemble_top1": e, "best_snapshot_top1": b,
                 "swa_top1": w} for s, (e, b, w) in enumerate([(0.93, 0.92, 0.94), (0.925, 0.915, 0.935),
                                                               (0.935, 0.925, 0.945)])])
    table = summarise(ENSEMBLE, cells)
    assert table["ensemble"]["top1_mean"] == pytest.approx(0.93)          # the ensemble's own top-1
    assert table["verdict"]["gain_over_best_snapshot"] == pytest.approx(0.01)
    assert table["verdict"]["holds"] is True
    md = tables.variant_body(ENSEMBLE, table, {}, "test", [])
    assert "| ensemble | 93.00 ± 0.50 | 3 | 92.00 ± 0.50 |" in md and "**held**" in md
    assert "| weight average of the snapshots (SWA, BN recomputed) | 94.00 ± 0.50 | 3 | |" in md
    tables.bars(ENSEMBLE, table, tmp_path / "bars.png", "test")
    assert (tmp_path / "bars.png").stat().st_size > 1000
    # the training-loss curves: at the chosen lr only, over the epochs every seed logged
    for c in cells:
        c["run_dir"] = str(tmp_path / f"{c['variant']}-{c['seed']}")
        Path(c["run_dir"]).mkdir()
        losses = [(0.5, 2.0 + c["seed"]), (1.0, 1.0 + c["seed"])] + ([(1.5, 0.5)] if c["seed"] == 0 else [])
        Path(c["run_dir"], "metrics.jsonl").write_text("".join(
            json.dumps({"kind": "train", "step": i, "epoch": e, "loss": v}) + "\n" for i, (e, v) in enumerate(losses)))
    curves = tables.loss_curves(table, cells + [{"variant": "single", "lr": 9.0, "top1": 0.5, "run_dir": "absent"}])
    assert curves["single"] == [(0.5, 3.0, 2.0, 4.0), (1.0, 2.0, 1.0, 3.0)]
    tables.bars(ENSEMBLE, table, tmp_path / "curves.png", "test", curves)
    assert (tmp_path / "curves.png").stat().st_size > (tmp_path / "bars.png").stat().st_size


def test_a_tiny_batch_control_study_tunes_then_runs_both_variants(cli, tmp_path):
    """Tuning on a validation split (every variant at every lr of the grid), then each variant at its own
    chosen lr on the test set."""
    common = ["--epochs", "2", "--seeds", "1", "--batch", "64", "--start-batch", "32", "--switch-epochs", "1",
              "--nproc-per-node", "1", "--set", "data.dataset=synthetic", "--set", "data.synthetic_size=192",
              "--set", "data.image_size=8", "--set", "model.width=4", "--set", "schedule.warmup_epochs=0"]
    tune, out = tmp_path / "tune", tmp_path / "bc"
    cli("study", "batch-control", *common, "--val-split", "64", "--lr-grid", "0.05,0.4", "--out", tune, check=True)
    tuned = json.loads((tune / "study.json").read_text())
    assert sorted((c["variant"], c["lr"]) for c in tuned["cells"]) == [
        ("control", 0.05), ("control", 0.4), ("fixed", 0.05), ("fixed", 0.4)]
    for name in ("fixed", "control"):   # the chosen lr is the variant's best on the validation split
        best = max((c for c in tuned["cells"] if c["variant"] == name), key=lambda c: c["top1"])
        assert tuned["table"][name]["lr"] == best["lr"] and tuned["table"][name]["lrs_run"] == 2
    assert "(best of 2" in (tune / "study.md").read_text()
    refused = cli("study", "batch-control", *common, "--from-tuning", tune, "--val-split", "64", "--out", out)
    assert refused.returncode == 2 and "test set" in refused.stderr
    proc = cli("study", "batch-control", *common, "--from-tuning", tune, "--out", out, check=True)
    data = json.loads((out / "study.json").read_text())
    assert {(c["variant"], c["lr"]) for c in data["cells"]} == {(n, tuned["table"][n]["lr"]) for n in ("fixed", "control")}
    assert all("val_split" not in c["command"] for c in data["cells"])
    assert {c["variant"] for c in data["cells"]} == {"fixed", "control"}
    assert all(c["top1"] is not None for c in data["cells"])
    control = next(c for c in data["cells"] if c["variant"] == "control")
    metrics = [json.loads(line) for line in (Path(control["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert {r["global_batch"] for r in metrics if r["kind"] == "train"} == {32, 64}   # the switch happened
    assert "verdict" in data["table"] and "Claim" in (out / "study.md").read_text()
    assert "machine time of the finished cells: " in (out / "study.md").read_text()
    assert f"Machine: {data['cells'][0]['machine']}; " in (out / "study.md").read_text()   # as written, case kept
    assert "did not hold" in proc.stderr or "held" in proc.stderr


def test_a_dry_run_lists_the_cells_and_writes_nothing(cli, tmp_path):
    """--dry-run checks every cell and lists it; the study directory stays as it was (none created), so a real
    study with other settings can use it afterwards."""
    tiny = ["--set", "data.dataset=synthetic", "--set", "data.synthetic_size=160", "--set", "data.image_size=8",
            "--set", "model.width=4", "--nproc-per-node", "1"]
    for args in (["batch-scaling", "--batches", "32", "--optimizers", "sgd,lars", "--epochs", "1"],
                 ["batch-control", "--batch", "64", "--start-batch", "32", "--switch-epochs", "1", "--epochs", "2"]):
        out = tmp_path / args[0]
        proc = cli("study", *args, *tiny, "--out", out, "--dry-run")
        assert proc.returncode == 0, proc.stderr
        assert "nothing written" in proc.stderr and "cell 1/" in proc.stderr
        assert not out.exists()
        # a dry run checks --out too: a file where the study directory would go is refused, not promised
        (tmp_path / "file").write_text("kept")
        for bad in (tmp_path / "file", tmp_path / "file" / "study"):
            refused = cli("study", *args, *tiny, "--out", bad, "--dry-run")
            assert refused.returncode == 2 and "is a file, not a directory" in refused.stderr, refused.stderr
        assert (tmp_path / "file").read_text() == "kept"


def test_a_tiny_ensemble_study_records_the_ensemble_its_snapshots_and_their_weight_average(cli, tmp_path):
    out = tmp_path / "ens"
    cli("study", "ensemble", "--epochs", "3", "--cycles", "1", "--cycle-epochs", "1", "--collapse-epochs", "0.5",
        "--seeds", "1", "--batch", "64", "--nproc-per-node", "1", "--set", "data.dataset=synthetic",
        "--set", "data.synthetic_size=192", "--set", "data.image_size=8", "--set", "model.width=4",
        "--set", "schedule.warmup_epochs=0", "--set", "ensemble.swa=true", "--set", "ensemble.rewarm_epochs=0.25",
        "--out", out, check=True)
    data = json.loads((out / "study.json").read_text())
    single, = (c for c in data["cells"] if c["variant"] == "single")
    ens, = (c for c in data["cells"] if c["variant"] == "ensemble")
    assert "ensemble_top1" not in single and single["epochs"] == pytest.approx(3)
    assert ens["epochs"] == pytest.approx(3)                      # the same budget: base 2 + 1 cycle of 1
    summary = json.loads((Path(ens["run_dir"]) / "summary.json").read_text())
    assert len(summary["snapshots"]) == 2
    assert ens["ensemble_top1"] == summary["ensemble_top1"] and ens["swa_top1"] == summary["swa_top1"]
    assert ens["best_snapshot_top1"] == max(s["top1"] for s in summary["snapshots"])
    assert data["table"]["ensemble"]["top1_mean"] == ens["ensemble_top1"]
    md = (out / "study.md").read_text()
    assert f"| weight average of the snapshots (SWA, BN recomputed) | {100 * ens['swa_top1']:.2f} ± 0.00 | 1 |" in md
    assert "Claim (ensemble >= single model and >= best snapshot + 0.3)" in md


def test_a_final_study_takes_its_choices_from_several_tuning_studies(cli, tmp_path):
    """Tuning studies of one protocol extend each other (a batch tuned later, lr values past a grid's edge): the
    final study takes the best validation top-1 over all their cells. Studies of different protocols are refused
    in one sentence, since their top-1s do not compare."""
    protocol = {"recipe": "fashion_mnist", "epochs": 1.0, "val_split": 32, "overrides": ["model.width=4"]}

    def tuning(name, rows, **changed):
        (tmp_path / name).mkdir()
        table = {f"{o}@{b}@{lr}": {"batch": b, "optimizer": o, "lr": lr, "top1_mean": top1}
                 for b, o, lr, top1 in rows}
        (tmp_path / name / "study.json").write_text(json.dumps({**protocol, **changed, "table": table}))
        return tmp_path / name

    first = tuning("first", [(32, "sgd", 0.05, 0.6), (32, "sgd", 0.4, 0.7)])
    later = tuning("later", [(16, "sgd", 0.1, 0.65), (16, "sgd", 0.2, 0.55)])
    edge = tuning("edge", [(32, "sgd", 0.8, 0.75), (16, "sgd", 0.05, 0.6)])    # past the grid's edge
    assert tuning_mod.chosen_lrs_of([first, later], SCALING) == {(32, "sgd"): 0.4, (16, "sgd"): 0.1}
    assert tuning_mod.chosen_lrs_of([first, later, edge], SCALING) == {(32, "sgd"): 0.8, (16, "sgd"): 0.1}
    assert tuning_mod.chosen_lrs_of([edge, later, first], SCALING) == tuning_mod.chosen_lrs_of([first, later, edge], SCALING)
    assert tuning_mod.chosen_lrs_of([], SCALING) is None
    # a later study's cell at the same batch, optimizer and lr is a re-run (e.g. after a fix): it replaces the
    # earlier one, which no longer counts
    rerun = tuning("rerun", [(32, "sgd", 0.8, 0.5), (32, "sgd", 0.05, 0.72)])
    assert tuning_mod.chosen_lrs_of([first, later, edge, rerun], SCALING) == {(32, "sgd"): 0.05, (16, "sgd"): 0.1}
    assert tuning_mod.chosen_lrs_of([rerun, first, later, edge], SCALING) == {(32, "sgd"): 0.8, (16, "sgd"): 0.1}
    tiny = ["--optimizers", "sgd", "--epochs", "1", "--nproc-per-node", "1", "--set", "data.dataset=synthetic",
            "--set", "data.synthetic_size=160", "--set", "data.image_size=8", "--set", "model.width=4",
            "--dry-run", "--out", tmp_path / "final"]
    proc = cli("study", "batch-scaling", "--batches", "16,32", "--from-tuning", first, "--from-tuning", later,
               "--from-tuning", edge, *tiny)
    assert proc.returncode == 0, proc.stderr
    assert "sgd batch 16 lr 0.1 seed 0" in proc.stderr and "sgd batch 32 lr 0.8 seed 0" in proc.stderr
    longer = tuning("longer", [(32, "sgd", 0.1, 0.9)], epochs=3.0)
    refused = cli("study", "batch-scaling", "--batches", "32", "--from-tuning", first, "--from-tuning", longer, *tiny)
    assert refused.returncode == 2 and "were tuned differently (epochs)" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_study_cells_under_results_are_committed_but_never_their_weights() -> None:
    """A study's per-cell files under results/ are its evidence and what a stopped study resumes from: git must
    not ignore them (the repository-wide runs/ rule once did), and must ignore their weights, run locks, logs and
    uncompressed per-step metrics (a cell keeps config.yaml, summary.json and metrics.jsonl.gz)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout: no .gitignore rules to check")
    cell = "results/large_batch/final/runs/sgd-b64-lr0.5-s0"

    def ignored(rel: str) -> bool:
        proc = subprocess.run(["git", "check-ignore", "--no-index", "-q", rel], cwd=root, capture_output=True,
                              text=True)
        if proc.returncode not in (0, 1):   # 0: ignored, 1: not; anything else is git itself failing
            pytest.skip(f"git check-ignore could not run here: {proc.stderr.strip()}")
        return proc.returncode == 0

    for name in ("summary.json", "metrics.jsonl.gz", "config.yaml"):
        assert not ignored(f"{cell}/{name}"), name
    for name in ("checkpoints/step_00000100.pt", "snapshots/snapshot_1.pt", "model.pt", ".largebatch.lock",
                 "train.log", "metrics.jsonl"):
        assert ignored(f"{cell}/{name}"), name
    assert ignored("runs/fashion_mnist-20261125/summary.json")   # a user's own runs stay out


@pytest.mark.parametrize("name, results", [("batch_scaling", "results/large_batch"),
                                           ("batch_control", "results/large_batch/batch_control"),
                                           ("collapsed_ensemble", "results/large_batch/ensemble"),
                                           ("recipe_tuning", "results/recipe_tuning"),
                                           ("collapsed_released", "results/large_batch/released")])
def test_each_experiment_file_expands_to_its_committed_study_cells(tmp_path, name, results):
    """experiments/NAME.yaml is the whole protocol of the committed study in results/: its tuning studies (dry run
    into a fresh directory) and then the studies that choose their lrs from those tunings (dry run beside copies
    of the committed tunings' study.json) list exactly the committed cells' commands, every one of them. The
    schedules are written once as fractions of the run; the 8-epoch tuning and the 24-epoch cells both follow."""
    from largebatch.commands import experiment

    root = Path(__file__).resolve().parents[2]
    entries = experiment.load(root / "experiments" / f"{name}.yaml")["studies"]
    dependent = [e["name"] for e in entries if "{out}" in str(e.get("from_tuning", ""))]
    tunings = [e["name"] for e in entries if e["name"] not in dependent]
    for tuning in tunings:
        (tmp_path / "b" / tuning).mkdir(parents=True)
        shutil.copy(root / results / tuning / "study.json", tmp_path / "b" / tuning / "study.json")
    listed = []
    for out, only in ((tmp_path / "a", tunings), (tmp_path / "b", dependent)):
        if not only:   # an experiment of tuning studies only (recipe_tuning)
            continue
        proc = run_cli("study", name, "--dry-run", "--out", out, "--only", ",".join(only), timeout=240)
        assert proc.returncode == 0, proc.stderr
        listed += [_without_run_dir(line.strip()) for line in proc.stderr.splitlines()
                   if line.startswith("  largebatch train ")]
    committed = [_without_run_dir(c["command"]) for study_name in tunings + dependent
                 for c in json.loads((root / results / study_name / "study.json").read_text())["cells"]]
    assert len(listed) == len(committed) > 0 and sorted(listed) == sorted(committed)


def _without_run_dir(command: str) -> str:
    words = shlex.split(command)
    i = words.index("--run-dir")
    return shlex.join(words[:i] + words[i + 2:])


def test_committed_cells_keep_their_numbers_in_compressed_metrics() -> None:
    """results/ keeps each cell's per-step metrics as metrics.jsonl.gz: read back (`metrics.read` takes the
    compressed file where the plain one is absent), they give the study.json record's train loss and noise scale."""
    root = Path(__file__).resolve().parents[2] / "results" / "large_batch" / "final"
    cells = {Path(c["run_dir"]).name: c for c in json.loads((root / "study.json").read_text())["cells"]}
    for name in ("sgd-b64-lr2-s0", "lars-b6144-lr1-s2"):
        run_dir = root / "runs" / name
        assert (run_dir / "metrics.jsonl.gz").is_file() and not (run_dir / "metrics.jsonl").exists()
        assert cells_mod.final_train_loss(run_dir) == cells[name]["train_loss"]
        assert cells_mod.noise_scale(run_dir) == cells[name]["noise_scale"]


def test_every_committed_cells_recorded_command_resolves_to_the_config_it_ran_with() -> None:
    """Behaviour unchanged at the config level: the recorded command of each committed cell in results/ (its
    recipe and --set list; every runs/*/config.yaml there belongs to a cell of its study.json) resolves today to
    exactly the config.yaml that cell trained with (read as a saved config: keys added since take their defaults
    on both sides). A change of a default, of --set
    parsing or of the batch spellings that would make a re-run train something else fails here."""
    root = Path(__file__).resolve().parents[2] / "results"
    checked = 0
    for path in sorted(root.rglob("study.json")):
        for cell in json.loads(path.read_text())["cells"]:
            run_dir = path.parent / "runs" / Path(cell["run_dir"]).name
            if not (run_dir / "config.yaml").exists():
                continue
            words = shlex.split(cell["command"])
            sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
            now = config_mod.load(words[2], sets).to_dict()
            then = config_mod.from_dict(config_mod.load_yaml(run_dir / "config.yaml"), saved=True).to_dict()
            assert {**now, "recipe": None} == {**then, "recipe": None}, run_dir
            checked += 1
    assert checked == len(list(root.glob("**/runs/*/config.yaml"))) >= 160


def _committed_studies() -> list[Path]:
    return sorted((Path(__file__).resolve().parents[2] / "results").rglob("study.json"))


@pytest.mark.parametrize("path", _committed_studies(), ids=lambda p: str(p.parent.relative_to(p.parents[2])))
def test_every_committed_study_is_re_summarised_from_its_cells_byte_for_byte(path):
    """The summariser, the chosen lrs and the verdict rules against every committed study: its study.json written
    again from its own head and cells is the committed file byte for byte (table, chosen lrs, claims and verdicts),
    and so is its study.md from the table on (the line above it names the machines, which cells finished before
    summary.json named its machine do not record)."""
    data = json.loads(path.read_text())
    meta = {k: v for k, v in data.items() if k not in ("cells", "table", "claims")}
    again, body = summary_tables(KINDS[data.get("kind", "batch-scaling")], meta, data["cells"])
    assert json.dumps(again, indent=2) == path.read_text()
    assert (path.parent / "study.md").read_text().split("\n\n", 2)[2] == body
