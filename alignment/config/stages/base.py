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

    kind: str = Field(
        description="the stage kind (sft, reward, dpo, ppo, rsft, rlvr); defaults to the stage's id, so "
        "give it for a second stage of a kind (`sft2: {kind: sft}`)"
    )
    model: str | None = Field(
        None,
        description="the start policy: '${stage}', a local path or hub id; default: the "
        "previous policy stage's output, or the recipe's model for the first stage (ppo calls it `policy`)",
    )
    data: DataSpec | None = Field(None, description="where the stage's training rows come from")
    eval_data: DataSpec | None = Field(
        None,
        description="held-out rows the TRL trainer evaluates on during training "
        "(sft, reward, dpo, rlvr); rsft does not read it, ppo refuses it",
    )
    lora: LoraSpec | None = Field(
        None, description="this stage's LoRA settings instead of the recipe's `lora:`; `lora: null` trains all weights"
    )
    train: dict[str, Any] = Field(
        default_factory=dict,
        description="knobs passed verbatim to the kind's TRL config "
        "(sft, rsft: trl.SFTConfig; reward: RewardConfig; dpo: DPOConfig; rlvr: GRPOConfig "
        "or RLOOConfig), built at load time, so a misspelt knob fails `align check`",
    )

    # False for kinds whose output is a scoring model (reward): never the implicit start of a later
    # stage, never evaluated as a policy.
    produces_policy: ClassVar[bool] = True
    # True for kinds whose output a later stage's `reward_model:` may name: a reward stage's classifier, and
    # a dpo stage's policy read as its implicit reward (models/implicit_reward.py).
    scores_as_reward: ClassVar[bool] = False

    # What to turn down when the stage runs out of accelerator memory (the runner's error lists them).
    # Gradient checkpointing is on by default only where the memory estimate says the stage would not
    # fit (`memory.py`, which errs high); this is where a user whose stage still does not fit learns of it.
    memory_knobs: ClassVar[tuple[str, ...]] = (
        "`train.gradient_checkpointing: true` (recomputes activations in the backward pass: less memory, roughly "
        "a third more time)",
        BATCH_KNOB,
        "`train.max_length`",
        LORA_KNOB,
    )

    def start_model_key(self) -> str:
        """Name of the key holding the starting policy (PPO calls it `policy`)."""
        return "model"
