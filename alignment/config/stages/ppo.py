"""`ppo` stage config: the keys a recipe's `kind: ppo` stage accepts (torch-free; the runtime is
alignment/stages/ppo.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ..base import Strict
from ..data import DataSpec
from ..sampling import ImportanceSamplingSpec, ServerSampling, check_server, importance_sampling_field
from ..signal import PromptFilterSpec, check_prompt_filter, prompt_filter_field
from ..tools import ToolUse
from ..verifier import VerifierSpec, gold_field
from .base import LORA_KNOB, StageConfig


class RolloutSpec(ServerSampling):
    """`rollout:` the one sampling spec, with PPO's sizes: `batch_size` prompts per update on each process
    (sampled in one generate call), one completion each."""

    batch_size: int = Field(
        64,
        gt=0,
        description="prompts per update on each process, sampled in one generate call; "
        "a multiple of train.mini_batch_size",
    )
    max_new_tokens: int = Field(
        64,
        gt=0,
        description="most tokens sampled per completion; an unfinished completion "
        "loses missing_eos_penalty when that is set",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="sampling temperature (> 0); the log-probs of the ratio and the KL "
        "are taken at the same temperature, so they match the sampled distribution",
    )
    n: Literal[1] = Field(1, description="one completion per prompt (PPO's rollout is one sample per episode)")
    max_prompt_length: int | None = Field(
        None,
        gt=0,
        description="drop prompts longer than this many tokens "
        "(rendered; the count is logged); default: keep every prompt",
    )
    server: str | None = Field(
        None,
        description="sample through a vLLM server (alignment/sampling/server.py): `local` starts vLLM's "
        "OpenAI-compatible server in its own process on 127.0.0.1 (its log: logs/rollout_server.log in the "
        "stage's output), "
        "`http://host:port` uses one you run; the policy's LoRA adapter is pushed after every update "
        "(LoRA only); settings under `vllm:` (server_python, server_start_timeout, server_timeout)",
    )

    _server_value = field_validator("server")(classmethod(lambda cls, v: check_server(v)))


class TrainSpec(Strict):
    """Optimisation settings of our PPO loop (not a TRL config). Sizes are per process."""

    learning_rate: float = Field(1.0e-5, gt=0, description="AdamW learning rate of the policy (the schedule's peak)")
    critic_learning_rate: float | None = Field(
        None,
        gt=0,
        description="learning rate of the critic (value head and its adapter or backbone); default: learning_rate",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay of policy and critic")
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="learning-rate schedule "
        "over every optimizer step of the run, after "
        "the warm-up (transformers.get_scheduler)",
    )
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from 0 to the learning rate")
    ppo_epochs: int = Field(
        4,
        gt=0,
        description="passes over each rollout batch, in shuffled minibatches, per update "
        "(Schulman et al. 2017, arXiv:1707.06347)",
    )
    mini_batch_size: int = Field(16, gt=0, description="completions per optimizer step on each process")
    train_sampling_strategy: Literal["random", "bucket_by_length"] = Field(
        "random",
        description="how each PPO epoch forms its minibatches: random rows, or rows of about one length "
        "(prompt and completion within a power of two) together, the minibatches in random order, so a minibatch of "
        "short rows is not padded to a long one's length (alignment/training/buckets.py; the same option as the "
        "TRL-backed stages')",
    )
    gradient_accumulation_steps: int = Field(
        1,
        gt=0,
        description="micro-batches a minibatch is split into (one "
        "forward and backward pass each); must divide mini_batch_size",
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="clip the gradient's global norm to this before each optimizer step; null: no clipping"
    )
    cliprange: float = Field(
        0.2,
        gt=0,
        description="epsilon of the clipped surrogate: the policy ratio is clipped to "
        "[1 - eps, 1 + eps] (Schulman et al. 2017, arXiv:1707.06347, eq. 7)",
    )
    cliprange_value: float | None = Field(
        0.2,
        gt=0,
        description="values may move at most this far from the "
        "rollout's before the value loss is clipped (PPO2 value clipping); null: no "
        "clipping",
    )
    vf_coef: float = Field(0.1, ge=0, description="weight of the value loss: loss = policy loss + vf_coef x value loss")
    gamma: float = Field(
        1.0,
        ge=0,
        le=1,
        description="discount per token of GAE (Schulman et al. 2016, "
        "arXiv:1506.02438); 1: no discount over a completion's tokens",
    )
    lam: float = Field(
        0.95,
        ge=0,
        le=1,
        description="GAE lambda: 1 gives Monte-Carlo returns minus the value (high "
        "variance), 0 one-step TD errors (high bias) (Schulman et al. 2016, arXiv:1506.02438)",
    )
    whiten_advantages: bool = Field(
        True,
        description="standardise the advantages of each rollout batch (this "
        "process's) to zero mean and unit variance over its completion tokens",
    )
    reward_norm: Literal["none", "batch", "running"] = Field(
        "none",
        description="standardise the scores before the KL "
        "penalty: batch by the update's scores (all processes), "
        "running by every score so far (Welford); none: raw",
    )
    reward_clip: float | None = Field(None, gt=0, description="clip (normalised) scores to [-c, c]")
    total_updates: int | None = Field(
        None, gt=0, description="PPO updates (rollout, then optimisation) to run, instead of total_episodes"
    )
    total_episodes: int | None = Field(
        None,
        gt=0,
        description="completions to train on over all processes: updates = "
        "ceil(episodes / (rollout.batch_size x processes)); default: one pass over the "
        "prompts",
    )
    save_every: int = Field(
        50,
        gt=0,
        description="updates between resumable checkpoints (model, optimizer, scheduler, "
        "KL controller) in the stage's work folder; a rerun resumes from the newest",
    )
    logging_steps: int = Field(
        1, gt=0, description="updates between log lines; every update's metrics go to log_history.json and the trackers"
    )
    gradient_checkpointing: bool | None = Field(
        None,
        description="recompute layers in the backward pass; default: only where the estimate says the "
        "step would not fit on the GPU without it (memory.py); never on CPU",
    )


class EarlyStopSpec(Strict):
    """`early_stop:` — keep the policy where a gold measure peaked, and stop once it has not improved for a while
    (early stopping against over-optimisation of a reward model: Gao et al. 2022, arXiv:2210.10760)."""

    gold: str = Field(description="the `gold:` verifier to watch (its name as logged, gold/<name>)")
    window: int = Field(
        4,
        gt=0,
        description="updates whose gold means are averaged: one update's rollout mean is "
        "noisy (a few points at 256 rollouts), the average of the last `window` is compared",
    )
    patience: int | None = Field(
        10,
        gt=0,
        description="stop after this many updates without a new best average; "
        "null: train every update and still keep the best",
    )


class AsyncSpec(Strict):
    """`async:` generation of the next updates' rollouts on the rollout server while this update trains."""

    max_staleness: int = Field(
        0,
        ge=0,
        description="how many updates ahead the server samples (batch t+1..t+k while t trains), so how many "
        "policy versions old a sample may be when trained on; an older one is dropped and counted "
        "(stale_dropped). 0: synchronous, today's loop",
    )


