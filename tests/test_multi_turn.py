"""Multi-turn SFT: every assistant turn of a `messages` conversation is trained (content and end-of-turn token),
no system or user turn and no generation prompt is, on the chat templates of the major families
(tests/chat_templates.py, byte-level BPE included); a tiny model's loss on the FIRST answer falls after SFT;
and the TRL SFTConfig options the stage's own tokenization makes meaningless are refused by `align check`."""

from __future__ import annotations

import json

import pytest
import torch
from chat_templates import FAMILIES, bpe_tokenizer, family_tokenizer
from conftest import SMALLEST_MODEL, TINY_MODEL, run_cli_here, write_recipe

from alignment.config.recipe import load_recipe
from alignment.data.formatting import (
    assistant_turns,
    encode,
    encode_prompt_completion,
    encode_segments,
    render_completion,
    render_example,
    render_prompt,
)
from alignment.errors import UserError
from alignment.run.runner import ensure_base_model, make_context, run_recipe
from alignment.stages import stage_module
from alignment.training.rows import token_rows

# Templates that render a past answer differently from the answer being given (reasoning dropped, or a
# generation prompt that opens a reasoning block past answers lack): one row per assistant turn.
PER_TURN = {"qwen3", "deepseek-r1"}
TOKENIZERS = [(name, "char") for name in sorted(FAMILIES)] + [("qwen2.5", "bpe"), ("llama3", "bpe")]


def conversation(spec) -> list[dict]:
    system = [{"role": "system", "content": "Answer briefly."}] if spec.system_role else []
    return system + [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "  4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "six "},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You are welcome."},
    ]


def trained_spans(row: dict) -> list[list[int]]:
    """The runs of ids whose mask is 1."""
    spans, current = [], []
    for token, trained in zip(row["input_ids"], row["completion_mask"]):
        if trained:
            current.append(token)
        elif current:
            spans, current = spans + [current], []
    return spans + [current] if current else spans


@pytest.mark.parametrize("name, kind", TOKENIZERS)
def test_the_mask_covers_exactly_every_assistant_turn_as_the_template_renders_it(name, kind):
    spec = FAMILIES[name]
    tokenizer = bpe_tokenizer(name) if kind == "bpe" else family_tokenizer(name)
    messages = conversation(spec)
    rendered, how = render_example(tokenizer, {"messages": messages}, 0)
    assert how == ("per_turn" if name in PER_TURN else "turns")
    rows = token_rows(tokenizer, rendered)
    turns = assistant_turns(messages)
    spans = [span for row in rows for span in trained_spans(row)]
    assert len(spans) == len(turns) == 3
    end = tokenizer.convert_tokens_to_ids(spec.end_of_turn)
    for span, i in zip(spans, turns):
        expected = render_completion(tokenizer, messages[:i], messages[i]["content"])
        assert tokenizer.decode(span) == tokenizer.decode(encode(tokenizer, expected)), (i, expected)
        assert span[-1] == end and span.count(end) == 1
    # Before the first answer: exactly the ids the samplers feed for it (`encode` of the rendered prompt).
    first = rows[0]
    prompt_ids = encode(tokenizer, render_prompt(tokenizer, messages[: turns[0]]))
    assert first["input_ids"][: len(prompt_ids)] == prompt_ids and 1 not in first["completion_mask"][: len(prompt_ids)]
    if how == "per_turn":  # each row: the conversation before the turn as the samplers feed it, then the turn
        for row, i in zip(rows, turns):
            prompt_ids = encode(tokenizer, render_prompt(tokenizer, messages[:i]))
            assert row["input_ids"][: len(prompt_ids)] == prompt_ids and row["completion_mask"].index(1) == len(
                prompt_ids
            )


