"""The config's schema: one dataclass per recipe section, each key a documented field with its default and, for a
number, its bounds (`fields.py`); the entries of a list key (a phase) as `Item`s; `Config`, the whole.

Each section's `validate()` checks its fields' bounds, then what bounds alone cannot say (a model name, keys that
exclude each other); the checks that span sections are `checks.py`'s, the reading of a recipe `loading.py`'s.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from largebatch.comm.options import ALLREDUCE, HOOK_ONLY, OPTIONS
from largebatch.config.fields import SAYS_IN_BOUNDS, Item, Section, _choices, _doc, _is_number, _required, _suggest
from largebatch.errors import UserError
from largebatch.schedule import in_start_order

# Upper bounds used by more than one key (or by a command's flag): sizes beyond them are mistakes (a misplaced
# exponent), not experiments.
MAX_CYCLES = 1000              # ensemble.cycles, and the length of ensemble.segments
MAX_EPOCHS = 1_000_000         # schedule.epochs, ensemble.cycle_epochs
MAX_LR = 10_000.0              # optim.lr (per reference_batch) and a batch phase's lr; the papers' largest is below 100
THREADS_PER_CORE = 8           # train.threads, per core of this host (64 at least)


def check_threads(name: str, threads: Optional[int], unit: str = "", alternative: str = "") -> None:
    """Intra-op threads a user gave (`name`: the setting or flag; None: the default): 1 or more, and at most
    `THREADS_PER_CORE` per core of this host (64 at least), like --nproc-per-node (launch.check_worker_count);
    torch.set_num_threads(100000) crashed the process (a segfault)."""
    if threads is None:
        return
    cores = os.cpu_count() or 1
    most = max(64, THREADS_PER_CORE * cores)
    if threads < 1:
        raise UserError(f"{name} is {threads}; give 1 or more.")
    if threads > most:
        raise UserError(f"{name} is {threads}; this host has {cores} cores, so give at most {most} threads{unit} "
                        f"({THREADS_PER_CORE} per core, 64 at least){alternative}.")


@dataclass
class ModelConfig(Section):
    prefix = "model"
    name: str = _doc("resnet18", "architecture from largebatch.models.MODELS, or a model from elsewhere: timm:NAME, "
                                 "torchvision:NAME, or package.module:factory (called with num_classes; "
                                 "largebatch/models/external.py)")
    stem: str = _choices("auto", "imagenet", "small",
                         doc="ImageNet 7x7/2 stem + max-pool, a 3x3/1 stem for 28-32 px images, "
                             "or auto (small when data.image_size <= 64)")
    zero_init_residual: bool = _doc(True, "zero-init the last BN gamma of each residual block (Goyal)")
    width: int = _doc(64, "channels of the first stage (64 for the standard ResNets)", bounds="> 0")
    bn_batch: Optional[int] = _doc(None, "BatchNorm statistics over groups of this many images of each forward "
                                         "batch (ghost BN; Goyal et al.: 32; null: the whole forward batch; "
                                         "largebatch/models/ghost_bn.py)", bounds="> 0")

    def validate(self) -> None:
        super().validate()
        from largebatch.models import MODELS, check_model_name, external

        if external.is_external(self.name):   # model.width and model.stem do not apply (the run says so)
            check_model_name(self.name, "model.name")
        elif self.name not in MODELS:
            raise UserError(f"model.name is {self.name!r}{_suggest(self.name, list(MODELS))}; "
                            f"valid models: {', '.join(MODELS)}, or timm:NAME, torchvision:NAME, "
                            "package.module:factory.")


def _start_epoch(doc: str, says: str) -> Any:
    """A phase's start_epoch, the one rule phases share: 0 or later (and each its own: schedule.in_start_order)."""
    return _required(doc, bounds=">= 0", says=says)


@dataclass
class ResolutionPhase(Item):
    """Progressive resizing: from `start_epoch` on, training batches are resized to `image_size`."""

    start_epoch: float = _start_epoch("epoch (fractional allowed) from which this size applies",
                                      "{key} is {value:g}; give a number {bounds}.")
    image_size: int = _required("training image size in pixels from start_epoch on", bounds=">= 4",
                                says="{key} is {value!r}; give an integer of at least {low} pixels.")


