"""`largebatch plan --validate`: the model against published runs (shared/FACTS.md).

1. Each row is a published run: its plan (device, topology, algorithm, batch, precision) and one
   published quantity (time-to-train, images/s or scaling efficiency).
2. The model predicts the same quantity; error = predicted / published - 1.
   Papers' times are training times (evaluation left out: eval_every=0); MLPerf's time-to-accuracy
   includes its evaluation passes (every 4 epochs over the 50,000 validation images).
3. A row whose figure was used to set a catalog input is marked FIT: it shows the fit, it does
   not validate the model. Compute is fitted to single-node figures only; no multi-node run is a FIT.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from largebatch.perf.model import predict

IMAGENET = 1281167


@dataclass(frozen=True)
class Row:
    source: str
    setup: str
    quantity: str
    published: float
    predicted: float
    role: str          # "FIT (input)" or "validation"
    note: str = ""

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1.0


RN50: dict[str, Any] = dict(model="resnet50", dataset_size=IMAGENET)


def _ips(device: str, n: int, per_gpu: int, stack: str, precision: str = "fp16", per_node: int = 8,
         intra: str | None = None) -> float:
    """images/s of a single-node (or single-GPU) throughput table row."""
    return predict(device=device, devices=n, devices_per_node=per_node, intra_node=intra, global_batch=n * per_gpu,
                   precision=precision, stack=stack, **RN50).images_per_s


def _sony_2176_time() -> float:
    """Sony: 5 warm-up epochs at 16 per GPU (34,816), then 85 epochs at 32 per GPU (69,632)."""
    common = dict(device="v100", devices=2176, devices_per_node=4, intra_node="nvlink2", inter_node="ib-edr:2",
                  algorithm="torus2d", precision="fp16", eval_every=0, stack="stack-2018", **RN50)
    return (predict(global_batch=34816, epochs=5, **common).time_to_train_s
            + predict(global_batch=69632, epochs=85, **common).time_to_train_s)


def rows() -> list[Row]:
    """Steps 1-3 for every published row (sources: docs/performance_sources.md, shared/FACTS.md).

    Stack per row, chosen by date and framework before looking at the errors: runs before mid-2019 use
    `stack-2018`; NVIDIA DeepLearningExamples tables their own README's stack; MLPerf v0.7 and later
    `mlperf-2020`. The P100 curve is Goyal et al.'s own 2017 stack (its FIT), used as is."""
    out: list[Row] = []
    V = "validation"
    goyal = dict(device="p100", devices_per_node=8, intra_node="nvlink1", inter_node="eth50",
                 algorithm="hierarchical", precision="fp32", epochs=90, eval_every=0, **RN50)
    g8 = predict(devices=8, global_batch=256, **goyal)
    g256 = predict(devices=256, global_batch=8192, **goyal)
    out.append(Row("Goyal et al. 1706.02677", "8 P100, batch 256, 90 epochs", "time-to-train (h)",
                   29.0, g8.time_to_train_s / 3600, "FIT (input)", "P100 fp32 eff_max (one node)"))
    out.append(Row("Goyal et al. 1706.02677", "256 P100, 50 GbE, batch 8k, 90 epochs", "time-to-train (h)",
                   1.0, g256.time_to_train_s / 3600, V))
    out.append(Row("Goyal et al. 1706.02677", "8 -> 256 P100, 32 per GPU", "scaling efficiency",
                   0.90, g256.images_per_s / (32 * g8.images_per_s), V))
    akiba = predict(device="p100", devices=1024, devices_per_node=8, intra_node="nvlink1", inter_node="ib-fdr:2",
                    global_batch=32768, precision="fp32", epochs=90, eval_every=0, **RN50)
    out.append(Row("Akiba et al. 1711.04325", "1,024 P100 (128 x 8), 2x IB FDR, batch 32k, 90 epochs",
                   "time-to-train (min)", 15.0, akiba.time_to_train_s / 60, V,
                   "fp32 compute assumed (precision not in the text at hand)"))
    out.append(Row("Mikami et al. 1811.05233", "2,176 V100, 2x IB EDR, 2D-torus, 34K->68K", "time-to-train (s)",
                   224.0, _sony_2176_time(), V, "stack-2018"))
    sony = dict(device="v100", devices_per_node=4, intra_node="nvlink2", inter_node="ib-edr:2", algorithm="torus2d",
                precision="fp16", epochs=90, eval_every=0, stack="stack-2018", **RN50)
    s1088 = predict(devices=1088, global_batch=34816, **sony)
    out.append(Row("Mikami et al. 1811.05233", "1,088 V100, 32 per GPU, against one node", "scaling efficiency",
                   0.9162, s1088.scaling_efficiency_node, V, "baseline of the 91.62% not stated: one node (4 GPUs) assumed"))
    v05 = predict(device="v100", devices=640, devices_per_node=8, intra_node="nvlink2", inter_node="ib-edr:4",
                  global_batch=640 * 26, precision="fp16", epochs=81, stack="stack-2018", **RN50)
    out.append(Row("MLPerf v0.5 NVIDIA (result_1.txt)", "640 V100 (80 DGX-1), 26 per GPU, 81 epochs",
                   "time-to-train (s)", 374.5, v05.time_to_train_s, V,
                   "run_start to run_stop (evaluation every 4 epochs modelled); 4 IB EDR per DGX-1 assumed"))
    yama = predict(device="v100", devices=2048, devices_per_node=4, intra_node="nvlink2", inter_node="ib-edr:2",
                   global_batch=81920, precision="fp16", stack="stack-2018", **RN50)
    out.append(Row("Yamazaki et al. 1903.12650", "2,048 V100 (ABCI), batch 81,920", "images/s",
                   1.73e6, yama.images_per_s, V, "stack-2018; published 'over 1.73 million'"))
    out.append(Row("MLPerf v0.7 NVIDIA 1x DGX-1", "8 V100, 208 per GPU", "images/s",
                   11271.0, _ips("v100", 8, 208, "mlperf-2020"), "FIT (input)", "V100 fp16 eff_max"))
    out.append(Row("MLPerf v0.7 NVIDIA 1x DGX A100", "8 A100, 408 per GPU", "images/s",
                   22428.0, _ips("a100", 8, 408, "mlperf-2020"), "FIT (input)", "A100 fp16 eff_max"))
    tables = [  # (source, stack, device, GPUs, per-GPU batch, GPUs per node, published images/s)
        ("DLE MXNet RN50 (20.12)", "dle-mxnet-2020", "v100", 1, 192, 8, 1376.0),
        ("DLE MXNet RN50 (20.12)", "dle-mxnet-2020", "v100", 8, 192, 8, 10723.0),
        ("DLE MXNet RN50 (20.12)", "dle-mxnet-2020", "v100", 16, 256, 16, 21484.0),
        ("DLE MXNet RN50 (20.12)", "dle-mxnet-2020", "a100", 1, 256, 8, 2180.0),
        ("DLE MXNet RN50 (20.12)", "dle-mxnet-2020", "a100", 8, 256, 8, 16925.0),
        ("DLE PyTorch RN50 (21.03)", "dle-pytorch-2021", "v100", 1, 256, 8, 1200.0),
        ("DLE PyTorch RN50 (21.03)", "dle-pytorch-2021", "v100", 8, 256, 8, 8322.0),
        ("DLE PyTorch RN50 (21.03)", "dle-pytorch-2021", "a100", 1, 256, 8, 2470.0),
        ("DLE PyTorch RN50 (21.03)", "dle-pytorch-2021", "a100", 8, 256, 8, 16621.0),
        ("DLE TensorFlow RN50 (20.06, XLA)", "dle-tf-2020", "v100", 1, 256, 8, 1270.0),
        ("DLE TensorFlow RN50 (20.06, XLA)", "dle-tf-2020", "v100", 8, 256, 8, 9510.0),
        ("DLE TensorFlow RN50 (20.06, XLA)", "dle-tf-2020", "a100", 1, 256, 8, 2375.0),
        ("DLE TensorFlow RN50 (20.06, XLA)", "dle-tf-2020", "a100", 8, 256, 8, 17400.0),
    ]
    stack_refs = {("dle-mxnet-2020", "v100", 1), ("dle-pytorch-2021", "v100", 1), ("dle-tf-2020", "v100", 1)}
    for source, stack, dev, n, b, per_node, published in tables:
        fit = (stack, dev, n) in stack_refs
        out.append(Row(source, f"{n} {dev.upper()} AMP, {b} per GPU", "images/s", published,
                       _ips(dev, n, b, stack, per_node=per_node), "FIT (input)" if fit else V,
                       f"{stack} factor" if fit else stack))
    h8 = predict(device="h100", devices=8, devices_per_node=8, intra_node="nvlink4", global_batch=3456,
                 precision="fp16", epochs=37, **RN50)
    out.append(Row("MLPerf Training v3.0 (FACTS.md)", "8 H100, batch 3,456, 37 epochs", "time-to-train (min)",
                   13.466, h8.time_to_train_s / 60, V,
                   "batch and epochs to 75.9% not in the sources (assumed); evaluation every 4 epochs modelled"))
    knl = predict(device="xeon-phi-7250", devices=2048, devices_per_node=1, inter_node="omnipath",
                  algorithm="ring", global_batch=32768, precision="fp32", epochs=90, eval_every=0, **RN50)
    out.append(Row("You et al. 1709.05011", "2,048 KNL, batch 32K, 90 epochs", "time-to-train (min)",
                   20.0, knl.time_to_train_s / 60, "FIT (input)", "KNL eff_max; no independent KNL figure at hand"))
    return out


def summary(rs: list[Row], within: float = 0.25) -> tuple[int, int]:
    """(validation rows within `within`, validation rows)."""
    vs = [r for r in rs if r.role == "validation"]
    return sum(abs(r.error) <= within for r in vs), len(vs)


def table(rs: list[Row], printer: Callable[[str], None] = print) -> None:
    """Print the rows as a markdown table (the form docs/performance_model.md holds)."""
    printer("| Source | Setup | Quantity | Published | Model | Error | Role |")
    printer("|---|---|---|---:|---:|---:|---|")
    for r in rs:
        role = r.role + (f": {r.note}" if r.note else "")
        printer(f"| {r.source} | {r.setup} | {r.quantity} | {r.published:.4g} | {r.predicted:.4g} | "
                f"{100 * r.error:+.1f}% | {role} |")
