"""`largebatch plan --validate`: the model against published runs (docs/performance_sources.md).

1. Each row is a published run: its plan (device, topology, algorithm, batch, precision) and one
   published quantity (time-to-train, images/s or scaling efficiency).
2. The model predicts the same quantity; error = predicted / published - 1.
   Papers' times are training times (evaluation left out: eval_every=0); MLPerf's time-to-accuracy
   includes its evaluation passes (every 4 epochs over the 50,000 validation images).
   An MLPerf row's figure comes from the result log: the time from run_start to run_stop where both
   lines were read (v1.1 and later; inputs: the logged global batch and the epoch of run_stop), otherwise
   the last images/s the log prints before run_stop (v0.6, v0.7, v1.0; v0.6 and v0.7 logs interleave
   every rank's output).
3. A row whose figure was used to set a catalog input is marked FIT: it shows the fit, it does
   not validate the model. Compute is fitted to single-node figures only; no multi-node run is a FIT
   except You et al.'s KNL run (no single-node KNL figure exists).
4. An MLPerf row uses its release's stack (`mlperf-v0.5` ... `mlperf-v4.0`, each fitted to that release's
   own single-node log; v0.7's is `mlperf-2020`, the device curves' own). largebatch's own measured step (the
   `largebatch` stack, one H200) is a FIT row per precision, predicted with the default stack.
5. The seed runs of 2017-2018 (Goyal et al., Akiba et al. of PFN, Mikami et al. of Sony, You et al.) each have a
   stack of their own (`goyal-2017`, `pfn-2017`, `sony-2018`, `you-2017`; `seed_figures`), fitted on one figure
   of the paper (`fit_factor`: the factor at which the model reproduces it; catalog.yaml stores it) and used to
   predict the paper's other figures. Which figure is fitted, by one rule: the paper's own single-node figure
   where it gives one; else its scaling efficiency at one size, where a speed at or below the device's peak
   reproduces it; else its time-to-train. The fitted figure's row is FIT, the others are validation rows.
   `alternative_fits` fits each stack on each of its other figures instead and predicts the rest (the same
   question asked the other way; docs/performance_model.md reports both). No new figure: each is one that
   docs/performance_sources.md records with its source.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from largebatch.perf.catalog import get_device, load_catalog
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
    nodes: int = 1     # nodes of the run; more than 1 makes it a multi-node row

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1.0


RN50: dict[str, Any] = dict(model="resnet50", dataset_size=IMAGENET)


def _ips(device: str, n: int, per_gpu: int, stack: str | None, precision: str = "fp16", per_node: int = 8,
         intra: str | None = None) -> float:
    """images/s of a single-node (or single-GPU) throughput table row."""
    return predict(device=device, devices=n, devices_per_node=per_node, intra_node=intra, global_batch=n * per_gpu,
                   precision=precision, stack=stack, **RN50).images_per_s


@dataclass(frozen=True)
class Figure:
    """One published figure of a seed paper; `model(stack)` is the model's value of it on that stack."""

    source: str
    setup: str
    quantity: str
    published: float
    model: Callable[[str], float]
    nodes: int = 1
    note: str = ""


# The seed runs' stacks: (device, precision) of the run, for the peak check of a fit
SEED_DEVICES = {"goyal-2017": ("p100", "fp32"), "pfn-2017": ("p100", "fp32"), "sony-2018": ("v100", "fp16"),
                "you-2017": ("xeon-phi-7250", "fp32")}


def _goyal(stack: str, devices: int, batch: int) -> Any:
    return predict(device="p100", devices=devices, devices_per_node=8, intra_node="nvlink1", inter_node="eth50",
                   algorithm="hierarchical", precision="fp32", global_batch=batch, epochs=90, eval_every=0,
                   stack=stack, **RN50)


def _akiba(stack: str) -> Any:
    return predict(device="p100", devices=1024, devices_per_node=8, intra_node="nvlink1", inter_node="ib-fdr:2",
                   global_batch=32768, precision="fp32", epochs=90, eval_every=0, stack=stack, **RN50)


def _sony(stack: str, devices: int, batch: int, epochs: float) -> Any:
    return predict(device="v100", devices=devices, devices_per_node=4, intra_node="nvlink2", inter_node="ib-edr:2",
                   algorithm="torus2d", precision="fp16", global_batch=batch, epochs=epochs, eval_every=0,
                   stack=stack, **RN50)


def _sony_2176_time(stack: str = "sony-2018") -> float:
    """Sony: 5 warm-up epochs at 16 per GPU (34,816), then 85 epochs at 32 per GPU (69,632)."""
    return _sony(stack, 2176, 34816, 5).time_to_train_s + _sony(stack, 2176, 69632, 85).time_to_train_s


def _knl(stack: str) -> Any:
    return predict(device="xeon-phi-7250", devices=2048, devices_per_node=1, inter_node="omnipath",
                   algorithm="ring", global_batch=32768, precision="fp32", epochs=90, eval_every=0, stack=stack,
                   **RN50)


