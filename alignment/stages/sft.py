"""`sft` stage: supervised fine-tuning with `trl.SFTTrainer`.

Data: `prompt`/`completion` rows (text or conversational), chat `messages`, or plain `text`. Pairs and
conversations are rendered with the shared convention (`formatting.py`) and tokenized by us, so the policy is
trained on exactly the prompt tokens it will be sampled from later, followed by the answer's. The loss is on
the answers only by default: the completion, or EVERY assistant turn of a conversation (content and
end-of-turn token; system and user turns and generation prompts are not trained, as with TRL's
`assistant_only_loss`, which is accepted and means the same). A template that renders past turns differently
(Qwen3, DeepSeek-R1) gets one row per assistant turn instead (`formatting.render_example`), counted and said.
`train: {completion_only_loss: false}` trains on every token. Plain `text` rows are trained on every token.
What was detected and trained on is in stage.json's `data_format`.
Recipe keys under `train:` go verbatim to `trl.SFTConfig`, except those the stage's own tokenization makes
meaningless (`trainer.REFUSED_SFT_OPTIONS`), which `align check` refuses.
"""

from __future__ import annotations

import logging

from ..config.data import DataSpec
from ..data.formatting import prompt_and_completion, render_example
from ..data.loading import check_columns, check_strings, column_values, dataset_rows, file_rows
from ..errors import UserError
from ..models.loading import load_policy
from ..runtime.cpu import refuse_slow_bf16
from ..runtime.dist import log_share
from ..training.context import StageContext
from ..training.rows import count_truncated, drop_overlong, row_lengths, token_rows
from ..training.trainer import (
    final_metrics,
    make_sft_trainer,
    save_model,
    sft_config,
    train,
)

log = logging.getLogger(__name__)


# prompt-completion (text or conversational), a conversation, or plain text (language modelling, e.g. a base
# model with no chat template: trained on every token).
COLUMNS = [("prompt", "completion"), ("messages",), ("text",)]


def trl_config(ctx: StageContext):
    return sft_config(ctx, completion_only_loss=True, max_length=1024, learning_rate=2e-5)


def rendered(ctx: StageContext, tokenizer, spec: DataSpec, key: str, max_length: int | None):
    """Rows TRL trains on as they are: pairs and conversations tokenized (`token_rows`) and those whose prompt
    alone fills `max_length` dropped, or plain `text` rows. What was found is recorded (`record_data`)."""
    where = f"{ctx.where}.{key}"
    dataset = ctx.load_data(spec, key)
    columns = check_columns(dataset, COLUMNS, where, spec)
    check_strings(dataset, columns, where)
    if columns == ("text",):
        return text_rows(ctx, dataset, key)
    rows, ways = [], {"pair": 0, "turns": 0, "per_turn": 0}
    try:
        for i, row in zip(file_rows(dataset), dataset_rows(dataset)):
            if not _empty_answer(row):
                example, how = render_example(tokenizer, row, i)
                rows += example
                ways[how] += 1
    except UserError as error:
        raise UserError(f"{where} ({spec.describe()}): {error}") from None
    kept = sum(ways.values())
    if not rows:
        raise UserError(
            f"{where}: all {len(dataset)} rows were filtered out because their completion "
            "is empty; check the data or its column mapping (rename)."
        )
    if kept < len(dataset):
        log.info(f"[{where}] dropped {len(dataset) - kept} of {len(dataset)} rows with an empty completion")
    if ways["per_turn"]:
        log_share(
            log,
            ways["per_turn"],
            kept,
            f"[{where}] the chat template renders earlier turns differently "
            f"once later ones follow (e.g. it drops past reasoning), so {ways['per_turn']} multi-turn "
            "conversations were each split into one row per assistant turn (the conversation before it, then "
            "that answer): every answer is trained, at the cost of encoding the shared turns once per answer",
        )
    ctx.record_data(key, **sft_data_format(columns, dataset, ways, ctx.config.train, len(rows)))
    return drop_overlong(token_rows(tokenizer, rows), max_length, where)


