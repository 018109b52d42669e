"""Errors a user can cause, and the one place that turns them into exit code 2.

A `UserError` carries one sentence naming the problem and the fix. Bugs are not
UserErrors: they keep their tracebacks.
"""
from __future__ import annotations

import os
import sys

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input from a user: config, data, command line, world size."""


def report(err: UserError) -> int:
    """Print the error once (rank 0 only under torchrun) and return exit code 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"largebatch: error: {err}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR
