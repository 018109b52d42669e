"""Typed configuration: one dataclass per section, YAML recipes, `--set` overrides.

A recipe is a YAML mapping of sections (``model``, ``data``, ``batch``, ``optim``,
``schedule``, ``train``, ``comm``, ``ensemble``) to keys. Every key is a documented
dataclass field; an unknown section or key is an error that names itself and the
valid ones, so a recipe never sets a key that nobody reads. Builders receive only
their own section (``build_optimizer(cfg.optim, model)``), never the whole config.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from largebatch import safeyaml
from largebatch.algorithms import ALLREDUCE, HOOK_ONLY, OPTIONS
from largebatch.errors import UserError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def _choices(*values: str, doc: str) -> Any:
    return field(default=values[0], metadata={"choices": values, "doc": doc})


def _required(doc: str, **meta: Any) -> Any:
    """A field of a list entry (`Item`) that the recipe must give: no default."""
    return field(metadata={"doc": doc, "required": True, **meta})


def _doc(default: Any, doc: str, **meta: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: json.loads(json.dumps(default)), metadata={"doc": doc, **meta})
    return field(default=default, metadata={"doc": doc, **meta})


class Section:
    """A config section. `validate()`: the range checks that types alone cannot express, world-size-free (the
    batch arithmetic that needs the world size is `schedule.Plan`'s); each error names the key and the fix."""

    def __post_init__(self) -> None:
        """Entries of a list key given as mappings (``BatchConfig(phases=[{...}])`` from code) become their typed
        `Item`s, through the same strict loader as a recipe."""
        name = next((n for n, cls in SECTIONS.items() if cls is type(self)), type(self).__name__)
        for key, cls in _item_types(type(self)).items():
            value = getattr(self, key)
            if isinstance(value, list) and not all(isinstance(v, cls) for v in value):
                setattr(self, key, [_item_from_dict(f"{name}.{key}[{i}]", cls, v) for i, v in enumerate(value)])

    def validate(self) -> None:
        name = next(n for n, cls in SECTIONS.items() if cls is type(self))
        for key in POSITIVE + NON_NEGATIVE:   # None means "not set" and passes
            section, field_name = key.split(".")
            if section == name:
                _check_sign(key, getattr(self, field_name), allow_zero=key in NON_NEGATIVE)
        for key in _item_types(type(self)):   # the entries of a list key (phases) check themselves
            for i, item in enumerate(getattr(self, key)):
                item.validate(f"{name}.{key}[{i}]")


@dataclass
class ModelConfig(Section):
    name: str = _doc("resnet18", "architecture from largebatch.models.MODELS, or a model from elsewhere: timm:NAME, "
                                 "torchvision:NAME, or package.module:factory (called with num_classes; "
                                 "largebatch/models/external.py)")
    stem: str = _choices("auto", "imagenet", "small",
                         doc="ImageNet 7x7/2 stem + max-pool, a 3x3/1 stem for 28-32 px images, "
                             "or auto (small when data.image_size <= 64)")
    zero_init_residual: bool = _doc(True, "zero-init the last BN gamma of each residual block (Goyal)")
    width: int = _doc(64, "channels of the first stage (64 for the standard ResNets)")
    bn_batch: Optional[int] = _doc(None, "BatchNorm statistics over groups of this many images of each forward "
                                         "batch (ghost BN; Goyal et al.: 32; null: the whole forward batch; "
                                         "largebatch/models/ghost_bn.py)")

    def validate(self) -> None:
        super().validate()
        from largebatch.models import MODELS, check_model_name, external

        if external.is_external(self.name):   # model.width and model.stem do not apply (the run says so)
            check_model_name(self.name, "model.name")
        elif self.name not in MODELS:
            raise UserError(f"model.name is {self.name!r}{_suggest(self.name, list(MODELS))}; "
                            f"valid models: {', '.join(MODELS)}, or timm:NAME, torchvision:NAME, "
                            "package.module:factory.")


class Item:
    """An entry of a list key (a phase): a dataclass read by the same strict loader as a section, with its own
    checks. Fields whose metadata says ``required`` must be given."""

    def validate(self, where: str) -> None:
        """Range checks of this entry; `where` names it (``batch.phases[1]``)."""


@dataclass
class ResolutionPhase(Item):
    """Progressive resizing: from `start_epoch` on, training batches are resized to `image_size`."""

    start_epoch: float = _required("epoch (fractional allowed) from which this size applies", bounds=">= 0")
    image_size: int = _required("training image size in pixels from start_epoch on", bounds=">= 4")

    def validate(self, where: str) -> None:
        if self.start_epoch < 0:
            raise UserError(f"{where}.start_epoch is {self.start_epoch:g}; give a number >= 0.")
        if self.image_size < 4:
            raise UserError(f"{where}.image_size is {self.image_size!r}; give an integer of at least 4 pixels.")


@dataclass
class BatchPhase(Item):
    """Batch-size control (Sony): from `start_epoch` on, `global_batch` images per step, at peak lr `lr`."""

    start_epoch: int = _required("whole epoch this phase starts at (the first phase starts at 0)", bounds=">= 0")
    global_batch: int = _required("images per optimizer step across all workers in this phase", bounds="> 0")
    lr: Optional[float] = _doc(None, "peak lr of this phase (null: optim.lr scaled to global_batch by "
                                     "optim.scaling_rule)", bounds="(0, 10000]")

    def validate(self, where: str) -> None:
        if self.start_epoch < 0:
            raise UserError(f"{where}.start_epoch is {self.start_epoch!r}; give a whole number of epochs >= 0.")
        if self.global_batch <= 0:
            raise UserError(f"{where}.global_batch is {self.global_batch!r}; give a positive integer.")
        if self.lr is not None and not 0 < self.lr <= MAX_LR:
            raise UserError(f"{where}.lr is {self.lr!r}; give a positive number of at most {MAX_LR:,.0f}, or leave "
                            "it out.")


@dataclass
class EnsembleSegment(Item):
    """Collapsed Ensemble on a schedule of its own (`ensemble.segments`, after the base run): a segment that
    re-warms and decays, or a collapse."""

    epochs: float = _required("length of this segment in epochs", bounds="> 0")
    collapse: bool = _doc(False, "a collapse: augmentation off, weight decay x ensemble.collapse_wd_factor, lr poly-2 "
                                 "from where the previous segment ended to zero, then a snapshot")
    peak_factor: float = _doc(1.0, "a segment's peak lr as a fraction of the base run's peak lr", bounds="(0, 100]")
    rewarm_epochs: float = _doc(0.0, "linear re-warm-up from where the previous segment ended to the peak",
                                bounds=">= 0")
    end_factor: float = _doc(0.0, "lr at the segment's end as a fraction of its peak (poly-2 decay over a horizon "
                                  "that ends there: 0 decays to zero, 0.25 stops half-way)", bounds="[0, 1)")

    def validate(self, where: str) -> None:
        if not (_is_number(self.epochs) and self.epochs > 0):
            raise UserError(f"{where}.epochs is {self.epochs!r}; give a positive number of epochs.")
        if not 0 < self.peak_factor <= 100:
            raise UserError(f"{where}.peak_factor is {self.peak_factor!r}; give a fraction of the base peak lr in (0, 100].")
        if not 0 <= self.rewarm_epochs < self.epochs:
            raise UserError(f"{where}.rewarm_epochs is {self.rewarm_epochs!r}; give 0 or more epochs, fewer than the "
                            f"segment's {self.epochs}.")
        if not 0 <= self.end_factor < 1:
            raise UserError(f"{where}.end_factor is {self.end_factor!r}; give a fraction in [0, 1).")


@dataclass
class DataConfig(Section):
    dataset: str = _choices("fashion_mnist", "idx", "imagefolder", "shards", "synthetic", "webdataset",
                            doc="data source (webdataset: tar shards as published, largebatch/data/wds.py)")
    root: str = _doc("/usr/share/datasets/fashion-mnist",
                     "directory of the IDX files, of train/ and val/ class folders, or of tar shards; webdataset: "
                     "a directory of shards or a brace pattern of the training shards (train-{000000..001023}.tar)")
    val_root: Optional[str] = _doc(None, "webdataset: the evaluation shards, a directory or brace pattern (null: the "
                                         "shards named *val* in data.root's directory, or its val/ folder)")
    val_labels: Optional[str] = _doc(None, "imagefolder: the label file of a flat val/ folder (ImageNet's layout; "
                                           "null: LOC_val_solution.csv in data.root or up to 3 folders above)")
    image_size: int = _doc(28, "training crop size in pixels (evaluation resizes to size/0.875 then centre-crops for ImageFolder)")
    augment: bool = _doc(True, "random crop + horizontal flip for training (off during a collapse phase)")
    crop_padding: int = _doc(2, "padding of the random crop for in-memory small images")
    min_scale: float = _doc(0.08, "smallest area fraction of random-resized-crop (ImageFolder)", bounds="(0, 1]")
    loader_workers: int = _doc(2, "decoding processes per rank for JPEG sources (0 = in the training process)")
    on_corrupt: str = _choices("skip", "fail", doc="a corrupt or truncated JPEG is skipped and listed, or fails the run")
    decode: str = _choices("auto", "cpu", "gpu", doc="where JPEGs are decoded and cropped (auto: cpu until a GPU check "
                                                     "has verified GPU decoding, saying so on CUDA; gpu: on the GPU "
                                                     "with nvImageCodec or torchvision; largebatch/data/gpu_jpeg.py)")
    gpu_decoder: str = _choices("auto", "nvimgcodec", "torchvision",
                                doc="data.decode gpu: nvImageCodec decodes only the crop window, on the hardware "
                                    "JPEG decoder where there is one; torchvision decodes whole images with nvJPEG; "
                                    "auto: nvImageCodec where it loads")
    gpu_cache_gb: float = _doc(0.0, "data.decode gpu: keep decoded images in this much GPU memory (0 = off)",
                               bounds="[0, 4096]")
    num_classes: int = _doc(10, "classes of the synthetic source, and of webdataset shards (labels 0..num_classes-1)",
                            bounds="[2, 1000000]")
    synthetic_size: int = _doc(4096, "images per epoch of the synthetic source")
    train_size: Optional[int] = _doc(None, "training images, for --dry-run without the data (null = read from the data)")
    subset: Optional[int] = _doc(None, "train on a fixed random subset of this many training images (null = all)")
    val_split: Optional[int] = _doc(None, "hold out this many training images as a validation set (a fixed seeded "
                                          "choice, the same for every train.seed); evaluation then runs on it, "
                                          "never on the test set; null = off")
    resolution_phases: list[ResolutionPhase] = _doc(
        [], "progressive resizing: list of {start_epoch, image_size}; training batches are resized (antialiased) "
            "to image_size from start_epoch on, evaluation stays at the data's own size; empty means no resizing")

    def validate(self) -> None:
        super().validate()
        if not 0 < self.min_scale <= 1:
            raise UserError(f"data.min_scale is {self.min_scale}; it must be in (0, 1].")
        if self.num_classes < 2:
            raise UserError(f"data.num_classes is {self.num_classes}; a classifier needs 2 or more classes.")
        if not 0 <= self.gpu_cache_gb <= 4096:
            raise UserError(f"data.gpu_cache_gb is {self.gpu_cache_gb}; give 0 (off) to 4096 GiB.")
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
        if self.num_classes > MAX_CLASSES:
            raise UserError(f"data.num_classes is {self.num_classes}; give at most {MAX_CLASSES:,} classes "
                            "(the classifier head is num_classes x features weights).")
        _check_distinct_starts("data.resolution_phases", self.resolution_phases)


@dataclass
class BatchConfig(Section):
    global_batch: int = _doc(256, "images per optimizer step across all workers; with batch.phases it is theirs "
                                  "(the first phase's) and giving it too is an error")
    micro_batch: Optional[int] = _doc("auto", "largest per-worker forward batch, accumulation derived from it; auto: "
                                              "the largest that fits the device's memory (largebatch/memory.py); "
                                              "null: the whole per-worker batch in one pass", words=("auto",))
    accumulation: Optional[int] = _doc(None, "gradient-accumulation steps (derived when unset; with a number for "
                                             "batch.micro_batch too, the two must make the per-worker batch)")
    phases: list[BatchPhase] = _doc([], "batch-size control: list of {start_epoch, global_batch, lr (optional peak "
                                        "lr)} starting at epoch 0; empty means global_batch for the whole run")

    def validate(self) -> None:
        super().validate()
        _check_distinct_starts("batch.phases", self.phases)
        if self.phases:   # the batch the run starts with, for whoever reads batch.global_batch
            self.global_batch = min(self.phases, key=lambda p: p.start_epoch).global_batch


@dataclass
class OptimConfig(Section):
    name: str = _choices("sgd", "lars", "lamb", doc="optimizer")
    lr: float = _doc(0.1, "learning rate per reference_batch images; scaled to the global batch by scaling_rule",
                     bounds="(0, 10000]")
    reference_batch: int = _doc(256, "batch size that lr is given for")
    scaling_rule: str = _choices("linear", "sqrt", "none", doc="how the peak lr grows with the global batch")
    momentum: float = _doc(0.9, "momentum", bounds="[0, 1)")
    nesterov: bool = _doc(False, "Nesterov momentum")
    weight_decay: float = _doc(5e-5, "L2 weight decay on weights (not on BN or biases when no_decay_bn_bias)",
                               bounds="[0, 1)")
    no_decay_bn_bias: bool = _doc(True, "parameters with ndim <= 1 (BN, biases) get no weight decay and no LARS/LAMB adaptation")
    trust_coefficient: float = _doc(0.001, "LARS eta")
    lars_eps: float = _doc(0.0, "LARS: added to the denominator of the trust ratio")
    lamb_eps: float = _doc(1e-6, "LAMB: Adam's epsilon, added to the root of the second moment (> 0)")
    betas: list = _doc([0.9, 0.999], "LAMB moment coefficients")

    def validate(self) -> None:
        super().validate()
        if self.lr > MAX_LR:   # 1e300 planned a peak lr of 2e300, inf at larger batches
            raise UserError(f"optim.lr is {self.lr:g}; give a learning rate per optim.reference_batch images of at most "
                            f"{MAX_LR:,.0f} (typical: 0.1 for SGD, 1-30 for LARS, 0.001-0.01 for LAMB).")
        if not 0 <= self.momentum < 1:
            raise UserError(f"optim.momentum is {self.momentum}; it must be in [0, 1).")
        if self.weight_decay >= 1:
            raise UserError(f"optim.weight_decay is {self.weight_decay}; give a value in [0, 1) (typical: 5e-5 to 5e-4; "
                            "0.01 for LAMB).")
        if len(self.betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in self.betas):
            raise UserError(f"optim.betas is {self.betas}; give two numbers in [0, 1), e.g. [0.9, 0.999].")


@dataclass
class ScheduleConfig(Section):
    epochs: float = _doc(10.0, "training epochs", bounds="(0, 1000000]")
    warmup_epochs: float = _doc(2.0, "gradual linear warm-up (per step) from warmup_start_lr to the peak lr")
    warmup_start_lr: Optional[float] = _doc(None, "lr at step 0; default optim.lr, the unscaled lr (Goyal), or the "
                                                 "peak lr where that is lower (a batch below reference_batch)")
    decay: str = _choices("cosine", "step", "poly", "constant", doc="decay after warm-up")
    milestones: list = _doc([30, 60, 80], "epochs at which step decay multiplies the lr by gamma")
    gamma: float = _doc(0.1, "step decay factor", bounds="(0, 1]")
    power: float = _doc(2.0, "poly decay power (LARS uses 2)")
    end_lr: float = _doc(0.0, "lr at the end of poly/cosine decay (at most the peak lr)")
    decay_epochs: Optional[float] = _doc(None, "the epoch poly/cosine decay would reach end_lr at, when training stops "
                                               "earlier (null: schedule.epochs); e.g. a 60-epoch horizon stopped at 25")

    def validate(self) -> None:
        super().validate()
        if self.decay_epochs is not None and not self.warmup_epochs < self.decay_epochs:
            raise UserError(f"schedule.decay_epochs ({self.decay_epochs}) must be after the warm-up "
                            f"({self.warmup_epochs} epochs); give a later horizon or null.")
        if self.epochs > MAX_EPOCHS:   # 1e300 planned an endless run, the steps counted in float
            raise UserError(f"schedule.epochs is {self.epochs:g}; give at most {MAX_EPOCHS:,} epochs.")
        if self.warmup_epochs > self.epochs:
            raise UserError(f"schedule.warmup_epochs ({self.warmup_epochs}) is longer than schedule.epochs "
                            f"({self.epochs}); shorten the warm-up or train longer.")
        if self.gamma > 1:
            raise UserError(f"schedule.gamma is {self.gamma}; step decay multiplies the lr by gamma at each milestone, "
                            "so give a factor in (0, 1], e.g. 0.1.")
        bad = [m for m in self.milestones if not _is_number(m) or m < 0]
        if bad:
            raise UserError(f"schedule.milestones has {bad[0]!r}; give a list of epochs >= 0, e.g. [30, 60, 80].")


@dataclass
class TrainConfig(Section):
    seed: int = _doc(0, "seed of data order, augmentation and initialisation")
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
    threads: Optional[int] = _doc(None, "intra-op threads per worker (default cores / local workers)")
    device_memory_gb: Optional[float] = _doc(None, "memory per worker's device in GiB for batch.micro_batch auto "
                                                   "(null: the CUDA device's total, or the CPU's available memory / "
                                                   "local workers); set it to plan a GPU from another machine")
    label_smoothing: float = _doc(0.0, "label smoothing of the cross-entropy", bounds="[0, 1)")
    log_every: int = _doc(50, "steps between metric lines (the only steps with host syncs)")
    eval_every: int = _doc(1, "epochs between evaluations (0 = only at the end)")
    eval_flip: bool = _doc(False, "test-time augmentation: average logits over the image and its mirror")
    ema: Optional[float] = _doc(None, "decay of an exponential moving average of weights used for evaluation",
                                bounds="(0, 1)")
    checkpoint_every: int = _doc(0, "steps between checkpoints (0 = only every epoch and at the end)")
    keep_checkpoints: int = _doc(3, "checkpoints kept on disk (the newest ones)")
    max_steps: Optional[int] = _doc(None, "stop after this many steps (tests, benchmarks)")
    tensorboard: bool = _doc(False, "also write TensorBoard event files (pip install -e .[tensorboard])")
    plots: bool = _doc(True, "write PNG plots of the metrics at the end")
    max_nonfinite: int = _doc(20, "abort after this many consecutive steps with non-finite loss or gradients")
    deterministic: bool = _doc(False, "deterministic kernels (bitwise resume on CPU is the default anyway)")
    noise_scale: bool = _doc(False, "log the gradient noise scale B_simple (McCandlish et al.) on logging steps; "
                                    "needs 2+ workers; those steps average gradients with a plain all-reduce")

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.label_smoothing < 1:
            raise UserError(f"train.label_smoothing is {self.label_smoothing}; it must be in [0, 1).")
        if self.ema is not None and not 0 < self.ema < 1:
            raise UserError(f"train.ema is {self.ema}; it must be in (0, 1) or null.")
        check_threads("train.threads", self.threads, " per worker", ", or null for cores / local workers")
        if self.compile_mode != "default" and not self.compile:
            raise UserError(f"train.compile_mode is {self.compile_mode} but train.compile is false; set train.compile "
                            "true, or remove train.compile_mode.")


@dataclass
class CommConfig(Section):
    algorithm: str = _choices(*ALLREDUCE, *HOOK_ONLY,
                              doc="all-reduce of gradient buckets (noop: no communication, for measurement only)")
    compression: str = _choices("none", "fp16", "bf16", doc="wire format of gradients")
    bucket_mb: float = _doc(25.0, "DDP bucket size in MB (tensor fusion)")
    # The algorithm options: documented once, in largebatch.algorithms.OPTIONS (a test holds these are its keys)
    grid: Optional[str] = _doc(None, OPTIONS["grid"].doc)
    pipeline: Optional[int] = _doc(None, OPTIONS["pipeline"].doc)
    impl: Optional[str] = _doc(None, OPTIONS["impl"].doc)
    local_size: Optional[int] = _doc(None, OPTIONS["local_size"].doc)
    inter: Optional[str] = _doc(None, OPTIONS["inter"].doc)
    small_bytes: Optional[int] = _doc(None, OPTIONS["small_bytes"].doc)
    timeout_s: float = _doc(600.0, "collective timeout in seconds (1 to a week); when it fires the error names the "
                                    "missing ranks", bounds="[1, 604800]")

    def validate(self) -> None:
        """Also the checks the comm hook makes (`comm.dispatch.resolve`), so that a run of any world size, and
        --dry-run, refuses an option the algorithm does not read; the layout that needs the world size waits."""
        super().validate()
        if not MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S:
            raise UserError(f"comm.timeout_s is {self.timeout_s:g}; give {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} seconds "
                            "(a week; default 600), since no collective completes in under a second.")
        from largebatch.comm.dispatch import resolve
        from largebatch.comm.hook import check_hook

        options = {name: getattr(self, name) for name in OPTIONS}
        for key, value in options.items():
            if value is not None and self.algorithm not in OPTIONS[key].algorithms:
                raise UserError(f"comm.{key} is set but comm.algorithm {self.algorithm} does not use it; remove it, "
                                f"or choose an algorithm that does ({', '.join(OPTIONS[key].algorithms)}).")
        check_hook(resolve(self.algorithm, {"compression": self.compression, **options}, allow_noop=True), options,
                   "comm.")


@dataclass
class EnsembleConfig(Section):
    cycles: int = _doc(0, "Collapsed Ensemble: cycles after the base schedule (0 = off)", bounds="[0, 1000]")
    cycle_epochs: float = _doc(2.0, "epochs of one cycle: re-warm-up then poly-2 decay", bounds="(0, 1000000]")
    rewarm_epochs: float = _doc(0.5, "re-warm-up epochs at the start of each cycle")
    cycle_lr_factor: float = _doc(0.5, "peak lr of a cycle relative to the base peak lr")
    collapse_epochs: float = _doc(1.0, "collapse: augmentation off, weight decay x factor, lr poly-2 to zero")
    collapse_wd_factor: float = _doc(2.0, "weight-decay multiplier during a collapse")
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
        if self.cycles > MAX_CYCLES:   # before the plan, which builds a segment per cycle
            raise UserError(f"ensemble.cycles is {self.cycles}; give at most {MAX_CYCLES} cycles (0 = off).")
        if self.cycle_epochs > MAX_EPOCHS:   # 1e300 lost the collapse to rounding: "use longer cycles"
            raise UserError(f"ensemble.cycle_epochs is {self.cycle_epochs:g}; give at most {MAX_EPOCHS:,} epochs.")


SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "batch": BatchConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "train": TrainConfig,
    "comm": CommConfig,
    "ensemble": EnsembleConfig,
}


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


