"""`dpo` stage config: the keys a recipe's `kind: dpo` stage accepts (torch-free; the runtime is
alignment/stages/dpo.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ..data import DataSpec
from ..sampling import OnPolicySpec
from .base import StageConfig


class Config(StageConfig):
    kind: Literal["dpo"] = Field(
        "dpo",
        description="dpo: direct preference optimisation (Rafailov et al. 2023, "
        "arXiv:2305.18290) with trl.DPOTrainer against the frozen start policy; beta and "
        "loss_type go under train:",
    )
    scores_as_reward: ClassVar[bool] = True  # `reward_model: ${dpo}`: beta * (log pi - log ref) of an answer
    data: DataSpec = Field(
        description="preference pairs in any usual format (as the reward stage reads them); with "
        "on_policy, prompts and the verifier's columns"
    )
    on_policy: OnPolicySpec | None = Field(
        None,
        description="build pairs from the start policy's graded samples "
        "instead of reading them from `data` (on-policy preference data)",
    )
    eval_fraction: float = Field(
        0.0, ge=0, lt=1, description="share of pairs held out for TRL's evaluation when eval_data is not given; 0: none"
    )
