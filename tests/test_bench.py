"""The benchmark script runs end to end in its reduced (micro) form and reports every section."""

import importlib.util

from conftest import REPO


def test_bench_micro_reports_ours_and_plain_for_each_section(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    results = bench.main(["--size", "micro", "--json", str(out), "--static-cache"])
    assert any(r["variant"].startswith("ours: static cache") for r in results)
    assert {"ours: LoRA adapter unmerged", "ours: LoRA merged for sampling"} <= {r["variant"] for r in results}
    pairs = {(r["section"], r["variant"].split(":")[0]) for r in results}
    assert pairs == ({(s, v) for s in ("rollout", "sft", "dpo") for v in ("ours", "plain")}
                     | {("static", "ours"), ("ppo", "ours")})  # static: ours against ours; TRL has no PPO
    assert next(r for r in results if r["section"] == "ppo")["unit"] == "episodes/s"
    assert all(r["rate"] > 0 and r["peak_mib"] > 0 for r in results)
    assert out.exists() and "rollout" in capsys.readouterr().out
