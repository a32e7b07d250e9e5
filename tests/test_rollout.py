"""PPO's rollout container (alignment/training/rollout.py): shapes checked at construction, rows sliced
together, padding trimmed; and a seeded tiny PPO run recorded before the loop used it.

    python -m pytest tests/test_rollout.py -q
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import tiny_ppo_recipe, trainable_digest

from alignment.config.recipe import load_recipe
from alignment.rl import masked_mean, prompt_completion_batch
from alignment.run.runner import run_recipe
from alignment.training.rollout import Rollout, RolloutStats

PAD = 0


def make_rollout(lengths=(2, 5, 0, 3), prompts=(3, 1, 2, 2)) -> Rollout:
    """B = 4 rows, P = 3, T = 5; each [B, T] field holds distinct values (row * 10 + column)."""
    prompt_ids = [[7] * n for n in prompts]
    response_ids = [[9] * n for n in lengths]
    ids, attention, mask = prompt_completion_batch(prompt_ids, response_ids, PAD)
    rows, width = len(lengths), mask.shape[1]
    grid = torch.arange(rows)[:, None] * 10.0 + torch.arange(width)[None, :]
    return Rollout(
        query_responses=ids,
        attention_mask=attention,
        response_mask=mask,
        logprobs=-grid,
        ref_logprobs=-grid - 0.5,
        values=grid / 100,
        entropy=grid + 0.25,
        scores=torch.arange(rows, dtype=torch.float),
        finished=torch.tensor([True, False, True, True]),
    )


def tensors(rollout: Rollout) -> dict[str, torch.Tensor]:
    return {
        f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout) if getattr(rollout, f.name) is not None
    }


def with_advantages(rollout: Rollout) -> Rollout:
    return dataclasses.replace(rollout, advantages=rollout.values * 2, returns=rollout.values * 3)


# ---------------------------------------------------------------------------------------------------
# Slicing


@pytest.mark.parametrize(
    "rows",
    [torch.tensor([2, 0]), [2, 0], slice(1, 3), torch.tensor([False, True, True, False])],
    ids=["tensor", "list", "slice", "bool-mask"],
)
def test_indexing_takes_the_same_rows_of_every_field(rows):
    whole = with_advantages(make_rollout())
    part = whole[rows]
    expected = torch.arange(4)[rows]
    assert isinstance(part, Rollout) and len(part) == len(expected)
    for name, value in tensors(part).items():
        assert torch.equal(value, getattr(whole, name)[expected]), name
    assert part.response_width == whole.response_width
    assert part.query_responses.shape[1] == whole.query_responses.shape[1]


def test_one_int_is_refused_rather_than_dropping_the_batch_dimension():
    rollout = make_rollout()
    for index in (1, torch.tensor(1)):
        with pytest.raises(TypeError, match="one int would drop the batch dimension"):
            rollout[index]
    assert len(rollout[1:2]) == 1


def test_trimmed_cuts_only_the_columns_that_are_padding_in_every_row():
    whole = with_advantages(make_rollout())
    part = whole[torch.tensor([0, 3])]  # responses of 2 and 3 tokens out of T = 5
    cut = part.trimmed()
    assert cut.response_width == 3 and cut.query_responses.shape[1] == 3 + 3
    assert torch.equal(cut.query_responses, part.query_responses[:, :6])
    assert torch.equal(cut.attention_mask.sum(1), part.attention_mask.sum(1))  # no real token cut off
    for name in ("logprobs", "ref_logprobs", "values", "entropy", "advantages", "returns"):
        assert masked_mean(getattr(cut, name), cut.response_mask) == masked_mean(
            getattr(part, name), part.response_mask
        )
    assert torch.equal(cut.scores, part.scores) and torch.equal(cut.finished, part.finished)
    assert all(value.is_contiguous() for value in tensors(cut).values())
    assert whole.trimmed().response_width == 5  # the longest response fills T
    assert whole[torch.tensor([2])].trimmed().response_width == 1  # an empty response keeps one column


def test_trimmed_also_cuts_the_prompt_padding_every_row_has():
    whole = with_advantages(make_rollout())  # prompts of 3, 1, 2, 2 tokens, left-padded to P = 3
    part = whole[torch.tensor([2, 3])]  # prompts of 2 tokens, responses of 0 and 3
    cut = part.trimmed()
    assert cut.response_width == 3 and cut.query_responses.shape[1] == 2 + 3
    assert torch.equal(cut.query_responses, part.query_responses[:, 1:6])
    assert torch.equal(cut.attention_mask.sum(1), part.attention_mask.sum(1))  # no real token cut off
    assert torch.equal(cut.logprobs, part.logprobs[:, :3])  # [B, T] fields keep their columns from the first
    assert whole[torch.tensor([1, 2])].trimmed().query_responses.shape[1] == 2 + 5  # the longer prompt decides


# ---------------------------------------------------------------------------------------------------
# Construction checks


@pytest.mark.parametrize(
    "name, bad, message",
    [
        (
            "values",
            lambda r: r.values[:, :4],
            r"Rollout.values: shape \[4, 4\] does not fit \[B, T\]: T is 5 in response_mask",
        ),
        (
            "scores",
            lambda r: r.scores[:3],
            r"Rollout.scores: shape \[3\] does not fit \[B\]: B is 4 in query_responses",
        ),
        (
            "logprobs",
            lambda r: r.logprobs[:, :, None],
            r"Rollout.logprobs: expected a tensor \[B, T\], got shape \[4, 5, 1\]",
        ),
        ("finished", lambda r: r.finished[:, None], r"Rollout.finished: expected a tensor \[B\], got shape \[4, 1\]"),
        (
            "attention_mask",
            lambda r: r.attention_mask[:, 1:],
            r"Rollout.attention_mask: .* P\+T is 8 in query_responses",
        ),
        ("entropy", lambda r: r.entropy.tolist(), r"Rollout.entropy: expected a tensor \[B, T\], got list"),
    ],
)
def test_a_wrong_shaped_field_is_refused_naming_it(name, bad, message):
    rollout = make_rollout()
    with pytest.raises((ValueError, TypeError), match=message):
        dataclasses.replace(rollout, **{name: bad(rollout)})


def test_other_inconsistencies_are_refused():
    rollout = make_rollout()
    with pytest.raises(ValueError, match="advantages and returns are set together"):
        dataclasses.replace(rollout, advantages=rollout.values)
    with pytest.raises(ValueError, match=r"Rollout.returns: shape \[4, 2\] does not fit \[B, T\]"):
        dataclasses.replace(with_advantages(rollout), returns=rollout.values[:, :2])
    wide = torch.zeros(4, 9)
    with pytest.raises(ValueError, match="query_responses has 3 columns, fewer than the 9 of response_mask"):
        Rollout(
            **{
                **tensors(rollout),
                "query_responses": rollout.query_responses[:, :3],
                "attention_mask": rollout.attention_mask[:, :3],
                "response_mask": wide,
                "logprobs": wide,
                "ref_logprobs": wide,
                "values": wide,
                "entropy": wide,
            }
        )
    with pytest.raises(TypeError, match="Rollout.values: expected a tensor"):
        dataclasses.replace(rollout, values=None)


def test_stats_stay_out_of_the_sliced_container():
    names = {f.name for f in dataclasses.fields(Rollout)}
    assert not names & {f.name for f in dataclasses.fields(RolloutStats)}
    assert all(f.metadata["dims"][0] == "B" for f in dataclasses.fields(Rollout))  # every field has a row per sequence


# ---------------------------------------------------------------------------------------------------
# The loop that uses it: a seeded tiny PPO run, recorded before the Rollout container

# LoRA; rollouts long enough that some responses stop early (micro-batches are trimmed, the EOS penalty
# applies); running reward normalisation, adaptive KL, 2 epochs, 2 micro-batches per step.
SEEDED_RUN = dict(
    rollout={"max_new_tokens": 40, "temperature": 1.5},
    missing_eos_penalty=0.5,
    kl_target=0.5,
    train={"ppo_epochs": 2, "reward_norm": "running"},
)
LOGGED = (
    "score",
    "kl",
    "kl_coef",
    "entropy",
    "policy_loss",
    "value_loss",
    "clipfrac",
    "approx_kl",
    "grad_norm",
    "explained_variance",
    "value_mean",
    "response_length",
    "eos_fraction",
)


def seeded_run(folder, tiny_model) -> dict:
    """The run's logged metrics per update and a fingerprint of its trained policy adapter."""
    path = tiny_ppo_recipe(folder, tiny_model, **SEEDED_RUN)
    run_recipe(load_recipe(path))
    out = folder / "out" / "ppo"
    history = json.loads((out / "log_history.json").read_text())
    adapter = trainable_digest(out / "adapter" / "adapter_model.safetensors").values()
    return {
        "history": [{key: entry[key] for key in LOGGED} for entry in history],
        "adapter_sum": sum(t.double().sum().item() for t in adapter),
        "adapter_abs_sum": sum(t.double().abs().sum().item() for t in adapter),
    }


