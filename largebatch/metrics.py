"""What a run reports: metrics.jsonl, a live progress display, the summary, plots.

Only rank 0 writes. Values arrive here already as Python numbers: the trainer does its
host syncs on logging steps only. Files are written with O_NOFOLLOW (`rundir.open_own`, `rundir.write_own`)
into sub-directories from `rundir.own_dir`: a symbolic link among them is refused, never written through.
Each is whole or absent: summary.json, corrupt_images.txt and the plots are written to a temporary name,
fsync'ed and renamed (`rundir.write_own`, through `checkpoint.atomic_write`); metrics.jsonl takes whole lines
only (`checkpoint.append_whole`). A full disk is an OSError naming the file, which the command line turns into
one sentence (exit 2), keeping what was written.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from largebatch.checkpoint import append_whole
from largebatch.errors import UserError, fs_bytes
from largebatch.rundir import open_own, own_dir, write_own


FLAGS_OF_NOTE = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def machine(device) -> str:
    """The machine in words: the GPU, or the CPU model, the vector flags that decide CPU speed and the core
    count; and torch's version. Every figure (a benchmark's, a run's summary.json) carries it."""
    import torch

    version = torch.__version__.split("+")[0]
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, torch {version}"
    model, flags = "", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    model = model or platform.processor() or "CPU"   # platform.processor runs `uname -p`: only without cpuinfo's
    noted = " ".join(f for f in FLAGS_OF_NOTE if f in flags) or "none of " + " ".join(FLAGS_OF_NOTE)
    gpu = "GPU not used" if torch.cuda.is_available() else "no GPU"
    return f"{model} (flags: {noted}), {len(os.sched_getaffinity(0))} cores, {gpu}, torch {version}"


class MetricsLog:
    """Appends one JSON object per line; reopened in append mode so a resumed run continues it.

    A line is appended whole or not at all (`checkpoint.append_whole`): a full disk mid-line cuts the file back
    and raises an OSError naming it, so the lines written before stay readable. A torn last line left by an
    older writer killed mid-line is cut off when the log is reopened, so the next line does not join it."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path = path
        self.enabled = enabled
        self._f = open_own(path, "ab") if enabled else None
        if self._f is not None:
            _cut_torn_tail(self._f.fileno(), path)

    def write(self, record: dict) -> None:
        if self._f:
            append_whole(self._f.fileno(), (json.dumps(record) + "\n").encode(), self.path)

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


def _cut_torn_tail(fd: int, path: Path) -> None:
    """Cut a last line without its newline off the log open at `fd` (it is half a record)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        end = size
        while end > 0:
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            if end == size and block.endswith(b"\n"):
                return
            newline = block.rfind(b"\n")
            if newline >= 0:
                os.ftruncate(fd, start + newline + 1)
                return
            end = start
    os.ftruncate(fd, 0)


# The fields of a record that readers use as numbers; the first ones of each kind must be there.
NUMBERS = ("step", "epoch", "loss", "lr", "global_batch", "images_per_s", "data_wait_s", "nonfinite_steps", "time",
           "top1", "top5", "noise_scale", "grad_sq", "grad_trace", "ensemble_top1", "ensemble_top5", "ensemble_loss",
           "best_snapshot_top1")
