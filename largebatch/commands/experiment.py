"""`largebatch study EXPERIMENT.yaml [--out DIR] [--dry-run] [--only NAME,...]`

Runs an experiment written as data (experiments/*.yaml): its studies in order, each into OUT/NAME, resumable
(kill and re-run: every study resumes its own cells). An experiment file is a mapping:

    about: one line, what the experiment re-checks or measures
    common: {...}            # study settings every study starts from (lists: common's first)
    studies:                 # run in this order
      - name: tune           # OUT/tune
        study: batch-scaling # batch-scaling, batch-control or ensemble (`largebatch study KIND --help`)
        epochs: 8            # every setting is the study's flag, underscores for dashes
        val_split: 10000
        set: {model.width: 8, schedule.decay: poly}      # --set KEY=VALUE, in this order
        opt_set: {sgd: {schedule.warmup_epochs: 5/90 run}}  # --opt-set OPT:KEY=VALUE
        lr_grid: {sgd: [0.125, 0.25]}                  # batch-scaling: --lr-grid OPT:LR,...; the others: a list
        protocol: {optimizers: {lars: {...}}, claims: [...]}   # --protocol: keys in place of the package's
        from_tuning: ["{out}/tune"]                     # "{out}": this experiment's OUT
      - name: restarts
        optional: true       # run only when named by --only
      - name: recheck        # another file's study, stated once there: its settings (its common's too), with
        from: {file: batch_scaling.yaml, study: final, out: ../results/large_batch}   # "{out}" there: out
        claims_only: true    # a setting given here replaces that study's

1. Read and check the file: one sentence naming the file and the key for anything that is not of this shape, a
   study kind that does not exist, or a setting its study does not take (checked against the study's own flags).
2. Budget-independent units: a value "A/B run" is that fraction of the study's `epochs`, rounded to 3 decimals
   (warm-up 5/90 run is 1.333 epochs of a 24-epoch study and 0.444 of an 8-epoch tuning), so one protocol
   states its schedule once for every budget (in `set`, `opt_set` and the protocol's optimizer settings);
   learning rates are per `optim.reference_batch` (256) images. A study's `protocol` (the study kind's keys:
   its optimizers or variants, its claims with their rules, `largebatch/commands/study/protocol.yaml`) is
   checked here, with the file and key named, and passed to the study as --protocol; a study without one runs
   the package's.
3. Paths: a relative path in the file is relative to the file's directory; "{out}/NAME" is inside OUT, as --out
   gives it. A study taken `from` another file keeps that file's paths: relative to its directory, and "{out}"
   there is the `out` given with `from` (relative to this file: where that experiment ran), else this OUT.
4. Run each study (`largebatch study KIND ... --out OUT/NAME`) in order; --dry-run lists every cell's command
   and trains nothing. The first study that fails stops the experiment with its exit code.
"""
from __future__ import annotations

import json
import re
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

from largebatch.cli import ArgumentParser
from largebatch.commands.study.kinds import KINDS
from largebatch.commands.study.protocol import RUN_FRACTION
from largebatch.errors import UserError

EXPERIMENTS_DIR = Path(__file__).resolve().parent.parent.parent / "experiments"


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="largebatch study", description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("experiment", help="an experiment file (experiments/NAME.yaml, or NAME of one there); the "
                                      "studies themselves: largebatch study batch-scaling | batch-control | ensemble")
    p.add_argument("--out", type=Path, default=None, help="experiment directory (default: runs/NAME)")
    p.add_argument("--dry-run", action="store_true", help="check the file and list every cell, train nothing")
    p.add_argument("--only", default=None, metavar="NAME,...",
                   help="run only these studies of the file (also the optional ones), in the file's order")
    return p


def _study_main(kind: str) -> tuple[Callable[[list[str]], int], ArgumentParser]:
    from largebatch.commands.study import kinds, runner

    return (lambda argv: runner.run(kind, argv)), kinds.parser(kind)


def resolve(name: str) -> Path:
    """The experiment file: a path, or the name of one in experiments/."""
    path = Path(name)
    if path.suffix not in (".yaml", ".yml") and "/" not in name:
        path = EXPERIMENTS_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml")))
        raise UserError(f"no experiment file {name}; give a YAML file, one of experiments/ ({known}), or a study: "
                        f"{', '.join(KINDS)}.")
    return path


