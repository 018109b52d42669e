"""Reading a config: recipes (strict YAML), `--set` overrides, a run's own config.yaml with the keys of an older
largebatch (`RENAMED`), and writing config.yaml back.

Every key is read against its field (`fields._coerce`: type, choices, a phase's required keys); an unknown section
or key is one sentence naming it and the valid ones, so a recipe never sets a key that nobody reads. The bounds
and the checks across sections follow (`checks.validate`).
"""
from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path
from typing import Any, Optional

import yaml

from largebatch import safeyaml
from largebatch.config.checks import validate
from largebatch.config.fields import _coerce, _is_number, _suggest
from largebatch.config.schema import SECTIONS, BatchConfig, Config
from largebatch.errors import UserError
from largebatch.schedule import batch_phases

RECIPES_DIR = Path(__file__).resolve().parent.parent.parent / "recipes"


def _section_from_dict(name: str, cls: type, data: Any) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"recipe section {name!r} must be a mapping of keys to values, got {data!r}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if f"{name}.{key}" in RENAMED:
            raise UserError(f"{name}.{key} is now {RENAMED[f'{name}.{key}']}; rename it in the recipe.")
        if key not in fields:
            raise UserError(f"unknown key {name}.{key}{_suggest(str(key), list(fields))}; "
                            f"valid keys of {name}: {', '.join(fields)}.")
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key], dict(fields[key].metadata))
    return cls(**kwargs)


def from_dict(data: dict, recipe: str = "custom", saved: bool = False) -> Config:
    """The validated Config of a recipe mapping; `saved`: a run's own config.yaml, whose keys from an older
    largebatch are read as the current ones (`RENAMED`)."""
    if not isinstance(data, dict):
        raise UserError(f"recipe {recipe!r} must be a YAML mapping of sections ({', '.join(SECTIONS)}).")
    data = _upgrade_saved(data) if saved else dict(data)
    check_one_batch(data, f"recipe {recipe!r}")
    data.pop("recipe", None)
    for name in data:
        if name not in SECTIONS:
            raise UserError(f"unknown recipe section {name!r}{_suggest(str(name), list(SECTIONS))}; "
                            f"valid sections: {', '.join(SECTIONS)}.")
    sections = {name: _section_from_dict(name, cls, data.get(name)) for name, cls in SECTIONS.items()}
    cfg = Config(**sections, recipe=recipe)
    validate(cfg)
    _start_batch(cfg.batch)
    return cfg


