"""The one prompt-rendering convention shared by every stage.

The text a policy is trained on in SFT is exactly the text it is prompted with in RL, what the
reward model scores and what evaluation samples from. All of them go through these functions:

- `render_prompt(tokenizer, prompt)`: the prompt as the model sees it, ending where the model's
  answer begins (the chat template with `add_generation_prompt=True`, or the plain string when the
  tokenizer has no chat template).
- `render_completion(tokenizer, prompt, completion)`: the answer as the model must produce it,
  including the end-of-turn token and nothing after it. Templates that add a newline after the
  end-of-turn token (Qwen's ChatML does) would otherwise train a trailing newline that generation
  never produces: we cut the rendered answer at the end-of-turn token.

Rows hold a `prompt` (a string or a list of chat messages) and a `completion` (a string), or
`messages` whose last assistant turn is the completion.
"""

from __future__ import annotations

import copy
from typing import Any

from .errors import UserError


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def as_messages(prompt: Any) -> list[dict]:
    """A prompt as chat messages: a plain string becomes one user turn."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return list(prompt)


def render_prompt(tokenizer, prompt: Any) -> str:
    """Prompt text, ending exactly where the model's answer starts."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(as_messages(prompt), add_generation_prompt=True, tokenize=False)
    if not isinstance(prompt, str):
        raise UserError(
            "The data holds chat messages but the tokenizer has no chat template, so they cannot be rendered. "
            "Use a tokenizer with a chat template (an instruct/chat checkpoint) or plain-text prompts."
        )
    return prompt


def end_of_turn(tokenizer) -> str:
    """The token that ends an assistant turn: what the chat template closes a turn with, else EOS."""
    if has_chat_template(tokenizer):
        probe = render_completion(tokenizer, "x", "y")
        for token in sorted(marker_tokens(tokenizer), key=len, reverse=True):
            if probe.endswith(token):
                return token
    return tokenizer.eos_token


def marker_tokens(tokenizer) -> set[str]:
    """Special and added tokens: the candidates for a turn marker (a template's end-of-turn token need not
    be flagged special once EOS is set to something else, e.g. a base model's <|endoftext|>)."""
    added = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    return set(tokenizer.all_special_tokens) | added


def render_completion(tokenizer, prompt: Any, completion: str) -> str:
    """Completion text including the end-of-turn token, cut right after it (see module docstring)."""
    if not has_chat_template(tokenizer):
        return completion + tokenizer.eos_token
    prompt_text = render_prompt(tokenizer, prompt)
    full = tokenizer.apply_chat_template(
        as_messages(prompt) + [{"role": "assistant", "content": completion}], tokenize=False
    )
    if not full.startswith(prompt_text):
        raise UserError(
            "The tokenizer's chat template renders a prompt differently alone and followed by an answer, so "
            "training and generation would see different text. Use a template whose generation prompt is a "
            "prefix of the full conversation."
        )
    tail = full[len(prompt_text):]
    # The first special token after the answer closes the turn; anything after it is dropped. Templates that
    # trim the content (Llama 3's `| trim`, Gemma's) render " 4\n" as "4": look for it as rendered.
    answer_end = answer_end_in(tail, completion)
    closing = [(tail.find(t, answer_end), t) for t in marker_tokens(tokenizer) if tail.find(t, answer_end) >= 0]
    if closing:
        at, token = min(closing)
        return tail[: at + len(token)]
    return tail.rstrip() + tokenizer.eos_token


def answer_end_in(tail: str, completion: str) -> int:
    """Where the answer ends in the rendered assistant turn `tail`: after the completion as written, else as
    a trimming template renders it (stripped), else at the start of the turn."""
    for answer in (completion, completion.strip()):
        if answer and (at := tail.find(answer)) >= 0:
            return at + len(answer)
    return 0


def split_messages(messages: list[dict], row: int | None = None) -> tuple[list[dict], str]:
    """Split a chat into (prompt messages, final assistant answer)."""
    if not messages or messages[-1].get("role") != "assistant":
        where = f" (row {row})" if row is not None else ""
        raise UserError(f"A 'messages' conversation{where} must end with an assistant turn, which is the completion.")
    return list(messages[:-1]), messages[-1]["content"]


def prompt_and_completion(row: dict, index: int | None = None) -> tuple[Any, str]:
    """(prompt, completion) of a row in either format, before rendering. A row with both a conversation and
    a bare `prompt` but no `completion` (UltraChat: prompt, prompt_id, messages) is a conversation. TRL's
    conversational prompt-completion rows hold the completion as messages: one assistant turn."""
    if row.get("messages") is not None and row.get("completion") is None:
        return split_messages(row["messages"], index)
    return row["prompt"], completion_text(row["completion"], index)


def completion_text(completion: Any, row: int | None = None) -> str:
    """A completion as text: a string, or a conversational completion of exactly one assistant message."""
    if isinstance(completion, str):
        return completion
    roles = [m.get("role") for m in completion] if isinstance(completion, list) else None
    if roles != ["assistant"] or not isinstance(completion[0].get("content"), str):
        where = f" (row {row})" if row is not None else ""
        raise UserError(f"A conversational 'completion'{where} must be one assistant message "
                        f"[{{'role': 'assistant', 'content': ...}}]; got roles {roles}.")
    return completion[0]["content"]


def render_pair(tokenizer, row: dict, index: int | None = None) -> dict:
    """{'prompt': text, 'completion': text} for SFT, in the shared convention."""
    prompt, completion = prompt_and_completion(row, index)
    return {"prompt": render_prompt(tokenizer, prompt), "completion": render_completion(tokenizer, prompt, completion)}


def eos_as_end_of_turn(tokenizer):
    """The tokenizer to hand TRL's SFT/DPO trainers: a copy whose EOS is the chat template's end-of-turn
    token. TRL appends EOS to completions that do not already end with it; our rendered completions end
    with the end-of-turn token, which for base models differs from EOS (Qwen2.5: <|im_end|> vs
    <|endoftext|>), so without this every answer would be trained to end with both. The original
    tokenizer (the one saved with the checkpoint) is left unchanged."""
    token = end_of_turn(tokenizer)
    if token == tokenizer.eos_token:
        return tokenizer
    trl_tokenizer = copy.deepcopy(tokenizer)
    trl_tokenizer.eos_token = token
    return trl_tokenizer


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of rendered text. The rendered text already holds every special token the template adds,
    so none is added here (the same choice as the samplers)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
