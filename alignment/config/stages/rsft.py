"""`rsft` stage config: the keys a recipe's `kind: rsft` stage accepts (torch-free; the runtime is alignment/stages/rsft.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from ..data import DataSpec
from ..sampling import SamplingSpec
from ..verifier import VerifierSpec, gold_field
from .base import StageConfig


class RsftSampling(SamplingSpec):
    n: int = Field(8, gt=0, description="completions sampled per prompt")
    max_new_tokens: int = Field(256, gt=0)

class Config(StageConfig):
    kind: Literal["rsft"] = "rsft"
    memory_knobs: ClassVar[tuple[str, ...]] = ("`sampling.batch_size`", *StageConfig.memory_knobs)
    data: DataSpec
    verifiers: list[VerifierSpec] = Field(default_factory=list)
    reward_model: str | None = Field(None, description="'${rm}' (a reward stage), a local path or hub id")
    gold: list[VerifierSpec] = gold_field()
    rounds: int = Field(1, gt=0)
    prompts_per_round: int | None = Field(None, gt=0, description="default: every prompt, every round")
    sampling: RsftSampling = Field(default_factory=RsftSampling)
    select: Literal["best_of_n", "top_k", "threshold"] = "best_of_n"
    k: int = Field(1, gt=0, description="completions kept per prompt with select: top_k")
    threshold: float | None = None
    rm_batch_size: int = Field(16, gt=0)

    @model_validator(mode="after")
    def _one_scorer(self):
        if bool(self.verifiers) == (self.reward_model is not None):
            raise ValueError("give exactly one of 'verifiers' (programmatic checks) or 'reward_model' to score samples")
        if self.select == "threshold" and self.threshold is None and self.reward_model is not None:
            raise ValueError("select: threshold with a reward model needs 'threshold' (the minimum score)")
        if "k" in self.model_fields_set and self.select != "top_k":
            raise ValueError(f"'k' only applies to select: top_k (select is {self.select})")
        return self
