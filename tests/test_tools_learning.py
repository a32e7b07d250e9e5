"""A tiny from-scratch model learns to use a tool under rlvr with tools (issue #30 item 5, the tiny version).

The task (tests/secret_box.py) needs its tool: the answer is a random digit that only the `open_box()` tool of
an environment shows. SFT on demonstrations that call the tool for 30% of the problems (guessing a digit for the
rest) gives a policy that calls about a third of the time; GRPO with the environment in multi-turn rollouts,
rewarded by the arithmetic verifier on the final answer, then raises both the share of rollouts that call the tool
and the reward, as read from the rlvr stage's own per-step log (`tools/call_rate`, `rewards/arithmetic/mean`).
"""

from __future__ import annotations

import json
from pathlib import Path

import secret_box
from conftest import write_recipe

from alignment.config.recipe import load_recipe
from alignment.run.runner import run_recipe

FORMAT = "llama3_json"  # the shortest call text of the formats: `{"name": "open_box", "parameters": {}}`
RL_STEPS = 30


def tool_learning_recipe(tmp_path: Path, seed: int) -> dict:
    sft_rows = secret_box.sft_rows(800, seed, call_fraction=0.3, style=FORMAT)
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in sft_rows))
    (tmp_path / "boxes.jsonl").write_text("\n".join(json.dumps(r) for r in secret_box.rl_rows(512, seed)))
    return {
        "name": "tool-learning",
        "model": {"tiny": {"hidden_size": 64, "num_layers": 2}},
        "output_dir": str(tmp_path / "out"),
        "seed": seed,
        "stages": {
            # 200 steps: the call text is learned in about 50, copying the tool's digit into the answer in 75-150
            # (a sharp transition whose step varies with the seed).
            "sft": {
                "data": {"dataset": str(tmp_path / "sft.jsonl")},
                "train": {
                    "num_train_epochs": 4,
                    "per_device_train_batch_size": 32,
                    "learning_rate": 5.0e-3,
                    "lr_scheduler_type": "constant_with_warmup",
                    "warmup_steps": 10,
                    "max_length": 128,
                    "logging_steps": 50,
                },
            },
            "rlvr": {
                "model": "${sft}",
                "data": {"dataset": str(tmp_path / "boxes.jsonl")},
                "verifiers": ["arithmetic"],
                "environment": "secret_box:SecretBox",
                "tool_format": FORMAT,
                "describe_tools": False,
                "max_turns": 2,
                "max_tool_output_tokens": 32,
                "train": {
                    "max_steps": RL_STEPS,
                    "num_generations": 8,
                    "per_device_train_batch_size": 16,
                    "learning_rate": 5.0e-4,
                    "lr_scheduler_type": "constant",
                    "beta": 0.0,
                    "temperature": 1.0,
                    "max_completion_length": 80,
                    "logging_steps": 1,
                },
            },
        },
    }


def learning_curve(tmp_path: Path, seed: int) -> tuple[list[float], list[float]]:
    """(tool-call rate, mean verifier reward) per rlvr step: each over the step's 16 rollouts, sampled from the
    policy before that step's update (so step 1 is the SFT policy)."""
    loaded = load_recipe(write_recipe(tmp_path, tool_learning_recipe(tmp_path, seed)))
    run_recipe(loaded)
    history = json.loads((loaded.stage_dir("rlvr") / "log_history.json").read_text())
    steps = [entry for entry in history if "tools/call_rate" in entry]
    assert len(steps) == RL_STEPS
    return [entry["tools/call_rate"] for entry in steps], [entry["rewards/arithmetic/mean"] for entry in steps]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_a_tiny_model_learns_to_call_the_tool_it_needs(tmp_path):
    """The SFT policy (the first 3 steps) against the policy of the second half (steps 16-30, 240 rollouts): a
    window, not the last few steps, because at a constant learning rate and no KL penalty a run that has learned
    the tool can drop for a few steps and recover, and where that happens moves with the float ordering of the
    machine's kernels. Seeds 1-5 on a 2-core AVX2 host, rise of the call rate +0.39, +0.34, +0.71, +0.68, +0.70
    and of the reward +0.30, +0.32, +0.65, +0.58, +0.62 at learning rate 5e-4. The margins (0.2) are below the
    smallest rises (0.34 and 0.30)."""
    calls, rewards = learning_curve(tmp_path, seed=1)
    start_calls, end_calls = mean(calls[:3]), mean(calls[RL_STEPS // 2 :])
    start_reward, end_reward = mean(rewards[:3]), mean(rewards[RL_STEPS // 2 :])
    assert start_calls < 0.6, f"the SFT policy already calls in {start_calls:.0%} of rollouts: no room to learn"
    assert end_calls >= start_calls + 0.2, (calls, rewards)
    assert end_reward >= start_reward + 0.2, (calls, rewards)
