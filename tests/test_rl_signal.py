"""Where an RL stage's signal is: dynamic sampling (flat groups dropped and refilled up to a bound), the prompt
filter by the start policy's pass rate, and the health line every RL stage ends with."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import SMALLEST_MODEL, recipe_dict, run, write_recipe

from alignment.errors import UserError
from alignment.training.dynamic_sampling import DynamicSampling, pad_rows
from alignment.training.health import health, reward_trend, unparseable_share
from alignment.training.signal import flat_groups, keep_groups, pass_rate_bounds

# ---------------------------------------------------------------------------------------------------
# Pure rules


def test_flat_groups_marks_groups_whose_rewards_do_not_differ():
    assert flat_groups([1, 1, 0, 1, 0.5, 0.5], 2) == [True, False, True]
    with pytest.raises(ValueError, match="whole groups"):
        flat_groups([1, 1, 0], 2)


@pytest.mark.parametrize(
    "draws, needed, chosen, counts",
    [
        # enough groups with spread in the first draw: the flat one is dropped, the spare one left over
        ([[False, True, False, False]], 2, [(0, 0), (0, 2)], {"dropped": 1, "filled": 0, "informative": 2, "spare": 1}),
        # refilled from the second draw
        (
            [[True, False], [False, True]],
            2,
            [(0, 1), (1, 0)],
            {"dropped": 2, "filled": 0, "informative": 2, "spare": 0},
        ),
        # the bound ran out: flat groups fill the batch, first draws first
        ([[True, True], [True, False]], 2, [(0, 0), (1, 1)], {"dropped": 2, "filled": 1, "informative": 1, "spare": 0}),
        ([[True, True]], 2, [(0, 0), (0, 1)], {"dropped": 0, "filled": 2, "informative": 0, "spare": 0}),
    ],
)
def test_keep_groups_prefers_groups_with_spread_and_never_shrinks_the_batch(draws, needed, chosen, counts):
    assert keep_groups(draws, needed) == (chosen, counts)


@pytest.mark.parametrize(
    "rates, low, high, kept, counts",
    [
        ([0.0, 0.125, 0.5, 0.875, 1.0], 0.1, 0.9, [1, 2, 3], {"kept": 3, "too_hard": 1, "too_easy": 1}),
        ([0.0, 0.5, 1.0], 0.5, 0.5, [1], {"kept": 1, "too_hard": 1, "too_easy": 1}),  # bounds are inclusive
        ([0.0, 0.0], 0.1, 0.9, [], {"kept": 0, "too_hard": 2, "too_easy": 0}),
    ],
)
def test_pass_rate_bounds_keep_rates_within_low_and_high(rates, low, high, kept, counts):
    assert pass_rate_bounds(rates, low, high) == (kept, counts)


def test_reward_trend_compares_the_first_and_last_third():
    history = [{"reward": r, "reward_std": 0.2} for r in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)] + [{"loss": 1.0}]
    assert reward_trend(history, "reward", "reward_std") == pytest.approx(
        {"reward_start": 0.15, "reward_end": 0.55, "reward_std": 0.2}
    )
    assert reward_trend([{"reward": 1.0}], "reward") == {}


# ---------------------------------------------------------------------------------------------------
# The health line: (status, paragraph) from a stage's metrics

FLAT = {"reward_start": 0.30, "reward_end": 0.30, "reward_std": 0.2}
ROSE = {"reward_start": 0.30, "reward_end": 0.45, "reward_std": 0.2}
VERIFIER = {"verifier/arithmetic/scored": 100, "verifier/arithmetic/unparseable": 0, "verifier/arithmetic/errors": 0}


@pytest.mark.parametrize(
    "kind, metrics, status, says",
    [
        (
            "rlvr",
            {**ROSE, **VERIFIER, "zero_variance_groups": 0.1, "kl": 0.05},
            "ok",
            ["reward rose (0.3 to 0.45", "Nothing in its counters looks wrong"],
        ),
        (
            "rlvr",
            {**FLAT, **VERIFIER, "zero_variance_groups": 0.67, "kl": 0.05},
            "flat",
            [
                "did not move",
                "67% of the prompt groups scored alike",
                "dynamic_sampling",
                "prompt_filter",
                "train.num_generations",
            ],
        ),
        (
            "rlvr",
            {**FLAT, "completions_truncated": 40, "completions_sampled": 100},
            "flat",
            ["40% of completions were cut", "train.max_completion_length"],
        ),
        (
            "rlvr",
            {
                **FLAT,
                "verifier/math/scored": 100,
                "verifier/math/unparseable": 50,
                "verifier/math/errors": 5,
                "zero_variance_groups": 0.9,
            },
            "flat",
            [
                "Likely cause: the verifiers could not parse (or failed on) 55%",
                "format",
                "Also: 90% of the prompt groups",
            ],
        ),
        ("rlvr", {**FLAT, **VERIFIER, "kl": 1e-5}, "flat", ["KL to the start policy stayed at 1e-05", "learning_rate"]),
        ("rlvr", {**ROSE, "zero_variance_groups": 0.8}, "warn", ["reward rose", "80% of the prompt groups"]),
        ("rlvr", {"reward_start": 0.5, "reward_end": 0.2}, "fell", ["reward fell", "No counter explains it"]),
        (
            "ppo",
            {**FLAT, "eos_fraction": 0.5, "kl": 0.5},
            "flat",
            ["50% of completions were cut", "rollout.max_new_tokens"],
        ),
        ("ppo", {**FLAT, "kl": 1e-3}, "flat", ["KL to the start policy", "train.total_updates"]),
        (
            "rsft",
            {"prompt_coverage": 0.2, "unfinished_rate": 0.3},
            "unknown",
            ["not logged twice", "only 20% of prompts had a sample kept", "sampling.n", "sampling.max_new_tokens"],
        ),
        ("rsft", {**ROSE, "prompt_coverage": 0.9}, "ok", ["reward rose"]),
        (
            "rsft",
            {**FLAT, "prompt_coverage": 0.6},
            "flat",
            ["did not move", "No counter explains it: compare the start and final policies' evaluation", "rounds"],
        ),
    ],
)
def test_health_names_the_likely_cause_and_the_setting(kind, metrics, status, says):
    found, paragraph = health(kind, metrics)
    assert found == status, paragraph
    for phrase in says:
        assert phrase in paragraph, (phrase, paragraph)
    assert paragraph.startswith(f"Health ({kind}): ") and "\n" not in paragraph


def test_gold_verifiers_are_not_counted_as_parse_failures():
    metrics = {**VERIFIER, "verifier/gold/x/scored": 100, "verifier/gold/x/unparseable": 100}
    assert unparseable_share(metrics) == 0.0
    assert unparseable_share({}) is None


# ---------------------------------------------------------------------------------------------------
# Dynamic sampling on a stand-in trainer: which rows make the batch


class StandIn:
    """The parts of a GRPO trainer DynamicSampling touches; each draw's groups are flat as `plan` says, and every
    row's completion holds (draw, row) so the test can read which rows were joined."""

    def __init__(self, plan: list[list[bool]], size: int = 2):
        self.plan, self.num_generations, self.calls = plan, size, []
        self.accelerator = SimpleNamespace(process_index=0, num_processes=1)
        self.args = SimpleNamespace(per_device_train_batch_size=len(plan[0]) * size, steps_per_generation=1)
        self.model = SimpleNamespace(training=True)
        self.train_dataset = [{"prompt": f"fresh {i}"} for i in range(10)]
        self.processing_class = SimpleNamespace(pad_token_id=0)
        self.signal = SimpleNamespace(last_flat=None)
        self._generate_and_score_completions = self.generate

    def generate(self, inputs):
        draw = len(self.calls)
        self.calls.append(inputs)
        self.signal.last_flat = self.plan[draw]
        rows = len(inputs)
        width = draw + 1  # draws of different widths, re-padded when joined
        completion = torch.tensor([[10 * draw + r + 1] * width for r in range(rows)])
        return {
            "prompt_ids": torch.ones(rows, 3, dtype=torch.long),
            "prompt_mask": torch.ones(rows, 3),
            "completion_ids": completion,
            "completion_mask": torch.ones(rows, width),
            "advantages": torch.arange(rows, dtype=torch.float) + 100 * draw,
            "num_items_in_batch": torch.tensor(rows * width),
        }


