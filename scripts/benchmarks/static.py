"""The `static` section: `cache: static` (compiled decoding on a GPU) beside the dynamic cache. It runs on a
GPU, and on CPU only with `--static-cache`, where nothing is compiled; `--compile` adds `compile: true` on
CPU (torch.compile of the decode step, whose first call compiles).
"""

from __future__ import annotations

from pathlib import Path

from .common import timed_generate, warm_up
from .rollout import rollout_setup


def bench_static(model_dir: Path, size: dict, args) -> list[dict]:
    """`cache: static` (compiled decoding on a GPU) beside the default dynamic cache, in its own section:
    compiling takes long, and a time limit on it should not cost the other rollout rows."""
    import torch

    tokenizer, model, prompts, spec = rollout_setup(model_dir, size)
    warm_up(model, tokenizer, prompts, spec)
    static = spec.model_copy(update={"cache": "static", "engine": "generate"})
    timed_generate("static", "compile", model, tokenizer, prompts, static, args)  # the first call compiles (GPU)
    results = [
        timed_generate("static", "ours: sampling.generate", model, tokenizer, prompts, spec, args),
        timed_generate("static", "ours: static cache (compiled on GPU)", model, tokenizer, prompts, static, args),
    ]
    if args.compile and not torch.cuda.is_available():  # `compile: true`: the decode step compiled on CPU too
        compiled = static.model_copy(update={"compile": True})
        timed_generate("static", "compile", model, tokenizer, prompts, compiled, args)  # the first call compiles
        results.append(
            timed_generate(
                "static", "ours: static cache, compile: true (CPU)", model, tokenizer, prompts, compiled, args
            )
        )
    return results