def _number(value: Any, epochs: float | None, where: str) -> Any:
    """A value as it is, or "A/B run" as that fraction of the study's epochs (rounded to 3 decimals); in a list,
    each item."""
    if isinstance(value, list):
        return [_number(v, epochs, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str) and RUN_FRACTION.match(value):
        if epochs is None:
            raise UserError(f"{where} is {value!r}, a fraction of the run, but the study gives no epochs; add "
                            "epochs to it (or to common).")
        a, b = (Fraction(x) for x in RUN_FRACTION.match(value).groups())   # type: ignore[union-attr]
        if b == 0:
            raise UserError(f"{where} is {value!r}; a fraction of the run needs a divisor above 0.")
        return round(float(epochs * a / b), 3)
    return value


def _text(value: Any) -> str:
    """A value as a flag or --set takes it: numbers as %g-like text (2, 1.333, 0.0078125), lists as [a,b]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return repr(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_text(v) for v in value) + "]"
    return str(value)


def _merge(common: dict, own: dict) -> dict:
    out = dict(common)
    for key, value in own.items():
        if isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = out[key] + value
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def study_argv(entry: dict, out: Path, base: Path, where: str) -> tuple[str, list[str]]:
    """Step 2-3 for one study: (kind, the study command's argv), every setting checked against its flags."""
    kind = entry.get("study")
    if kind not in KINDS:
        raise UserError(f"{where}.study is {kind!r}; give one of {', '.join(KINDS)}.")
    _, p = _study_main(kind)
    long = [(a, next((o for o in a.option_strings if o.startswith("--")), None)) for a in p._actions]
    flags = {flag[2:].replace("-", "_"): (a, flag) for a, flag in long if flag}   # --opt-set: opt_set
    epochs = entry.get("epochs")
    argv: list[str] = []
    for key, value in entry.items():
        if key in ("name", "study", "optional", "from"):
            continue
        here = f"{where}.{key}"
        if key in ("out", "dry_run", "help") or key not in flags:
            valid = sorted(k for k in flags if k not in ("out", "dry_run", "help"))
            raise UserError(f"{here}: study {kind} has no setting {key!r}; valid: {', '.join(valid)}.")
        action, flag = flags[key]
        if key == "set":
            if not isinstance(value, dict):
                raise UserError(f"{here} must be a mapping of section.key to value, got {value!r}.")
            argv += [x for k, v in value.items() for x in (flag, f"{k}={_text(_number(v, epochs, f'{here}.{k}'))}")]
        elif key == "opt_set":
            if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                raise UserError(f"{here} must map each optimizer to a mapping of section.key to value, got {value!r}.")
            argv += [x for opt, sets in value.items() for k, v in sets.items()
                     for x in (flag, f"{opt}:{k}={_text(_number(v, epochs, f'{here}.{opt}.{k}'))}")]
        elif key == "protocol":
            argv += [flag, json.dumps(_protocol(kind, value, epochs, here), separators=(",", ":"), ensure_ascii=False)]
        elif key == "lr_grid" and kind == "batch-scaling":
            if not isinstance(value, dict):
                raise UserError(f"{here} must map each optimizer to a list of lrs, got {value!r}.")
            argv += [x for opt, lrs in value.items()
                     for x in (flag, f"{opt}:{','.join(_text(v) for v in (lrs if isinstance(lrs, list) else [lrs]))}")]
        elif action.nargs == 0:   # a switch
            if not isinstance(value, bool):
                raise UserError(f"{here} is a switch; give true or false, got {value!r}.")
            argv += [flag] if value else []
        elif isinstance(action.default, list):   # repeatable (--from-tuning)
            for item in value if isinstance(value, list) else [value]:
                argv += [flag, _path(str(item), out, base) if key == "from_tuning" else _text(item)]
        elif key == "from_tuning" and isinstance(value, list):
            raise UserError(f"{here}: study {kind} takes one tuning directory, got {len(value)}.")
        elif isinstance(value, list):   # a comma-separated list (--batches, --optimizers, batch-control's --lr-grid)
            argv += [flag, ",".join(_text(v) for v in value)]
        elif key == "from_tuning":
            argv += [flag, _path(str(value), out, base)]
        else:
            argv += [flag, _text(_number(value, epochs, here))]
    return kind, argv


def _protocol(kind: str, value: Any, epochs: float | None, where: str) -> dict:
    """A study's `protocol`: its optimizer settings' "A/B run" values as epochs, then checked as the study will
    check it (`protocol.of`), so that a mistake names this file and key."""
    from largebatch.commands.study import protocol

    if not isinstance(value, dict) or not value:
        raise UserError(f"{where} is {value!r}; give a mapping of the protocol keys it replaces "
                        f"({', '.join(protocol.KEYS[kind])}), or leave it out for the package's.")
    if isinstance(value.get("optimizers"), dict):
        value = {**value, "optimizers": {
            name: {k: _number(v, epochs, f"{where}.optimizers.{name}.{k}") for k, v in sets.items()}
            if isinstance(sets, dict) else sets for name, sets in value["optimizers"].items()}}
    protocol.of(kind, value, where)
    return value


def _path(text: str, out: Path, base: Path) -> str:
    """A path of the file: "{out}/..." inside OUT (as given, relative to the current directory like --out),
    anything else relative to the file's directory `base`."""
    if text.startswith("{out}"):
        return str(out / text[len("{out}"):].lstrip("/"))
    path = Path(text)
    return str(path if path.is_absolute() else base / path)


def load(path: Path) -> dict:
    """Step 1: the file as a mapping with a list of studies, each with a unique name (and a `from` naming a file
    and a study, and optionally where that file's studies ran)."""
    from largebatch.config import load_yaml

    data = load_yaml(path, what="experiment file")
    studies = data.get("studies")
    if not isinstance(studies, list) or not studies:
        raise UserError(f"experiment file {path} has no list of studies; give 'studies:' with one entry per study.")
    unknown = sorted(set(data) - {"about", "common", "studies"})
    if unknown:
        raise UserError(f"experiment file {path} has unknown keys {unknown}; valid: about, common, studies.")
    if not isinstance(data.get("common", {}), dict):
        raise UserError(f"experiment file {path}: common must be a mapping of study settings.")
    names = []
    for i, entry in enumerate(studies):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise UserError(f"experiment file {path}: studies[{i}] must be a mapping with a name and a study.")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", entry["name"]) or entry["name"] in names:
            raise UserError(f"experiment file {path}: studies[{i}].name {entry['name']!r} must be unique and a plain "
                            "directory name (letters, digits, _ . -).")
        names.append(entry["name"])
        taken = entry.get("from")
        shape = isinstance(taken, dict) and {"file", "study"} <= set(taken) <= {"file", "study", "out"}
        if "from" in entry and not (shape and all(isinstance(v, str) and v for v in dict(taken or {}).values())):
            raise UserError(f"experiment file {path}: studies[{i}].from must be {{file: OTHER.yaml, study: NAME}}, "
                            f"optionally with out: DIR (where OTHER.yaml's studies ran); got {taken!r}.")
    return data


def _rebase(text: str, out: Path | None, base: Path) -> str:
    """A path of a study taken `from` another file, as this file's study_argv reads it: "{out}/..." inside `out`
    (None: left to mean this OUT), anything else relative to that file's directory `base`."""
    if text.startswith("{out}") and out is None:
        return text
    return _path(text, out if out is not None else Path(), base)


def _taken(entry: dict, path: Path, where: str) -> dict:
    """Step 1 for `from: {file, study, out}`: that study as its file states it (its common merged in), its paths
    rebased (`_rebase`), then this entry's settings in place of its own."""
    ref = entry["from"]
    other = path.resolve().parent / ref["file"]
    if not other.is_file():
        raise UserError(f"{where}.from: no experiment file {other}; give a file beside {path.name} or a path "
                        "relative to it.")
    data = load(other)
    found = next((e for e in data["studies"] if e["name"] == ref["study"]), None)
    if found is None:
        raise UserError(f"{where}.from: {other} has no study {ref['study']!r}; its studies: "
                        f"{', '.join(e['name'] for e in data['studies'])}.")
    if "from" in found:
        raise UserError(f"{where}.from: study {ref['study']!r} of {other} is itself taken from another file; "
                        "take that one instead.")
    study = _merge(data.get("common") or {}, found)
    ran = path.resolve().parent / ref["out"] if "out" in ref else None
    if "from_tuning" in study:
        tunings = study["from_tuning"]
        rebased = [_rebase(str(t), ran, other.parent) for t in (tunings if isinstance(tunings, list) else [tunings])]
        study["from_tuning"] = rebased if isinstance(tunings, list) else rebased[0]
    own = {k: v for k, v in entry.items() if k != "from"}
    return {**{k: v for k, v in study.items() if k not in ("name", "optional")}, **own}


def plan(path: Path, out: Path, only: list[str] | None = None) -> list[tuple[str, str, list[str]]]:
    """Steps 1-3: (name, study kind, argv with --out) of every study to run, in the file's order."""
    data = load(path)
    entries = data["studies"]
    names = [e["name"] for e in entries]
    for name in only or []:
        if name not in names:
            raise UserError(f"--only {name}: experiment file {path} has no study of that name; its studies: "
                            f"{', '.join(names)}.")
    out_list = []
    for i, entry in enumerate(entries):
        if (only and entry["name"] not in only) or (not only and entry.get("optional")):
            continue
        where = f"{path}: studies[{i}] ({entry['name']})"
        merged = _taken(entry, path, where) if "from" in entry else _merge(data.get("common") or {}, entry)
        kind, argv = study_argv(merged, out, path.resolve().parent, where)
        out_list.append((entry["name"], kind, argv + ["--out", str(out / entry["name"])]))
    return out_list


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    path = resolve(args.experiment)
    out = args.out if args.out is not None else Path("runs") / path.stem
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    studies = plan(path, out, only)
    if not args.dry_run:
        from largebatch.cli import check_output_path

        check_output_path("--out", out, directory=True)
        out.mkdir(parents=True, exist_ok=True)
    for name, kind, study_args in studies:
        print(f"experiment {path.stem}: study {name} ({kind})", file=sys.stderr, flush=True)
        waiting = [Path(v).name for flag, v in zip(study_args, study_args[1:]) if flag == "--from-tuning"
                   and Path(v).parent == out and not (Path(v) / "study.json").exists()]
        if args.dry_run and waiting:   # its lrs are chosen by tunings of this experiment that have not run
            print(f"  its cells take their lrs from {', '.join(waiting)}, which have not run yet; they are listed "
                  "once those have.", file=sys.stderr, flush=True)
            continue
        run, _ = _study_main(kind)
        code = run(study_args + (["--dry-run"] if args.dry_run else []))
        if code:
            print(f"experiment {path.stem}: study {name} ended with exit {code}; the experiment stops here (run it "
                  "again to resume).", file=sys.stderr, flush=True)
            return code
    return 0
