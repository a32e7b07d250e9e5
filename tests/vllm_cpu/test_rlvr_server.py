"""rlvr's `rollout: {server: local}` on vLLM's real server (CPU build): GRPO's completions sampled through the
server (each prompt's group in one request, n per prompt), the LoRA adapter pushed at every generation, the
processed log-probs checked against the policy's and returned to TRL, which `importance_sampling` corrects with.

    python=$(bash scripts/vllm_env.sh | tail -1) && $python -m pytest -q -m vllm tests/vllm_cpu/test_rlvr_server.py
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import write_recipe

from alignment.config.model import TinySpec
from alignment.config.recipe import load_recipe
from alignment.models.tiny import build_tiny_model
from alignment.run.runner import run_recipe

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory) -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed here: run with the python of `bash scripts/vllm_env.sh`", pytrace=False)
    return build_tiny_model(TinySpec(num_heads=2, num_kv_heads=1), seed=0, path=tmp_path_factory.mktemp("t") / "m")


def test_grpo_samples_its_groups_through_the_server(tmp_path, tiny32, caplog):
    recipe = {
        "name": "rlvr-server",
        "model": str(tiny32),
        "output_dir": str(tmp_path / "out"),
        "seed": 1,
        "lora": {"r": 4, "lora_alpha": 8},
        "stages": {
            "rlvr": {
                "data": {"task": "arithmetic", "split": "train", "n": 16},
                "verifiers": ["arithmetic"],
                "rollout": {"server": "local", "vllm": {"kv_cache_gib": 1, "logprob_tolerance": 1e-3}},
                "importance_sampling": {},
                "train": {
                    "max_steps": 2,
                    "num_generations": 4,
                    "per_device_train_batch_size": 8,
                    "max_completion_length": 8,
                    "logging_steps": 1,
                    "learning_rate": 1.0e-3,
                },
            }
        },
    }
    loaded = load_recipe(write_recipe(tmp_path, recipe))
    with caplog.at_level("INFO"):
        metrics = run_recipe(loaded)["rlvr"]
    metrics = metrics.get("metrics", metrics)
    assert caplog.text.count("vLLM rollout server vs policy") == 2  # one generation per step, each checked
    assert metrics["global_step"] == 2
    history = json.loads((loaded.stage_dir("rlvr") / "log_history.json").read_text())
    assert all(abs(e["is_ratio_mean"] - 1) < 1e-3 and e["sampler_kl"] < 1e-5 for e in history if "is_ratio_mean" in e)
    assert any("is_ratio_mean" in e for e in history)
