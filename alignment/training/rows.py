"""Token rows for TRL's trainers, built by us so the prompt's ids are exactly those the samplers feed
(`data.formatting.encode_prompt_completion`), and the rows too long for `max_length` dropped or counted,
never cut silently. Used by sft, rsft and dpo."""

from __future__ import annotations

import logging

from ..data.formatting import encode_prompt_completion, encode_segments
from ..errors import UserError
from ..runtime.dist import log_share

log = logging.getLogger(__name__)


def token_rows(tokenizer, rendered: list[dict]) -> list[dict]:
    """Rendered {'prompt', 'completion'} rows, or multi-turn {'segments'} rows (`formatting.render_example`), as
    {'input_ids', 'completion_mask'}, which TRL's SFTTrainer takes as they are: the prompt's ids are exactly
    those the samplers feed (`formatting.encode_prompt_completion`; TRL would tokenize the joined text, where
    tokens can merge across the boundary), and a conversation's mask is 1 on every assistant turn."""
    rows = []
    for row in rendered:
        if "segments" in row:
            ids, mask = encode_segments(tokenizer, row["segments"])
            rows.append({"input_ids": ids, "completion_mask": mask})
            continue
        prompt, completion = encode_prompt_completion(tokenizer, row["prompt"], row["completion"])
        rows.append({"input_ids": prompt + completion, "completion_mask": [0] * len(prompt) + [1] * len(completion)})
    return rows


def prompt_length(row: dict) -> int:
    """Tokens before the first trained one: what must fit within max_length for anything to be trained."""
    mask = row["completion_mask"]
    return mask.index(1) if 1 in mask else len(mask)


def drop_overlong(rows: list[dict], max_length: int | None, where: str, length=prompt_length) -> list[dict]:
    """Drop the token rows whose prompt (`length(row)` tokens) leaves no room for the completion within
    `max_length`; said (loudly when they are more than a few), and all dropped is an error."""
    if not max_length:
        return rows
    kept = [r for r in rows if length(r) < max_length]
    if not kept:
        raise UserError(
            f"{where}: every prompt is at least max_length={max_length} tokens long, so nothing is "
            "left to train on; raise train.max_length or shorten the prompts."
        )
    if len(kept) < len(rows):
        dropped = len(rows) - len(kept)
        log_share(
            log,
            dropped,
            len(rows),
            f"[{where}] dropped {dropped} of {len(rows)} rows whose prompt leaves "
            f"no room for the completion within max_length={max_length} tokens",
        )
    return kept


def row_lengths(tokenizer, rows: list[dict]) -> list[int]:
    """Tokens of each SFT row as TRL trains it (a text row's as TRL tokenizes it, before it appends EOS)."""
    return [
        len(r["input_ids"]) if "input_ids" in r else len(tokenizer(r["text"], add_special_tokens=False)["input_ids"])
        for r in rows
    ]


def count_truncated(lengths: list[int], max_length: int | None, where: str, what: str = "rows") -> int:
    """How many of the rows (of `lengths` tokens) are longer than `max_length`, which TRL cuts (SFT from the
    right, DPO by its truncation_mode): a cut completion is trained without its end (the end-of-turn token
    above all). Said, loudly when they are more than a few."""
    if not max_length:
        return 0
    truncated = sum(n > max_length for n in lengths)
    if truncated:
        log_share(
            log,
            truncated,
            len(lengths),
            f"[{where}] {truncated} of {len(lengths)} {what} "
            f"({truncated / len(lengths):.0%}) are longer than max_length={max_length} tokens and are trained "
            "cut off, without their end; raise train.max_length or shorten them",
        )
    return truncated
