"""`dpo` stage config: the keys a recipe's `kind: dpo` stage accepts (torch-free; the runtime is alignment/stages/dpo.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..data import DataSpec
from ..sampling import OnPolicySpec
from .base import StageConfig


class Config(StageConfig):
    kind: Literal["dpo"] = "dpo"
    data: DataSpec
    on_policy: OnPolicySpec | None = Field(None, description="build pairs from the start policy's graded samples")
    eval_fraction: float = Field(0.0, ge=0, lt=1, description="share of pairs held out when eval_data is not given")
