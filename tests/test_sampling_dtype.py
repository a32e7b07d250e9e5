"""`dtype: bfloat16` in a sampling block (alignment/sampling/samples.py `weights_as`): the call samples from a bf16
copy of the weights, exactly as a bf16 model would, and the model's own fp32 weights come back untouched (the same
tensors), LoRA adapter merged or not. bf16 linear layers on a CPU with native bf16 run on weights laid out for
oneDNN once per call (`prepacked_linears`), with the same samples bit for bit."""

from __future__ import annotations

import copy
import gc
import weakref
from contextlib import nullcontext

import pytest
import torch
from helpers import base_weights, lora_policy, shaken
from pydantic import ValidationError

from alignment.config.sampling import SamplingSpec
from alignment.data.formatting import render_prompt
from alignment.errors import UserError
from alignment.models.loading import load_policy
from alignment.models.prefix import shared_prefix
from alignment.models.tokenizer import load_tokenizer
from alignment.sampling import generate, hf, samples
from alignment.sampling.samples import onednn_runs_bf16, packs_for_onednn, prepacked_linears

CASES = [{"temperature": 0, "batch_size": 3}, {"temperature": 1.0, "n": 3}, {"temperature": 0.7, "top_p": 0.9, "n": 2}]


@pytest.fixture(scope="module")
def varied_model(tiny_model):
    return shaken(load_policy(str(tiny_model)))


@pytest.fixture(scope="module")
def varied_prompts(tiny_model, prompts):
    """The shared prompts and two after which the shaken model stops early, so rows leave the batch."""
    tokenizer = load_tokenizer(str(tiny_model))
    return prompts + [render_prompt(tokenizer, f"What is {a}+{b}?") for a, b in [(99, 9), (12, 345)]]


