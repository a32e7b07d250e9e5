"""OpenEnv environments in rollouts (`environment: {openenv: ...}`, alignment/tools/openenv.py), against real
openenv-core servers on 127.0.0.1: an MCP environment written here with openenv-core's own classes, served by the
toolkit in its own process (or reached by URL); its tools, observations, rewards and `done` in scripted rollouts,
every bound of the tool rollout (timeouts, unknown tools, wrong arguments, non-finite rewards, cut outputs), the
errors for a server that cannot start or ends, and short rlvr, rsft and evaluation runs on it."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from conftest import SMALLEST_MODEL, write_recipe
from test_tools import call, run_script
from test_tools_stages import TRAIN, scripted_calculator_user

from alignment.config.tools import OpenEnvironment, ToolUse
from alignment.errors import UserError
from alignment.tools import openenv
from alignment.tools import rollout as rollout_module

pytest.importorskip("openenv.core", reason="openenv-core (the tasks extra) is not installed")

CALCULATOR_ENV = '''
import asyncio
import math

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Observation, State


class Calculator(MCPEnvironment):
    """Multiplies. Asking for the row's own product earns 1; submit() ends the episode, 2 for the right answer."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("calculator")
        self.expected, self.reward_now, self.done_now = None, 0.0, False

        @mcp.tool()
        def calculator(expression: str) -> str:
            """Multiply two integers.

            Args:
                expression: two integers joined by *
            """
            a, b = (int(x) for x in expression.split("*"))
            self.reward_now = 1.0 if a * b == self.expected else 0.0
            return str(a * b)

        @mcp.tool()
        def submit(answer: int) -> str:
            """Submit the answer; the episode ends.

            Args:
                answer: the product
            """
            self.done_now, self.reward_now = True, 2.0 if answer == self.expected else 0.0
            return "submitted"

        @mcp.tool()
        async def nap(seconds: float) -> str:
            """Wait.

            Args:
                seconds: how long
            """
            await asyncio.sleep(seconds)
            return "awake"

        @mcp.tool()
        def broken() -> str:
            """Give a reward that is no number."""
            self.reward_now = math.nan
            return "nan"

        super().__init__(mcp)
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed=None, episode_id=None, answer=None, **row):
        self.expected, self.done_now = (int(answer) if answer is not None else None), False
        return Observation(done=False, reward=None)

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Observation(done=False, reward=0.0)

    async def step_async(self, action, timeout_s=None, **kwargs):
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        observation.reward, observation.done, self.reward_now = self.reward_now, self.done_now, 0.0
        return observation

    @property
    def state(self):
        return self._state


class Lonely(Calculator):
    SUPPORTS_CONCURRENT_SESSIONS = False
