"""Typed configuration: one dataclass per section, YAML recipes, `--set` overrides.

A recipe is a YAML mapping of sections (``model``, ``data``, ``batch``, ``optim``,
``schedule``, ``train``, ``comm``, ``ensemble``) to keys. Every key is a documented
dataclass field; an unknown section or key is an error that names itself and the
valid ones, so a recipe never sets a key that nobody reads. Builders receive only
their own section (``build_optimizer(cfg.optim, model)``), never the whole config.

One module per job:
  fields.py     how a key is declared and checked: field helpers, each bound on its field, Section and Item
  schema.py     the sections, `Config`, the limits used by more than one key
  checks.py     the checks that span sections
  loading.py    recipes, strict YAML, --set, a run's config.yaml (older keys included), and writing it
  reference.py  every key's type, default, bounds and doc (`largebatch config`, docs/config.md)
What a resume may change is largebatch/resume.py's, next to the checkpoints.
"""
from largebatch.config.checks import validate
from largebatch.config.fields import Item, Section
from largebatch.config.loading import (
    RECIPES_DIR, RENAMED, YamlLoader, apply_overrides, check_one_batch, from_dict, list_recipes, load, load_yaml,
    resolve_recipe, save,
)
from largebatch.config.reference import KeyDoc, reference, shown
from largebatch.config.schema import (
    MAX_CYCLES, MAX_EPOCHS, MAX_LR, SECTIONS, THREADS_PER_CORE, BatchConfig, BatchPhase, CommConfig, Config,
    DataConfig, EnsembleConfig, EnsembleSegment, ModelConfig, OptimConfig, ResolutionPhase, ScheduleConfig,
    TrainConfig, check_threads,
)
from largebatch.errors import UserError

__all__ = [
    "MAX_CYCLES", "MAX_EPOCHS", "MAX_LR", "RECIPES_DIR", "RENAMED", "SECTIONS", "THREADS_PER_CORE", "BatchConfig",
    "BatchPhase", "CommConfig", "Config", "DataConfig", "EnsembleConfig", "EnsembleSegment", "Item", "KeyDoc",
    "ModelConfig", "OptimConfig", "ResolutionPhase", "ScheduleConfig", "Section", "TrainConfig", "UserError",
    "YamlLoader", "apply_overrides", "check_one_batch", "check_threads", "from_dict", "list_recipes", "load",
    "load_yaml", "reference", "resolve_recipe", "save", "shown", "validate",
]
