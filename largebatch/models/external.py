"""Models from anywhere: `timm:NAME`, `torchvision:NAME` or `pkg.module:factory` as `model.name`.

A `model.name` with a colon names a model that largebatch did not write; the large-batch recipe (parameter groups
by shape, LARS/LAMB, warm-up, batch-size control, the comm hooks, the Collapsed Ensemble) applies to it unchanged.

1. `timm:NAME`: `timm.create_model(NAME, pretrained=False, num_classes=C, in_chans=I)`.
2. `torchvision:NAME`: `torchvision.models.get_model(NAME, weights=None, num_classes=C)`; 3-channel images only.
3. `pkg.module:factory`: the module is imported (from `sys.path`, then the current directory), and
   `factory(num_classes=C)` called, with `in_channels=I` where its signature names `in_channels`; it must return
   an `nn.Module`.
4. Zero-init of the residual gammas (`model.zero_init_residual`, Goyal et al.): the library's own argument where
   the model takes it (timm: `zero_init_last`, torchvision: `zero_init_residual`; a factory: either, where its
   signature names it); else every submodule with a `zero_init_last()` method (timm's blocks) gets it called; a
   model with neither is left with its own initialisation, and `Built.note` says so (the run prints it once).
5. What was built (`Built`): the name, the library and its version (or the factory's file), the class and the
   parameter count, written into every checkpoint's metadata; a resume or `evaluate` builds the model again from
   the run's config.yaml, and a checkpoint of another class or size is refused naming both.

`check(name, key)` is the recipe-time check (before any data is read or a run directory is taken): the syntax,
the library and the model name (timm and torchvision are imported for it), or for a factory the import, the
callable, a `num_classes` parameter, and one call on the meta device (shapes only) that must return an
`nn.Module` (a factory that fails on the meta device is judged when the run builds it for real).
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from largebatch.errors import UserError

LIBRARIES = ("timm", "torchvision")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass(frozen=True)
class Built:
    """Step 5: what `model.name` built."""

    name: str
    source: str        # "timm 1.0.9", "torchvision 0.20.1", "my_pkg.models (/path/models.py)", "largebatch"
    cls: str           # the network's class, with its module
    parameters: int
    zero_init: str     # what was done for model.zero_init_residual
    note: str = ""     # said once by the run: zero-init asked for and not possible

    @property
    def identity(self) -> str:
        """What a checkpoint must match to load into this model: the class and the parameter count."""
        return f"{self.cls} with {self.parameters:,} parameters"

    def record(self) -> dict:
        return {"name": self.name, "source": self.source, "identity": self.identity, "zero_init": self.zero_init}


def is_external(name: str) -> bool:
    return ":" in name


def _split(name: str, key: str) -> tuple[str, str]:
    where, _, what = name.partition(":")
    if not where or not what or ":" in what:
        raise UserError(f"{key} is {name!r}; a model from elsewhere is timm:NAME, torchvision:NAME or "
                        "package.module:factory.")
    if where not in LIBRARIES and not (_DOTTED.fullmatch(where) and what.isidentifier()):
        raise UserError(f"{key} is {name!r}; a factory is named package.module:function (Python names, e.g. "
                        "my_models.nets:make_model).")
    return where, what


def _import_library(lib: str, name: str, key: str) -> Any:
    """Step 1-2: the library, or one sentence naming the package to install."""
    if importlib.util.find_spec(lib) is None:
        raise UserError(f"{key} {name} needs the {lib} package, which is not installed here; install it "
                        f"(pip install {lib}) or choose a model of largebatch.models.MODELS.")
    try:
        return importlib.import_module(lib if lib == "timm" else "torchvision.models")
    except ModuleNotFoundError as err:   # timm imports torchvision for its data transforms
        raise UserError(f"{key} {name} needs the {lib} package, whose import fails because {err.name} is not "
                        f"installed; install it (pip install {err.name}).") from None


def _library_names(lib: str, module: Any) -> list[str]:
    return list(module.list_models())


def _check_library_name(lib: str, what: str, name: str, key: str) -> Any:
    module = _import_library(lib, name, key)
    known = module.is_model(what) if lib == "timm" else what.lower() in _library_names(lib, module)
    if not known:
        close = difflib.get_close_matches(what, _library_names(lib, module), n=1)
        hint = f" (did you mean {lib}:{close[0]}?)" if close else ""
        raise UserError(f"{key} is {name!r}: {lib} {_version(lib)} has no model {what!r}{hint}; give a name from "
                        f"{lib}'s list_models().")
    return module


def _import_factory(where: str, what: str, name: str, key: str) -> Callable[..., Any]:
    """Step 3: the factory named `where:what`, importable, callable and taking num_classes."""
    if os.getcwd() not in sys.path and "" not in sys.path:   # like `python -m`: the current directory is searched
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(where)
    except ModuleNotFoundError as err:
        if err.name is not None and where.startswith(err.name):
            raise UserError(f"{key} is {name!r}, but module {where} cannot be found; put its directory on "
                            "PYTHONPATH (or run from it), or install its package.") from None
        raise UserError(f"{key} {name}: importing {where} fails because module {err.name} is not installed; "
                        f"install it.") from None
    except Exception as err:   # noqa: BLE001 - the user's module does not import: say why in one sentence
        detail = " ".join(str(err).split())[:160]
        raise UserError(f"{key} {name}: importing {where} fails ({type(err).__name__}: {detail}); fix the "
                        "module.") from None
    factory = getattr(module, what, None)
    if factory is None:
        raise UserError(f"{key} is {name!r}, but module {where} has no {what!r}; name a function of it that "
                        "returns an nn.Module.")
    if not callable(factory):
        raise UserError(f"{key} is {name!r}, but {where}.{what} is a {type(factory).__name__}, not a function; "
                        "name a function that returns an nn.Module.")
    if "num_classes" not in _parameters(factory):
        raise UserError(f"{key} is {name!r}, but {where}.{what} takes no num_classes argument; give it one "
                        "(the data set's class count is passed as num_classes=).")
    return factory


def _parameters(fn: Callable[..., Any]) -> set[str]:
    """The keyword names `fn` takes; "num_classes" stands in for **kwargs (it takes any)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):   # a builtin without a signature: assume it takes what it is given
        return {"num_classes"}
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if any(p.kind == p.VAR_KEYWORD for p in params):
        names.add("num_classes")
    return names


