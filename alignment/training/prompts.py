"""The prompt of a data row, for every stage and the evaluation that samples from prompts (ppo, rsft, rlvr,
on-policy pairs, evaluation suites): a `prompt` column (text or chat messages) or a `messages` column.
`check_prompt_rows` checks such data before anything is sampled; its errors name the row as written in the
file (`data.file_rows`), not its place after `shuffle` and `limit`."""

from __future__ import annotations

from typing import Any

from ..data.loading import check_columns, check_strings, dataset_rows, file_rows, messages_problem
from ..errors import UserError, row_name
from .rewards import check_verifier_columns

PROMPT_COLUMNS = [("prompt",), ("messages",)]


def prompt_of(row: dict) -> Any:
    """The prompt of a prompt-data row: `prompt`, or `messages` without a final assistant turn."""
    if row.get("prompt") is not None:
        return row["prompt"]
    messages = list(row["messages"])
    return messages[:-1] if messages and messages[-1].get("role") == "assistant" else messages


def prompt_problem(prompt: Any) -> str | None:
    """Why a prompt (`prompt_of`) cannot be rendered, or None."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "the prompt is empty"
    if not prompt:
        return "the conversation holds no prompt before its final assistant turn"
    return messages_problem(prompt)


def check_prompt_rows(dataset, verifiers: list, where: str, spec=None, provided=(), entry: str | None = None) -> None:
    """Prompt data for on-policy sampling: a prompt column of text or chat messages, each row's prompt
    renderable, and the columns the verifiers need, present and filled in every row (a JSON line without
    the key reads as None). `provided`: columns the caller fills in itself (the RL stages hand every verifier
    the row's prompt); `entry`: the recipe list the verifiers came from (`check_verifier_columns`)."""
    check_strings(dataset, check_columns(dataset, PROMPT_COLUMNS, where, spec), where)
    check_verifier_columns(verifiers, dataset.column_names, where, provided=provided, entry=entry)
    needed = {c: v.name for v in verifiers for c in v.required_columns if c in dataset.column_names}
    for index, row in zip(file_rows(dataset), dataset_rows(dataset)):
        if problem := prompt_problem(prompt_of(row)):
            raise UserError(f"{where}: {row_name(index)}: {problem}.")
        if empty := [c for c in needed if row[c] is None]:
            raise UserError(
                f"{where}: {row_name(index)}: column '{empty[0]}', which verifier '{needed[empty[0]]}' needs, "
                "is empty (the row lacks it); fill it in or drop the row."
            )


def prompt_data_format(rows: list[dict], columns: list[str], verifiers: list = ()) -> dict:
    """What an RL stage (ppo, rsft, rlvr) reads from prompt data, for stage.json (`StageContext.record_data`)."""
    column = "prompt" if "prompt" in columns else "messages"
    chats = sum(not isinstance(prompt_of(row), str) for row in rows)
    answered = (
        sum(
            1
            for row in rows
            if row.get("prompt") is None and row["messages"] and row["messages"][-1].get("role") == "assistant"
        )
        if column == "messages"
        else 0
    )
    kind = "conversational" if chats == len(rows) else "text" if not chats else f"{chats} conversational, rest text"
    info = {
        "format": f"prompts from the `{column}` column ({kind})",
        "prompt_column": column,
        "columns": [column] + sorted({c for v in verifiers for c in v.required_columns if c in columns} - {column}),
        "rows": len(rows),
        "conversational_prompts": chats,
        "trained_on": "the policy's own completions to these prompts",
    }
    if answered:
        info["final_assistant_turns_dropped"] = answered  # a reference answer, not part of the prompt
    return info
