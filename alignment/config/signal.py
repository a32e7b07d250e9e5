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

    k: int = Field(8, ge=2, description="completions sampled per prompt from the start policy to measure its pass "
                   "rate (a completion passes when every verifier passes it)")
    low: float = Field(0.1, ge=0, le=1, description="keep a prompt whose pass rate is at least this (lower: too hard, "
                       "dropped and counted as prompt_filter/too_hard)")
    high: float = Field(0.9, ge=0, le=1, description="keep a prompt whose pass rate is at most this (higher: too easy, "
                        "dropped and counted as prompt_filter/too_easy)")
    sampling: SamplingSpec | None = Field(None, description="how the start policy samples for the measure (its `n` is "
                                          "replaced by k); default: as the stage samples (rlvr: train.temperature, "
                                          "top_p, top_k and max_completion_length; ppo: rollout; rsft: sampling)")

    @model_validator(mode="after")
    def _bounds(self):
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high}): no pass rate would be kept")
        return self


class DynamicSamplingSpec(Strict):
    """`dynamic_sampling:` drop the prompt groups whose rewards do not differ and refill the batch (DAPO)."""

    max_draws: int = Field(3, ge=2, description="most generation batches sampled for one training batch, the first "
                           "included; a batch still short of groups with spread after them is filled with flat groups "
                           "(counted as dynamic_sampling/groups_filled)")


def prompt_filter_field():
    """The `prompt_filter:` key of the RL stages (ppo, rlvr, rsft)."""
    return Field(None, description="measure each prompt's pass rate under the start policy (k samples) before "
                 "training and keep only those within [low, high]: prompts it always or never solves teach GRPO, RLOO "
                 "and RSFT nothing. Needs verifiers; not with tools. Off by default (null)")


class PromptFilterKey(Strict):
    """The `prompt_filter:` key, for the Config of each RL stage (ppo, rlvr, rsft)."""

    prompt_filter: PromptFilterSpec | None = prompt_filter_field()

    @model_validator(mode="after")
    def _filter_needs_verifiers(self):
        if self.prompt_filter is None:
            return self
        if not getattr(self, "verifiers", None):
            raise ValueError("prompt_filter measures a pass rate, which needs `verifiers:` (a reward model's score "
                             "has no pass); drop prompt_filter or give verifiers")
        if getattr(self, "uses_tools", False):
            raise ValueError("prompt_filter samples one turn without tools; it is not implemented with `tools:` or "
                             "`environment:`")
        return self
