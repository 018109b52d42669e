"""The performance model: step time, throughput, scaling efficiency, time-to-train and cost.

1. Compute. Forward FLOPs F per image come from the model definition (`flops.model_cost`).
   On a device of peak P at precision q with fraction-of-peak eff_max (the catalog's curve, for the
   reference software stack, times the factor of the run's `stack` on that device), one image of training
   costs t_img = 3F / (P eff_max), and a step of b images per device costs
   t_c(b) = t_img (b + b_half): the efficiency against the per-device batch is
   eff_max * b / (b + b_half), half of eff_max at b = b_half. Forward is t_c/3, backward 2t_c/3.
2. Gradient bytes. G = parameters x bytes per element of the precision (fp16/bf16: 2, fp32: 4),
   cut into buckets of `bucket_mb` (the last one smaller), as DDP and Sony's tensor fusion do.
3. Communication. Each bucket costs one all-reduce of its size with the chosen algorithm on the
   two-level topology (`topology.py`; one file per algorithm). comm = sum over buckets.
   `native`, the default, is the backend's own all-reduce as NCCL runs it: its tuner picks, per
   message, the faster of its ring and its double binary tree from a latency + bandwidth model of
   each, so `native` costs min(ring, tree) per bucket. A flat ring alone is latency-bound at
   thousands of devices (2(p-1) steps), which NCCL avoids by switching to the tree.
4. Overlap. Backward produces gradients at a constant rate, so bucket i is ready at
   t_bwd * (bytes up to and including i) / G; buckets are all-reduced one at a time in order.
   The exposed communication is what is left after backward ends:
   max(0, end of the last all-reduce - t_bwd). Without overlap it is all of comm.
5. Step time = t_c + exposed + data wait; images/s = global batch / step time. The data wait is what the
   input pipeline adds when it is slower than the step: with a loader of r images/s per device (`data_images_per_s`,
   e.g. `largebatch bench data`'s figure; None = the loader keeps up, not modelled) it is
   max(0, b / r - (t_c + exposed)), the loader working ahead during compute and communication.
6. Scaling efficiency against one device: t_c / (t_c + exposed) (the same per-device batch, no
   communication); against one node: the same step on g devices / on p devices (data wait left out of both).
7. Evaluation, the overhead that published times-to-accuracy include: every `eval_every` epochs
   one pass over `eval_images` split over all devices, forward only (t_c / 3 per step of the
   per-device batch, b_half included), plus its all-reduce of the counts (one latency step).
8. Time-to-train = epochs x dataset / global batch x step time (an epoch charges its images, not
   a rounded-up step count: at a global batch near the dataset size the rounding would charge up
   to twice the images) + evaluation; `steps_per_epoch` is the run's own figure, dataset // global batch
   (the trainer drops an epoch's last partial batch; largebatch/runplan.py); device-hours = devices x hours; cost = device-hours x price
   per device-hour, hardware = devices x purchase price. Where the time goes: compute (steps x t_c),
   exposed communication (steps x exposed), data (steps x data wait) and evaluation add up to time-to-train.
9. Phases (a recipe's batch.phases and data.resolution_phases): each stretch of epochs at one global batch and
   image size is predicted as above and the times are summed; evaluation pass k (at epoch k x eval_every) costs
   what it costs in the phase it falls in. The step figures reported are those of the phase that takes the most
   time; `phases` lists every phase's.
10. Stack: without one, `catalog.default_stack` picks it (largebatch's own where measured on the device at the
   precision, else the newest MLPerf release with a figure for the device); `stack_reason` says which rule.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from largebatch.comm.options import ALLREDUCE, MODEL_ONLY
from largebatch.errors import UserError
from largebatch.perf import halving_doubling, hierarchical, ring, torus2d, tree
from largebatch.perf.catalog import DEFAULT_STACK, Device, default_stack, get_device, get_link, stack_factor
from largebatch.perf.flops import model_cost
from largebatch.perf.topology import Topology

ALGORITHMS = ALLREDUCE + MODEL_ONLY
BYTES_PER_ELEMENT = {"fp32": 4, "fp16": 2, "bf16": 2}
BACKENDS = ("nccl", "gloo")
MAX_BUCKETS = 1_000_000   # gradient buckets of one step: more is a misplaced exponent (--bucket-mb 1e-9)


@dataclass(frozen=True)
class Prediction:
    """What `predict` returns; `to_json()` is what `largebatch plan --json` prints."""

    model: str
    device: str
    precision: str
    algorithm: str
    devices: int
    devices_per_node: int
    nodes: int
    global_batch: int
    per_device_batch: int
    forward_flops_per_image: float
    params: int
    gradient_bytes: int
    buckets: int
    compute_time_s: float
    forward_time_s: float
    backward_time_s: float
    comm_time_s: float
    exposed_comm_s: float
    step_time_s: float
    images_per_s: float
    images_per_s_per_device: float
    scaling_efficiency: float
    scaling_efficiency_node: float
    mfu: float
    steps_per_epoch: int
    epochs: float
    eval_time_s: float
    time_to_train_s: float
    device_hours: float
    cost_usd: float | None
    hardware_usd: float | None
    stack: str = DEFAULT_STACK
    torus_grid: list[int] | None = None
    notes: list[str] = field(default_factory=list)
    stack_reason: str = "given"
    data_time_s: float = 0.0          # data wait per step (5.)
    compute_total_s: float = 0.0      # where the time goes (8.): these four add up to time_to_train_s
    exposed_comm_total_s: float = 0.0
    data_total_s: float = 0.0
    image_size: int = 224
    phases: list[dict[str, Any]] = field(default_factory=list)
    micro_batch: int = 0              # images of one forward pass per device, and passes per step
    accumulation: int = 1
    memory: str = ""                  # memory per device at that micro-batch (largebatch/memory.py), where known

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["where_the_time_goes_s"] = {"compute": self.compute_total_s, "exposed_communication": self.exposed_comm_total_s,
                                        "evaluation": self.eval_time_s, "data": self.data_total_s}
        return out


def allreduce_time(algorithm: str, nbytes: float, topo: Topology, torus_x: int | None = None, *,
                   inter: str = "halving_doubling", pieces: int = 1, backend: str = "nccl",
                   queued: bool = False) -> float:
    """Seconds for one all-reduce of `nbytes` with `algorithm` on `topo` (step 3): the one place that maps
    algorithm names to cost functions, for `plan` and for `largebatch bench allreduce`'s predictions
    (`largebatch.perf.measured`). `native` is the backend's own all-reduce: NCCL's faster of ring and tree
    per message, gloo's ring. `queued`: the two-level algorithms' native-composed form, whose pieces are
    work handles issued ahead (`largebatch.perf.topology.staged`)."""
    if algorithm == "native":
        if backend not in BACKENDS:
            raise ValueError(f"no native all-reduce model for backend {backend!r}")
        return ring.cost(nbytes, topo) if backend == "gloo" else min(ring.cost(nbytes, topo), tree.cost(nbytes, topo))
    if algorithm == "ring":
        return ring.cost(nbytes, topo)
    if algorithm == "halving_doubling":
        return halving_doubling.cost(nbytes, topo)
    if algorithm == "torus2d":
        return torus2d.cost(nbytes, topo, torus_x, pieces, queued)
    if algorithm == "hierarchical":
        return hierarchical.cost(nbytes, topo, inter, pieces, queued)
    if algorithm == "tree":
        return tree.cost(nbytes, topo)
    raise UserError(f"unknown algorithm {algorithm!r}; choose one of: {', '.join(ALGORITHMS)}.")


def bucket_sizes(gradient_bytes: int, bucket_bytes: int) -> list[int]:
    """Step 2: full buckets of `bucket_bytes` and one smaller last bucket."""
    full, rest = divmod(gradient_bytes, bucket_bytes)
    return [bucket_bytes] * full + ([rest] if rest else [])


def overlap(backward_s: float, comm_s: list[float], sizes: list[int], enabled: bool = True) -> float:
    """Step 4: exposed communication when buckets are all-reduced in order as backward makes them."""
    if not enabled:
        return sum(comm_s)
    total = float(sum(sizes))
    end = 0.0
    done = 0
    for size, t in zip(sizes, comm_s):
        done += size
        ready = backward_s * done / total
        end = max(end, ready) + t
    return max(0.0, end - backward_s)


def _step(dev: Device, fwd_flops: float, b: int, topo: Topology, algorithm: str, sizes: list[int],
          do_overlap: bool, torus_x: int | None, inter: str = "halving_doubling", accumulation: int = 1
          ) -> tuple[float, float, float, float]:
    """(compute, comm, exposed, compute + exposed) seconds for per-device batch `b` on `topo`, in `accumulation`
    forward and backward passes."""
    t_img = 3.0 * fwd_flops / (dev.peak_flops * dev.eff_max)     # 1.
    t_c = t_img * (b + accumulation * dev.b_half)
    cache: dict[int, float] = {}
    comm = []
    for s in sizes:                                                # 3.
        if s not in cache:
            cache[s] = allreduce_time(algorithm, s, topo, torus_x, inter=inter)
        comm.append(cache[s])
    exposed = overlap(2.0 * t_c / 3.0, comm, sizes, do_overlap)     # 4.
    return t_c, sum(comm), exposed, t_c + exposed                 # 5.


def _segments(epochs: float, global_batch: int, image_size: int, batch_phases: list[tuple[float, int]] | None,
              resolution_phases: list[tuple[float, int]] | None) -> list[tuple[float, float, int, int]]:
    """Step 9: (start, end, global batch, image size) of every stretch of epochs at one batch and one size. Before
    the first phase of a list (or without one) the plain value applies."""
    starts = sorted({0.0} | {float(a) for a, _ in (batch_phases or []) + (resolution_phases or []) if a < epochs})

    def at(phases: list[tuple[float, int]] | None, epoch: float, plain: int) -> int:
        value = plain
        for start, v in sorted(phases or []):
            if start <= epoch:
                value = int(v)
        return value

    ends = starts[1:] + [float(epochs)]
    return [(a, b, at(batch_phases, a, global_batch), at(resolution_phases, a, image_size))
            for a, b in zip(starts, ends) if b > a]


def predict(model: str = "resnet50", device: str = "v100", devices: int = 8, devices_per_node: int = 8,
            intra_node: str | None = None, inter_node: str = "ib-edr:1", algorithm: str = "native",
            global_batch: int = 2048, epochs: float = 90.0, dataset_size: int = 1281167,
            precision: str = "fp16", image_size: int = 224, in_channels: int = 3, num_classes: int = 1000,
            stem: str = "imagenet", width: int = 64, bucket_mb: float = 25.0, overlap_comm: bool = True,
            torus_x: int | None = None, price_per_device_hour: float | None = None,
            purchase_price: float | None = None, eval_every: float = 4.0, eval_images: int = 50000,
            stack: str | None = None, batch_phases: list[tuple[float, int]] | None = None,
            resolution_phases: list[tuple[float, int]] | None = None, data_images_per_s: float | None = None,
            inter: str = "halving_doubling", splits: dict[int, tuple[int, int]] | None = None,
            memory_note: str = "") -> Prediction:
    """Predict one training plan (steps 1-10); impossible plans raise UserError. `splits`: per-device batch ->
    (micro-batch, accumulation), as the run splits it (largebatch/runplan.py: the micro-batch that fits the
    device's memory); each micro-batch pays the per-pass overhead b_half. A batch it does not name runs in one
    pass."""
    if algorithm not in ALGORITHMS:
        raise UserError(f"unknown algorithm {algorithm!r}; choose one of: {', '.join(ALGORITHMS)}.")
    if precision not in BYTES_PER_ELEMENT:
        raise UserError(f"unknown precision {precision!r}; choose one of: {', '.join(BYTES_PER_ELEMENT)}.")
    if devices < 1 or devices_per_node < 1:
        raise UserError(f"devices ({devices}) and devices per node ({devices_per_node}) must be positive integers.")
    if devices > devices_per_node and devices % devices_per_node:
        raise UserError(f"{devices} devices do not fill nodes of {devices_per_node}; use a multiple of "
                        f"{devices_per_node} or change --devices-per-node.")
    if epochs <= 0 or dataset_size < 1:
        raise UserError(f"epochs ({epochs}) and dataset size ({dataset_size}) must be positive.")
    if bucket_mb <= 0:
        raise UserError(f"bucket size {bucket_mb} MB must be positive.")
    if eval_every < 0 or eval_images < 0:
        raise UserError(f"evaluation every {eval_every} epochs over {eval_images} images: give non-negative "
                        "numbers (0 leaves evaluation out).")
    if data_images_per_s is not None and not data_images_per_s > 0:
        raise UserError(f"data rate {data_images_per_s} images/s per device must be positive.")
    segments = _segments(epochs, global_batch, image_size, batch_phases, resolution_phases)
    for _, _, gb, _ in segments:
        where = "" if len(segments) == 1 else " (a batch phase's)"
        if gb < devices:
            raise UserError(f"global batch {gb}{where} is smaller than the {devices} devices; "
                            "each device needs at least one image per step.")
        if gb % devices:
            raise UserError(f"global batch {gb}{where} does not split evenly over {devices} devices; "
                            f"use a multiple of {devices}.")
        if gb > dataset_size:
            raise UserError(f"global batch {gb}{where} is larger than the dataset ({dataset_size} images); one step "
                            "would see images twice: use a smaller --global-batch or the right --train-size.")
    dev = get_device(device, precision)
    reason = "given"
    if stack is None:                                               # 10.
        stack, reason = default_stack(device, precision)
    factor = stack_factor(stack, device, precision)
    if factor != 1.0:
        dev = replace(dev, eff_max=dev.eff_max * factor)
    intra, _ = get_link(intra_node or dev.default_intra)
    inter_link, mult = get_link(inter_node)
    g = min(devices_per_node, devices)
    topo = Topology(devices, g, intra, inter_link, mult, dev.gamma_s_per_byte)
    node_topo = Topology(g, g, intra, inter_link, mult, dev.gamma_s_per_byte)

    cost = model_cost(model, image_size, in_channels, num_classes, stem, width)
    grad_bytes = cost.params * BYTES_PER_ELEMENT[precision]         # 2.
    bucket_bytes = max(1, int(bucket_mb * 2**20))
    if math.ceil(grad_bytes / bucket_bytes) > MAX_BUCKETS:   # a list of them was a MemoryError, or minutes of work
        raise UserError(f"--bucket-mb {bucket_mb:g} splits the {grad_bytes / 2**20:,.0f} MiB gradient of {model} into "
                        f"{math.ceil(grad_bytes / bucket_bytes):,} buckets; give a larger --bucket-mb or a smaller "
                        f"model (at most {MAX_BUCKETS:,} buckets).")
    sizes = bucket_sizes(grad_bytes, bucket_bytes)
    grid = None
    if algorithm == "torus2d":
        x, y = torus2d.grid(devices, torus_x, topo if torus_x is None else None, float(sizes[0]))
        torus_x, grid = x, [x, y]
    node_x = None
    if algorithm == "torus2d":
        node_x = torus2d.grid(g, None, node_topo, float(sizes[0]))[0]
    count_s = allreduce_time(algorithm, 8.0, topo, torus_x, inter=inter)
    passes = 0 if eval_every <= 0 or eval_images <= 0 else math.floor(epochs / eval_every + 1e-9)
    marks = [k * eval_every for k in range(1, passes + 1)]

    rows: list[dict[str, Any]] = []
    for start, end, gb, size in segments:
        fwd = cost.forward_flops if size == image_size else model_cost(model, size, in_channels, num_classes, stem,
                                                                          width).forward_flops
        b = gb // devices
        micro, acc = (splits or {}).get(b, (b, 1))
        t_c, comm, exposed, busy = _step(dev, fwd, b, topo, algorithm, sizes, overlap_comm, torus_x, inter, acc)
        node_busy = _step(dev, fwd, b, node_topo, algorithm, sizes, overlap_comm, node_x, inter, acc)[3]
        wait = 0.0 if data_images_per_s is None else max(0.0, b / data_images_per_s - busy)   # 5.
        step = busy + wait
        n_eval = sum(1 for m in marks if start < m <= end + 1e-9)      # 7.
        eval_s = n_eval * (math.ceil(eval_images / gb) * t_c / 3.0 + count_s)
        steps = (end - start) * dataset_size / gb                       # 8.
        rows.append(dict(start_epoch=start, end_epoch=end, global_batch=gb, image_size=size, per_device_batch=b,
                         micro_batch=micro, accumulation=acc, steps_per_epoch=max(dataset_size // gb, 1),
                         forward_flops=fwd, compute_time_s=t_c, comm_time_s=comm, exposed_comm_s=exposed,
                         data_time_s=wait, step_time_s=step, node_busy_s=node_busy, images_per_s=gb / step,
                         steps=steps, eval_time_s=eval_s, time_s=steps * step + eval_s))
    main = max(rows, key=lambda r: r["time_s"])
    ttt = sum(r["time_s"] for r in rows)
    eval_total = sum(r["eval_time_s"] for r in rows)
    hours = devices * ttt / 3600.0
    price = purchase_price if purchase_price is not None else dev.purchase_usd
    notes = []
    if devices == 1:
        notes.append("one device: no communication")
    if grid is not None and devices > 3 and all(devices % d for d in range(2, math.isqrt(devices) + 1)):
        notes.append(f"{devices} devices have no divisor between 1 and {devices}: the 2D torus is a 1 x {devices} "
                     "ring; a device count with a divisor near its square root gives a real grid")
    if len(rows) > 1:
        notes.append(f"{len(rows)} phases; the step figures are those of epochs {main['start_epoch']:g}-"
                     f"{main['end_epoch']:g} (global batch {main['global_batch']}, {main['image_size']} px), "
                     "the phase that takes the most time")
    step, t_c, exposed = main["step_time_s"], main["compute_time_s"], main["exposed_comm_s"]
    b, gb = main["per_device_batch"], main["global_batch"]
    return Prediction(
        model=model, device=device, precision=precision, algorithm=algorithm, devices=devices,
        devices_per_node=g, nodes=topo.nodes, global_batch=gb, per_device_batch=b,
        forward_flops_per_image=main["forward_flops"], params=cost.params, gradient_bytes=grad_bytes,
        buckets=len(sizes), compute_time_s=t_c, forward_time_s=t_c / 3.0, backward_time_s=2.0 * t_c / 3.0,
        comm_time_s=main["comm_time_s"], exposed_comm_s=exposed, step_time_s=step, images_per_s=gb / step,
        images_per_s_per_device=b / step, scaling_efficiency=t_c / (t_c + exposed),        # 6.
        scaling_efficiency_node=main["node_busy_s"] / (t_c + exposed),
        mfu=3.0 * main["forward_flops"] * gb / step / (devices * dev.peak_flops),
        steps_per_epoch=max(dataset_size // gb, 1), epochs=epochs, eval_time_s=eval_total, time_to_train_s=ttt,
        device_hours=hours, cost_usd=None if price_per_device_hour is None else hours * price_per_device_hour,
        hardware_usd=None if price is None else devices * float(price), stack=stack, torus_grid=grid,
        notes=notes, stack_reason=reason, data_time_s=main["data_time_s"],
        compute_total_s=sum(r["steps"] * r["compute_time_s"] for r in rows),
        exposed_comm_total_s=sum(r["steps"] * r["exposed_comm_s"] for r in rows),
        data_total_s=sum(r["steps"] * r["data_time_s"] for r in rows), image_size=main["image_size"],
        micro_batch=main["micro_batch"], accumulation=main["accumulation"], memory=memory_note,
        phases=[{k: v for k, v in r.items() if k != "node_busy_s"} for r in rows] if len(rows) > 1 else [])
