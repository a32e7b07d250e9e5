"""`rlvr` stage: RL from verifiable rewards with `trl.GRPOTrainer` (or `trl.RLOOTrainer`).

For each prompt the policy samples `num_generations` completions; each verifier in `verifiers:` scores
them (`alignment/verifier_rewards.py` adapts a verifier to TRL's reward-function call) and the weighted sum is
the reward. GRPO normalises rewards within each prompt's group (Shao et al. 2024, eq. 3, DeepSeekMath);
`algorithm: rloo` uses the leave-one-out baseline instead (Ahmadian et al. 2024). Both keep a KL
penalty to the starting policy: on by default here (`beta: 0.04`) although TRL's GRPO default is 0;
`train: {beta: 0}` turns it off. With LoRA the reference is the same model with the adapter disabled.
A group whose completions all score the same has no advantage to learn from: stage.json's
`zero_variance_groups` is their share over the run, and above half the stage warns.

Data: prompts (`prompt` or chat `messages`; a final assistant turn is dropped) plus the columns the
verifiers read (e.g. `answer`). Prompts are rendered with `formatting.render_prompt` and given to TRL
as plain strings, so TRL applies no chat template of its own (a BOS that the tokenizer adds by itself
is dropped from the rendered text, or Llama-3-style tokenizers would see two: `without_leading_bos`),
and generation stops at the template's end-of-turn token. Recipe keys under `train:` go verbatim to `trl.GRPOConfig` / `trl.RLOOConfig`;
`per_device_train_batch_size` counts completions, so `per_device_train_batch_size x processes x
steps_per_generation` must be a multiple of `num_generations`.

Sampling with vLLM is TRL's own: `train: {use_vllm: true, vllm_mode: colocate}` (an engine beside the
policy on each GPU, weights synced by TRL) or `vllm_mode: server` (`trl vllm-serve` on other GPUs). The
stage checks that vllm is installed before anything loads, and tells vLLM to stop at the chat
template's end-of-turn token (`generation_kwargs.stop_token_ids`), which it would otherwise read from
the checkpoint's generation_config.json, where base models name only their EOS token.

    stages:
      rlvr:
        model: ${sft}
        data: {task: arithmetic, split: train, n: 2000}
        verifiers: [arithmetic]           # or [{name: my_verifiers:brevity, weight: 0.2, options: {...}}]
        train: {max_steps: 200, num_generations: 8, learning_rate: 1.0e-6, max_completion_length: 256}
"""

from __future__ import annotations

import logging
import os
from typing import ClassVar, Literal

from pydantic import Field

from ..config.data import DataSpec
from ..config.stage import BATCH_KNOB, LORA_KNOB, StageConfig
from ..config.verifier import VerifierSpec
from ..errors import UserError
from .base import StageContext

DEFAULT_BETA = 0.04  # KL coefficient to the starting policy (TRL's GRPO default 0 would drop the reference)
# Above this share of prompt groups without reward variance, most of the run had no verifier signal.
ZERO_VARIANCE_WARNING = 0.5

log = logging.getLogger(__name__)


class Config(StageConfig):
    kind: Literal["rlvr"] = "rlvr"
    memory_knobs: ClassVar[tuple[str, ...]] = (
        "`train.gradient_checkpointing: true`", BATCH_KNOB, "`train.max_completion_length`", LORA_KNOB)
    data: DataSpec
    algorithm: Literal["grpo", "rloo"] = "grpo"
    verifiers: list[VerifierSpec] = Field(min_length=1, description="reward = weighted sum of these verifiers")


def trainer_classes(algorithm: str):
    if algorithm == "rloo":
        from trl import RLOOConfig, RLOOTrainer

        return RLOOConfig, RLOOTrainer
    from trl import GRPOConfig, GRPOTrainer

    return GRPOConfig, GRPOTrainer


def stage_defaults(config: Config) -> dict:
    return {"beta": DEFAULT_BETA, "num_generations": 8, "per_device_train_batch_size": 8, "max_completion_length": 256,
            "disable_dropout": True, "reward_weights": [v.weight for v in config.verifiers]}


def check_group_size(ctx: StageContext) -> None:
    """TRL's own check says 'generation_batch_size must be divisible by num_generations'; this names the
    recipe keys behind that number and suggests a fix."""
    knobs = {**stage_defaults(ctx.config), **ctx.config.train}
    n = knobs.get("num_generations") or 0
    per_device = knobs.get("per_device_train_batch_size", 8)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    steps = knobs.get("steps_per_generation") or knobs.get("gradient_accumulation_steps", 1)
    if not isinstance(n, int) or n < 2:
        raise UserError(f"{ctx.where}.train.num_generations is {n!r}: GRPO/RLOO compare completions of the same "
                        "prompt, so it needs at least 2 per prompt (8 is usual).")
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
    """TRL raises a bare ImportError after the models are loaded; say it first, with the key."""
    from ..config.sampling import vllm_missing

    if ctx.config.train.get("use_vllm") and (why := vllm_missing("`use_vllm: true`", "set `use_vllm: false`")):
        raise UserError(f"{ctx.where}.train.use_vllm: {why}")


def stop_vllm_at_end_of_turn(args, tokenizer, model=None) -> None:
    """vLLM takes its stop tokens from generation_config.json, not from the model we adjusted; pass them."""
    from ..sampling.samples import stop_token_ids

    if getattr(args, "use_vllm", False):
        kwargs = dict(args.generation_kwargs or {})
        kwargs.setdefault("stop_token_ids", stop_token_ids(tokenizer, model))
        args.generation_kwargs = kwargs


def trl_config(ctx: StageContext):
    check_group_size(ctx)
    check_vllm(ctx)
    config_class, _ = trainer_classes(ctx.config.algorithm)
    return ctx.trl_args(config_class, **stage_defaults(ctx.config))


