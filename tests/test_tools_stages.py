"""Tools in the stages: `tools:`/`environment:`/`max_turns` on rlvr through TRL's rollout_func (our multi-turn
rollout, tool tokens masked), what `align check` refuses, and the shipped tools recipe."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import SMALLEST_MODEL, recipe_dict, write_recipe

from alignment.tasks import tool_arithmetic
from alignment.tools.formats import Call, ToolFormat

TRAIN = {
    "max_steps": 2,
    "num_generations": 4,
    "per_device_train_batch_size": 8,
    "max_completion_length": 48,
    "logging_steps": 1,
    "learning_rate": 1.0e-4,
}


def recipe(tmp_path: Path, **stage) -> dict:
    return {
        "name": "tools-test",
        "model": SMALLEST_MODEL,
        "output_dir": str(tmp_path / "out"),
        "seed": 1,
        "stages": {
            "rlvr": {
                "data": {"task": "arithmetic", "split": "train", "n": 32},
                "verifiers": ["arithmetic"],
                "tools": ["calculator"],
                "tool_format": "hermes",
                "max_turns": 3,
                "max_tool_output_tokens": 16,
                "train": TRAIN,
                **stage,
            }
        },
    }


def test_rlvr_trains_on_multi_turn_rollouts_with_tool_results(tmp_path, monkeypatch):
    """The random tiny model writes no calls; every closed turn is read as a calculator call, so the rollouts
    that end their turns run several turns with tool results between them, through GRPO's update."""
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import run_recipe

    monkeypatch.setattr(ToolFormat, "parse", lambda self, text: ([Call("calculator", {"expression": "2*3"})], []))
    loaded = load_recipe(write_recipe(tmp_path, recipe(tmp_path)))
    metrics = run_recipe(loaded)["rlvr"]
    metrics = metrics.get("metrics", metrics)
    assert metrics["tools/rollouts"] == 16  # 2 steps x 8 completions
    assert metrics["tools/turns"] >= metrics["tools/rollouts"]
    saved = json.loads((loaded.stage_dir("rlvr") / "tools.json").read_text())
    assert saved["tool_format"] == "hermes" and saved["tools"][0]["function"]["name"] == "calculator"
    history = json.loads((loaded.stage_dir("rlvr") / "log_history.json").read_text())
    assert any("tools/call_rate" in entry for entry in history)


@pytest.mark.parametrize(
    "stage, message",
    [
        ({"tools": ["nonesuch"]}, "stages.rlvr.tools.0: Unknown tool 'nonesuch'"),
        ({"tool_format": None}, "tool_format"),
        ({"algorithm": "rloo"}, "tools need algorithm: grpo"),
        ({"environment": "nowhere:Env"}, "stages.rlvr.environment"),
        ({"tools": [], "max_turns": 3, "tool_format": None, "max_tool_output_tokens": 16}, "only apply with `tools:`"),
    ],
)
def test_align_check_validates_the_tool_keys(tmp_path, stage, message):
    """What `align check` runs (load_recipe + check_recipe), in process."""
    from alignment.config.recipe import load_recipe
    from alignment.errors import UserError
    from alignment.run.runner import check_recipe

    with pytest.raises(UserError) as error:
        check_recipe(load_recipe(write_recipe(tmp_path, recipe(tmp_path, **stage))))
    assert message in str(error.value)


def test_ppo_refuses_tools_and_names_the_stages_that_run_them(tmp_path):
    from alignment.config.recipe import load_recipe
    from alignment.errors import UserError

    stage = {
        "verifiers": ["arithmetic"],
        "data": {"task": "arithmetic", "n": 8},
        "tools": ["calculator"],
        "max_turns": 2,
    }
    with pytest.raises(UserError, match=r"'stages.ppo': ppo does not take max_turns, tools: .* rlvr .* rsft"):
        load_recipe(write_recipe(tmp_path, recipe_dict(tmp_path, "ppo", stage)))


def test_partitioned_engines_are_refused_before_loading(monkeypatch):
    from alignment.config.stages.rlvr import Config
    from alignment.errors import UserError
    from alignment.training import tool_rollouts

    monkeypatch.setattr(tool_rollouts, "launched_engine", lambda: "zero3")
    config = Config(data={"task": "arithmetic"}, verifiers=["arithmetic"], tools=["calculator"])
    with pytest.raises(UserError, match="do not run under zero3"):
        tool_rollouts.check_engine(config, "stages.rlvr")