@dataclass
class BatchPhase(Item):
    """Batch-size control (Sony): from `start_epoch` on, `global_batch` images per step, at peak lr `lr`."""

    start_epoch: int = _start_epoch("whole epoch this phase starts at (the first phase starts at 0)",
                                    "{key} is {value!r}; give a whole number of epochs {bounds}.")
    global_batch: int = _required("images per optimizer step across all workers in this phase", bounds="> 0",
                                  says="{key} is {value!r}; give a positive integer.")
    lr: Optional[float] = _doc(None, "peak lr of this phase (null: optim.lr scaled to global_batch by "
                                     "optim.scaling_rule)", bounds=f"(0, {MAX_LR:g}]",
                               says="{key} is {value!r}; give a positive number of at most {high:,.0f}, or leave it out.")


REWARM_SAYS = "{key} is {value!r}; give 0 or more epochs, fewer than the segment's {epochs}."


@dataclass
class EnsembleSegment(Item):
    """Collapsed Ensemble on a schedule of its own (`ensemble.segments`, after the base run): a segment that
    re-warms and decays, or a collapse."""

    epochs: float = _required("length of this segment in epochs", bounds="> 0",
                              says="{key} is {value!r}; give a positive number of epochs.")
    collapse: bool = _doc(False, "a collapse: augmentation off, weight decay x ensemble.collapse_wd_factor, lr poly-2 "
                                 "from where the previous segment ended to zero, then a snapshot")
    peak_factor: float = _doc(1.0, "a segment's peak lr as a fraction of the base run's peak lr", bounds="(0, 100]",
                              says="{key} is {value!r}; give a fraction of the base peak lr in {bounds}.")
    rewarm_epochs: float = _doc(0.0, "linear re-warm-up from where the previous segment ended to the peak",
                                bounds=">= 0", says=REWARM_SAYS)
    end_factor: float = _doc(0.0, "lr at the segment's end as a fraction of its peak (poly-2 decay over a horizon "
                                  "that ends there: 0 decays to zero, 0.25 stops half-way)", bounds="[0, 1)",
                             says="{key} is {value!r}; give a fraction in {bounds}.")

    def validate(self, where: str) -> None:
        super().validate(where)
        if self.rewarm_epochs >= self.epochs:   # the upper end of its bounds is the segment's own length
            raise UserError(REWARM_SAYS.format(key=f"{where}.rewarm_epochs", value=self.rewarm_epochs,
                                               epochs=self.epochs))