def prompt_rows(ctx: StageContext, tokenizer, spec: DataSpec, key: str, verifiers) -> list[dict]:
    """Rows with `prompt` rendered to text and the data's own prompt kept in SOURCE_PROMPT for verifiers."""
    from ..formatting import render_prompt
    from ..prompts import prompt_of
    from ..verifier_rewards import SOURCE_PROMPT

    rows = []
    for row in ctx.load_prompt_rows(spec, key, verifiers):
        source = prompt_of(row)  # `messages` lose a final assistant turn: a reference answer is not the prompt
        rows.append({**row, "prompt": without_leading_bos(tokenizer, render_prompt(tokenizer, source)),
                     SOURCE_PROMPT: source})
    return rows


def without_leading_bos(tokenizer, prompt: str) -> str:
    """TRL's GRPO/RLOO tokenize plain-string prompts with the tokenizer's special tokens on (its SFT and
    DPO trainers turn them off), so a tokenizer that adds a BOS itself (Llama 3) would put a second one
    before the chat template's own. Drop the template's; the tokenizer adds it back, once."""
    bos = tokenizer.bos_token
    if bos and prompt.startswith(bos) and tokenizer("")["input_ids"][:1] == [tokenizer.bos_token_id]:
        return prompt[len(bos):]
    return prompt


def stop_at_end_of_turn(model, tokenizer) -> None:
    """TRL stops sampling at `model.generation_config.eos_token_id` (+ the tokenizer's EOS); make that the stop
    set of every other sampler, which adds the chat template's end-of-turn token (it differs from EOS for base
    models: Qwen2.5's <|im_end|> vs <|endoftext|>)."""
    from ..sampling.samples import stop_token_ids

    config = model.generation_config
    config.eos_token_id = stop_token_ids(tokenizer, model)
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id


def check(ctx: StageContext) -> None:
    from ..verifier_rewards import resolve_all

    trl_config(ctx)
    verifiers = resolve_all(ctx.config.verifiers, [ctx.recipe.base_dir], ctx.where)
    tokenizer = ctx.load_tokenizer()
    prompt_rows(ctx, tokenizer, ctx.config.data, "data", verifiers)
    if ctx.config.eval_data:
        prompt_rows(ctx, tokenizer, ctx.config.eval_data, "eval_data", verifiers)


def run(ctx: StageContext) -> dict:
    import datasets

    from ..models import load_policy, peft_config
    from ..sampling.samples import checkpoint_sampling_defaults_off
    from ..trainer_utils import final_metrics, save_model, train, trainer_callbacks
    from ..verifier_rewards import build_rewards

    args = trl_config(ctx)
    _, trainer_class = trainer_classes(ctx.config.algorithm)
    rewards = build_rewards(ctx.config.verifiers, [ctx.recipe.base_dir], ctx.where)
    verifiers = [r.verifier for r in rewards]
    tokenizer = ctx.load_tokenizer()
    model = load_policy(ctx.start_model, ctx.recipe.trust_remote_code, partitioned=True)
    stop_at_end_of_turn(model, tokenizer)
    stop_vllm_at_end_of_turn(args, tokenizer, model)
    train_rows = prompt_rows(ctx, tokenizer, ctx.config.data, "data", verifiers)
    eval_rows = None
    if ctx.config.eval_data:
        eval_rows = prompt_rows(ctx, tokenizer, ctx.config.eval_data, "eval_data", verifiers)
    trainer = trainer_class(
        model=model, reward_funcs=rewards, args=args, processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(train_rows),
        eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
        peft_config=peft_config(ctx.lora) if ctx.lora else None, callbacks=trainer_callbacks(ctx),
    )
    with checkpoint_sampling_defaults_off(trainer.model):  # TRL leaves min_p etc. to the checkpoint's defaults
        train(ctx, trainer)
    save_model(trainer, tokenizer, ctx.out_dir, ctx.save_dtype())
    totals = {k: v for r in rewards for k, v in r.totals().items()}
    result = final_metrics(trainer, rows=len(train_rows), **totals)
    report_zero_variance(ctx, result["metrics"], result["log_history"])
    return result


def zero_variance_share(history: list[dict]) -> float | None:
    """Share of prompt groups whose completions all got the same total reward, over the whole run: the mean
    of TRL's per-logging-step `frac_reward_zero_std` (training entries; eval's are `eval_...`). None when
    TRL logged none. Such a group's advantages are all 0 (GRPO: r - mean over std; RLOO: r minus the
    leave-one-out mean), so it adds nothing but the KL term to the gradient. Caveats of TRL's number: under
    `scale_rewards: batch` GRPO tests the batch's spread, not each group's, and RLOO subtracts the KL
    penalty before testing, so with `beta > 0` it reads near 0 even when the verifiers gave equal rewards."""
    values = [entry["frac_reward_zero_std"] for entry in history if "frac_reward_zero_std" in entry]
    return sum(values) / len(values) if values else None


def report_zero_variance(ctx: StageContext, metrics: dict, history: list[dict]) -> None:
    """`zero_variance_groups` in the stage's metrics, and a warning when most groups taught nothing."""
    share = zero_variance_share(history)
    if share is None:
        return
    metrics["zero_variance_groups"] = share
    if share > ZERO_VARIANCE_WARNING:
        log.warning(
            f"[{ctx.stage_id}] {share:.0%} of prompt groups got the same reward for every one of their "
            "completions (zero_variance_groups in stage.json): those groups give GRPO/RLOO no gradient, so the "
            "policy barely moved. Give prompts the policy solves some of the time (harder ones if it solves "
            "them all, easier if none), sample more diversely (a higher train.temperature), or raise "
            "train.num_generations.")
