"""`rollout: {server: ...}` without vLLM: the config's checks, and the server's error paths (a start that fails, a
server that never answers, one that crashes mid-request) against stand-in executables: each error names the
server's log and leaves no process behind. The real server: tests/vllm_cpu/test_server_engine.py.

Run: python -m pytest tests/test_rollout_server.py -q   (CPU, seconds)
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
from pydantic import ValidationError

from alignment.config.model import LoraSpec
from alignment.config.sampling import SamplingSpec, VllmSpec
from alignment.config.stages.ppo import RolloutSpec
from alignment.errors import UserError
from alignment.sampling import server

# A stand-in "python" for `vllm.server_python`: runs the script its body names, whatever arguments vLLM would get.
STAND_IN = """#!{python}
import sys
{body}
"""

HEALTHY_THEN_CRASH = """
import os, http.server, socketserver
port = int(sys.argv[sys.argv.index("--port") + 1])
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def do_POST(self):
        print("crashing on the first request", flush=True)
        os._exit(3)
socketserver.TCPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def stand_in(tmp_path, body: str) -> str:
    path = tmp_path / "fake_python"
    path.write_text(STAND_IN.format(python=sys.executable, body=textwrap.dedent(body)))
    path.chmod(0o755)
    return str(path)


def started(tmp_path, body: str, **spec):
    vllm = VllmSpec(server_python=stand_in(tmp_path, body), **spec)
    return server.start_local("/no/model", vllm, 4, "float32", tmp_path / "logs", "stages.ppo.rollout")


def test_rollout_spec_takes_local_or_a_url_and_not_with_the_vllm_backend(monkeypatch):
    monkeypatch.setattr("alignment.config.sampling.vllm_missing", lambda *a: None)  # as where vLLM is installed
    assert RolloutSpec(server="local").server == "local"
    assert RolloutSpec(server="http://10.1.2.3:8000").server == "http://10.1.2.3:8000"
    with pytest.raises(ValidationError, match="neither `local` nor a URL"):
        RolloutSpec(server="localhost")
    with pytest.raises(ValidationError, match="`backend: vllm` is an engine in this process"):
        RolloutSpec(server="local", backend="vllm", vllm={"check_samples": 0})


def test_check_refuses_full_finetuning_several_processes_and_a_missing_python(tmp_path):
    spec = VllmSpec()
    with pytest.raises(UserError, match=r"(?s)stages.ppo.server: the policy's weights reach the server as LoRA.*lora:"):
        server.check_settings("local", spec, None, 1, "stages.ppo")
    with pytest.raises(UserError, match="2 processes"):
        server.check_settings("local", spec, LoraSpec(), 2, "stages.ppo")
    with pytest.raises(UserError, match="server_python: /nowhere/python is not a file"):
        server.check_settings("local", VllmSpec(server_python="/nowhere/python"), LoraSpec(), 1, "stages.ppo")
    server.check_settings("http://127.0.0.1:1", spec, LoraSpec(), 1, "stages.ppo")  # a URL needs no local vLLM


def test_a_server_that_exits_at_start_is_an_error_naming_its_log(tmp_path):
    with pytest.raises(UserError) as error:
        started(tmp_path, 'print("vllm: no such model /no/model", flush=True); sys.exit(7)')
    message = str(error.value)
    assert "exited with code 7 before it answered /health" in message
    assert str(tmp_path / "logs" / "rollout_server.log") in message and "no such model" in message


def test_the_server_is_bound_to_its_cores_and_given_runtime_lora(tmp_path):
    body = """
        import os
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "-")
        print("bind=" + bind, os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"], sys.argv[1:], flush=True)
        sys.exit(1)
    """
    with pytest.raises(UserError) as error:
        started(tmp_path, body, server_cpus="0")
    assert "bind=0 True" in str(error.value) and "'--logprobs-mode', 'processed_logprobs'" in str(error.value)


