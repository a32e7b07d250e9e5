"""rsft's `sampling: {server: local}` on vLLM's real server (CPU build): each round's server starts on that round's
policy (merged weights), its samples are checked against the policy, and it is stopped after the round's sampling.

    python=$(bash scripts/vllm_env.sh | tail -1) && $python -m pytest -q -m vllm tests/vllm_cpu/test_rsft_server.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import write_recipe

from alignment.config.model import TinySpec
from alignment.config.recipe import load_recipe
from alignment.models.tiny import build_tiny_model
from alignment.run.runner import run_recipe
from alignment.sampling import server as rollout_server

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory) -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed here: run with the python of `bash scripts/vllm_env.sh`", pytrace=False)
    return build_tiny_model(TinySpec(num_heads=2, num_kv_heads=1), seed=0, path=tmp_path_factory.mktemp("t") / "m")


def test_rsft_samples_its_round_on_a_server_of_the_rounds_policy(tmp_path, tiny32, caplog, monkeypatch):
    started = []
    start = rollout_server.start_local
    monkeypatch.setattr(rollout_server, "start_local", lambda *a, **k: started.append(start(*a, **k)) or started[-1])
    sampling = {"server": "local", "vllm": {"kv_cache_gib": 1, "logprob_tolerance": 1e-3}, "max_new_tokens": 6, "n": 4}
    recipe = {
        "name": "rsft-server",
        "model": str(tiny32),
        "output_dir": str(tmp_path / "out"),
        "seed": 2,
        "stages": {
            "rsft": {
                "data": {"task": "arithmetic", "split": "train", "n": 8},
                "verifiers": ["arithmetic"],
                "select": "top_k",
                "sampling": sampling,
                "train": {"max_steps": 1, "per_device_train_batch_size": 4, "max_length": 64},
            }
        },
    }
    with caplog.at_level("INFO"):
        run_recipe(load_recipe(write_recipe(tmp_path, recipe)))
    assert caplog.text.count("vLLM rollout server vs policy") == 1  # the round's samples passed the 1e-3 check
    (running,) = started
    assert running.process is None and running.version == 0  # stopped after sampling; no adapter pushed
    assert (tmp_path / "out" / "rsft" / "logs" / "rollout_server.log").exists()