def seed_figures() -> dict[str, list[Figure]]:
    """Each seed run's stack and the figures of its paper that docs/performance_sources.md records, the figure the
    stack is fitted on first (module docstring, step 5: the rule that picks it)."""
    goyal, akiba, sony = "Goyal et al. 1706.02677", "Akiba et al. 1711.04325", "Mikami et al. 1811.05233"
    return {
        # the paper's own single-node figure (B1, A6; ../shared/FACTS.md)
        "goyal-2017": [
            Figure(goyal, "8 P100, batch 256, 90 epochs", "time-to-train (h)", 29.0,
                   lambda s: _goyal(s, 8, 256).time_to_train_s / 3600, 1, "one node"),
            Figure(goyal, "256 P100, 50 GbE, batch 8k, 90 epochs", "time-to-train (h)", 1.0,
                   lambda s: _goyal(s, 256, 8192).time_to_train_s / 3600, 32),
            Figure(goyal, "8 -> 256 P100, 32 per GPU", "scaling efficiency", 0.90,
                   lambda s: _goyal(s, 256, 8192).images_per_s / (32 * _goyal(s, 8, 256).images_per_s), 32),
        ],
        # no single-node figure; the 80% (NVIDIA's table) would need a P100 at about 6x its fp32 peak
        # (alternative_fits), so the time (B2)
        "pfn-2017": [
            Figure(akiba, "1,024 P100 (128 x 8), 2x IB FDR, batch 32k, 90 epochs", "time-to-train (min)", 15.0,
                   lambda s: _akiba(s).time_to_train_s / 60, 128,
                   "fp32 compute assumed (precision not in the text at hand)"),
            Figure("Akiba et al. (NVIDIA table)", "1,024 P100 (128 x 8), 32 per GPU, against one node",
                   "scaling efficiency", 0.80, lambda s: _akiba(s).scaling_efficiency_node, 128,
                   "baseline of the 80% not stated: one node (8 GPUs) assumed; fp32 assumed as above"),
        ],
        # no single-node figure; the scaling efficiency at 1,088 V100 (B5)
        "sony-2018": [
            Figure(sony, "1,088 V100, 32 per GPU, against one node", "scaling efficiency", 0.9162,
                   lambda s: _sony(s, 1088, 34816, 90).scaling_efficiency_node, 272,
                   "baseline of the 91.62% not stated: one node (4 GPUs) assumed"),
            Figure(sony, "2,176 V100, 2x IB EDR, 2D-torus, 34K->68K", "time-to-train (s)", 224.0,
                   _sony_2176_time, 544,
                   "5 epochs at 16 per GPU, then 85 at 32 (90 epochs assumed: not in the sources)"),
        ],
        # the paper's one figure on hardware in the catalog: no held-out figure exists (B11)
        "you-2017": [
            Figure("You et al. 1709.05011", "2,048 KNL, batch 32K, 90 epochs", "time-to-train (min)", 20.0,
                   lambda s: _knl(s).time_to_train_s / 60, 2048,
                   "no other figure of the paper on catalog hardware: no held-out figure"),
        ],
    }


TRIAL_STACK = "__fit_trial__"


@contextmanager
def _trial_stack(factor: float) -> Iterator[str]:
    """A stack of the given factor, in the loaded catalog for the duration only (the fit's trial values)."""
    stacks = load_catalog().setdefault("stacks", {})
    stacks[TRIAL_STACK] = {"factor": factor, "released": "", "source": "validate.fit_factor's trial value"}
    try:
        yield TRIAL_STACK
    finally:
        stacks.pop(TRIAL_STACK, None)


def fit_factor(figure: Figure, lo: float = 0.01, hi: float = 100.0, rel: float = 1e-6) -> float:
    """The stack factor at which the model reproduces `figure` (bisection on log(factor); every seed quantity is
    monotone in the factor: a faster stack takes less time and is less efficient). ValueError where no factor
    in [lo, hi] reproduces it."""
    def err(x: float) -> float:
        with _trial_stack(x) as s:
            return figure.model(s) / figure.published - 1.0

    e_lo, e_hi = err(lo), err(hi)
    if e_lo == 0.0:
        return lo
    if (e_lo < 0) == (e_hi < 0):
        raise ValueError(f"no stack factor in [{lo}, {hi}] reproduces {figure.source}: {figure.setup}")
    while hi / lo > 1.0 + rel:
        mid = math.sqrt(lo * hi)
        e = err(mid)
        if (e < 0) == (e_lo < 0):
            lo, e_lo = mid, e
        else:
            hi = mid
    return math.sqrt(lo * hi)


@dataclass(frozen=True)
class AlternativeFit:
    """A seed stack fitted on another figure of its paper than the catalog's, and what it then predicts."""

    stack: str
    fitted: Figure
    factor: float
    peak_fraction: float          # eff_max x factor: above 1 no real speed reproduces the fitted figure
    predictions: list[tuple[Figure, float]]   # (figure, model value) for every other figure of the paper

    @property
    def feasible(self) -> bool:
        return self.peak_fraction <= 1.0


