"""Built-in synthetic tasks: seeded data generators with their own verifier, no download.

A data spec names one with `task:`, e.g. `data: {task: arithmetic, split: train, n: 5000}`; the
remaining keys are the task's own parameters, validated by its model in `alignment/config/tasks.py`
(torch-free, so loading a recipe does not import the task).
"""

from __future__ import annotations

from types import ModuleType

from ..config.tasks import task_params_model
from . import arithmetic, reasoning_gym, tool_arithmetic

TASKS: dict[str, ModuleType] = {
    "arithmetic": arithmetic,
    "tool_arithmetic": tool_arithmetic,
    "reasoning_gym": reasoning_gym,
}


def get_task(name: str) -> ModuleType:
    """The task module (with `build(params, split, seed)` and `verify`)."""
    task_params_model(name)  # an unknown name: the same error as when the recipe is loaded
    return TASKS[name]