def test_trls_vllm_engine_is_refused_with_tools_and_the_vllm_backend_named_where_it_runs():
    from alignment.config.stages.rlvr import Config
    from alignment.errors import UserError
    from alignment.training import tool_rollouts

    config = Config(
        data={"task": "arithmetic"}, verifiers=["arithmetic"], tools=["calculator"], train={"use_vllm": True}
    )
    with pytest.raises(
        UserError,
        match=r"(?s)stages.rlvr.train.use_vllm: .*never sample.*use_vllm: false.*rsft and "
        r"evaluation suites, with `sampling: \{backend: vllm\}`",
    ):
        tool_rollouts.check_engine(config, "stages.rlvr")


def test_smollm2_tools_recipe_passes_align_check_on_a_stand_in_model(tmp_path, tiny_model):
    """recipes/smollm2-135m/tools.yaml on the tiny model (the real model is the slow suite's): data, verifiers,
    tools, tool format, TRL configs and the evaluate block."""
    from conftest import REPO, run_cli_here

    recipe = REPO / "recipes" / "smollm2-135m" / "tools.yaml"
    result = run_cli_here("check", recipe, f"model={tiny_model}", f"output_dir={tmp_path / 'out'}")
    assert result.returncode == 0, result.stderr[-2000:]


def test_an_evaluation_suite_with_tools_reports_tool_use_and_whole_trajectories(tmp_path, tiny_model, monkeypatch):
    """Every closed turn read as a call (the random tiny model writes none): pass@1 on the final answers, the tool
    metrics, and each sample's whole trajectory in samples.jsonl."""
    from alignment.config.evaluate import SuiteSpec
    from alignment.evaluation.evaluate import evaluate_checkpoints

    monkeypatch.setattr(ToolFormat, "parse", lambda self, text: ([Call("calculator", {"expression": "2*3"})], []))
    suite = SuiteSpec(
        name="products",
        data={"task": "tool_arithmetic", "split": "test", "n": 6},
        verifier="arithmetic",
        tools=["calculator"],
        tool_format="hermes",
        describe_tools=False,
        max_turns=2,
        sampling={"temperature": 1.0, "max_new_tokens": 60},
    )
    metrics = evaluate_checkpoints({"tiny": str(tiny_model)}, [suite], tmp_path / "eval")["tiny"]
    assert {
        "products/pass@1",
        "products/tool_call_rate",
        "products/tool_errors",
        "products/parse_failures",
        "products/turns",
        "products/truncated_tool_outputs",
    } <= set(metrics)
    assert 1 <= metrics["products/turns"] <= 2
    lines = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(line["trajectory"]["messages"][0]["role"] == "assistant" for line in lines)
    assert all(
        line["completion"] == [t for t in line["trajectory"]["messages"] if t["role"] == "assistant"][-1]["content"]
        for line in lines
    )


def test_pass_k_with_tools_samples_n_whole_rollouts_per_prompt(tmp_path, tiny_model, monkeypatch):
    """pass@k on tool suites: n rollouts of each of the first `limit` prompts, each a whole trajectory in
    samples.jsonl; the scripted policy calls the calculator and answers with its result, so every rollout passes
    on the products the calculator was given, and pass@k is computed from those verdicts."""
    from alignment.config.evaluate import SuiteSpec
    from alignment.evaluation.evaluate import evaluate_checkpoints
    from alignment.models.tokenizer import load_tokenizer
    from alignment.tools import rollout as rollout_module

    monkeypatch.setattr(rollout_module, "generate_ids", scripted_calculator_user(load_tokenizer(str(tiny_model))))
    suite = SuiteSpec(
        name="products",
        data={"task": "tool_arithmetic", "split": "test", "n": 5},
        verifier="arithmetic",
        tools=["calculator"],
        tool_format="hermes",
        describe_tools=False,
        max_turns=2,
        sampling={"temperature": 0, "max_new_tokens": 200},
        pass_k={"n": 3, "k": [1, 3], "limit": 4},
    )
    metrics = evaluate_checkpoints({"tiny": str(tiny_model)}, [suite], tmp_path / "eval")["tiny"]
    lines = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    sampled = [line for line in lines if line["mode"] == "pass_k"]
    assert [line["prompt_index"] for line in sampled] == [i for i in range(4) for _ in range(3)]
    assert all(line["trajectory"]["tool_calls"] == 1 for line in sampled)
    assert metrics["products/pass@1"] == 1.0
    assert metrics["products/pass@1_sampled"] == 1.0 and metrics["products/pass@3"] == 1.0


