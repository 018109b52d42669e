"""`largebatch plan --validate`: the model against published runs (shared/FACTS.md).

1. Each row is a published run: its plan (device, topology, algorithm, batch, precision) and one
   published quantity (time-to-train, images/s or scaling efficiency).
2. The model predicts the same quantity; error = predicted / published - 1.
   Papers' times are training times (evaluation left out: eval_every=0); MLPerf's time-to-accuracy
   includes its evaluation passes (every 4 epochs over the 50,000 validation images).
3. A row whose figure was used to set a catalog input is marked FIT: it shows the fit, it does
   not validate the model. `fit_v100_b_half()` re-derives the one fitted curve parameter
   (V100 fp16 b_half, from Sony's 224 s) so the catalog value can be checked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from largebatch.perf.catalog import load_catalog
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


def _sony_2176_time() -> float:
    """Sony: 5 warm-up epochs at 16 per GPU (34,816), then 85 epochs at 32 per GPU (69,632)."""
    common = dict(model="resnet50", device="v100", devices=2176, devices_per_node=4, intra_node="nvlink2",
                  inter_node="ib-edr:2", algorithm="torus2d", precision="fp16", dataset_size=IMAGENET, eval_every=0)
    return (predict(global_batch=34816, epochs=5, **common).time_to_train_s
            + predict(global_batch=69632, epochs=85, **common).time_to_train_s)


def rows() -> list[Row]:
    """Steps 1-3 for every published row."""
    out: list[Row] = []
    goyal = dict(model="resnet50", device="p100", devices_per_node=8, intra_node="nvlink1", inter_node="eth50",
                 algorithm="hierarchical", precision="fp32", dataset_size=IMAGENET, epochs=90, eval_every=0)
    g8 = predict(devices=8, global_batch=256, **goyal)
    g256 = predict(devices=256, global_batch=8192, **goyal)
    out.append(Row("Goyal et al. 1706.02677", "8 P100, batch 256, 90 epochs", "time-to-train (h)",
                   29.0, g8.time_to_train_s / 3600, "FIT (input)", "P100 eff_max"))
    out.append(Row("Goyal et al. 1706.02677", "256 P100, 50 GbE, batch 8k, 90 epochs", "time-to-train (h)",
                   1.0, g256.time_to_train_s / 3600, "validation"))
    out.append(Row("Goyal et al. 1706.02677", "8 -> 256 P100, 32 per GPU", "scaling efficiency",
                   0.90, g256.images_per_s / (32 * g8.images_per_s), "validation"))
    out.append(Row("Mikami et al. 1811.05233", "2,176 V100, 2x IB EDR, 2D-torus, 34K->68K", "time-to-train (s)",
                   224.0, _sony_2176_time(), "FIT (input)", "V100 fp16 b_half"))
    sony = dict(model="resnet50", device="v100", devices_per_node=4, intra_node="nvlink2", inter_node="ib-edr:2",
                algorithm="torus2d", precision="fp16", dataset_size=IMAGENET, epochs=90, eval_every=0)
    s1088 = predict(devices=1088, global_batch=34816, **sony)
    out.append(Row("Mikami et al. 1811.05233", "1,088 V100, 32 per GPU, against one node", "scaling efficiency",
                   0.9162, s1088.scaling_efficiency_node, "validation",
                   "Sony's baseline for 91.62% is not stated in FACTS.md; one node (4 GPUs) assumed"))
    v1 = predict(model="resnet50", device="v100", devices=1, devices_per_node=8, global_batch=256, precision="fp16")
    v8 = predict(model="resnet50", device="v100", devices=8, devices_per_node=8, intra_node="nvlink2",
                 global_batch=2048, precision="fp16")
    out.append(Row("NVIDIA DLE RN50 v1.5 README", "1 V100 16GB AMP, batch 256", "images/s",
                   1200.0, v1.images_per_s, "FIT (input)", "V100 fp16 eff_max"))
    out.append(Row("NVIDIA DLE RN50 v1.5 README", "8 V100 16GB AMP (DGX-1), 256 per GPU", "images/s",
                   8322.0, v8.images_per_s, "validation"))
    a1 = predict(model="resnet50", device="a100", devices=1, devices_per_node=8, global_batch=256, precision="fp16")
    a8 = predict(model="resnet50", device="a100", devices=8, devices_per_node=8, intra_node="nvlink3",
                 global_batch=2048, precision="fp16")
    out.append(Row("NVIDIA DLE RN50 v1.5 (FACTS.md)", "1 A100 AMP, batch 256", "images/s",
                   2470.0, a1.images_per_s, "FIT (input)", "A100 eff_max"))
    out.append(Row("NVIDIA DLE RN50 v1.5 (FACTS.md)", "8 A100 AMP (DGX A100), 256 per GPU", "images/s",
                   16621.0, a8.images_per_s, "validation"))
    h8 = predict(model="resnet50", device="h100", devices=8, devices_per_node=8, intra_node="nvlink4",
                 global_batch=3456, precision="fp16", epochs=37, dataset_size=IMAGENET)
    out.append(Row("MLPerf Training v3.0 (FACTS.md)", "8 H100, batch 3,456, 37 epochs", "time-to-train (min)",
                   13.466, h8.time_to_train_s / 60, "validation",
                   "batch and epochs to 75.9% are not in FACTS.md (assumed, unconfirmed); evaluation every 4 epochs "
                   "over 50,000 images modelled, data loading and initialisation not"))
    knl = predict(model="resnet50", device="xeon-phi-7250", devices=2048, devices_per_node=1, inter_node="omnipath",
                  algorithm="ring", global_batch=32768, precision="fp32", epochs=90, dataset_size=IMAGENET, eval_every=0)
    out.append(Row("You et al. 1709.05011", "2,048 KNL, batch 32K, 90 epochs", "time-to-train (min)",
                   20.0, knl.time_to_train_s / 60, "FIT (input)", "KNL eff_max; no independent KNL figure at hand"))
    return out


def fit_v100_b_half(target_s: float = 224.0) -> float:
    """Step 3: the V100 fp16 b_half that makes Sony's 2,176-GPU run take `target_s` (bisection).

    Sets the value in the loaded (cached) catalog while it searches and restores it afterwards."""
    curve = load_catalog()["devices"]["v100"]["efficiency"]["fp16"]
    saved = curve["b_half"]
    lo, hi = 0.0, 2000.0
    try:
        for _ in range(40):
            mid = (lo + hi) / 2
            curve["b_half"] = mid
            if _sony_2176_time() < target_s:
                lo = mid
            else:
                hi = mid
    finally:
        curve["b_half"] = saved
    return (lo + hi) / 2


def table(rs: list[Row], printer: Callable[[str], None] = print) -> None:
    """Print the rows as a markdown table (the form docs/performance_model.md holds)."""
    printer("| Source | Setup | Quantity | Published | Model | Error | Role |")
    printer("|---|---|---|---:|---:|---:|---|")
    for r in rs:
        role = r.role + (f": {r.note}" if r.note else "")
        printer(f"| {r.source} | {r.setup} | {r.quantity} | {r.published:.4g} | {r.predicted:.4g} | "
                f"{100 * r.error:+.1f}% | {role} |")
