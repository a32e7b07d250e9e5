"""Preference data: every input format normalises to (prompt, chosen, rejected); bad rows are dropped and
counted or named in a UserError; on-policy pairs from verifier-graded samples; reward scoring convention."""

from __future__ import annotations

import json

import datasets
import pytest
import torch

from alignment.config.sampling import OnPolicySpec
from alignment.data.formatting import encode
from alignment.errors import UserError
from alignment.training.pairs import (
    normalize_pairs,
    normalize_row,
    on_policy_pairs,
    pair_samples,
    render_pairs,
)
from alignment.training.scoring import score_rendered, score_texts
from alignment.verifiers import VerifyResult, resolve

USER = {"role": "user", "content": "What is 2+2?"}


def chat(answer, user=USER):
    return [user, {"role": "assistant", "content": answer}]


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}, ("What is 2+2?", "4", "5")),
        # UltraFeedback (HuggingFaceH4/ultrafeedback_binarized): a prompt column and full conversations
        ({"prompt": "What is 2+2?", "chosen": chat("4"), "rejected": chat("5")}, ([USER], "4", "5")),
        # chat answers holding only the assistant turn: the prompt column is the prompt
        (
            {
                "prompt": [USER],
                "chosen": [{"role": "assistant", "content": "4"}],
                "rejected": [{"role": "assistant", "content": "5"}],
            },
            ([USER], "4", "5"),
        ),
        # implicit prompt, chat and plain text (cut at a word boundary, never inside '42'/'43')
        ({"chosen": chat("4"), "rejected": chat("5")}, ([USER], "4", "5")),
        (
            {"chosen": "Human: what is 40+2?\nAssistant: 42", "rejected": "Human: what is 40+2?\nAssistant: 43"},
            ("Human: what is 40+2?\nAssistant: ", "42", "43"),
        ),
    ],
)
def test_formats_normalise(row, expected):
    pair = normalize_row(row, 0, "stages.dpo.data")
    assert (pair["prompt"], pair["chosen"], pair["rejected"]) == expected


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"prompt": "q", "chosen": "", "rejected": "5"}, "empty chosen or rejected"),
        ({"prompt": "q", "chosen": "4", "rejected": None}, "empty chosen or rejected"),
        ({"prompt": "q", "chosen": " 4", "rejected": "4 "}, "chosen identical to rejected"),
        ({"prompt": "  ", "chosen": "4", "rejected": "5"}, "empty prompt"),
        (
            {"chosen": chat("4"), "rejected": chat("5", {"role": "user", "content": "other"})},
            "chosen and rejected chats differ before the last turn",
        ),
        ({"chosen": "4", "rejected": "5"}, "no shared prompt in the full texts"),
    ],
)
def test_bad_rows_are_dropped_with_a_reason(row, reason):
    assert normalize_row(row, 3, "stages.dpo.data") == reason


def test_drops_are_counted_and_all_dropped_is_an_error(logged):
    rows = [
        {"prompt": "q", "chosen": "4", "rejected": "5"},
        {"prompt": "q", "chosen": "4", "rejected": "4"},
        {"prompt": "q", "chosen": "", "rejected": "5"},
    ]
    pairs, dropped = normalize_pairs(datasets.Dataset.from_list(rows), "stages.rm.data")
    assert len(pairs) == 1 and sum(dropped.values()) == 2
    assert "dropped 2 of 3 rows" in logged()
    with pytest.raises(UserError, match=r"stages.rm.data: no usable preference pairs.*2 chosen identical"):
        normalize_pairs(datasets.Dataset.from_list([rows[1], rows[1]]), "stages.rm.data")


def test_missing_column_and_bad_type_name_the_culprit():
    with pytest.raises(UserError, match=r"stages.dpo.data: missing column\(s\) 'rejected'.*rename"):
        normalize_pairs(datasets.Dataset.from_list([{"prompt": "q", "chosen": "4", "reject": "5"}]), "stages.dpo.data")
    with pytest.raises(UserError, match=r"row 0, column 'chosen' is int"):
        normalize_pairs(datasets.Dataset.from_list([{"prompt": "q", "chosen": 4, "rejected": 5}]), "stages.dpo.data")
    with pytest.raises(UserError, match=r"row 2, column 'rejected' is a chat that does not end with an assistant"):
        normalize_row({"prompt": "q", "chosen": chat("4"), "rejected": [USER]}, 2, "stages.dpo.data")


def test_pair_samples_prefers_common_finished_answers_and_skips_errors():
    ok, wrong, bad = VerifyResult(1.0), VerifyResult(0.0), VerifyResult(0.0, "error", "boom")
    none = VerifyResult(0.0, "unparseable")
    texts = ["7", "4", "5", "5", "x", "4", "boom"]
    results = [wrong, ok, wrong, wrong, none, ok, bad]
    finished = [True, False, True, True, True, True, True]
    assert pair_samples(texts, results, finished, 1) == [("4", "5")]  # '5' is the most frequent wrong answer
    assert set(pair_samples(texts, results, finished, 5)) == {("4", "5"), ("4", "7"), ("4", "x")}
    assert pair_samples(["4", "4"], [ok, ok], [True, True], 3) == []


