"""`ppo` stage config: the keys a recipe's `kind: ppo` stage accepts (torch-free; the runtime is alignment/stages/ppo.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from ..base import Strict
from ..data import DataSpec
from ..sampling import SamplingSpec
from ..verifier import VerifierSpec, gold_field
from .base import LORA_KNOB, StageConfig


class RolloutSpec(SamplingSpec):
    """`rollout:` the one sampling spec, with PPO's sizes: `batch_size` prompts per update on each process
    (sampled in one generate call), one completion each."""

    batch_size: int = Field(64, gt=0, description="prompts per update on each process")
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, gt=0)
    n: Literal[1] = Field(1, description="one completion per prompt (PPO's rollout is one sample per episode)")
    max_prompt_length: int | None = Field(None, gt=0, description="drop prompts longer than this many tokens")

class TrainSpec(Strict):
    """Optimisation settings of our PPO loop (not a TRL config). Sizes are per process."""

    learning_rate: float = Field(1.0e-5, gt=0)
    critic_learning_rate: float | None = Field(None, gt=0, description="default: learning_rate")
    weight_decay: float = Field(0.0, ge=0)
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up")
    ppo_epochs: int = Field(4, gt=0)
    mini_batch_size: int = Field(16, gt=0, description="rows per optimizer step")
    gradient_accumulation_steps: int = Field(1, gt=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    cliprange: float = Field(0.2, gt=0)
    cliprange_value: float | None = Field(0.2, gt=0)
    vf_coef: float = Field(0.1, ge=0)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    whiten_advantages: bool = True
    reward_norm: Literal["none", "batch", "running"] = "none"
    reward_clip: float | None = Field(None, gt=0, description="clip (normalised) scores to [-c, c]")
    total_updates: int | None = Field(None, gt=0)
    total_episodes: int | None = Field(None, gt=0, description="default: one pass over the prompts")
    save_every: int = Field(50, gt=0)
    logging_steps: int = Field(1, gt=0)
    gradient_checkpointing: bool | None = Field(
        None, description="recompute layers in the backward pass; default: only where the estimate says the "
        "step would not fit on the GPU without it (memory.py); never on CPU")

class Config(StageConfig):
    kind: Literal["ppo"] = "ppo"
    memory_knobs: ClassVar[tuple[str, ...]] = (
        "`train.gradient_checkpointing: true`",
        "`train.mini_batch_size` (raise `train.gradient_accumulation_steps` to keep the step size)",
        "`rollout.batch_size` or `rollout.max_new_tokens`", LORA_KNOB)
    policy: str | None = None
    reward_model: str | None = None
    verifiers: list[VerifierSpec] = Field(default_factory=list)
    gold: list[VerifierSpec] = gold_field()
    data: DataSpec
    kl_coef: float = Field(0.05, ge=0)
    kl_target: float | None = Field(None, gt=0, description="adaptive KL controller target (nats per sequence)")
    kl_horizon: int = Field(10000, gt=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    missing_eos_penalty: float | None = Field(None, description="subtracted from the score of unfinished completions")
    train: TrainSpec = Field(default_factory=TrainSpec)

    def start_model_key(self) -> str:
        return "policy"

    @model_validator(mode="after")
    def _consistent(self):
        t = self.train
        if self.model is not None:
            raise ValueError("a ppo stage names its start policy with 'policy', not 'model'")
        if self.eval_data is not None:
            raise ValueError("'eval_data' is not used by ppo; evaluate the result with the recipe's evaluate block")
        if self.reward_model is None and not self.verifiers:
            raise ValueError("give a 'reward_model' or 'verifiers' (or both): PPO needs a reward")
        if self.rollout.batch_size % t.mini_batch_size:
            raise ValueError(f"rollout.batch_size ({self.rollout.batch_size}) must be a multiple of "
                             f"train.mini_batch_size ({t.mini_batch_size})")
        if t.mini_batch_size % t.gradient_accumulation_steps:
            raise ValueError(f"train.mini_batch_size ({t.mini_batch_size}) must be a multiple of "
                             f"train.gradient_accumulation_steps ({t.gradient_accumulation_steps})")
        if t.total_updates is not None and t.total_episodes is not None:
            raise ValueError("give train.total_updates or train.total_episodes, not both")
        return self
