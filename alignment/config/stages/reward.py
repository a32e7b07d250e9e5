"""`reward` stage config: the keys a recipe's `kind: reward` stage accepts (torch-free; the runtime is
alignment/stages/reward.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from ..base import Strict
from ..data import DataSpec
from ..sampling import OnPolicySpec
from .base import StageConfig


class EnsembleSpec(Strict):
    """`ensemble:` — train the reward model `members` times on the same pairs, each from its own seed, and
    read it as one reward (Coste et al. 2023, arXiv:2310.02743; alignment/models/reward_ensemble.py)."""

    members: int = Field(
        gt=1,
        le=16,
        description="reward models trained, each with seed recipe seed + i (its "
        "score head's initialisation and its batch order); the stage takes about members x as long",
    )
    combine: Literal["mean", "min", "uwo"] = Field(
        "mean",
        description="how a reader combines the members' "
        "scores: mean; min (worst-case optimisation); uwo (mean minus "
        "`penalty` x the members' variance: uncertainty-weighted). min "
        "and uwo read each member standardised by the mean and std of "
        "its scores on the stage's held-out pairs (else its training "
        "pairs), since a Bradley-Terry model's offset is arbitrary",
    )
    penalty: float = Field(1.0, ge=0, description="uwo: the weight of the members' variance subtracted from their mean")

    @model_validator(mode="after")
    def _penalty_for_uwo(self):
        if "penalty" in self.model_fields_set and self.combine != "uwo":
            raise ValueError(f"'penalty' weighs the members' variance in combine: uwo (combine is {self.combine})")
        return self


class Config(StageConfig):
    kind: Literal["reward"] = Field(
        "reward",
        description="reward: a Bradley-Terry reward model (Ouyang et al. 2022, "
        "arXiv:2203.02155, eq. 1) trained with trl.RewardTrainer: the start policy with a "
        "fresh one-label score head, scoring prompt + completion",
    )
    produces_policy: ClassVar[bool] = False  # a scoring model: no later stage starts from it
    scores_as_reward: ClassVar[bool] = True
    data: DataSpec = Field(
        description="preference pairs: `prompt` + `chosen`/`rejected` strings, chat `chosen`/"
        "`rejected` message lists, or full texts sharing their prompt; with on_policy, prompts and the "
        "verifier's columns"
    )
    on_policy: OnPolicySpec | None = Field(
        None, description="build pairs from the start policy's graded samples, not from `data`'s pairs"
    )
    eval_fraction: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="share of pairs held out when eval_data is not given "
        "(pairwise accuracy and margin are measured on them); 0: none",
    )
    score_learning_rate: float | None = Field(
        None,
        gt=0,
        description="learning rate of the freshly initialised score head (default: train.learning_rate); "
        "a head that learns faster than the pretrained body it reads from: 3e-2 over 2e-4 took the arithmetic pairs "
        "from "
        "0.6-0.75 to 0.945 held-out accuracy (alignment/stages/reward.py)",
    )
    ensemble: EnsembleSpec | None = Field(
        None,
        description="train several reward models on the same pairs and score "
        "with their combination wherever `${this stage}` is a reward_model "
        "(over-optimisation: Coste et al. 2023)",
    )