def scripted_calculator_user(tokenizer):
    """A stand-in for sampling.generate_ids: on a product prompt it calls the calculator, then answers with the
    last tool result (log-prob 0 per token); the turns are the model's, the results the rollout's."""
    from alignment.data.formatting import encode
    from alignment.sampling import Sample

    eot = tokenizer.convert_tokens_to_ids("<|end|>")

    def generate_ids(model, tokenizer_, prompt_ids, settings, progress=None, logprobs=False):
        out = []
        for i, ids in enumerate(prompt_ids):
            text = tokenizer.decode(ids)
            if "<tool_response>" in text:
                reply = re.findall(r"<tool_response>\s*(-?\d+)", text)[-1]
            else:
                reply = tool_arithmetic.call_text(re.findall(r"\d+\*\d+", text)[-1])
            turn = encode(tokenizer, reply) + [eot]
            out.append(Sample(i, "", turn, finished=True, logprobs=[0.0] * len(turn)))
        return out

    return generate_ids


def test_rsft_selects_whole_trajectories_and_trains_with_tool_results_masked(tmp_path, monkeypatch):
    from alignment.config.recipe import load_recipe
    from alignment.models.tiny import build_tokenizer
    from alignment.run.runner import run_recipe
    from alignment.tools import rollout as rollout_module

    monkeypatch.setattr(rollout_module, "generate_ids", scripted_calculator_user(build_tokenizer()))
    stage = {
        "kind": "rsft",
        "data": {"task": "tool_arithmetic", "split": "train", "n": 8},
        "verifiers": ["arithmetic"],
        "tools": ["calculator"],
        "tool_format": "hermes",
        "describe_tools": False,
        "max_turns": 2,
        "sampling": {"n": 2, "max_new_tokens": 200},
        "train": {"max_steps": 2, "per_device_train_batch_size": 4, "max_length": 256},
    }
    loaded = load_recipe(
        write_recipe(
            tmp_path,
            {
                "name": "rsft-tools",
                "model": SMALLEST_MODEL,
                "output_dir": str(tmp_path / "out"),
                "seed": 1,
                "stages": {"rsft": stage},
            },
        )
    )
    metrics = run_recipe(loaded)["rsft"]
    metrics = metrics.get("metrics", metrics)
    assert metrics["round1/selected"] == 8 and metrics["round1/pass_rate"] == 1.0
    assert metrics["round1/tool_call_rate"] == 1.0 and metrics["round1/tool_errors"] == 0
    assert json.loads((loaded.stage_dir("rsft") / "tools.json").read_text())["tool_format"] == "hermes"
    rows = [json.loads(line) for line in (loaded.stage_dir("rsft") / "selected_round1.jsonl").read_text().splitlines()]
    tokenizer = build_tokenizer()
    for row in rows:
        mask, ids = row["completion_mask"], row["input_ids"]
        sampled = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        # (the tiny model's reloaded tokenizer drops whitespace, so compare without it)
        expected = (
            tool_arithmetic.call_text(re.findall(r"\d+\*\d+", row["prompt"])[-1])
            + "<|end|>"
            + row["completion"]
            + "<|end|>"
        )
        assert re.sub(r"\s", "", sampled) == re.sub(r"\s", "", expected)
        assert "<tool_response>" in tokenizer.decode(ids) and "<tool_response>" not in sampled
        assert row["trajectory"]["tool_calls"] == 1 and row["trajectory"]["stop_reason"] == "answer"