@dataclass
class DataConfig(Section):
    prefix = "data"
    dataset: str = _choices("fashion_mnist", "idx", "imagefolder", "shards", "synthetic", "webdataset",
                            doc="data source (webdataset: tar shards as published, largebatch/data/wds.py)")
    root: str = _doc("/usr/share/datasets/fashion-mnist",
                     "directory of the IDX files, of train/ and val/ class folders, or of tar shards; webdataset: "
                     "a directory of shards or a brace pattern of the training shards (train-{000000..001023}.tar)")
    val_root: Optional[str] = _doc(None, "webdataset: the evaluation shards, a directory or brace pattern (null: the "
                                         "shards named *val* in data.root's directory, or its val/ folder)")
    val_labels: Optional[str] = _doc(None, "imagefolder: the label file of a flat val/ folder (ImageNet's layout; "
                                           "null: LOC_val_solution.csv in data.root or up to 3 folders above)")
    image_size: int = _doc(28, "training crop size in pixels (evaluation resizes to size/0.875 then centre-crops for "
                               "ImageFolder)", bounds="> 0")
    augment: bool = _doc(True, "random crop + horizontal flip for training (off during a collapse phase)")
    crop_padding: int = _doc(2, "padding of the random crop for in-memory small images", bounds=">= 0")
    min_scale: float = _doc(0.08, "smallest area fraction of random-resized-crop (ImageFolder)", bounds="(0, 1]",
                            says=SAYS_IN_BOUNDS)
    loader_workers: int = _doc(2, "decoding processes per rank for JPEG sources (0 = in the training process)",
                               bounds=">= 0")
    on_corrupt: str = _choices("skip", "fail", doc="a corrupt or truncated JPEG is skipped and listed, or fails the run")
    decode: str = _choices("auto", "cpu", "gpu", doc="where JPEGs are decoded and cropped (auto: cpu until a GPU check "
                                                     "has verified GPU decoding, saying so on CUDA; gpu: on the GPU "
                                                     "with nvImageCodec or torchvision; largebatch/data/gpu_jpeg.py)")
    gpu_decoder: str = _choices("auto", "nvimgcodec", "torchvision",
                                doc="data.decode gpu: nvImageCodec decodes only the crop window, on the hardware "
                                    "JPEG decoder where there is one; torchvision decodes whole images with nvJPEG; "
                                    "auto: nvImageCodec where it loads")
    gpu_cache_gb: float = _doc(0.0, "data.decode gpu: keep decoded images in this much GPU memory (0 = off): one budget "
                               "for training and evaluation images, taken from the micro-batch's memory",
                               bounds="[0, 4096]", says="{key} is {value}; give {low} (off) to {high} GiB.")
    num_classes: int = _doc(10, "classes of the synthetic source, and of webdataset shards (labels 0..num_classes-1)",
                            bounds="[2, 1000000]", says="{key} is {value}; a classifier needs {low} or more classes.",
                            above="{key} is {value}; give at most {high:,} classes (the classifier head is "
                                  "num_classes x features weights).")
    synthetic_size: int = _doc(4096, "images per epoch of the synthetic source", bounds="> 0")
    train_size: Optional[int] = _doc(None, "training images, for --dry-run without the data (null = read from the "
                                           "data)", bounds="> 0")
    subset: Optional[int] = _doc(None, "train on a fixed random subset of this many training images (null = all)",
                                 bounds="> 0")
    val_split: Optional[int] = _doc(None, "hold out this many training images as a validation set (a fixed seeded "
                                          "choice, the same for every train.seed); evaluation then runs on it, "
                                          "never on the test set; null = off", bounds="> 0")
    resolution_phases: list[ResolutionPhase] = _doc(
        [], "progressive resizing: list of {start_epoch, image_size}; training batches are resized (antialiased) "
            "to image_size from start_epoch on, evaluation stays at the data's own size; empty means no resizing")

    def validate(self) -> None:
        super().validate()
        if self.dataset in ("shards", "webdataset"):
            for key in ("val_split", "subset"):
                if getattr(self, key) is not None:
                    raise UserError(f"data.{key} picks images by index, which a shard source streams in shard order "
                                    f"and cannot do (the held-out images would be trained on); remove data.{key} "
                                    "and give the validation images as shards of their own, or use "
                                    "data.dataset imagefolder.")
        if self.decode == "gpu" and self.dataset != "imagefolder":
            raise UserError(f"data.decode gpu decodes JPEG folders (data.dataset imagefolder), not {self.dataset}; "
                            "set data.decode to cpu or auto.")
        if self.val_labels is not None and self.dataset != "imagefolder":
            raise UserError(f"data.val_labels labels a flat ImageFolder val/ and data.dataset is {self.dataset}; "
                            "remove data.val_labels or set data.dataset to imagefolder.")
        if self.val_root is not None and self.dataset != "webdataset":
            raise UserError(f"data.val_root names webdataset evaluation shards and data.dataset is {self.dataset}; "
                            "remove data.val_root or set data.dataset to webdataset.")
        in_start_order(self.resolution_phases, "data.resolution_phases")


@dataclass
class BatchConfig(Section):
    prefix = "batch"
    global_batch: int = _doc(256, "images per optimizer step across all workers; with batch.phases it is theirs "
                                  "(the first phase's) and giving it too is an error", bounds="> 0")
    micro_batch: Optional[int] = _doc("auto", "largest per-worker forward batch, accumulation derived from it; auto: "
                                              "the largest that fits the device's memory (largebatch/memory.py); "
                                              "null: the whole per-worker batch in one pass", words=("auto",),
                                     bounds="> 0")
    accumulation: Optional[int] = _doc(None, "gradient-accumulation steps (derived when unset; with a number for "
                                             "batch.micro_batch too, the two must make the per-worker batch)",
                                     bounds="> 0")
    phases: list[BatchPhase] = _doc([], "batch-size control: list of {start_epoch, global_batch, lr (optional peak "
                                        "lr)} starting at epoch 0; empty means global_batch for the whole run")

    def validate(self) -> None:
        super().validate()
        in_start_order(self.phases, "batch.phases")


