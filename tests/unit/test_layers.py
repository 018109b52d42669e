"""The import rule of docs/ARCHITECTURE.md, checked on the source (every import, function-level ones too).

Layers, lowest first; a module may import its own layer and the layers below, never above:
  0 base          errors, cli (the dispatch table and shared argument helpers),
                  safeyaml (bounded YAML loading)
  1 runtime       config (a package: fields, schema, checks, loading, reference), dist, launch, rundir, checkpoint,
                  resume, schedule, placement, metrics, models, data, optim, step, batches, progress, comm,
                  perf (the model), noise_scale, evaluation, ensemble, reliability
  2 trainer       trainer
  3 commands      largebatch/commands/ (train, evaluate, plan, study, chaos, cluster, bench/...), perf.calibrate,
                  __main__
plus: comm imports only errors and comm (comm.options: the one table of algorithm names and options; the runtime never depends on the performance model), and
perf's model imports no torch-distributed runtime but comm's pure layout helpers.
"""
from __future__ import annotations

import ast
from pathlib import Path

import largebatch

ROOT = Path(largebatch.__file__).parent
COMMANDS = {"largebatch.commands", "largebatch.perf.calibrate", "largebatch.__main__"}
BASE = {"largebatch", "largebatch.errors", "largebatch.cli", "largebatch.comm.options", "largebatch.safeyaml"}


def _module(path: Path) -> str:
    parts = ("largebatch",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("largebatch"):
            # `from PACKAGE import submodule` imports the submodule (and runs PACKAGE's __init__ first, which
            # is no edge of its own when the importer lives in PACKAGE); any other name comes from PACKAGE
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if _is_module(sub) else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("largebatch")}
    return out


def _within(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _layer(name: str) -> int:
    if _within(name, COMMANDS):
        return 3
    if _within(name, {"largebatch.trainer"}):
        return 2
    if name in BASE or _within(name, {"largebatch.errors"}) or name == "largebatch.__version__":
        return 0
    return 1


GRAPH = {_module(p): _imports(p) for p in ROOT.rglob("*.py")}


def test_no_module_imports_a_layer_above_it():
    bad = [f"{m} ({_layer(m)}) imports {d} ({_layer(d)})" for m, deps in GRAPH.items() for d in deps
           if _layer(d) > _layer(m)]
    assert not bad, "\n".join(sorted(bad))


def test_comm_imports_only_itself_errors_and_the_names():
    bad = [(m, d) for m, deps in GRAPH.items() if _within(m, {"largebatch.comm"}) for d in deps
           if not _within(d, {"largebatch.comm", "largebatch.errors", "largebatch.comm.options"})]
    assert not bad, bad


def test_the_performance_model_does_not_import_the_runtime():
    allowed = {"largebatch.perf", "largebatch.errors", "largebatch.comm.options", "largebatch.models", "largebatch.comm.pipeline",
               "largebatch.comm.topology", "largebatch.safeyaml"}
    bad = [(m, d) for m, deps in GRAPH.items()
           if _within(m, {"largebatch.perf"}) and not _within(m, COMMANDS) for d in deps if not _within(d, allowed)]
    assert not bad, bad


def test_the_rule_sees_violations():
    """The checker itself: a runtime module importing a command is caught."""
    assert _layer("largebatch.data.idx") < _layer("largebatch.commands.train")
    assert _imports(ROOT / "trainer.py") >= {"largebatch.evaluation", "largebatch.comm"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles: the strongly connected components of more than one module (Tarjan), plus self-imports.
    An import of a name from a package counts as an import of its __init__."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    """No circle, function-level imports included: a submodule that takes a name from its own package's
    __init__ (which imports the submodule) is a circle too."""
    graph = {m: {d for d in deps if d != m} for m, deps in GRAPH.items()}
    assert not _cycles(graph), _cycles(graph)


def test_the_circle_finder_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
