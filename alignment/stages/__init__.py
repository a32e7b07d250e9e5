"""Stage kinds. `STAGES` maps a recipe `kind` to its module; modules import lazily so that
loading a recipe does not import torch or TRL for stages it does not use."""

from __future__ import annotations

import importlib
import importlib.util

from ..config.base import did_you_mean
from ..errors import UserError

STAGES: dict[str, str] = {
    "sft": "alignment.stages.sft",
    "reward": "alignment.stages.reward",
    "dpo": "alignment.stages.dpo",
    "ppo": "alignment.stages.ppo",
    "rsft": "alignment.stages.rsft",
    "rlvr": "alignment.stages.rlvr",
}

def available_kinds() -> list[str]:
    """Kinds whose module is present in this installation."""
    return [k for k, m in STAGES.items() if importlib.util.find_spec(m) is not None]


def stage_module(kind: str, where: str = "stages"):
    if kind not in available_kinds():
        raise UserError(
            f"{where}: unknown stage kind '{kind}'{did_you_mean(kind, STAGES)}; available kinds: {', '.join(available_kinds())}."
        )
    return importlib.import_module(STAGES[kind])
