"""`sft` stage config: the keys a recipe's `kind: sft` stage accepts (torch-free; the runtime is
alignment/stages/sft.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..data import DataSpec
from .base import StageConfig


class Config(StageConfig):
    kind: Literal["sft"] = Field(
        "sft",
        description="sft: supervised fine-tuning with trl.SFTTrainer, the loss on the "
        "completion tokens only unless train.completion_only_loss is false",
    )
    data: DataSpec = Field(
        description="`prompt` + `completion` rows, chat `messages` (the last assistant turn is the "
        "completion) or plain `text` rows"
    )