'''

FAILING_APP = """
from contextlib import asynccontextmanager

from fastapi import FastAPI


@asynccontextmanager
async def lifespan(app):
    raise RuntimeError("the database is not there")
    yield


app = FastAPI(lifespan=lifespan)
"""

APP = {"openenv": {"app": "calc_env:Calculator", "max_sessions": 64}}


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("openenv")
    (folder / "calc_env.py").write_text(CALCULATOR_ENV)
    (folder / "failing_app.py").write_text(FAILING_APP)
    return folder


@pytest.fixture(scope="module")
def served(env_dir):
    """The Calculator served once for the module's rollout tests (a real uvicorn process), stopped after them."""
    with openenv.serving(env_dir / "logs") as scope:
        openenv.connect(OpenEnvironment(**APP).openenv, [env_dir], "test")
        yield scope
    assert not scope.servers  # stopped and forgotten when the block ended


def rollout_on(monkeypatch, env_dir, scripts, rows, environment=APP, **limits):
    return run_script(
        monkeypatch,
        scripts,
        tools=[],
        environment=OpenEnvironment(**environment),
        search_dirs=[env_dir],
        rows=rows,
        max_new_tokens=2000,
        **{"max_completion_length": 2000, **limits},
    )[2]


def test_the_served_environments_tools_observations_and_rewards_reach_the_rollout(monkeypatch, env_dir, served):
    scripts = {
        "a": [call("calculator", expression="2*3"), "6"],
        "b": [call("submit", answer=5), "never sampled"],
        "c": [call("calculator", expression="2*4"), call("submit", answer=8)],
        "d": ["6"],
    }
    t = rollout_on(monkeypatch, env_dir, scripts, [{"answer": "6"}, {"answer": "6"}, {"answer": "8"}, {}])
    assert [m["content"] for m in t["a"].turns if m["role"] == "tool"] == ["6"]
    assert t["a"].reward == 1.0 and t["a"].stop_reason == "answer" and t["a"].answer == "6"
    assert t["b"].reward == 0.0 and t["b"].stop_reason == "done"  # the environment ended the episode
    assert t["c"].reward == 3.0 and t["c"].stop_reason == "done"  # the sum of its observations' rewards
    assert t["a"].environment is not t["c"].environment  # one session per rollout
    assert t["d"].reward == 0.0 and t["d"].environment.client is None  # no call, no session opened
    assert all(x.counts["tool_errors"] == 0 and x.counts["reward_errors"] == 0 for x in t.values())
    assert t["c"].record()["environment_reward"] == 3.0


def test_its_mcp_tools_are_the_models_tool_schemas(env_dir, served):
    from alignment.tools.registry import resolve_tools

    box = resolve_tools([], OpenEnvironment(**APP), [env_dir], "stages.rlvr")
    names = [s["function"]["name"] for s in box.schemas]
    assert names == ["calculator", "submit", "nap", "broken"]
    calculator = box.schemas[0]["function"]
    assert calculator["description"].startswith("Multiply two integers")
    assert calculator["parameters"]["properties"]["expression"]["type"] == "string"
    assert calculator["parameters"]["required"] == ["expression"]
    assert callable(box.environment.reward)  # the stage adds the environment's reward (weight 1)


def test_every_bound_of_the_tool_rollout_holds_for_its_calls(monkeypatch, env_dir, served):
    """Unknown tools and wrong arguments never reach the server; a call that hangs is cut at the tool timeout and
    its session takes no more calls, its reward refused; a non-finite reward is refused; long results are cut."""
    scripts = {
        "hang": [call("nap", seconds=60), call("calculator", expression="2*3"), "6"],
        "bad": [call("nope"), call("calculator", expr="2*3"), call("calculator", expression="2*3"), "6"],
        "nan": [call("broken"), call("calculator", expression="2*3"), "6"],
    }
    t = rollout_on(monkeypatch, env_dir, scripts, [{"answer": "6"}] * 3, tool_timeout=0.5)
    hang = [m["content"] for m in t["hang"].turns if m["role"] == "tool"]
    assert "did not finish within 0.5 s" in hang[0] and "takes no calls" in hang[1]
    assert t["hang"].counts["tool_errors"] == 2 and t["hang"].counts["reward_errors"] == 1 and t["hang"].reward == 0.0
    bad = [m["content"] for m in t["bad"].turns if m["role"] == "tool"]
    assert "unknown tool 'nope'" in bad[0] and "wrong arguments for 'calculator'" in bad[1] and bad[2] == "6"
    assert t["bad"].counts["tool_errors"] == 2 and t["bad"].reward == 1.0
    assert "no finite number" in [m["content"] for m in t["nan"].turns if m["role"] == "tool"][0]
    assert t["nan"].counts["tool_errors"] == 1 and t["nan"].counts["reward_errors"] == 1 and t["nan"].reward == 0.0
    scripts = {"long": [call("calculator", expression="123456789*987654321"), "x"]}
    t = rollout_on(monkeypatch, env_dir, scripts, [{}], max_tool_output_tokens=3)
    assert t["long"].counts["truncated_tool_outputs"] == 1 and "more tokens cut" in t["long"].turns[1]["content"]


def test_a_running_server_is_reached_by_its_url(monkeypatch, env_dir, served):
    url = served.servers[0].url
    scripts = {"a": [call("calculator", expression="2*3"), "6"]}
    t = rollout_on(monkeypatch, env_dir, scripts, [{"answer": "6"}], environment={"openenv": {"url": url}})
    assert t["a"].reward == 1.0 and t["a"].counts["tool_errors"] == 0
    assert t["a"].environment.connection.server is None  # nothing served: the toolkit only connects


def test_no_server_at_the_url_is_an_error_naming_it(env_dir):
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with openenv.serving(None), pytest.raises(UserError, match=rf"stages.rlvr.environment: .*127.0.0.1:{port}"):
        openenv.connect(OpenEnvironment(openenv={"url": f"http://127.0.0.1:{port}"}).openenv, [], "stages.rlvr")


@pytest.mark.parametrize(
    "environment, message",
    [
        ({"openenv": {"url": "ftp://x"}}, r"'environment.openenv.url': 'ftp://x' is not an http"),
        ({"openenv": {}}, r"give exactly one of `url:`"),
        ({"openenv": {"url": "http://h:1", "max_sessions": 2}}, r"max_sessions only apply with `app:`"),
        ({"openenv": {"app": "calc_env"}}, r"not of the form module:Class"),
        ({"openenv": {"urll": "http://h:1"}}, r"unknown key 'environment.openenv.urll' \(did you mean 'url'\?\)"),
        (3, r"expected module:Class or \{openenv"),
    ],
)
def test_the_config_refuses_malformed_openenv_settings(environment, message):
    from pydantic import ValidationError

    from alignment.config.base import explain

    with pytest.raises(ValidationError) as error:
        ToolUse(environment=environment)
    assert re.search(message, explain(error.value, ToolUse))


@pytest.mark.parametrize(
    "app, message",
    [
        ("calc_envv:Calculator", r"cannot import module 'calc_envv'"),
        ("calc_env:Calculater", r"has no function 'Calculater'. Did you mean 'Calculator'"),
        ("calc_env:FastMCP", r"neither an OpenEnv environment class"),
        ("calc_env:Lonely", r"SUPPORTS_CONCURRENT_SESSIONS"),
    ],
)
def test_an_app_that_cannot_be_served_is_refused_before_a_server_starts(env_dir, app, message):
    spec = OpenEnvironment(openenv={"app": app}).openenv
    with pytest.raises(UserError, match=rf"stages.rlvr.environment.openenv.app: .*{message}"):
        openenv.load_app(spec, [env_dir], "stages.rlvr")


def test_a_server_that_fails_to_start_is_an_error_naming_its_log(env_dir, tmp_path):
    spec = OpenEnvironment(openenv={"app": "failing_app:app"}).openenv
    with openenv.serving(tmp_path) as scope:
        with pytest.raises(UserError, match=r"failed: it ended \(exit code \d+\) before it answered") as error:
            openenv.connect(spec, [env_dir], "stages.rlvr")
        assert not any(server.running for server in scope.servers)
    log = tmp_path / "openenv-app.log"
    assert f"Its log: {log}" in str(error.value) and "the database is not there" in log.read_text()


def test_a_full_server_and_one_that_ends_during_the_stage_are_errors(env_dir, tmp_path):
    """A session past the served environment's `max_sessions` is an error naming the key; a server that ended is
    an error naming its log."""
    from alignment.tools.registry import resolve_tools

    with openenv.serving(tmp_path) as scope:
        box = resolve_tools([], OpenEnvironment(openenv={"app": "calc_env:Lonely", "max_sessions": 1}), [env_dir], "s")
        first, second = (box.bind(box.new_environment({})[0])["calculator"] for _ in range(2))
        assert first.call({"expression": "2*3"}, 5.0) == (True, "6")
        with pytest.raises(UserError, match=r"s.environment: .* refused a session .* raise `max_sessions`"):
            second.call({"expression": "2*3"}, 5.0)
        server = scope.servers[0]
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
        session, _ = box.new_environment({"answer": "6"})
        with pytest.raises(UserError, match=r"its process ended .* while the stage used it\. Its log: .*openenv-"):
            box.bind(session)["calculator"].call({"expression": "2*3"}, 5.0)
    assert server.log.parent == tmp_path and not scope.servers


# --- the stages and an evaluation suite on a served environment --------------------------------------------------
def stage_recipe(tmp_path: Path, env_dir: Path, stage: dict) -> Path:
    (tmp_path / "calc_env.py").write_text((env_dir / "calc_env.py").read_text())
    recipe = {
        "name": "openenv-test",
        "model": SMALLEST_MODEL,
        "output_dir": str(tmp_path / "out"),
        "seed": 1,
        "stages": {"s": stage},
    }
    return write_recipe(tmp_path, recipe)


RLVR = {
    "kind": "rlvr",
    "data": {"task": "tool_arithmetic", "split": "train", "n": 16},
    "verifiers": ["arithmetic"],
    "environment": {"openenv": {"app": "calc_env:Calculator"}},
    "tool_format": "hermes",
    "describe_tools": False,
    "max_turns": 2,
    "train": {**TRAIN, "max_steps": 1, "max_completion_length": 200},
}


@pytest.mark.parametrize(
    "environment, message",
    [
        ({"openenv": {"url": "http//127.0.0.1:8000"}}, r"'stages.s.environment.openenv.url': 'http//127.0.0.1:8000'"),
        ({"openenv": {"app": "calc_env:Calculater"}}, r"stages.s.environment.openenv.app: .*Did you mean 'Calculator'"),
    ],
)
def test_align_check_refuses_a_bad_address_or_app(tmp_path, env_dir, environment, message):
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import check_recipe

    with pytest.raises(UserError, match=message):
        check_recipe(load_recipe(stage_recipe(tmp_path, env_dir, {**RLVR, "environment": environment})))


def test_rlvr_trains_on_the_served_environment_and_gets_its_reward(tmp_path, env_dir, monkeypatch):
    from alignment.config.recipe import load_recipe
    from alignment.models.tiny import build_tokenizer
    from alignment.run.runner import run_recipe

    monkeypatch.setattr(rollout_module, "generate_ids", scripted_calculator_user(build_tokenizer()))
    started, start = [], openenv.Server.start
    monkeypatch.setattr(openenv.Server, "start", lambda *a, **k: started.append(start(*a, **k)) or started[-1])
    loaded = load_recipe(stage_recipe(tmp_path, env_dir, RLVR))
    metrics = run_recipe(loaded)["s"]
    metrics = metrics.get("metrics", metrics)
    history = json.loads((loaded.stage_dir("s") / "log_history.json").read_text())
    rewards = [h["rewards/environment_reward/mean"] for h in history if "rewards/environment_reward/mean" in h]
    assert rewards and all(r == 1.0 for r in rewards)
    assert metrics["tools/call_rate"] == 1.0 and metrics["tools/tool_errors"] == 0
    assert (loaded.stage_dir("s") / "openenv-Calculator.log").exists()  # its log, beside the checkpoint
    assert len(started) == 1 and not started[0].running  # served for the stage, stopped when it ended


@pytest.mark.slow
def test_rsft_and_an_evaluation_suite_run_on_the_served_environment(tmp_path, env_dir, tiny_model, monkeypatch):
    from alignment.config.evaluate import SuiteSpec
    from alignment.config.recipe import load_recipe
    from alignment.evaluation.evaluate import evaluate_checkpoints
    from alignment.models.tiny import build_tokenizer
    from alignment.run.runner import check_recipe, run_recipe

    monkeypatch.setattr(rollout_module, "generate_ids", scripted_calculator_user(build_tokenizer()))
    tools = {"environment": {"openenv": {"app": "calc_env:Calculator"}}, "tool_format": "hermes"}
    stage = {
        "kind": "rsft",
        "data": {"task": "tool_arithmetic", "split": "train", "n": 4},
        "verifiers": ["arithmetic"],
        **tools,
        "describe_tools": False,
        "max_turns": 2,
        "sampling": {"n": 2, "max_new_tokens": 200},
        "train": {"max_steps": 1, "per_device_train_batch_size": 4, "max_length": 256},
    }
    loaded = load_recipe(stage_recipe(tmp_path, env_dir, stage))
    check_recipe(loaded)  # align check serves the environment, lists its tools and stops it
    metrics = run_recipe(loaded)["s"]
    metrics = metrics.get("metrics", metrics)
    assert metrics["round1/pass_rate"] == 1.0 and metrics["round1/tool_call_rate"] == 1.0
    assert metrics["round1/tool_errors"] == 0

    suite = SuiteSpec(
        name="products",
        data={"task": "tool_arithmetic", "split": "test", "n": 3},
        verifier="arithmetic",
        **tools,
        describe_tools=False,
        max_turns=2,
        sampling={"temperature": 0, "max_new_tokens": 200},
    )
    scores = evaluate_checkpoints({"tiny": str(tiny_model)}, [suite], tmp_path / "eval")["tiny"]
    assert scores["products/pass@1"] == 1.0 and scores["products/tool_call_rate"] == 1.0
    assert scores["products/tool_errors"] == 0 and scores["products/reward_errors"] == 0
    lines = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert all(line["trajectory"]["environment_reward"] == 1.0 for line in lines)
    assert (tmp_path / "eval" / "openenv-Calculator.log").exists()