def test_a_server_that_never_answers_is_stopped_and_named(tmp_path):
    with pytest.raises(UserError, match=r"did not answer /health within 1 s.*rollout_server.log") as error:
        started(tmp_path, 'import time; print("loading", flush=True); time.sleep(600)', server_start_timeout=1)
    assert "loading" in str(error.value)
    assert not any("fake_python" in line for line in os.popen("ps -eo args").read().splitlines()), "left running"


def test_a_crash_mid_request_is_an_error_naming_the_log(tmp_path):
    running = started(tmp_path, HEALTHY_THEN_CRASH)
    with running, pytest.raises(UserError, match=r"(?s)exited with code 3.*rollout_server.log.*crashing"):
        running.generate_ids(None, [[1, 2]], SamplingSpec(), [0], model="policy-v1")
    assert running.process is None


def test_an_unreachable_url_is_an_error_naming_it(tmp_path):
    with pytest.raises(UserError, match=r"did not answer /health within 1 s.*http://127.0.0.1:9"):
        server.connect("http://127.0.0.1:9", VllmSpec(server_start_timeout=1), "stages.ppo.rollout")


# --------------------------------------------------------------------------------------------------
# async: {max_staleness: k}
# --------------------------------------------------------------------------------------------------


def test_prefetch_hands_each_update_its_samples_and_drops_those_too_old():
    prefetch = server.Prefetch(max_staleness=2)
    try:
        prefetch.submit(1, 0, lambda: ["a", "b"])  # drawn by version 0 for update 1
        prefetch.submit(1, 0, lambda: ["never"])  # an update already queued is not drawn twice
        prefetch.submit(5, 1, lambda: ["c", "d", "e"])
        assert prefetch.versions() == {0, 1}
        assert prefetch.take(1, 1) == (["a", "b"], 1)  # one version behind: kept
        assert prefetch.take(2, 2) == (None, 0)  # nothing drawn ahead for it
        assert prefetch.take(5, 4) == (None, 0) and prefetch.dropped == 3  # 3 versions behind k = 2: dropped, counted
    finally:
        prefetch.close()


def test_prefetch_raises_a_failed_request_in_the_training_thread():
    prefetch = server.Prefetch(max_staleness=1)

    def failing():
        raise UserError("stages.ppo.rollout: the vLLM rollout server did not answer")

    try:
        prefetch.submit(1, 0, failing)
        with pytest.raises(UserError, match="did not answer"):
            prefetch.take(1, 1)
    finally:
        prefetch.close()


def ppo_keys(**stage):
    from alignment.config.stages.ppo import Config

    return Config(kind="ppo", data={"task": "arithmetic", "n": 4}, verifiers=["arithmetic"], **stage)


def test_async_needs_the_server_and_the_correction_beyond_zero():
    assert ppo_keys(**{"async": {"max_staleness": 0}}).async_.max_staleness == 0  # synchronous: anything goes
    with pytest.raises(ValidationError, match="set rollout.server"):
        ppo_keys(**{"async": {"max_staleness": 1}, "importance_sampling": {}})
    with pytest.raises(ValidationError, match="without importance_sampling"):
        ppo_keys(**{"async": {"max_staleness": 1}, "rollout": {"server": "local"}})
    keys = ppo_keys(**{"async": {"max_staleness": 2}, "rollout": {"server": "local"}, "importance_sampling": {}})
    assert keys.async_.max_staleness == 2
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        ppo_keys(**{"async": {"max_staleness": -1}})


def test_async_zero_is_todays_loop_bit_for_bit(tmp_path, tiny_model):
    import json

    import torch
    from helpers import tiny_ppo_recipe, trainable_digest

    from alignment.config.recipe import load_recipe
    from alignment.run.runner import run_recipe
    from alignment.stages.ppo import TIMING_KEYS

    runs = {}
    for name, stage in (("plain", {}), ("async0", {"async": {"max_staleness": 0}})):
        run_recipe(load_recipe(tiny_ppo_recipe(tmp_path / name, tiny_model, **stage)))
        out = tmp_path / name / "out" / "ppo"
        history = json.loads((out / "log_history.json").read_text())
        runs[name] = (
            [{k: v for k, v in e.items() if k not in TIMING_KEYS} for e in history],
            trainable_digest(out / "model.safetensors"),
        )
    (plain, plain_weights), (async0, async0_weights) = runs["plain"], runs["async0"]
    assert async0 == plain and "policy_lag" not in async0[-1]
    assert all(torch.equal(async0_weights[k], plain_weights[k]) for k in plain_weights)
    recorded = json.loads((tmp_path / "async0" / "out" / "ppo" / "stage.json").read_text())["config"]
    assert recorded["async"] == {"max_staleness": 0} and "async_" not in recorded  # the recipe's key names