def _start_batch(batch: BatchConfig) -> None:
    """With batch.phases, batch.global_batch is the batch the run starts with (the first phase's, by start
    epoch), for whoever reads it (the dry run, memory, the messages); a recipe gives one or the other."""
    if batch.phases:
        batch.global_batch = batch_phases(batch)[0].global_batch


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(recipe: str) -> Path:
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") or "/" in recipe:
        if path.is_dir():
            raise UserError(f"recipe {recipe} is a directory; give a YAML file or one of: {', '.join(list_recipes())}.")
        if not path.is_file():
            raise UserError(f"recipe file {recipe} does not exist; give a YAML path or one of: {', '.join(list_recipes())}.")
        return path
    path = RECIPES_DIR / f"{recipe}.yaml"
    if not path.is_file():
        raise UserError(f"no recipe named {recipe!r}{_suggest(recipe, list_recipes())}; "
                        f"available: {', '.join(list_recipes())}, or a path to a YAML file.")
    return path


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader (YAML 1.1) with YAML 1.2's floats: 1e-3, 1e4 and 2.5e300 are numbers, not the strings
    YAML 1.1 makes of an exponent without a dot or a sign, wherever they stand (a key, a list, a batch phase)."""


YamlLoader.add_implicit_resolver(   # copies the inherited resolvers first: yaml.SafeLoader is left as it is
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def load_yaml(path: Path, what: str = "recipe") -> dict:
    """A YAML mapping from `path`; every way it can be unreadable is one sentence naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{what} {path} is not a UTF-8 text file; give a YAML file.") from None
    except OSError as err:
        raise UserError(f"cannot read {what} {path}: {err.strerror}; check the path and its permissions.") from None
    try:
        data = safeyaml.load(text, YamlLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{what} {path} is not valid YAML{where}; fix the syntax there.") from None
    except safeyaml.TooLarge as err:
        raise UserError(f"{what} {path} expands to {err}; write the values out, or remove the nested "
                        "aliases.") from None
    if data is not None and not isinstance(data, dict):
        raise UserError(f"{what} {path} must be a YAML mapping of sections ({', '.join(SECTIONS)}), "
                        f"not a {type(data).__name__}.")
    return data or {}


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` strings; values are parsed as YAML (so 3, 0.1, true, [1, 2] work).
    batch.global_batch and batch.phases are two spellings of one setting, the batch: one given by an override
    replaces the other, as a later --set of one key replaces an earlier (a recipe file giving both is refused:
    `check_one_batch`)."""
    data = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise UserError(f"--set {item!r} is not of the form section.key=value (e.g. --set optim.lr=0.2).")
        dotted, raw = item.split("=", 1)
        section, key = dotted.split(".", 1)
        try:
            value = safeyaml.load(raw, YamlLoader) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        except safeyaml.TooLarge as err:
            raise UserError(f"--set {item.split('=', 1)[0]}: its value expands to {err}; write the value "
                            "out.") from None
        if section not in SECTIONS:
            raise UserError(f"--set {dotted}: unknown section {section!r}{_suggest(section, list(SECTIONS))}; "
                            f"valid sections: {', '.join(SECTIONS)}.")
        hints = typing.get_type_hints(SECTIONS[section])
        if hints.get(key) in (str, Optional[str]) and not isinstance(value, str) and value is not None:
            value = raw   # a string key keeps what was typed (e.g. model.name=101, comm.grid=0x4: not hex 4)
        data.setdefault(section, {})
        if data[section] is None:
            data[section] = {}
        data[section][key] = value
        if isinstance(data[section], dict) and (dotted == "batch.global_batch" or (dotted == "batch.phases" and value)):
            data[section].pop("phases" if key == "global_batch" else "global_batch", None)   # one setting: the batch
    return data


def load(recipe: str = "fashion_mnist", overrides: list[str] | None = None) -> Config:
    path = resolve_recipe(recipe)
    base = load_yaml(path)
    check_one_batch(base, f"recipe {path}")
    data = apply_overrides(base, overrides or [])
    name = path.stem if path.parent == RECIPES_DIR else str(path)
    return from_dict(data, recipe=name)


def check_one_batch(data: dict, where: str) -> None:
    """batch.global_batch beside a non-empty batch.phases would be ignored (each phase names its own batch): one
    sentence naming where both were given."""
    batch = data.get("batch")
    if isinstance(batch, dict) and "global_batch" in batch and batch.get("phases"):
        raise UserError(f"{where} gives both batch.global_batch and batch.phases; with phases each phase names its "
                        "global batch (the run starts with the first's), so remove batch.global_batch, or set "
                        "batch.phases to [] for one global batch throughout.")


# Keys a run's config.yaml may hold from an older largebatch, and what they became: `from_dict(saved=True)` reads
# them into the new keys (evaluate, resume); a recipe that uses one gets a sentence naming the new key.
RENAMED = {"optim.eps": "optim.lars_eps (LARS) or optim.lamb_eps (LAMB)"}


def _upgrade_saved(data: dict) -> dict:
    """A run's config.yaml as the current keys: optim.eps into the running optimizer's own eps, and
    batch.global_batch beside phases dropped (the run ignored it; the first phase's batch is its start)."""
    data = json.loads(json.dumps(data))
    optim, batch = data.get("optim"), data.get("batch")
    if isinstance(optim, dict) and "eps" in optim:
        eps = optim.pop("eps")
        if optim.get("name") == "lamb" and _is_number(eps) and eps > 0:
            optim["lamb_eps"] = eps
        elif optim.get("name") == "lars":
            optim["lars_eps"] = eps
    if isinstance(batch, dict) and batch.get("phases"):
        batch.pop("global_batch", None)
    return data



def save(cfg: Config, path: Path) -> None:
    """config.yaml of a run: whole or absent (a full disk leaves no empty file), never written through a symbolic
    link (`checkpoint.atomic_write`: O_NOFOLLOW); a recipe that trains the same run again."""
    from largebatch.checkpoint import atomic_write

    data = cfg.to_dict()
    if cfg.batch.phases:   # derived from the phases: a recipe gives one or the other (check_one_batch)
        data["batch"].pop("global_batch")
    atomic_write(path, yaml.safe_dump(data, sort_keys=False).encode())
