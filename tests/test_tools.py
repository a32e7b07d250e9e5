"""alignment/tools: the built-in tools, resolving `tools:`/`environment:`, tool-call formats on real templates, and the
multi-turn rollout (every failure mode counted, masks exact, the sampler's log-probs equal the policy's)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trl
from chat_templates import family_tokenizer
from helpers import assert_token_in_token_out, calculator_rollout, quick_stopping

from alignment.config.sampling import SamplingSpec
from alignment.config.tools import ToolSpec, ToolUse
from alignment.data.formatting import encode
from alignment.errors import UserError
from alignment.models.loading import load_policy
from alignment.models.tokenizer import load_tokenizer
from alignment.sampling import Sample
from alignment.tools import rollout as rollout_module
from alignment.tools.builtins import calculator
from alignment.tools.formats import Call, ToolFormat, native_style
from alignment.tools.registry import resolve_tools
from alignment.tools.rollout import COUNTS, RolloutLimits, rollout, start

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"  # the checkpoints' own templates, as TRL ships them
CALC = [ToolSpec(name="calculator")]


def real_template(family: str, template: str):
    tokenizer = family_tokenizer(family)
    tokenizer.chat_template = (TRL_TEMPLATES / f"{template}.jinja").read_text()
    return tokenizer


# --- calculator ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "expression, value",
    [
        ("2+3*4", "14"),
        ("(123 * 45) / 7", "5535/7"),
        ("1/4", "0.25"),
        ("2**10", "1024"),
        ("-3 - -2", "-1"),
        ("0.1 + 0.2", "0.3"),
        ("2**-2", "0.25"),
        ("((7))", "7"),
        ("123*45", "5535"),
        ("10/4", "2.5"),
    ],
)
def test_calculator_is_exact(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "10**100000",
        "9**9**9",
        "1/0",
        "a+b",
        "2**0.5",
        "1" * 300,
        "[1]*3",
        "(lambda: 1)()",
        "2 if 1 else 3",
        "0**-1",
        "1 < 2",
        "",
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression):
    with pytest.raises((ValueError, ZeroDivisionError)):
        calculator(expression)


# --- resolving tools and environments ---------------------------------------------------------------------------
USER_TOOLS = '''
def lookup(key: str, table: str = "default") -> str:
    """Look a key up.

    Args:
        key: what to look up
        table: which table
    """
    return f"{table}:{key}"

def undocumented(x):
    return x

class Shop:
    def reset(self, row):
        self.stock = row["stock"]
        return " (the shop is open)"

    def buy(self, item: str) -> str:
        """Buy one item.

        Args:
            item: the item's name
        """
        self.stock -= 1
        return "bought"

    def reward(self):
        return float(self.stock == 0)

class NoReset:
    def buy(self, item: str) -> str:
        """Buy.

        Args:
            item: the item
        """
'''


@pytest.fixture
def user_dir(tmp_path):
    (tmp_path / "my_tools.py").write_text(USER_TOOLS)
    return tmp_path


def test_user_tools_and_environments_resolve_with_their_schemas(user_dir):
    box = resolve_tools(
        [ToolSpec(name="calculator"), ToolSpec(name="my_tools:lookup", options={"table": "t"})],
        "my_tools:Shop",
        [user_dir],
    )
    names = [s["function"]["name"] for s in box.schemas]
    assert names == ["calculator", "lookup", "buy"]
    assert "table" not in box.schemas[1]["function"]["parameters"]["properties"]  # bound from the recipe: hidden
    env, note = box.new_environment({"stock": 1})
    tools = box.bind(env)
    assert note == " (the shop is open)" and tools["lookup"](key="k") == "t:k"
    assert tools["buy"](item="x") == "bought" and env.reward() == 1.0


@pytest.mark.parametrize(
    "tools, environment, message",
    [
        (["nonesuch"], None, "Unknown tool 'nonesuch'"),
        (["my_tools:missing"], None, "has no function 'missing'"),
        (["my_tools:undocumented"], None, "cannot be described to the model"),
        ([{"name": "my_tools:lookup", "options": {"colour": 1}}], None, "no argument(s) 'colour'"),
        ([{"name": "python", "options": {"colour": 1}}], None, "bad `options:`"),
        (["calculator", "calculator"], None, "a second tool named 'calculator'"),
        ([], "my_tools:NoReset", "has no reset(row)"),
        ([], "nowhere:Env", "cannot import module 'nowhere'"),
    ],
)
def test_resolution_errors_are_user_errors_naming_the_key(user_dir, tools, environment, message):
    with pytest.raises(UserError, match="stages.x") as error:
        resolve_tools([ToolSpec.model_validate(t) for t in tools], environment, [user_dir], "stages.x")
    assert message in str(error.value)


def test_tool_keys_without_tools_are_refused():
    with pytest.raises(ValueError, match="max_turns only apply"):
        ToolUse(max_turns=3)
    assert ToolUse(tools=["calculator"], max_turns=3).uses_tools


# --- formats on real templates ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family, template, style",
    [
        ("qwen2.5", "qwen2_5", "hermes"),
        ("llama3", "llama3_1", "llama3_json"),
        ("llama3", "llama3_2", "llama3_json"),
    ],
)
def test_pieces_rebuild_the_templates_own_tool_conversation(family, template, style):
    """Prompt + the model's call + end of turn + the tool result turn, each rendered on its own, are exactly the
    template's rendering of the whole conversation: appending the result's ids continues what was sampled."""
    tokenizer = real_template(family, template)
    box = resolve_tools(CALC, None, [])
    fmt = ToolFormat.for_tokenizer(tokenizer, None)
    assert (fmt.style, fmt.native) == (style, True)
    call = Call("calculator", {"expression": "2*3"})
    whole = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "What is 2*3?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}}],
            },
            {"role": "tool", "name": "calculator", "content": "6"},
        ],
        tools=box.schemas,
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = fmt.render_prompt(tokenizer, "What is 2*3?", box.schemas)
    eot = "<|im_end|>" if style == "hermes" else "<|eot_id|>"
    pieces = prompt + fmt.call_text([call]) + eot + fmt.result_text(tokenizer, [("calculator", "6")])
    assert pieces == whole
    assert '"calculator"' in prompt  # the schema is in the prompt
    assert fmt.parse(fmt.call_text([call])) == ([call], [])


def test_templates_without_tools_need_a_tool_format():
    tokenizer = family_tokenizer("smollm2")
    assert native_style(tokenizer) is None
    with pytest.raises(UserError, match="tool_format"):
        ToolFormat.for_tokenizer(tokenizer, None)
    fmt = ToolFormat.for_tokenizer(tokenizer, "hermes")
    prompt = fmt.render_prompt(tokenizer, "What is 2*3?", resolve_tools(CALC, None, []).schemas)
    assert prompt.startswith("<|im_start|>system\nYou may call tools") and "<tool_call>" in prompt
    assert fmt.result_text(tokenizer, [("calculator", "6")]) == (
        "\n<|im_start|>tool\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "style, text, calls, failures",
    [
        (
            "hermes",
            'Let me.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
            [Call("f", {"a": 1})],
            0,
        ),
        (
            "hermes",
            '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"}</tool_call>',
            [Call("f", {}), Call("g", {})],
            0,
        ),
        ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>', [Call("f", {"a": 2})], 0),
        ("hermes", "<tool_call>{name: f}</tool_call>", [], 1),
        ("hermes", '<tool_call>{"name": "f"', [], 1),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>', [], 1),
        ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [], 1),
        ("hermes", "The answer is 6.", [], 0),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1}}', [Call("f", {"a": 1})], 0),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}', [Call("f", {})], 0),
        ("llama3_json", '{"name": "f", "parameters": ', [], 1),
        ("llama3_json", "It is 6.", [], 0),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', [Call("f", {"a": 1})], 0),
        ("mistral", "[TOOL_CALLS][{oops", [], 1),
        ("mistral", "Six.", [], 0),
    ],
)
def test_parse(style, text, calls, failures):
    found, reasons = ToolFormat(style, native=False).parse(text)
    assert found == calls and len(reasons) == failures


# --- the rollout, scripted -------------------------------------------------------------------------------------
def scripted_sampler(tokenizer, scripts: dict[str, list[str]]):
    """A stand-in for sampling.generate_ids: each trajectory (found by the last user message in its prompt)
    answers its next scripted turn (the key is the user message's first word), closed with the end-of-turn token,
    log-prob -1 per token."""
    eot = tokenizer.convert_tokens_to_ids("<|end|>")

    def generate_ids(model, tokenizer_, prompt_ids, settings, progress=None, logprobs=False):
        out = []
        for i, ids in enumerate(prompt_ids):
            text = tokenizer.decode(ids)
            key = text.split("<|user|>", 1)[1].split("<|end|>")[0].split(" ")[0]
            turn = encode(tokenizer, scripts[key].pop(0)) + [eot]
            turn = turn[: settings.max_new_tokens]
            out.append(Sample(i, "", turn, finished=turn[-1] == eot, logprobs=[-1.0] * len(turn)))
        return out

    return generate_ids


def script_tokenizer():
    tokenizer = family_tokenizer("smollm2")
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|end|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|system|>"]}
    )
    return tokenizer


def run_script(
    monkeypatch, scripts, tools=CALC, environment=None, search_dirs=(), rows=None, max_new_tokens=400, **limits
):
    tokenizer = script_tokenizer()
    monkeypatch.setattr(
        rollout_module, "generate_ids", scripted_sampler(tokenizer, {k: list(v) for k, v in scripts.items()})
    )
    fmt = ToolFormat("hermes", native=False)
    box = resolve_tools(tools, environment, list(search_dirs))
    trajectories = start(tokenizer, fmt, box, list(scripts), rows or [{} for _ in scripts])
    rollout(None, tokenizer, trajectories, fmt, SamplingSpec(max_new_tokens=max_new_tokens), RolloutLimits(**limits))
    return tokenizer, fmt, dict(zip(scripts, trajectories))


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_every_failure_mode_is_an_observation_and_counted(monkeypatch, user_dir):
    (user_dir / "flaky.py").write_text(
        "import time\n\n"
        'def boom(x: int) -> str:\n    """Raise.\n\n    Args:\n        x: anything\n    """\n'
        "    raise RuntimeError('kaboom')\n\n"
        'def slow(x: int) -> str:\n    """Sleep.\n\n    Args:\n        x: seconds\n    """\n'
        "    time.sleep(x)\n    return 'late'\n\n"
        'def loud(x: int) -> str:\n    """Talk.\n\n    Args:\n        x: words\n    """\n'
        "    return 'word ' * x\n"
    )
    tools = [*CALC, *(ToolSpec(name=f"flaky:{n}") for n in ("boom", "slow", "loud"))]
    scripts = {
        "ok": [call("calculator", expression="2*3"), "It is 6."],
        "json": ["<tool_call>{not json}</tool_call>", '<tool_call>{"name": "calculator"', "6"],
        "unknown": [call("nonesuch", x=1), "6"],
        "args": [call("calculator", expr="2*3"), "6"],
        "raise": [call("boom", x=1), "6"],
        "timeout": [call("slow", x=3), call("slow", x=3), call("calculator", expression="1"), "6"],
        "long": [call("loud", x=200), "6"],
        "turns": [call("calculator", expression="1+1")] * 4,
    }
    tokenizer, fmt, t = run_script(
        monkeypatch,
        scripts,
        tools,
        search_dirs=[user_dir],
        max_turns=4,
        tool_timeout=0.5,
        max_tool_time=0.7,
        max_tool_output_tokens=50,
        max_completion_length=2000,
    )
    counts = {
        k: {c: v.counts[c] for c in ("turns", "tool_calls", "tool_errors", "parse_failures", "truncated_tool_outputs")}
        for k, v in t.items()
    }
    assert counts["ok"] == {
        "turns": 2,
        "tool_calls": 1,
        "tool_errors": 0,
        "parse_failures": 0,
        "truncated_tool_outputs": 0,
    }
    assert t["ok"].turns[1] == {"role": "tool", "name": "calculator", "content": "6"}
    assert t["ok"].answer == "It is 6." and t["ok"].stop_reason == "answer"
    assert counts["json"]["parse_failures"] == 2 and counts["json"]["turns"] == 3
    assert "could not read the tool call" in t["json"].turns[1]["content"]
    assert counts["unknown"]["tool_errors"] == 1 and "unknown tool 'nonesuch'" in t["unknown"].turns[1]["content"]
    assert counts["args"]["tool_errors"] == 1 and "wrong arguments" in t["args"].turns[1]["content"]
    assert counts["raise"]["tool_errors"] == 1 and "RuntimeError: kaboom" in t["raise"].turns[1]["content"]
    # The first call runs past the 0.5 s timeout, the second past the 0.2 s left of the rollout's 0.7 s of tool
    # time; the third finds it spent.
    assert counts["timeout"]["tool_errors"] == 3
    assert "did not finish within 0.5 s" in t["timeout"].turns[1]["content"]
    assert "tool time (0.7 s) is spent" in t["timeout"].turns[5]["content"]
    assert counts["long"]["truncated_tool_outputs"] == 1 and "more tokens cut]" in t["long"].turns[1]["content"]
    assert t["turns"].stop_reason == "max_turns" and counts["turns"]["tool_calls"] == 3


def test_masks_are_exact_and_only_the_result_turn_is_tokenized(monkeypatch):
    tokenizer, fmt, t = run_script(monkeypatch, {"q": [call("calculator", expression="2*3"), "6"]})
    q = t["q"]
    first = encode(tokenizer, call("calculator", expression="2*3")) + [tokenizer.convert_tokens_to_ids("<|end|>")]
    result = encode(tokenizer, fmt.result_text(tokenizer, [("calculator", "6")]))
    second = encode(tokenizer, "6") + first[-1:]
    assert q.ids == first + result + second
    assert q.mask == [1] * len(first) + [0] * len(result) + [1] * len(second)
    assert q.logprobs == [-1.0] * len(first) + [0.0] * len(result) + [-1.0] * len(second)


def test_the_budget_ends_a_rollout_where_a_result_would_not_fit(monkeypatch):
    _, _, t = run_script(monkeypatch, {"q": [call("calculator", expression="2*3"), "6"]}, max_completion_length=60)
    assert t["q"].stop_reason == "length" and t["q"].counts["turns"] == 1 and len(t["q"].ids) <= 60
    assert set(t["q"].mask) == {1}


def test_environments_are_one_instance_per_rollout_with_their_reward(monkeypatch, user_dir):
    scripts = {"a": [call("buy", item="x"), "done"], "b": ["nothing"]}
    _, _, t = run_script(
        monkeypatch,
        scripts,
        tools=[],
        environment="my_tools:Shop",
        search_dirs=[user_dir],
        rows=[{"stock": 1}, {"stock": 1}],
    )
    assert t["a"].reward == 1.0 and t["b"].reward == 0.0
    assert t["a"].environment is not t["b"].environment
    assert t["a"].record()["environment_reward"] == 1.0


# --- the counts: one definition (COUNTS), every report ---------------------------------------------------------
BROKEN_ENV = '''
class Broken:
    def reset(self, row):
        return None

    def peek(self) -> str:
        """Look around."""
        return "nothing"

    def reward(self):
        raise ValueError("no score")
'''


@pytest.fixture
def broken_env(tmp_path):
    (tmp_path / "broken_env.py").write_text(BROKEN_ENV)
    return tmp_path


def test_rollout_limits_take_their_defaults_from_the_config():
    keys, limits = ("max_turns", "max_tool_output_tokens", "tool_timeout", "max_tool_time"), RolloutLimits()
    assert {k: getattr(limits, k) for k in keys} == {k: ToolUse.model_fields[k].default for k in keys}
    config = ToolUse(tools=["calculator"], max_turns=2, tool_timeout=3.0)
    assert RolloutLimits.of(config, 99) == RolloutLimits(2, 99, 256, 3.0, 60.0)


def test_cut_outputs_returns_what_it_cut_and_leaves_its_argument_alone():
    tokenizer = script_tokenizer()
    results = [("loud", "word " * 100), ("calculator", "6")]
    given = list(results)
    kept, cut = rollout_module.cut_outputs(tokenizer, results, 10)
    assert results == given and cut == 1
    more = len(encode(tokenizer, results[0][1])) - 10
    assert kept[1] == ("calculator", "6") and kept[0][1].endswith(f"\n[... {more} more tokens cut]")


def test_a_raising_environment_reward_is_counted_in_the_record(monkeypatch, broken_env):
    _, _, t = run_script(monkeypatch, {"a": ["6"]}, environment="broken_env:Broken", search_dirs=[broken_env])
    assert t["a"].reward == 0.0
    assert t["a"].record()["reward_errors"] == 1 and set(COUNTS) <= set(t["a"].record())


class Scored:
    """A stand-in for a verifier reward: 1 for the answer "6"."""

    weight = 1.0

    def __init__(self, name: str):
        self.__name__ = name

    def __call__(self, prompts=None, completions=None, **kwargs):
        return [float(c == "6") for c in completions]


def test_rlvr_reports_every_count_once_per_batch(monkeypatch, broken_env):
    """TRL's rollout_func and reward calls on one batch: each count reaches the per-row fields, is logged once
    per batch (not once per reward function) and is summed in the stage totals, reward_errors included."""
    from alignment.config.stages.rlvr import Config
    from alignment.training.rewards import SOURCE_PROMPT
    from alignment.training.tool_rollouts import ToolRollouts

    tokenizer = script_tokenizer()
    scripts = {"a": [call("calculator", expression="2*3"), "6"], "b": ["7"]}
    monkeypatch.setattr(rollout_module, "generate_ids", scripted_sampler(tokenizer, scripts))
    config = Config(
        data={"task": "arithmetic"},
        verifiers=["arithmetic"],
        tools=["calculator"],
        environment="broken_env:Broken",
        tool_format="hermes",
        describe_tools=False,
    )
    tools = ToolRollouts(config, tokenizer, [broken_env], "stages.rlvr")
    prompts = [row["prompt"] for row in tools.prepare([{SOURCE_PROMPT: key} for key in scripts])]
    trainer = SimpleNamespace(
        args=SimpleNamespace(max_completion_length=200, temperature=1.0, top_p=1.0, top_k=0),
        accelerator=SimpleNamespace(unwrap_model=lambda model: model),
        model=SimpleNamespace(training=True),
    )
    output = tools(prompts, trainer)
    assert output["tool_reward_errors"] == [1, 1] and output["tool_tool_calls"] == [1, 0]
    fields = {k: v for k, v in output.items() if k not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
    logged = []
    funcs = tools.rewards([Scored("first"), Scored("second")])
    assert len(funcs) == 3  # the environment's reward last
    for func in funcs:
        func(
            prompts=prompts,
            completions=["?", "?"],
            log_metric=lambda name, value: logged.append((name, value)),
            **fields,
        )
    names = [name for name, _ in logged]
    assert sorted(names) == sorted({"tools/call_rate", *(f"tools/{k}" for k in COUNTS)})
    assert dict(logged)["tools/reward_errors"] == 1.0 and dict(logged)["tools/call_rate"] == 0.5
    assert funcs[0](prompts=prompts, completions=["?", "?"], **fields) == [1.0, 0.0]  # the final answers scored
    metrics = tools.metrics()
    assert metrics["tools/reward_errors"] == 2 and metrics["tools/tool_calls"] == 1 and metrics["tools/rollouts"] == 2


def test_an_evaluation_suite_reports_every_count(monkeypatch, broken_env):
    from alignment.config.evaluate import SuiteSpec
    from alignment.evaluation.tool_suites import tool_samples

    tokenizer = script_tokenizer()
    scripts = {"a": [call("calculator", expression="2*3"), "6"], "b": ["7"]}
    monkeypatch.setattr(rollout_module, "generate_ids", scripted_sampler(tokenizer, scripts))
    spec = SuiteSpec(
        name="s",
        data={"task": "tool_arithmetic", "n": 2},
        verifier="arithmetic",
        tools=["calculator"],
        environment="broken_env:Broken",
        tool_format="hermes",
        describe_tools=False,
        sampling={"max_new_tokens": 200},
    )
    suite = SimpleNamespace(
        spec=spec, prompts=list(scripts), rows=[{}, {}], toolbox=resolve_tools(CALC, "broken_env:Broken", [broken_env])
    )
    samples, scores, records = tool_samples(None, tokenizer, suite, "eval")
    assert [s.text for s in samples] == ["6", "7"]
    assert scores == {
        "tool_call_rate": 0.5,
        "turns": 1.5,
        "tool_errors": 0.0,
        "parse_failures": 0.0,
        "skipped_calls": 0.0,
        "truncated_tool_outputs": 0.0,
        "reward_errors": 1.0,
    }
    assert [r["reward_errors"] for r in records] == [1, 1]


# --- the rollout on a real model and sampler -------------------------------------------------------------------
def test_sampler_logprobs_equal_the_policys_on_the_models_own_tokens(tiny_model, tmp_path, monkeypatch):
    """Tiny model with the HF sampler, ending most turns within a few tokens; every turn closed is read as a
    call, so rollouts run several turns with tool results between them (the vLLM backend's twin:
    tests/test_vllm_engine.py, and on the real engine tests/vllm_cpu)."""
    path = quick_stopping(tiny_model, tmp_path / "quick")
    tokenizer, model = load_tokenizer(str(path)), load_policy(str(path))
    prompts = [f"What is {a}+{b}?" for a, b in [(1, 2), (37, 48), (5, 600)]]
    torch.manual_seed(0)
    trajectories, encoded = calculator_rollout(
        model, tokenizer, SamplingSpec(max_new_tokens=8, batch_size=2), monkeypatch, prompts
    )
    assert_token_in_token_out(model, tokenizer, trajectories, encoded, atol=2e-4)


# --- rlvr: sampling options the tool rollout cannot honour, the environment's reward in the group signal ---------
@pytest.mark.parametrize(
    "train, key",
    [
        ({"min_p": 0.1}, "min_p"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"generation_kwargs": {"do_sample": False}}, "generation_kwargs"),
    ],
)
def test_rlvr_refuses_sampling_options_the_tool_rollout_would_ignore(train, key):
    from alignment.config.stages.rlvr import Config
    from alignment.training.tool_rollouts import ToolRollouts

    config = Config(
        data={"task": "arithmetic"}, verifiers=["arithmetic"], tools=["calculator"], tool_format="hermes", train=train
    )
    with pytest.raises(UserError, match=f"stages.rlvr.train.{key}: with tools"):
        ToolRollouts(config, script_tokenizer(), [], "stages.rlvr")
    inert = Config(
        data={"task": "arithmetic"},
        verifiers=["arithmetic"],
        tools=["calculator"],
        tool_format="hermes",
        train={"repetition_penalty": 1.0, "generation_kwargs": {}},
    )
    ToolRollouts(inert, script_tokenizer(), [], "stages.rlvr")


def test_the_environment_reward_counts_in_the_group_signal():
    """Groups of 2 whose verifier rewards are equal but whose environment rewards differ are not flat."""
    from alignment.training.rewards import GroupSignal, VerifierReward
    from alignment.training.tool_rollouts import EnvironmentReward
    from alignment.verifiers import resolve

    verifier = VerifierReward(resolve(lambda completion: 1.0), 1.0, "v")
    environment = EnvironmentReward()
    signal = GroupSignal([verifier, environment], stop_ids=[9], num_generations=2)
    ids = [[9]] * 4
    verifier(prompts=["p"] * 4, completions=["x"] * 4, completion_ids=ids)
    assert environment(environment_reward=[1.0, 0.0, 0.5, 0.5], completion_ids=ids) == [1.0, 0.0, 0.5, 0.5]
    assert signal.metrics()["zero_variance_groups"] == 0.5
