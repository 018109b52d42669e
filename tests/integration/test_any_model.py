"""Models from anywhere (largebatch/models/external.py): a factory of this file, timm:NAME and torchvision:NAME.

The factories below are the "own model" of the tests: `model.name: test_any_model:make_model` (this directory on
PYTHONPATH). The timm and torchvision tests (marked `library`) run wherever those libraries import: `make test`
runs them in its second environment (`make test-eco`: torch 2.14.1, torchvision 0.29.1, timm), where
LARGEBATCH_REQUIRE_LIBRARIES=1 makes a library that does not import a failure; in the main environment (CPU torch,
no torchvision) they skip, saying why, and the refusals of a missing library are tested instead.
"""
from __future__ import annotations

import importlib.util
import os
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import require_library
from largebatch.config import OptimConfig
from largebatch.errors import UserError
from largebatch.models import build_model, build_model_recorded, check_model_name, count_flops
from largebatch.optim import LARS, build_optimizer, param_groups

pytestmark = pytest.mark.timeout(300)
TESTS = Path(__file__).resolve().parent   # factories named test_any_model:NAME live here
FACTORY_PATH = os.pathsep.join([str(TESTS), str(TESTS.parent)])   # this folder, and conftest's that it imports


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


@pytest.mark.parametrize("lib", ["timm", "torchvision"])
def test_a_missing_library_through_train_exits_2_in_one_sentence(cli, tmp_path, lib):
    if importlib.util.find_spec(lib) is not None:
        pytest.skip(f"{lib} is installed here: the refusal cannot be seen (an unknown model name is tested instead)")
    proc = cli("train", "--set", f"model.name={lib}:resnet18", "--set", "data.dataset=synthetic",
               "--run-dir", tmp_path / "run", "--quiet")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"needs the {lib} package" in lines[0] and "pip install" in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, fragment", [
    ("no_such_module_xyz:make", "cannot be found"),
    ("test_any_model:returns_no_module", "not an nn.Module"),
    ("test_any_model:takes_no_classes", "takes no num_classes"),
])
def test_a_bad_factory_through_train_exits_2_and_writes_nothing(cli, tmp_path, name, fragment):
    proc = cli("train", "--set", f"model.name={name}", "--set", "data.dataset=synthetic",
               "--run-dir", tmp_path / "run", "--quiet", env={"PYTHONPATH": FACTORY_PATH})
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


# ---- timm and torchvision, where installed -----------------------------------------------------------------


LIBRARY_MODELS = ["timm:resnet18", "timm:resnet50", "torchvision:resnet18", "torchvision:resnet50"]
# The residual gamma zeroed in each block, as both libraries name it: the branch's last BN.
LAST_BN = {"BasicBlock": "bn2", "Bottleneck": "bn3"}
ZERO_INIT_ARGUMENT = {"timm": "zero_init_last", "torchvision": "zero_init_residual"}


def _block_gammas(net: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Every BN gamma of every residual block, by block name and BN name."""
    return {name: {n: bn.weight for n, bn in m.named_children() if isinstance(bn, nn.BatchNorm2d)}
            for name, m in net.named_modules() if type(m).__name__ in LAST_BN}


def _decay_groups(net: nn.Module) -> tuple[set[str], set[str]]:
    """The names of `largebatch train`'s optimizer (optim.name lars, the recipe's defaults): the tensors with weight
    decay and LARS's adaptation, and those with neither."""
    opt = build_optimizer(OptimConfig(name="lars"), net, 0.1)
    names = {id(p): n for n, p in net.named_parameters()}
    adapted = {names[id(p)] for g in opt.param_groups if not g["lars_exclude"] and g["weight_decay"] > 0
               for p in g["params"]}
    excluded = {names[id(p)] for g in opt.param_groups if g["lars_exclude"] and g["weight_decay"] == 0
                for p in g["params"]}
    assert len(adapted) + len(excluded) == len(names)
    return adapted, excluded


