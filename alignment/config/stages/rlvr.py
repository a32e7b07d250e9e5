"""`rlvr` stage config: the keys a recipe's `kind: rlvr` stage accepts (torch-free; the runtime is alignment/stages/rlvr.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from ..data import DataSpec
from ..tools import ToolUse
from ..verifier import VerifierSpec
from .base import BATCH_KNOB, LORA_KNOB, StageConfig


class Config(StageConfig, ToolUse):
    kind: Literal["rlvr"] = "rlvr"
    memory_knobs: ClassVar[tuple[str, ...]] = (
        "`train.gradient_checkpointing: true`", BATCH_KNOB, "`train.max_completion_length`", LORA_KNOB)
    data: DataSpec
    algorithm: Literal["grpo", "rloo"] = "grpo"
    verifiers: list[VerifierSpec] = Field(min_length=1, description="reward = weighted sum of these verifiers")

    @model_validator(mode="after")
    def _tools_need_grpo(self):
        if self.uses_tools and self.algorithm != "grpo":
            raise ValueError("tools need algorithm: grpo (TRL 1.16's RLOOTrainer has no rollout_func hook, which "
                             "the multi-turn rollout uses)")
        return self
