"""`sft` stage config: the keys a recipe's `kind: sft` stage accepts (torch-free; the runtime is alignment/stages/sft.py)."""

from __future__ import annotations

from typing import Literal

from ..data import DataSpec
from .base import StageConfig


class Config(StageConfig):
    kind: Literal["sft"] = "sft"
    data: DataSpec
