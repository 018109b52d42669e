"""The device and link catalog: package `catalog.yaml` plus the user's measured "this machine".

1. Read `largebatch/perf/catalog.yaml` (datasheet and published figures, each with its source).
2. Merge the user's catalog file on top (`$LARGEBATCH_CATALOG`, else
   `~/.cache/largebatch/this_machine.yaml`, written by `largebatch plan --calibrate`), so that a
   measured "this-machine" device and "loopback" link become known names.
3. Resolve a device's compute curve for one precision: `eff_max` given directly, derived from a
   `reference` (measured images/s of a model at a per-device batch, with that model's FLOPs),
   carried over from another device (`eff_max_from`), or a measured speed ratio to another device
   on one software stack (`speed_of`).
4. Resolve a software stack's factor on eff_max (`stacks`): given, a single-GPU or single-node figure
   of that stack against the device curve (which describes the reference stack), or carried over from
   another stack (`factor_from`); a stack may give one device its own figure (`devices`), whose factor
   then replaces the stack's for that device.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from largebatch import safeyaml
from largebatch.errors import UserError

PACKAGE_CATALOG = Path(__file__).with_name("catalog.yaml")


def user_catalog_path() -> Path:
    """Where `--calibrate` writes and `plan` reads the measured entries (read from the environment each call; the
    path itself is cached per environment, as a sweep of `predict` asks for it thousands of times)."""
    return _user_path(os.environ.get("LARGEBATCH_CATALOG"), os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))


@lru_cache(maxsize=8)
def _user_path(env: str | None, xdg: str | None, home: str | None) -> Path:
    if env:
        return Path(env)
    return Path(xdg or Path.home() / ".cache") / "largebatch" / "this_machine.yaml"


@dataclass(frozen=True)
class Link:
    """One link: `alpha_s` per message step, `bandwidth_Bps` per direction (bytes/s)."""

    name: str
    alpha_s: float
    bandwidth_Bps: float
    source: str = ""


@dataclass(frozen=True)
class Device:
    """One device at one precision: peak FLOP/s, the compute curve and the reduction cost."""

    name: str
    key: str
    precision: str
    peak_flops: float
    eff_max: float
    b_half: float
    gamma_s_per_byte: float
    purchase_usd: float | None
    default_intra: str
    source: str


def _merge(base: dict, extra: dict) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    for section, entries in (extra or {}).items():
        out.setdefault(section, {}).update(entries or {})
    return out


@lru_cache(maxsize=8)
def _load(user_path: str) -> dict[str, dict[str, Any]]:
    with open(PACKAGE_CATALOG) as f:
        data = yaml.safe_load(f)
    return _merge(data, read_user_catalog(Path(user_path)))   # 2. the measured entries


def read_user_catalog(path: Path) -> dict[str, dict[str, Any]]:
    """The measured entries in `path` ({} when there is no file): a mapping of sections to mappings of
    named entries. A file cut short or edited into another shape is one sentence naming it, not a traceback
    in every `plan`."""
    if not path.is_file():
        return {}
    fix = "fix or delete it (largebatch plan --calibrate writes it anew)"
    try:
        data = safeyaml.load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError):
        raise UserError(f"the measured catalog {path} is not valid YAML; {fix}.") from None
    except safeyaml.TooLarge as err:
        raise UserError(f"the measured catalog {path} expands to {err}; {fix}.") from None
    if not isinstance(data, dict):
        raise UserError(f"the measured catalog {path} is a {type(data).__name__}, not a mapping of sections; {fix}.")
    for section, entries in data.items():
        if entries is None:
            continue
        if not isinstance(entries, dict) or not all(isinstance(e, dict) for e in entries.values()):
            raise UserError(f"the measured catalog {path} has a section {section!r} that is not a mapping of "
                            f"named entries; {fix}.")
    return data


def load_catalog() -> dict[str, dict[str, Any]]:
    """The merged catalog (steps 1-2): {'devices': {...}, 'links': {...}}."""
    return _load(str(user_catalog_path()))


def clear_cache() -> None:
    """Forget loaded catalogs (after `--calibrate` wrote a new entry)."""
    _load.cache_clear()


def get_link(spec: str) -> tuple[Link, int]:
    """`name` or `name:multiplicity` (e.g. `ib-edr:2`) -> (Link, multiplicity)."""
    links = load_catalog()["links"]
    name, _, mult = spec.partition(":")
    if name not in links:
        raise UserError(f"unknown link {name!r}; choose one of: {', '.join(sorted(links))} "
                        "(add ':N' for N links per node, e.g. ib-edr:2).")
    try:
        multiplicity = int(mult) if mult else 1
    except ValueError:
        multiplicity = 0
    if multiplicity < 1:
        raise UserError(f"link multiplicity in {spec!r} must be a positive integer, e.g. {name}:2.")
    e = links[name]
    return Link(name, float(e["alpha_us"]) * 1e-6, float(e["bandwidth_gbs"]) * 1e9, str(e.get("source", ""))), multiplicity


def device_names() -> list[str]:
    return sorted(load_catalog()["devices"])


def _eff_max(key: str, precision: str, seen: tuple[str, ...] = ()) -> tuple[float, float, str]:
    """(eff_max, b_half, source) of `key` at `precision` (step 3)."""
    from largebatch.perf.flops import model_cost

    devices = load_catalog()["devices"]
    entry = devices[key]
    curves = entry.get("efficiency", {})
    if precision not in curves:
        raise UserError(f"device {key!r} has no figures for precision {precision!r}; "
                        f"choose one of: {', '.join(curves)}.")
    c = curves[precision]
    b_half = float(c.get("b_half", 0.0))
    if "eff_max" in c:
        return float(c["eff_max"]), b_half, str(c.get("source", ""))
    if "speed_of" in c:
        other = c["speed_of"]["device"]
        if other in seen:
            raise ValueError(f"catalog cycle in speed_of: {seen + (other,)}")
        eff, _, _ = _eff_max(other, precision, seen + (key,))
        ratio = float(c["speed_of"]["ratio"])
        peak_other = float(devices[other]["peak_tflops"][precision])
        return eff * ratio * peak_other / float(entry["peak_tflops"][precision]), b_half, str(c.get("source", ""))
    if "eff_max_from" in c:
        other = c["eff_max_from"]
        if other in seen:
            raise ValueError(f"catalog cycle in eff_max_from: {seen + (other,)}")
        eff, _, _ = _eff_max(other, precision, seen + (key,))
        return eff, b_half, str(c.get("source", ""))
    ref = c["reference"]
    cost = model_cost(ref["model"], int(ref.get("image_size", 224)), int(ref.get("in_channels", 3)),
                      int(ref.get("num_classes", 1000)), ref.get("stem", "imagenet"), int(ref.get("width", 64)))
    # t_step(b) = t_img * (b + b_half) = b / images_per_s  ->  t_img, then eff_max = 3F / (peak t_img).
    b = float(ref["batch"])
    t_img = b / float(ref["images_per_s"]) / (b + b_half)
    peak = float(entry["peak_tflops"][precision]) * 1e12
    return 3.0 * cost.forward_flops / (peak * t_img), b_half, str(c.get("source", ""))


def get_device(key: str, precision: str) -> Device:
    """The device `key` at `precision`, or a UserError listing the known devices."""
    devices = load_catalog()["devices"]
    if key not in devices:
        raise UserError(f"unknown device {key!r}; choose one of: {', '.join(sorted(devices))} "
                        "('this-machine' appears after 'largebatch plan --calibrate').")
    entry = devices[key]
    peaks = entry.get("peak_tflops", {})
    if precision not in peaks:
        raise UserError(f"device {key!r} has no peak for precision {precision!r}; choose one of: {', '.join(peaks)}.")
    eff, b_half, source = _eff_max(key, precision)
    return Device(name=str(entry.get("name", key)), key=key, precision=precision,
                  peak_flops=float(peaks[precision]) * 1e12, eff_max=eff, b_half=b_half,
                  gamma_s_per_byte=3.0 / (float(entry["memory_gbs"]) * 1e9),
                  purchase_usd=entry.get("purchase_usd"), default_intra=str(entry.get("default_intra", "none")),
                  source=source)


DEFAULT_STACK = "mlperf-2020"


def _reference_factor(ref: dict[str, Any]) -> float:
    """images/s per GPU of a stack's figure (`images_per_s` on `gpus` GPUs, default 1) over the device curve
    at the same per-GPU batch (one GPU's compute: the exposed NVLink all-reduce of one node is left out)."""
    from largebatch.perf.flops import model_cost

    dev = get_device(ref["device"], ref["precision"])
    cost = model_cost("resnet50", 224, 3, 1000, "imagenet", 64)
    b = float(ref["batch"])
    curve = b / (3.0 * cost.forward_flops / (dev.peak_flops * dev.eff_max) * (b + dev.b_half))
    return float(ref["images_per_s"]) / float(ref.get("gpus", 1)) / curve


def stack_factor(name: str, device: str | None = None, precision: str | None = None, seen: tuple[str, ...] = ()) -> float:
    """Step 4: the factor on eff_max of software stack `name` on `device` at `precision` (the device curves describe
    DEFAULT_STACK): the device's own figure of that stack at that precision where the stack gives one
    (`devices.<key>.precisions.<prec>`), else the device's figure (`devices.<key>.reference`), else the stack's factor."""
    stacks = load_catalog().get("stacks", {})
    if name not in stacks:
        raise UserError(f"unknown software stack {name!r}; choose one of: {', '.join(sorted(stacks))}.")
    entry = stacks[name]
    per_device = entry.get("devices") or {}
    if device is not None and device in per_device:
        own = per_device[device]
        by_precision = own.get("precisions") or {}
        if precision is not None and precision in by_precision:
            return _reference_factor(by_precision[precision]["reference"])
        if "reference" in own:
            return _reference_factor(own["reference"])
    if "factor" in entry:
        return float(entry["factor"])
    if "factor_from" in entry:
        other = str(entry["factor_from"])
        if other in seen + (name,):
            raise ValueError(f"catalog cycle in factor_from: {seen + (name, other)}")
        return stack_factor(other, device, precision, seen + (name,))
    return _reference_factor(entry["reference"])


def stack_names() -> list[str]:
    return sorted(load_catalog().get("stacks", {}))


MEASURED_STACK = "largebatch"   # largebatch's own measured step: the default where it was measured


def measured_precisions(device: str) -> list[str]:
    """The precisions at which largebatch's own step was measured on `device` (the `largebatch` stack's figures)."""
    own = ((load_catalog().get("stacks", {}).get(MEASURED_STACK) or {}).get("devices") or {}).get(device) or {}
    return sorted(own.get("precisions") or {})


def has_figure(name: str, device: str) -> bool:
    """Whether stack `name` holds a figure of `device` itself (not one carried over from another device)."""
    entry = load_catalog().get("stacks", {})[name]
    return (device in (entry.get("devices") or {}) or (entry.get("reference") or {}).get("device") == device
            or device in (entry.get("figures") or []))


def default_stack(device: str, precision: str) -> tuple[str, str]:
    """(stack, why) that `plan` uses without --stack: `largebatch` where largebatch's own step was measured on this
    device at this precision; else the newest MLPerf release stack (by `released`) with a figure for the device;
    else the device's own curve (DEFAULT_STACK, factor 1)."""
    if precision in measured_precisions(device):
        return MEASURED_STACK, f"largebatch's own step, measured on {device} at {precision}"
    stacks = load_catalog().get("stacks", {})
    releases = [(str(e.get("released", "")), n) for n, e in stacks.items()
                if (n.startswith("mlperf-") and has_figure(n, device))]
    if releases:
        name = max(releases)[1]
        measured = measured_precisions(device)
        why = (f"the newest MLPerf release with a figure for {device}"
               + (f" (largebatch was measured on it at {', '.join(measured)} only)" if measured
                  else " (largebatch has no measurement on it)"))
        return name, why
    return DEFAULT_STACK, f"no stack has a figure for {device}: its own curve"
