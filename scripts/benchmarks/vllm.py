"""The `vllm` section (not in the default list: it needs vLLM, e.g. the environment of scripts/vllm_env.sh):
tokens/s of `backend: vllm` (an engine in this process, the policy's weights pushed before each call, 8
samples re-scored by the policy after it), our HF sampler and plain `model.generate` (the whole batch in one
call, left-padded), on the same prompts, for each BATCHxNEW_TOKENS of `--vllm-shapes`; then the engine's
start-up and the time of one weight push, eager and compiled (`vllm.enforce_eager`). `--model PATH` runs it
on a real checkpoint (its chat template, prompts asking for stories). Rows are printed as they come.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .common import Peak, row, text, timed_generate, warm_up

STORY_TOPICS = [
    "a lighthouse",
    "a lost key",
    "two rivers",
    "a clockmaker",
    "the first snow",
    "a red kite",
    "an old map",
    "a quiet robot",
]


def vllm_prompts(tokenizer, count: int, real_model: bool) -> list[str]:
    """Rendered prompts: on a real model, requests for stories (answers that run to max_new_tokens), else text."""
    from alignment.data.formatting import render_prompt

    rng = random.Random(0)
    if real_model:
        return [
            render_prompt(tokenizer, f"Write a story about {STORY_TOPICS[i % 8]}, number {i}.") for i in range(count)
        ]
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
            spec = SamplingSpec(
                max_new_tokens=new_tokens, temperature=1.0, batch_size=batch, backend="vllm", vllm=settings
            )
            generate(model, tokenizer, prompts[:8], spec.model_copy(update={"max_new_tokens": 4}))  # warm-up
            add(timed_generate("vllm", f"vLLM {label}, {shape}", model, tokenizer, prompts, spec, args))
            if not eager:
                continue
            hf = spec.model_copy(update={"backend": "transformers"})
            warm_up(model, tokenizer, prompts, hf)
            add(timed_generate("vllm", f"ours: HF sampler, {shape}", model, tokenizer, prompts, hf, args))
            with Peak() as peak, torch.no_grad():
                batch_ids = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
                out = model.generate(
                    **batch_ids, max_new_tokens=new_tokens, do_sample=True, pad_token_id=tokenizer.pad_token_id
                )
                tokens = int((out[:, batch_ids["input_ids"].shape[1] :] != tokenizer.pad_token_id).sum())
            add(
                row(
                    "vllm",
                    f"plain: model.generate, {shape}",
                    tokens / peak.seconds,
                    "tokens/s",
                    peak,
                    model,
                    args,
                    False,
                )
            )
    vllm_engine.close()
    return results
