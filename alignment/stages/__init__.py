"""Stage kinds. `STAGES` maps a recipe `kind` to its module; modules import lazily so that
loading a recipe does not import torch or TRL for stages it does not use."""

from __future__ import annotations

import importlib

from ..errors import UserError
from ..schema import did_you_mean

STAGES: dict[str, str] = {
    "sft": "alignment.stages.sft",
}

# Kinds whose output is a scoring model rather than a policy: never the implicit start of a later stage.
NON_POLICY_KINDS = {"reward"}


def stage_module(kind: str, where: str = "stages"):
    if kind not in STAGES:
        raise UserError(
            f"{where}: unknown stage kind '{kind}'{did_you_mean(kind, STAGES)}; available kinds: {', '.join(STAGES)}."
        )
    return importlib.import_module(STAGES[kind])