@pytest.mark.parametrize("name, kind", TOKENIZERS)
def test_one_turn_is_tokenized_exactly_as_a_prompt_and_its_completion(name, kind):
    """A prompt and completion as segments give the ids `encode_prompt_completion` gives (byte-level merges at
    the boundary included), so single-turn rows train as before."""
    tokenizer = bpe_tokenizer(name) if kind == "bpe" else family_tokenizer(name)
    prompt = render_prompt(tokenizer, "What is 2+2?")
    for answer in ("4", "  4", "\n  four"):
        completion = render_completion(tokenizer, "What is 2+2?", answer)
        ids, mask = encode_segments(tokenizer, [(prompt, False), (completion, True)])
        prompt_ids, completion_ids = encode_prompt_completion(tokenizer, prompt, completion)
        assert ids == prompt_ids + completion_ids and mask == [0] * len(prompt_ids) + [1] * len(completion_ids)


def test_a_one_turn_conversation_is_a_plain_pair_and_bad_conversations_name_their_row():
    tokenizer = family_tokenizer("qwen2.5")
    (row,), how = render_example(tokenizer, {"messages": conversation(FAMILIES["qwen2.5"])[:3]}, 0)
    assert how == "pair" and set(row) == {"prompt", "completion"}
    starts_with_answer = [
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    with pytest.raises(UserError, match=r"^row 7: .*starts with an assistant turn"):
        render_example(tokenizer, {"messages": starts_with_answer}, 7)
    no_content = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    with pytest.raises(UserError, match=r"^row 2: .*not \{'role': str, 'content': str\}"):
        render_example(tokenizer, {"messages": no_content}, 2)


# Two-turn conversations: a word first, a number second. Trained on the second answers alone (the old
# behaviour), the model learns that answers are numbers and the first answers' loss rises.
WORDS = ["red", "green", "blue", "black"]


def two_turn_rows(n: int = 64) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"colour {k % 4}?"},
                {"role": "assistant", "content": WORDS[k % 4]},
                {"role": "user", "content": "and a number?"},
                {"role": "assistant", "content": str(10 + k % 8)},
            ]
        }
        for k in range(n)
    ]