@pytest.mark.library
@pytest.mark.parametrize("name", LIBRARY_MODELS)
def test_a_library_resnet_gets_zero_init_lars_groups_and_flops(name):
    lib, arch = name.split(":")
    require_library(lib)
    net, built = build_model_recorded(name, 10)
    assert built.source.startswith(lib) and built.parameters == sum(p.numel() for p in net.parameters())
    assert built.zero_init == f"argument {ZERO_INIT_ARGUMENT[lib]}=True", built.zero_init
    # zero-init: exactly the last BN gamma of each block is zero, every other gamma one (the stem's, the
    # shortcuts', the blocks' first ones).
    blocks = _block_gammas(net)
    assert len(blocks) == {"resnet18": 8, "resnet50": 16}[arch]
    for block, gammas in blocks.items():
        last = LAST_BN[type(net.get_submodule(block)).__name__]
        for bn, gamma in gammas.items():
            assert torch.all(gamma == (0.0 if bn == last else 1.0)), f"{name} {block}.{bn}: {built.zero_init}"
    others = [m.weight for n, m in net.named_modules()
              if isinstance(m, nn.BatchNorm2d) and n.rsplit(".", 1)[0] not in blocks]
    assert others and all(torch.all(g == 1.0) for g in others)
    off, built_off = build_model_recorded(name, 10, zero_init_residual=False)
    assert all(torch.all(g == 1.0) for m in off.modules() if isinstance(m, nn.BatchNorm2d) for g in [m.weight])
    assert built_off.zero_init == f"argument {ZERO_INIT_ARGUMENT[lib]}=False", built_off.zero_init
    # LARS and weight decay: exactly the BN and bias tensors are excluded, found by module type here.
    adapted, excluded = _decay_groups(net)
    assert excluded == _bn_and_bias(net) == _no_decay_names(net) and "fc.bias" in excluded
    assert adapted == {n for n, p in net.named_parameters() if p.ndim == 4} | {"fc.weight"}
    # FLOPs from the model's own forward pass: the library's ResNet is largebatch's (torchvision v1.5 layout).
    assert count_flops(net, (1, 3, 224, 224)) == count_flops(build_model(arch, 10), (1, 3, 224, 224))


@pytest.mark.library
@pytest.mark.parametrize("name", LIBRARY_MODELS)
def test_a_library_resnet_trains_checkpoints_resumes_and_evaluates(cli, tmp_path, name):
    """32 px images at the library's own width; one intra-op thread (make test-eco runs two tests at a time on 2
    cores). ResNet-50 leaves out the separate `evaluate` (the resumed run's own evaluation stands for it: the same
    rebuild from config.yaml as ResNet-18's `evaluate`, 10 s saved per library)."""
    require_library(name.split(":")[0])
    _train_resume_evaluate(cli, tmp_path, name, ["--set", "data.image_size=32", "--set", "train.threads=1"],
                           evaluate=name.endswith("resnet18"))


@pytest.mark.library
@pytest.mark.parametrize("lib", ["timm", "torchvision"])
def test_a_library_name_that_does_not_exist_is_one_sentence(lib):
    require_library(lib)
    with pytest.raises(UserError) as err:
        check_model_name(f"{lib}:resnet500")
    assert "has no model 'resnet500'" in str(err.value) and f"did you mean {lib}:resnet50" in str(err.value)


@pytest.mark.library
def test_a_library_name_that_does_not_exist_through_train_exits_2_and_writes_nothing(cli, tmp_path):
    require_library("timm")
    proc = cli("train", "--set", "model.name=timm:resnet500", "--set", "data.dataset=synthetic",
               "--run-dir", tmp_path / "run", "--quiet")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "timm 1." in lines[0] and "has no model 'resnet500'" in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def _train_resume_evaluate(cli, run_dir_parent: Path, name: str, extra: list[str], env: dict | None = None,
                           evaluate: bool = True) -> dict:
    """train 2 steps with a checkpoint, resume to 4 (each run ends with its evaluation), `evaluate` the run: the
    model recorded and rebuilt each time. Returns evaluate's result, or the resumed run's summary."""
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
    if not evaluate:
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 4 and 0 <= summary["final_top1"] <= 1, summary
        return summary
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


@pytest.mark.library
def test_the_worker_forkservers_preload_leaves_the_cuda_driver_untouched_on_a_cuda_build():
    """Workers fork from a forkserver that imported launch.WORKER_PRELOAD (launch._launch_warm). CUDA cannot be
    initialised in a process forked from one that initialised it, so on a CUDA build of torch (the eco stack's)
    that import must call none of torch's CUDA entry points; checked in a fresh interpreter."""
    import subprocess
    import sys

    from largebatch.launch import WORKER_PRELOAD

    if torch.version.cuda is None:
        if os.environ.get("LARGEBATCH_REQUIRE_LIBRARIES"):
            pytest.fail("make test-eco's torch is a CUDA build; this one is not")
        pytest.skip("this torch is a CPU build (no CUDA entry points); make test-eco runs it on a CUDA build")
    script = f"""
import torch
calls = []
for name in ("_cuda_getDeviceCount", "_cuda_init", "_cuda_isDriverSufficient", "_cuda_getDevice", "_cuda_getArchFlags"):
    f = getattr(torch._C, name, None)
    if f is not None:
        setattr(torch._C, name, lambda *a, _f=f, _n=name, **k: calls.append(_n) or _f(*a, **k))
for module in {list(WORKER_PRELOAD)!r}:
    __import__(module)
print(sorted(set(calls)), torch.cuda.is_initialized())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[] False", out.stdout
