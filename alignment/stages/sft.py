"""`sft` stage: supervised fine-tuning with `trl.SFTTrainer`.

Data: `prompt`/`completion` rows or chat `messages` (the last assistant turn is the completion).
Both are rendered with the shared convention (`formatting.py`) and tokenized by us, so the policy is
trained on exactly the prompt tokens it will be sampled from later, followed by the completion's. The loss is on the
completion only by default (`train: {completion_only_loss: false}` trains on the prompt too).
Recipe keys under `train:` go verbatim to `trl.SFTConfig`.
"""

from __future__ import annotations

import logging

from trl import SFTConfig

from ..config.data import DataSpec
from ..data.formatting import (
    prompt_and_completion,
    render_pair,
)
from ..data.loading import check_columns, check_strings, file_rows
from ..errors import UserError
from ..models.loading import load_policy
from ..training.context import StageContext
from ..training.rows import count_truncated, drop_overlong, row_lengths, token_rows
from ..training.trainer import (
    final_metrics,
    make_sft_trainer,
    save_model,
    train,
)

log = logging.getLogger(__name__)


# prompt-completion (text or conversational), a conversation, or plain text (language modelling, e.g. a base
# model with no chat template: trained on every token).
COLUMNS = [("prompt", "completion"), ("messages",), ("text",)]




def trl_config(ctx: StageContext):
    return ctx.trl_args(SFTConfig, completion_only_loss=True, max_length=1024, learning_rate=2e-5)


def rendered(ctx: StageContext, tokenizer, spec: DataSpec, key: str, max_length: int | None):
    """Rows TRL trains on as they are: pairs tokenized (`token_rows`) and those whose prompt alone fills
    `max_length` dropped, or plain `text` rows."""
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
    try:
        return not prompt_and_completion(row)[1].strip()
    except UserError:
        return False  # a malformed conversation is reported by render_pair with its row number












def check(ctx: StageContext) -> None:
    args = trl_config(ctx)
    tokenizer = ctx.load_tokenizer()
    rendered(ctx, tokenizer, ctx.config.data, "data", args.max_length)




def build_trainer(ctx: StageContext):
    """(SFTTrainer, tokenizer, row counts); the tokenizer is the one saved with the output."""
    args = trl_config(ctx)
    tokenizer = ctx.load_tokenizer()
    model = load_policy(ctx.start_model, ctx.recipe.trust_remote_code, partitioned=True)
    train_rows = rendered(ctx, tokenizer, ctx.config.data, "data", args.max_length)
    eval_rows = rendered(ctx, tokenizer, ctx.config.eval_data, "eval_data", args.max_length) if ctx.config.eval_data else None
    counts = {"rows": len(train_rows),
              "rows_truncated": count_truncated(row_lengths(tokenizer, train_rows), args.max_length, f"{ctx.where}.data")}
    return make_sft_trainer(ctx, args, model, tokenizer, train_rows, eval_rows), tokenizer, counts


def run(ctx: StageContext) -> dict:
    trainer, tokenizer, counts = build_trainer(ctx)
    train(ctx, trainer)
    save_model(trainer, tokenizer, ctx.out_dir, ctx.save_dtype())
    return final_metrics(trainer, **counts)
