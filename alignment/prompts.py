"""The prompt of a data row, for every stage and the evaluation that samples from prompts (ppo, rsft, rlvr,
on-policy pairs, evaluation suites): a `prompt` column (text or chat messages) or a `messages` column."""

from __future__ import annotations

from typing import Any

from .data import check_columns
from .verifier_rewards import check_verifier_columns

PROMPT_COLUMNS = [("prompt",), ("messages",)]


def prompt_of(row: dict) -> Any:
    """The prompt of a prompt-data row: `prompt`, or `messages` without a final assistant turn."""
    if row.get("prompt") is not None:
        return row["prompt"]
    messages = list(row["messages"])
    return messages[:-1] if messages and messages[-1].get("role") == "assistant" else messages


def check_prompt_rows(dataset, verifier, where: str, spec=None) -> None:
    """Prompt data for on-policy sampling: a prompt column and the columns the verifier needs (it gets
    the rows as they are, so not even `prompt` is filled in for it)."""
    check_columns(dataset, PROMPT_COLUMNS, where, spec)
    check_verifier_columns([verifier], dataset.column_names, where, provided=(), entry=None)