# ---------------------------------------------------------------------------
# Loading and validation


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_number(value: Any) -> bool:
    """A finite int or float (not a bool): what a numeric item of a list key must be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: Any) -> Any:
    """A whole number written as a float (1e3, 64.0) as the int it is, as for an int key; anything else as is."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])} or null"
    words = {int: "whole number", float: "number", str: "string", bool: "boolean (true or false)", list: "list",
             dict: "mapping"}
    return words.get(origin if origin in (list, dict) else tp, getattr(tp, "__name__", str(tp)))


def _coerce(where: str, value: Any, tp: Any, meta: dict) -> Any:
    """Check `value` against the field type `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if isinstance(value, str) and value in meta.get("words", ()):   # a word a number key also takes ("auto")
            return value
        return _coerce(where, value, args[0], meta)
    ok = True
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        given = value
        if isinstance(value, str):   # YAML 1.1 reads 1e4 as a string: take it as the whole number it is
            with contextlib.suppress(ValueError):
                number = float(value.strip())
                value = int(number) if number.is_integer() else value
        elif isinstance(value, float) and value.is_integer():   # 1.0e+4, 64.0: a whole number written as a float
            value = int(value)
        ok = _is_int(value)
        if ok and not -2**63 <= value < 2**63:   # no count, size or seed is larger; torch takes 64-bit integers
            raise UserError(f"{where} is {given}; give a number below 2**63.")
    elif tp is float:
        if isinstance(value, str):   # YAML 1.1 reads 1e-3 (no dot) as a string: take it as the number it is
            with contextlib.suppress(ValueError):
                value = float(value.strip())
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
        if ok and not math.isfinite(value):
            raise UserError(f"{where} is {value}; give a finite number.")
    elif tp is str:
        if isinstance(value, bool) and {"on", "off"} <= set(meta.get("choices", ())):
            value = "on" if value else "off"   # YAML 1.1 reads a bare on/off as a boolean
        ok = isinstance(value, str)
    elif tp is list or origin is list:
        ok = isinstance(value, list)
        item = (typing.get_args(tp) or (None,))[0]
        if ok and isinstance(item, type) and issubclass(item, Item):
            return [_item_from_dict(f"{where}[{i}]", item, entry) for i, entry in enumerate(value)]
    elif tp is dict or origin is dict:
        ok = isinstance(value, dict)
    if not ok:
        fix = "" if "[" in where else f" or with --set {where}=VALUE"   # an entry of a list key: the recipe's
        raise UserError(f"{where} must be a {_type_name(tp)}, got {value!r}; fix it in the recipe{fix}.")
    choices = meta.get("choices")
    if choices and value not in choices:
        raise UserError(f"{where} is {value!r}; valid values: {', '.join(choices)}.")
    return value


def _item_types(cls: type) -> dict[str, type]:
    """The list keys of a section whose entries are `Item`s: key -> entry type."""
    out = {}
    for key, tp in typing.get_type_hints(cls).items():
        args = typing.get_args(tp) if typing.get_origin(tp) is list else ()
        if args and isinstance(args[0], type) and issubclass(args[0], Item):
            out[key] = args[0]
    return out


def _item_from_dict(where: str, cls: type, data: Any) -> Any:
    """An entry of a list key (`Item`) from its mapping: the same strict rules as a section, plus required keys."""
    if isinstance(data, cls):
        return data
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = [name for name, f in fields.items() if f.metadata.get("required")]
    if not isinstance(data, dict):
        optional = [name for name in fields if name not in required]
        raise UserError(f"{where} must be a mapping with {' and '.join(required)}"
                        f"{' (and optionally ' + ', '.join(optional) + ')' if optional else ''}, got {data!r}.")
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise UserError(f"{where} has unknown keys {unknown}; valid: {', '.join(fields)}.")
    missing = [name for name in required if name not in data]
    if missing:
        raise UserError(f"{where} must give {' and '.join(required)}; it lacks {', '.join(missing)} ({data!r}).")
    hints = typing.get_type_hints(cls)
    item = cls(**{key: _coerce(f"{where}.{key}", value, hints[key], dict(fields[key].metadata))
                  for key, value in data.items()})
    item.validate(where)
    return item


def _section_from_dict(name: str, cls: type, data: Any) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"recipe section {name!r} must be a mapping of keys to values, got {data!r}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if f"{name}.{key}" in RENAMED:
            raise UserError(f"{name}.{key} is now {RENAMED[f'{name}.{key}']}; rename it in the recipe.")
        if key not in fields:
            raise UserError(f"unknown key {name}.{key}{_suggest(str(key), list(fields))}; "
                            f"valid keys of {name}: {', '.join(fields)}.")
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key], dict(fields[key].metadata))
    return cls(**kwargs)


def from_dict(data: dict, recipe: str = "custom", saved: bool = False) -> Config:
    """The validated Config of a recipe mapping; `saved`: a run's own config.yaml, whose keys from an older
    largebatch are read as the current ones (`RENAMED`)."""
    if not isinstance(data, dict):
        raise UserError(f"recipe {recipe!r} must be a YAML mapping of sections ({', '.join(SECTIONS)}).")
    data = _upgrade_saved(data) if saved else dict(data)
    check_one_batch(data, f"recipe {recipe!r}")
    data.pop("recipe", None)
    for name in data:
        if name not in SECTIONS:
            raise UserError(f"unknown recipe section {name!r}{_suggest(str(name), list(SECTIONS))}; "
                            f"valid sections: {', '.join(SECTIONS)}.")
    sections = {name: _section_from_dict(name, cls, data.get(name)) for name, cls in SECTIONS.items()}
    cfg = Config(**sections, recipe=recipe)
    validate(cfg)
    return cfg


@dataclass(frozen=True)
class KeyDoc:
    """One config key as `largebatch config` and docs/config.md show it, read from its dataclass field."""

    key: str          # section.key, or section.key[].field for an entry of a list key
    type: str
    default: str
    bounds: str       # choices, sign or range; "" when any value of the type goes
    doc: str


def _bounds(key: str, meta: Any) -> str:
    if meta.get("choices"):
        return ", ".join(meta["choices"])
    if meta.get("bounds"):
        return meta["bounds"]
    if key in POSITIVE:
        return "> 0"
    if key in NON_NEGATIVE:
        return ">= 0"
    return ""


def reference() -> list[KeyDoc]:
    """Every config key in section order, from the dataclasses (type, default, bounds, doc), the entries of a
    list key (a phase) after it: the one source of `largebatch config` and docs/config.md."""
    rows = []

    def add(prefix: str, cls: type, instance: Any) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}"
            default = None if f.metadata.get("required") else getattr(instance, f.name, f.default)
            shown_default = "required" if f.metadata.get("required") else shown(default) if default is not None else "null"
            item = _item_types(cls).get(f.name)
            type_name = f"list of {item.__name__}" if item else _type_name(hints[f.name])
            for word in f.metadata.get("words", ()):   # a word a number key also takes ("auto")
                type_name = type_name.replace(" or null", f", {word} or null")
            rows.append(KeyDoc(key, type_name, shown_default, _bounds(key, f.metadata), f.metadata.get("doc", "")))
            if item is not None:
                add(f"{key}[]", item, None)

    for name, cls in SECTIONS.items():
        add(name, cls, cls())
    return rows


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(recipe: str) -> Path:
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") or "/" in recipe:
        if path.is_dir():
            raise UserError(f"recipe {recipe} is a directory; give a YAML file or one of: {', '.join(list_recipes())}.")
        if not path.is_file():
            raise UserError(f"recipe file {recipe} does not exist; give a YAML path or one of: {', '.join(list_recipes())}.")
        return path
    path = RECIPES_DIR / f"{recipe}.yaml"
    if not path.is_file():
        raise UserError(f"no recipe named {recipe!r}{_suggest(recipe, list_recipes())}; "
                        f"available: {', '.join(list_recipes())}, or a path to a YAML file.")
    return path


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader (YAML 1.1) with YAML 1.2's floats: 1e-3, 1e4 and 2.5e300 are numbers, not the strings
    YAML 1.1 makes of an exponent without a dot or a sign, wherever they stand (a key, a list, a batch phase)."""


