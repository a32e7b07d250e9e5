"""`dpo` stage: direct preference optimisation with `trl.DPOTrainer`.

Loss (Rafailov et al. 2023, eq. 7), per pair (x, y+, y-):
    -log sigmoid(beta * ((log pi(y+|x) - log ref(y+|x)) - (log pi(y-|x) - log ref(y-|x))))
The reference is the starting policy: with LoRA the same model with the adapter disabled (`reference_for`);
its log-probs are precomputed when training passes over the pairs more than once (`several_passes`). Pairs
come from `data` in any usual preference format (`training/pairs.py`) or, with `on_policy:`, from the start
policy's own samples graded by a verifier; we tokenize them (`pairs.pair_token_ids`) and TRL takes the ids
as they are (`pretokenized`). `trl.DPOConfig` knobs go under `train:`. The output is also a reward model
(`models.implicit_reward`). Where chosen and rejected differ in a token or two, add the chosen answer's NLL
(RPO, Pang et al. 2024) against likelihood displacement (Razin et al. 2024):

    stages:
      dpo: {model: "${sft}", data: {task: arithmetic, n: 8000},
            train: {loss_type: [sigmoid, sft], loss_weights: [0.2, 1.0], beta: 0.1, learning_rate: 1.0e-3}}
"""

from __future__ import annotations

import copy

import datasets
from trl import DPOConfig, DPOTrainer

from ..config.base import did_you_mean
from ..data.formatting import eos_as_end_of_turn
from ..errors import UserError
from ..models.implicit_reward import write_marker
from ..models.loading import load_policy
from ..models.lora import peft_config
from ..runtime.cpu import refuse_slow_bf16
from ..runtime.dist import loads_partitioned
from ..training.buckets import training_dataset, with_length_sampling
from ..training.context import StageContext
from ..training.pairs import (
    check_stage_data,
    eval_pairs,
    pair_token_ids,
    render_pairs,
    split_eval,
    stage_pairs,
)
from ..training.rows import count_truncated, drop_overlong
from ..training.trainer import final_metrics, save_model, train, trainer_callbacks

# The loss types trl 1.16's DPOTrainer implements; it only rejects others at the first step.
LOSS_TYPES = {
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
}


def trl_config(ctx: StageContext):
    held_out = ctx.config.eval_data is not None or ctx.config.eval_fraction > 0
    args = ctx.trl_args(
        DPOConfig,
        max_length=1024,
        learning_rate=5e-6 if ctx.lora else 5e-7,
        per_device_train_batch_size=8,
        eval_strategy="epoch" if held_out else "no",
        precompute_ref_log_probs=several_passes(ctx.config.train),
    )
    unknown = [t for t in args.loss_type if t not in LOSS_TYPES]
    if unknown:
        raise UserError(
            f"{ctx.where}.train.loss_type: unknown DPO loss '{unknown[0]}'{did_you_mean(unknown[0], LOSS_TYPES)}; "
            f"choose from {', '.join(sorted(LOSS_TYPES))}."
        )
    return args


def several_passes(train: dict) -> bool:
    """Whether training goes over the pairs more than once, so computing the reference once pays.

    Then `precompute_ref_log_probs: true` is the default (`num_train_epochs` > 1, TRL's default being 3, and no
    `max_steps`): one reference pass before training instead of one per epoch pays over several epochs and not
    over one (measured: docs/performance.md), so one epoch or a fixed number of steps keeps TRL's default of
    computing them with each batch."""
    epochs = train.get("num_train_epochs", DPOConfig.__dataclass_fields__["num_train_epochs"].default)
    return (train.get("max_steps") or -1) <= 0 and epochs > 1


def check(ctx: StageContext) -> None:
    refuse_slow_bf16(ctx.config, ctx.where)
    trl_config(ctx)
    ctx.load_tokenizer()
    check_stage_data(ctx)


def reference_for(ctx: StageContext, policy, args):
    """The frozen reference model to hand TRL, or None when TRL needs none (LoRA, or precomputed log-probs).
    Where the policy may not be whole on this process before the trainer wraps it (ZeRO-3, FSDP's
    CPU-RAM-efficient loading), the reference is loaded again from the start checkpoint (TRL then shards it like the
    policy)
    instead of copied.

    The reference is the starting policy (the previous or named stage's output). With LoRA the policy is that
    model plus a fresh adapter and the reference is the same model with the adapter disabled, so no second
    copy of the weights exists; with full fine-tuning it is a frozen in-memory copy (`copy.deepcopy`), never a
    reload by hub id; with `precompute_ref_log_probs` full fine-tuning needs no copy at all."""
    if ctx.lora or args.precompute_ref_log_probs:
        return None
    if loads_partitioned():
        reference = load_policy(ctx.start_model, ctx.recipe.trust_remote_code, partitioned=True)
    else:
        reference = copy.deepcopy(policy)
    return reference.eval().requires_grad_(False)


