"""ppo's `async: {max_staleness: 1}` on vLLM's real server (CPU build) on loopback: update t+1's rollout is drawn by
the server from policy version t while update t trains; every sample after the first update is one version old
(policy_lag 1), none dropped, the importance weights correct for it, and only the first rollout (the one drawn by
the current policy) is checked against the policy.

    python=$(bash scripts/vllm_env.sh | tail -1) && $python -m pytest -q -m vllm tests/vllm_cpu/test_async_rollouts.py
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import tiny_ppo_recipe

from alignment.config.model import TinySpec
from alignment.config.recipe import load_recipe
from alignment.models.tiny import build_tiny_model
from alignment.run.runner import run_recipe

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ENGINE = {"kv_cache_gib": 1, "logprob_tolerance": 1e-3, "max_model_len": 256}


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory) -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed here: run with the python of `bash scripts/vllm_env.sh`", pytrace=False)
    return build_tiny_model(TinySpec(num_heads=2, num_kv_heads=1), seed=0, path=tmp_path_factory.mktemp("t") / "m")


def test_async_one_trains_on_samples_one_version_old(tmp_path, tiny32, caplog):
    stage = {
        "rollout": {"server": "local", "vllm": ENGINE},
        "importance_sampling": {"cap": 5.0},
        "async": {"max_staleness": 1},
        "train": {"total_updates": 3},
    }
    with caplog.at_level("INFO"):
        run_recipe(load_recipe(tiny_ppo_recipe(tmp_path, tiny32, **stage)))
    history = json.loads((tmp_path / "out" / "ppo" / "log_history.json").read_text())
    assert [e["policy_lag"] for e in history] == [0.0, 1.0, 1.0]
    assert [e["stale_dropped"] for e in history] == [0.0, 0.0, 0.0]
    assert caplog.text.count("vLLM rollout server vs policy") == 1  # the one rollout of the current version
    # version 0 sampled update 0 and 1: at update 1 the policy has moved, and the weights see it
    assert history[0]["sampler_kl"] < 1e-5 < history[1]["sampler_kl"]