def _version(lib: str) -> str:
    try:
        from importlib.metadata import version

        return version(lib)
    except Exception:   # noqa: BLE001 - a source checkout without metadata
        return "(version unknown)"


def check(name: str, key: str = "model.name") -> None:
    """The recipe-time check (see the module docstring); raises UserError, returns nothing."""
    where, what = _split(name, key)
    if where in LIBRARIES:
        _check_library_name(where, what, name, key)
        return
    factory = _import_factory(where, what, name, key)
    try:
        with torch.device("meta"):
            out = factory(num_classes=2)
    except Exception:   # noqa: BLE001 - a factory that needs real tensors: judged at the real build
        return
    if not isinstance(out, nn.Module):
        raise UserError(f"{key} is {name!r}, but {where}.{what}(num_classes=...) returned a "
                        f"{type(out).__name__}, not an nn.Module; return the network.")


def _with_optional(make: Callable[..., Any], kwargs: dict, optional: dict) -> tuple[Any, str]:
    """make(**kwargs, **optional), or make(**kwargs) where the model takes none of `optional` (TypeError naming
    it): the library's models differ in which arguments they take. Returns the model and which argument was used."""
    if optional:
        try:
            return make(**kwargs, **optional), f"argument {', '.join(f'{k}={v}' for k, v in optional.items())}"
        except TypeError as err:
            if not any(k in str(err) for k in optional):
                raise
    return make(**kwargs), ""


def _zero_init_last(net: nn.Module) -> int:
    """Step 4's fallback: call every submodule's zero_init_last() (timm's convention); how many there were."""
    blocks = [m for m in net.modules() if callable(getattr(m, "zero_init_last", None))]
    for m in blocks:
        m.zero_init_last()   # type: ignore[operator]  # callable, checked above
    return len(blocks)


def build(name: str, num_classes: int, in_channels: int, zero_init_residual: bool) -> tuple[nn.Module, Built]:
    """Steps 1-5: the network of `name` and what was built."""
    key = "model.name"
    where, what = _split(name, key)
    zero = ""
    if where == "timm":
        timm = _check_library_name(where, what, name, key)
        net, zero = _with_optional(timm.create_model, dict(model_name=what, pretrained=False,
                                                           num_classes=num_classes, in_chans=in_channels),
                                   {"zero_init_last": zero_init_residual})
        source = f"timm {_version('timm')}"
    elif where == "torchvision":
        models = _check_library_name(where, what, name, key)
        if in_channels != 3:
            raise UserError(f"{key} {name}: torchvision's models take 3-channel images and the data has "
                            f"{in_channels}; use timm:{what} (in_chans) or a factory with in_channels.")
        net, zero = _with_optional(models.get_model, dict(name=what, weights=None, num_classes=num_classes),
                                   {"zero_init_residual": zero_init_residual})
        source = f"torchvision {_version('torchvision')}"
    else:
        factory = _import_factory(where, what, name, key)
        params = _parameters(factory)
        kwargs: dict[str, Any] = {"num_classes": num_classes}
        if "in_channels" in params:
            kwargs["in_channels"] = in_channels
        optional = {k: zero_init_residual for k in ("zero_init_residual", "zero_init_last") if k in params}
        net, zero = _with_optional(factory, kwargs, optional)
        if not isinstance(net, nn.Module):
            raise UserError(f"{key} is {name!r}, but {where}.{what}(num_classes={num_classes}) returned a "
                            f"{type(net).__name__}, not an nn.Module; return the network.")
        source = f"{where} ({getattr(sys.modules.get(where), '__file__', None) or 'no file'})"
    note = ""
    if not zero and zero_init_residual:
        blocks = _zero_init_last(net)
        if blocks:
            zero = f"zero_init_last() of {blocks} blocks"
        else:
            zero = "none (the model exposes no residual-gamma zero-init)"
            note = (f"model {name} exposes no zero-init of its residual gammas (no zero_init_residual or "
                    "zero_init_last argument, no zero_init_last() method), so it keeps its own initialisation "
                    "and model.zero_init_residual does nothing for it.")
    elif not zero:
        zero = "off (model.zero_init_residual false)"
    cls = f"{type(net).__module__}.{type(net).__qualname__}"
    params = sum(p.numel() for p in net.parameters())
    return net, Built(name, source, cls, params, zero, note)
