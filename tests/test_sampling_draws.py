"""`draw: inverse_cdf` (alignment/sampling/decode.py `inverse_cdf`): one uniform number per row instead of
torch.multinomial's exponential number per vocabulary entry: tokens follow the model's (warped) distribution, a
token cut by top-k or top-p is never drawn, a seed repeats the samples."""

from __future__ import annotations

import pytest
import torch
from helpers import shaken, tiny_ppo_recipe
from pydantic import ValidationError

from alignment.config.recipe import load_recipe
from alignment.config.sampling import SamplingSpec
from alignment.models.loading import load_policy
from alignment.models.tokenizer import load_tokenizer
from alignment.run.runner import run_recipe
from alignment.sampling import decode, generate, samples
from alignment.sampling.decode import inverse_cdf, warpers


def test_inverse_cdf_picks_the_token_whose_span_holds_the_uniform_number():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75], [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])  # row 3: unnormalised
    torch.manual_seed(0)
    u = torch.rand((3, 1), dtype=torch.float64)[:, 0].tolist()
    # spans by hand: row 1 [0, .25) -> 1, [.25, 1) -> 3; row 2 [0, .5) -> 0, [.5, 1) -> 1; row 3 all -> 3
    expected = [1 if u[0] < 0.25 else 3, 0 if u[1] < 0.5 else 1, 3]
    torch.manual_seed(0)
    assert inverse_cdf(probs).tolist() == expected


def test_inverse_cdf_never_draws_a_token_of_probability_zero():
    probs = torch.zeros(20000, 6, dtype=torch.float32)
    probs[:, 1], probs[:, 4] = 0.1, 0.9  # zero spans at the start, between and at the end
    torch.manual_seed(0)
    drawn = inverse_cdf(probs)
    assert set(drawn.tolist()) == {1, 4}
    assert abs((drawn == 1).double().mean().item() - 0.1) < 0.01


@pytest.fixture(scope="module")
def varied_model(tiny_model):
    return shaken(load_policy(str(tiny_model)))


@pytest.mark.parametrize(
    "spec", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}], ids=["temperature-1", "top-k"]
)
def test_inverse_cdf_draws_follow_the_models_distribution(tiny_model, varied_model, prompts, spec):
    """3000 one-token samples of one prompt: their frequencies match the warped softmax (total variation < 0.05),
    and top-k's cut tokens never appear."""
    tokenizer = load_tokenizer(str(tiny_model))
    settings = SamplingSpec(n=3000, max_new_tokens=1, batch_size=500, draw="inverse_cdf", **spec)
    torch.manual_seed(0)
    samples = generate(varied_model, tokenizer, prompts[:1], settings)
    ids = torch.tensor([tokenizer(prompts[0], add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logits = varied_model(input_ids=ids).logits[:, -1].float()
    probs = warpers(settings)(None, logits)[0].softmax(-1)
    counts = torch.bincount(torch.tensor([s.token_ids[0] for s in samples]), minlength=probs.numel()).float()
    assert 0.5 * (counts / counts.sum() - probs).abs().sum() < 0.05
    assert counts[probs == 0].sum() == 0


def test_a_seed_repeats_inverse_cdf_samples_and_they_differ_from_generates(tiny_model, varied_model, prompts):
    tokenizer = load_tokenizer(str(tiny_model))
    runs = []
    for draw in ("inverse_cdf", "inverse_cdf", "generate"):
        torch.manual_seed(0)
        runs.append(generate(varied_model, tokenizer, prompts, SamplingSpec(n=3, max_new_tokens=12, draw=draw)))
    ours, again, theirs = ([s.token_ids for s in run] for run in runs)
    assert ours == again and ours != theirs
    assert all(len(s.logprobs) == len(s.token_ids) for s in runs[0])  # log-probs come back as with any draw


@pytest.mark.parametrize("other", [{"engine": "generate"}, {"cache": "static"}])
def test_inverse_cdf_is_refused_where_the_loop_does_not_draw(other):
    with pytest.raises(ValidationError, match="draw: inverse_cdf"):
        SamplingSpec(draw="inverse_cdf", **other)


def test_a_ppo_run_samples_its_rollouts_in_bf16_with_inverse_cdf_draws_and_trains(tmp_path, tiny_model, monkeypatch):
    """`rollout: {dtype: bfloat16, draw: inverse_cdf}` end to end: every rollout step draws through `inverse_cdf` on
    bf16 weights, PPO trains its fp32 policy from them, and the saved policy is fp32 and moved."""
    sampled_by, seen = [], []  # the model a sampling call casts; the type of its weights at each draw
    draw, cast = decode.inverse_cdf, samples.weights_as

    def spying_cast(model, dtype):
        sampled_by[:] = [model]
        return cast(model, dtype)

    def spying_draw(probs):
        seen.append(next(p.dtype for p in sampled_by[0].parameters()))
        return draw(probs)

    monkeypatch.setattr(decode, "inverse_cdf", spying_draw)
    monkeypatch.setattr("alignment.sampling.hf.weights_as", spying_cast)
    path = tiny_ppo_recipe(tmp_path, tiny_model, rollout={"dtype": "bfloat16", "draw": "inverse_cdf"})
    metrics = run_recipe(load_recipe(path))["ppo"]["metrics"]
    assert metrics["updates"] == 3
    assert len(seen) >= 3 * 5 and set(seen) == {torch.bfloat16}  # 3 rollouts of up to 6 tokens, all drawn in bf16
    trained = load_policy(str(tmp_path / "out" / "ppo")).state_dict()
    start = load_policy(str(tiny_model)).state_dict()
    assert all(t.dtype == torch.float32 for t in trained.values())
    assert any(not torch.equal(trained[k], start[k]) for k in start)