def test_the_tasks_demonstrations_are_written_as_the_rollout_writes_calls_and_results():
    """tool_arithmetic's SFT rows, rendered by the chat template, are what the rollout builds: prompt, the call,
    end of turn, then the tool result turn rendered on its own."""
    from alignment.config.tasks import ToolArithmeticParams
    from alignment.models.tiny import build_tokenizer

    fmt = ToolFormat("hermes", native=False)
    assert tool_arithmetic.call_text("12*3") == fmt.call_text([Call("calculator", {"expression": "12*3"})])
    rows = tool_arithmetic.build(ToolArithmeticParams(n=50, demonstrations=True, call_fraction=1.0), "train", 0)
    tokenizer = build_tokenizer()
    messages = rows[1]["prompt"]
    prompt = fmt.render_prompt(tokenizer, messages[:1], [], describe=False)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        prompt + messages[1]["content"] + "<|end|>" + fmt.result_text(tokenizer, [("calculator", rows[1]["answer"])])
    )
    assert [len(r["prompt"]) for r in rows[:2]] == [1, 3]  # the call, then the answer after its result
    assert rows[0]["completion"] == [messages[1]] and rows[1]["completion"][0]["content"] == rows[1]["answer"]


@pytest.mark.parametrize("call_fraction", [0.0, 0.33, 1.0])
def test_call_fraction_is_the_share_of_trained_first_turns_that_call(call_fraction):
    """SFT trains every assistant turn of a conversation, so a demonstration of the answer after a result must
    not also train its call: the first turns SFT is trained on call in `call_fraction` of the problems, and the
    answer after a result is trained for every problem."""
    from alignment.config.tasks import ToolArithmeticParams
    from alignment.data.formatting import render_example
    from alignment.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    rows = tool_arithmetic.build(
        ToolArithmeticParams(n=300, demonstrations=True, call_fraction=call_fraction), "train", 0
    )
    trained = []  # the text of every turn SFT trains on
    for row in rows:
        for rendered in render_example(tokenizer, row)[0]:
            trained += (
                [t for t, on in rendered["segments"] if on] if "segments" in rendered else [rendered["completion"]]
            )
    calls = sum("<tool_call>" in t for t in trained)
    assert len(trained) == 600  # per problem: the first turn, and the answer after the result
    assert abs(calls / 300 - call_fraction) < 0.08


CHECKED_CALCULATOR = '''
import re

from alignment.tools.builtins import calculator as exact


class CheckedCalculator:
    def reset(self, row):
        self.expected, self.asked = re.findall(r"\\d+\\*\\d+", str(row["prompt"]))[-1], False

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: numbers with + - * / ** and parentheses
        """
        self.asked = self.asked or expression.replace(" ", "") == self.expected
        return exact(expression)

    def reward(self):
        return float(self.asked)
'''


def test_rlvr_with_an_environment_gets_its_reward(tmp_path, monkeypatch):
    """An environment's methods are the tools and its reward() reaches GRPO as one more reward (weight 1), through
    TRL's rollout_func fields; the scripted user asks each problem's own product, so every rollout earns it."""
    from alignment.config.recipe import load_recipe
    from alignment.models.tiny import build_tokenizer
    from alignment.run.runner import run_recipe
    from alignment.tools import rollout as rollout_module

    (tmp_path / "calc_env.py").write_text(CHECKED_CALCULATOR)
    monkeypatch.setattr(rollout_module, "generate_ids", scripted_calculator_user(build_tokenizer()))
    stage = recipe(
        tmp_path,
        tools=[],
        environment="calc_env:CheckedCalculator",
        describe_tools=False,
        data={"task": "tool_arithmetic", "split": "train", "n": 32},
        train={**TRAIN, "max_completion_length": 200},
    )
    loaded = load_recipe(write_recipe(tmp_path, stage))
    metrics = run_recipe(loaded)["rlvr"]
    metrics = metrics.get("metrics", metrics)
    history = json.loads((loaded.stage_dir("rlvr") / "log_history.json").read_text())
    rewards = [h["rewards/environment_reward/mean"] for h in history if "rewards/environment_reward/mean" in h]
    assert rewards and all(r == 1.0 for r in rewards)
    assert metrics["tools/call_rate"] == 1.0 and metrics["tools/tool_errors"] == 0
