"""The CUDA check's steps (run by scripts/gpu_check.sh, which installs the package first).

    python scripts/gpu_check.py --mode gpu|cpu --out DIR

0. The machine: GPU, driver, CUDA and torch versions (or the CPU model and flags).
1. `pytest -m 'cuda or library'`: the CUDA tests (tests/test_cuda.py) and timm:/torchvision: models through
   largebatch (tests/test_any_model.py); on CPU, or without those libraries, they skip, saying why.
2. Throughput: `largebatch bench train` of ResNet-50 at 224 px with LARS and label smoothing 0.1, at batch
   256 and at MLPerf's 400 per GPU (GPU_CHECK_BATCHES), one GPU, in bf16 and fp16 channels_last, eager and as
   one CUDA graph (GPU_CHECK_CONFIGS adds torch.compile), beside timm's and torchvision's resnet50 through
   the same plain loop with the same settings, in the same run; MFU against the bf16 matmul peak measured in
   that run; MLPerf Training v4.0's 7,951 img/s per H200 (NVIDIA, 8x H200) as the reference line, and
   NVIDIA's published 2,470 img/s on an A100 scaled by the ratio of the measured bf16 peak to the A100's
   312 TFLOP/s dense bf16 specification.
3. Data: `largebatch bench data` at 224 px with 6 and 16 loader workers, decoding on the CPU and on the
   GPU (torchvision's nvJPEG, whole images; nvImageCodec, crop windows), on a generated ImageFolder of
   500x375 JPEGs, batches counted on the GPU; does the loader keep up
   with the model's images/s from step 2?
4. End to end: `largebatch train` of ResNet-50 for 200 steps on that JPEG tree (LARS, fp16, the CUDA
   graph, GPU decoding), images/s and data wait per step from its metrics, against the step alone.
5. Calibrate (GPU mode only: on a CPU it takes minutes and tests/test_perf_calibrate.py covers it):
   `largebatch plan --calibrate` on the GPU writes the machine's catalog entry into DIR.

--mode cpu runs the same sequence with tiny sizes (a width-8 ResNet-18 at 32 px), so the script keeps
working between GPU loans; the suite runs it. Every step's status, figures and time go to
DIR/gpu_check.json, its output to DIR/gpu_check.log; a failing step is recorded and the next one runs.
The JPEG tree and the training run go to --scratch (GPU_CHECK_SCRATCH, default /tmp/largebatch-gpu-check).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
A100_IMAGES_PER_S = 2470.0        # NVIDIA DeepLearningExamples ResNet-50 v1.5, one A100, mixed precision
A100_BF16_PEAK_TFLOPS = 312.0     # A100 SXM dense bf16 tensor-core specification
MLPERF_H200 = "mlperf-v4.0-h200=7951"   # MLPerf Training v4.0, NVIDIA 8x H200: 63,608 img/s over 8 GPUs

SIZES = {
    "gpu": {"bench_train": ["--model", "resnet50", "--image-size", "224", "--batch", "256", "--steps", "10",
                            "--rounds", "3", "--peak-size", "8192", "--optimizer", "lars", "--label-smoothing", "0.1",
                            "--reference", MLPERF_H200,
                            "--configs", "bf16-cl,fp16-cl,bf16-cl-graph,fp16-cl-graph"],
            "batches": [256, 400],
            # a loader worker decodes a whole batch: 128 batches of 64 keep 16 workers busy for 8 each a pass
            "images": 8192, "batch": 64, "workers": [6, 16], "size": 224, "passes": 2,
            "decode": ["cpu", "gpu:torchvision", "gpu:nvimgcodec"],
            # the full-width ResNet-50 (the default recipe's model.width is 12) for 200 steps (not its 4 epochs)
            "train": ["--set", "model.name=resnet50", "--set", "model.width=64", "--set", "model.stem=imagenet",
                      "--set", "schedule.epochs=100", "--set", "data.image_size=224", "--set", "batch.global_batch=256",
                      "--set", "optim.name=lars", "--set", "train.label_smoothing=0.1",
                      "--set", "train.precision=fp16", "--set", "train.max_steps=200", "--set", "train.log_every=20",
                      "--set", "data.loader_workers=6", "--set", "data.decode=gpu", "--set", "train.cuda_graph=on"]},
    # cpu: one intra-op thread (the suite runs this beside other work, and ops this small gain nothing from a
    # second one on a busy 2-core machine)
    "cpu": {"bench_train": ["--model", "resnet18", "--width", "8", "--image-size", "32", "--batch", "8",
                            "--steps", "1", "--rounds", "1", "--peak-size", "256", "--configs", "fp32,bf16-cl",
                            "--threads", "1"],
            "batches": [8],
            "images": 24, "batch": 8, "workers": [0, 2], "decode": ["cpu"], "size": 64, "passes": 1,
            "train": ["--set", "model.name=resnet18", "--set", "model.width=4", "--set", "data.image_size=32",
                      "--set", "batch.global_batch=8", "--set", "train.max_steps=3", "--set", "train.log_every=1",
                      "--set", "data.loader_workers=0", "--set", "train.device=cpu", "--set", "train.threads=1"]},
}


class Check:
    def __init__(self, out: Path, mode: str):
        self.out, self.mode = out, mode
        # GPU_CHECK_ONLY=throughput,data runs those steps alone (a device command is limited in time: the
        # check can be split over two calls; the machine step always runs)
        self.only = {x for x in os.environ.get("GPU_CHECK_ONLY", "").split(",") if x} | {"machine"} \
            if os.environ.get("GPU_CHECK_ONLY") else set()
        self.log = open(out / "gpu_check.log", "a")
        self.result: dict = {"mode": mode, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                             "command": f"scripts/gpu_check.sh{' --cpu' if mode == 'cpu' else ''}", "steps": {}}

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def sh(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run a command from the repository root; its output goes to the log and the screen."""
        self.say("$ " + " ".join(cmd))
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.say(proc.stdout[-20000:] + proc.stderr[-20000:])
        return proc

    def step(self, name: str, fn) -> None:
        if self.only and name not in self.only:
            return
        self.say(f"\n=== {name} ===")
        t0 = time.monotonic()
        try:
            record = {"status": "ok", **(fn() or {})}
        except Exception as err:   # noqa: BLE001 - reported, and the next step runs
            record = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
            self.say(traceback.format_exc())
        record["seconds"] = round(time.monotonic() - t0, 1)
        self.result["steps"][name] = record
        self.say(f"--- {name}: {record['status']} ({record['seconds']} s)")
        self.save()

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.result, indent=2) + "\n")


