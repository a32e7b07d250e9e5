"""`sft` stage: supervised fine-tuning with `trl.SFTTrainer`.

Data: `prompt`/`completion` rows or chat `messages` (the last assistant turn is the completion).
Both are rendered with the shared convention (`formatting.py`) and tokenized by us, so the policy is
trained on exactly the prompt tokens it will be sampled from later, followed by the completion's. The loss is on the
completion only by default (`train: {completion_only_loss: false}` trains on the prompt too).
Recipe keys under `train:` go verbatim to `trl.SFTConfig`.
"""

from __future__ import annotations

import logging
from typing import Literal

from ..config.data import DataSpec
from ..config.stage import StageConfig
from ..errors import UserError
from .base import StageContext

log = logging.getLogger(__name__)


# prompt-completion (text or conversational), a conversation, or plain text (language modelling, e.g. a base
# model with no chat template: trained on every token).
COLUMNS = [("prompt", "completion"), ("messages",), ("text",)]


class Config(StageConfig):
    kind: Literal["sft"] = "sft"
    data: DataSpec


def trl_config(ctx: StageContext):
    from trl import SFTConfig

    return ctx.trl_args(SFTConfig, completion_only_loss=True, max_length=1024, learning_rate=2e-5)


def rendered(ctx: StageContext, tokenizer, spec: DataSpec, key: str, max_length: int | None):
    """Rows TRL trains on as they are: pairs tokenized (`token_rows`) and those whose prompt alone fills
    `max_length` dropped, or plain `text` rows."""
    from ..data import check_columns, check_strings, file_rows
    from ..formatting import render_pair

    dataset = ctx.load_data(spec, key)
    columns = check_columns(dataset, COLUMNS, f"{ctx.where}.{key}", spec)
    check_strings(dataset, columns, f"{ctx.where}.{key}")
    if columns == ("text",):
        rows = [{"text": text} for text in dataset["text"] if text.strip()]
        if not rows:
            raise UserError(f"{ctx.where}.{key}: every 'text' value is empty.")
        if len(rows) < len(dataset):
            log.info(f"[{ctx.where}.{key}] dropped {len(dataset) - len(rows)} of {len(dataset)} rows with empty text")
        return rows
    try:
        rows = [render_pair(tokenizer, row, i) for i, row in zip(file_rows(dataset), dataset) if not _empty_answer(row)]
    except UserError as error:
        raise UserError(f"{ctx.where}.{key} ({spec.describe()}): {error}") from None
    if not rows:
        raise UserError(f"{ctx.where}.{key}: all {len(dataset)} rows were filtered out because their completion "
                        "is empty; check the data or its column mapping (rename).")
    if len(rows) < len(dataset):
        log.info(f"[{ctx.where}.{key}] dropped {len(dataset) - len(rows)} of {len(dataset)} rows with an empty completion")
    return drop_overlong(token_rows(tokenizer, rows), max_length, f"{ctx.where}.{key}")


def _empty_answer(row: dict) -> bool:
    from ..formatting import prompt_and_completion

    try:
        return not prompt_and_completion(row)[1].strip()
    except UserError:
        return False  # a malformed conversation is reported by render_pair with its row number


def token_rows(tokenizer, rendered: list[dict]) -> list[dict]:
    """Rendered {'prompt', 'completion'} rows as {'input_ids', 'completion_mask'}, which TRL's SFTTrainer takes
    as they are: the prompt's ids are exactly those the samplers feed (`formatting.encode_prompt_completion`;
    TRL would tokenize the joined text, where tokens can merge across the boundary)."""
    from ..formatting import encode_prompt_completion

    rows = []
    for row in rendered:
        prompt, completion = encode_prompt_completion(tokenizer, row["prompt"], row["completion"])
        rows.append({"input_ids": prompt + completion, "completion_mask": [0] * len(prompt) + [1] * len(completion)})
    return rows


def prompt_length(row: dict) -> int:
    return row["completion_mask"].count(0)


