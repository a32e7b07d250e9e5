"""VerifierSpec: one entry of an RL stage's `verifiers:` list (resolved by `alignment.verifiers.resolve`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .base import ByName


class VerifierSpec(ByName):
    """One entry of a stage's `verifiers:` list; a bare string is shorthand for `{name: ...}`."""

    name: str = Field(
        description="built-in key, plugin name or module:function (file next to the recipe); "
        "a bare string in the list is shorthand for {name: ...}"
    )
    weight: float = Field(
        1.0,
        description="multiplier of this verifier's reward in the weighted sum that is the "
        "stage's reward (rlvr hands it to TRL as reward_weights)",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="values of the verifier function's keyword-only "
        "parameters, e.g. {tolerance: 0.01}; an unknown option fails `align check`",
    )


def gold_field():
    """The `gold:` key of the RL stages (ppo, rlvr, rsft): the same spec as `verifiers:`."""
    return Field(
        default_factory=list,
        description=(
            "verifiers scored on every rollout and logged as gold/<name> (mean per logging step), never part of the "
            "reward (a weight is ignored): the true objective kept in view while the stage optimises a proxy such as "
            "a reward model (Gao et al. 2022)"
        ),
    )