def test_on_policy_pairs_counts_built_and_dropped(tiny_model, logged):
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer

    tokenizer, model = load_tokenizer(str(tiny_model)), load_policy(str(tiny_model))

    # Graded by the parity of the first character, except rows whose verdict is fixed: those prompts lack one side.
    def parity(completion, mode):
        return {"always": 1.0, "never": 0.0}.get(mode, float(ord(completion.strip()[0]) % 2))

    rows = [{"prompt": f"What is {i}+1?", "mode": m} for i, m in enumerate(["parity"] * 4 + ["always", "never"])]
    torch.manual_seed(0)
    spec = OnPolicySpec(verifier="parity", n=8, temperature=1.0, max_new_tokens=6, pairs_per_prompt=2)
    pairs, stats = on_policy_pairs(model, tokenizer, rows, spec, resolve(parity), "stages.dpo")
    assert stats["prompts_without_incorrect"] == 1 and stats["prompts_without_correct"] == 1
    assert stats["prompts_dropped"] == 2 and stats["pairs_built"] == len(pairs) >= 4
    assert all(ord(p["chosen"].strip()[0]) % 2 == 1 and ord(p["rejected"].strip()[0]) % 2 == 0 for p in pairs)
    assert {p["prompt"] for p in pairs} <= {r["prompt"] for r in rows[:4]}
    assert "dropped 2 prompts" in logged()
    with pytest.raises(UserError, match="no pairs could be built"):
        on_policy_pairs(model, tokenizer, rows[4:], spec, resolve(parity), "stages.dpo")


def test_render_pairs_ends_each_answer_with_one_end_of_turn(tiny_model):
    from alignment.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model))
    [pair] = render_pairs(tokenizer, [{"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}])
    assert pair == {"prompt": "<|user|>What is 2+2?<|end|><|assistant|>", "chosen": "4<|end|>", "rejected": "5<|end|>"}


def test_score_texts_uses_the_shared_rendering_and_ignores_padding(tiny_model):
    from transformers import AutoModelForSequenceClassification

    from alignment.data.formatting import render_completion, render_prompt
    from alignment.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_model), num_labels=1)
    prompts = ["What is 2+2?", [USER], "What is 12+30?"]
    completions = ["4", "five", "42 is the answer"]
    batched = score_texts(model, tokenizer, prompts, completions, batch_size=3)
    for prompt, completion, score in zip(prompts, completions, batched):
        ids = encode(tokenizer, render_prompt(tokenizer, prompt) + render_completion(tokenizer, prompt, completion))
        alone = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        assert score == pytest.approx(alone, abs=1e-5)
    assert score_rendered(model, tokenizer, ["<|user|>What is 2+2?<|end|><|assistant|>4<|end|>"]) == pytest.approx(
        batched[:1], abs=1e-5
    )
    assert len({round(s, 4) for s in batched}) == 3


def test_a_cut_off_completion_is_scored_as_sampled_without_an_end_of_turn(tiny_model):
    from transformers import AutoModelForSequenceClassification

    from alignment.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_model), num_labels=1)
    prompts, completions = ["What is 2+2?"] * 2, ["4", "4"]
    finished, cut_off = score_texts(model, tokenizer, prompts, completions, finished=[True, False])
    assert finished == pytest.approx(
        score_rendered(model, tokenizer, ["<|user|>What is 2+2?<|end|><|assistant|>4<|end|>"])[0]
    )
    assert cut_off == pytest.approx(score_rendered(model, tokenizer, ["<|user|>What is 2+2?<|end|><|assistant|>4"])[0])
    assert abs(finished - cut_off) > 1e-4
    with pytest.raises(ValueError, match="finished flags"):
        score_texts(model, tokenizer, prompts, completions, finished=[True])


def test_without_a_pad_token_the_reward_model_still_sees_where_an_answer_ends(tiny_model, tmp_path):
    """Padding with EOS (= the end-of-turn token here, as in SmolLM2) would make the score head read the token
    before it: `4<|end|>` and `4` would score the same. A spare special token pads instead."""
    from helpers import without_pad_token
    from transformers import AutoModelForSequenceClassification

    from alignment.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(without_pad_token(tiny_model, tmp_path)))
    assert tokenizer.pad_token == "<pad>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_model), num_labels=1)
    model.config.pad_token_id = None  # as a fresh reward model of such a checkpoint: scoring takes the tokenizer's
    finished, cut_off = score_texts(model, tokenizer, ["What is 2+2?"] * 2, ["4", "4"], finished=[True, False])
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert abs(finished - cut_off) > 1e-4