@dataclass
class OptimConfig(Section):
    prefix = "optim"
    name: str = _choices("sgd", "lars", "lamb", doc="optimizer")
    lr: float = _doc(0.1, "learning rate per reference_batch images; scaled to the global batch by scaling_rule",
                     bounds=f"(0, {MAX_LR:g}]",
                     above="{key} is {value:g}; give a learning rate per optim.reference_batch images of at most "
                           "{high:,.0f} (typical: 0.1 for SGD, 1-30 for LARS, 0.001-0.01 for LAMB).")
    reference_batch: int = _doc(256, "batch size that lr is given for", bounds="> 0")
    scaling_rule: str = _choices("linear", "sqrt", "none", doc="how the peak lr grows with the global batch")
    momentum: float = _doc(0.9, "momentum", bounds="[0, 1)", says=SAYS_IN_BOUNDS)
    nesterov: bool = _doc(False, "Nesterov momentum")
    weight_decay: float = _doc(5e-5, "L2 weight decay on weights (not on BN or biases when no_decay_bn_bias)",
                               bounds="[0, 1)", above="{key} is {value}; give a value in {bounds} (typical: 5e-5 to "
                                                     "5e-4; 0.01 for LAMB).")
    no_decay_bn_bias: bool = _doc(True, "parameters with ndim <= 1 (BN, biases) get no weight decay and no "
                                        "LARS/LAMB adaptation")
    trust_coefficient: float = _doc(0.001, "LARS eta", bounds="> 0")
    lars_eps: float = _doc(0.0, "LARS: added to the denominator of the trust ratio", bounds=">= 0")
    lamb_eps: float = _doc(1e-6, "LAMB: Adam's epsilon, added to the root of the second moment (> 0)", bounds="> 0")
    betas: list = _doc([0.9, 0.999], "LAMB moment coefficients")

    def validate(self) -> None:
        super().validate()   # optim.lr's upper bound: 1e300 planned a peak lr of 2e300, inf at larger batches
        if len(self.betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in self.betas):
            raise UserError(f"optim.betas is {self.betas}; give two numbers in [0, 1), e.g. [0.9, 0.999].")


@dataclass
class ScheduleConfig(Section):
    prefix = "schedule"
    epochs: float = _doc(10.0, "training epochs", bounds=f"(0, {MAX_EPOCHS}]",   # 1e300 planned an endless run
                         above="{key} is {value:g}; give at most {high:,} epochs.")
    warmup_epochs: float = _doc(2.0, "gradual linear warm-up (per step) from warmup_start_lr to the peak lr",
                                bounds=">= 0")
    warmup_start_lr: Optional[float] = _doc(None, "lr at step 0; default optim.lr, the unscaled lr (Goyal), or the "
                                                 "peak lr where that is lower (a batch below reference_batch)",
                                            bounds=">= 0")
    decay: str = _choices("cosine", "step", "poly", "constant", doc="decay after warm-up")
    milestones: list = _doc([30, 60, 80], "epochs at which step decay multiplies the lr by gamma")
    gamma: float = _doc(0.1, "step decay factor", bounds="(0, 1]",
                        above="{key} is {value}; step decay multiplies the lr by gamma at each milestone, so give a "
                              "factor in {bounds}, e.g. 0.1.")
    power: float = _doc(2.0, "poly decay power (LARS uses 2)", bounds="> 0")
    end_lr: float = _doc(0.0, "lr at the end of poly/cosine decay (at most the peak lr)", bounds=">= 0")
    decay_epochs: Optional[float] = _doc(None, "the epoch poly/cosine decay would reach end_lr at, when training stops "
                                               "earlier (null: schedule.epochs); e.g. a 60-epoch horizon stopped "
                                               "at 25", bounds=">= 0")

    def validate(self) -> None:
        super().validate()
        if self.decay_epochs is not None and not self.warmup_epochs < self.decay_epochs:
            raise UserError(f"schedule.decay_epochs ({self.decay_epochs}) must be after the warm-up "
                            f"({self.warmup_epochs} epochs); give a later horizon or null.")
        if self.warmup_epochs > self.epochs:
            raise UserError(f"schedule.warmup_epochs ({self.warmup_epochs}) is longer than schedule.epochs "
                            f"({self.epochs}); shorten the warm-up or train longer.")
        bad = [m for m in self.milestones if not _is_number(m) or m < 0]
        if bad:
            raise UserError(f"schedule.milestones has {bad[0]!r}; give a list of epochs >= 0, e.g. [30, 60, 80].")


