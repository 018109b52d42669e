"""The CUDA check's steps (run by scripts/gpu_check.sh, which installs the package and the carried wheels first).

    python scripts/gpu_check.py --mode gpu|cpu --out DIR

The steps, in the default order: the most important evidence first, so that the deadline cuts the least telling
step (the end-to-end train step before data, launch and more_tests). GPU_CHECK_ONLY=b,a runs b then a; the
machine step runs first unless GPU_CHECK_ONLY places it:

machine      the environment: GPU, driver, CUDA, torch, torchvision, timm; whether libnvjpeg.so.13 loads
             (ctypes) and which one; nvImageCodec's version and which of its back-ends decode a JPEG;
             torchvision's nvJPEG decode.
throughput   `largebatch bench train` of ResNet-50 at 224 px with LARS and label smoothing 0.1, batch 256
             (GPU_CHECK_BATCHES), bf16 and fp16 channels_last, eager and as one CUDA graph (GPU_CHECK_CONFIGS),
             beside torchvision's resnet50 through the same plain loop in the same run (GPU_CHECK_PEERS, e.g.
             timm,torchvision); MFU against the bf16 matmul peak measured in that run; MLPerf Training v4.0's
             7,951 img/s per H200 as the reference line, and NVIDIA's 2,470 img/s on an A100 scaled by the
             measured bf16 peak over the A100's 312 TFLOP/s.
cuda_tests   `pytest -m cuda tests/integration/test_cuda.py -k 'graph or prefetch or decode or gpu_cache or lars'`.
train        60 steps of `largebatch train` (ResNet-50, LARS, fp16, data.decode=gpu, train.cuda_graph=on,
             6 loader workers) on a generated ImageFolder of 500x375 JPEGs (written first): images/s and data
             wait per step, against the step alone.
data         `largebatch bench data` at 224 px, 6 loader workers, decoding on the CPU and on the GPU
             (GPU_CHECK_DECODE, e.g. cpu,gpu:nvimgcodec,gpu:torchvision), on that JPEG tree; does the loader
             keep up with the model's images/s from throughput?
launch       5 steps of one worker started as users start them on a node: `python -m largebatch.launch` (torchrun,
             with largebatch's exit codes and warm workers) `--nproc-per-node 1 --max-restarts 1 ... -m largebatch
             train` (synthetic data) with OMP_NUM_THREADS=1, what torchrun gives each worker of a node of several
             GPUs; the worker is forked from the launch's forkserver, on CUDA. The environment is in the record.
more_tests   the other CUDA tests of tests/integration/test_cuda.py. The `library` model tests (timm:/torchvision:
             models, tests/integration/test_any_model.py) are not here: they need no GPU, and `make test-eco`
             runs them.
calibrate    only when asked (GPU_CHECK_CALIBRATE=1, or named in GPU_CHECK_ONLY): `largebatch plan --calibrate`.

Time: every step and every command in it is bounded by one deadline, GPU_CHECK_DEADLINE_S (default 450)
after GPU_CHECK_T0 (the epoch second gpu_check.sh started; now where unset). A command still running at the
deadline is killed with its whole process group (the step: "timeout"); a step that would start with under
10 s left is recorded as "not run: deadline". A failing step is recorded and the next one runs.

Files in DIR, at most 8, none in sub-folders: gpu_check.json (every step's status, figures, time, and the
bench JSONs' and the training run's content), env.txt (the machine step), throughput.log, cuda_tests.log
(cuda_tests and more_tests), data.log, train.log, calibrate.log, each streamed line by line as its commands
run (a killed command leaves its partial log); gpu_check.log, this script's own output, is written by
gpu_check.sh. The JPEG tree, the bench JSONs and the training run go to --scratch (GPU_CHECK_SCRATCH,
default /tmp/largebatch-gpu-check).

--mode cpu runs the same sequence with tiny sizes (a width-8 ResNet-18 at 32 px), so the script keeps
working between GPU loans; the suite runs it (tests/integration/test_gpu_check.py).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
A100_IMAGES_PER_S = 2470.0        # NVIDIA DeepLearningExamples ResNet-50 v1.5, one A100, mixed precision
A100_BF16_PEAK_TFLOPS = 312.0     # A100 SXM dense bf16 tensor-core specification
MLPERF_H200 = "mlperf-v4.0-h200=7951"   # MLPerf Training v4.0, NVIDIA 8x H200: 63,608 img/s over 8 GPUs
MIN_START_S = 10.0    # a step that would start with less time left is not started
KILL_GRACE_S = 3.0    # SIGTERM, then SIGKILL to the process group after this
TESTS_K = "graph or prefetch or decode or gpu_cache or lars"

STEPS = ("machine", "throughput", "cuda_tests", "train", "data", "launch", "more_tests", "calibrate")
DEFAULT_STEPS = STEPS[:-1]   # calibrate only when asked
# each step's log in DIR (two steps share one): with gpu_check.json and gpu_check.log, at most 8 files
LOGS = {"machine": "env.txt", "throughput": "throughput.log", "cuda_tests": "cuda_tests.log",
        "more_tests": "cuda_tests.log", "data": "data.log", "train": "train.log", "launch": "train.log",
        "calibrate": "calibrate.log"}
OWN_FILES = ("gpu_check.json", "gpu_check.log")

SIZES = {
    "gpu": {"bench_train": ["--model", "resnet50", "--image-size", "224", "--batch", "256", "--steps", "10",
                            "--rounds", "3", "--peak-size", "8192", "--optimizer", "lars", "--label-smoothing", "0.1",
                            "--reference", MLPERF_H200,
                            "--configs", "bf16-cl,fp16-cl,bf16-cl-graph,fp16-cl-graph"],
            "batches": [256], "peers": "torchvision",
            # 4096 JPEGs: about 10 s to generate on 16 cores; 64 batches keep 6 workers busy
            "images": 4096, "batch": 64, "workers": [6], "size": 224, "passes": 2, "decode": ["cpu", "gpu"],
            # the full-width ResNet-50 (the default recipe's model.width is 12) for 60 steps (not its 4 epochs)
            "train": ["--set", "model.name=resnet50", "--set", "model.width=64", "--set", "model.stem=imagenet",
                      "--set", "schedule.epochs=100", "--set", "data.image_size=224", "--set", "batch.global_batch=256",
                      "--set", "optim.name=lars", "--set", "train.label_smoothing=0.1",
                      "--set", "train.precision=fp16", "--set", "train.max_steps=60", "--set", "train.log_every=10",
                      "--set", "data.loader_workers=6", "--set", "data.decode=gpu", "--set", "train.cuda_graph=on"],
            "launch": ["--set", "data.dataset=synthetic", "--set", "data.synthetic_size=2048", "--set",
                       "data.image_size=64", "--set", "model.name=resnet18", "--set", "model.width=16",
                       "--set", "batch.global_batch=64", "--set", "train.max_steps=5", "--set", "train.log_every=1"]},
    # cpu: one intra-op thread (the suite runs this beside other work, and ops this small gain nothing from a
    # second one on a busy 2-core machine)
    "cpu": {"bench_train": ["--model", "resnet18", "--width", "8", "--image-size", "32", "--batch", "8",
                            "--steps", "1", "--rounds", "1", "--peak-size", "256", "--configs", "fp32,bf16-cl",
                            "--threads", "1"],
            "batches": [8], "peers": "torchvision",
            "images": 24, "batch": 8, "workers": [0, 2], "decode": ["cpu"], "size": 64, "passes": 1,
            "train": ["--set", "model.name=resnet18", "--set", "model.width=4", "--set", "data.image_size=32",
                      "--set", "batch.global_batch=8", "--set", "train.max_steps=3", "--set", "train.log_every=1",
                      "--set", "data.loader_workers=0", "--set", "train.device=cpu", "--set", "train.threads=1"],
            "launch": ["--set", "data.dataset=synthetic", "--set", "data.synthetic_size=64", "--set",
                       "data.image_size=16", "--set", "model.name=resnet18", "--set", "model.width=4",
                       "--set", "batch.global_batch=8", "--set", "train.max_steps=3", "--set", "train.log_every=1",
                       "--set", "train.device=cpu", "--set", "train.threads=1"]},
}

# GPU_CHECK_STALL=STEP (for tests/integration/test_gpu_check.py): the step first runs this, which prints two lines, starts a
# child and waits for an hour, so the deadline must kill the process group and keep the partial log
STALL = ("import os, subprocess, sys, time\n"
         "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
         "print(f'stall: line 1 pid {os.getpid()} child {child.pid}', flush=True)\n"
         "print('stall: line 2', flush=True)\n"
         "time.sleep(3600)\n")


class StepTimeout(Exception):
    """A command of the step ran into the deadline and was killed."""


class Check:
    def __init__(self, out: Path, scratch: Path, mode: str, t0: float, deadline_s: float, steps: list[str]):
        self.out, self.scratch, self.mode = out, scratch, mode
        self.t0, self.deadline = t0, t0 + deadline_s
        self.result: dict = {"mode": mode, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                             "command": f"scripts/gpu_check.sh{' --cpu' if mode == 'cpu' else ''}",
                             "deadline_s": deadline_s, "order": steps, "steps": {}}
        self.current, self.begun = "", set()

    def left(self) -> float:
        return self.deadline - time.time()

    def say(self, text: str) -> None:
        print(text, flush=True)   # gpu_check.sh tees this into DIR/gpu_check.log

    def run(self, cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, list[str]]:
        """Run a command from the repository root in its own process group, its output streamed line by line
        into the current step's log; killed (the group) at the deadline. `env`: variables set for it (written
        into the log before the command). Returns (exit status, its lines)."""
        timeout = self.left() - 1.0
        if timeout < 1:
            raise StepTimeout("no time left before the deadline")
        lines: collections.deque[str] = collections.deque(maxlen=20000)
        with open(self.out / LOGS[self.current], "a", buffering=1) as log:
            log.write(f"$ {' '.join(f'{k}={shlex.quote(v)}' for k, v in (env or {}).items())}"
                      f"{' ' if env else ''}{shlex.join(cmd)}\n")
            log.flush()
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", bufsize=1, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

            def pump() -> None:
                for line in proc.stdout:
                    lines.append(line.rstrip("\n"))
                    try:
                        log.write(line)
                        log.flush()
                    except ValueError:   # closed: a process outside the group kept the pipe open
                        return
            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            killed = False
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                killed = True
                kill_group(proc.pid, signal.SIGTERM)
                try:
                    rc = proc.wait(timeout=KILL_GRACE_S)
                except subprocess.TimeoutExpired:
                    kill_group(proc.pid, signal.SIGKILL)
                    rc = proc.wait()
            except BaseException:   # Ctrl-C, or SIGTERM to this script: the command's group goes too
                kill_group(proc.pid, signal.SIGKILL)
                raise
            kill_group(proc.pid, signal.SIGKILL)   # stray children (loader workers) of a command that ended
            reader.join(timeout=5)
            seconds = time.monotonic() - t0
            if killed:
                log.write(f"--- killed at the deadline after {seconds:.1f} s (exit {rc})\n")
            else:
                log.write(f"--- exit {rc} after {seconds:.1f} s\n")
        if killed:
            what = " ".join(cmd[2:4] if cmd[1:2] == ["-m"] else ["python", *cmd[1:2]])[:60]
            raise StepTimeout(f"{what} killed at the deadline after {seconds:.0f} s", list(lines))
        return rc, list(lines)

    def step(self, name: str, fn) -> None:
        left = self.left()
        if left < MIN_START_S:
            self.result["steps"][name] = {"status": "not run: deadline", "left_s": round(left, 1)}
            self.say(f"--- {name}: not run: deadline ({left:.0f} s left)")
            self.save()
            return
        self.current = name
        if LOGS[name] not in self.begun:   # this run's logs start empty (a reused DIR keeps no old lines)
            (self.out / LOGS[name]).write_text("")
            self.begun.add(LOGS[name])
        self.say(f"\n=== {name} ({left:.0f} s left; log {LOGS[name]}) ===")
        t0 = time.monotonic()
        record: dict = {}
        try:
            if os.environ.get("GPU_CHECK_STALL") == name:
                self.run([sys.executable, "-c", STALL])
            fn(record)
            status = "ok"
        except StepTimeout as err:
            status, record["error"] = "timeout", str(err.args[0])
        except Exception as err:   # noqa: BLE001 - reported, and the next step runs
            status, record["error"] = "failed", f"{type(err).__name__}: {err}"
            with open(self.out / LOGS[name], "a") as log:
                log.write(traceback.format_exc())
        record = {"status": status, **record, "seconds": round(time.monotonic() - t0, 1)}
        self.result["steps"][name] = record
        if status != "ok":   # the log's last lines, so that the device tool's output shows why
            lines = (self.out / LOGS[name]).read_text(errors="replace").splitlines()
            self.say("\n".join("    " + line for line in lines[-15:]))
        self.say(f"--- {name}: {status} ({record['seconds']} s){': ' + record['error'] if 'error' in record else ''}")
        self.save()

    def save(self) -> None:
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.result, indent=2) + "\n")
        tmp.replace(self.out / "gpu_check.json")


def kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def probe(path: Path) -> int:
    """The machine step, in its own process (the check's own process holds no CUDA context): each finding
    printed as it comes (a crash leaves the ones before it) and all of them written to PATH as JSON."""
    info: dict = {}

    def show(key: str, value) -> None:
        info[key] = value
        print(f"{key}: {value}", flush=True)

    def error(err: BaseException) -> str:
        return f"{type(err).__name__}: {err}"

    def loaded(fragment: str) -> list[str]:
        try:
            maps = Path("/proc/self/maps").read_text().splitlines()
        except OSError:
            return []
        return sorted({line.split()[-1] for line in maps if fragment in line and "/" in line})

    show("python", sys.version.split()[0])
    show("cpu_count", os.cpu_count())
    show("LD_LIBRARY_PATH", os.environ.get("LD_LIBRARY_PATH", ""))
    import torch

    show("torch", torch.__version__)
    show("cuda", torch.version.cuda)
    show("cudnn", torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    cuda = torch.cuda.is_available()
    show("cuda_available", cuda)
    if cuda:
        show("gpu", torch.cuda.get_device_name(0))
        show("capability", ".".join(map(str, torch.cuda.get_device_capability(0))))
        show("memory_gib", round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            show("driver", smi.stdout.strip() or smi.stderr.strip())
        except (OSError, subprocess.TimeoutExpired) as err:
            show("driver", error(err))
    try:
        from largebatch.metrics import machine

        show("machine", machine(torch.device("cuda" if cuda else "cpu")))
    except Exception as err:   # noqa: BLE001
        show("machine", error(err))
    for module in ("torchvision", "timm", "simplejpeg"):
        try:
            show(module, __import__(module).__version__)
        except Exception as err:   # noqa: BLE001
            show(module, error(err))
    import ctypes

    try:
        nvjpeg = ctypes.CDLL("libnvjpeg.so.13")
        version = []
        for prop in range(3):   # nvjpegGetProperty: MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            value = ctypes.c_int(-1)
            nvjpeg.nvjpegGetProperty(prop, ctypes.byref(value))
            version.append(str(value.value))
        show("libnvjpeg.so.13", f"loads: {'.'.join(version)} from {', '.join(loaded('libnvjpeg')) or '?'}")
    except OSError as err:
        show("libnvjpeg.so.13", f"does not load: {err}")
    import io

    from PIL import Image

    blob = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 120, 40)).save(blob, format="JPEG")
    data = blob.getvalue()
    if cuda:
        try:
            from torchvision.io import decode_jpeg

            image = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), device="cuda")
            show("torchvision_decode_jpeg_cuda", f"ok {tuple(image.shape)}")
        except Exception as err:   # noqa: BLE001
            show("torchvision_decode_jpeg_cuda", error(err))
    try:
        from nvidia import nvimgcodec
    except Exception as err:   # noqa: BLE001
        show("nvimgcodec", f"does not import: {error(err)}")
    else:
        show("nvimgcodec", f"{nvimgcodec.__version__} (CUDA {getattr(nvimgcodec, '__cuda_version__', '?')}) "
                           f"from {Path(nvimgcodec.__file__).parent}")
        import numpy as np

        backends = {}
        for kind in ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU", "CPU_ONLY"):
            try:
                decoder = nvimgcodec.Decoder(backends=[nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, kind))])
                image = decoder.decode(nvimgcodec.CodeStream(np.frombuffer(data, np.uint8)))
                backends[kind] = ("no image (this back-end did not decode)" if image is None else
                                  f"ok {tuple(image.shape)} {image.buffer_kind}")
            except Exception as err:   # noqa: BLE001
                backends[kind] = error(err)
            print(f"nvimgcodec back-end {kind}: {backends[kind]}", flush=True)
        info["nvimgcodec_backends"] = backends
        show("libnvjpeg_after_nvimgcodec", loaded("libnvjpeg.so"))
    path.write_text(json.dumps(info, indent=2) + "\n")
    return 0


def pytest_counts(lines: list[str]) -> dict:
    """pytest's summary line (the last one), or, for a killed run, the -v lines it had printed."""
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", line)
                    and line.startswith("=")), "")
    if summary:
        return {"summary": summary.strip("= "),
                **{k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}}
    counts = collections.Counter(m.group(1).lower() for line in lines
                                 if (m := re.search(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR)", line)))
    return {"summary": "killed before pytest's summary", **counts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--out", type=Path, help="results: gpu_check.json and the steps' logs (at most 8 files)")
    p.add_argument("--scratch", type=Path, default=Path(os.environ.get("GPU_CHECK_SCRATCH", "/tmp/largebatch-gpu-check")),
                   help="the generated JPEG tree, the bench JSONs and the training run (not results)")
    p.add_argument("--probe", type=Path, help=argparse.SUPPRESS)   # the machine step's own process
    args = p.parse_args()
    if args.probe:
        return probe(args.probe)
    if args.out is None:
        p.error("--out is required")
    t0 = float(os.environ.get("GPU_CHECK_T0") or time.time())
    deadline_s = float(os.environ.get("GPU_CHECK_DEADLINE_S") or 450)
    only = [x.strip() for x in os.environ.get("GPU_CHECK_ONLY", "").split(",") if x.strip()]
    unknown = [x for x in only if x not in STEPS]
    if unknown:
        print(f"gpu_check: GPU_CHECK_ONLY names {', '.join(unknown)}; the steps are {', '.join(STEPS)}.",
              file=sys.stderr)
        return 2
    if only:   # in the order given; the machine step first unless placed
        order = list(dict.fromkeys(only if "machine" in only else ["machine", *only]))
    else:
        order = list(DEFAULT_STEPS) + (["calibrate"] if os.environ.get("GPU_CHECK_CALIBRATE") == "1" else [])
    # SIGTERM (an outer timeout) unwinds, so that the running command's process group is killed as well
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    args.scratch.mkdir(parents=True, exist_ok=True)
    sizes = dict(SIZES[args.mode])
    if os.environ.get("GPU_CHECK_CONFIGS"):   # e.g. torch.compile's modes in a call of their own
        bench = list(sizes["bench_train"])
        bench[bench.index("--configs") + 1] = os.environ["GPU_CHECK_CONFIGS"]
        sizes["bench_train"] = bench
    if os.environ.get("GPU_CHECK_BATCHES"):   # e.g. 256,400 (MLPerf's 400 per GPU)
        sizes["batches"] = [int(b) for b in os.environ["GPU_CHECK_BATCHES"].split(",")]
    if os.environ.get("GPU_CHECK_PEERS"):     # e.g. timm,torchvision
        sizes["peers"] = os.environ["GPU_CHECK_PEERS"]
    if os.environ.get("GPU_CHECK_DECODE"):    # e.g. cpu,gpu:nvimgcodec,gpu:torchvision
        sizes["decode"] = os.environ["GPU_CHECK_DECODE"].split(",")
    check = Check(args.out, args.scratch, args.mode, t0, deadline_s, order)
    check.say(f"gpu_check ({args.mode}): steps {', '.join(order)}; deadline {deadline_s:.0f} s, "
              f"{check.left():.0f} s left")
    py = sys.executable
    scratch = args.scratch
    jpegs = scratch / "jpegs"
    device = "cuda" if args.mode == "gpu" else "cpu"

    def machine(rec: dict) -> None:
        path = scratch / "env.json"
        path.unlink(missing_ok=True)
        rc, _ = check.run([py, str(Path(__file__).resolve()), "--probe", str(path)])
        if path.exists():
            rec.update(json.loads(path.read_text()))
        if rc != 0:
            raise RuntimeError(f"the environment probe exited {rc}")

    def throughput(rec: dict) -> None:
        rec["by_batch"], rec["bench_json"] = {}, {}
        for batch in sizes["batches"]:
            out = scratch / f"bench_train_{batch}.json"
            out.unlink(missing_ok=True)
            bench = list(sizes["bench_train"])
            bench[bench.index("--batch") + 1] = str(batch)
            rc, _ = check.run([py, "-m", "largebatch", "bench", "train", *bench, "--peers", sizes["peers"],
                               "--device", device, "--json", str(out)])
            if not out.exists():   # an entry that failed leaves the others' figures in the JSON (exit 1)
                raise RuntimeError(f"bench train --batch {batch} exited {rc}")
            r = json.loads(out.read_text())
            rec["bench_json"][str(batch)] = r
            b = {k: r.get(k) for k in ("machine", "optimizer", "best_config", "images_per_s", "plain_images_per_s",
                                       "mfu_bf16_peak", "peak_matmul_gflops_bf16", "peak_matmul_gflops_fp32",
                                       "vs_best_peer", "peers_skipped", "reference", "vs_reference")}
            b["configs"] = {n: c.get("images_per_s") for n, c in r["configs"].items()}
            b["peers"] = {n: c.get("images_per_s") for n, c in r.get("peers", {}).items()}
            b["errors"] = r.get("errors", {})   # one line per entry that failed
            if args.mode == "gpu" and r.get("peak_matmul_gflops_bf16") and r.get("images_per_s"):   # NVIDIA's A100 figure, scaled
                scale = r["peak_matmul_gflops_bf16"] / 1e3 / A100_BF16_PEAK_TFLOPS
                b["nvidia_a100_scaled_images_per_s"] = round(A100_IMAGES_PER_S * scale, 1)
                b["vs_nvidia_scaled"] = round(r["images_per_s"] / (A100_IMAGES_PER_S * scale), 3)
            rec["by_batch"][str(batch)] = b
            rec["images_per_s"] = max((x["images_per_s"] for x in rec["by_batch"].values() if x["images_per_s"]),
                                      default=None)
            if rc != 0:
                raise RuntimeError(f"bench train --batch {batch} exited {rc}: "
                                   + ("; ".join(f"{n}: {e}" for n, e in b["errors"].items()) or "see throughput.log"))

    def pytest_step(rec: dict, files: list[str], marker: str, keyword: str) -> None:
        try:
            rc, lines = check.run([py, "-m", "pytest", "-m", marker, "-k", keyword, "-v", "-rs",
                                   "-p", "no:cacheprovider", *files])
        except StepTimeout as err:
            rec.update(pytest_counts(err.args[1] if len(err.args) > 1 else []))
            raise
        rec.update(pytest_counts(lines))
        if rc not in (0, 5) or rec.get("failed") or rec.get("error"):
            raise RuntimeError(f"pytest: {rec['summary']}")

    def cuda_tests(rec: dict) -> None:
        pytest_step(rec, ["tests/integration/test_cuda.py"], "cuda", TESTS_K)

    def more_tests(rec: dict) -> None:
        # not the `library` model tests (tests/integration/test_any_model.py): CPU tests, run by `make test-eco`
        pytest_step(rec, ["tests/integration/test_cuda.py"], "cuda", f"not ({TESTS_K})")

    def data(rec: dict) -> None:
        rec["loader"], rec["bench_json"] = {}, {}
        for decode in sizes["decode"]:
            where, _, decoder = decode.partition(":")
            for workers in sizes["workers"]:
                key = f"{decode.replace(':', '_')}_{workers}"
                out = scratch / f"bench_data_{key}.json"
                out.unlink(missing_ok=True)
                rc, _ = check.run([py, "-m", "largebatch", "bench", "data", "--images", str(sizes["images"]),
                                   "--workers", str(workers), "--size", str(sizes["size"]), "--passes",
                                   str(sizes["passes"]), "--batch", str(sizes["batch"]), "--decode", where,
                                   "--gpu-decoder", decoder or "auto", "--stage-images", "0", "--no-memory",
                                   "--dir", str(jpegs), "--json", str(out)])
                if rc != 0:
                    raise RuntimeError(f"bench data --decode {decode} --workers {workers} exited {rc}")
                r = json.loads(out.read_text())
                rec["bench_json"][key] = r
                rec["loader"][key] = {"images_per_s": r["images_per_s"], "cpu_images_per_s": r["cpu_images_per_s"],
                                      "gpu_decoder": r.get("gpu_decoder")}
        model = check.result["steps"].get("throughput", {}).get("images_per_s")
        if model:
            rec["model_images_per_s"] = model
            rec["loader_keeps_up"] = max(r["images_per_s"] for r in rec["loader"].values()) >= model

    def train(rec: dict) -> None:
        if not (jpegs / "train").is_dir():   # the data step did not run: the JPEG tree first
            rc, _ = check.run([py, "-c", "import sys; from pathlib import Path; from largebatch.commands.bench.data "
                               "import write_imagefolder; write_imagefolder(Path(sys.argv[1]), int(sys.argv[2]))",
                               str(jpegs), str(sizes["images"])])
            if rc != 0:
                raise RuntimeError(f"generating the JPEG tree exited {rc}")
        run = scratch / "train"
        if run.exists():
            import shutil

            shutil.rmtree(run)   # this script's own scratch run from an earlier check
        rc, _ = check.run([py, "-m", "largebatch", "train", "--set", "data.dataset=imagefolder", "--set",
                           f"data.root={jpegs}", *sizes["train"], "--set", "train.eval_every=0", "--set",
                           "train.plots=false", "--quiet", "--run-dir", str(run)])
        metrics = run / "metrics.jsonl"
        recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
            if metrics.exists() else []
        rec["metrics"] = recs
        if rc != 0:
            raise RuntimeError(f"largebatch train exited {rc}")
        steps = [r for r in recs if r.get("kind") == "train"]
        later = steps[1:] or steps   # the first logged stretch holds start-up
        summary = json.loads((run / "summary.json").read_text())
        rec["summary"] = summary
        rec.update(steps=summary["steps"], precision=summary.get("precision"),
                   images_per_s=round(sum(r["images_per_s"] for r in later) / len(later), 1),
                   data_wait_s_per_step=round(sum(r["data_wait_s"] for r in later) / len(later), 4))
        alone = check.result["steps"].get("throughput", {}).get("by_batch", {}).get("256", {})
        if alone.get("configs", {}).get("fp16-cl-graph"):
            rec["vs_step_alone"] = round(rec["images_per_s"] / alone["configs"]["fp16-cl-graph"], 3)

    def launch(rec: dict) -> None:
        run = scratch / "launch"
        if run.exists():
            import shutil

            shutil.rmtree(run)
        # As users start workers on a node (docs/multinode.md): torchrun's arguments through largebatch.launch
        # (torchrun's agent in process, with largebatch's exit codes), one worker with a restart allowed, forked
        # from the launch's forkserver (itself a fork of the launcher where that holds one thread and no CUDA
        # driver), not run in the launching process. OMP_NUM_THREADS=1 is what torchrun gives each worker of a
        # node of several GPUs (it sets it where unset and nproc > 1); with one GPU here it would set nothing, and
        # the worker would take every core of the machine, as no user's node runs it.
        env = {"OMP_NUM_THREADS": "1"}
        cmd = [py, "-m", "largebatch.launch", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", f"gpu-check-{os.getpid()}", "--local-addr",
               "127.0.0.1", "--max-restarts", "1", "-m", "largebatch", "train", *sizes["launch"], "--set",
               "train.eval_every=0", "--set", "train.plots=false", "--quiet", "--run-dir", str(run)]
        rec.update(command=shlex.join(["python", *cmd[1:]]), env=env, cpu_count=os.cpu_count())
        rc, _ = check.run(cmd, env=env)
        if rc != 0:
            raise RuntimeError(f"python -m largebatch.launch --nproc-per-node 1 --max-restarts 1 exited {rc}")
        summary = json.loads((run / "summary.json").read_text())
        rec.update(steps=summary["steps"], world_size=summary.get("world_size"), machine=summary.get("machine"),
                   threads_per_worker=summary.get("threads_per_worker"))

    def calibrate(rec: dict) -> None:
        out = scratch / "this_machine.yaml"
        out.unlink(missing_ok=True)
        rc, _ = check.run([py, "-m", "largebatch", "plan", "--calibrate", "--catalog-out", str(out)])
        if rc != 0:
            raise RuntimeError(f"plan --calibrate exited {rc}")
        import yaml

        text = out.read_text()
        with open(args.out / LOGS["calibrate"], "a") as log:
            log.write(f"--- {out}\n{text}")
        parsed = yaml.safe_load(text) or {}
        rec.update(catalog_yaml=text, sections={k: sorted(v) for k, v in parsed.items() if isinstance(v, dict)})

    fns = {"machine": machine, "throughput": throughput, "cuda_tests": cuda_tests, "more_tests": more_tests,
           "data": data, "train": train, "launch": launch, "calibrate": calibrate}
    for name in order:
        check.step(name, fns[name])

    steps = check.result["steps"]
    failed = [n for n, r in steps.items() if r["status"] in ("failed", "timeout")]
    not_run = [n for n, r in steps.items() if r["status"].startswith("not run")]
    check.result.update(failed_steps=failed, not_run_steps=not_run, seconds=round(time.time() - t0, 1))
    check.save()
    parts = ", ".join(f"{n} {r['status']}" + (f" {r['seconds']:.0f} s" if "seconds" in r else "")
                      for n, r in steps.items())
    check.say(f"\ngpu_check ({args.mode}): {len(steps) - len(failed) - len(not_run)} ok, {len(failed)} failed, "
              f"{len(not_run)} not run in {time.time() - t0:.0f} s of {deadline_s:.0f} [{parts}]; "
              f"{args.out / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
