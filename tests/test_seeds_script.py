"""scripts/seeds.py: the across-seeds table the quickstart figures of docs/results.md come from."""

import importlib.util
import json
import sys

import pytest
from conftest import REPO, run_cli_here

spec = importlib.util.spec_from_file_location("seeds", REPO / "scripts" / "seeds.py")
seeds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(seeds)


def finished_seed(out, seed, sft, rlvr):
    metrics = {
        "base": {"arithmetic/pass@1": 0.0, "arithmetic/kl": 9.0},
        "sft": {"arithmetic/pass@1": sft, "arithmetic/kl": 0.0},
        "rlvr": {"arithmetic/pass@1": rlvr, "arithmetic/kl": 0.5},
    }
    (out / f"seed-{seed}" / "eval").mkdir(parents=True)
    (out / f"seed-{seed}" / "eval" / "metrics.json").write_text(json.dumps({"checkpoints": metrics}))
    (out / f"seed-{seed}" / "wall_s.json").write_text(json.dumps({"wall_s": 500.0 + seed, "jobs": 2, "threads": 2}))


def test_the_table_has_mean_min_max_per_stage_and_every_seeds_gain(tmp_path):
    finished_seed(tmp_path, 1, sft=0.60, rlvr=0.95)
    finished_seed(tmp_path, 2, sft=0.70, rlvr=0.90)
    data = seeds.main(["--seeds", "1", "2", "--out", str(tmp_path), "--table-only"])
    assert data["summary"]["arithmetic/pass@1"]["rlvr"] == pytest.approx({"mean": 0.925, "min": 0.90, "max": 0.95})
    assert data["gains_points"][1]["rlvr"] == pytest.approx(35.0) and data["gains_points"][2]["rlvr"] == pytest.approx(
        20.0
    )
    table = (tmp_path / "seeds.md").read_text()
    assert "0.925 [0.900, 0.950]" in table and "| min | | +20.0 |" in table and "--jobs 2" in table
    assert "| seed | sft arithmetic/pass@1 | rlvr (points) |" in table  # no gain column for the zero-shot base
    assert "wall per seed: 1: 501 s, 2: 502 s" in table  # the runs' own record, also when only tabulating
    assert json.loads((tmp_path / "seeds.json").read_text())["gains_points"]["1"]["rlvr"] == pytest.approx(35.0)


def test_a_seed_that_fails_stops_the_script_naming_its_log(tmp_path, monkeypatch):
    """The script's `align run` command, run in this process (the CLI's own tests run it in a fresh one)."""

    def align_here(command, env, stdout, stderr):
        assert command[:3] == [sys.executable, "-m", "alignment"], command
        done = run_cli_here(*command[3:], env=env)
        with stdout:
            stdout.write(done.stdout + done.stderr)
        return done

    monkeypatch.setattr(seeds.subprocess, "run", align_here)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nstages: {}\nunknown_key: 1\n")
    with pytest.raises(SystemExit) as stop:
        seeds.main([str(bad), "--seeds", "4", "--out", str(tmp_path / "out")])
    assert "seed 4 failed (exit 2)" in str(stop.value) and "seed-4.log" in str(stop.value)
    assert "unknown key 'unknown_key'" in (tmp_path / "out" / "seed-4.log").read_text()
