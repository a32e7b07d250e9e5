"""alignment/sampling: the one sampling path (order, stop tokens, the static-cache option)."""

from __future__ import annotations

import pytest
import torch
from helpers import base_weights, lora_policy, with_skewed_generation_config

from alignment.config.sampling import SamplingSpec
from alignment.data.formatting import render_prompt
from alignment.models.loading import load_policy
from alignment.models.tokenizer import load_tokenizer
from alignment.sampling import generate


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
    tokenizer = load_tokenizer(str(tiny_model))
    model = lora_policy(tiny_model) if adapter else load_policy(str(tiny_model))
    spec = {"temperature": 0, "max_new_tokens": 8, "batch_size": 3}
    dynamic = generate(model, tokenizer, prompts, SamplingSpec(**spec))
    static = generate(model, tokenizer, prompts, SamplingSpec(**spec, cache="static"))
    assert [s.token_ids for s in static] == [s.token_ids for s in dynamic]
    assert [s.finished for s in static] == [s.finished for s in dynamic]


def test_merged_lora_samples_like_the_unmerged_adapter_and_restores_the_base_exactly(tiny_model, prompts):
    from alignment.sampling.samples import lora_merged

    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    spec = {"temperature": 0, "max_new_tokens": 8, "batch_size": 3}
    before = base_weights(model)
    unmerged = generate(model, tokenizer, prompts, SamplingSpec(**spec, merge_lora=False))
    merged = generate(model, tokenizer, prompts, SamplingSpec(**spec))  # merge_lora is the default
    assert [s.token_ids for s in merged] == [s.token_ids for s in unmerged]
    after = base_weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before), "the base weights (the reference) must not drift"
    ids = torch.tensor([tokenizer(prompts[1])["input_ids"]])
    with torch.no_grad():
        with model.disable_adapter():
            reference = model(input_ids=ids).logits
        with lora_merged(model):
            assert not torch.allclose(model(input_ids=ids).logits, reference)  # the adapter is in the weights
        policy = model(input_ids=ids).logits
        with model.disable_adapter():
            assert torch.equal(model(input_ids=ids).logits, reference)
    assert not torch.allclose(policy, reference)  # the adapter runs in the forward pass again


def test_merged_lora_restores_the_base_when_sampling_fails(tiny_model):
    from alignment.sampling.samples import lora_merged

    model = lora_policy(tiny_model)
    before = base_weights(model)
    with pytest.raises(RuntimeError, match="out of memory"):
        with lora_merged(model):
            assert not all(torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)
            raise RuntimeError("CUDA out of memory (simulated)")
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)
    assert not any(m.merged for m in model.modules() if hasattr(m, "merged_adapters"))


def test_running_out_of_memory_while_merging_names_the_setting(tiny_model, monkeypatch):
    from peft.tuners.lora import LoraLayer

    from alignment.errors import UserError
    from alignment.sampling.samples import lora_merged

    model = lora_policy(tiny_model)
    before = base_weights(model)
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]

    def out_of_memory(*_, **__):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(layers[3], "merge", out_of_memory)  # three layers are merged by then
    with pytest.raises(UserError, match=r"merge_lora: false.*rollout:"):
        with lora_merged(model):
            pass
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)
    assert not any(layer.merged for layer in layers)


def test_merge_lora_is_a_no_op_without_an_adapter(tiny_model, prompts):
    tokenizer, model = load_tokenizer(str(tiny_model)), load_policy(str(tiny_model))
    spec = {"temperature": 0, "max_new_tokens": 6}
    assert ([s.token_ids for s in generate(model, tokenizer, prompts, SamplingSpec(**spec))]
            == [s.token_ids for s in generate(model, tokenizer, prompts, SamplingSpec(**spec, merge_lora=False))])


@pytest.mark.parametrize("spec", [{"temperature": 0}, {"temperature": 1.0, "n": 3}, {"temperature": 0.7, "top_p": 0.9}],
                         ids=["greedy", "sampled", "top-p"])
def test_a_checkpoints_generation_config_does_not_change_what_is_sampled(tiny_model, prompts, tmp_path, spec):
    tokenizer = load_tokenizer(str(tiny_model))
    clean, skewed = load_policy(str(tiny_model)), load_policy(str(with_skewed_generation_config(tiny_model, tmp_path)))
    settings = SamplingSpec(max_new_tokens=8, **spec)
    runs = []
    for model in (clean, skewed):
        torch.manual_seed(0)
        runs.append([s.token_ids for s in generate(model, tokenizer, prompts, settings)])
    assert runs[0] == runs[1]
    assert skewed.generation_config.min_p == 0.99  # the checkpoint's own config is back after sampling
    ids = torch.tensor([tokenizer(prompts[0], add_special_tokens=False)["input_ids"]])
    with torch.no_grad():  # left to transformers, the skewed config does change generation (2 beams, 2 tokens)
        plain = clean.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        skew = skewed.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert plain.tolist() != skew.tolist()


def test_the_stop_set_is_the_union_of_eos_end_of_turn_and_the_checkpoints_eos_ids(tiny_model, tmp_path):
    from alignment.sampling import stop_token_ids

    tokenizer = load_tokenizer(str(tiny_model))
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    two_eos = load_policy(str(with_skewed_generation_config(tiny_model, tmp_path, extra_eos=10)))
    assert stop_token_ids(tokenizer) == sorted({tokenizer.eos_token_id, end})
    assert stop_token_ids(tokenizer, two_eos) == sorted({tokenizer.eos_token_id, end, 10})
    prompt = render_prompt(tokenizer, "What is 1+2?")
    torch.manual_seed(0)
    samples = generate(two_eos, tokenizer, [prompt] * 16, SamplingSpec(temperature=1.0, max_new_tokens=30))
    for sample in samples:  # nothing is sampled past token 10: it ends the answer like EOS does
        assert 10 not in sample.token_ids[:-1]
        assert sample.finished == (sample.token_ids[-1] in stop_token_ids(tokenizer, two_eos))
    assert any(s.token_ids[-1] == 10 for s in samples)  # the random policy does sample it