def build_trainer(ctx: StageContext):
    """(DPOTrainer ready to train, the tokenizer to save with the policy, pair counts)."""
    args = trl_config(ctx)
    tokenizer = ctx.load_tokenizer()
    policy = load_policy(ctx.start_model, ctx.recipe.trust_remote_code, partitioned=True)
    sampler = (
        (lambda: load_policy(ctx.start_model, ctx.recipe.trust_remote_code))
        if loads_partitioned()
        else (lambda: policy)
    )
    pairs, stats = stage_pairs(ctx, tokenizer, sampler)
    if ctx.config.eval_data is not None:
        held_out = eval_pairs(ctx)
    else:
        pairs, held_out = split_eval(pairs, ctx.config.eval_fraction, ctx.seed)
    if not held_out:
        args.eval_strategy = "no"

    train_rows = within_prompt_limit(
        pair_token_ids(tokenizer, render_pairs(tokenizer, pairs)), args, f"{ctx.where}.data"
    )
    eval_rows = (
        within_prompt_limit(
            pair_token_ids(tokenizer, render_pairs(tokenizer, held_out)), args, f"{ctx.where} held-out pairs"
        )
        if held_out
        else []
    )
    # TRL cuts pairs longer than max_length (truncation_mode); a cut answer loses its end: count and say it.
    lengths = [pair_length(r) for r in train_rows]
    truncated = count_truncated(lengths, args.max_length, f"{ctx.where}.data", what="pairs")
    trainer = pretokenized(with_length_sampling(DPOTrainer))(
        model=policy,
        ref_model=reference_for(ctx, policy, args),
        args=args,
        processing_class=eos_as_end_of_turn(tokenizer),
        train_dataset=training_dataset(train_rows, args, pair_length),
        eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
        peft_config=peft_config(ctx.lora) if ctx.lora else None,
        callbacks=trainer_callbacks(ctx),
    )
    return (
        trainer,
        tokenizer,
        {**stats, "pairs_train": len(train_rows), "pairs_eval": len(eval_rows), "pairs_truncated": truncated},
    )


def pair_length(row: dict) -> int:
    """The tokens a pair takes in a batch: its prompt and the longer answer."""
    return len(row["prompt_ids"]) + max(len(row["chosen_ids"]), len(row["rejected_ids"]))


def pretokenized(base):
    """`base` (DPOTrainer) taking rows we tokenized ({'prompt_ids', 'chosen_ids', 'rejected_ids'},
    `pairs.pair_token_ids`) as they are. TRL 1.16 always tokenizes text rows itself, prompt and prompt+answer
    joined, and starts the answer where the two diverge: where tokens merge across the boundary, the prompt
    it trains on loses its last token. Its dataset preparation is skipped for our rows, and its one other
    step, dropping pairs whose prompt fills max_length, is done by `within_prompt_limit`."""

    class PretokenizedDPOTrainer(base):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if "prompt_ids" in dataset.column_names:
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    return PretokenizedDPOTrainer


def within_prompt_limit(rows: list[dict], args, where: str) -> list[dict]:
    """The pairs TRL keeps: with `truncation_mode: keep_start` a prompt of max_length tokens or more leaves no
    answer token; those pairs are dropped and said (`training.rows.drop_overlong`)."""
    if args.truncation_mode != "keep_start":
        return rows
    return drop_overlong(rows, args.max_length, where, length=lambda row: len(row["prompt_ids"]))


def run(ctx: StageContext) -> dict:
    trainer, tokenizer, counts = build_trainer(ctx)
    train(ctx, trainer)
    save_model(trainer, tokenizer, ctx.out_dir, ctx.save_dtype())
    if ctx.is_main:  # what `reward_model: ${dpo}` reads (models.implicit_reward)
        write_marker(ctx.out_dir, ctx.start_model, trainer.args.beta, ctx.recipe.stage_dir(ctx.stage_id))
    return final_metrics(trainer, **counts)
