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


def test_a_changed_constant_of_the_step_is_caught(monkeypatch):
    """Label smoothing 0.1 -> 0.1001 in the golden LARS run: the losses move in the 5th digit, and the
    comparison names the steps."""
    monkeypatch.setitem(LC.GOLDEN, "lars", [*LC.GOLDEN["lars"], "train.label_smoothing=0.1001"])
    diffs = LC.compare("lars", LC.run("lars"), LC.machine_class())
    assert diffs and any("step 1 loss" in d for d in diffs)
