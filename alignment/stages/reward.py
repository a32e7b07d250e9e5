"""`reward` stage: a Bradley-Terry reward model trained with `trl.RewardTrainer`.

The model is the start policy loaded as a one-label sequence classifier (a fresh scalar `score`
head on the policy's body, trained in full also with LoRA: `load_classifier`), trained on chosen/rejected
pairs with -log sigmoid(r(x, y+) - r(x, y-)) (Ouyang et al. 2022, eq. 1). Pairs come from `data` in any
usual preference format (`training/pairs.py`) or, with `on_policy: {verifier: ..., n: 8}`, from the start
policy's own samples graded by a verifier (`with_data_pairs: true` adds the data's own). Pairs are rendered
with the shared convention and tokenized by us, so the model learns on exactly the text
`scoring.score_texts` scores later (ppo, evaluation). `score_learning_rate` gives the fresh head its own
rate (`trainer_class` says why). Pairwise accuracy and mean margin are measured on `eval_data`, or on
`eval_fraction` of the pairs held out. The output is merged weights (`models.load_reward_model` loads it)
with the adapter in `adapter/`; `ensemble: {members: k}` trains k of them (`run`).

    stages:
      rm: {kind: reward, model: "${sft}", data: {task: arithmetic, n: 8000}, train: {learning_rate: 1.0e-3}}
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import datasets
import transformers
from accelerate import PartialState
from transformers import AutoModelForSequenceClassification
from trl import RewardConfig, RewardTrainer
from trl.trainer.reward_trainer import suppress_seqcls_warning

from ..errors import UserError
from ..models.loading import (
    default_dtype,
    is_adapter_dir,
    load_policy,
    load_reward_model,
)
from ..models.lora import peft_config
from ..models.reward_ensemble import MARKER, member_dir, member_statistics, write_marker
from ..models.saving import save_checkpoint
from ..runtime.cpu import refuse_slow_bf16
from ..runtime.dist import log_share
from ..training.buckets import training_dataset, with_length_sampling
from ..training.context import StageContext
from ..training.pairs import (
    check_stage_data,
    eval_pairs,
    render_pairs,
    reward_token_ids,
    split_eval,
    stage_pairs,
)
from ..training.scoring import score_ids
from ..training.trainer import final_metrics, save_model, train, trainer_callbacks

log = logging.getLogger(__name__)


def trl_config(ctx: StageContext):
    held_out = ctx.config.eval_data is not None or ctx.config.eval_fraction > 0
    return ctx.trl_args(
        RewardConfig,
        max_length=1024,
        learning_rate=1e-4 if ctx.lora else 1e-5,
        per_device_train_batch_size=8,
        eval_strategy="epoch" if held_out else "no",
    )


def check(ctx: StageContext) -> None:
    refuse_slow_bf16(ctx.config, ctx.where)
    trl_config(ctx)
    ctx.load_tokenizer()
    check_stage_data(ctx)


def load_classifier(ctx: StageContext, tokenizer, seed: int | None = None):
    """The start model with a one-label head (fresh for a policy, kept for a reward model).

    With LoRA the adapter is built with `task_type="SEQ_CLS"`: peft then trains the new score head in full
    (modules_to_save); a frozen random head would make the reward meaningless."""
    if is_adapter_dir(ctx.start_model):
        raise UserError(
            f"{ctx.where}.model: '{ctx.start_model}' is a LoRA adapter folder; merge it first "
            "(`align merge`) and start the reward model from the merged checkpoint."
        )
    transformers.set_seed(ctx.seed if seed is None else seed)  # the fresh head's initialisation
    with suppress_seqcls_warning():
        model = AutoModelForSequenceClassification.from_pretrained(
            ctx.start_model,
            num_labels=1,
            dtype=default_dtype(),
            trust_remote_code=ctx.recipe.trust_remote_code,
            use_safetensors=True,
        )
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def datasets_for(ctx: StageContext, tokenizer) -> tuple[list[dict], list[dict], dict]:
    """(train pairs, held-out pairs, counts): raw {'prompt', 'chosen', 'rejected'} rows."""
    pairs, stats = stage_pairs(ctx, tokenizer, lambda: load_policy(ctx.start_model, ctx.recipe.trust_remote_code))
    if ctx.config.eval_data is not None:
        return pairs, eval_pairs(ctx), stats
    train, held_out = split_eval(pairs, ctx.config.eval_fraction, ctx.seed)
    return train, held_out, stats


@dataclass
class Pairs:
    """The tokenized pairs every member of the stage trains and is measured on, and their counts."""

    train: list[dict]
    held_out: list[dict]
    counts: dict


def tokenized_pairs(ctx: StageContext, tokenizer, max_length: int | None) -> Pairs:
    train, held_out, stats = datasets_for(ctx, tokenizer)
    train_ids, dropped_train = within_max_length(
        reward_token_ids(tokenizer, render_pairs(tokenizer, train)), max_length, f"{ctx.where}.data"
    )
    eval_ids, dropped_eval = within_max_length(
        reward_token_ids(tokenizer, render_pairs(tokenizer, held_out)), max_length, f"{ctx.where} held-out pairs"
    )
    return Pairs(
        train_ids,
        eval_ids,
        {
            **stats,
            "pairs_train": len(train_ids),
            "pairs_eval": len(eval_ids),
            "pairs_dropped_too_long": dropped_train + dropped_eval,
        },
    )


def build_trainer(ctx: StageContext, pairs: Pairs | None = None, member: int = 0):
    """The RewardTrainer of ensemble member `member` (0: the stage's only or first reward model), ready to train,
    and the pair counts. Member i starts from seed recipe seed + i (head initialisation, batch order) and keeps
    its trainer checkpoints in a folder of its own, so a resumed stage resumes each member where it stopped."""
    args = trl_config(ctx)
    tokenizer = ctx.load_tokenizer()
    pairs = pairs or tokenized_pairs(ctx, tokenizer, args.max_length)
    if member:
        args.seed = args.data_seed = ctx.seed + member
        args.output_dir = f"{args.output_dir}-member-{member}"
    if not pairs.held_out:
        args.eval_strategy = "no"
    trainer = trainer_class(with_length_sampling(RewardTrainer), ctx.config.score_learning_rate)(
        model=load_classifier(ctx, tokenizer, args.seed),
        args=args,
        processing_class=tokenizer,
        train_dataset=training_dataset(pairs.train, args, lambda p: max(len(p["chosen_ids"]), len(p["rejected_ids"]))),
        eval_dataset=datasets.Dataset.from_list(pairs.held_out) if pairs.held_out else None,
        peft_config=peft_config(ctx.lora, task_type="SEQ_CLS") if ctx.lora else None,
        callbacks=trainer_callbacks(ctx),
    )
    return trainer, pairs.counts


def within_max_length(pairs: list[dict], max_length: int | None, where: str) -> tuple[list[dict], int]:
    """The tokenized pairs whose chosen and rejected texts both fit `max_length`, and how many did not. TRL
    drops the longer ones itself, with only a progress bar to show for it: here they are counted and said,
    and a share above a few percent is a warning. All dropped is an error."""
    if not max_length or not pairs:
        return pairs, 0
    kept = [p for p in pairs if max(len(p["chosen_ids"]), len(p["rejected_ids"])) <= max_length]
    dropped = len(pairs) - len(kept)
    if not kept:
        raise UserError(
            f"{where}: all {len(pairs)} pairs are longer than train.max_length={max_length} tokens; "
            "raise it or shorten the data."
        )
    if dropped:
        log_share(
            log,
            dropped,
            len(pairs),
            f"[{where}] dropped {dropped} of {len(pairs)} pairs "
            f"({dropped / len(pairs):.0%}) longer than train.max_length={max_length} tokens",
        )
    return kept, dropped


SCORE_HEADS = ("score", "classifier")  # the one-label head of AutoModelForSequenceClassification, by architecture


def is_score_head(name: str) -> bool:
    return any(part in SCORE_HEADS for part in name.split("."))


def trainer_class(base, score_learning_rate: float | None):
    """`base` (RewardTrainer), whose optimizer gives the score head its own learning rate when one is set.

    `score_learning_rate` gives the fresh head a higher rate than the pretrained body: on the arithmetic pairs
    (answers one digit apart) one rate for both stalled whatever the rate, epochs or LoRA rank, where a fast
    head over a slow body learns them (recipes/arithmetic-reward-model.yaml; measured: docs/results.md)."""
    if score_learning_rate is None:
        return base

    class ScoreHeadRateTrainer(base):
        def create_optimizer(self, model=None):
            optimizer = super().create_optimizer(model)
            give_score_head_its_rate(optimizer, self.model if model is None else model, score_learning_rate)
            return optimizer

    return ScoreHeadRateTrainer


def give_score_head_its_rate(optimizer, model, learning_rate: float) -> None:
    """Move the score head's parameters out of the optimizer's groups into groups of their own at
    `learning_rate` (weight decay kept per group). Called before the first step, so no state moves."""
    head = {id(p) for n, p in model.named_parameters() if p.requires_grad and is_score_head(n)}
    if not head:
        raise UserError(
            "score_learning_rate is set, but the model has no trainable score head "
            f"(looked for parameters under {' or '.join(SCORE_HEADS)})."
        )
    for group in list(optimizer.param_groups):
        moved = [p for p in group["params"] if id(p) in head]
        if moved and group["lr"] != learning_rate:  # (a second call finds the head in its own groups)
            group["params"] = [p for p in group["params"] if id(p) not in head]
            optimizer.add_param_group(
                {**{k: v for k, v in group.items() if k != "params"}, "params": moved, "lr": learning_rate}
            )
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]


def save_reward_model(model, tokenizer, out_dir, dtype=None) -> None:
    """Merged weights with one label and the pad token set (the head pools at the last non-pad token)."""
    model.config.num_labels = 1
    model.config.pad_token_id = tokenizer.pad_token_id
    save_checkpoint(model, tokenizer, out_dir, dtype)


def run(ctx: StageContext) -> dict:
    """Train the reward model (or each member of an ensemble); returns the stage's metrics.

    With `ensemble: {members: k}` the pairs are built once and k reward models train on them, member i from
    seed `seed + i`; member 0 is the stage's checkpoint, the others go to `members/`, and
    `reward_ensemble.json` tells readers to combine them (`models/reward_ensemble.py`)."""
    ensemble = ctx.config.ensemble
    pairs = tokenized_pairs(ctx, ctx.load_tokenizer(), trl_config(ctx).max_length)
    trainer, counts = build_trainer(ctx, pairs)
    result = train_member(ctx, trainer, counts, ctx.out_dir)
    if ensemble is None:
        return result
    members = member_metrics(0, result["metrics"])
    for member in range(1, ensemble.members):
        del trainer
        trainer, _ = build_trainer(ctx, pairs, member)
        if ctx.is_main:
            log.info(f"[{ctx.where}] ensemble member {member + 1} of {ensemble.members} (seed {trainer.args.seed})")
        done = train_member(ctx, trainer, counts, member_dir(ctx.out_dir, member))
        members.update(member_metrics(member, done["metrics"]))
    if ctx.is_main:
        write_marker(ctx.out_dir, ensemble.members, ensemble.combine, ensemble.penalty, standardisation(ctx, pairs))
    result["metrics"].update(members)
    PartialState().wait_for_everyone()  # the members and the marker are on disk
    if pairs.held_out and ctx.is_main:
        result["metrics"].update(ensemble_accuracy(ctx, pairs.held_out))
    return result


def member_metrics(member: int, metrics: dict) -> dict:
    """One member's held-out figures, named `member_<i>/eval_accuracy` and `member_<i>/eval_margin`."""
    return {f"member_{member}/{k}": metrics[k] for k in ("eval_accuracy", "eval_margin") if k in metrics}


def train_member(ctx: StageContext, trainer, counts: dict, out_dir) -> dict:
    """Train one reward model, measure it on the held-out pairs, save it to `out_dir`."""
    train(ctx, trainer)
    held_out = {}
    if trainer.eval_dataset is not None:
        scores = trainer.evaluate()
        held_out = {"eval_accuracy": scores.get("eval_accuracy"), "eval_margin": scores.get("eval_margin")}
        if ctx.is_main:
            log.info(
                f"[{ctx.where}] held-out pairwise accuracy {held_out['eval_accuracy']:.3f}, "
                f"mean margin {held_out['eval_margin']:.3f} ({counts['pairs_eval']} pairs)"
            )
    save_model(trainer, trainer.processing_class, out_dir, ctx.save_dtype(), save=save_reward_model)
    return final_metrics(trainer, **counts, **held_out)


# Pairs whose chosen and rejected texts standardise the members: the mean and std of a member's scores settle
# long before this many texts, and scoring them costs a forward pass per member per text.
STANDARDISE_PAIRS = 512


def standardisation(ctx: StageContext, pairs: Pairs) -> list[tuple[float, float]]:
    """Each member's (mean, std) of scores on the chosen and rejected texts of the held-out pairs (the training
    pairs where none are held out), at most STANDARDISE_PAIRS of them: the texts the stage has, drawn from the
    start policy's distribution with on_policy. Written into the marker, they make the ensemble one fixed
    function, the same in every stage and evaluation that reads it (`models/reward_ensemble.py`)."""
    (ctx.out_dir / MARKER).unlink(missing_ok=True)  # one left by an interrupted run would load member 0 as the ensemble
    source = (pairs.held_out or pairs.train)[:STANDARDISE_PAIRS]
    texts = [p["chosen_ids"] for p in source] + [p["rejected_ids"] for p in source]
    tokenizer, scores = ctx.load_tokenizer(), []
    for member in range(ctx.config.ensemble.members):
        model = load_reward_model(str(member_dir(ctx.out_dir, member)), ctx.recipe.trust_remote_code)
        scores.append(score_ids(model, tokenizer, texts))
        del model
    return member_statistics(scores)


def ensemble_accuracy(ctx: StageContext, held_out: list[dict]) -> dict:
    """The combined score's held-out pairwise accuracy and mean margin (`eval_accuracy`, `eval_margin`: the
    stage's headline figures are the ensemble's; each member's are under `member_<i>/`)."""
    model = load_reward_model(str(ctx.out_dir), ctx.recipe.trust_remote_code)
    tokenizer = ctx.load_tokenizer()
    chosen = score_ids(model, tokenizer, [p["chosen_ids"] for p in held_out])
    rejected = score_ids(model, tokenizer, [p["rejected_ids"] for p in held_out])
    margins = [c - r for c, r in zip(chosen, rejected)]
    accuracy, margin = sum(m > 0 for m in margins) / len(margins), sum(margins) / len(margins)
    log.info(
        f"[{ctx.where}] ensemble of {ctx.config.ensemble.members} ({ctx.config.ensemble.combine}): held-out "
        f"pairwise accuracy {accuracy:.3f}, mean margin {margin:.3f} ({len(margins)} pairs)"
    )
    return {"eval_accuracy": accuracy, "eval_margin": margin}
