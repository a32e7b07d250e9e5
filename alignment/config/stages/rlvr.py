"""`rlvr` stage config: the keys a recipe's `kind: rlvr` stage accepts (torch-free; the runtime is alignment/stages/rlvr.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ..data import DataSpec
from ..verifier import VerifierSpec
from .base import BATCH_KNOB, LORA_KNOB, StageConfig


class Config(StageConfig):
    kind: Literal["rlvr"] = "rlvr"
    memory_knobs: ClassVar[tuple[str, ...]] = (
        "`train.gradient_checkpointing: true`", BATCH_KNOB, "`train.max_completion_length`", LORA_KNOB)
    data: DataSpec
    algorithm: Literal["grpo", "rloo"] = "grpo"
    verifiers: list[VerifierSpec] = Field(min_length=1, description="reward = weighted sum of these verifiers")
