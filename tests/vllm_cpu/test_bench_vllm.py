"""The benchmark's vllm section (scripts/bench.py --sections vllm) runs end to end on the real engine, reduced."""

import importlib.util

import pytest
from conftest import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_bench_vllm_section_reports_the_three_samplers_start_up_and_push(tmp_path):
    spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # micro with one head of 32 (vLLM's CPU kernels take no narrower)
    results = bench.main(
        [
            "--size",
            "micro",
            "--sections",
            "vllm",
            "--set",
            "num_heads=1",
            "--vllm-shapes",
            "4x8",
            "--vllm-max-len",
            "64",
            "--vllm-kv-gib",
            "1",
            "--json",
            str(tmp_path / "b.json"),
        ]
    )
    variants = [r["variant"] for r in results]
    assert variants == [
        "vLLM engine start-up (eager)",
        "vLLM weight push (eager, best of 3)",
        "vLLM eager, batch 4 x 8 new tokens",
        "ours: HF sampler, batch 4 x 8 new tokens",
        "plain: model.generate, batch 4 x 8 new tokens",
        "vLLM engine start-up (compiled)",
        "vLLM weight push (compiled, best of 3)",
        "vLLM compiled, batch 4 x 8 new tokens",
    ]
    assert all(r["rate"] > 0 for r in results if r["unit"] == "tokens/s")
