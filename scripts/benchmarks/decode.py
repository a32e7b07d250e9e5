"""The `decode` section (`--size smollm2`: its only default): useful tokens/s of each sampler (`samplers`) at
the recipes' sampling shapes (a size's `decode`, RECIPE_SHAPES in scripts/bench.py) beside this machine's
matmul rate at the decode's shapes (`roofline`). On a model that is not bf16 already, also our loop with
`dtype: bfloat16` and plain `generate` on bf16 weights, beside the bf16 roofline, where bf16 is fast (a GPU, or a
CPU with AVX512-BF16 or AMX: elsewhere they are left out with the reason printed; `--no-bf16` leaves them out
anywhere); `--no-generate-batch` leaves out transformers' continuous batching. `--rounds R` runs them all R times
in rotation and reports medians, and each sampler's ratio to plain `generate` within a round (`vs plain`),
which a machine whose speed drifts between minutes leaves alone. Rows are printed as each shape ends.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from .common import Peak, text
from .roofline import matmul_roofline, roofline_row
from .samplers import Sampler, decode_samplers


def decode_prompts(tokenizer, count: int, real_model: bool) -> list[str]:
    """Rendered prompts: on a real model, arithmetic questions (answers end by themselves), else random text."""
    from alignment.data.formatting import render_prompt

    rng = random.Random(0)
    if real_model:
        return [
            render_prompt(tokenizer, f"What is {rng.randint(1, 999)} + {rng.randint(1, 999)}? Explain briefly.")
            for _ in range(count)
        ]
    return [render_prompt(tokenizer, text(rng, rng.randint(8, 48))) for _ in range(count)]


def significant(value: float) -> float:
    """`value` to 4 significant digits: a slow sampler's small GFLOP/s stays above zero in the table and the JSON."""
    return float(f"{value:.4g}")


def decode_rows(
    shape: str, samplers: list[Sampler], rates: dict, seconds: dict, peaks: dict, rooflines: dict, params: int
) -> list[dict]:
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
        rows.append(
            {
                "section": "decode",
                "variant": f"{sampler.variant}, {shape}",
                "rate": round(rate, 2),
                "unit": "tokens/s",
                "peak_mib": round(peaks[sampler.variant], 1),
                "seconds": round(statistics.median(seconds[sampler.variant]), 2),
                "mfu": None,
                "gflops": significant(gflops),
                "of_roofline": significant(gflops / roofline),
                "rates": [round(r, 2) for r in own],
                "vs_plain": None if ratio is None else round(ratio, 3),
            }
        )
    return rows


def bf16_runs_fast(device) -> bool:
    """Whether the bf16 rows belong on this machine: on a GPU, or on a CPU that multiplies bf16 natively; elsewhere
    they crawl (`alignment.runtime.cpu.slow_bf16`), so they are left out and the reason is printed."""
    from alignment.runtime.cpu import slow_bf16

    why = None if device.type != "cpu" else slow_bf16()
    if why:
        print(
            f"decode: bf16 rows left out: {why} (the sampler's `dtype: bfloat16` would be slower than fp32 "
            "here, and plain bf16 generate far slower)",
            flush=True,
        )
    return why is None


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
    half = model.dtype != torch.bfloat16 and not args.no_bf16 and bf16_runs_fast(model.device)
    if not has_vllm:
        print(
            "decode: vLLM is not installed here, so it has no rows (bash scripts/vllm_env.sh builds its "
            "environment; run this command in it)",
            flush=True,
        )
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
                    rooflines[kind].append(
                        matmul_roofline(model.config, batch, dtype, model.device, size.get("roofline_seconds", 0.5))
                    )
                roof_seconds[kind].append(peak.seconds)
                roof_peaks[kind] = peak.mib
            for sampler in samplers:
                with Peak() as peak:
                    tokens = sampler.run()
                rates[sampler.variant].append(tokens / peak.seconds)
                seconds[sampler.variant].append(peak.seconds)
                peaks[sampler.variant] = peak.mib
        rows = [
            roofline_row(batch, dtype, rooflines[kind], statistics.median(roof_seconds[kind]), roof_peaks[kind])
            for kind, dtype in types.items()
        ]
        rows += decode_rows(shape, samplers, rates, seconds, peaks, rooflines, params)
        for r in rows:
            print(json.dumps(r), flush=True)
        results += rows
    vllm_engine.close()
    return results
