"""Tools in the rlvr and rsft stages: the multi-turn rollout (alignment/tools/rollout.py) as TRL's GRPOTrainer
`rollout_func` (`ToolRollouts`, which says why it is our own rollout), and as rsft's sampler.

In rlvr the rollout hands TRL its ids with an `env_mask` (tool tokens get no gradient, no KL term and do not count
as completion length) and, per rollout, its final answer and counts as fields the reward functions receive. The
verifiers score the final assistant turn (`AnswerReward`); an environment's `reward()` is one more reward function
with weight 1. The counts (`tools.rollout.COUNTS`) and the share of rollouts that called a tool are logged once
per batch (`tools/...`) and summed over the training rollouts in stage.json; `tools.json` beside the checkpoint
records the tool format and the tools' schemas the policy was trained with, so it can be prompted the same way.

Limits: refused with RLOO (TRL's RLOOTrainer has no `rollout_func`), under FSDP2 and ZeRO-3, and with TRL's
`use_vllm` (`check_engine` says why); in rlvr the rollout samples with the transformers backend, whose
log-probs are those TRL's loss expects (logits / temperature).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from accelerate.utils import gather_object

from ..config.sampling import SamplingSpec
from ..errors import UserError
from ..runtime.dist import PARTITIONED, get_logger, is_main_process, launched_engine
from ..sampling import Sample
from ..tools.formats import ToolFormat
from ..tools.registry import Toolbox, resolve_tools
from ..tools.rollout import COUNTS, RolloutLimits, count_means, rollout, start
from .rewards import SOURCE_PROMPT

log = get_logger(__name__)

ANSWER = "tool_answer"  # the field holding each trajectory's final answer, forwarded to the reward functions
FIELDS = {k: f"tool_{k}" for k in COUNTS}  # the field holding each count of COUNTS, per rollout


def check_engine(config, where: str) -> None:
    """Refuse before anything loads what the rollout cannot do (`algorithm: rloo` with tools is refused when the
    recipe loads, by the rlvr config)."""
    engine = launched_engine()
    if engine in PARTITIONED:
        raise UserError(
            f"{where}: tool rollouts do not run under {engine}: each process samples from its own "
            "unwrapped model and sharded weights are not gathered for it. Launch with DDP "
            "(configs/accelerate/ddp.yaml) or a single process."
        )
    # TRL's vLLM engine samples TRL's own single-turn completions, which rollout_func replaces; rlvr has no
    # sampling block for this toolkit's vLLM backend (which runs the tool rollouts of rsft and evaluation).
    ignored = {"min_p": None, "repetition_penalty": 1.0, "generation_kwargs": None}  # key: the value that does nothing
    for key, inert in ignored.items():
        if config.train.get(key, inert) not in (inert, {}):
            raise UserError(
                f"{where}.train.{key}: with tools, rlvr's multi-turn rollouts sample with temperature, "
                f"top_p and top_k only, so `{key}` would be ignored; drop it (or sample without tools)."
            )
    if config.train.get("use_vllm"):
        raise UserError(
            f"{where}.train.use_vllm: with tools, rlvr's rollouts are this toolkit's multi-turn "
            "rollout (TRL's rollout_func), which samples with the transformers backend: TRL's vLLM engine "
            "would be started and sent the weights at every step but never sample. Set use_vllm: false "
            "(tool rollouts do sample through vLLM in rsft and evaluation suites, with "
            "`sampling: {backend: vllm}`)."
        )


class ToolRollouts:
    """Everything a GRPO stage needs for tools: the toolbox, the format, the rollout_func and the reward wrappers.

    Why our own rollout and not TRL 1.16's `tools=` / `environment_factory=`: TRL's tool loop
    (`GRPOTrainer._tool_call_loop`) is token-in token-out and masks tool results (`tool_mask`), but it parses
    calls only through a tokenizer response schema it knows for a few templates (none for ChatML without tools,
    so not SmolLM2's or the tiny model's), needs conversational prompts, bounds neither a tool's time nor its
    output, counts a malformed call as nothing (it is not parsed as a call), and has no sandbox. TRL's
    `rollout_func` hook takes ids back with an `env_mask`, which GRPO multiplies into its loss mask, and forwards
    every other field to the reward functions: our rollout plugs in there, with its limits, counts and sandboxed
    `python` tool.
    """

    def __init__(self, config, tokenizer, search_dirs: list[Path], where: str):
        check_engine(config, where)
        self.config, self.tokenizer, self.where = config, tokenizer, where
        self.toolbox: Toolbox = resolve_tools(config.tools, config.environment, search_dirs, where)
        self.format = ToolFormat.for_tokenizer(tokenizer, config.tool_format, where)
        self.format.result_text(tokenizer, [("check", "ok")])  # a template that cannot render results fails now
        self.rows: dict[str, dict] = {}
        self.totals: Counter = Counter()
        self.environment_reward = EnvironmentReward()

    @property
    def has_environment_reward(self) -> bool:
        return self.toolbox.environment is not None and callable(getattr(self.toolbox.environment, "reward", None))

    def prepare(self, rows: list[dict]) -> list[dict]:
        """Rows with `prompt` rendered with the tools described; remembered by that text, which is all TRL
        hands the rollout. With an environment, rows must differ in their prompt (reset gets the row)."""
        prepared = []
        for row in rows:
            text = self.format.render_prompt(
                self.tokenizer, row[SOURCE_PROMPT], self.toolbox.schemas, self.config.describe_tools
            )
            other = self.rows.setdefault(text, row)
            if other is not row and self.toolbox.environment is not None and other != row:
                raise UserError(
                    f"{self.where}.data: two rows have the same prompt but different columns; with an "
                    "`environment:` each prompt must be unique, as the row reaches reset(row) through it."
                )
            prepared.append({**row, "prompt": text})
        return prepared

    def __call__(self, prompts: list[str], trainer) -> dict:
        """TRL's rollout_func: one trajectory per prompt (TRL repeats each prompt num_generations times)."""
        args = trainer.args
        settings = SamplingSpec(
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k or 0,
            batch_size=max(len(prompts), 1),
        )
        rows = [self.rows[p] for p in prompts]
        trajectories = start(
            self.tokenizer,
            self.format,
            self.toolbox,
            [r[SOURCE_PROMPT] for r in rows],
            rows,
            self.config.describe_tools,
        )
        model = trainer.accelerator.unwrap_model(trainer.model)
        rollout(
            model,
            self.tokenizer,
            trajectories,
            self.format,
            settings,
            RolloutLimits.of(self.config, args.max_completion_length),
        )
        if trainer.model.training:
            for t in trajectories:
                self.totals.update(
                    {k: t.counts[k] for k in COUNTS}, rollouts=1, with_calls=int(t.counts["tool_calls"] > 0)
                )
        return {
            "prompt_ids": [t.prompt_ids for t in trajectories],
            "completion_ids": [t.ids for t in trajectories],
            "logprobs": [t.logprobs for t in trajectories],
            "env_mask": [t.mask for t in trajectories],
            ANSWER: [t.answer for t in trajectories],
            "environment_reward": [t.reward for t in trajectories],
            **{FIELDS[k]: [t.counts[k] for t in trajectories] for k in COUNTS},
        }

    def rewards(self, verifier_rewards: list) -> list:
        """TRL reward functions: each verifier on the final answers, plus the environment's reward if any. TRL
        calls every reward function on each batch, so only the first logs the batch's counts."""
        wrapped = [AnswerReward(reward, log_counts=i == 0) for i, reward in enumerate(verifier_rewards)]
        return wrapped + self.extra_rewards

    @property
    def extra_rewards(self) -> list:
        """The rewards the tools add to the stage's (the environment's, weight 1): a `GroupSignal` counts them."""
        return [self.environment_reward] if self.has_environment_reward else []

    def metrics(self) -> dict:
        """For stage.json: counts summed over the training rollouts of every process (each samples its own
        prompts), and the share of rollouts that called a tool. Every process must call it (a collective)."""
        totals = sum(gather_object([self.totals]), Counter())
        total = totals["rollouts"]
        found = {f"tools/{k}": totals[k] for k in COUNTS}
        return {**found, "tools/rollouts": total, "tools/call_rate": totals["with_calls"] / total if total else 0.0}

    def save(self, out_dir: Path) -> None:
        """tools.json beside the checkpoint: how the policy was prompted and how it calls tools (written by the
        main process only, as the checkpoint is)."""
        if not is_main_process():
            return
        record = {
            "tool_format": self.format.style,
            "native_template": self.format.native,
            "tools": self.toolbox.schemas,
            "max_turns": self.config.max_turns,
            "described_in_prompt": self.config.describe_tools,
        }
        (Path(out_dir) / "tools.json").write_text(json.dumps(record, indent=2))


