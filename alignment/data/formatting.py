"""The one prompt-rendering convention shared by every stage.

The text a policy is trained on in SFT is exactly the text it is prompted with in RL, what the reward model
scores and what evaluation samples from: all of them go through these functions.

- `render_prompt(tokenizer, prompt)`: the prompt as the model sees it, ending where the model's answer begins
  (the chat template with `add_generation_prompt=True`, or the plain string without a chat template).
- `render_completion(tokenizer, prompt, completion)`: the answer as the model must produce it,
  including the end-of-turn token and nothing after it.
- `encode_prompt_completion(tokenizer, prompt_text, completion_text)`: the token ids every stage trains on,
  the prompt's exactly those the samplers feed (`encode`), then the completion's.

Rows hold a `prompt` (a string or a list of chat messages) and a `completion` (a string), or `messages`: a
conversation whose every assistant turn is trained (`render_example`, `encode_segments`), as one row or,
where the template renders past turns differently (Qwen3, DeepSeek-R1), one row per turn, counted and said.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from jinja2 import TemplateError

from ..errors import UserError, row_name


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def as_messages(prompt: Any) -> list[dict]:
    """A prompt as chat messages: a plain string becomes one user turn."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return list(prompt)


def template_text(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template's text for `messages`; a conversation the template refuses (Gemma 2 raises "System
    role not supported", others on roles that do not alternate) is a UserError with the template's reason."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except TemplateError as error:
        roles = [m.get("role") for m in messages]
        raise UserError(
            f"The tokenizer's chat template refused a conversation with roles {roles}: {error}. Give "
            "prompts this template accepts (e.g. no system message, or a recipe-level `template: "
            "{system_prompt: ...}` only for templates with a system role)."
        ) from None


def render_prompt(tokenizer, prompt: Any) -> str:
    """Prompt text, ending exactly where the model's answer starts."""
    if has_chat_template(tokenizer):
        return template_text(tokenizer, as_messages(prompt), add_generation_prompt=True)
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
    """Completion text including the end-of-turn token, cut right after it.

    Templates that add a newline after the end-of-turn token (Qwen's ChatML does) would otherwise train a
    trailing newline that generation never produces. A template whose generation prompt is not where the
    rendered conversation continues gets the completion as written after its generation prompt
    (`answer_after_generation_prompt`)."""
    if not has_chat_template(tokenizer):
        return completion + tokenizer.eos_token
    prompt_text = render_prompt(tokenizer, prompt)
    full = template_text(tokenizer, as_messages(prompt) + [{"role": "assistant", "content": completion}])
    if full.startswith(prompt_text):
        # Templates that trim the content (Llama 3's `| trim`, Gemma's) render " 4\n" as "4": the answer is
        # taken as the template renders it, up to the token that closes the turn.
        tail = full[len(prompt_text) :]
        closing = closing_token(tokenizer, tail, answer_end_in(tail, completion))
        if closing is None:
            return tail.rstrip() + tokenizer.eos_token
        at, token = closing
        return tail[: at + len(token)]
    return answer_after_generation_prompt(tokenizer, prompt, prompt_text, full, completion)


def answer_after_generation_prompt(tokenizer, prompt: Any, prompt_text: str, full: str, completion: str) -> str:
    """The rendered completion for a template whose generation prompt is not where the rendered conversation
    continues: DeepSeek-R1's opens the reasoning (`<think>` and a newline) and renders a past answer without
    its reasoning. The model answers after the generation prompt, so the completion is the answer as written
    (without the part of the generation prompt it may repeat) and the token that closes the turn. Only the
    generation prompt may differ: a conversation rendered otherwise differently is an error."""
    before = template_text(tokenizer, as_messages(prompt))
    shared = len(os.path.commonprefix([prompt_text, full]))
    if not (prompt_text.startswith(before) and shared >= len(before)):
        raise UserError(
            "The tokenizer's chat template renders a prompt differently alone and followed by an answer, so "
            "training and generation would see different text. Use a template whose generation prompt is a "
            "prefix of the full conversation."
        )
    opened = prompt_text[shared:]  # what only the generation prompt holds (DeepSeek-R1: "<think>\n")
    tail = full[shared:]
    closing = closing_token(tokenizer, tail, answer_end_in(tail, completion))
    return completion.removeprefix(opened) + (closing[1] if closing else tokenizer.eos_token)


def closing_token(tokenizer, tail: str, answer_end: int) -> tuple[int, str] | None:
    """(position, token) of the first special token at or after `answer_end` in a rendered assistant turn: the
    token that closes the turn (anything after it is dropped); None when the template closes it with none."""
    closing = [(tail.find(t, answer_end), t) for t in marker_tokens(tokenizer) if tail.find(t, answer_end) >= 0]
    return min(closing) if closing else None


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
        where = f" ({row_name(row)})" if row is not None else ""
        raise UserError(f"A 'messages' conversation{where} must end with an assistant turn, which is the completion.")
    return list(messages[:-1]), messages[-1]["content"]


def assistant_turns(messages: list[dict]) -> list[int]:
    """The indices of a conversation's assistant messages."""
    return [i for i, message in enumerate(messages) if message.get("role") == "assistant"]


def check_messages(messages: list, row: int | None = None) -> None:
    """Every message is {'role': str, 'content': str}, and an assistant turn has a turn before it (its prompt)."""
    where = f" (row {row})" if row is not None else ""
    for message in messages:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise UserError(
                f"A 'messages' conversation{where} holds a message that is not "
                f"{{'role': str, 'content': str}}: {str(message)[:80]!r}."
            )
    if messages and messages[0].get("role") == "assistant":
        raise UserError(
            f"A 'messages' conversation{where} starts with an assistant turn: there is no prompt before "
            "it to train it after. Start the conversation with a user (or system) turn."
        )


def render_turns(tokenizer, messages: list[dict]) -> list[tuple[str, bool]] | None:
    """The conversation as consecutive (text, trained) segments: before each assistant turn the text the
    samplers would feed at that point (`render_prompt` of the conversation so far, less what earlier segments
    hold), untrained; each assistant turn as `render_completion` renders it, trained. None when a prefix is not
    where the longer conversation's rendering starts (see `render_example`)."""
    segments, covered = [], ""
    for i in assistant_turns(messages):
        prompt = render_prompt(tokenizer, messages[:i])
        if not prompt.startswith(covered):
            return None
        answer = render_completion(tokenizer, messages[:i], messages[i]["content"])
        segments += [(prompt[len(covered) :], False), (answer, True)]
        covered = prompt + answer
    return segments if template_text(tokenizer, messages).startswith(covered) else None


def render_example(tokenizer, row: dict, index: int | None = None) -> tuple[list[dict], str]:
    """(rendered SFT rows, how) of one data row. how: 'pair' (a prompt and its completion, or a conversation
    with one assistant turn: one {'prompt', 'completion'}), 'turns' (a multi-turn conversation as one
    {'segments'} row, every assistant turn trained) or 'per_turn' (one {'prompt', 'completion'} per assistant
    turn: the template renders past turns differently, see below).

    Multi-turn conversations are rendered turn by turn, as growing prefixes (the conversation up to each
    assistant turn with the generation prompt, then that turn as `render_completion` renders it), and each
    prefix must be where the rendering of the longer conversation starts. Where it is (ChatML, Llama 3, Gemma,
    Mistral, Phi), the conversation is one row whose mask is 1 on each assistant answer and its end-of-turn
    token. Where it is not, because the template renders a past answer differently from the answer being given
    (Qwen3 and DeepSeek-R1 drop past reasoning, and DeepSeek-R1's generation prompt opens a reasoning block a
    past answer lacks), no one sequence holds every answer as the model produced it: the conversation becomes
    one row per assistant turn (the conversation before it, as the template renders it, then that answer),
    counted and said. Every answer is trained either way; none is dropped."""
    messages = row.get("messages")
    if messages is None or row.get("completion") is not None or len(assistant_turns(messages)) < 2:
        return [render_pair(tokenizer, row, index)], "pair"
    try:
        check_messages(messages, index)
        split_messages(messages, index)  # ends with an assistant turn
        if (segments := render_turns(tokenizer, messages)) is not None:
            return [{"segments": segments}], "turns"
        return [
            {
                "prompt": render_prompt(tokenizer, messages[:i]),
                "completion": render_completion(tokenizer, messages[:i], messages[i]["content"]),
            }
            for i in assistant_turns(messages)
        ], "per_turn"
    except UserError as error:
        raise UserError(f"row {index}: {error}" if index is not None else str(error)) from None


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
        where = f" ({row_name(row)})" if row is not None else ""
        raise UserError(
            f"A conversational 'completion'{where} must be one assistant message "
            f"[{{'role': 'assistant', 'content': ...}}]; got roles {roles}."
        )
    return completion[0]["content"]


def render_pair(tokenizer, row: dict, index: int | None = None) -> dict:
    """{'prompt': text, 'completion': text} for SFT, in the shared convention."""
    prompt, completion = prompt_and_completion(row, index)
    try:
        return {
            "prompt": render_prompt(tokenizer, prompt),
            "completion": render_completion(tokenizer, prompt, completion),
        }
    except UserError as error:
        raise UserError(f"{row_name(index)}: {error}" if index is not None else str(error)) from None


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


def encode_prompt_completion(tokenizer, prompt_text: str, completion_text: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a rendered prompt and completion, the ids SFT, DPO and the reward model
    train on and the reward model scores. The prompt ids are exactly those the samplers feed, `encode(prompt)`.
    Tokenizing the joined text instead can merge tokens across the boundary (a byte-level BPE merges the
    prompt's final newline with a completion's leading spaces), and the model would learn to answer a context
    the sampler never feeds. Where the joined text starts with the prompt's ids, the completion's ids are the
    rest (the completion tokenized in context); where tokens merge across the boundary, the completion is
    tokenized after a special token, across which nothing merges, as the sampler would have to produce it."""
    prompt_ids = encode(tokenizer, prompt_text)
    joined = encode(tokenizer, prompt_text + completion_text)
    if joined[: len(prompt_ids)] == prompt_ids:
        return prompt_ids, joined[len(prompt_ids) :]
    anchor = tokenizer.eos_token or ""
    return prompt_ids, encode(tokenizer, anchor + completion_text)[len(encode(tokenizer, anchor)) :]


def encode_segments(tokenizer, segments: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """(input ids, mask) of a conversation's rendered segments (`render_turns`): the first segment as the
    samplers encode a prompt (`encode`), each later one as `encode_prompt_completion` encodes a completion after
    the text before it (tokens merging across a boundary handled the same way); the mask is 1 on the trained
    segments' ids. Only the text since the last special token is re-encoded with a segment (nothing merges
    across a special token), which keeps a long conversation linear to tokenize."""
    markers = marker_tokens(tokenizer)
    ids, mask, text = [], [], ""
    for segment, trained in segments:
        if text:
            start = max(text.rfind(marker) for marker in markers) if markers else -1
            new = encode_prompt_completion(tokenizer, text[max(start, 0) :], segment)[1]
        else:
            new = encode(tokenizer, segment)
        ids += new
        mask += [int(trained)] * len(new)
        text += segment
    return ids, mask
