"""study.md's tables and study.png, as each kind shows them (`kinds.KINDS`' `body` and `chart`).

- batch-scaling (`grid_body`, `batch_chart`): a row per global batch, per optimizer the chosen lr's top-1, lr and
  train loss; the gradient noise scales; the papers' claims. The chart: top-1 against the global batch on a log2
  axis, error bars over seeds, the ImageNet-equivalent batch on top.
- the variant kinds (`variant_body`, `variant_chart`): a row per variant (and one per extra figure, the snapshots'
  weight average), the claim's sentence. The chart: a bar per variant and figure, and each variant's training
  loss against epoch.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from largebatch.commands.study.cells import train_records
from largebatch.commands.study.directory import save_figure

IMAGENET_IMAGES = 1_281_167
COLOURS = ["#4c72b0", "#dd8452", "#8c8c8c", "#55a868"]


@contextlib.contextmanager
def _figure(path: Path, *args, **kwargs):
    """A matplotlib figure (`plt.subplots(*args, **kwargs)`) saved to `path`, whole or not at all, and closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*args, **kwargs)
    try:
        yield axes
        fig.tight_layout()
        save_figure(fig, path)
    finally:
        plt.close(fig)


def grid_body(kind, table: dict, meta: dict, split: str, verdicts: list[dict]) -> str:
    """batch-scaling's study.md tables: the grid over --batches (sorted) and --optimizers, then the claims."""
    return grid_markdown(table, sorted(meta["batches"]), meta["optimizers"], split) + claims_markdown(verdicts, split)


def grid_markdown(table: dict, batches: list[int], optimizers: list[str], split: str = "test") -> str:
    """batch-scaling's table: one row per global batch; per optimizer the chosen lr's top-1 (mean ± std over
    seeds), its lr and train loss; then the gradient noise scale per batch and optimizer."""
    head = "| global batch | " + " | ".join(f"{o} {split} top-1 (%) | {o} lr | {o} train loss"
                                            for o in optimizers) + " |"
    sep = "|---:|" + "---:|---:|---:|" * len(optimizers)
    rows = [head, sep]
    for b in batches:
        cols = []
        for o in optimizers:
            c = next((r for r in table.values() if r["batch"] == b and r["optimizer"] == o and r["chosen"]), None)
            if c is None:
                cols += ["(not run)", "", ""]
            else:
                gone = c.get("diverged_lrs", [])
                lrs = sorted({r["lr"] for r in table.values() if r["batch"] == b and r["optimizer"] == o
                              and r["lr"] is not None} | set(gone))
                tried = len(lrs)
                edge = tried > 1 and c["lr"] in (lrs[0], lrs[-1])   # the optimum may lie outside the grid
                cols.append(f"{100 * c['top1_mean']:.2f} ± {100 * c['top1_std']:.2f} (n={c['seeds']})")
                notes = [f"best of {tried}"] + ([f"{len(gone)} diverged"] if gone else []) + (["at the edge"] if edge else [])
                cols.append("setting" if c["lr"] is None else f"{c['lr']:g}" + (
                    f" ({', '.join(notes)})" if tried > 1 else ""))
                cols.append(f"{c['train_loss_mean']:.3f}" if c["train_loss_mean"] is not None else "")
        rows.append(f"| {b} | " + " | ".join(cols) + " |")
    noise = {(r["batch"], r["optimizer"]): r["noise_scale_mean"] for r in table.values()
             if r["chosen"] and r.get("noise_scale_mean") is not None}
    if noise:
        rows += ["", "Gradient noise scale B_simple (second half of training, chosen lr; the batch above which a "
                 "larger batch stops paying, McCandlish et al.):", "",
                 "| global batch | " + " | ".join(f"{o} B_simple" for o in optimizers) + " |",
                 "|---:|" + "---:|" * len(optimizers)]
        for b in batches:
            rows.append(f"| {b} | " + " | ".join(f"{noise[(b, o)]:,.0f}" if (b, o) in noise else ""
                                                  for o in optimizers) + " |")
    return "\n".join(rows) + "\n"