YamlLoader.add_implicit_resolver(   # copies the inherited resolvers first: yaml.SafeLoader is left as it is
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def load_yaml(path: Path, what: str = "recipe") -> dict:
    """A YAML mapping from `path`; every way it can be unreadable is one sentence naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{what} {path} is not a UTF-8 text file; give a YAML file.") from None
    except OSError as err:
        raise UserError(f"cannot read {what} {path}: {err.strerror}; check the path and its permissions.") from None
    try:
        data = safeyaml.load(text, YamlLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{what} {path} is not valid YAML{where}; fix the syntax there.") from None
    except safeyaml.TooLarge as err:
        raise UserError(f"{what} {path} expands to {err}; write the values out, or remove the nested "
                        "aliases.") from None
    if data is not None and not isinstance(data, dict):
        raise UserError(f"{what} {path} must be a YAML mapping of sections ({', '.join(SECTIONS)}), "
                        f"not a {type(data).__name__}.")
    return data or {}


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` strings; values are parsed as YAML (so 3, 0.1, true, [1, 2] work).
    batch.global_batch and batch.phases are two spellings of one setting, the batch: one given by an override
    replaces the other, as a later --set of one key replaces an earlier (a recipe file giving both is refused:
    `check_one_batch`)."""
    data = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise UserError(f"--set {item!r} is not of the form section.key=value (e.g. --set optim.lr=0.2).")
        dotted, raw = item.split("=", 1)
        section, key = dotted.split(".", 1)
        try:
            value = safeyaml.load(raw, YamlLoader) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        except safeyaml.TooLarge as err:
            raise UserError(f"--set {item.split('=', 1)[0]}: its value expands to {err}; write the value "
                            "out.") from None
        if section not in SECTIONS:
            raise UserError(f"--set {dotted}: unknown section {section!r}{_suggest(section, list(SECTIONS))}; "
                            f"valid sections: {', '.join(SECTIONS)}.")
        hints = typing.get_type_hints(SECTIONS[section])
        if hints.get(key) in (str, Optional[str]) and not isinstance(value, str) and value is not None:
            value = raw   # a string key keeps what was typed (e.g. model.name=101, comm.grid=0x4: not hex 4)
        data.setdefault(section, {})
        if data[section] is None:
            data[section] = {}
        data[section][key] = value
        if isinstance(data[section], dict) and (dotted == "batch.global_batch" or (dotted == "batch.phases" and value)):
            data[section].pop("phases" if key == "global_batch" else "global_batch", None)   # one setting: the batch
    return data


def load(recipe: str = "fashion_mnist", overrides: list[str] | None = None) -> Config:
    path = resolve_recipe(recipe)
    base = load_yaml(path)
    check_one_batch(base, f"recipe {path}")
    data = apply_overrides(base, overrides or [])
    name = path.stem if path.parent == RECIPES_DIR else str(path)
    return from_dict(data, recipe=name)


def check_one_batch(data: dict, where: str) -> None:
    """batch.global_batch beside a non-empty batch.phases would be ignored (each phase names its own batch): one
    sentence naming where both were given."""
    batch = data.get("batch")
    if isinstance(batch, dict) and "global_batch" in batch and batch.get("phases"):
        raise UserError(f"{where} gives both batch.global_batch and batch.phases; with phases each phase names its "
                        "global batch (the run starts with the first's), so remove batch.global_batch, or set "
                        "batch.phases to [] for one global batch throughout.")


# Keys a run's config.yaml may hold from an older largebatch, and what they became: `from_dict(saved=True)` reads
# them into the new keys (evaluate, resume); a recipe that uses one gets a sentence naming the new key.
RENAMED = {"optim.eps": "optim.lars_eps (LARS) or optim.lamb_eps (LAMB)"}


def _upgrade_saved(data: dict) -> dict:
    """A run's config.yaml as the current keys: optim.eps into the running optimizer's own eps, and
    batch.global_batch beside phases dropped (the run ignored it; the first phase's batch is its start)."""
    data = json.loads(json.dumps(data))
    optim, batch = data.get("optim"), data.get("batch")
    if isinstance(optim, dict) and "eps" in optim:
        eps = optim.pop("eps")
        if optim.get("name") == "lamb" and _is_number(eps) and eps > 0:
            optim["lamb_eps"] = eps
        elif optim.get("name") == "lars":
            optim["lars_eps"] = eps
    if isinstance(batch, dict) and batch.get("phases"):
        batch.pop("global_batch", None)
    return data


# Numeric keys checked by `validate`: > 0, and >= 0.
POSITIVE = ("model.width", "model.bn_batch", "data.image_size", "data.synthetic_size", "data.train_size", "data.subset", "data.val_split",
            "batch.global_batch", "batch.micro_batch", "batch.accumulation",
            "optim.lr", "optim.reference_batch", "optim.trust_coefficient", "optim.lamb_eps",
            "schedule.epochs", "schedule.gamma", "schedule.power",
            "train.threads", "train.device_memory_gb", "train.max_steps", "train.log_every", "train.keep_checkpoints",
            "comm.bucket_mb", "comm.timeout_s", "comm.pipeline", "comm.local_size",
            "ensemble.cycle_epochs", "ensemble.cycle_lr_factor", "ensemble.collapse_wd_factor")
NON_NEGATIVE = ("schedule.decay_epochs", "data.crop_padding", "data.loader_workers", "optim.weight_decay", "optim.lars_eps",
                "schedule.warmup_epochs", "schedule.warmup_start_lr", "schedule.end_lr",
                "train.seed", "train.eval_every", "train.checkpoint_every", "train.max_nonfinite", "comm.small_bytes",
                "ensemble.cycles", "ensemble.rewarm_epochs", "ensemble.collapse_epochs")


# Upper bounds of `validate`: sizes beyond them are mistakes (a misplaced exponent), not experiments.
MAX_CLASSES = 1_000_000        # data.num_classes
THREADS_PER_CORE = 8           # train.threads, per core of this host (64 at least)
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 7 * 24 * 3600.0   # comm.timeout_s
MAX_CYCLES = 1000              # ensemble.cycles
MAX_EPOCHS = 1_000_000         # schedule.epochs, ensemble.cycle_epochs
MAX_LR = 10_000.0              # optim.lr (per reference_batch) and a batch phase's lr; the papers' largest is below 100


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


def _check_distinct_starts(where: str, phases: list) -> None:
    """Phases take effect in start_epoch order (listed in any order); two with one start_epoch are ambiguous."""
    seen: dict[Any, int] = {}
    for i, phase in enumerate(phases):
        start = phase.start_epoch
        if start in seen:
            raise UserError(f"{where}[{i}].start_epoch is {start:g}, the same as {where}[{seen[start]}]'s; "
                            "phases need strictly increasing start epochs, so give each phase its own.")
        seen[start] = i


def _peak_lrs(cfg: "Config") -> tuple[list[float], str]:
    """The peak lr of each batch phase in start order (the phase's own lr, or optim.lr scaled to its global
    batch, as `schedule.Plan` makes them), and where it comes from without phases, for a message."""
    from largebatch.schedule import scaled_lr

    o = cfg.optim
    phases = sorted(cfg.batch.phases, key=lambda p: p.start_epoch) or [BatchPhase(0, cfg.batch.global_batch)]
    peaks = [p.lr if p.lr is not None else scaled_lr(o.lr, p.global_batch, o.reference_batch, o.scaling_rule)
             for p in phases]
    return peaks, f"optim.lr {o.lr:g} scaled to the global batch {cfg.batch.global_batch}"


def _check_end_lr(cfg: "Config") -> None:
    """schedule.end_lr is where poly/cosine decay ends: not above the peak lr of any batch phase, or the decay
    would raise it."""
    s = cfg.schedule
    if s.decay not in ("poly", "cosine"):
        return
    peaks, scaled = _peak_lrs(cfg)
    peak, which = min(peaks), "the smallest of batch.phases" if cfg.batch.phases else scaled
    if s.end_lr > peak:
        raise UserError(f"schedule.end_lr is {s.end_lr:g}, above the peak lr of {peak:g} ({which}), so the {s.decay} "
                        f"decay would raise the lr; give at most {peak:g} (0 decays to zero).")


def _check_warmup_start(cfg: "Config") -> None:
    """An explicit schedule.warmup_start_lr is where the gradual warm-up starts, climbing to the first batch
    phase's peak lr: not above it, or the warm-up would lower the lr (the default never starts above it)."""
    s = cfg.schedule
    if s.warmup_start_lr is None or s.warmup_epochs <= 0:
        return
    peaks, scaled = _peak_lrs(cfg)
    peak, which = peaks[0], "the first of batch.phases" if cfg.batch.phases else scaled
    if s.warmup_start_lr > peak:
        raise UserError(f"schedule.warmup_start_lr is {s.warmup_start_lr:g}, above the peak lr of {peak:g} ({which}), "
                        f"so the warm-up would lower the lr; give at most {peak:g}, or null for the default (the "
                        "unscaled lr, or the peak where that is lower).")


def _check_sign(where: str, value: float | str | None, allow_zero: bool = False) -> None:
    if value is None or isinstance(value, str):   # a word a number key takes ("auto")
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "positive"
        raise UserError(f"{where} is {value}; it must be {bound}.")


def validate(cfg: Config) -> None:
    """Every section's `validate()`, in the order of SECTIONS, then the checks that span sections."""
    for name in SECTIONS:
        getattr(cfg, name).validate()
    _check_end_lr(cfg)
    _check_warmup_start(cfg)


def save(cfg: Config, path: Path) -> None:
    """config.yaml of a run: whole or absent (a full disk leaves no empty file), never written through a symbolic
    link (`checkpoint.atomic_write`: O_NOFOLLOW); a recipe that trains the same run again."""
    from largebatch.checkpoint import atomic_write

    data = cfg.to_dict()
    if cfg.batch.phases:   # derived from the phases: a recipe gives one or the other (check_one_batch)
        data["batch"].pop("global_batch")
    atomic_write(path, yaml.safe_dump(data, sort_keys=False).encode())


# ---------------------------------------------------------------------------
# What a resume may change (docs/reliability.md, "What a resume may change")
#
# A resume continues one run. A key either says how the run is executed, logged and checkpointed, or how long it
# goes on (RESUMABLE: accepted, recorded in config.yaml and as a "resume" entry in metrics.jsonl, and said in one
# line), or it is part of what the run is (every other key: refused, unless named in `--allow-change`, then
# accepted and recorded the same way). Default-deny: a key added later is part of what the run is until it is
# listed here. The keys the run's steps and epochs are counted in (RESUME_NEVER) cannot change even so.

RESUMABLE = frozenset({
    "schedule.epochs",                  # more (or fewer) epochs: the decay is stretched from the resumed step on
    "batch.micro_batch", "batch.accumulation",   # the same global batch split otherwise, like another world size
    "data.loader_workers", "data.on_corrupt", "data.decode", "data.gpu_decoder", "data.gpu_cache_gb",
    "data.train_size",
    "train.device", "train.precision", "train.channels_last", "train.compile", "train.compile_mode",
    "train.cuda_graph", "train.threads", "train.device_memory_gb", "train.deterministic",
    "train.log_every", "train.eval_every", "train.eval_flip", "train.ema", "train.noise_scale",
    "train.checkpoint_every", "train.keep_checkpoints", "train.max_steps", "train.max_nonfinite",
    "train.tensorboard", "train.plots",
    "comm.bucket_mb", "comm.timeout_s", "comm.grid", "comm.pipeline", "comm.impl", "comm.local_size", "comm.inter",
    "comm.small_bytes",
    "ensemble.swa",
})
RESUME_NEVER = ("batch.global_batch", "batch.phases")


def _flat(data: Any) -> dict[str, Any]:
    """`section.key` -> value of a config mapping (a Config's `to_dict()` or a run's config.yaml)."""
    if not isinstance(data, dict):
        return {}
    return {f"{section}.{key}": value for section in SECTIONS if isinstance(data.get(section), dict)
            for key, value in data[section].items()}


def shown(value: Any) -> str:
    """A setting's value as a user would write it after --set (lists and mappings as YAML flow, i.e. JSON)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def resume_changes(old: dict, new: Config) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every key whose value differs from `old` (the config a checkpoint was written
    with); a key that `old` lacks (written by an older version) is not compared."""
    before, after = _flat(_upgrade_saved(old) if isinstance(old, dict) else old), _flat(new.to_dict())
    items = {f"{name}.{key}": cls for name, section in SECTIONS.items() for key, cls in _item_types(section).items()}
    for key, cls in items.items():
        if isinstance(before.get(key), list):   # as the typed loader reads them (a phase without lr: lr None)
            with contextlib.suppress(UserError, TypeError):
                before[key] = [dataclasses.asdict(_item_from_dict(key, cls, v)) for v in before[key]]
    if new.batch.phases:   # derived from the phases, which are compared
        after.pop("batch.global_batch")
    return [(key, before[key], value) for key, value in after.items() if key in before and before[key] != value]


def check_allow_change(keys: list[str]) -> list[str]:
    """The keys of `--allow-change` (repeatable, or comma-separated): each a config key that is part of what a run
    is; one sentence naming the first that is not."""
    flat = [k.strip() for item in keys for k in item.split(",") if k.strip()]
    valid = list(_flat(Config().to_dict()))
    for key in flat:
        if key not in valid:
            raise UserError(f"--allow-change {key}: no such setting{_suggest(key, valid)}; name a section.key of the "
                            "config, e.g. --allow-change data.root.")
        if key in RESUME_NEVER:
            raise UserError(f"--allow-change {key}: a run's steps and epochs are counted in batches of "
                            f"{' and '.join(RESUME_NEVER)}, so a resume cannot change them; start a new run with a "
                            "fresh --run-dir (batch.phases changes the batch during a run when given from its start).")
    return flat


def check_resume(changes: list[tuple[str, Any, Any]], allowed: list[str], run_dir: Path) -> None:
    """Refuse, in one sentence naming the settings with their old and new values and the fix, a resume that changes
    a key the run's steps are counted in, or one that is part of what the run is and not in `allowed`."""
    never = [c for c in changes if c[0] in RESUME_NEVER]
    if never:
        listed = ", ".join(f"{k} {shown(a)} -> {shown(b)}" for k, a, b in never)
        back = " ".join(f"--set {k}={shown(a)}" for k, a, _ in never)
        raise UserError(f"--resume of {run_dir} would change {listed}, the batches its steps and epochs are counted "
                        f"in, so the epoch count would jump; resume with {back}, or start a new run with a fresh "
                        "--run-dir (batch.phases changes the batch during a run when given from its start).")
    refused = [c for c in changes if c[0] not in RESUMABLE and c[0] not in allowed]
    if refused:
        listed = ", ".join(f"{k} {shown(a)} -> {shown(b)}" for k, a, b in refused)
        back = " ".join(f"--set {k}={shown(a)}" for k, a, _ in refused)
        allow = " ".join(f"--allow-change {k}" for k, _, _ in refused)
        raise UserError(f"--resume of {run_dir} would change what the run is: {listed}; resume with {back} (its "
                        f"config.yaml), start a new run with a fresh --run-dir, or, if the run should go on so "
                        f"changed (e.g. the same data moved to another data.root), add {allow} to accept and record "
                        "the change.")
