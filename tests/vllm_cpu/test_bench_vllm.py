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


def test_bench_async_section_measures_in_process_and_server_runs_after_the_same_updates(tmp_path):
    """The async section on the micro shape: one SFT, then PPO in the trainer's process and on vLLM's server one
    version ahead, each evaluated after the same two updates; its rows carry the rate, pass@1 and the policy lag."""
    spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--size", "micro", "--sections", "async", "--set", "num_heads=1", "--async-updates", "2"]
    results = bench.main([*argv, "--staleness", "1", "--vllm-max-len", "256", "--vllm-kv-gib", "1"])
    assert [r["variant"].split(" (")[0] for r in results] == ["in process, every core", "server, max_staleness 1"]
    assert all(r["unit"] == "updates/min" and r["rate"] > 0 and 0 <= r["pass_at_1"] <= 1 for r in results)
    assert [r["policy_lag"] for r in results] == [0.0, 1.0]  # the server's second update trained one version behind