def claims_markdown(rows: list[dict], split: str) -> str:
    """The listed claims' verdicts (`verdict.judge`) as a table."""
    if not rows:
        return ""
    lines = ["", f"The papers' claims ({split} top-1, chosen lr, against SGD at batch {rows[0]['baseline_batch']}):", "",
             "| claim | measured | difference (points) | held |", "|---|---:|---:|---|"]
    for r in rows:
        verdict = ("held" if r["held"] else "did not hold") + (" (1 seed)" if r["seeds"] < 2 else "")
        lines.append(f"| {r['who']}: {r['claim']} | {r['optimizer']} at {r['batch']}: {100 * r['top1']:.2f} "
                     f"(baseline {100 * r['baseline_top1']:.2f}) | {100 * r['difference']:+.2f} "
                     f"± {100 * r['spread']:.2f} | {verdict} |")
    return "\n".join(lines) + "\n"


def batch_chart(kind, table: dict, cells: list[dict], meta: dict, path: Path) -> None:
    """batch-scaling's study.png (`plot`)."""
    plot(table, meta["optimizers"], path, meta.get("train_size"), "validation" if meta.get("val_split") else "test")


def plot(table: dict, optimizers: list[str], path: Path, train_size: int | None = None, split: str = "test") -> None:
    """Top-1 (chosen lr per cell) against the global batch on a log2 axis, error bars over seeds; with
    `train_size`, the ImageNet batch with the same steps per epoch on a second axis."""
    with _figure(path, figsize=(6, 4)) as ax:
        _batch_axes(ax, table, optimizers, train_size, split)


def _batch_axes(ax, table: dict, optimizers: list[str], train_size: int | None, split: str) -> None:
    for o in optimizers:
        pts = sorted((c["batch"], c["top1_mean"], c["top1_std"]) for c in table.values()
                     if c["optimizer"] == o and c.get("chosen", True))
        if pts:
            xs, ys, es = zip(*pts)
            ax.errorbar(xs, [100 * y for y in ys], yerr=[100 * e for e in es], marker="o", capsize=3, label=o)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch (images)")
    ax.set_ylabel(f"{split} top-1 (%)")
    if train_size:
        import numpy as np
        from matplotlib.ticker import NullFormatter

        scale = IMAGENET_IMAGES / train_size
        top = ax.secondary_xaxis("top", functions=(lambda b: np.multiply(b, scale), lambda b: np.divide(b, scale)))
        batches = sorted({c["batch"] for c in table.values()})
        top.set_xticks([b * scale for b in batches], [f"{b * scale / 1000:.3g}K" for b in batches])
        top.xaxis.set_minor_formatter(NullFormatter())
        top.set_xlabel("ImageNet-equivalent batch (same steps per epoch)")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_title("top-1 vs global batch at equal epochs")
    ax.grid(alpha=0.3)
    ax.legend()


def variant_body(kind, table: dict, meta: dict, split: str, verdicts: list[dict]) -> str:
    """A variant kind's study.md table: a row per variant (top-1 mean ± std, seeds, its figures' columns, the
    chosen lr with how many ran and diverged), a row per figure shown as one (the snapshots' weight average), and
    the sentence of the kind's claim."""
    columns = [f for f in kind.figures if f.column]
    with_lr = any(r.get("lr") is not None for n, r in table.items() if n != "verdict")
    rows = [f"| variant | {split} top-1 (%) | seeds |" + "".join(f" {f.column} |" for f in columns)
            + (" lr |" if with_lr else ""),
            "|---|---:|---:|" + "---:|" * len(columns) + ("---:|" if with_lr else "")]
    for name, r in table.items():
        if name == "verdict":
            continue
        extra = "".join(f" {100 * r[f'{f.name}_mean']:.2f} ± {100 * r[f'{f.name}_std']:.2f} |"
                        if f"{f.name}_mean" in r else " |" for f in columns)
        if with_lr:
            runs = r.get("lrs_run", 1)
            tried = f" (best of {runs}" + (f", {r['lrs_diverged']} diverged" if r.get("lrs_diverged") else "") + ")"
            extra += f" {r['lr']:g}{tried if runs > 1 else ''} |"
        rows.append(f"| {name} | {100 * r['top1_mean']:.2f} ± {100 * r['top1_std']:.2f} | {r['seeds']} |{extra}")
    for f in kind.figures:
        r = table.get(f.variant, {})
        if f.row and f"{f.name}_mean" in r:
            rows.append(f"| {f.row} | {100 * r[f'{f.name}_mean']:.2f} ± {100 * r[f'{f.name}_std']:.2f} | "
                        f"{r['seeds']} |" + " |" * len(columns) + (" |" if with_lr else ""))
    v = table.get("verdict")
    if v:
        claim = kind.protocol.claims[0]
        rows.append("")
        rows.append(f"Claim ({claim.claim}): difference {100 * v['difference']:+.2f} points, spread "
                    f"{100 * v['spread']:.2f}" + "".join(f", {a.label} {100 * v[a.name]:+.2f}" for a in claim.also
                                                          if a.name in v)
                    + f": **{'held' if v['holds'] else 'did not hold'}**.")
    return "\n".join(rows) + "\n"


