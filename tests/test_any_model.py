"""Models from anywhere (largebatch/models/external.py): a factory of this file, timm:NAME and torchvision:NAME.

The factories below are the "own model" of the tests: `model.name: test_any_model:make_model` (this directory on
PYTHONPATH). The timm and torchvision tests run wherever those libraries import (the GPU machine's
`make gpu-check` runs them with the `library` marker) and skip, saying why, where they do not (this CPU machine:
torch has no CPU torchvision build here, and timm needs torchvision).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from largebatch.errors import UserError
from largebatch.models import build_model, build_model_recorded, check_model_name, count_flops
from largebatch.optim import LARS, param_groups

pytestmark = pytest.mark.timeout(300)
TESTS = Path(__file__).resolve().parent


# ---- the factories ---------------------------------------------------------------------------------

class Block(nn.Module):
    """A residual block exposing timm's convention: zero_init_last() zeroes its last BN gamma."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def zero_init_last(self) -> None:
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class TinyNet(nn.Module):
    def __init__(self, num_classes: int, in_channels: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = Block(8)
        self.shortcut = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))   # a BN inside a branch, a conv bias
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(self.stem(x)) + self.shortcut(self.stem(x))
        return self.fc(x.mean((2, 3)))


def make_model(num_classes: int, in_channels: int = 3) -> nn.Module:
    return TinyNet(num_classes, in_channels)


def make_plain(num_classes: int) -> nn.Module:
    """No residual zero-init exposed, no in_channels."""
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, num_classes))


def returns_no_module(num_classes: int) -> dict:
    return {"num_classes": num_classes}


def takes_no_classes() -> nn.Module:
    return TinyNet(10, 3)


NOT_A_FUNCTION = 3


# ---- the factory path ------------------------------------------------------------------------------------

def _no_decay_names(net: nn.Module) -> set[str]:
    groups = param_groups(net, 5e-5)
    excluded = {id(p) for g in groups if g.get("lars_exclude") for p in g["params"]}
    return {n for n, p in net.named_parameters() if id(p) in excluded}


def _bn_and_bias(net: nn.Module) -> set[str]:
    """The names LARS must exclude, found by module type (not by shape, as param_groups does)."""
    norms = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    out = set()
    for name, m in net.named_modules():
        for pname, _ in m.named_parameters(recurse=False):
            if isinstance(m, norms) or pname == "bias":
                out.add(f"{name}.{pname}" if name else pname)
    return out


def test_a_factory_model_is_built_with_num_classes_and_in_channels_and_zero_init():
    net, built = build_model_recorded("test_any_model:make_model", 7, in_channels=1)
    assert isinstance(net, TinyNet) and net.fc.out_features == 7 and net.stem[0].in_channels == 1
    assert torch.count_nonzero(net.block.bn2.weight) == 0   # zero_init_last() called
    assert built.zero_init == "zero_init_last() of 1 blocks" and not built.note
    assert built.identity == f"test_any_model.TinyNet with {sum(p.numel() for p in net.parameters()):,} parameters"
    off, built_off = build_model_recorded("test_any_model:make_model", 7, zero_init_residual=False)
    assert torch.count_nonzero(off.block.bn2.weight) == 8 and built_off.zero_init.startswith("off")
    plain, built_plain = build_model_recorded("test_any_model:make_plain", 4)
    assert built_plain.zero_init.startswith("none") and "keeps its own initialisation" in built_plain.note


def test_lars_excludes_exactly_the_bn_and_bias_tensors_of_a_factory_model():
    net = build_model("test_any_model:make_model", 5)
    assert _no_decay_names(net) == _bn_and_bias(net) == {
        "stem.1.weight", "stem.1.bias", "block.bn1.weight", "block.bn1.bias", "block.bn2.weight", "block.bn2.bias",
        "shortcut.0.bias", "shortcut.1.weight", "shortcut.1.bias", "fc.bias"}
    opt = LARS(param_groups(net, 5e-5), lr=0.1, momentum=0.9, weight_decay=5e-5)
    assert [g.get("lars_exclude", False) for g in opt.param_groups] == [False, True]


def test_forward_flops_are_counted_from_the_model_itself():
    net = build_model("test_any_model:make_model", 5)
    # stem 3->8 3x3, block two 8->8 3x3, shortcut 1x1 (on a second stem pass), fc 8->5; 2 FLOPs per MAC
    px = 16 * 16
    macs = 2 * px * 8 * 3 * 9 + 2 * px * 8 * 8 * 9 + px * 8 * 8 + 8 * 5
    assert count_flops(net, (1, 3, 16, 16)) == 2 * macs

    class Attention(nn.Module):   # matrix products that are no nn.Linear: counted too
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = x.flatten(2).transpose(1, 2)           # (1, 16, 4)
            return (q @ q.transpose(1, 2)).softmax(-1) @ q

    assert count_flops(Attention(), (1, 4, 4, 4)) == 2 * (16 * 16 * 4) * 2