def params_in_bf16(model):
    """`model` with its parameters cast to bf16 in place; buffers (the rotary frequencies) stay fp32, as they do
    under `dtype: bfloat16` (`model.to(torch.bfloat16)` would round them too and rotate positions otherwise)."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    return model


def sampled(model, tokenizer, prompts, **spec):
    torch.manual_seed(0)
    return generate(model, tokenizer, prompts, SamplingSpec(max_new_tokens=20, **spec))


@pytest.mark.parametrize("spec", CASES, ids=["greedy-streamed", "sampled", "top-p"])
def test_bf16_sampling_samples_what_the_model_cast_to_bf16_samples(tiny_model, varied_model, varied_prompts, spec):
    prompts = varied_prompts
    tokenizer = load_tokenizer(str(tiny_model))
    cast = params_in_bf16(copy.deepcopy(varied_model))
    ours = sampled(varied_model, tokenizer, prompts, dtype="bfloat16", **spec)
    reference = sampled(cast, tokenizer, prompts, **spec)
    assert [s.token_ids for s in ours] == [s.token_ids for s in reference]
    assert [s.logprobs for s in ours] == [s.logprobs for s in reference]
    full = sampled(varied_model, tokenizer, prompts, **spec)  # the fp32 model's own samples are other numbers
    assert [s.logprobs for s in full] != [s.logprobs for s in ours]
    assert len({len(s.token_ids) for s in ours}) > 1  # rows stopped at different steps


def test_the_models_own_weights_come_back_untouched(tiny_model, varied_model, prompts):
    tokenizer = load_tokenizer(str(tiny_model))
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in varied_model.named_parameters()}
    sampled(varied_model, tokenizer, prompts, dtype="bfloat16", n=2)
    for name, p in varied_model.named_parameters():
        assert p.dtype == torch.float32 and p.data_ptr() == before[name][0]  # the very tensor, not a cast back
        assert torch.equal(p, before[name][1])


def test_the_bf16_copy_is_kept_between_calls_refilled_at_each_and_dropped_with_the_model(
    tiny_model, prompts, monkeypatch
):
    """On CPU a second call samples from the same bf16 storage as the first (no fresh pages), filled from the weights
    as they are then: after an update its samples are the updated model's cast to bf16. The copies go with the
    model."""
    tokenizer = load_tokenizer(str(tiny_model))
    model = shaken(load_policy(str(tiny_model)))
    storage, fill = [], samples.typed_copy

    def filled(param, dtype):
        copy_ = fill(param, dtype)
        storage.append(copy_.data_ptr())
        return copy_

    monkeypatch.setattr(samples, "typed_copy", filled)
    first = sampled(model, tokenizer, prompts, dtype="bfloat16", n=2)
    filled_first, storage[:] = list(storage), []
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.3)  # an update between two calls, as in ppo
    second = sampled(model, tokenizer, prompts, dtype="bfloat16", n=2)
    assert storage == filled_first and len(set(storage)) == len(list(model.parameters()))  # the same storage
    reference = sampled(params_in_bf16(copy.deepcopy(model)), tokenizer, prompts, n=2)
    assert [s.token_ids for s in second] == [s.token_ids for s in reference]
    assert [s.logprobs for s in second] == [s.logprobs for s in reference]
    assert [s.logprobs for s in second] != [s.logprobs for s in first]
    kept = [weakref.ref(samples._typed_copies[p]) for p in model.parameters()]
    del model, param
    gc.collect()
    assert [copy_() for copy_ in kept] == [None] * len(kept)


def test_a_lora_policy_samples_in_bf16_merged_or_not_and_keeps_its_base_and_adapter(tiny_model, prompts):
    """Merged: the adapter is folded in fp32, then the weights are cast, as a merged-and-unloaded copy cast to bf16
    samples; unmerged: as the adapted model cast to bf16 samples."""
    tokenizer = load_tokenizer(str(tiny_model))
    model = lora_policy(tiny_model)
    base, adapter = base_weights(model), {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    for merge in (True, False):
        ours = sampled(model, tokenizer, prompts, dtype="bfloat16", n=2, merge_lora=merge)
        cast = copy.deepcopy(model)
        cast = params_in_bf16(cast.merge_and_unload() if merge else cast)
        reference = sampled(cast, tokenizer, prompts, n=2, merge_lora=False)
        assert [s.token_ids for s in ours] == [s.token_ids for s in reference]
        assert [s.logprobs for s in ours] == [s.logprobs for s in reference]
        assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)  # bit for bit
        assert all(torch.equal(p, adapter[n]) for n, p in model.named_parameters() if n in adapter)
    without = sampled(load_policy(str(tiny_model)), tokenizer, prompts, dtype="bfloat16", n=2)
    assert [s.token_ids for s in without] != [s.token_ids for s in ours]  # the adapter is in the samples


def test_an_unknown_dtype_is_refused_naming_the_choices():
    with pytest.raises(ValidationError, match="dtype") as error:
        SamplingSpec(dtype="float16")
    assert "bfloat16" in str(error.value)


def test_bf16_sampling_is_refused_for_parameters_a_zero3_engine_owns(tiny_model, prompts):
    """A ZeRO-3 parameter (DeepSpeed marks each with `ds_id`) is storage its engine manages: the call stops with an
    error naming the setting, before any weight is touched."""
    model, tokenizer = load_policy(str(tiny_model)), load_tokenizer(str(tiny_model))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    next(iter(model.parameters())).ds_id = 0
    with pytest.raises(UserError, match="`dtype: bfloat16`.*ZeRO-3"):
        sampled(model, tokenizer, prompts, dtype="bfloat16")
    assert all(p.dtype == torch.float32 and torch.equal(p, before[n]) for n, p in model.named_parameters())


def head_inputs(model, tokenizer, prompts, **spec) -> list[tuple[int, bool]]:
    """For each call of the model's LM head while it greedily samples `prompts`: how many positions per row it got,
    and whether its input's strides were the compact ones (not is_contiguous(): a one-row slice counts as contiguous
    whatever its strides)."""
    head, seen = model.get_output_embeddings(), []
    spy = head.register_forward_hook(
        lambda module, args, output: seen.append(
            (args[0].shape[-2], args[0].stride() == torch.empty(args[0].shape).stride())
        )
    )
    try:
        sampled(model, tokenizer, prompts, temperature=0, **spec)
    finally:
        spy.remove()
    assert not head._forward_pre_hooks  # the loop's hook lives for the prefill only
    return seen


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_the_prefill_hands_a_bf16_lm_head_a_compact_input_and_an_fp32_one_generates_view(
    tiny_model, varied_model, varied_prompts, bf16
):
    """torch's CPU linear runs a strided [rows, 1, hidden] input (the prefill's `logits_to_keep=1` slice) through a
    frozen head as a batched product over a per-row copy of its weight: 1000x slower in bf16 on SmolLM2
    (decode.contiguous_head_input).
    bf16 prefills get a compact input; fp32 ones keep generate's strided view, so its logits stay generate's."""
    model = params_in_bf16(copy.deepcopy(varied_model)) if bf16 else varied_model
    tokenizer = load_tokenizer(str(tiny_model))
    # whole prompts prefilled (a shared prefix's rest is a separate forward, whatever the dtype)
    seen = [compact for _, compact in head_inputs(model, tokenizer, varied_prompts, share_prefix=False)]
    assert len(seen) >= 2  # the prefill, then a decode step per token after the first
    assert seen[0] is bf16  # the prefill's last positions: a strided view unless copied
    assert all(seen[1:])  # decode steps feed one position: compact either way


def test_one_prompts_samples_run_its_one_row_through_a_bf16_head_compact_too(tiny_model, varied_model, prompts):
    """n samples of one prompt prefill it on one row: the [1, 1, hidden] slice keeps the prompt's strides, which
    `.contiguous()` leaves as they are (it counts as contiguous) and torch still runs slowly."""
    seen = head_inputs(params_in_bf16(copy.deepcopy(varied_model)), load_tokenizer(str(tiny_model)), prompts[:1], n=2)
    assert len(seen) >= 2 and all(compact for _, compact in seen)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_a_shared_prefix_asks_the_head_for_no_logits(tiny_model, varied_model, bf16):
    """The shared prefix runs for its keys and values only: its forward asks for the logits of no position
    (models.prefix.prefix_cache), so the head multiplies nothing; the prompts' rest then gets one position each."""
    tokenizer = load_tokenizer(str(tiny_model))
    system = {"role": "system", "content": "Answer with the sum only."}
    prompts = [
        render_prompt(tokenizer, [system, {"role": "user", "content": f"What is {a}+{b}?"}])
        for a, b in [(1, 2), (37, 48), (5, 60)]
    ]
    assert shared_prefix([tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]) >= 8
    model = params_in_bf16(copy.deepcopy(varied_model)) if bf16 else varied_model
    seen = head_inputs(model, tokenizer, prompts)
    assert [positions for positions, _ in seen[:3]] == [0, 1, 1]  # the prefix, the prompts' rest, a decode step
    compact = [c for _, c in seen]
    assert compact[1] is bf16 and all(compact[2:])  # the rest's slice as in the prefill without a prefix


