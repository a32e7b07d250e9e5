"""ppo's `rollout: {server: ...}` against vLLM's real OpenAI-compatible server (vLLM's CPU build) on loopback: a
tiny model saved to disk, its LoRA adapter pushed after every update under a fresh name, every rollout's processed
log-probs checked against the policy's (tolerance 1e-3), the server stopped when the run ends.

    python=$(bash scripts/vllm_env.sh | tail -1) && $python -m pytest -q -m vllm tests/vllm_cpu/test_server_engine.py
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import tiny_ppo_recipe

from alignment.config.model import TinySpec
from alignment.config.recipe import load_recipe
from alignment.config.sampling import VllmSpec
from alignment.models.tiny import build_tiny_model
from alignment.run.runner import run_recipe
from alignment.sampling import server as rollout_server

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ENGINE = {"kv_cache_gib": 1, "logprob_tolerance": 1e-3, "max_model_len": 256}
TWO_UPDATES = {"total_updates": 2}


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory) -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed here: run with the python of `bash scripts/vllm_env.sh`", pytrace=False)
    return build_tiny_model(TinySpec(num_heads=2, num_kv_heads=1), seed=0, path=tmp_path_factory.mktemp("t") / "m")


def test_ppo_samples_through_a_local_server_and_stops_it(tmp_path, tiny32, caplog, monkeypatch):
    started = []
    start = rollout_server.start_local
    monkeypatch.setattr(rollout_server, "start_local", lambda *a, **k: started.append(start(*a, **k)) or started[-1])
    rollout = {"server": "local", "vllm": ENGINE, "temperature": 0.9, "top_k": 5}
    recipe = tiny_ppo_recipe(tmp_path, tiny32, rollout=rollout, train=TWO_UPDATES, importance_sampling={})
    with caplog.at_level("INFO"):
        run_recipe(load_recipe(recipe))
    assert caplog.text.count("vLLM rollout server vs policy") == 2  # both rollouts passed the 1e-3 check
    (server,) = started
    assert server.process is None and server.version == 2  # stopped; the adapter pushed once per update
    log = (tmp_path / "out" / "ppo" / "logs" / "rollout_server.log").read_text()  # kept with the checkpoint
    assert "/v1/load_lora_adapter" in log and "/v1/completions" in log  # the second check needs the pushed adapter
    history = json.loads((tmp_path / "out" / "ppo" / "log_history.json").read_text())
    assert len(history) == 2 and all(0 < e["is_ratio_mean"] < 1 and e["sampler_kl"] > 0 for e in history)


def test_ppo_uses_a_server_the_user_runs(tmp_path, tiny32, caplog):
    spec = VllmSpec(**ENGINE)
    with rollout_server.start_local(str(tiny32), spec, 4, "float32", tmp_path / "logs", "user") as running:
        rollout = {"server": running.url, "vllm": ENGINE}
        recipe = tiny_ppo_recipe(tmp_path, tiny32, rollout=rollout, train=TWO_UPDATES)
        with caplog.at_level("INFO"):
            run_recipe(load_recipe(recipe))
        assert running.process.poll() is None  # a server the user runs is left running
    assert caplog.text.count("vLLM rollout server vs policy") == 2


def test_two_processes_share_one_server(tmp_path, tiny32):
    """`accelerate launch` with 2 CPU processes (DDP, gloo): process 0 starts the one server and pushes each version,
    process 1 connects and samples from it; both train on their own prompts and the run ends cleanly."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    rollout = {"server": "local", "vllm": ENGINE}
    recipe = tiny_ppo_recipe(tmp_path, tiny32, rollout=rollout, train=TWO_UPDATES)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["-m", "alignment", "run", str(recipe)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=850, env=env, cwd=repo)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert output.count("starting the vLLM rollout server") == 1  # one server for both processes
    history = json.loads((tmp_path / "out" / "ppo" / "log_history.json").read_text())
    assert len(history) == 2 and history[-1]["episodes"] == 2 * 2 * 8  # both processes sampled 8 prompts per update
    assert "Traceback" not in output, output[-4000:]
