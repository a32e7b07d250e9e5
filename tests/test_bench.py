"""The benchmark script runs end to end in its reduced (micro) form and reports every section."""

import importlib.util

from conftest import REPO


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_micro_reports_ours_and_plain_for_each_section(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "bench.json"
    results = bench.main(["--size", "micro", "--json", str(out), "--static-cache"])
    assert any(r["variant"].startswith("ours: static cache") for r in results)
    assert {"ours: LoRA adapter unmerged", "ours: LoRA merged for sampling"} <= {r["variant"] for r in results}
    pairs = {(r["section"], r["variant"].split(":")[0]) for r in results}
    assert pairs == ({(s, v) for s in ("rollout", "sft", "dpo", "decode") for v in ("ours", "plain")}
                     | {("static", "ours"), ("ppo", "ours"), ("decode", "roofline")})  # static: ours vs ours; no TRL PPO
    assert next(r for r in results if r["section"] == "ppo")["unit"] == "episodes/s"
    assert all(r["rate"] > 0 and r["peak_mib"] > 0 for r in results)
    assert out.exists() and "rollout" in capsys.readouterr().out


def test_bench_decode_table_has_useful_tokens_gflops_and_the_roofline_share(capsys):
    """The decode section at micro size: for every recipe shape, the roofline rows (fp32 and bf16: the test model is
    fp32 on CPU) and each sampler's useful tokens/s, GFLOP/s and share of the roofline, the sampled shapes with the
    inverse-CDF draws too. No speed is asserted (the machine may be loaded)."""
    bench = load_bench()
    results = bench.main(["--size", "micro", "--sections", "decode"])
    shapes = {name: temperature for name, _, _, temperature, *_ in bench.SIZES["micro"]["decode"]}
    for name, temperature in shapes.items():
        rows = {r["variant"].split(f", {name}:")[0]: r for r in results if f", {name}:" in r["variant"]}
        samplers = {"ours: engine loop (default)", "ours: engine generate", "plain: model.generate",
                    "ours: engine loop, dtype bfloat16", "plain: model.generate, bf16 weights"}
        if temperature > 0:
            samplers |= {"ours: engine loop, draw inverse_cdf", "ours: engine loop, dtype bfloat16, draw inverse_cdf"}
        assert set(rows) == samplers
        for r in rows.values():
            assert r["unit"] == "tokens/s" and r["rate"] > 0 and r["gflops"] > 0 and 0 < r["of_roofline"]
    roofs = [r["variant"].rsplit(", ", 1)[-1] for r in results if r["variant"].startswith("roofline")]
    assert sorted(roofs) == sorted(["float32", "bfloat16"] * len(shapes))
    assert all(r["unit"] == "GFLOP/s" and r["of_roofline"] == 1.0 for r in results if r["variant"].startswith("roof"))
    header = capsys.readouterr().out
    assert all(column in header for column in ("GFLOP/s", "of roofline", "tokens/s"))


def test_bench_shapes_picks_decode_shapes_and_names_an_unknown_one(capsys):
    import pytest

    bench = load_bench()
    results = bench.main(["--size", "micro", "--sections", "decode", "--shapes", "rollouts"])
    assert results and all(", rollouts:" in r["variant"] for r in results if not r["variant"].startswith("roofline"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--size", "micro", "--sections", "decode", "--shapes", "rollouts,evals"])
    assert exit_info.value.code == 2
    assert "--shapes evals: not a decode shape" in capsys.readouterr().err
