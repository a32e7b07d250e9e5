"""The RL stages' settings that look for a learning signal: `prompt_filter:` (ppo, rlvr, rsft) and rlvr's
`dynamic_sampling:`. Both are off unless a recipe sets them (docs/tuning.md#when-rl-does-not-move says why).
Torch-free; the runtime is alignment/training/prompt_filter.py and alignment/training/dynamic_sampling.py.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from .base import Strict
from .sampling import SamplingSpec


class PromptFilterSpec(Strict):
    """`prompt_filter:` keep only the prompts the start policy solves some of the time, measured before training."""

    k: int = Field(
        8,
        ge=2,
        description="completions sampled per prompt from the start policy to measure its pass "
        "rate (a completion passes when every verifier passes it)",
    )
    low: float = Field(
        0.1,
        ge=0,
        le=1,
        description="keep a prompt whose pass rate is at least this (lower: too hard, "
        "dropped and counted as prompt_filter/too_hard)",
    )
    high: float = Field(
        0.9,
        ge=0,
        le=1,
        description="keep a prompt whose pass rate is at most this (higher: too easy, "
        "dropped and counted as prompt_filter/too_easy)",
    )
    sampling: SamplingSpec | None = Field(
        None,
        description="how the start policy samples for the measure (its `n` is "
        "replaced by k); default: as the stage samples (rlvr: train.temperature, "
        "top_p, top_k and max_completion_length; ppo: rollout; rsft: sampling)",
    )

    @model_validator(mode="after")
    def _bounds(self):
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high}): no pass rate would be kept")
        return self


class DynamicSamplingSpec(Strict):
    """`dynamic_sampling:` drop the prompt groups whose rewards do not differ and refill the batch (DAPO)."""

    max_draws: int = Field(
        3,
        ge=2,
        description="most generation batches sampled for one training batch, the first "
        "included; a batch still short of groups with spread after them is filled with flat groups "
        "(counted as dynamic_sampling/groups_filled)",
    )


def prompt_filter_field():
    """The `prompt_filter:` key of the RL stages (ppo, rlvr, rsft)."""
    return Field(
        None,
        description="measure each prompt's pass rate under the start policy (k samples) before "
        "training and keep only those within [low, high]: prompts it always or never solves teach GRPO, RLOO "
        "and RSFT nothing. Needs verifiers; not with tools. Off by default (null)",
    )


def check_prompt_filter(config):
    """An RL stage's `model_validator`: `prompt_filter` needs verifiers (a pass) and one-turn sampling (no tools)."""
    if config.prompt_filter is None:
        return config
    if not config.verifiers:
        raise ValueError(
            "prompt_filter measures a pass rate, which needs `verifiers:` (a reward model's score "
            "has no pass); drop prompt_filter or give verifiers"
        )
    if getattr(config, "uses_tools", False):
        raise ValueError(
            "prompt_filter samples one turn without tools; it is not implemented with `tools:` or `environment:`"
        )
    return config
