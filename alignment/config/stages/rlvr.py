"""`rlvr` stage config: the keys a recipe's `kind: rlvr` stage accepts (torch-free; the runtime is alignment/stages/rlvr.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from ..data import DataSpec
from ..verifier import VerifierSpec, gold_field
from .base import BATCH_KNOB, LORA_KNOB, StageConfig


class Config(StageConfig):
    kind: Literal["rlvr"] = "rlvr"
    memory_knobs: ClassVar[tuple[str, ...]] = (
        "`train.gradient_checkpointing: true`", BATCH_KNOB, "`train.max_completion_length`", LORA_KNOB)
    data: DataSpec
    algorithm: Literal["grpo", "rloo"] = "grpo"
    verifiers: list[VerifierSpec] = Field(default_factory=list, description="reward = weighted sum of these verifiers "
                                          "(and of the reward model's score, if given)")
    reward_model: str | None = Field(None, description="'${rm}' (a reward stage), a local path or hub id: its score of "
                                     "the rendered conversation is a reward (as ppo's)")
    reward_model_weight: float = Field(1.0, description="weight of the reward model's score in the reward")
    gold: list[VerifierSpec] = gold_field()

    @model_validator(mode="after")
    def _a_reward(self):
        if self.reward_model is None and not self.verifiers:
            raise ValueError("give 'verifiers' or a 'reward_model' (or both): GRPO/RLOO need a reward")
        if "reward_model_weight" in self.model_fields_set and self.reward_model is None:
            raise ValueError("'reward_model_weight' weighs a 'reward_model', and none is given")
        return self