class AnswerReward:
    """A verifier reward that scores each trajectory's final answer; with `log_counts`, it also logs the batch's
    tool counts (`tools/<count>`: means per rollout, and `tools/call_rate`)."""

    def __init__(self, inner, log_counts: bool = True):
        self.inner, self.weight, self.__name__ = inner, inner.weight, inner.__name__
        self.log_counts = log_counts

    def __call__(self, prompts=None, completions=None, **kwargs):
        answers = kwargs.pop(ANSWER, None)
        fields = {k: kwargs.pop(FIELDS[k], None) for k in COUNTS}
        kwargs.pop("environment_reward", None)
        log_metric = kwargs.get("log_metric")
        if self.log_counts and callable(log_metric) and fields["turns"]:
            rows = [dict(zip(COUNTS, values)) for values in zip(*fields.values())]
            for key, mean in count_means(rows).items():
                log_metric(f"tools/{key}", mean)
        return self.inner(prompts=prompts, completions=answers if answers is not None else completions, **kwargs)


class EnvironmentReward:
    """The environment's reward() of each finished rollout as a TRL reward function of weight 1 (TRL logs it as
    rewards/environment_reward); like every reward of the stage, it reports to the stage's `GroupSignal`, so a group
    is only counted without variance when its total reward, this one included, is the same."""

    __name__ = "environment_reward"
    weight = 1.0

    def __init__(self):
        self.signal = None  # set by GroupSignal

    def __call__(self, prompts=None, completions=None, environment_reward=None, completion_ids=None, **kwargs):
        if environment_reward is None:  # never a silent 0: the rollout_func's field did not reach the reward call
            raise RuntimeError("the rollout's environment_reward field did not reach the reward function")
        rewards = [float(r or 0.0) for r in environment_reward]
        if self.signal is not None:
            self.signal.record(self, rewards, completion_ids, kwargs.get("log_metric"))
        return rewards


