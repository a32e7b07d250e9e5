"""`rsft` stage config: the keys a recipe's `kind: rsft` stage accepts (torch-free; the runtime is
alignment/stages/rsft.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from ..data import DataSpec
from ..sampling import ServerSampling
from ..signal import PromptFilterSpec, check_prompt_filter, prompt_filter_field
from ..tools import ToolUse
from ..verifier import VerifierSpec, gold_field
from .base import StageConfig


class RsftSampling(ServerSampling):
    n: int = Field(8, gt=0, description="completions sampled per prompt (the N of best-of-N)")
    server: Literal["local"] | None = Field(
        None,
        description="`local`: each round samples through vLLM's OpenAI-compatible server in its own process, "
        "started on the round's policy (its merged weights) and stopped after the round's sampling "
        "(alignment/sampling/server.py; log: logs/rollout_server.log in the stage's output). A server you run "
        "cannot load each round's policy, so no URL here",
    )

    max_new_tokens: int = Field(
        256,
        gt=0,
        description="most tokens sampled per completion; one cut off without an end-of-turn token is never selected",
    )


class Config(StageConfig, ToolUse):
    kind: Literal["rsft"] = Field(
        "rsft",
        description="rsft: rejection-sampling fine-tuning: sample N completions per "
        "prompt, keep the best, SFT on them (trl.SFTTrainer), for several rounds (expert "
        "iteration; RAFT, Dong et al. 2023; ReST-EM, Singh et al. 2023)",
    )
    memory_knobs: ClassVar[tuple[str, ...]] = ("`sampling.batch_size`", *StageConfig.memory_knobs)
    data: DataSpec = Field(description="prompts (`prompt` or chat `messages`) and the columns the verifiers read")
    verifiers: list[VerifierSpec] = Field(
        default_factory=list,
        description="verifiers scoring each sample (weighted "
        "sum); without a threshold a sample must pass every one; give these or "
        "reward_model",
    )
    reward_model: str | None = Field(
        None,
        description="'${rm}' (a reward stage; a dpo stage scores as its implicit reward), a local path or hub id "
        "that scores "
        "each sample; give this or verifiers",
    )
    gold: list[VerifierSpec] = gold_field()
    prompt_filter: PromptFilterSpec | None = prompt_filter_field()
    _prompt_filter_needs = model_validator(mode="after")(check_prompt_filter)
    rounds: int = Field(
        1,
        gt=0,
        description="rounds of sample, select, fine-tune; each samples from the policy the round before trained",
    )
    prompts_per_round: int | None = Field(
        None,
        gt=0,
        description="prompts sampled per round, consecutive slices of the "
        "data wrapping around; default: every prompt, every round",
    )
    max_pass_rate: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="with verifiers: a prompt whose samples pass at a higher rate than this in a round gives that "
        "round no training row (counted as `solved_skipped`). The policy already answers such a prompt, and "
        "training on its answer sharpens what greedy decoding gets right anyway; the round trains on the prompts "
        "it still gets wrong some of the time, at the cost of the rows that keep what it knows in place (measured in "
        "docs/tuning.md#rsft). Default: every covered prompt gives its selection",
    )
    sampling: RsftSampling = Field(default_factory=RsftSampling, description="how each round samples (n per prompt)")
    select: Literal["best_of_n", "top_k", "threshold"] = Field(
        "best_of_n",
        description="what is kept per prompt once "
        "empty, unfinished and duplicate samples are dropped: "
        "best_of_n the best sample, top_k the k best, threshold "
        "every eligible one",
    )
    k: int = Field(1, gt=0, description="completions kept per prompt with select: top_k")
    threshold: float | None = Field(
        None,
        description="minimum score to keep a sample (with verifiers: their weighted "
        "sum, and it must parse, instead of passing every one); required for select: "
        "threshold with a reward model",
    )
    rm_batch_size: int = Field(16, gt=0, description="sequences per reward-model forward pass when scoring samples")
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="regularized best-of-n (Jinnai et al. 2024, arXiv:2404.01054): "
        "candidates are ranked by score + kl_coef * log p(y|x), p the policy that sampled them at "
        "temperature 1 (the mode of the KL-regularised optimum p * exp(score / kl_coef) among them), "
        "so an unlikely sample needs a higher score to win; 0: by the score alone",
    )

    @model_validator(mode="after")
    def _one_scorer(self):
        if bool(self.verifiers) == (self.reward_model is not None):
            raise ValueError("give exactly one of 'verifiers' (programmatic checks) or 'reward_model' to score samples")
        if self.select == "threshold" and self.threshold is None and self.reward_model is not None:
            raise ValueError("select: threshold with a reward model needs 'threshold' (the minimum score)")
        if "k" in self.model_fields_set and self.select != "top_k":
            raise ValueError(f"'k' only applies to select: top_k (select is {self.select})")
        if self.kl_coef and self.select == "threshold":
            raise ValueError(
                "'kl_coef' ranks candidates, and select: threshold keeps every one above the threshold "
                "whatever its rank; use best_of_n or top_k"
            )
        if self.max_pass_rate is not None and self.reward_model is not None:
            raise ValueError(
                "'max_pass_rate' needs verifiers (a sample passes when every verifier passes it); a reward "
                "model's scores have no pass rate"
            )
        if self.kl_coef and self.uses_tools:
            raise ValueError(
                "'kl_coef' is not implemented for rollouts with tools (their log-probs cover the model's "
                "own turns only); leave it at 0 there"
            )
        return self

    @model_validator(mode="after")
    def _server_samples_plain_turns(self):
        if self.sampling.server is not None and self.uses_tools:
            raise ValueError(
                "sampling.server samples single-turn completions; the multi-turn rollouts of tools sample with "
                "this toolkit's sampler: drop one of the two"
            )
        return self

    @model_validator(mode="after")
    def _no_eval_data(self):
        if self.eval_data is not None:  # each round trains on its own selected samples; nothing would read it
            raise ValueError("'eval_data' is not used by rsft; evaluate the result with the recipe's evaluate block")
        return self
