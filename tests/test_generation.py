"""generation.py: the one sampling path (order, stop tokens, the static-cache option)."""

from __future__ import annotations

import pytest
import torch

from alignment.formatting import render_prompt
from alignment.generation import SamplingSpec, generate
from alignment.models import load_policy, load_tokenizer


@pytest.fixture(scope="module")
def prompts(tiny_model):
    tokenizer = load_tokenizer(str(tiny_model))
    # Different lengths, so batches are left-padded and sorted by length.
    return [render_prompt(tokenizer, f"What is {a}+{b}?") for a, b in [(1, 2), (37, 48), (5, 60), (99, 9), (12, 345)]]


def test_samples_come_back_in_prompt_order_with_their_tokens(tiny_model, prompts):
    tokenizer, model = load_tokenizer(str(tiny_model)), load_policy(str(tiny_model))
    greedy = generate(model, tokenizer, prompts, SamplingSpec(temperature=0, max_new_tokens=6, batch_size=2))
    alone = [generate(model, tokenizer, [p], SamplingSpec(temperature=0, max_new_tokens=6))[0] for p in prompts]
    assert [s.prompt_index for s in greedy] == list(range(len(prompts)))
    assert [s.token_ids for s in greedy] == [s.token_ids for s in alone]  # padding and sorting change nothing
    torch.manual_seed(0)
    sampled = generate(model, tokenizer, prompts, SamplingSpec(temperature=1.0, max_new_tokens=6, n=3))
    assert [s.prompt_index for s in sampled] == [i for i in range(len(prompts)) for _ in range(3)]
    assert all(len(s.token_ids) <= 6 for s in sampled)


@pytest.mark.parametrize("adapter", [False, True], ids=["plain", "lora"])
def test_static_cache_decodes_exactly_like_the_dynamic_cache(tiny_model, prompts, adapter):
    from alignment.models import LoraSpec, apply_lora

    tokenizer, model = load_tokenizer(str(tiny_model)), load_policy(str(tiny_model))
    if adapter:
        model = apply_lora(model, LoraSpec(r=4, lora_alpha=8))
        with torch.no_grad():  # a non-zero adapter, so the LoRA path really contributes
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.05)
    spec = {"temperature": 0, "max_new_tokens": 8, "batch_size": 3}
    dynamic = generate(model, tokenizer, prompts, SamplingSpec(**spec))
    static = generate(model, tokenizer, prompts, SamplingSpec(**spec, cache="static"))
    assert [s.token_ids for s in static] == [s.token_ids for s in dynamic]
    assert [s.finished for s in static] == [s.finished for s in dynamic]