class Config(StageConfig):
    kind: Literal["ppo"] = Field(
        "ppo",
        description="ppo: RLHF with PPO in our own loop on accelerate: rollouts scored "
        "by a reward model and/or verifiers, a per-token KL penalty to the start policy, GAE, "
        "clipped policy and value updates (Ziegler et al. 2019; Ouyang et al. 2022)",
    )
    memory_knobs: ClassVar[tuple[str, ...]] = (
        "`train.gradient_checkpointing: true`",
        "`train.mini_batch_size` (raise `train.gradient_accumulation_steps` to keep the step size)",
        "`rollout.batch_size` or `rollout.max_new_tokens`",
        LORA_KNOB,
    )
    policy: str | None = Field(
        None,
        description="the start policy and KL reference: '${stage}', a local path or hub "
        "id; default: the previous policy stage's output, or the recipe's model",
    )
    reward_model: str | None = Field(
        None,
        description="'${rm}' (a reward stage; a dpo stage scores as its implicit reward), a local path or hub id "
        "of a one-label "
        "sequence classifier scoring prompt + completion; give this, verifiers or both",
    )
    verifiers: list[VerifierSpec] = Field(
        default_factory=list, description="verifiers whose weighted rewards are added to the reward model's score"
    )
    gold: list[VerifierSpec] = gold_field()
    prompt_filter: PromptFilterSpec | None = prompt_filter_field()
    _prompt_filter_needs = model_validator(mode="after")(check_prompt_filter)
    early_stop: EarlyStopSpec | None = Field(
        None,
        description="save the policy of the update where a `gold:` "
        "verifier's average peaked, not the last, and stop training `patience` "
        "updates after it (the policy at the best average is kept in memory)",
    )
    data: DataSpec = Field(description="prompts (`prompt` or chat `messages`) and the columns the verifiers read")
    kl_coef: float = Field(
        0.05,
        ge=0,
        description="beta of the per-token KL penalty: r_t = -beta KL_t, plus the score "
        "at the last token (Ziegler et al. 2019, arXiv:1909.08593, eq. 2); the start value with "
        "kl_target",
    )
    kl_target: float | None = Field(
        None,
        gt=0,
        description="adaptive KL controller target (nats per sequence): "
        "kl_coef is adjusted so the KL summed over a completion's tokens tracks it "
        "(Ziegler et al. 2019); null: kl_coef stays fixed",
    )
    kl_horizon: int = Field(
        10000,
        gt=0,
        description="horizon of the adaptive KL controller, in episodes: each update "
        "multiplies kl_coef by 1 + clip(KL / kl_target - 1, -0.2, 0.2) x episodes / kl_horizon "
        "(Ziegler et al. 2019)",
    )
    kl_estimator: Literal["k1"] = Field(
        "k1",
        description="per-token KL estimate in the penalty, from d = log p - "
        "log p_ref: k1 = d, the one estimator whose expected gradient as a reward "
        "is the gradient of KL(pi || ref). k2 = d^2 / 2 and k3 = exp(-d) - 1 + d "
        '(Schulman, "Approximating KL divergence", '
        "http://joschu.net/blog/kl-approx.html) estimate the KL's value with less "
        "variance, k3 without bias, but as a reward their gradients are biased (k3's "
        "is grad KL(pi || ref) - grad KL(ref || pi), zero to first order at the "
        "reference), so they are refused here",
    )
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="how each update samples its completions")
    importance_sampling: ImportanceSamplingSpec | None = importance_sampling_field()
    async_: AsyncSpec | None = Field(
        None,
        alias="async",
        description="sample ahead on the rollout server while training (needs rollout.server and "
        "importance_sampling, which corrects for the older policy that drew the samples); logged: policy_lag "
        "(mean versions behind), stale_dropped. null: synchronous",
    )
    missing_eos_penalty: float | None = Field(
        None,
        description="subtracted from the score of unfinished completions "
        "(no end-of-turn token within max_new_tokens), as TRL's; null: none",
    )
    train: TrainSpec = Field(
        default_factory=TrainSpec, description="optimisation settings of our PPO loop (its own keys, not a TRL config)"
    )

    def start_model_key(self) -> str:
        return "policy"

    @model_validator(mode="before")
    @classmethod
    def _no_tools(cls, data):
        given = sorted(set(data) & set(ToolUse.model_fields)) if isinstance(data, dict) else []
        if given:
            raise ValueError(
                f"ppo does not take {', '.join(given)}: its rollout is one sampled turn per episode, "
                "scored once, with a value for every token. Multi-turn rollouts with tools run in rlvr "
                "(GRPO, which needs no critic over the tool results) and rsft; use one of them"
            )
        return data

    @field_validator("kl_estimator", mode="before")
    @classmethod
    def _k1_in_the_reward(cls, value):
        if value in ("k2", "k3"):
            raise ValueError(
                f"{value} is refused in the reward: the KL penalty is paid as a reward (no gradient "
                "flows through it), and then only k1's expected gradient is the gradient of "
                "KL(pi || ref); k3's is grad KL(pi || ref) - grad KL(ref || pi) and k2's "
                "grad E[d^2/2] - grad KL(pi || ref), both zero to first order at the reference, so the "
                "penalty would barely hold the policy near it. Use k1 (the default)"
            )
        return value

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
            raise ValueError(
                f"rollout.batch_size ({self.rollout.batch_size}) must be a multiple of "
                f"train.mini_batch_size ({t.mini_batch_size})"
            )
        if t.mini_batch_size % t.gradient_accumulation_steps:
            raise ValueError(
                f"train.mini_batch_size ({t.mini_batch_size}) must be a multiple of "
                f"train.gradient_accumulation_steps ({t.gradient_accumulation_steps})"
            )
        if t.total_updates is not None and t.total_episodes is not None:
            raise ValueError("give train.total_updates or train.total_episodes, not both")
        if self.async_ is not None and self.async_.max_staleness > 0:
            if self.rollout.server is None:
                raise ValueError(
                    "async.max_staleness > 0 samples ahead on the rollout server while the trainer trains: set "
                    "rollout.server (local or a URL), or max_staleness: 0"
                )
            if self.importance_sampling is None:
                raise ValueError(
                    "async.max_staleness > 0 trains on samples drawn by an older policy; without "
                    "importance_sampling they would be taken as on-policy: set importance_sampling (e.g. {})"
                )
        if self.early_stop is not None and self.early_stop.gold not in [g.name for g in self.gold]:
            raise ValueError(
                f"early_stop.gold '{self.early_stop.gold}' is not one of the stage's `gold:` verifiers "
                f"({', '.join(g.name for g in self.gold) or 'none given'}); it watches one of them"
            )
        return self