def alternative_fits() -> list[AlternativeFit]:
    """Every seed stack fitted, in turn, on each figure of its paper that the catalog's stack is not fitted on."""
    out = []
    for stack, figs in seed_figures().items():
        device, precision = SEED_DEVICES[stack]
        eff_max = get_device(device, precision).eff_max
        for i, fig in enumerate(figs[1:], start=1):
            factor = fit_factor(fig)
            with _trial_stack(factor) as s:
                preds = [(other, other.model(s)) for j, other in enumerate(figs) if j != i]
            out.append(AlternativeFit(stack, fig, factor, eff_max * factor, preds))
    return out


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def seed_table(printer: Callable[[str], None] = print, alternatives: list[AlternativeFit] | None = None) -> None:
    """Print the seed stacks both ways as markdown (the form docs/performance_model.md holds): the catalog's fit
    and its held-out predictions, then each alternative fit (`alternatives`, computed when not given)."""
    from largebatch.perf.catalog import stack_factor

    printer("| Stack | Fitted on | Factor | Predicted (held out) | Published | Model | Error |")
    printer("|---|---|---:|---|---:|---:|---:|")
    for stack, figs in seed_figures().items():
        rest: list[Figure | None] = list(figs[1:]) or [None]
        for k, other in enumerate(rest):
            head = (f"| {stack} | {figs[0].setup}: {figs[0].quantity} {_fmt(figs[0].published)} | "
                    f"{stack_factor(stack):.3f} |" if k == 0 else "| | | |")
            if other is None:
                printer(f"{head} no held-out figure | | | |")
            else:
                pred = other.model(stack)
                printer(f"{head} {other.setup}: {other.quantity} | {_fmt(other.published)} | {_fmt(pred)} | "
                        f"{100 * (pred / other.published - 1):+.1f}% |")
    printer("")
    printer("| Stack | Fitted instead on | Factor | eff_max x factor | Predicted | Published | Model | Error |")
    printer("|---|---|---:|---:|---|---:|---:|---:|")
    for alt in alternative_fits() if alternatives is None else alternatives:
        for k, (other, pred) in enumerate(alt.predictions):
            head = (f"| {alt.stack} | {alt.fitted.setup}: {alt.fitted.quantity} {_fmt(alt.fitted.published)} | "
                    f"{alt.factor:.3f} | {alt.peak_fraction:.2f}{'' if alt.feasible else ' (above peak)'} |"
                    if k == 0 else "| | | | |")
            printer(f"{head} {other.setup}: {other.quantity} | {_fmt(other.published)} | {_fmt(pred)} | "
                    f"{100 * (pred / other.published - 1):+.1f}% |")