@pytest.mark.parametrize("name, fragment", [
    ("no_such_module_xyz:make", "module no_such_module_xyz cannot be found; put its directory on PYTHONPATH"),
    ("test_any_model:missing", "module test_any_model has no 'missing'"),
    ("test_any_model:NOT_A_FUNCTION", "is a int, not a function"),
    ("test_any_model:returns_no_module", "returned a dict, not an nn.Module"),
    ("test_any_model:takes_no_classes", "takes no num_classes argument"),
    ("a b:c", "a factory is named package.module:function"),
    ("timm:", "a model from elsewhere is timm:NAME"),
])
def test_a_bad_factory_is_one_sentence_at_recipe_time(name, fragment):
    with pytest.raises(UserError, match=None) as err:
        check_model_name(name)
    assert fragment in str(err.value), str(err.value)


@pytest.mark.parametrize("lib", ["timm", "torchvision"])
def test_a_missing_library_is_one_sentence_naming_the_package(lib):
    if importlib.util.find_spec(lib) is not None:
        try:
            __import__(lib)
            pytest.skip(f"{lib} is installed and imports here: the refusal cannot be seen")
        except ImportError:
            pass
    with pytest.raises(UserError) as err:
        check_model_name(f"{lib}:resnet18")
    assert "pip install" in str(err.value) and str(err.value).count(". ") == 0, str(err.value)


@pytest.mark.parametrize("name, fragment", [
    ("no_such_module_xyz:make", "cannot be found"),
    ("test_any_model:returns_no_module", "not an nn.Module"),
    ("test_any_model:takes_no_classes", "takes no num_classes"),
])
def test_a_bad_factory_through_train_exits_2_and_writes_nothing(cli, tmp_path, name, fragment):
    proc = cli("train", "--set", f"model.name={name}", "--set", "data.dataset=synthetic",
               "--run-dir", tmp_path / "run", "--quiet", env={"PYTHONPATH": str(TESTS)})
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


# ---- timm and torchvision, where installed -----------------------------------------------------------------

def _library(lib: str):
    try:
        return __import__(lib)
    except ImportError as err:
        pytest.skip(f"{lib} does not import here ({err}); scripts/gpu_check.sh runs this where it is installed")


LIBRARY_BLOCK_GAMMA = {"timm": "bn2", "torchvision": "bn2"}   # resnet18's BasicBlock: the last BN of the branch


@pytest.mark.library
@pytest.mark.parametrize("lib", ["timm", "torchvision"])
def test_a_library_resnet18_gets_zero_init_lars_groups_and_flops(lib):
    _library(lib)
    net, built = build_model_recorded(f"{lib}:resnet18", 10)
    assert built.source.startswith(lib) and built.parameters == sum(p.numel() for p in net.parameters())
    gammas = [m.bn2.weight for m in net.modules() if type(m).__name__ == "BasicBlock"]
    assert len(gammas) == 8 and all(torch.count_nonzero(g) == 0 for g in gammas), built.zero_init
    assert _no_decay_names(net) == _bn_and_bias(net) and "fc.bias" in _no_decay_names(net)
    assert count_flops(net, (1, 3, 224, 224)) == count_flops(build_model("resnet18", 10), (1, 3, 224, 224))


@pytest.mark.library
@pytest.mark.parametrize("lib", ["timm", "torchvision"])
def test_a_library_resnet18_trains_resumes_and_evaluates(cli, tmp_path, lib):
    _library(lib)
    _train_resume_evaluate(cli, tmp_path, f"{lib}:resnet18", ["--set", "data.image_size=32"])


def _train_resume_evaluate(cli, run_dir_parent: Path, name: str, extra: list[str], env: dict | None = None) -> dict:
    """train 2 steps with a checkpoint, resume to 4, evaluate: the model recorded and rebuilt each time."""
    run = run_dir_parent / "run"
    common = ["--set", f"model.name={name}", "--set", "batch.global_batch=8", "--set", "schedule.warmup_epochs=0",
              "--set", "train.plots=false", "--set", "train.checkpoint_every=2", "--set", "optim.name=lars",
              "--quiet", *extra]
    if not any("data.dataset" in a for a in extra):
        common += ["--set", "data.dataset=synthetic", "--set", "data.synthetic_size=64", "--set", "data.num_classes=4"]
    cli("train", "--run-dir", run, "--set", "train.max_steps=2", *common, env=env, check=True)
    meta = json.loads((run / "checkpoints" / "step-00000002.json").read_text())
    assert meta["model"]["name"] == name and "parameters" in meta["model"]["identity"]
    resumed = cli("train", "--run-dir", run, "--resume", "--set", "train.max_steps=4", *common, env=env, check=True)
    assert "resumed from" in resumed.stderr and "at step 2" in resumed.stderr
    ev = cli("evaluate", run, env=env, check=True)
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["model"] == meta["model"] and 0 <= result["top1"] <= 1
    return result


# ---- the pieces in a user's own loop ------------------------------------------------------------------------

def test_examples_own_loop_runs_on_2_gloo_processes(tmp_path):
    """examples/own_loop.py: plain DDP with LARS + param_groups, the lr schedule and a largebatch comm hook."""
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "examples" / "own_loop.py"), "--steps", "30"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    first, last = (float(v) for v in line.split("loss ")[1].split(" -> "))
    assert line.startswith("world 2, global batch 32") and last < first, line
