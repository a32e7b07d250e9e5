"""`rlvr` stage config: the keys a recipe's `kind: rlvr` stage accepts (torch-free; the runtime is
alignment/stages/rlvr.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from ..data import DataSpec
from ..sampling import ImportanceSamplingSpec, ServerRolloutSpec, importance_sampling_field
from ..signal import (
    DynamicSamplingSpec,
    PromptFilterSpec,
    check_prompt_filter,
    prompt_filter_field,
)
from ..tools import ToolUse
from ..verifier import VerifierSpec, gold_field
from .base import BATCH_KNOB, LORA_KNOB, StageConfig


class Config(StageConfig, ToolUse):
    kind: Literal["rlvr"] = Field(
        "rlvr",
        description="rlvr: RL from verifiable rewards with trl.GRPOTrainer or "
        "RLOOTrainer; the weighted sum of the verifiers (and a reward model) is the reward, with a KL "
        "penalty to the "
        "start policy (train.beta, 0.04 here where TRL's GRPO default is 0)",
    )
    memory_knobs: ClassVar[tuple[str, ...]] = (
        "`train.gradient_checkpointing: true`",
        BATCH_KNOB,
        "`train.max_completion_length`",
        LORA_KNOB,
    )
    data: DataSpec = Field(
        description="prompts (`prompt` or chat `messages`, a final assistant turn dropped) and the "
        "columns the verifiers read, e.g. `answer`"
    )
    algorithm: Literal["grpo", "rloo"] = Field(
        "grpo",
        description="grpo: advantages normalised within each prompt's "
        "group of num_generations samples (Shao et al. 2024, DeepSeekMath, "
        "arXiv:2402.03300); rloo: leave-one-out baseline (Ahmadian et al. "
        "2024, arXiv:2402.14740)",
    )
    verifiers: list[VerifierSpec] = Field(
        default_factory=list,
        description="reward = weighted sum of these verifiers (and of the reward model's score, if given)",
    )
    reward_model: str | None = Field(
        None,
        description="'${rm}' (a reward stage; a dpo stage scores as its implicit reward), a local path or hub id: "
        "its score of "
        "the rendered conversation is a reward (as ppo's)",
    )
    reward_model_weight: float = Field(1.0, description="weight of the reward model's score in the reward")
    gold: list[VerifierSpec] = gold_field()
    prompt_filter: PromptFilterSpec | None = prompt_filter_field()
    _prompt_filter_needs = model_validator(mode="after")(check_prompt_filter)
    importance_sampling: ImportanceSamplingSpec | None = importance_sampling_field()
    rollout: ServerRolloutSpec | None = Field(
        None,
        description="sample through a vLLM server (`{server: local}` or a URL) instead of TRL's own sampler, "
        "the policy's LoRA adapter pushed at every generation; null: TRL samples",
    )
    dynamic_sampling: DynamicSamplingSpec | None = Field(
        None,
        description="drop the prompt groups whose rewards "
        "do not differ and refill the batch from fresh prompts, up to "
        "max_draws generations per batch (DAPO, Yu et al. 2025, "
        "arXiv:2503.14476); counted in stage.json. Off by default (null)",
    )

    @model_validator(mode="after")
    def _tools_need_grpo(self):
        if self.uses_tools and self.algorithm != "grpo":
            raise ValueError(
                "tools need algorithm: grpo (TRL 1.16's RLOOTrainer has no rollout_func hook, which "
                "the multi-turn rollout uses). For RLOO's leave-one-out baseline with tools, use grpo with "
                "train: {scale_rewards: none}: its advantage, the reward minus the group mean, is RLOO's "
                "times (G-1)/G, a constant that Adam's step cancels; its KL term is in the loss, not "
                "subtracted from the reward as RLOO's is"
            )
        return self

    @model_validator(mode="after")
    def _importance_sampling_in_grpo(self):
        if self.importance_sampling is not None:
            if self.algorithm != "grpo":
                raise ValueError(
                    "importance_sampling weighs GRPO's per-token loss (TRL 1.16's RLOOTrainer has no hook for "
                    "it): use algorithm: grpo"
                )
            if self.train.get("use_vllm"):
                raise ValueError(
                    "importance_sampling with train.use_vllm: TRL corrects its own vLLM sampler "
                    "(train.vllm_importance_sampling_mode, on by default); drop one of the two"
                )
            if not self.uses_tools and self.rollout is None:
                raise ValueError(
                    "importance_sampling corrects for a sampler other than the trained policy, and without "
                    "tools or rollout.server TRL samples with the trained policy itself (nothing to correct); it "
                    "applies to the multi-turn rollouts of `tools:`/`environment:` and to `rollout: {server: ...}`"
                )
            if self.train.get("top_p", 1.0) < 1.0 or self.train.get("top_k"):
                raise ValueError(
                    "importance_sampling with train.top_p / train.top_k: the tool rollout records the sampler's "
                    "log-probs before truncation, so the ratio would be biased "
                    "(https://github.com/huggingface/trl/issues/6789); drop top_p/top_k"
                )
            if self.train.get("loss_type") == "vespo":
                raise ValueError("importance_sampling: loss_type vespo weighs the ratio itself; use another loss")
        return self

    @model_validator(mode="after")
    def _server_samples_plain_turns(self):
        if self.rollout is not None:
            if self.uses_tools:
                raise ValueError(
                    "rollout.server samples single-turn completions; the multi-turn rollouts of tools sample "
                    "with this toolkit's sampler: drop one of the two"
                )
            if self.train.get("use_vllm"):
                raise ValueError("rollout.server and train.use_vllm are two vLLM samplers: drop one")
        return self

    @model_validator(mode="after")
    def _a_reward(self):
        if self.reward_model is None and not self.verifiers:
            raise ValueError("give 'verifiers' or a 'reward_model' (or both): GRPO/RLOO need a reward")
        if "reward_model_weight" in self.model_fields_set and self.reward_model is None:
            raise ValueError("'reward_model_weight' weighs a 'reward_model', and none is given")
        return self

    @model_validator(mode="after")
    def _weights_from_the_rewards(self):
        # TRL's reward_weights would replace the ones the stage derives, and could give a gold verifier weight.
        if "reward_weights" in self.train:
            raise ValueError(
                "train.reward_weights: the stage builds TRL's reward_weights from each verifier's "
                "`weight:` and `reward_model_weight` (every `gold:` verifier at 0, so it is logged and "
                "never rewarded); set those instead"
            )
        return self