def _mlperf_multinode() -> list[Row]:
    """MLPerf multi-node ResNet-50 results, each from its own result log (docs/performance_sources.md B15, B20-B49).

    images/s rows: the last throughput the log prints before run_stop; time rows: run_start to run_stop,
    with the log's epochs and MLPerf's evaluation every 4 epochs modelled. DGX-1: 8 V100 on NVLink 2, 4 IB EDR;
    DGX-2H: 16 V100-SXM3 on NVSwitch, 8 IB EDR for compute; DGX A100: NVLink 3, 8 IB HDR; DGX H100: NVLink 4,
    8 IB NDR (the systems' descriptions). Other submitters' closed-division runs are rows too where the system
    file names the NGC MXNet container of the release (NVIDIA's MXNet implementation: the release's stack) and
    the devices are in the catalog; their nodes and links are their system files'. result_0.txt is read unless
    the row says why not (a result_0 whose run_stop is "aborted" is not a time-to-train: the first converged
    log is read)."""
    V = "validation"
    dgx1 = dict(device="v100", devices_per_node=8, intra_node="nvlink2", inter_node="ib-edr:4", precision="fp16")
    dgx2h = dict(device="v100", devices_per_node=16, intra_node="nvlink2", inter_node="ib-edr:8", precision="fp16")
    a100 = dict(device="a100", devices_per_node=8, intra_node="nvlink3", inter_node="ib-hdr:8", precision="fp16")
    h100 = dict(device="h100", devices_per_node=8, intra_node="nvlink4", inter_node="ib-ndr:8", precision="fp16")
    sxm3 = "V100-SXM3-32GB (DGX-2H) modelled as the catalog's V100 SXM2"
    # other submitters' systems (their system files): Dell XE8545, 4 A100-SXM4 on NVLink 3, 2 IB HDR; Dell
    # C4140, 4 V100-SXM2 on NVLink 2, inter-node network not described (1 IB EDR assumed); H3C R5500G5, 8 A100-SXM4
    # on NVSwitch, 4 IB HDR; Dell XE9680, 8 GPUs on NVSwitch, 8 IB NDR (the H100 one is `h100`); Azure ND96amsr A100
    # v4, 8 A100 on NVSwitch, 8 IB HDR (`a100`)
    xe8545 = dict(device="a100", devices_per_node=4, intra_node="nvlink3", inter_node="ib-hdr:2", precision="fp16")
    c4140 = dict(device="v100", devices_per_node=4, intra_node="nvlink2", inter_node="ib-edr:1", precision="fp16")
    r5500 = dict(device="a100", devices_per_node=8, intra_node="nvlink3", inter_node="ib-hdr:4", precision="fp16")
    xe9680_a100 = dict(device="a100", devices_per_node=8, intra_node="nvlink3", inter_node="ib-ndr:8", precision="fp16")
    a100_var = "A100-SXM4-80GB{} modelled as the catalog's A100 (fitted to the 40 GB, 400 W DGX A100)"
    c4140_net = "C4140 system file names only '1Gb Ethernet' host networking (MOFED installed): 1 IB EDR assumed"

    def ips(plan: dict[str, Any], n: int, batch: int, stack: str = "mlperf-2020") -> float:
        return predict(devices=n, global_batch=batch, stack=stack, **plan, **RN50).images_per_s

    def secs(plan: dict[str, Any], n: int, batch: int, epochs: int, stack: str) -> float:
        return predict(devices=n, global_batch=batch, epochs=epochs, stack=stack, **plan, **RN50).time_to_train_s

    return [
        Row("MLPerf v0.6 NVIDIA (dgx1_n130 result_0.txt)", "1,040 V100 (130 DGX-1), 52 per GPU", "images/s",
            1134014.78, ips(dgx1, 1040, 54080, "mlperf-v0.6"), V,
            "mlperf-v0.6; logged Speed of the last epoch (86)", nodes=130),
        Row("MLPerf v0.6 NVIDIA (dgx2h_n96 result_0.txt)", "1,536 V100 (96 DGX-2H), 39 per GPU", "images/s",
            1635376.64, ips(dgx2h, 1536, 59904, "mlperf-v0.6"), V,
            f"mlperf-v0.6; logged Speed of the last epoch (90); {sxm3}; 8 of the log's 10 "
            "EDR cards taken as compute links", nodes=96),
        Row("MLPerf v0.6 NVIDIA (dgx2h_n32 result_0.txt)", "512 V100 (32 DGX-2H), 65 per GPU", "images/s",
            635680.04, ips(dgx2h, 512, 33280, "mlperf-v0.6"), V,
            f"mlperf-v0.6; logged Speed, last window before run_stop (epoch 72); 32 x 16 GPUs and 65 per GPU from "
            f"the log (config_DGX2_multi_32x16x65.sh); {sxm3}; the 8 IB devices of the log's DGXIBDEVICES taken "
            "as compute links", nodes=32),
        Row("MLPerf v0.7 NVIDIA (dgxa100_n2 result_0.txt)", "16 A100 (2 DGX A100), 204 per GPU", "images/s",
            36850.97, ips(a100, 16, 3264), V, "mlperf-2020; logged Speed, last window of epoch 41", nodes=2),
        Row("MLPerf v0.7 NVIDIA (dgxa100_n96 result_0.txt)", "768 A100 (96 DGX A100), 45 per GPU", "images/s",
            1310363.36, ips(a100, 768, 34560), V, "mlperf-2020; logged Speed of the last epoch (59)", nodes=96),
        Row("MLPerf v0.7 NVIDIA (dgx2h_n32 result_0.txt)", "512 V100 (32 DGX-2H), 65 per GPU", "images/s",
            632904.99, ips(dgx2h, 512, 33280), V,
            f"mlperf-2020; logged Speed of epoch 56 (run_stop not in the part of the log read); {sxm3}", nodes=32),
        Row("MLPerf v0.7 DellEMC (2xC4140 result_0.txt)", "8 V100 (2 C4140), 208 per GPU", "images/s",
            11245.37, ips(c4140, 8, 1664), V,
            f"mlperf-2020 (NGC MXNet 20.06); logged Speed, last window before run_stop (epoch 40); mpirun -np 8 and "
            f"batch_size=208 from the log; V100-SXM2-32GB; {c4140_net}", nodes=2),
        Row("MLPerf v0.7 DellEMC (4xC4140 result_0.txt)", "16 V100 (4 C4140), 208 per GPU", "images/s",
            22182.08, ips(c4140, 16, 3328), V,
            f"mlperf-2020 (NGC MXNet 20.06); logged Speed, last window before run_stop (epoch 41); 16 ranks and "
            f"batch_size=208 from the log; V100-SXM2-32GB; {c4140_net}", nodes=4),
        Row("MLPerf v1.0 NVIDIA (dgxa100_n8 result_1.txt)", "64 A100 (8 DGX A100), 204 per GPU", "images/s",
            198446.97, ips(a100, 64, 13056, "mlperf-v1.0"), V,
            "mlperf-v1.0; logged throughput of the last epoch (45); 8 IB HDR assumed as in the v0.7 and v1.1 "
            "DGX A100 system files", nodes=8),
        Row("MLPerf v1.0 Dell (2xXE8545x4A100-SXM-80GB result_0.txt)", "8 A100 (2 XE8545), 408 per GPU", "images/s",
            25152.22, ips(xe8545, 8, 3264, "mlperf-v1.0"), V,
            f"mlperf-v1.0 (NGC MXNet 21.05); logged throughput of the last epoch (35); 8 tasks, 4 per node, "
            f"--batch-size 408 from the log; 2 IB HDR (system file); {a100_var.format(' 500 W')}", nodes=2),
        Row("MLPerf v1.1 NVIDIA (dgxa100_n128 result_0.txt)", "1,024 A100 (128 DGX A100), 35 per GPU, 56 epochs",
            "time-to-train (s)", 32.623, secs(a100, 1024, 35840, 56, "mlperf-v1.1"), V, "mlperf-v1.1; run_start to run_stop",
            nodes=128),
        Row("MLPerf v1.1 NVIDIA (dgxa100_n540 result_0.txt)", "4,320 A100 (540 DGX A100), 15 per GPU, 85 epochs",
            "time-to-train (s)", 21.136, secs(a100, 4320, 64800, 85, "mlperf-v1.1"), V, "mlperf-v1.1; run_start to run_stop",
            nodes=540),
        Row("MLPerf v1.1 NVIDIA (dgxa100_n8 result_0.txt)", "64 A100 (8 DGX A100), 51 per GPU, 35 epochs",
            "time-to-train (s)", 271.596, secs(a100, 64, 3264, 35, "mlperf-v1.1"), V,
            "mlperf-v1.1; run_start to run_stop; d_batch_size 51, global_batch_size 3264 and epoch 35 from the log",
            nodes=8),
        Row("MLPerf v1.1 Azure (nd96amsr_a100_v4_n8 result_0.txt)", "64 A100 (8 ND96amsr A100 v4), 51 per GPU, 35 epochs",
            "time-to-train (s)", 275.232, secs(a100, 64, 3264, 35, "mlperf-v1.1"), V,
            f"mlperf-v1.1 (MXNet NVIDIA Release 21.09); run_start to run_stop; batch 51, global_batch_size 3264 and "
            f"epoch 35 from the log; 8 nodes, 8 IB HDR each (system file); {a100_var.format(' 400 W')}", nodes=8),
        Row("MLPerf v1.1 Dell (2xXE8545x4A100-SXM-80GB result_0.txt)", "8 A100 (2 XE8545), 408 per GPU, 35 epochs",
            "time-to-train (s)", 1807.272, secs(xe8545, 8, 3264, 35, "mlperf-v1.1"), V,
            f"mlperf-v1.1 (NGC MXNet 21.09); run_start to run_stop; batch_size=408 (8 ranks), global_batch_size 3264 "
            f"and epoch 35 from the log; 2 IB HDR (system file); {a100_var.format(' 500 W')}", nodes=2),
        Row("MLPerf v2.0 NVIDIA (dgxa100_n527 result_0.txt)", "4,216 A100 (527 DGX A100), 16 per GPU, 86 epochs",
            "time-to-train (s)", 19.092, secs(a100, 4216, 67456, 86, "mlperf-v2.0"), V, "mlperf-v2.0; run_start to run_stop",
            nodes=527),
        Row("MLPerf v2.0 NVIDIA (dgxa100_n8 result_0.txt)", "64 A100 (8 DGX A100), 51 per GPU, 35 epochs",
            "time-to-train (s)", 270.100, secs(a100, 64, 3264, 35, "mlperf-v2.0"), V,
            "mlperf-v2.0; run_start to run_stop; d_batch_size 51, global_batch_size 3264 and epoch 35 from the log",
            nodes=8),
        Row("MLPerf v2.0 NVIDIA (dgxa100_n128 result_0.txt)", "1,024 A100 (128 DGX A100), 35 per GPU, 56 epochs",
            "time-to-train (s)", 31.767, secs(a100, 1024, 35840, 56, "mlperf-v2.0"), V,
            "mlperf-v2.0; run_start to run_stop; d_batch_size 35, global_batch_size 35840 and epoch 56 from the log",
            nodes=128),
        Row("MLPerf v2.0 Azure (ND96amsr_A100_v4_n8 result_0.txt)", "64 A100 (8 ND96amsr A100 v4), 51 per GPU, 35 epochs",
            "time-to-train (s)", 275.586, secs(a100, 64, 3264, 35, "mlperf-v2.0"), V,
            f"mlperf-v2.0 (MxNet NVIDIA Release 22.04); run_start to run_stop; srun 64 tasks, 8 per node, "
            f"batch_size=51 and epoch 35 from the log (global 3264 derived); 8 IB HDR (system file); {a100_var.format('')}",
            nodes=8),
        Row("MLPerf v2.0 Dell (2xXE8545x4A100-SXM-40GB result_0.txt)", "8 A100 (2 XE8545), 204 per GPU, 35 epochs",
            "time-to-train (s)", 2007.073, secs(xe8545, 8, 1632, 35, "mlperf-v2.0"), V,
            "mlperf-v2.0 (NGC MXNet 22.05, system file); run_start to run_stop; DGXNNODES=2, DGXNGPU=4, BATCHSIZE=204 "
            "and epoch 35 from the log (global 1632 derived); 2 IB HDR (the XE8545 system files)", nodes=2),
        Row("MLPerf v2.0 Dell (4xXE8545x4A100-SXM-40GB result_0.txt)", "16 A100 (4 XE8545), 204 per GPU, 35 epochs",
            "time-to-train (s)", 1025.241, secs(xe8545, 16, 3264, 35, "mlperf-v2.0"), V,
            "mlperf-v2.0 (NGC MXNet 22.05, system file); run_start to run_stop; 16 ranks, batch_size=204 and epoch 35 "
            "from the log (global 3264 derived); 2 IB HDR (the XE8545 system files)", nodes=4),
        Row("MLPerf v2.0 Dell (8xXE8545x4A100-SXM-40GB result_0.txt)", "32 A100 (8 XE8545), 102 per GPU, 35 epochs",
            "time-to-train (s)", 585.455, secs(xe8545, 32, 3264, 35, "mlperf-v2.0"), V,
            "mlperf-v2.0 (NGC MXNet 22.05, system file); run_start to run_stop; d_batch_size 102, global_batch_size "
            "3264 and epoch 35 from the log; 2 IB HDR (the XE8545 system files)", nodes=8),
        Row("MLPerf v2.0 Dell (16xXE8545x4A100-SXM-40GB result_0.txt)", "64 A100 (16 XE8545), 204 per GPU, 45 epochs",
            "time-to-train (s)", 332.159, secs(xe8545, 64, 13056, 45, "mlperf-v2.0"), V,
            "mlperf-v2.0 (NGC MXNet 22.05, system file); run_start to run_stop; 64 ranks, batch_size=204 and epoch 45 "
            "from the log (global 13056 derived); 2 IB HDR (the XE8545 system files)", nodes=16),
        Row("MLPerf v2.0 Dell (32xXE8545x4A100-SXM-40GB result_0.txt)", "128 A100 (32 XE8545), 128 per GPU, 47 epochs",
            "time-to-train (s)", 195.463, secs(xe8545, 128, 16384, 47, "mlperf-v2.0"), V,
            "mlperf-v2.0 (NGC MXNet 22.05, system file); run_start to run_stop; 128 ranks, batch_size=128 and epoch 47 "
            "from the log (global 16384 derived); 2 IB HDR (system file)", nodes=32),
        Row("MLPerf v2.0 Dell (2xXE8545x4A100-SXM-80GB result_0.txt)", "8 A100 (2 XE8545), 408 per GPU, 35 epochs",
            "time-to-train (s)", 1719.236, secs(xe8545, 8, 3264, 35, "mlperf-v2.0"), V,
            f"mlperf-v2.0; run_start to run_stop; 8 ranks, batch_size=408 and epoch 35 from the log (global 3264 "
            f"derived); 2 IB HDR as in the system's v1.0 and v1.1 files; {a100_var.format(' 500 W')}", nodes=2),
        Row("MLPerf v2.0 Dell (4xXE8545x4A100-SXM-80GB result_0.txt)", "16 A100 (4 XE8545), 204 per GPU, 35 epochs",
            "time-to-train (s)", 951.976, secs(xe8545, 16, 3264, 35, "mlperf-v2.0"), V,
            f"mlperf-v2.0; run_start to run_stop; 16 ranks, batch_size=204 and epoch 35 from the log (global 3264 "
            f"derived); 2 IB HDR as in the XE8545 system files; {a100_var.format(' 500 W')}", nodes=4),
        Row("MLPerf v2.0 H3C (2R5500G5-Intelx8A100-SXM-80GB result_1.txt)", "16 A100 (2 R5500 G5), 204 per GPU, 35 epochs",
            "time-to-train (s)", 922.968, secs(r5500, 16, 3264, 35, "mlperf-v2.0"), V,
            f"mlperf-v2.0 (NGC MXNet 22.04, system file); result_1: there is no result_0 (logs numbered 1 to 5); "
            f"run_start to run_stop; srun 16 tasks, 8 per node, batch_size=204 and epoch 35 from the log (global 3264 "
            f"derived); 4 IB HDR (system file); {a100_var.format('')}", nodes=2),
        Row("MLPerf v3.0 NVIDIA (dgxh100_n8 result_0.txt)", "64 H100 (8 DGX H100), 50 per GPU, 35 epochs",
            "time-to-train (s)", 159.917, secs(h100, 64, 3200, 35, "mlperf-v3.0"), V,
            "mlperf-v3.0; run_start to run_stop (official score 2.664 min)", nodes=8),
        Row("MLPerf v3.0 NVIDIA (dgxh100_n64 result_0.txt)", "512 H100 (64 DGX H100), 40 per GPU, 50 epochs",
            "time-to-train (s)", 31.965, secs(h100, 512, 20480, 50, "mlperf-v3.0"), V,
            "mlperf-v3.0; run_start to run_stop (official score 0.509 min)", nodes=64),
        Row("MLPerf v3.0 NVIDIA (dgxh100_n96 result_0.txt)", "768 H100 (96 DGX H100), 42 per GPU, 56 epochs",
            "time-to-train (s)", 22.212, secs(h100, 768, 32256, 56, "mlperf-v3.0"), V,
            "mlperf-v3.0; run_start to run_stop (official score 0.369 min)", nodes=96),
        Row("MLPerf NVIDIA+CoreWeave (coreweave_hgxh100_n448)", "3,584 H100 (448 HGX H100), 16 per GPU, 77 epochs",
            "time-to-train (s)", 10.961, secs(h100, 3584, 57344, 77, "mlperf-v3.0"), V,
            "mlperf-v3.0 (MLPerf ID 3.0-2002, MXNet 23.04); run_start to run_stop (official score 0.183 min)",
            nodes=448),
        Row("MLPerf v3.0 Dell (2xXE9680x8A100-SXM-80GB result_1.txt)", "16 A100 (2 XE9680), 204 per GPU, 36 epochs",
            "time-to-train (s)", 863.728, secs(xe9680_a100, 16, 3264, 36, "mlperf-v3.0"), V,
            f"mlperf-v3.0 (NGC MXNet 23.04; the A100 keeps v2.0's factor); result_1: result_0's run_stop is "
            f"'aborted' (epoch 37, accuracy 0.758); run_start to run_stop; 16 tasks, 8 per node, global_batch_size "
            f"3264 and epoch 36 from the log; 8 IB NDR (system file); {a100_var.format(' 500 W')}", nodes=2),
        Row("MLPerf v3.0 Dell (2xXE9680x8H100-SXM-80GB result_1.txt)", "16 H100 (2 XE9680), 200 per GPU, 35 epochs",
            "time-to-train (s)", 468.899, secs(h100, 16, 3200, 35, "mlperf-v3.0"), V,
            "mlperf-v3.0 (NGC MXNet 23.04); result_1: result_0's run_stop is 'aborted' (epoch 37, accuracy 0.758); "
            "run_start to run_stop; 16 ranks, global_batch_size 3200 and epoch 35 from the log; H100-SXM5 700 W, "
            "8 IB NDR (system file)", nodes=2),
    ]


