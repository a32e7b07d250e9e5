"""`importance_sampling:` with `backend: vllm` on the real engine (vLLM's CPU build): the engine runs in
`processed_logprobs` mode, its log-probs of each sampled token (after temperature and top-k) agree with the
policy's processed log-probs within the check's tolerance, and PPO's ratio statistics come from them.

    python=$(bash scripts/vllm_env.sh | tail -1) && $python -m pytest -q -m vllm tests/vllm_cpu/test_importance_vllm.py
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
from alignment.sampling import vllm_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ENGINE = {"kv_cache_gib": 1, "logprob_tolerance": 1e-3}


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory) -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed here: run with the python of `bash scripts/vllm_env.sh`", pytrace=False)
    yield build_tiny_model(TinySpec(num_heads=2, num_kv_heads=1), seed=0, path=tmp_path_factory.mktemp("t") / "m")
    vllm_engine.close()


def test_ppo_on_vllm_corrects_with_the_engines_processed_logprobs(tmp_path, tiny32, caplog):
    rollout = {"backend": "vllm", "vllm": ENGINE, "temperature": 0.8, "top_k": 3}
    recipe = tiny_ppo_recipe(tmp_path, tiny32, rollout=rollout, importance_sampling={"cap": 2.0})
    with caplog.at_level("INFO"):
        run_recipe(load_recipe(recipe))
    assert vllm_engine._engine is not None and vllm_engine._engine.shape.endswith("|processed_logprobs")
    assert caplog.text.count("vLLM sampler vs policy") == 3  # every update's check passed on processed log-probs
    history = json.loads((tmp_path / "out" / "ppo" / "log_history.json").read_text())
    for entry in history:  # top-k: pi / pi_sampler = the kept mass Z < 1 for every sampled token
        assert 0 < entry["is_ratio_mean"] < 1 and entry["is_ratio_max"] <= 1 + 1e-3 and entry["sampler_kl"] > 0
