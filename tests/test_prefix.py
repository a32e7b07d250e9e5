"""alignment/models/prefix.py: a prefix every row shares, run once, gives the forward passes' values of whole rows
(the evaluation's KL reference pass, reward-model scoring) to summation order, and runs fewer tokens."""

from __future__ import annotations

import functools

import pytest
import torch

from alignment.data.formatting import encode, render_prompt
from alignment.models.loading import load_policy, load_reward_model
from alignment.models.prefix import after_prefix, forward_after_prefix, shared_prefix
from alignment.models.tokenizer import load_tokenizer, pad_token_id
from alignment.rl import prompt_completion_batch, sequence_logprobs
from alignment.training.scoring import score_ids

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer with the sum only."}
QUESTIONS = [(1, 2), (37, 48), (5, 60), (99, 9), (12, 345), (7, 7)]


@pytest.fixture(scope="module")
def chat(tiny_model):
    """(tokenizer, encoded prompts behind one system prompt, completions of different lengths)."""
    tokenizer = load_tokenizer(str(tiny_model))
    prompts = [
        encode(tokenizer, render_prompt(tokenizer, [SYSTEM, {"role": "user", "content": f"What is {a}+{b}?"}]))
        for a, b in QUESTIONS
    ]
    completions = [
        tokenizer(str(a + b) + " is the sum" * (i % 3), add_special_tokens=False)["input_ids"]
        for i, (a, b) in enumerate(QUESTIONS)
    ]
    return tokenizer, prompts, completions


def perturbed(model, seed: int):
    """`model` with its weights moved, so its outputs are far from uniform."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    return model.eval()


def counting(model, widths: list[int]):
    """Record the width of every forward's input on `model` (its signature kept: callers read it)."""
    forward = model.forward

    @functools.wraps(forward)
    def recorded(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    model.forward = recorded


def test_shared_prefix_counts_the_common_tokens_and_leaves_each_row_one():
    rows = [list(range(20)) + [7, 8], list(range(20)) + [9], list(range(20)) + [1, 2, 3]]
    assert shared_prefix(rows) == 20
    assert shared_prefix([list(range(12)), list(range(12))]) == 11  # equal rows keep their last token
    assert shared_prefix([list(range(7)) + [1], list(range(7)) + [2]]) == 0  # under MIN_SHARED_PREFIX
    assert shared_prefix([list(range(30))]) == 0  # one row: nothing to share


def test_log_probs_after_a_shared_prefix_equal_the_whole_rows(tiny_model, chat):
    """sequence_logprobs through `after_prefix` on prompts whose system prompt is left out (left padding inside
    the rest, completions of different lengths) equals the whole rows' to fp32 rounding, and the prefix runs on
    one row only."""
    tokenizer, prompts, completions = chat
    model = perturbed(load_policy(str(tiny_model)), 3)
    pad = pad_token_id(tokenizer)
    shared = shared_prefix(prompts)
    assert shared >= 8 and len({len(p) for p in prompts}) > 1
    ids, mask, keep = prompt_completion_batch(prompts, completions, pad)
    rest_ids, rest_mask, rest_keep = prompt_completion_batch([p[shared:] for p in prompts], completions, pad)
    k = keep.shape[1]
    with torch.no_grad():
        whole = sequence_logprobs(model, ids, mask, k)
        widths = []
        counting(model, widths)
        cut = sequence_logprobs(after_prefix(model, torch.tensor(prompts[0][:shared])), rest_ids, rest_mask, k)
    assert torch.equal(keep, rest_keep)
    assert widths == [shared, rest_ids.shape[1]] and rest_ids.shape[1] == ids.shape[1] - shared
    assert (whole * keep).abs().sum() > 1.0  # not trivially zero
    assert torch.allclose(whole * keep, cut * keep, atol=1e-4)


def test_after_prefix_without_a_prefix_is_the_model_itself(tiny_model):
    model = load_policy(str(tiny_model))
    assert after_prefix(model, None) is model and after_prefix(model, torch.tensor([], dtype=torch.long)) is model


def test_reward_scores_with_a_shared_prefix_equal_the_whole_rows(tiny_model, chat, tmp_path):
    """score_ids runs a batch's common prefix once; the scores equal a forward over each whole row alone."""
    tokenizer, prompts, completions = chat
    from transformers import AutoModelForSequenceClassification

    classifier = AutoModelForSequenceClassification.from_pretrained(str(tiny_model), num_labels=1)
    classifier.config.pad_token_id = pad_token_id(tokenizer)
    classifier.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    reward_model = perturbed(load_reward_model(str(tmp_path / "rm")), 4)
    rows = [p + c for p, c in zip(prompts, completions)]
    with torch.no_grad():
        alone = [float(reward_model(input_ids=torch.tensor([r])).logits[0, 0]) for r in rows]
    widths = []
    counting(reward_model, widths)
    scores = score_ids(reward_model, tokenizer, rows, batch_size=4)
    assert max(abs(a - b) for a, b in zip(scores, alone)) < 1e-4
    assert max(alone) - min(alone) > 1e-3  # the rows score differently: the head read each row's own last token
    shared = shared_prefix(rows)
    assert len(widths) == 4 and widths[0] >= shared and widths[2] >= shared  # each batch's prefix on one row
    assert widths[0] + widths[1] == max(map(len, rows))  # then the longest row's rest, not the whole row


def test_forward_after_prefix_runs_the_plain_forward_without_one(tiny_model, chat):
    tokenizer, prompts, _ = chat
    model = perturbed(load_policy(str(tiny_model)), 5)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        through = forward_after_prefix(model, None, ids, torch.ones_like(ids)).logits
    assert torch.equal(plain, through)