def rows() -> list[Row]:
    """Steps 1-3 for every published row (sources: docs/performance_sources.md).

    Stack per row, chosen by release, date and framework before looking at the errors: an MLPerf row uses
    its release's stack (`mlperf-v0.5`, `mlperf-v0.6`, `mlperf-2020` for v0.7, `mlperf-v1.0` ... `mlperf-v3.0`,
    each fitted to that release's single-node log: the FIT rows below); other runs before mid-2019 use
    `stack-2018`, except the seed runs of 2017-2018, each on its paper's stack (`seed_figures`: the fitted figure a
    FIT row, the others validation rows); NVIDIA DeepLearningExamples tables their own README's stack."""
    out: list[Row] = []
    V = "validation"
    for stack, figs in seed_figures().items():
        if stack == "you-2017":
            continue            # at the end, where the KNL row has always been
        for k, fig in enumerate(figs):
            fitted = (f"{stack}, fitted on this figure" if k == 0 else
                      f"{stack} (fitted on the paper's {figs[0].quantity}, {figs[0].setup})")
            out.append(Row(fig.source, fig.setup, fig.quantity, fig.published, fig.model(stack),
                           "FIT (input)" if k == 0 else V, fitted + (f"; {fig.note}" if fig.note else ""),
                           nodes=fig.nodes))
    v05 = predict(device="v100", devices=640, devices_per_node=8, intra_node="nvlink2", inter_node="ib-edr:4",
                  global_batch=640 * 26, precision="fp16", epochs=81, stack="mlperf-v0.5", **RN50)
    out.append(Row("MLPerf v0.5 NVIDIA (result_1.txt)", "640 V100 (80 DGX-1), 26 per GPU, 81 epochs",
                   "time-to-train (s)", 374.5, v05.time_to_train_s, V,
                   "mlperf-v0.5; run_start to run_stop (evaluation every 4 epochs modelled); 4 IB EDR per DGX-1 "
                   "assumed", nodes=80))
    yama = predict(device="v100", devices=2048, devices_per_node=4, intra_node="nvlink2", inter_node="ib-edr:2",
                   global_batch=81920, precision="fp16", stack="stack-2018", **RN50)
    out.append(Row("Yamazaki et al. 1903.12650", "2,048 V100 (ABCI), batch 81,920", "images/s",
                   1.73e6, yama.images_per_s, V, "stack-2018; published 'over 1.73 million'", nodes=512))
    out.extend(_mlperf_multinode())
    out.append(Row("MLPerf v0.7 NVIDIA 1x DGX-1", "8 V100, 208 per GPU", "images/s",
                   11271.0, _ips("v100", 8, 208, "mlperf-2020"), "FIT (input)", "V100 fp16 eff_max"))
    out.append(Row("MLPerf v0.7 NVIDIA 1x DGX A100", "8 A100, 408 per GPU", "images/s",
                   22428.0, _ips("a100", 8, 408, "mlperf-2020"), "FIT (input)", "A100 fp16 eff_max"))
    release_fits = [  # (release, system, result log, device, per-GPU batch, logged images/s on 8 GPUs, what)
        ("v0.5", "1x DGX-1", "dgx1_ngc18.11_mxnet result_0.txt", "v100", 208, 10129.0,
         "mlperf-v0.5 factor; images/s from the log's epoch timestamps"),
        ("v0.6", "1x DGX-1", "dgx1_ngc19.05_mxnet result_0.txt", "v100", 208, 11218.10, "mlperf-v0.6 factor"),
        ("v1.0", "1x DGX A100", "dgxa100_ngc21.05_mxnet result_0.txt", "a100", 408, 26698.85, "mlperf-v1.0 factor"),
        ("v1.1", "1x DGX A100", "dgxa100_ngc21.09_mxnet result_0.txt", "a100", 408, 26325.80, "mlperf-v1.1 factor"),
        ("v2.0", "1x DGX A100", "dgxa100_ngc22.04_mxnet result_0.txt", "a100", 408, 27164.07, "mlperf-v2.0 factor"),
        ("v3.0", "1x DGX H100", "dgxh100_ngc23.04_mxnet result_0.txt", "h100", 400, 56078.48,
         "mlperf-v3.0 H100 factor (per-stack device factor)"),
        ("v4.0", "1x HGX H200", "h200_ngc24.04_mxnet result_0.txt", "h200", 400, 63608.0,
         "mlperf-v4.0 H200 factor (per-stack device factor); median logged epoch throughput from epoch 2"),
    ]
    for release, system, log, dev, b, published, what in release_fits:
        out.append(Row(f"MLPerf {release} NVIDIA {system} ({log})", f"8 {dev.upper()}, {b} per GPU", "images/s",
                       published, _ips(dev, 8, b, f"mlperf-{release}"), "FIT (input)", what))
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
    h8 = predict(device="h100", devices=8, devices_per_node=8, intra_node="nvlink4", global_batch=3200,
                 precision="fp16", epochs=35, stack="mlperf-v3.0", **RN50)
    out.append(Row("MLPerf Training v3.0", "8 H100, batch 3,200, 35 epochs", "time-to-train (min)",
                   13.466, h8.time_to_train_s / 60, "FIT (input)",
                   "single node of the mlperf-v3.0 H100 fit's configuration (8 H100, MXNet 23.04, batch 3,200); "
                   "batch and epochs from that fit's log (dgxh100_ngc23.04_mxnet result_0.txt, 13.60 min); "
                   "evaluation every 4 epochs modelled"))
    h200 = predict(device="h200", devices=8, devices_per_node=8, intra_node="nvlink4", global_batch=3200,
                   precision="fp16", epochs=35, stack="mlperf-v4.0", **RN50)
    out.append(Row("MLPerf Training v4.0", "8 H200, batch 3,200, 35 epochs", "time-to-train (min)",
                   12.03, h200.time_to_train_s / 60, "FIT (input)",
                   "single node of the mlperf-v4.0 H200 fit's configuration (8 H200, MXNet 24.04, 400 per GPU, "
                   "h200_ngc24.04_mxnet result_0.txt); evaluation every 4 epochs modelled"))
    for prec, published in (("fp16", 5610.62), ("bf16", 4413.28)):   # largebatch's own step: the default stack
        out.append(Row("largebatch bench train (results/gpu/bench_train.json, 2026-11-26)",
                       f"1 H200 {prec} channels_last, 256 per GPU", "images/s", published,
                       _ips("h200", 1, 256, None, precision=prec), "FIT (input)",
                       f"largebatch stack's H200 {prec} factor, the H200's default stack at {prec}"))
    (you,) = seed_figures()["you-2017"]
    out.append(Row(you.source, you.setup, you.quantity, you.published, you.model("you-2017"), "FIT (input)",
                   f"you-2017, fitted on this figure (the KNL curve too: no independent KNL figure at hand); "
                   f"{you.note}", nodes=you.nodes))
    return out


def summary(rs: list[Row], within: float = 0.25) -> tuple[int, int]:
    """(validation rows within `within`, validation rows)."""
    vs = [r for r in rs if r.role == "validation"]
    return sum(abs(r.error) <= within for r in vs), len(vs)


def multinode_summary(rs: list[Row], within: float = 0.25) -> tuple[int, int]:
    """(multi-node validation rows within `within`, multi-node validation rows)."""
    return summary([r for r in rs if r.nodes > 1], within)


def table(rs: list[Row], printer: Callable[[str], None] = print) -> None:
    """Print the rows as a markdown table (the form docs/performance_model.md holds)."""
    printer("| Source | Setup | Quantity | Published | Model | Error | Role |")
    printer("|---|---|---|---:|---:|---:|---|")
    for r in rs:
        role = r.role + (f": {r.note}" if r.note else "")
        printer(f"| {r.source} | {r.setup} | {r.quantity} | {r.published:.4g} | {r.predicted:.4g} | "
                f"{100 * r.error:+.1f}% | {role} |")


if __name__ == "__main__":
    seed_table()