@dataclass
class TrainConfig(Section):
    prefix = "train"
    seed: int = _doc(0, "seed of data order, augmentation and initialisation", bounds=">= 0")
    device: str = _choices("auto", "cpu", "cuda", doc="auto: cuda when available")
    precision: str = _choices("fp32", "bf16", "fp16", doc="autocast precision; fp16 uses dynamic loss scaling (CUDA; "
                                                          "without CUDA fp16 trains as bf16, said in one line)")
    channels_last: str = _choices("auto", "on", "off", doc="NHWC memory format (auto: on for CUDA and bf16 CPU)")
    compile: bool = _doc(False, "torch.compile the model (Inductor fuses BN's and ReLU's elementwise work)")
    compile_mode: str = _choices("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune",
                                 doc="torch.compile's mode; the last two capture CUDA graphs of their own, so "
                                     "train.cuda_graph stays off with them")
    cuda_graph: str = _choices("auto", "on", "off",
                               doc="replay each training step as one CUDA graph (on: one CUDA process without "
                                   "train.noise_scale; auto: eager until a GPU check has verified the graph, "
                                   "saying so in one line on CUDA; largebatch/graph.py)")
    threads: Optional[int] = _doc(None, "intra-op threads per worker (default cores / local workers)",
                                  bounds="> 0")   # and at most THREADS_PER_CORE per core: check_threads
    device_memory_gb: Optional[float] = _doc(None, "memory per worker's device in GiB for batch.micro_batch auto "
                                                   "(null: the CUDA device's total, or the CPU's available memory / "
                                                   "local workers); set it to plan a GPU from another machine",
                                             bounds="> 0")
    label_smoothing: float = _doc(0.0, "label smoothing of the cross-entropy", bounds="[0, 1)", says=SAYS_IN_BOUNDS)
    log_every: int = _doc(50, "steps between metric lines (the only steps with host syncs)", bounds="> 0")
    eval_every: int = _doc(1, "epochs between evaluations (0 = only at the end)", bounds=">= 0")
    eval_flip: bool = _doc(False, "test-time augmentation: average logits over the image and its mirror")
    ema: Optional[float] = _doc(None, "decay of an exponential moving average of weights used for evaluation",
                                bounds="(0, 1)", says="{key} is {value}; it must be in {bounds} or null.")
    checkpoint_every: int = _doc(0, "steps between checkpoints (0 = only every epoch and at the end)", bounds=">= 0")
    keep_checkpoints: int = _doc(3, "checkpoints kept on disk (the newest ones)", bounds="> 0")
    max_steps: Optional[int] = _doc(None, "stop after this many steps (tests, benchmarks)", bounds="> 0")
    tensorboard: bool = _doc(False, "also write TensorBoard event files (pip install -e .[tensorboard])")
    plots: bool = _doc(True, "write PNG plots of the metrics at the end")
    max_nonfinite: int = _doc(20, "abort after this many consecutive steps with non-finite loss or gradients",
                              bounds=">= 0")
    deterministic: bool = _doc(False, "deterministic kernels (bitwise resume on CPU is the default anyway)")
    noise_scale: bool = _doc(False, "log the gradient noise scale B_simple (McCandlish et al.) on logging steps; "
                                    "needs 2+ workers; those steps average gradients with a plain all-reduce")

    def validate(self) -> None:
        super().validate()
        check_threads("train.threads", self.threads, " per worker", ", or null for cores / local workers")
        if self.compile_mode != "default" and not self.compile:
            raise UserError(f"train.compile_mode is {self.compile_mode} but train.compile is false; set train.compile "
                            "true, or remove train.compile_mode.")