def machine_step() -> dict:
    import torch

    from largebatch.commands.bench import machine

    info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
            "machine": machine(torch.device("cuda" if torch.cuda.is_available() else "cpu"))}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        info["driver"] = smi.stdout.strip() or smi.stderr.strip()
    info["cpu_count"] = os.cpu_count()
    return info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--out", type=Path, required=True, help="results: gpu_check.json, gpu_check.log, bench JSONs")
    p.add_argument("--scratch", type=Path, default=Path(os.environ.get("GPU_CHECK_SCRATCH", "/tmp/largebatch-gpu-check")),
                   help="the generated JPEG tree and the training run (not results)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = SIZES[args.mode]
    if os.environ.get("GPU_CHECK_CONFIGS"):   # e.g. leave torch.compile's warm-ups out of a short device call
        bench = list(sizes["bench_train"])
        bench[bench.index("--configs") + 1] = os.environ["GPU_CHECK_CONFIGS"]
        sizes = {**sizes, "bench_train": bench}
    if os.environ.get("GPU_CHECK_BATCHES"):   # e.g. 256 alone in a short device call
        sizes = {**sizes, "batches": [int(b) for b in os.environ["GPU_CHECK_BATCHES"].split(",")]}
    check = Check(args.out, args.mode)
    py = sys.executable
    check.step("machine", machine_step)

    def tests() -> dict:
        proc = check.sh([py, "-m", "pytest", "-m", "cuda or library", "-q", "-rs", "-p", "no:cacheprovider",
                         "tests/test_cuda.py", "tests/test_any_model.py"], timeout=1800)
        summary = (proc.stdout.strip().splitlines() or [""])[-1]
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
        if proc.returncode not in (0, 5) or counts.get("failed") or counts.get("error"):
            raise RuntimeError(f"pytest -m cuda: {summary}")
        return {"summary": summary, **counts}
    check.step("cuda_tests", tests)

    def throughput() -> dict:
        recs = {}
        for batch in sizes["batches"]:
            out = args.out / f"bench_train_{batch}.json"
            bench = list(sizes["bench_train"])
            bench[bench.index("--batch") + 1] = str(batch)
            proc = check.sh([py, "-m", "largebatch", "bench", "train", *bench, "--peers", "timm,torchvision",
                             "--device", "cuda" if args.mode == "gpu" else "cpu", "--json", str(out)], timeout=2400)
            if proc.returncode != 0:
                raise RuntimeError(f"bench train --batch {batch} exited {proc.returncode}")
            r = json.loads(out.read_text())
            rec = {k: r.get(k) for k in ("machine", "optimizer", "best_config", "images_per_s", "plain_images_per_s",
                                         "mfu_bf16_peak", "peak_matmul_gflops_bf16", "peak_matmul_gflops_fp32",
                                         "vs_best_peer", "peers_skipped", "reference", "vs_reference")}
            rec["configs"] = {n: c["images_per_s"] for n, c in r["configs"].items()}
            rec["peers"] = {n: c["images_per_s"] for n, c in r["peers"].items()}
            if args.mode == "gpu":   # NVIDIA's A100 figure scaled by the measured bf16 peak
                scale = r["peak_matmul_gflops_bf16"] / 1e3 / A100_BF16_PEAK_TFLOPS
                rec["nvidia_a100_scaled_images_per_s"] = round(A100_IMAGES_PER_S * scale, 1)
                rec["vs_nvidia_scaled"] = round(r["images_per_s"] / (A100_IMAGES_PER_S * scale), 3)
            recs[str(batch)] = rec
        best = max(recs.values(), key=lambda r: r["images_per_s"])
        return {"images_per_s": best["images_per_s"], "by_batch": recs}
    check.step("throughput", throughput)

    jpegs = args.scratch / "jpegs"

    def data() -> dict:
        rates = {}
        for decode in sizes["decode"]:
            where, _, decoder = decode.partition(":")
            for workers in sizes["workers"]:
                out = args.out / f"bench_data_{decode.replace(':', '_')}_{workers}.json"
                proc = check.sh([py, "-m", "largebatch", "bench", "data", "--images", str(sizes["images"]),
                                 "--workers", str(workers), "--size", str(sizes["size"]), "--passes",
                                 str(sizes["passes"]), "--batch", str(sizes["batch"]), "--decode", where,
                                 "--gpu-decoder", decoder or "auto",
                                 "--stage-images", "0", "--no-memory", "--dir", str(jpegs), "--json", str(out)],
                                timeout=1800)
                if proc.returncode != 0:
                    raise RuntimeError(f"bench data --decode {decode} --workers {workers} exited {proc.returncode}")
                r = json.loads(out.read_text())
                rates[f"{decode.replace(':', '_')}_{workers}"] = {
                    "images_per_s": r["images_per_s"], "cpu_images_per_s": r["cpu_images_per_s"],
                    "gpu_decoder": r.get("gpu_decoder")}
        rec: dict = {"loader": rates}
        model = check.result["steps"].get("throughput", {}).get("images_per_s")
        if model:
            rec["model_images_per_s"] = model
            rec["loader_keeps_up"] = max(r["images_per_s"] for r in rates.values()) >= model
        return rec
    check.step("data", data)

    def train() -> dict:
        run = args.scratch / "train"
        if run.exists():
            import shutil

            shutil.rmtree(run)   # this script's own scratch run from an earlier check
        proc = check.sh([py, "-m", "largebatch", "train", "--set", "data.dataset=imagefolder", "--set",
                         f"data.root={jpegs}", *sizes["train"], "--set", "train.eval_every=0", "--set",
                         "train.plots=false", "--quiet", "--run-dir", str(run)], timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"largebatch train exited {proc.returncode}")
        recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        steps = [r for r in recs if r.get("kind") == "train"]
        later = steps[1:] or steps   # the first logged stretch holds start-up
        summary = json.loads((run / "summary.json").read_text())
        rec = {"steps": summary["steps"], "images_per_s": round(sum(r["images_per_s"] for r in later) / len(later), 1),
               "data_wait_s_per_step": round(sum(r["data_wait_s"] for r in later) / len(later), 4),
               "precision": summary.get("precision")}
        step_alone = check.result["steps"].get("throughput", {}).get("by_batch", {}).get("256", {})
        if step_alone.get("configs", {}).get("fp16-cl-graph"):
            rec["vs_step_alone"] = round(rec["images_per_s"] / step_alone["configs"]["fp16-cl-graph"], 3)
        return rec
    check.step("train", train)

    def calibrate() -> dict:
        out = args.out / "this_machine.yaml"
        proc = check.sh([py, "-m", "largebatch", "plan", "--calibrate", "--catalog-out", str(out)], timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"plan --calibrate exited {proc.returncode}")
        import yaml

        data = yaml.safe_load(out.read_text()) or {}
        return {"catalog": str(out), "sections": {k: sorted(v) for k, v in data.items() if isinstance(v, dict)}}
    if args.mode == "gpu":
        check.step("calibrate", calibrate)

    failed = [n for n, r in check.result["steps"].items() if r["status"] != "ok"]
    check.result["failed_steps"] = failed
    check.save()
    check.say(f"\ngpu_check ({args.mode}): {len(check.result['steps']) - len(failed)} steps ok, "
              f"{len(failed)} failed{': ' + ', '.join(failed) if failed else ''}; {args.out / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