# Recorded with torch 2.13 on CPU (the Rollout loop trains byte-equal weights to the loop over a dict batch it
# replaced). The tolerance leaves room for another platform's float rounding only.
RECORDED = {
    "score": [-3.984375, -3.828125, -3.953125],
    "kl": [0.0, -0.082445, 0.399568],
    "kl_coef": [0.05, 0.049992, 0.049984],
    "entropy": [4.615196, 4.616234, 4.616183],
    "policy_loss": [-0.255843, -0.050815, -0.124606],
    "value_loss": [0.109785, 0.134275, 0.143077],
    "clipfrac": [0.005814, 0.006394, 0.0],
    "approx_kl": [0.000566, 0.001116, 0.000519],
    "grad_norm": [0.185856, 0.213786, 0.229516],
    "explained_variance": [0.0, -0.043639, -0.037439],
    "value_mean": [0.0, -0.175279, -0.214597],
    "response_length": [32.25, 30.5, 31.375],
    "eos_fraction": [0.375, 0.5, 0.5],
    "adapter_sum": 2.0029980782564962,
    "adapter_abs_sum": 419.26887602540955,
}


def test_seeded_tiny_ppo_run_trains_as_recorded_before_the_rollout_container(tmp_path, tiny_model):
    """Same rollouts, advantages, minibatches and updates as the loop before `Rollout`: every logged
    metric of the 3 updates and the trained adapter match the recorded run."""
    run = seeded_run(tmp_path, tiny_model)
    observed = {key: [entry[key] for entry in run["history"]] for key in LOGGED}
    observed.update(adapter_sum=run["adapter_sum"], adapter_abs_sum=run["adapter_abs_sum"])
    for key, recorded in RECORDED.items():
        assert observed[key] == pytest.approx(recorded, rel=1e-4, abs=2e-6), key
    assert min(observed["response_length"]) < 40  # some micro-batches were trimmed