REQUIRED = {"train": ("step", "epoch", "loss"), "eval": ("step", "top1"), "ensemble": ("step",)}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, in order. A line that is no JSON (torn by a kill or a full disk mid-write,
    which only an older writer left) is skipped; a line that is JSON but no record a run writes (not an object, a
    kind that is no string, a number field that is no number, or a train or eval record without its numbers) is
    a UserError naming the file and the line. A run whose metrics were compressed for results/ (metrics.jsonl.gz
    beside no metrics.jsonl) is read from the compressed file."""
    packed = path.with_name(path.name + ".gz")
    if not path.exists() and packed.exists():
        import gzip

        text = gzip.decompress(packed.read_bytes()).decode(errors="replace")
    elif path.exists():
        text = path.read_text(errors="replace")
    else:
        return []
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            rec = json.loads(line)
        except ValueError:   # a line cut by a kill mid-write
            continue
        why = ""
        if not isinstance(rec, dict):
            why = f"a JSON {type(rec).__name__}, not an object"
        elif "kind" in rec and not isinstance(rec["kind"], str):
            why = f"its kind is {rec['kind']!r}"
        else:
            bad = next((k for k in NUMBERS if k in rec and not _is_number(rec[k])), None)
            missing = next((k for k in REQUIRED.get(rec.get("kind", ""), ()) if k not in rec), None)
            why = (f"its {bad} is {rec[bad]!r}, not a number" if bad else
                   f"its {rec['kind']} record has no {missing}" if missing else "")
        if why:
            raise UserError(f"{path} line {number} is not a record a largebatch run writes ({why}); remove or fix "
                            "that line (the file was changed by something other than the run).")
        out.append(rec)
    return out


class ProgressDisplay:
    """A rich progress bar on a terminal; plain log lines otherwise (CI logs, files)."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool):
        self.enabled = enabled
        self.console = Console(stderr=True)
        self.live = enabled and self.console.is_terminal
        self.progress = None
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(),
                TextColumn("step {task.completed}/{task.total}"),
                TextColumn("loss {task.fields[loss]} lr {task.fields[lr]} batch {task.fields[batch]} "
                           "{task.fields[ips]} img/s"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=self.console)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                               epoch=0, loss="-", lr="-", batch="-", ips="-")
            self.progress.start()

    def update(self, rec: dict) -> None:
        if not self.enabled:
            return
        if self.progress is not None:   # the live display
            self.progress.update(self.task, completed=rec["step"], epoch=f"{rec['epoch']:.2f}",
                                 loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.4g}", batch=rec["global_batch"],
                                 ips=f"{rec['images_per_s']:.0f}")
        else:
            print(f"epoch {rec['epoch']:6.2f}  step {rec['step']:6d}  loss {rec['loss']:.4f}  lr {rec['lr']:.4g}  "
                  f"batch {rec['global_batch']}  {rec['images_per_s']:.0f} img/s", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if self.enabled:
            self.console.print(text)

    def close(self) -> None:
        if self.progress:
            self.progress.stop()


def summary_table(summary: dict) -> Table:
    table = Table(title="largebatch run summary", show_header=False)
    for key in ("final_top1", "final_top5", "best_top1", "epochs", "steps", "wall_s", "train_images_per_s",
                "world_size", "global_batch", "nonfinite_steps", "corrupt_images"):
        if key in summary:
            value = summary[key]
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    return table


def plot(records: list[dict], out_dir: Path) -> list[Path]:
    """PNGs of loss, top-1, lr, batch size and (when measured) the gradient noise scale against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    own_dir(out_dir)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    series = {
        "loss": (train, "loss", "training loss"),
        "top1": (evals, "top1", "test top-1"),
        "lr": (train, "lr", "learning rate"),
        "batch": (train, "global_batch", "global batch"),
        "noise_scale": (train, "noise_scale", "gradient noise scale B_simple (images)"),
    }
    paths = []
    for name, (rows, key, label) in series.items():
        rows = [r for r in rows if key in r]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="." if len(rows) < 50 else None)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        plt.close(fig)
        write_own(path, buf.getvalue())   # whole or absent (a full disk), never through a link
        paths.append(path)
    return paths


class Timer:
    def __init__(self):
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def write_tensorboard(run_dir: Path) -> None:
    """The TensorBoard event file of metrics.jsonl, whole or absent: written into a temporary directory inside
    tensorboard/ (a leftover of a killed run's is removed first), fsync'ed, then renamed into tensorboard/."""
    if (run_dir / "tensorboard").is_symlink():   # refused whether or not the package is there
        own_dir(run_dir / "tensorboard")
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("largebatch: train.tensorboard needs the tensorboard package: pip install -e .[tensorboard]",
              file=sys.stderr)
        return
    records = read(run_dir / "metrics.jsonl")
    board = own_dir(run_dir / "tensorboard")
    for old in board.glob(".tmp-events-*"):   # only rank 0 writes here, under the run's lock: a killed run's
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-events-", dir=board))
    try:
        writer = SummaryWriter(str(tmp))
        for rec in records:
            for key in ("loss", "lr", "global_batch", "images_per_s", "top1", "top5"):
                if key in rec:
                    writer.add_scalar(f"{rec['kind']}/{key}", rec[key], rec["step"])
        writer.close()
        for entry in sorted(tmp.iterdir()):
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(entry, board / entry.name)
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(board)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_outputs(run_dir: Path, summary: dict, corrupt: list[str], *, plots: bool, tensorboard: bool) -> None:
    """A finished run's files, each whole or absent (`rundir.write_own`; a full disk is an OSError naming
    the file): corrupt_images.txt (when any image was skipped: one name per line, written as the bytes of the
    name on disk, so a name that is not UTF-8 is listed as it is; a newline inside a name is written as the two
    characters \\n), the plots and the TensorBoard event file when asked for, and summary.json last: a run
    directory with a summary.json holds all of its outputs (without it, --resume writes them)."""
    if corrupt:   # the names' bytes as on disk (any name, also one that is not UTF-8), one per line
        write_own(run_dir / "corrupt_images.txt",
                     b"".join(fs_bytes(name).replace(b"\n", b"\\n") + b"\n" for name in corrupt))
    if plots:
        plot(read(run_dir / "metrics.jsonl"), run_dir / "plots")
    if tensorboard:
        write_tensorboard(run_dir)
    write_summary(run_dir, summary)


def write_summary(run_dir: Path, summary: dict) -> None:
    """RUN_DIR/summary.json, whole or absent, never through a link."""
    write_own(run_dir / "summary.json", json.dumps(summary, indent=2).encode())


def diverged_summary(*, recipe: str, run_dir: Path, reason: str, epochs: float, steps: int, world_size: int,
                     machine: str) -> dict:
    """summary.json of a run that diverged: no evaluation, the trainer's sentence, where it stopped."""
    return {"status": "diverged", "recipe": recipe, "run_dir": str(run_dir), "reason": reason,
            "epochs": round(epochs, 4), "steps": steps, "world_size": world_size, "machine": machine}


def run_summary(*, recipe: str, run_dir: Path, last_eval: dict, progress, wall_s: float, epochs: float, steps: int,
                world_size: int, global_batch: int, corrupt_images: int, precision: str, threads: int,
                ensemble: dict, machine: str) -> dict:
    """summary.json's content for a run that finished (status "finished"; `diverged_summary` for one that
    diverged; a stopped run has none, and resumes): the last evaluation, the best top-1 of the run, its size and speed (images/s over
    the time spent in training steps, data waits included), the machine of rank 0 (`machine()`; a resumed run
    names the machine that finished it), and the Collapsed Ensemble's record if any."""
    return {
        "status": "finished", "recipe": recipe, "run_dir": str(run_dir),
        "final_top1": last_eval["top1"], "final_top5": last_eval["top5"], "final_loss": last_eval["loss"],
        "best_top1": max(progress.best_top1, last_eval["top1"]), "epochs": round(epochs, 4), "steps": steps,
        "wall_s": wall_s, "train_images_per_s": progress.images_seen / max(progress.train_time, 1e-9),
        "world_size": world_size, "global_batch": global_batch, "nonfinite_steps": progress.nonfinite_total,
        "corrupt_images": corrupt_images, "precision": precision, "threads_per_worker": threads,
        "machine": machine, **ensemble,
    }
