"""The sampler's KV cache (alignment/sampling/kv_cache.py): a `DynamicLayer` that writes each step into reserved
room instead of concatenating, and holds exactly what the concatenating layer holds through every edit the
sampler makes (steps, row selection with repeats, keys and values assigned one after the other)."""

from __future__ import annotations

import torch
from helpers import shaken
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from alignment.config.sampling import SamplingSpec
from alignment.data.formatting import render_prompt
from alignment.models.loading import load_policy
from alignment.models.tokenizer import load_tokenizer
from alignment.sampling import decode, generate
from alignment.sampling.kv_cache import ReservedLayer, reserved_cache


def states(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 8, generator=g), torch.randn(batch, 2, length, 8, generator=g)


def test_the_reserved_layer_holds_what_the_concatenating_layer_holds_through_every_edit():
    plain, reserved = DynamicLayer(), ReservedLayer()
    copies = 0

    def both(method, *args):
        outputs = [getattr(layer, method)(*args) for layer in (plain, reserved)]
        assert torch.equal(reserved.keys, plain.keys) and torch.equal(reserved.values, plain.values)
        assert reserved.get_seq_length() == plain.get_seq_length()
        return outputs

    (pk, pv), (rk, rv) = both("update", *states(3, 11, 0))  # a prefill
    assert torch.equal(rk, pk) and torch.equal(rv, pv)
    buffer = reserved._buffers[0]
    for step in range(1, 41):  # decode steps: one position each
        both("update", *states(3, 1, step))
        copies += reserved._buffers[0] is not buffer
        buffer = reserved._buffers[0]
    assert reserved.get_seq_length() == 51
    assert copies <= 2  # 40 steps grew the buffer at most twice (11 -> 43 -> 64 room), never once per step
    both("batch_select_indices", torch.tensor([2, 0, 0]))  # compaction and a prompt copied to its samples' rows
    both("update", *states(3, 1, 99))  # after a selection the layer fills up again
    both("batch_repeat_interleave", 2)
    # stream.pad_middle and trim assign keys, then read and assign values: each keeps its own length meanwhile
    for layer in (plain, reserved):
        layer.keys = torch.cat([layer.keys[:, :, :5], layer.keys.new_zeros(6, 2, 3, 8), layer.keys[:, :, 5:]], dim=2)
        layer.values = torch.cat(
            [layer.values[:, :, :5], layer.values.new_zeros(6, 2, 3, 8), layer.values[:, :, 5:]], dim=2
        )
    both("update", *states(6, 1, 100))
    assert reserved.get_seq_length() == 56


def test_a_reserved_cache_replaces_only_plain_layers(tiny_model):
    cache = reserved_cache(load_policy(str(tiny_model)))
    assert cache.layers and all(type(layer) is ReservedLayer for layer in cache.layers)


def test_sampling_through_the_reserved_cache_equals_sampling_through_transformers_cache(
    tiny_model, prompts, monkeypatch
):
    """The same ids and log-probs bit for bit, greedy (streamed, rows joining the batch) and sampled (n samples
    of a prompt copied from one prefill), with and without a shared prefix."""
    model, tokenizer = shaken(load_policy(str(tiny_model))), load_tokenizer(str(tiny_model))
    # two prompts after which the shaken model stops within a few tokens: rows leave and join the batch
    prompts = prompts + [render_prompt(tokenizer, f"What is {a}+{b}?") for a, b in [(99, 9), (12, 345)]]
    cases = [
        SamplingSpec(temperature=0, max_new_tokens=20, batch_size=3),
        SamplingSpec(temperature=1.0, n=3, max_new_tokens=20),
        SamplingSpec(temperature=1.0, n=3, max_new_tokens=20, share_prefix=False),
    ]
    for spec in cases:
        runs = []
        for make in (reserved_cache, lambda m: DynamicCache(config=m.config.get_text_config(decoder=True))):
            monkeypatch.setattr(decode, "reserved_cache", make)
            torch.manual_seed(0)
            runs.append(generate(model, tokenizer, prompts, spec))
        ours, theirs = runs
        assert [s.token_ids for s in ours] == [s.token_ids for s in theirs]
        assert [s.logprobs for s in ours] == [s.logprobs for s in theirs]
        assert any(len(s.token_ids) < spec.max_new_tokens for s in ours)  # rows finished before the others