def text_rows(ctx: StageContext, dataset, key: str) -> list[dict]:
    """Plain `text` rows (language modelling: every token trained); empty ones dropped and said."""
    if ctx.config.train.get("assistant_only_loss"):
        raise UserError(
            f"{ctx.where}.train.assistant_only_loss: the data of {ctx.where}.{key} is plain `text` rows, "
            "which have no assistant turns; give `messages` or `prompt`/`completion` rows, or drop the key."
        )
    rows = [{"text": text} for text in column_values(dataset, "text") if text.strip()]
    if not rows:
        raise UserError(f"{ctx.where}.{key}: every 'text' value is empty.")
    if len(rows) < len(dataset):
        log.info(f"[{ctx.where}.{key}] dropped {len(dataset) - len(rows)} of {len(dataset)} rows with empty text")
    ctx.record_data(
        key,
        format="text (language modelling)",
        columns=["text"],
        rows=len(rows),
        ignored_columns=[c for c in dataset.column_names if c != "text"],
        trained_on="every token",
    )
    return rows


def sft_data_format(columns: tuple, dataset, ways: dict, train: dict, rows: int) -> dict:
    """What the stage made of `prompt`/`completion` or `messages` data, for stage.json and the model card."""
    every_token = train.get("completion_only_loss") is False
    info = {
        "columns": list(columns),
        "ignored_columns": [c for c in dataset.column_names if c not in columns],
        "rows": rows,
    }
    if columns == ("messages",):
        info["format"] = "messages (conversations)"
        info["conversations_multi_turn"] = ways["turns"] + ways["per_turn"]
        info["conversations_split_per_turn"] = ways["per_turn"]
        info["trained_on"] = (
            "every token"
            if every_token
            else ("every assistant turn (its content and end-of-turn token); not system or user turns")
        )
    else:
        chat = not isinstance(dataset[0]["prompt"], str)
        info["format"] = f"prompt/completion ({'conversational' if chat else 'text'})"
        info["trained_on"] = "every token" if every_token else "the completion (with its end-of-turn token)"
    return info


def _empty_answer(row: dict) -> bool:
    try:
        return not prompt_and_completion(row)[1].strip()
    except UserError:
        return False  # a malformed conversation is reported by render_example with its row number


def check(ctx: StageContext) -> None:
    refuse_slow_bf16(ctx.config, ctx.where)
    args = trl_config(ctx)
    tokenizer = ctx.load_tokenizer()
    rendered(ctx, tokenizer, ctx.config.data, "data", args.max_length)
    if ctx.config.eval_data:
        rendered(ctx, tokenizer, ctx.config.eval_data, "eval_data", args.max_length)


def build_trainer(ctx: StageContext):
    """(SFTTrainer, tokenizer, row counts); the tokenizer is the one saved with the output."""
    args = trl_config(ctx)
    tokenizer = ctx.load_tokenizer()
    model = load_policy(ctx.start_model, ctx.recipe.trust_remote_code, partitioned=True)
    train_rows = rendered(ctx, tokenizer, ctx.config.data, "data", args.max_length)
    eval_rows = (
        rendered(ctx, tokenizer, ctx.config.eval_data, "eval_data", args.max_length) if ctx.config.eval_data else None
    )
    counts = {
        "rows": len(train_rows),
        "rows_truncated": count_truncated(row_lengths(tokenizer, train_rows), args.max_length, f"{ctx.where}.data"),
    }
    return make_sft_trainer(ctx, args, model, tokenizer, train_rows, eval_rows), tokenizer, counts


def run(ctx: StageContext) -> dict:
    trainer, tokenizer, counts = build_trainer(ctx)
    train(ctx, trainer)
    save_model(trainer, tokenizer, ctx.out_dir, ctx.save_dtype())
    return final_metrics(trainer, **counts)
