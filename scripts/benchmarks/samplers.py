"""The samplers the decode section times, each a `Sampler` whose `run()` returns the useful tokens it sampled:
ours (`engine: loop`, `engine: generate`, the opt-in draws and bf16), vLLM where installed, plain
`model.generate` per batch as TRL calls it, and transformers' continuous batching (`model.generate_batch`).
Useful tokens stop at a row's first stop token; the padding `generate` writes after it is not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .common import warm_up


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
            batch = tokenizer(
                repeated[start : start + spec.batch_size],
                return_tensors="pt",
                padding=True,
                padding_side="left",
                add_special_tokens=False,
            ).to(model.device)
            out = model.generate(
                **batch,
                max_new_tokens=spec.max_new_tokens,
                do_sample=spec.temperature > 0,
                temperature=spec.temperature or None,
                top_p=None,
                top_k=None,
                eos_token_id=stops,
                pad_token_id=tokenizer.pad_token_id,
            )
            tokens += useful_tokens(out[:, batch["input_ids"].shape[1] :].tolist(), stops)
    return tokens


def continuous_batching(model, tokenizer, prompts, spec) -> int:
    """transformers' own continuous batching (`model.generate_batch`: a paged KV cache, finished requests replaced
    by waiting ones, blocks shared between requests that start alike), `n` samples of a prompt as its
    `num_return_sequences`; the useful tokens it sampled. Its cache sized to the call (pages of 64 tokens, enough
    for every request's prompt and new tokens: faster than sizing it from free memory, as measured in
    docs/performance.md, "Why not transformers' continuous batching"). Each call builds its manager anew, as a
    call per rollout batch would (on a GPU capturing its CUDA graphs as it meets new shapes, transformers'
    default there; its up-front warm-up is off: it captures graphs, which a CPU has not, and the section's
    warm-up call pays the process's one-off costs)."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from alignment.data.formatting import encode
    from alignment.sampling import stop_token_ids

    stops = stop_token_ids(tokenizer, model)
    encoded = [encode(tokenizer, p) for p in prompts]
    page = 64
    pages = max(-(-(len(ids) + spec.max_new_tokens) // page) for ids in encoded)
    generation = GenerationConfig(
        max_new_tokens=spec.max_new_tokens,
        do_sample=spec.temperature > 0,
        temperature=spec.temperature or None,
        top_p=None,
        top_k=None,
        num_return_sequences=spec.n,
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
    )
    graphs = None if model.device.type == "cuda" else False  # None: transformers decides
    batching = ContinuousBatchingConfig(
        max_requests_per_batch=spec.batch_size,
        page_size=page,
        num_blocks=len(encoded) * spec.n * pages + 1,
        use_cuda_graph=graphs,
    )
    with torch.no_grad():
        out = model.generate_batch(
            encoded, generation_config=generation, continuous_batching_config=batching, warmup=False
        )
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
    samplers = [
        Sampler(
            f"ours: engine {engine}" + (" (default)" if engine == default else ""),
            "model",
            ours(spec.model_copy(update={"engine": engine})),
            warm(spec) if engine == "loop" else None,
        )
        for engine in ("loop", "generate")
    ]
    if spec.temperature > 0:
        samplers.append(
            Sampler(
                "ours: engine loop, draw inverse_cdf", "model", ours(spec.model_copy(update={"draw": "inverse_cdf"}))
            )
        )
    if has_vllm:
        engine = {"kv_cache_gib": args.vllm_kv_gib, "max_model_len": args.vllm_max_len}
        vllm = SamplingSpec(**{**spec.model_dump(), "backend": "vllm", "vllm": engine})
        samplers.append(Sampler("vLLM", "model", ours(vllm), warm(vllm)))
    samplers.append(Sampler("plain: model.generate", "model", plain()))
    if not args.no_generate_batch:
        short = spec.model_copy(update={"n": 1, "max_new_tokens": min(8, spec.max_new_tokens)})
        samplers.append(
            Sampler(
                "transformers: generate_batch (continuous batching)",
                "model",
                lambda: continuous_batching(model, tokenizer, prompts, spec),
                lambda: continuous_batching(model, tokenizer, prompts[:2], short),
            )
        )
    if half:
        bf16 = spec.model_copy(update={"dtype": "bfloat16"})
        samplers.append(Sampler("ours: engine loop, dtype bfloat16", "bfloat16", ours(bf16), warm(bf16)))
        if spec.temperature > 0:
            samplers.append(
                Sampler(
                    "ours: engine loop, dtype bfloat16, draw inverse_cdf",
                    "bfloat16",
                    ours(spec.model_copy(update={"dtype": "bfloat16", "draw": "inverse_cdf"})),
                )
            )
        samplers.append(Sampler("plain: model.generate, bf16 weights", "bfloat16", plain(torch.bfloat16)))
    return samplers