@dataclass
class CommConfig(Section):
    prefix = "comm"
    algorithm: str = _choices(*ALLREDUCE, *HOOK_ONLY,
                              doc="all-reduce of gradient buckets (noop: no communication, for measurement only)")
    compression: str = _choices("none", "fp16", "bf16", doc="wire format of gradients")
    bucket_mb: float = _doc(25.0, "DDP bucket size in MB (tensor fusion)", bounds="> 0")
    # The algorithm options: documented once, in largebatch.comm.options.OPTIONS (a test holds these are its keys)
    grid: Optional[str] = _doc(None, OPTIONS["grid"].doc)
    pipeline: Optional[int] = _doc(None, OPTIONS["pipeline"].doc, bounds="> 0")
    impl: Optional[str] = _doc(None, OPTIONS["impl"].doc)
    local_size: Optional[int] = _doc(None, OPTIONS["local_size"].doc, bounds="> 0")
    inter: Optional[str] = _doc(None, OPTIONS["inter"].doc)
    small_bytes: Optional[int] = _doc(None, OPTIONS["small_bytes"].doc, bounds=">= 0")
    timeout_s: float = _doc(600.0, "collective timeout in seconds (1 to a week); when it fires the error names the "
                                    "missing ranks", bounds="[1, 604800]", sign="> 0",
                            says="{key} is {value:g}; give {low:g} to {high:g} seconds (a week; default 600), since "
                                 "no collective completes in under a second.")

    def validate(self) -> None:
        """The comm hook's own validation (`comm.hook.check_options`, the one place), so that a run of any world
        size, and --dry-run, refuses an option the algorithm does not read; the layout that needs the world size
        waits."""
        super().validate()
        from largebatch.comm.hook import check_options

        check_options(self.algorithm, self.compression, {name: getattr(self, name) for name in OPTIONS}, "comm.")


@dataclass
class EnsembleConfig(Section):
    prefix = "ensemble"
    # checked before the plan, which builds a segment per cycle (and 1e300 cycle epochs lost the collapse to rounding)
    cycles: int = _doc(0, "Collapsed Ensemble: cycles after the base schedule (0 = off)", bounds=f"[0, {MAX_CYCLES}]",
                       above="{key} is {value}; give at most {high} cycles (0 = off).")
    cycle_epochs: float = _doc(2.0, "epochs of one cycle: re-warm-up then poly-2 decay", bounds=f"(0, {MAX_EPOCHS}]",
                               above="{key} is {value:g}; give at most {high:,} epochs.")
    rewarm_epochs: float = _doc(0.5, "re-warm-up epochs at the start of each cycle", bounds=">= 0")
    cycle_lr_factor: float = _doc(0.5, "peak lr of a cycle relative to the base peak lr", bounds="> 0")
    collapse_epochs: float = _doc(1.0, "collapse: augmentation off, weight decay x factor, lr poly-2 to zero",
                                  bounds=">= 0")
    collapse_wd_factor: float = _doc(2.0, "weight-decay multiplier during a collapse", bounds="> 0")
    swa: bool = _doc(False, "also report the weight average of the snapshots (BN statistics recomputed)")
    segments: list[EnsembleSegment] = _doc([], "instead of cycles: segments of their own lengths, peaks and "
                                               "re-warm-ups after the base run, and collapses only where given "
                                               "(the authors' released schedules); the base run then ends without "
                                               "a collapse")

    def validate(self) -> None:
        super().validate()
        if self.segments and self.cycles:
            raise UserError(f"ensemble.segments and ensemble.cycles ({self.cycles}) both describe what follows the base "
                            "run; give one of them (set ensemble.cycles to 0 with segments).")
        if self.segments and not any(seg.collapse for seg in self.segments):
            raise UserError("ensemble.segments has no collapse, so the run would take no snapshot; end it with a "
                            "segment with collapse: true.")
        if len(self.segments) > MAX_CYCLES:
            raise UserError(f"ensemble.segments has {len(self.segments)} segments; give at most {MAX_CYCLES}.")


SECTIONS: dict[str, type[Section]] = {cls.prefix: cls for cls in (
    ModelConfig, DataConfig, BatchConfig, OptimConfig, ScheduleConfig, TrainConfig, CommConfig, EnsembleConfig)}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    ensemble: EnsembleConfig = field(default_factory=EnsembleConfig)
    recipe: str = "custom"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Stable hash of the resolved config (compared across ranks at start-up)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

