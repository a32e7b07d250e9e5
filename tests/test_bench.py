"""The benchmark script runs end to end in its reduced (micro) form and reports every section."""

import importlib.util

import pytest
import torch
from conftest import REPO

from alignment.runtime import cpu
from alignment.sampling.samples import onednn_runs_bf16


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_micro_reports_ours_and_plain_for_each_section(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "bench.json"
    results = bench.main(["--size", "micro", "--json", str(out), "--static-cache", "--no-generate-batch"])
    assert any(r["variant"].startswith("ours: static cache") for r in results)
    assert {"ours: LoRA adapter unmerged", "ours: LoRA merged for sampling"} <= {r["variant"] for r in results}
    pairs = {(r["section"], r["variant"].split(":")[0]) for r in results}
    assert pairs == (
        {(s, v) for s in ("rollout", "sft", "dpo", "decode") for v in ("ours", "plain")}
        | {("static", "ours"), ("ppo", "ours"), ("decode", "roofline")}
    )  # static: ours vs ours; no TRL PPO
    assert next(r for r in results if r["section"] == "ppo")["unit"] == "episodes/s"
    assert all(r["rate"] > 0 and r["peak_mib"] > 0 for r in results)
    assert out.exists() and "rollout" in capsys.readouterr().out


def test_bench_decode_table_has_useful_tokens_gflops_and_the_roofline_share(capsys):
    """The decode section at micro size: for every recipe shape, the roofline rows (fp32, and bf16 where bf16 is fast
    here: the test model is fp32 on CPU) and each sampler's useful tokens/s, GFLOP/s and share of the roofline, the
    sampled shapes with the inverse-CDF draws too. No speed is asserted (the machine may be loaded)."""
    bench = load_bench()
    half = torch.cuda.is_available() or cpu.bf16_native()
    results = bench.main(["--size", "micro", "--sections", "decode", "--rounds", "2"])
    shapes = {name: temperature for name, _, _, temperature, *_ in bench.SIZES["micro"]["decode"]}
    for name, temperature in shapes.items():
        rows = {r["variant"].split(f", {name}:")[0]: r for r in results if f", {name}:" in r["variant"]}
        samplers = {
            "ours: engine loop (default)",
            "ours: engine generate",
            "plain: model.generate",
            "transformers: generate_batch (continuous batching)",
        }
        if half:
            samplers |= {"ours: engine loop, dtype bfloat16", "plain: model.generate, bf16 weights"}
        if temperature > 0:
            samplers |= {"ours: engine loop, draw inverse_cdf"}
        if temperature > 0 and half:
            samplers |= {"ours: engine loop, dtype bfloat16, draw inverse_cdf"}
        assert set(rows) == samplers
        for r in rows.values():
            assert r["unit"] == "tokens/s" and r["rate"] > 0 and r["gflops"] > 0 and 0 < r["of_roofline"]
            # two rounds, the row's rate their median; the ratio to plain `generate` taken within each round
            assert len(r["rates"]) == 2 and r["rate"] == pytest.approx(sum(r["rates"]) / 2, abs=0.01)
            assert r["vs_plain"] > 0
        assert rows["plain: model.generate"]["vs_plain"] == 1.0
    roofs = [r["variant"].rsplit(", ", 1)[-1] for r in results if r["variant"].startswith("roofline")]
    assert sorted(roofs) == sorted(["float32", *(["bfloat16"] if half else [])] * len(shapes))
    assert all(
        r["unit"] == "GFLOP/s" and r["of_roofline"] == 1.0 and len(r["rates"]) == 2
        for r in results
        if r["variant"].startswith("roof")
    )
    # the roofline takes each shape's faster kernel: torch.matmul, or (CPU) the weight prepacked, as MKL's fp32 sgemm
    # or oneDNN's native bf16 kernel lays it out
    for r in (r for r in results if r["variant"].startswith("roof")):
        assert "torch.matmul" in r["kernels"] and r["rate"] >= max(r["kernels"].values()) - 0.01
        fp32 = r["variant"].endswith("float32")
        packs = torch.backends.mkl.is_available() if fp32 else onednn_runs_bf16()
        assert ("prepacked" in r["kernels"]) is packs
    header = capsys.readouterr().out
    assert all(column in header for column in ("GFLOP/s", "of roofline", "tokens/s", "vs plain"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the bf16 rows always run")
@pytest.mark.parametrize("native", [False, True])
def test_the_bf16_rows_run_only_where_the_cpu_multiplies_bf16_natively(monkeypatch, capsys, native):
    """The lower ISA forced (`bf16_native` false, as under ONEDNN_MAX_CPU_ISA=AVX2): the decode section leaves its
    bf16 rows out and prints why; on a native-bf16 CPU they run as before."""
    bench = load_bench()
    monkeypatch.setattr(cpu, "bf16_native", lambda: native)
    results = bench.main(["--size", "micro", "--sections", "decode", "--shapes", "rollouts", "--no-generate-batch"])
    bf16 = [r["variant"] for r in results if "bf16" in r["variant"] or "bfloat16" in r["variant"]]
    said = "decode: bf16 rows left out: " in capsys.readouterr().out
    assert (len(bf16) == 4 and not said) if native else (bf16 == [] and said)


def test_bench_rounds_ratio_is_taken_within_each_round():
    """`vs_plain` is the median of per-round ratios, so a machine twice as fast in one round leaves it alone, where
    a ratio of medians would not."""
    load_bench()  # puts scripts/ on sys.path, where the bench's sections live (scripts/benchmarks/)
    from benchmarks.decode import decode_rows
    from benchmarks.samplers import Sampler

    samplers = [Sampler("ours", "model", None), Sampler("plain: model.generate", "model", None)]
    rates = {"ours": [100.0, 200.0, 400.0], "plain: model.generate": [50.0, 100.0, 200.0]}
    seconds = {"ours": [1.0, 1.0, 1.0], "plain: model.generate": [2.0, 2.0, 2.0]}
    rows = decode_rows(
        "s",
        samplers,
        rates,
        seconds,
        {"ours": 1.0, "plain: model.generate": 1.0},
        {"model": [{"best": 10.0}, {"best": 20.0}, {"best": 30.0}]},
        params=1_000_000_000,
    )
    ours, plain = rows
    assert ours["rate"] == 200.0 and ours["vs_plain"] == 2.0 and plain["vs_plain"] == 1.0
    assert ours["gflops"] == 400.0 and ours["of_roofline"] == 20.0  # 2 x 1e9 x 200 / 1e9 over the median 20


def test_bench_shapes_picks_decode_shapes_and_names_an_unknown_one(capsys):
    bench = load_bench()
    results = bench.main(
        ["--size", "micro", "--sections", "decode", "--shapes", "rollouts", "--no-bf16", "--no-generate-batch"]
    )
    assert results and all(", rollouts:" in r["variant"] for r in results if not r["variant"].startswith("roofline"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--size", "micro", "--sections", "decode", "--shapes", "rollouts,evals"])
    assert exit_info.value.code == 2
    assert "--shapes evals: not a decode shape" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--size", "micro", "--sections", "decode", "--rounds", "0"])
    assert exit_info.value.code == 2 and "--rounds 0: expected at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sections", "decode,roll"], "--sections roll: not a section; known: rollout,"),
        (["--staleness", "1,x"], "--staleness: '1,x': expected whole numbers from 0 up"),
        (["--staleness", "-1"], "--staleness: '-1': expected whole numbers from 0 up"),
        (["--size", "smollm2", "--sections", "sft"], "--size smollm2 runs the decode, vllm and async sections only"),
    ],
)
def test_bench_names_a_bad_option_before_building_anything(argv, message, capsys):
    bench = load_bench()
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bench_async_section_without_vllm_points_at_its_environment(monkeypatch, capsys):
    bench = load_bench()
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--size", "micro", "--sections", "async"])
    assert exit_info.value.code == 2 and "bash scripts/vllm_env.sh" in capsys.readouterr().err


def test_a_warm_up_takes_the_timed_calls_path(monkeypatch):
    """Short, but long enough to prepack bf16 weights where the timed call does, so that kernel is warm too."""
    import alignment.sampling as sampling
    from alignment.config.sampling import SamplingSpec
    from alignment.sampling import hf

    load_bench()  # puts scripts/ on sys.path, where the bench's sections live (scripts/benchmarks/)
    from benchmarks.common import warm_up

    asked = []
    monkeypatch.setattr(sampling, "generate", lambda model, tokenizer, prompts, spec: asked.append(spec.max_new_tokens))
    for new_tokens in (4, 32, hf.PREPACK_MIN_NEW_TOKENS, 512):
        warm_up(None, None, ["p"] * 9, SamplingSpec(max_new_tokens=new_tokens))
    assert asked == [4, 8, hf.PREPACK_MIN_NEW_TOKENS, hf.PREPACK_MIN_NEW_TOKENS]


def test_bench_async_run_that_fails_carries_its_output_into_the_error(tmp_path):
    """The async section runs each stage as `align run` in a temporary folder, gone when the error is read: the
    error must carry the end of the run's output (here, the recipe's unknown key)."""
    load_bench()
    from benchmarks.async_ppo import align_run

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: x\nmodel: {{tiny: {{}}}}\noutput_dir: {tmp_path}/out\nstages: {{sft: {{bogus: 1}}}}\n")
    with pytest.raises(RuntimeError, match=r"(?s)failed \(exit 2\); its output ends:.*bogus"):
        align_run(recipe, None)