ONEDNN_BF16 = pytest.mark.skipif(
    not onednn_runs_bf16(), reason="not an x86 CPU with native bf16 (AVX512-BF16 or AMX): no weights are prepacked"
)


def packed_calls(monkeypatch) -> list[int]:
    """A list that counts the prepacked layers' forward calls from now on; calls of any length prepack."""
    monkeypatch.setattr(hf, "PREPACK_MIN_NEW_TOKENS", 1)
    calls, run = [], samples.onednn_linear
    monkeypatch.setattr(samples, "onednn_linear", lambda x, **weights: calls.append(1) or run(x, **weights))
    return calls


@ONEDNN_BF16
@pytest.mark.parametrize("spec", CASES, ids=["greedy-streamed", "sampled", "top-p"])
def test_prepacked_bf16_linears_sample_what_torchs_own_linear_samples(
    tiny_model, varied_model, varied_prompts, spec, monkeypatch
):
    tokenizer = load_tokenizer(str(tiny_model))
    calls = packed_calls(monkeypatch)
    packed = sampled(varied_model, tokenizer, varied_prompts, dtype="bfloat16", **spec)
    assert len(calls) > 0  # the layers ran on prepacked weights
    monkeypatch.setattr(hf, "prepacked_linears", lambda model: nullcontext())
    plain = sampled(varied_model, tokenizer, varied_prompts, dtype="bfloat16", **spec)
    assert [s.token_ids for s in packed] == [s.token_ids for s in plain]
    assert [s.logprobs for s in packed] == [s.logprobs for s in plain]  # bit for bit


@ONEDNN_BF16
def test_an_unmerged_lora_policy_samples_the_same_on_prepacked_weights(tiny_model, prompts, monkeypatch):
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    calls = packed_calls(monkeypatch)
    packed = sampled(model, tokenizer, prompts, dtype="bfloat16", n=2, merge_lora=False)
    assert len(calls) > 0
    monkeypatch.setattr(hf, "prepacked_linears", lambda model: nullcontext())
    plain = sampled(model, tokenizer, prompts, dtype="bfloat16", n=2, merge_lora=False)
    assert [(s.token_ids, s.logprobs) for s in packed] == [(s.token_ids, s.logprobs) for s in plain]


@ONEDNN_BF16
def test_prepacked_linears_covers_bf16_linear_layers_only_and_puts_their_forward_back(tiny_model, varied_model):
    bf16 = params_in_bf16(copy.deepcopy(varied_model))
    linears = [m for m in bf16.modules() if isinstance(m, torch.nn.Linear)]
    x = torch.randn(2, 1, bf16.config.hidden_size, dtype=torch.bfloat16)
    head = bf16.get_output_embeddings()
    with pytest.raises(RuntimeError, match="inside"), prepacked_linears(bf16):
        assert all("forward" in vars(m) for m in linears)  # every layer, the tied LM head included
        assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight))
        raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in linears)  # back, after an error too
    with prepacked_linears(varied_model):  # fp32 weights: torch's own linear
        assert not any("forward" in vars(m) for m in varied_model.modules())
    assert not packs_for_onednn(torch.nn.Embedding(4, 2).to(torch.bfloat16))
    biased = torch.nn.Linear(bf16.config.hidden_size, 8).to(torch.bfloat16)  # Qwen2's q, k and v carry a bias
    with prepacked_linears(biased):
        assert "forward" in vars(biased) and torch.equal(
            biased(x), torch.nn.functional.linear(x, biased.weight, biased.bias)
        )


@ONEDNN_BF16
def test_calls_shorter_than_the_prepacking_threshold_run_torchs_own_linear(tiny_model, prompts, monkeypatch):
    """Laying the weights out costs a pass over them per call, which a few decode steps do not win back."""
    tokenizer, model = load_tokenizer(str(tiny_model)), load_policy(str(tiny_model))
    calls = packed_calls(monkeypatch)
    monkeypatch.setattr(hf, "PREPACK_MIN_NEW_TOKENS", 21)
    sampled(model, tokenizer, prompts, dtype="bfloat16")  # 20 new tokens
    assert calls == []
    monkeypatch.setattr(hf, "PREPACK_MIN_NEW_TOKENS", 20)
    sampled(model, tokenizer, prompts, dtype="bfloat16")
    assert len(calls) > 0
