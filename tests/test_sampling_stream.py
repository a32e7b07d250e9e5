"""alignment/sampling/stream.py: greedy continuous batching (waiting rows take the places of finished ones).

The reference is `engine: generate` (one `model.generate` call per batch), which tests/test_sampling.py holds
equal to the batched loop: the stream must give the same ids, stops and texts, log-probs to fp32 rounding (a row's
logits come from other batches, whose padding columns and row counts change the order of sums), never run more
than `batch_size` rows, keep its batch full while rows wait, and keep its cache as narrow as its rows need.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import lora_policy, shaken
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from alignment.config.sampling import SamplingSpec
from alignment.data.formatting import render_prompt
from alignment.models.loading import load_policy
from alignment.models.tokenizer import load_tokenizer
from alignment.sampling import generate
from alignment.sampling.kv_cache import ReservedLayer
from alignment.sampling.stream import join, streamable, trim


@pytest.fixture(scope="module")
def shaken_model(tiny_model):
    """The tiny model with its weights shaken: greedy answers then stop at different steps (some at once)."""
    return shaken(load_policy(str(tiny_model)))


def arithmetic_prompts(tokenizer, system: bool) -> list[str]:
    head = [{"role": "system", "content": "Answer with the sum only."}] if system else []
    pairs = [(1, 2), (37, 48), (5, 60), (99, 9), (12, 345), (7, 7), (250, 31), (3, 1000), (64, 2), (18, 18)]
    return [render_prompt(tokenizer, head + [{"role": "user", "content": f"What is {a}+{b}?"}]) for a, b in pairs]


def forwards(model, monkeypatch) -> list[tuple[int, int, int]]:
    """Records (rows, input columns, attention-mask columns or 0) of every forward call of `model`."""
    calls, forward = [], model.forward

    @functools.wraps(forward)  # the sampler reads the forward's signature
    def recording(*args, **kwargs):
        mask = kwargs.get("attention_mask")
        calls.append((*kwargs["input_ids"].shape, 0 if mask is None else mask.shape[1]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recording)
    return calls


def both(model, tokenizer, prompts, **spec):
    runs = {
        engine: generate(
            model, tokenizer, prompts, SamplingSpec(temperature=0, max_new_tokens=24, engine=engine, **spec)
        )
        for engine in ("generate", "loop")
    }
    return runs["generate"], runs["loop"]


@pytest.mark.parametrize("system", [True, False], ids=["shared-prefix", "no-prefix"])
@pytest.mark.parametrize(
    "spec",
    [{"batch_size": 3}, {"batch_size": 4, "n": 2}, {"batch_size": 2, "share_prefix": False}],
    ids=["batch3", "n2-batch4", "batch2-whole-prompts"],
)
def test_the_stream_decodes_what_generate_decodes(tiny_model, shaken_model, system, spec):
    tokenizer = load_tokenizer(str(tiny_model))
    prompts = arithmetic_prompts(tokenizer, system)
    settings = SamplingSpec(temperature=0, **spec)
    assert streamable(shaken_model, settings, len(prompts) * settings.n)
    reference, streamed = both(shaken_model, tokenizer, prompts, **spec)
    assert [s.token_ids for s in streamed] == [s.token_ids for s in reference]
    assert [s.finished for s in streamed] == [s.finished for s in reference]
    assert [s.text for s in streamed] == [s.text for s in reference]
    assert any(s.finished for s in streamed) and len({len(s.token_ids) for s in streamed}) > 2  # rows left early
    # The log-probs against a fresh forward of each prompt + completion, alone: the temperature-1 log-softmax.
    for sample in streamed[::3]:
        ids = torch.tensor(
            [tokenizer(prompts[sample.prompt_index], add_special_tokens=False)["input_ids"] + sample.token_ids]
        )
        with torch.no_grad():
            logits = shaken_model(input_ids=ids).logits[0, -len(sample.token_ids) - 1 : -1].float()
        expected = logits.log_softmax(-1).gather(1, torch.tensor(sample.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4)


def test_the_stream_keeps_its_batch_full_while_rows_wait(tiny_model, shaken_model, monkeypatch):
    """Never more than batch_size rows; after the first prefill, prefills of admitted rows only (one row per
    distinct prompt, no wider than the prompts' own rests); fewer row-steps than batches of fixed rows run."""
    tokenizer = load_tokenizer(str(tiny_model))
    prompts = arithmetic_prompts(tokenizer, system=True)
    batched = forwards(shaken_model, monkeypatch)
    spec = {"temperature": 0, "max_new_tokens": 24, "batch_size": 3, "n": 4}  # 40 rows: a stream of many steps
    generate(shaken_model, tokenizer, prompts, SamplingSpec(**spec, engine="generate"))
    monkeypatch.undo()
    calls = forwards(shaken_model, monkeypatch)
    samples = generate(shaken_model, tokenizer, prompts, SamplingSpec(**spec))
    assert max(rows for rows, _, _ in calls) <= 3
    prompt_lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    prefills = [(rows, width) for rows, width, _ in calls if width > 1]
    assert len(prefills) >= 2  # waiting rows were prefilled as places came free (the prefix runs as its own call)
    assert all(width < max(prompt_lengths) for rows, width in prefills[1:] if rows > 1)
    decoded = sum(rows for rows, width, _ in calls if width == 1)
    assert decoded < sum(rows for rows, width, _ in batched if width == 1)  # generate runs finished rows on
    assert decoded >= sum(len(s.token_ids) for s in samples) - len(samples)  # each token but the first is a step
    # The cache holds what the rows in the batch need: never wider than the prefix, the longest prompt rest and
    # the steps since the oldest row in the batch was admitted, i.e. at most prompt + max_new_tokens.
    steps = sum(1 for _, width, _ in calls if width == 1)
    assert steps > max(prompt_lengths) + 24  # without trimming, the cache would outgrow the bound below
    assert max(mask for _, _, mask in calls) <= max(prompt_lengths) + 24


def test_greedy_with_lora_streams_the_same_merged_and_unmerged(tiny_model):
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    prompts = arithmetic_prompts(tokenizer, system=True)
    runs = [
        generate(
            model,
            tokenizer,
            prompts,
            SamplingSpec(temperature=0, max_new_tokens=12, batch_size=3, merge_lora=merge, engine=engine),
        )
        for merge, engine in [(True, "loop"), (False, "loop"), (True, "generate")]
    ]
    assert [s.token_ids for s in runs[0]] == [s.token_ids for s in runs[1]] == [s.token_ids for s in runs[2]]


def test_sampled_calls_with_generates_draws_and_single_batches_do_not_stream(tiny_model, shaken_model):
    """Sampling with `generate`'s draws keeps batches of fixed rows (a row's random draw depends on its batch); so
    does a call that fits one batch (nothing waits). Inverse-CDF draws stream."""
    assert not streamable(shaken_model, SamplingSpec(temperature=1.0, batch_size=2), 10)
    assert not streamable(shaken_model, SamplingSpec(temperature=0, batch_size=10), 10)
    assert streamable(shaken_model, SamplingSpec(temperature=0, batch_size=9), 10)
    assert streamable(shaken_model, SamplingSpec(temperature=1.0, batch_size=9, draw="inverse_cdf"), 10)


def test_inverse_cdf_rows_stream_within_the_batch_and_a_seed_repeats_them(tiny_model, shaken_model, monkeypatch):
    """Sampled rows (temperature 0.7, top-k) stream: never more than batch_size rows, waiting rows prefilled as
    places come free, the same samples from the same seed, and each token's log-prob that of a fresh forward over
    prompt + completion under the distribution drawn from (logits / temperature)."""
    tokenizer = load_tokenizer(str(tiny_model))
    prompts = arithmetic_prompts(tokenizer, system=True)
    spec = SamplingSpec(temperature=0.7, top_k=20, n=4, max_new_tokens=24, batch_size=3, draw="inverse_cdf")
    calls = forwards(shaken_model, monkeypatch)
    torch.manual_seed(0)
    samples = generate(shaken_model, tokenizer, prompts, spec)
    assert max(rows for rows, _, _ in calls) <= 3
    assert len([rows for rows, width, _ in calls if width > 1]) >= 2  # admitted rows were prefilled
    assert any(s.finished for s in samples) and len({len(s.token_ids) for s in samples}) > 2  # rows left early
    torch.manual_seed(0)
    assert [s.token_ids for s in generate(shaken_model, tokenizer, prompts, spec)] == [s.token_ids for s in samples]
    for sample in samples[::5]:
        ids = torch.tensor(
            [tokenizer(prompts[sample.prompt_index], add_special_tokens=False)["input_ids"] + sample.token_ids]
        )
        with torch.no_grad():
            logits = shaken_model(input_ids=ids).logits[0, -len(sample.token_ids) - 1 : -1].float() / 0.7
        expected = logits.log_softmax(-1).gather(1, torch.tensor(sample.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4)


def cache_of_layers(rows: list[list[float]], layer_class=DynamicLayer):
    """A one-layer DynamicCache whose keys and values [rows, 1 head, columns, 1] hold `rows`."""
    cache = DynamicCache()
    layer = layer_class()
    states = torch.tensor(rows)[:, None, :, None]
    layer.lazy_initialization(states, states)
    layer.update(states, states.clone())
    cache.layers = [layer]
    return cache


@pytest.mark.parametrize("layer_class", [DynamicLayer, ReservedLayer], ids=["transformers", "reserved"])
def test_join_pads_the_shorter_side_after_the_prefix_and_trim_drops_columns_nobody_attends(layer_class):
    """Prefix of 2 columns [p, q]. Running rows: 4 columns after it; admitted rows: 2. The admitted rows get 2 zero
    columns after the prefix; then a column no row attends (the first after the prefix) is dropped. The same on the
    sampler's own cache layer (sampling/kv_cache.py), whose keys and values are views of reserved room."""
    cache_of = functools.partial(cache_of_layers, layer_class=layer_class)
    running = cache_of([[1, 2, 0, 3, 4, 5], [1, 2, 6, 7, 8, 9]])
    running_mask = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 0, 1, 1, 1]])
    admitted = cache_of([[1, 2, 10, 11]])
    admitted_mask = torch.tensor([[1, 1, 1, 1]])
    mask = join(running, running_mask, admitted, admitted_mask, shared=2)
    assert mask.tolist() == [[1, 1, 0, 1, 1, 1], [1, 1, 0, 1, 1, 1], [1, 1, 0, 0, 1, 1]]
    assert running.layers[0].keys[:, 0, :, 0].tolist() == [[1, 2, 0, 3, 4, 5], [1, 2, 6, 7, 8, 9], [1, 2, 0, 0, 10, 11]]
    mask = trim(running, mask, shared=2)
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 1, 1]]
    assert running.layers[0].values[:, 0, :, 0].tolist() == [[1, 2, 3, 4, 5], [1, 2, 7, 8, 9], [1, 2, 0, 10, 11]]
    # The other way round: admitted rows longer than the running ones pad the running rows.
    short = cache_of([[1, 2, 3]])
    mask = join(short, torch.tensor([[1, 1, 1]]), cache_of([[1, 2, 4, 5]]), torch.tensor([[1, 1, 1, 1]]), shared=2)
    assert mask.tolist() == [[1, 1, 0, 1], [1, 1, 1, 1]]
    assert short.layers[0].keys[:, 0, :, 0].tolist() == [[1, 2, 0, 3], [1, 2, 4, 5]]