def drop_overlong(rows: list[dict], max_length: int | None, where: str, length=prompt_length) -> list[dict]:
    """Drop the token rows whose prompt (`length(row)` tokens) leaves no room for the completion within
    `max_length`; said (loudly when they are more than a few), and all dropped is an error."""
    from ..dist import log_share

    if not max_length:
        return rows
    kept = [r for r in rows if length(r) < max_length]
    if not kept:
        raise UserError(f"{where}: every prompt is at least max_length={max_length} tokens long, so nothing is "
                        "left to train on; raise train.max_length or shorten the prompts.")
    if len(kept) < len(rows):
        dropped = len(rows) - len(kept)
        log_share(log, dropped, len(rows), f"[{where}] dropped {dropped} of {len(rows)} rows whose prompt leaves "
                  f"no room for the completion within max_length={max_length} tokens")
    return kept


def row_lengths(tokenizer, rows: list[dict]) -> list[int]:
    """Tokens of each SFT row as TRL trains it (a text row's as TRL tokenizes it, before it appends EOS)."""
    return [len(r["input_ids"]) if "input_ids" in r else len(tokenizer(r["text"], add_special_tokens=False)["input_ids"])
            for r in rows]


def count_truncated(lengths: list[int], max_length: int | None, where: str, what: str = "rows") -> int:
    """How many of the rows (of `lengths` tokens) are longer than `max_length`, which TRL cuts (SFT from the
    right, DPO by its truncation_mode): a cut completion is trained without its end (the end-of-turn token
    above all). Said, loudly when they are more than a few."""
    from ..dist import log_share

    if not max_length:
        return 0
    truncated = sum(n > max_length for n in lengths)
    if truncated:
        log_share(log, truncated, len(lengths), f"[{where}] {truncated} of {len(lengths)} {what} "
                  f"({truncated / len(lengths):.0%}) are longer than max_length={max_length} tokens and are trained "
                  "cut off, without their end; raise train.max_length or shorten them")
    return truncated


def check(ctx: StageContext) -> None:
    args = trl_config(ctx)
    tokenizer = ctx.load_tokenizer()
    rendered(ctx, tokenizer, ctx.config.data, "data", args.max_length)


def make_trainer(ctx: StageContext, args, model, tokenizer, train_rows: list[dict], eval_rows: list[dict] | None = None):
    """The SFTTrainer of the `sft` stage and of each `rsft` round: token rows (`token_rows`) or text rows,
    the stage's LoRA and callbacks, and a tokenizer whose EOS is the end-of-turn token (see
    `formatting.eos_as_end_of_turn`)."""
    import datasets
    from trl import SFTTrainer

    from ..formatting import eos_as_end_of_turn
    from ..models import peft_config
    from ..trainer_utils import trainer_callbacks

    return SFTTrainer(
        model=model, args=args, processing_class=eos_as_end_of_turn(tokenizer),
        train_dataset=datasets.Dataset.from_list(train_rows),
        eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
        peft_config=peft_config(ctx.lora) if ctx.lora else None, callbacks=trainer_callbacks(ctx),
    )


def build_trainer(ctx: StageContext):
    """(SFTTrainer, tokenizer, row counts); the tokenizer is the one saved with the output."""
    from ..models import load_policy

    args = trl_config(ctx)
    tokenizer = ctx.load_tokenizer()
    model = load_policy(ctx.start_model, ctx.recipe.trust_remote_code, partitioned=True)
    train_rows = rendered(ctx, tokenizer, ctx.config.data, "data", args.max_length)
    eval_rows = rendered(ctx, tokenizer, ctx.config.eval_data, "eval_data", args.max_length) if ctx.config.eval_data else None
    counts = {"rows": len(train_rows),
              "rows_truncated": count_truncated(row_lengths(tokenizer, train_rows), args.max_length, f"{ctx.where}.data")}
    return make_trainer(ctx, args, model, tokenizer, train_rows, eval_rows), tokenizer, counts


def run(ctx: StageContext) -> dict:
    from ..trainer_utils import final_metrics, save_model, train

    trainer, tokenizer, counts = build_trainer(ctx)
    train(ctx, trainer)
    save_model(trainer, tokenizer, ctx.out_dir, ctx.save_dtype())
    return final_metrics(trainer, **counts)
