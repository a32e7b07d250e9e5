"""`reward` stage config: the keys a recipe's `kind: reward` stage accepts (torch-free; the runtime is alignment/stages/reward.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ..data import DataSpec
from ..sampling import OnPolicySpec
from .base import StageConfig


class Config(StageConfig):
    kind: Literal["reward"] = Field("reward", description="reward: a Bradley-Terry reward model (Ouyang et al. 2022, "
                                    "arXiv:2203.02155, eq. 1) trained with trl.RewardTrainer: the start policy with a "
                                    "fresh one-label score head, scoring prompt + completion")
    produces_policy: ClassVar[bool] = False  # a scoring model: no later stage starts from it
    scores_as_reward: ClassVar[bool] = True
    data: DataSpec = Field(description="preference pairs: `prompt` + `chosen`/`rejected` strings, chat `chosen`/"
                           "`rejected` message lists, or full texts sharing their prompt; with on_policy, prompts and the "
                           "verifier's columns")
    on_policy: OnPolicySpec | None = Field(None, description="build pairs from the start policy's graded samples, "
                                           "not from `data`'s pairs")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="share of pairs held out when eval_data is not given "
                                 "(pairwise accuracy and margin are measured on them); 0: none")
    score_learning_rate: float | None = Field(
        None, gt=0, description="learning rate of the freshly initialised score head (default: train.learning_rate); "
        "a head that learns faster than the pretrained body it reads from: 3e-2 over 2e-4 took the arithmetic pairs from "
        "0.6-0.75 to 0.945 held-out accuracy (alignment/stages/reward.py)")