def sample_trajectories(
    model,
    tokenizer,
    tools: ToolRollouts,
    prompts: list,
    rows: list[dict],
    settings: SamplingSpec,
    progress: str | None = None,
) -> tuple[list[Sample], list[dict]]:
    """`settings.n` multi-turn rollouts per prompt (rsft): one Sample per rollout holding its final answer
    (`finished` when it ended with an answer), and per rollout the token row SFT trains on
    (`input_ids`, `completion_mask` = 1 on the model's own tokens only: tool results are out of the loss) with
    the trajectory's record. `settings.max_new_tokens` bounds the whole trajectory after the prompt."""
    n = settings.n
    repeated = [(i, p, r) for i, (p, r) in enumerate(zip(prompts, rows)) for _ in range(n)]
    trajectories = start(
        tokenizer,
        tools.format,
        tools.toolbox,
        [p for _, p, _ in repeated],
        [r for _, _, r in repeated],
        tools.config.describe_tools,
    )
    rollout(
        model,
        tokenizer,
        trajectories,
        tools.format,
        settings,
        RolloutLimits.of(tools.config, settings.max_new_tokens),
        progress,
    )
    samples = [
        Sample(i, t.answer, [x for x, m in zip(t.ids, t.mask) if m], finished=t.stop_reason == "answer")
        for (i, _, _), t in zip(repeated, trajectories)
    ]
    token_rows = [
        {
            "input_ids": t.prompt_ids + t.ids,
            "completion_mask": [0] * len(t.prompt_ids) + t.mask,
            "trajectory": t.record(),
        }
        for t in trajectories
    ]
    return samples, token_rows