def test_flat_groups_are_dropped_and_refilled_from_fresh_prompts():
    trainer = StandIn([[True, False, True], [False, True, True], [True, False, True]])
    sampler = DynamicSampling(trainer, trainer.signal, max_draws=3, seed=1, where="stages.rl")
    batch = trainer._generate_and_score_completions([{"prompt": "p"}] * 6)
    assert len(trainer.calls) == 3  # the third draw completed the batch
    assert [len(c) for c in trainer.calls] == [6, 6, 6]
    fresh = trainer.calls[1]
    assert fresh[0]["prompt"].startswith("fresh") and fresh[0] == fresh[1] != fresh[2]  # whole groups of a prompt
    # kept: draw 0's group 1 (rows 2, 3), draw 1's group 0 (rows 0, 1), draw 2's group 1 (rows 2, 3)
    assert batch["advantages"].tolist() == [2, 3, 100, 101, 202, 203]
    assert batch["completion_ids"][:, 0].tolist() == [3, 4, 11, 12, 23, 24]
    assert batch["completion_ids"].shape == (6, 3) and batch["completion_mask"][0].tolist() == [1, 0, 0]
    assert batch["num_items_in_batch"].item() == 2 * 1 + 2 * 2 + 2 * 3
    assert sampler.metrics() == {
        "dynamic_sampling/batches": 1,
        "dynamic_sampling/draws": 3,
        "dynamic_sampling/groups_dropped": 6,
        "dynamic_sampling/groups_filled": 0,
        "dynamic_sampling/groups_spare": 0,
        "dynamic_sampling/batches_short": 0,
        "zero_variance_groups_trained": 0.0,
    }


