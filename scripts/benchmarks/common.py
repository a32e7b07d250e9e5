"""What every section shares: the result row, the peak-memory timer, MFU (on a GPU, against `--peak-tflops`),
the synthetic text, one timed `sampling.generate` call and the warm-up that goes before it.

A row is a dict of `section`, `variant`, `rate`, `unit`, `peak_mib`, `seconds` and `mfu` (None off a GPU, and
for units other than tokens/s); the decode section adds its own keys. On CPU the peak is the process's peak
resident set so far, which never goes down: compare CPU sections run one per process.
"""

from __future__ import annotations

import random
import time


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


def row(section, variant, rate, unit, peak, model, args, training) -> dict:
    params = sum(p.numel() for p in model.parameters()) if model is not None else 0
    util = mfu(rate, params, args.peak_tflops, training) if unit == "tokens/s" else None
    return {
        "section": section,
        "variant": variant,
        "rate": round(rate, 2),
        "unit": unit,
        "peak_mib": round(peak.mib, 1),
        "seconds": round(peak.seconds, 2),
        "mfu": util,
    }


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
