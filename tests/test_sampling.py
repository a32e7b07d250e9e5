"""alignment/sampling: the one sampling path (order, stop tokens, the static-cache option)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from helpers import base_weights, lora_policy, shaken, with_skewed_generation_config

from alignment.config.sampling import SamplingSpec
from alignment.data.formatting import render_prompt
from alignment.models.loading import load_policy
from alignment.models.prefix import shared_prefix
from alignment.models.tokenizer import load_tokenizer
from alignment.sampling import generate, prefills_kept, stop_token_ids


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
    assert [s.token_ids for s in generate(model, tokenizer, prompts, SamplingSpec(**spec))] == [
        s.token_ids for s in generate(model, tokenizer, prompts, SamplingSpec(**spec, merge_lora=False))
    ]


@pytest.mark.parametrize(
    "spec",
    [{"temperature": 0}, {"temperature": 1.0, "n": 3}, {"temperature": 0.7, "top_p": 0.9}],
    ids=["greedy", "sampled", "top-p"],
)
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


# `engine: loop` (sampling/decode.py) against `engine: generate` (one model.generate call per batch), the
# sampler it replaced: same ids, same stops, same random draws. The tiny model's weights are shaken so that its
# rows stop at different steps (the random-init model repeats one token), which exercises the compaction.
LOOP_CASES = [
    {"temperature": 0},
    {"temperature": 0, "n": 3, "batch_size": 7},
    {"temperature": 1.0, "n": 3},
    {"temperature": 0.7, "top_p": 0.9, "n": 4, "batch_size": 7},
    {"temperature": 1.0, "top_k": 5, "n": 2},
]


@pytest.fixture(scope="module")
def varied_prompts(tiny_model, prompts):
    """The shared prompts (one of them twice) and two more, after which the shaken model stops early greedily."""
    tokenizer = load_tokenizer(str(tiny_model))
    return prompts + [render_prompt(tokenizer, f"What is {a}+{b}?") for a, b in [(99, 9), (12, 345)]]


@pytest.fixture(scope="module")
def varied_model(tiny_model):
    return shaken(load_policy(str(tiny_model)))


def both_engines(model, tokenizer, prompts, **spec):
    runs = {}
    for engine in ("generate", "loop"):
        torch.manual_seed(0)
        runs[engine] = generate(model, tokenizer, prompts, SamplingSpec(max_new_tokens=24, engine=engine, **spec))
    return runs["generate"], runs["loop"]


@pytest.mark.parametrize("spec", LOOP_CASES, ids=["greedy", "greedy-n3-split", "sampled", "top-p-split", "top-k"])
def test_the_decode_loop_samples_exactly_what_generate_samples(tiny_model, varied_model, varied_prompts, spec):
    tokenizer = load_tokenizer(str(tiny_model))
    reference, looped = both_engines(varied_model, tokenizer, varied_prompts, **spec)
    assert [s.token_ids for s in looped] == [s.token_ids for s in reference]
    assert [s.finished for s in looped] == [s.finished for s in reference]
    assert [s.text for s in looped] == [s.text for s in reference]
    assert len({len(s.token_ids) for s in looped}) > 1 and any(s.finished for s in looped)  # rows left the batch


def test_first_argmax_finds_torchs_argmax_by_chunks():
    """The same index as torch's argmax: the first of equal maxima (within a chunk, across chunks, in the shorter
    last chunk), the first NaN of a row, 0 for a row of -inf; 3 chunks of 1024 and a last one of 37 entries."""
    from alignment.sampling.decode import ARGMAX_CHUNK, first_argmax

    vocab = 3 * ARGMAX_CHUNK + 37
    torch.manual_seed(0)
    scores = torch.randn(9, vocab)
    scores[1, [5, 900]] = 9.0  # a tie inside the first chunk
    scores[2, [2 * ARGMAX_CHUNK + 3, ARGMAX_CHUNK + 1000]] = 9.0  # a tie across chunks: the earlier chunk's
    scores[3, [vocab - 1, vocab - 20]] = 9.0  # a tie in the last, shorter chunk
    scores[4, -1] = 9.0  # the very last entry
    scores[5, [ARGMAX_CHUNK + 2, 2 * ARGMAX_CHUNK + 9]] = float("nan")  # NaN ranks above every number
    scores[5, 0] = 9.0
    scores[6] = float("-inf")
    scores[7, [3 * ARGMAX_CHUNK + 4, 3 * ARGMAX_CHUNK + 30]] = float("nan")  # the first NaN, in the last chunk
    scores[8] = 0.0
    expected = scores.argmax(dim=-1)
    assert expected.tolist()[1:8] == [
        5,
        ARGMAX_CHUNK + 1000,
        vocab - 20,
        vocab - 1,
        ARGMAX_CHUNK + 2,
        0,
        3 * ARGMAX_CHUNK + 4,
    ]  # the cases above, as torch ranks them
    assert torch.equal(first_argmax(scores), expected)
    assert torch.equal(first_argmax(scores[:, : 2 * ARGMAX_CHUNK]), scores[:, : 2 * ARGMAX_CHUNK].argmax(dim=-1))
    across = scores.t().contiguous().t()  # the same values, a row's entries far apart in memory
    assert torch.equal(first_argmax(across), expected)


def test_last_logits_copies_at_most_once():
    """fp32 logits of every row are the forward's own tensor; a selection of rows is one new tensor; bf16 logits
    come back as fp32 with the values `.to(torch.float32)` gives."""
    from alignment.sampling.decode import last_logits

    torch.manual_seed(0)
    logits = torch.randn(4, 1, 50)
    running = torch.tensor([True, False, True, True])
    assert last_logits(logits, torch.ones(4, dtype=torch.bool), every=True).data_ptr() == logits.data_ptr()
    assert torch.equal(last_logits(logits, running, every=False), logits[running, -1])
    half = logits.bfloat16()
    assert torch.equal(last_logits(half, running, every=False), half[running, -1].to(torch.float32))
    assert last_logits(half, running, every=True).dtype == torch.float32


def test_greedy_tokens_found_by_chunks_are_generates(tiny_model, varied_model, varied_prompts, monkeypatch):
    """The tiny model's vocabulary split into chunks of 5 (a shorter last one): the loop's greedy ids and stops are
    `generate`'s (the real model's 49,152 entries take this path at the default chunk: the slow SmolLM2 test)."""
    from alignment.sampling import decode

    tokenizer = load_tokenizer(str(tiny_model))
    monkeypatch.setattr(decode, "ARGMAX_CHUNK", 5)
    assert varied_model.config.vocab_size % 5 and varied_model.config.vocab_size >= 10
    chunked = []
    original = decode.first_argmax
    monkeypatch.setattr(decode, "first_argmax", lambda scores: chunked.append(scores.shape) or original(scores))
    reference, looped = both_engines(varied_model, tokenizer, varied_prompts, temperature=0)
    assert chunked and all(shape[-1] == varied_model.config.vocab_size for shape in chunked)
    assert [s.token_ids for s in looped] == [s.token_ids for s in reference]
    assert [s.finished for s in looped] == [s.finished for s in reference]


@pytest.mark.parametrize("compaction", [False, True], ids=["rows-stay", "rows-leave"])
@pytest.mark.parametrize("spec", [{"temperature": 0}, {"temperature": 1.0, "n": 2}], ids=["greedy", "sampled"])
def test_the_decode_loops_logprobs_are_generates_raw_logits(
    tiny_model, varied_model, varied_prompts, spec, compaction, monkeypatch
):
    """The reference is model.generate's own per-step logits (output_logits) for the same left-padded batch. While
    every row stays in the batch the log-probs are those bit for bit; once finished rows leave it, the BLAS kernels
    of a smaller batch may sum in another order (seen on an AVX512 host: 1.5e-6 on this model; bit for bit on an
    AMD EPYC), so they are held to 1e-5 there, the ids still exactly."""
    from alignment.sampling import decode
    from alignment.sampling.hf import left_padded
    from alignment.sampling.samples import checkpoint_sampling_defaults_off

    if not compaction:
        monkeypatch.setattr(decode, "COMPACT_SHARE", 2.0)  # a share of the rows no batch reaches: none leaves
    tokenizer = load_tokenizer(str(tiny_model))
    torch.manual_seed(0)
    # share_prefix off: the prompts share "<|user|>What is " (9 tokens), and a prefix run once on one row sums in
    # another order than generate's whole-prompt prefill (test_a_shared_prefix_is_prefilled_once_... covers that)
    spec = {"share_prefix": False, **spec}
    looped = generate(varied_model, tokenizer, varied_prompts, SamplingSpec(max_new_tokens=24, engine="loop", **spec))
    assert len({len(s.token_ids) for s in looped}) > 1  # rows stop at different steps (and leave, with compaction)
    stops = stop_token_ids(tokenizer, varied_model)
    order = sorted(
        range(len(looped)),
        key=lambda k: -len(tokenizer(varied_prompts[k // spec.get("n", 1)], add_special_tokens=False)["input_ids"]),
    )
    rows = [tokenizer(varied_prompts[k // spec.get("n", 1)], add_special_tokens=False)["input_ids"] for k in order]
    input_ids, attention = left_padded(rows, tokenizer.pad_token_id, "cpu")
    torch.manual_seed(0)
    with torch.no_grad(), checkpoint_sampling_defaults_off(varied_model):
        out = varied_model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=24,
            do_sample=spec["temperature"] > 0,
            eos_token_id=stops,
            pad_token_id=tokenizer.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    steps = [logits.log_softmax(-1) for logits in out.logits]  # per step [batch, vocab], as the loop computes them
    for row, k in enumerate(order):
        sample = looped[k]
        expected = [steps[t][row, token].item() for t, token in enumerate(sample.token_ids)]
        assert out.sequences[row, input_ids.shape[1] :][: len(sample.token_ids)].tolist() == sample.token_ids
        if compaction:
            assert sample.logprobs == pytest.approx(expected, abs=1e-5, rel=0)
        else:
            assert sample.logprobs == expected  # bit for bit


def test_the_decode_loop_prefills_each_prompt_once_and_drops_finished_rows(
    tiny_model, varied_model, varied_prompts, monkeypatch
):
    tokenizer = load_tokenizer(str(tiny_model))
    batches, logits = [], []
    forward = varied_model.forward

    @functools.wraps(forward)  # the loop reads the forward's signature
    def counting(*args, **kwargs):
        batches.append(tuple(kwargs["input_ids"].shape))
        out = forward(*args, **kwargs)
        logits.append(out.logits.shape[1])
        return out

    monkeypatch.setattr(varied_model, "forward", counting)
    torch.manual_seed(0)
    spec = SamplingSpec(temperature=1.0, n=4, max_new_tokens=24, engine="loop", share_prefix=False)
    samples = generate(varied_model, tokenizer, varied_prompts, spec)
    assert batches[0][0] == len(set(varied_prompts)) and batches[0][1] > 1  # the prefill: one row per distinct prompt
    assert logits[0] == 1  # the prefill runs the LM head on the last position only, as generate does
    decode = [b for b, width in batches[1:]]
    assert decode[0] == 4 * len(varied_prompts) and decode[-1] < decode[0]  # the batch shrinks as rows finish
    assert sum(decode) < len(decode) * decode[0]
    assert len(batches) == max(len(s.token_ids) for s in samples)  # no step after the last row's stop


@pytest.mark.parametrize("spec", LOOP_CASES[:4], ids=["greedy", "greedy-n3-split", "sampled", "top-p-split"])
def test_a_shared_prefix_is_prefilled_once_and_samples_the_same(tiny_model, varied_model, spec, monkeypatch):
    """Prompts behind one system prompt: with share_prefix the first forward runs the tokens they share on one row,
    the next runs each prompt's rest; ids, stops and texts equal those of whole prompts prefilled (share_prefix
    false, which the test above holds equal to generate), log-probs to fp32 rounding."""
    tokenizer = load_tokenizer(str(tiny_model))
    system = {"role": "system", "content": "Answer with the sum only."}
    prompts = [
        render_prompt(tokenizer, [system, {"role": "user", "content": f"What is {a}+{b}?"}])
        for a, b in [(1, 2), (37, 48), (5, 60), (99, 9), (12, 345)]
    ]
    shared = shared_prefix([tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts])
    assert shared >= 8
    shapes, forward = [], varied_model.forward

    @functools.wraps(forward)  # the loop reads the forward's signature
    def recording(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    runs = {}
    for share in (True, False):
        monkeypatch.setattr(varied_model, "forward", recording)
        torch.manual_seed(0)
        runs[share] = generate(
            varied_model, tokenizer, prompts, SamplingSpec(max_new_tokens=24, share_prefix=share, **spec)
        )
        monkeypatch.undo()
        if share:
            assert shapes[0] == (1, shared) and shapes[1][1] < max(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert [s.token_ids for s in runs[True]] == [s.token_ids for s in runs[False]]
    assert [s.finished for s in runs[True]] == [s.finished for s in runs[False]]
    assert [s.text for s in runs[True]] == [s.text for s in runs[False]]
    assert len({len(s.token_ids) for s in runs[True]}) > 1  # rows of different lengths: padding after the prefix
    assert max(abs(a - b) for x, y in zip(runs[True], runs[False]) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4


def test_the_decode_loop_is_reproducible_and_samples_like_merged_and_unmerged_lora(tiny_model, prompts):
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    runs = []
    for merge in (True, True, False):
        torch.manual_seed(7)
        spec = SamplingSpec(temperature=1.0, n=3, max_new_tokens=12, engine="loop", merge_lora=merge)
        runs.append([s.token_ids for s in generate(model, tokenizer, prompts, spec)])
    assert runs[0] == runs[1] == runs[2]


def test_the_decode_loop_draws_from_the_models_distribution(tiny_model, varied_model, varied_prompts):
    """3000 one-token samples of one prompt: their frequencies match softmax(logits) (total variation < 0.05)."""
    tokenizer = load_tokenizer(str(tiny_model))
    torch.manual_seed(0)
    spec = SamplingSpec(temperature=1.0, n=3000, max_new_tokens=1, batch_size=500, engine="loop")
    samples = generate(varied_model, tokenizer, varied_prompts[:1], spec)
    ids = torch.tensor([tokenizer(varied_prompts[0], add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        probs = varied_model(input_ids=ids).logits[0, -1].float().softmax(-1)
    counts = torch.bincount(torch.tensor([s.token_ids[0] for s in samples]), minlength=probs.numel()).float()
    assert 0.5 * (counts / counts.sum() - probs).abs().sum() < 0.05


def test_compile_needs_the_static_cache():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="cache: static"):
        SamplingSpec(compile=True)
    assert SamplingSpec(compile=True, cache="static").compile


@pytest.mark.slow
def test_the_decode_loop_samples_what_generate_samples_on_smollm2(smollm2_checkpoint):
    """The real model (byte-level BPE, ChatML, answers that stop at different lengths): greedy and n=4 sampled
    (a batch of 6 splits a prompt's samples) give the same ids and stops through both engines; so does greedy at
    batch 2, where the loop streams the rows (sampling/stream.py)."""
    tokenizer, model = load_tokenizer(str(smollm2_checkpoint)), load_policy(str(smollm2_checkpoint))
    prompts = [render_prompt(tokenizer, f"What is {a} + {b}? Answer briefly.") for a, b in [(2, 3), (37, 48), (120, 7)]]
    for spec in (
        {"temperature": 0},
        {"temperature": 1.0, "n": 4, "batch_size": 6},
        {"temperature": 0, "batch_size": 2},
    ):
        reference, looped = both_engines(model, tokenizer, prompts, **spec)
        assert [s.token_ids for s in looped] == [s.token_ids for s in reference]
        assert [s.finished for s in looped] == [s.finished for s in reference]
        assert any(s.finished for s in looped)


@pytest.mark.parametrize("share", [True, False], ids=["shared-prefix", "whole-prompts"])
def test_kept_prefills_give_the_same_samples_without_running_the_prompts_again(
    tiny_model, varied_model, share, monkeypatch
):
    """Inside `prefills_kept`, a second call on the same prompts (greedy, then temperature 1 as the evaluation's KL
    samples) decodes from the first call's prefill: the same ids, finished flags and log-probs as calls without it,
    bit for bit, and only one-token decode steps run in the second call."""
    tokenizer = load_tokenizer(str(tiny_model))
    system = {"role": "system", "content": "Answer with the sum only."}
    prompts = [
        render_prompt(tokenizer, [system, {"role": "user", "content": f"What is {a}+{b}?"}])
        for a, b in [(1, 2), (37, 48), (5, 60), (99, 9), (12, 345)]
    ]
    specs = [
        SamplingSpec(temperature=0, max_new_tokens=16, batch_size=3, share_prefix=share),
        SamplingSpec(temperature=1.0, max_new_tokens=16, batch_size=3, share_prefix=share),
    ]

    def both(kept: bool):
        widths, forward = [], varied_model.forward

        @functools.wraps(forward)  # the loop reads the forward's signature
        def recording(*args, **kwargs):
            widths.append(kwargs["input_ids"].shape[1])
            return forward(*args, **kwargs)

        monkeypatch.setattr(varied_model, "forward", recording)
        runs = []
        with prefills_kept() if kept else contextlib.nullcontext():
            for spec in specs:
                torch.manual_seed(0)
                start = len(widths)
                runs.append((generate(varied_model, tokenizer, prompts, spec), widths[start:]))
        monkeypatch.undo()
        return runs

    fresh, kept = both(False), both(True)
    for (a, _widths_fresh), (b, _widths_kept) in zip(fresh, kept):
        assert [s.token_ids for s in a] == [s.token_ids for s in b]
        assert [s.finished for s in a] == [s.finished for s in b]
        assert [s.logprobs for s in a] == [s.logprobs for s in b]
    assert kept[0][1] == fresh[0][1]  # the first call prefills as always
    assert max(fresh[1][1]) > 1 and set(kept[1][1]) == {1}  # the second runs decode steps only
    assert any(len(s.token_ids) > 1 for s in kept[1][0])  # and decoded more than the first token
