"""Built-in synthetic tasks: seeded data generators with their own verifier, no download.

A data spec names one with `task:`, e.g. `data: {task: arithmetic, split: train, n: 5000}`; the
remaining keys are the task's own parameters, validated by its `Params` model.
"""

from __future__ import annotations

import importlib

from ..config.base import did_you_mean
from ..errors import UserError

TASKS = {"arithmetic": "alignment.tasks.arithmetic"}


def get_task(name: str):
    """The task module (with `Params`, `build(params, split, seed)` and `verify`)."""
    if name not in TASKS:
        raise UserError(f"Unknown task '{name}'{did_you_mean(name, TASKS)}; built-in tasks: {', '.join(TASKS)}.")
    return importlib.import_module(TASKS[name])