# Anthropic HH-RLHF rows as the dataset holds them (Anthropic/hh-rlhf, helpful-base): each side is the whole
# transcript, the same up to the last Assistant turn.
HH_PREFIX = (
    "\n\nHuman: Hi, I want to learn to play horseshoes. Can you teach me?\n\nAssistant: I can, but maybe I "
    "should begin by telling you that a typical game consists of 2 players and 6 horseshoes.\n\nHuman: "
    "Okay. What else is needed to play, and what are the rules?"
)
HH_ROW = {
    "chosen": HH_PREFIX + "\n\nAssistant: A horseshoe is usually made out of metal and is about 3 to 3.5 inches "
    "long and around 1 inch thick. We also need two stakes and six horseshoes.",
    "rejected": HH_PREFIX + "\n\nAssistant: Horseshoes are either metal or plastic discs. The horseshoes come in "
    "different weights, and the lighter ones are easier to throw.",
}
HH_PROMPT = [
    {"role": "user", "content": "Hi, I want to learn to play horseshoes. Can you teach me?"},
    {
        "role": "assistant",
        "content": "I can, but maybe I should begin by telling you that a typical game consists "
        "of 2 players and 6 horseshoes.",
    },
    {"role": "user", "content": "Okay. What else is needed to play, and what are the rules?"},
]


def hh_spec(**extra):
    from alignment.config.data import DataSpec

    return DataSpec(dataset="Anthropic/hh-rlhf", **extra)


@pytest.mark.parametrize("family", ["llama3", "qwen2.5"])
def test_hh_transcripts_become_turns_rendered_as_sampling_renders_them(family, logged):
    """Detected without `format:` (and said in the log): the shared turns are the prompt as a conversation, the
    last Assistant turns the answers, so the pair's prompt text is exactly what the samplers feed."""
    from chat_templates import family_tokenizer

    from alignment.data.formatting import render_prompt

    tokenizer = family_tokenizer(family)
    pairs, dropped = normalize_pairs(datasets.Dataset.from_list([HH_ROW]), "stages.rm.data")
    assert "Anthropic HH transcripts" in logged() and not dropped
    assert pairs[0]["prompt"] == HH_PROMPT
    assert pairs[0]["chosen"].startswith("A horseshoe is") and pairs[0]["rejected"].startswith("Horseshoes are")
    rendered = render_pairs(tokenizer, pairs)[0]
    assert rendered["prompt"] == render_prompt(tokenizer, HH_PROMPT)
    assert "Human:" not in rendered["prompt"] + rendered["chosen"] + rendered["rejected"]
    assert rendered["chosen"].startswith("A horseshoe is") and rendered["chosen"].endswith(tokenizer.eos_token)


def test_hh_format_given_parses_rows_and_drops_empty_answers():
    rows = [HH_ROW, {"chosen": HH_ROW["chosen"], "rejected": HH_PREFIX + "\n\nAssistant:"}]
    pairs, dropped = normalize_pairs(datasets.Dataset.from_list(rows), "stages.dpo.data", hh_spec(format="hh"))
    assert [p["prompt"] for p in pairs] == [HH_PROMPT]
    assert dropped == {"empty chosen or rejected": 1}


def test_text_pairs_without_hh_markers_are_not_read_as_hh(logged):
    pairs, _ = normalize_pairs(
        datasets.Dataset.from_list(
            [{"chosen": "Human: what is 40+2?\nAssistant: 42", "rejected": "Human: what is 40+2?\nAssistant: 43"}]
        ),
        "w",
    )
    assert pairs[0]["prompt"] == "Human: what is 40+2?\nAssistant: " and "HH" not in logged()


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"chosen": HH_PREFIX, "rejected": HH_ROW["rejected"]},
            r"line 1 of \S+, column 'chosen' is not an Anthropic HH transcript "
            r".*no Assistant turn after its last Human",
        ),
        (
            {"chosen": "Assistant: hi", "rejected": HH_ROW["rejected"]},
            r"'chosen' is not .*does not start with a 'Human:'",
        ),
        (
            {"chosen": HH_ROW["chosen"], "rejected": HH_ROW["rejected"].replace("Okay.", "Fine.")},
            r"line 1 of \S+: the HH transcripts in 'chosen' and 'rejected' differ at turn 3, "
            r"before their last Assistant",
        ),
        ({"prompt": "q", **HH_ROW}, r"`format: hh` takes the prompt from the transcripts.*also has a 'prompt'"),
        ({"chosen": 3, "rejected": HH_ROW["rejected"]}, r"'chosen' is not an Anthropic HH transcript .*it is int"),
    ],
)
def test_malformed_hh_rows_name_the_row(tmp_path, row, message):
    from alignment.data.loading import load_rows

    path = tmp_path / "hh.jsonl"
    path.write_text(json.dumps(row) + "\n")
    spec = hh_spec(format="hh").model_copy(update={"dataset": str(path)})
    with pytest.raises(UserError, match=message):
        normalize_pairs(load_rows(spec, seed=0), "stages.rm.data", spec)


def test_an_unknown_data_format_is_a_recipe_error_and_a_task_keeps_its_own():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="unknown format 'hhh'.*did you mean 'hh'"):
        hh_spec(format="hhh")
    from alignment.config.data import DataSpec

    assert DataSpec(task="arithmetic", format="messages").task_params().format == "messages"
