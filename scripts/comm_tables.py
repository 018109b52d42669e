"""Markdown tables for docs/communication.md from the JSON files of scripts/bench_comm.sh.

    .venv/bin/python scripts/comm_tables.py OUTDIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from largebatch.commands.bench.allreduce import human


def allreduce_tables(path: Path) -> str:
    data = json.loads(path.read_text())
    rows = data["rows"]
    names = list(dict.fromkeys(r["algorithm"] for r in rows))
    sizes = list(dict.fromkeys(r["bytes"] for r in rows))
    at = {(r["algorithm"], r["bytes"]): r for r in rows}
    out = [f"`{data['command']}` ({data['machine']}; load average at the end "
           f"{', '.join(f'{x:.1f}' for x in data['load_average_1_5_15'])})", "",
           "busbw (GB/s) of native, and of each algorithm relative to native:", "",
           "| size | native busbw | " + " | ".join(n for n in names if n != "native") + " |",
           "|---|---|" + "---|" * (len(names) - 1)]
    for s in sizes:
        nat = at[("native", s)]["busbw_GBps"]
        out.append(f"| {human(s)} | {nat:.3f} | " + " | ".join(
            f"{at[(n, s)]['busbw_GBps'] / nat:.2f}x" for n in names if n != "native") + " |")
    out += ["", "measured (mean per call) / predicted time (ms) and the prediction's error (perf model on the "
            "measured links; the median call is in the JSON as median_s):", "",
            "| size | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for s in sizes:
        cells = []
        for n in names:
            r = at[(n, s)]
            if r.get("predicted_s") is None:
                cells.append(f"{r['time_s'] * 1e3:.2f} / -")
            else:
                cells.append(f"{r['time_s'] * 1e3:.2f} / {r['predicted_s'] * 1e3:.2f} "
                             f"({r['error']:+.0%})")
        out.append(f"| {human(s)} | " + " | ".join(cells) + " |")
    out += ["", "| algorithm | sizes within 25% | max error |", "|---|---|---|"]
    for n, f in data["fits"].items():
        out.append(f"| {n} | {f['within_25pct']}/{f['points']} | {f['max_abs_error']:.0%} |")
    links = data["links"]
    out.append("")
    for name in ("intra", "inter"):
        if name in links:
            f = links[name]
            out.append(f"- {name}-node link: alpha = {f['alpha_s'] * 1e6:.0f} us, B = {f['bandwidth_Bps'] / 1e9:.3f} GB/s "
                       f"({f['flows']} flow(s) per node in the measured step)")
    out.append(f"- gamma (add_): {links['gamma_s_per_byte'] * 1e9:.3f} ns/byte")
    return "\n".join(out)


def training_table(path: Path) -> str:
    data = json.loads(path.read_text())
    rows = data["training"]
    out = [f"`{data['command']}` ({data['machine']}; load average at the end "
           f"{', '.join(f'{x:.1f}' for x in data['load_average_1_5_15'])}; "
           f"{rows[0]['gradient_MB']:.1f} MB of gradients)", "",
           "| hook | step (ms) | exposed comm (ms) | rounds (ms) |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['hook']} | {r['step_s'] * 1e3:.1f} | {r['exposed_comm_s'] * 1e3:+.1f} | "
                   + ", ".join(f"{x * 1e3:.0f}" for x in r["samples_s"]) + " |")
    return "\n".join(out)


def main(outdir: str) -> None:
    d = Path(outdir)
    for name in ("communication_1x4.json", "communication_2x2.json"):
        if (d / name).exists():
            print(f"\n## {name}\n\n" + allreduce_tables(d / name))
    if (d / "communication_training.json").exists():
        print("\n## communication_training.json\n\n" + training_table(d / "communication_training.json"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results/communication")