def loss_curves(table: dict, cells: list[dict]) -> dict[str, list[tuple[float, float, float, float]]]:
    """Per variant, at its chosen lr: the training loss against epoch over its finished seeds, as
    (epoch, mean, min, max) at the epochs every seed logged (the seeds share one schedule)."""
    curves = {}
    for name, row in table.items():
        if name == "verdict":
            continue
        runs = [{r["epoch"]: r["loss"] for r in train_records(Path(c["run_dir"]))}
                for c in cells if c["variant"] == name and c.get("lr") == row.get("lr") and c.get("top1") is not None]
        epochs = sorted(set.intersection(*(set(r) for r in runs))) if runs else []
        curves[name] = [(e, sum(r[e] for r in runs) / len(runs), min(r[e] for r in runs), max(r[e] for r in runs))
                        for e in epochs]
    return curves


def variant_chart(kind, table: dict, cells: list[dict], meta: dict, path: Path) -> None:
    """A variant kind's study.png: its bars and training-loss curves (`bars`)."""
    bars(kind, table, path, "validation" if meta.get("val_split") else "test", loss_curves(table, cells))


def bars(kind, table: dict, path: Path, split: str, curves: dict | None = None) -> None:
    """Left: top-1 per variant (mean, error bar = std over seeds) and per figure with a bar (the ensemble's best
    snapshot and the snapshots' weight average); right, with `curves`: training loss against epoch per variant."""
    shown = [(n, table[n]["top1_mean"], table[n]["top1_std"]) for n in table if n != "verdict"]
    for f in kind.figures:
        r = table.get(f.variant, {})
        if f.bar and f"{f.name}_mean" in r:
            shown.append((f.bar, r[f"{f.name}_mean"], r[f"{f.name}_std"]))
    with_curves = curves is not None and any(curves.values())
    with _figure(path, 1, 2 if with_curves else 1, figsize=(9.5 if with_curves else 4.5, 3.5), squeeze=False) as axes:
        ax = axes[0][0]
        ax.bar([b[0] for b in shown], [100 * b[1] for b in shown], yerr=[100 * b[2] for b in shown], capsize=4,
               color=COLOURS[: len(shown)])
        low = min(100 * (b[1] - b[2]) for b in shown)
        high = max(100 * (b[1] + b[2]) for b in shown)
        ax.set_ylim(max(0.0, low - max(1.0, high - low)), min(100.0, high + 0.25 * max(1.0, high - low)))
        ax.set_ylabel(f"{split} top-1 (%)")
        ax.grid(axis="y", alpha=0.3)
        if curves is not None and with_curves:
            lx = axes[0][1]
            for i, (name, points) in enumerate(curves.items()):
                if not points:
                    continue
                e, mean, lo, hi = zip(*points)
                lx.plot(e, mean, color=COLOURS[i % len(COLOURS)], label=name)
                lx.fill_between(e, lo, hi, color=COLOURS[i % len(COLOURS)], alpha=0.2)
            lx.set_xlabel("epoch")
            lx.set_ylabel("training loss")
            lx.set_title("mean over seeds, band: their range", fontsize=9)
            lx.grid(alpha=0.3)
            lx.legend()
