"""Kept for tests/test_recipes.py, which imports `parser` and `variants` from here; the variant kinds (batch-control,
ensemble) live in largebatch/commands/study/ (kinds.py, plan.py). Remove once that test imports from there."""
from largebatch.commands.study.kinds import parser
from largebatch.commands.study.plan import variants

__all__ = ["parser", "variants"]