def answer_losses(model_dir, rows: list[dict]) -> list[float]:
    """Mean per-token NLL of each assistant turn (first, second) over `rows`, as the stage tokenizes them."""
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer

    tokenizer, model = load_tokenizer(str(model_dir)), load_policy(str(model_dir)).eval()
    totals = [[0.0, 0], [0.0, 0]]
    for row in rows:
        rendered, _ = render_example(tokenizer, row, 0)
        (tokens,) = token_rows(tokenizer, rendered)
        ids = torch.tensor([tokens["input_ids"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        nll = -logprobs.gather(1, ids[0, 1:, None])[:, 0]
        mask, turn, previous = tokens["completion_mask"], -1, 0
        for position in range(1, len(mask)):
            if mask[position] and not previous:
                turn += 1
            if mask[position]:
                totals[turn][0] += float(nll[position - 1])
                totals[turn][1] += 1
            previous = mask[position]
    return [total / count for total, count in totals]


def test_sft_on_two_turn_conversations_lowers_the_loss_on_the_first_answer_too(tmp_path):
    """Before the fix only the last turn was trained and the first answer's loss ROSE (issue #28: 5.29 -> 9.60; on
    this data 4.55 -> 5.26 with the last turn alone, 4.55 -> 0.91 now). `assistant_only_loss: true` is accepted
    (it is what the stage does) and runs."""
    rows = two_turn_rows()
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = {
        "max_steps": 40,
        "per_device_train_batch_size": 16,
        "learning_rate": 3.0e-3,
        "max_length": 64,
        "assistant_only_loss": True,
        "logging_steps": 10,
    }
    recipe = load_recipe(
        write_recipe(
            tmp_path,
            {
                "name": "multi-turn",
                "model": TINY_MODEL,
                "output_dir": str(tmp_path / "out"),
                "seed": 1,
                "stages": {"sft": {"data": {"dataset": str(data)}, "train": train}},
            },
        )
    )
    run_recipe(recipe)
    before, after = answer_losses(recipe.out / "base", rows), answer_losses(recipe.stage_dir("sft"), rows)
    assert after[0] < before[0] - 1.0 and after[1] < before[1] - 1.0
    record = json.loads((recipe.stage_dir("sft") / "stage.json").read_text())
    assert record["data_format"]["data"]["conversations_multi_turn"] == len(rows)
    assert record["data_format"]["data"]["trained_on"].startswith("every assistant turn")


# ---------------------------------------------------------------------------------------------------
# SFTConfig options the stage's own tokenization makes meaningless: refused by `align check` (sft and rsft)

MESSAGES = [{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}] * 4
TEXT = [{"text": "some plain text"}] * 4

OPTIONS = [  # (train: options, data, None = passes check, else the error's key and words)
    ({"assistant_only_loss": True}, MESSAGES, None),
    ({"assistant_only_loss": True, "completion_only_loss": True}, MESSAGES, None),
    ({"completion_only_loss": False}, MESSAGES, None),
    ({"packing": True, "packing_strategy": "bfd"}, MESSAGES, None),
    ({"dataset_text_field": "text"}, TEXT, None),
    ({"assistant_only_loss": True}, TEXT, r"train\.assistant_only_loss: .*plain `text` rows"),
    (
        {"assistant_only_loss": True, "completion_only_loss": False},
        MESSAGES,
        r"train: assistant_only_loss: true .*drop one",
    ),
    ({"completion_only_loss": None}, MESSAGES, r"train\.completion_only_loss: None .*train on every token"),
    ({"dataset_text_field": "content"}, TEXT, r"train\.dataset_text_field: 'content' .*rename: \{<column>: text\}"),
    ({"dataset_kwargs": {"skip_prepare_dataset": True}}, MESSAGES, r"train\.dataset_kwargs: .*completion mask"),
    ({"chat_template_path": "template.jinja"}, MESSAGES, r"train\.chat_template_path: .*`template:`"),
    ({"eos_token": "<|im_end|>"}, MESSAGES, r"train\.eos_token: .*end-of-turn token"),
    ({"formatting_func": "f"}, MESSAGES, r"train: unknown SFTConfig option 'formatting_func'"),
]


def options_recipe(tmp_path, kind: str, train: dict, rows: list[dict]) -> dict:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if kind == "sft":
        stage = {"data": {"dataset": str(data)}, "train": train}
    else:  # rsft: its data are prompts; its SFT rows are its own samples
        stage = {"kind": "rsft", "data": {"task": "arithmetic", "n": 8}, "verifiers": ["arithmetic"], "train": train}
    return {
        "name": "options",
        "model": SMALLEST_MODEL,
        "output_dir": str(tmp_path / "out"),
        "seed": 1,
        "stages": {kind: stage},
    }


# rsft trains on its own prompt/completion samples, never on text rows: the text-data rows are sft's alone
@pytest.mark.parametrize(
    "kind, train, rows, error",
    [("sft", *case) for case in OPTIONS] + [("rsft", *case) for case in OPTIONS if case[1] is not TEXT],
)
def test_sft_options_the_stages_tokenization_makes_meaningless_are_refused_in_check(tmp_path, kind, train, rows, error):
    recipe = load_recipe(write_recipe(tmp_path, options_recipe(tmp_path, kind, train, rows)))
    ensure_base_model(recipe)
    check = stage_module(kind).check
    if error is None:
        check(make_context(recipe, kind))
        return
    with pytest.raises(UserError, match=rf"^stages\.{kind}\.{error}"):
        check(make_context(recipe, kind))


def test_align_check_refuses_an_option_with_exit_2_and_one_paragraph(tmp_path):
    recipe = write_recipe(tmp_path, options_recipe(tmp_path, "sft", {"assistant_only_loss": True}, TEXT))
    result = run_cli_here("check", recipe)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "plain `text` rows" in result.stderr
