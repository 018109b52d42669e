"""Golden per-step losses (scripts/loss_compare.py): three tiny deterministic runs (SGD, LARS, LAMB, with
gradient accumulation, warm-up, label smoothing, an EMA) give exactly the recorded per-step losses and final
evaluation on this machine class, and a change of one constant of the step is caught."""
from __future__ import annotations

import importlib.util
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.timeout(300)


def _loss_compare():
    spec = importlib.util.spec_from_file_location("loss_compare", ROOT / "scripts" / "loss_compare.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["loss_compare"] = module
    spec.loader.exec_module(module)
    return module


LC = _loss_compare()


@pytest.mark.parametrize("name", list(LC.GOLDEN))
def test_the_golden_runs_give_the_recorded_losses(name):
    record = LC.run(name)
    assert len(record["steps"]) == 12
    diffs = LC.compare(name, record, LC.machine_class())
    assert not diffs, "\n".join(diffs) + "\n(a change made on purpose: scripts/loss_compare.py --update)"


def test_a_changed_constant_of_the_step_is_caught(monkeypatch, tmp_path):
    """Label smoothing 0.1 -> 0.1001 in the golden LARS run moves the losses by about 1e-6: the exact
    comparison on a recorded class names the steps (recorded here, into a scratch assets directory, so this
    holds on any machine); across classes only changes over CROSS_CLASS_RTOL are caught (0.11 is, 0.1001 is
    not)."""
    monkeypatch.setattr(LC, "ASSETS", tmp_path)
    cls = LC.machine_class()
    LC.write("lars", LC.run("lars"), cls)
    base = list(LC.GOLDEN["lars"])
    assert LC.compare("lars", LC.run("lars"), cls) == []                       # deterministic: equal to the bit
    for smoothing, caught_across in (("0.1001", False), ("0.11", True)):
        monkeypatch.setitem(LC.GOLDEN, "lars", [*base, f"train.label_smoothing={smoothing}"])
        changed = LC.run("lars")
        diffs = LC.compare("lars", changed, cls)
        assert diffs and any("step 1 loss" in d and "exact" in d for d in diffs), smoothing
        across = LC.compare("lars", changed, "another-class")                 # no file: within the tolerance
        assert bool(across) == caught_across, (smoothing, across)
        assert all("within 1e-05" in d for d in across)