def test_the_bound_fills_a_short_batch_with_flat_groups_and_says_so(caplog):
    trainer = StandIn([[True, True], [True, False]])
    sampler = DynamicSampling(trainer, trainer.signal, max_draws=2, seed=1, where="stages.rl")
    batch = trainer._generate_and_score_completions([{"prompt": "p"}] * 4)
    assert batch["advantages"].tolist() == [0, 1, 102, 103]  # draw 0's first flat group fills the gap
    metrics = sampler.metrics()
    assert metrics["dynamic_sampling/groups_filled"] == 1 and metrics["dynamic_sampling/batches_short"] == 1
    assert metrics["zero_variance_groups_trained"] == 0.5
    with caplog.at_level(logging.WARNING):
        sampler.report()
    assert "raise dynamic_sampling.max_draws" in caplog.text


def test_a_batch_with_spread_everywhere_is_sampled_once_and_evaluation_is_left_alone():
    trainer = StandIn([[False, False]])
    DynamicSampling(trainer, trainer.signal, max_draws=3, seed=1, where="stages.rl")
    trainer._generate_and_score_completions([{"prompt": "p"}] * 4)
    assert len(trainer.calls) == 1
    trainer.model.training = False
    trainer.calls, trainer.plan = [], [[True, True]]
    trainer._generate_and_score_completions([{"prompt": "p"}] * 4)
    assert len(trainer.calls) == 1


def test_pad_rows_pads_on_either_side():
    rows = [torch.tensor([1, 2]), torch.tensor([3])]
    assert pad_rows(rows, "left", 0).tolist() == [[1, 2], [0, 3]]
    assert pad_rows(rows, "right", 9).tolist() == [[1, 2], [3, 9]]


# ---------------------------------------------------------------------------------------------------
# In the stages, on tiny models

# Rewards flat within the group of a prompt whose answer is even, varied otherwise (as in test_rlvr.py).
MIXED = """def mixed(completion, answer):
    return float(len(answer)) if int(answer) % 2 == 0 else float(len(completion.strip()) % 3)
"""

# Pass rates the start policy cannot change: 1 for answers divisible by 3, 0 for remainder 1, exactly one half for
# remainder 2 (the verifier alternates; each prompt's k completions are scored one after another).
BY_ANSWER = """import itertools

_turn = itertools.count()


def by_answer(completion, answer):
    rest = int(answer) % 3
    return 1.0 if rest == 0 else 0.0 if rest == 1 else float(next(_turn) % 2)
"""

FAST_RLVR = {
    "max_steps": 2,
    "num_generations": 4,
    "per_device_train_batch_size": 16,
    "max_completion_length": 4,
    "learning_rate": 1.0e-3,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
}


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])  # RLOO's batch holds old_logps, joined the same way
def test_rlvr_dynamic_sampling_counts_its_draws_in_stage_json(tmp_path, algorithm):
    (tmp_path / "signal_verifiers.py").write_text(MIXED)
    stage = {
        "verifiers": ["signal_verifiers:mixed"],
        "train": FAST_RLVR,
        "dynamic_sampling": {"max_draws": 3},
        "algorithm": algorithm,
        "data": {"task": "arithmetic", "split": "train", "n": 32},
    }
    recipe, _, _ = run(tmp_path, "rlvr", stage, model=SMALLEST_MODEL)
    metrics = json.loads((recipe.stage_dir("rlvr") / "stage.json").read_text())["metrics"]
    assert metrics["global_step"] == 2 and metrics["dynamic_sampling/batches"] == 2
    draws = metrics["dynamic_sampling/draws"]
    assert 2 <= draws <= 6 and metrics["completions_sampled"] == 16 * draws  # every draw sampled and counted
    drawn_groups = draws * 4
    assert metrics["dynamic_sampling/groups_dropped"] + metrics["dynamic_sampling/groups_filled"] == round(
        metrics["zero_variance_groups"] * drawn_groups
    )  # every flat group: dropped, or kept to fill
    assert metrics["zero_variance_groups_trained"] == metrics["dynamic_sampling/groups_filled"] / 8
    assert metrics["health"] in ("ok", "warn", "flat", "fell") and metrics["health_summary"].startswith("Health (rlvr)")


