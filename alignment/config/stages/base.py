"""StageConfig: the keys every stage accepts; each stage module's `Config` extends it."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from ..base import Strict
from ..data import DataSpec
from ..model import LoraSpec

BATCH_KNOB = "`train.per_device_train_batch_size` (raise `train.gradient_accumulation_steps` to keep the batch)"
LORA_KNOB = "LoRA (`lora: {r: 16}`) instead of full fine-tuning"


class StageConfig(Strict):
    """Keys every stage accepts. `model` is the starting policy: '${stage}', a local path or a hub id;
    by default the previous policy stage's output (or the recipe's model for the first stage)."""

    kind: str
    model: str | None = None
    data: DataSpec | None = None
    eval_data: DataSpec | None = None
    lora: LoraSpec | None = None
    train: dict[str, Any] = Field(default_factory=dict)

    # False for kinds whose output is a scoring model (reward): never the implicit start of a later
    # stage, never evaluated as a policy.
    produces_policy: ClassVar[bool] = True

    # What to turn down when the stage runs out of accelerator memory (the runner's error lists them).
    # Gradient checkpointing is on by default only where the memory estimate says the stage would not
    # fit (`memory.py`, which errs high); this is where a user whose stage still does not fit learns of it.
    memory_knobs: ClassVar[tuple[str, ...]] = (
        "`train.gradient_checkpointing: true` (recomputes activations in the backward pass: less memory, roughly "
        "a third more time)", BATCH_KNOB, "`train.max_length`", LORA_KNOB)

    def start_model_key(self) -> str:
        """Name of the key holding the starting policy (PPO calls it `policy`)."""
        return "model"