# --------------------------------------------------------------------------------------------------
# rlvr's rollout: {server: ...}
# --------------------------------------------------------------------------------------------------


def rlvr_keys(**stage):
    from alignment.config.stages.rlvr import Config

    return Config(kind="rlvr", data={"task": "arithmetic", "n": 4}, verifiers=["arithmetic"], **stage)


def test_rlvr_server_takes_plain_turns_and_lets_the_correction_apply():
    keys = rlvr_keys(rollout={"server": "local"}, importance_sampling={"level": "sequence"})
    assert keys.rollout.server == "local" and keys.importance_sampling.level == "sequence"
    with pytest.raises(ValidationError, match="neither `local` nor a URL"):
        rlvr_keys(rollout={"server": "ftp://x"})
    with pytest.raises(ValidationError, match="multi-turn rollouts of tools"):
        rlvr_keys(rollout={"server": "local"}, tools=["calculator"])
    with pytest.raises(ValidationError, match="two vLLM samplers"):
        rlvr_keys(rollout={"server": "local"}, train={"use_vllm": True})


def test_rlvr_sampler_asks_for_each_group_in_one_request():
    """TRL hands the rollout_func each prompt num_generations times in a row: one prompt with n = group size goes
    to the server (which seeds a request's prompts alike), and every completion comes back beside its prompt ids."""
    from types import SimpleNamespace

    from alignment.sampling.samples import Sample
    from alignment.stages.rlvr import ServerSampler

    asked = {}

    def draw(model, tokenizer, ids, settings, progress, prompts_of):
        asked.update(ids=ids, n=settings.n, temperature=settings.temperature)
        return [
            Sample(i // settings.n, "", [7, i], True, None, [-0.5, -0.25]) for i in range(len(ids) * settings.n)
        ], {}

    tokenizer = lambda text: {"input_ids": [ord(c) for c in text]}  # noqa: E731
    sampler = ServerSampler(None, tokenizer, VllmSpec())
    sampler.rollouts = SimpleNamespace(draw=draw)
    args = SimpleNamespace(max_completion_length=8, temperature=0.7, top_p=1.0, top_k=None)
    trainer = SimpleNamespace(args=args, accelerator=SimpleNamespace(unwrap_model=lambda m: m), model=None)
    out = sampler(["ab", "ab", "ab", "cd", "cd", "cd"], trainer)
    assert asked == {"ids": [[97, 98], [99, 100]], "n": 3, "temperature": 0.7}
    assert out["prompt_ids"] == [[97, 98]] * 3 + [[99, 100]] * 3
    assert out["completion_ids"][4] == [7, 4] and out["logprobs"][0] == [-0.5, -0.25]


def test_rsft_server_is_local_only_and_takes_plain_turns():
    from alignment.config.stages.rsft import Config

    def rsft(**stage):
        return Config(kind="rsft", data={"task": "arithmetic", "n": 4}, verifiers=["arithmetic"], **stage)

    assert rsft(sampling={"server": "local"}).sampling.server == "local"
    with pytest.raises(ValidationError, match="local"):
        rsft(sampling={"server": "http://127.0.0.1:8000"})  # a user's server cannot load each round's policy
    with pytest.raises(ValidationError, match="multi-turn rollouts of tools"):
        rsft(sampling={"server": "local"}, tools=["calculator"])
    whole = VllmSpec(server_python=sys.executable)
    server.check_settings("local", whole, None, 1, "stages.rsft.sampling", adapters=False)  # whole weights: fine