def answers(n: int, seed: int = 1) -> list[int]:
    """The answers of the rows a stage reads from `data: {task: arithmetic, split: train, n: N}` (recipe seed 1)."""
    from alignment.config.data import DataSpec
    from alignment.data.loading import load_rows

    return [int(r["answer"]) for r in load_rows(DataSpec(task="arithmetic", split="train", n=n), seed)]


def filter_counts(metrics: dict) -> dict:
    return {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("prompt_filter/") and "rate" not in k}


@pytest.mark.parametrize("kind", ["rlvr", "rsft", "ppo"])
def test_prompt_filter_keeps_prompts_the_start_policy_solves_sometimes(tmp_path, kind):
    (tmp_path / "pass_rates.py").write_text(BY_ANSWER)
    data = {"task": "arithmetic", "split": "train", "n": 12}
    common = {"data": data, "verifiers": ["pass_rates:by_answer"], "prompt_filter": {"k": 4, "low": 0.25, "high": 0.75}}
    stage = {
        "rlvr": {**common, "train": {**FAST_RLVR, "max_steps": 1, "per_device_train_batch_size": 4}},
        "rsft": {
            **common,
            "sampling": {"n": 2, "max_new_tokens": 4},
            "select": "threshold",
            "threshold": 0.0,
            "train": {"max_steps": 1, "report_to": "none", "save_strategy": "no"},
        },
        "ppo": {
            **common,
            "rollout": {"batch_size": 4, "max_new_tokens": 4},
            "train": {"total_updates": 1, "mini_batch_size": 4, "ppo_epochs": 1},
        },
    }[kind]
    recipe, _, _ = run(tmp_path, kind, stage, model=SMALLEST_MODEL)
    metrics = json.loads((recipe.stage_dir(kind) / "stage.json").read_text())["metrics"]
    rests = [a % 3 for a in answers(12)]
    assert filter_counts(metrics) == {
        "measured": 12,
        "kept": rests.count(2),
        "too_hard": rests.count(1),
        "too_easy": rests.count(0),
    }
    assert metrics["prompt_filter/start_pass_rate"] == pytest.approx((rests.count(0) + rests.count(2) / 2) / 12)
    assert metrics["health_summary"].startswith(f"Health ({kind})")


def test_prompt_filter_that_leaves_nothing_is_a_clear_error(tmp_path):
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import run_recipe

    (tmp_path / "pass_rates.py").write_text(BY_ANSWER)
    stage = {
        "data": {"task": "arithmetic", "split": "train", "n": 6},
        "verifiers": ["pass_rates:by_answer"],
        "prompt_filter": {"k": 2, "low": 0.6, "high": 0.9},
        "sampling": {"n": 2, "max_new_tokens": 4},
    }
    recipe = load_recipe(write_recipe(tmp_path, recipe_dict(tmp_path, "rsft", stage, SMALLEST_MODEL)))
    with pytest.raises(
        UserError,
        match=r"rsft.prompt_filter: no prompt has a pass rate within \[0.6, 0.9\].*"
        r"0.00: \d+.*Widen low/high",
    ):
        run_recipe(recipe)


@pytest.mark.parametrize(
    "stage, message",
    [
        ({"kind": "rsft", "reward_model": "x", "prompt_filter": {}}, "needs `verifiers:`"),
        ({"kind": "rlvr", "verifiers": ["arithmetic"], "prompt_filter": {"low": 0.8, "high": 0.2}}, "no pass rate"),
        ({"kind": "rlvr", "verifiers": ["arithmetic"], "dynamic_sampling": {"max_draws": 1}}, "max_draws"),
    ],
)
def test_signal_settings_are_validated(stage, message):
    from alignment.config.stages import CONFIGS

    with pytest.raises(ValueError, match=message):
        CONFIGS[stage["kind"]](data={"task": "arithmetic"}, **stage)


def test_with_dynamic_sampling_on_the_health_line_reads_the_groups_trained_on():
    status, paragraph = health("rlvr", {**FLAT, "zero_variance_groups": 0.8, "zero_variance_groups_trained": 0.6})
    assert status == "flat" and "dynamic sampling was on, yet 60%" in paragraph
    assert "dynamic_sampling.max_draws" in paragraph and "turn on `dynamic_sampling`" not in paragraph
    status, paragraph = health("rlvr", {**ROSE, "zero_variance_groups": 0.8, "zero_variance_groups_trained": 0.0})
    assert status == "ok"  # the flat groups were dropped and refilled: nothing to flag


def test_further_causes_read_as_sentences():
    _, paragraph = health(
        "rlvr",
        {**FLAT, "zero_variance_groups": 0.9, "completions_truncated": 50, "completions_sampled": 100, "kl": 0.0},
    )
    assert "Also: 50% of completions" in paragraph and " The KL to the start policy" in paragraph
