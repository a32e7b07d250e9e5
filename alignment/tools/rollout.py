"""The multi-turn rollout with tools, token-in token-out.

    trajectories = start(tokenizer, fmt, toolbox, prompts, rows)          # render + environment reset
    rollout(model, tokenizer, trajectories, fmt, SamplingSpec(max_new_tokens=64), RolloutLimits(max_turns=4))
    t.prompt_ids, t.ids, t.mask, t.logprobs, t.counts, t.answer

Each turn samples the unfinished trajectories with the one sampler (`sampling.generate_ids`, fed the ids each holds,
never re-tokenized), runs the calls it parses and appends the tool result turn as ids. `mask` is 1 on sampled tokens,
0 on tool results and the template's text around them; `logprobs` are the sampler's (0 elsewhere). Model text is
hostile input: nothing it writes fails a rollout; each failure is an `error: ...` result, counted (`COUNTS`); work is
bounded per call, turn, rollout and batch (`RolloutLimits`); results are tokenized as data (no control token).
Limits: `module:function` tools run in a worker process killed at the timeout (tools/worker.py), the `python` tool's
sandbox at its own; the built-ins and an environment's methods in a daemon thread joined with the timeout (an OpenEnv
environment's calls are steps of its session, tools/openenv.py, whose `done` ends the rollout). An environment stays
in this process (shared state, no pickling): one whose call ignores the timeout keeps its thread, and is refused.
"""

from __future__ import annotations

import inspect
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config.sampling import SamplingSpec
from ..config.tools import ToolUse
from ..data.formatting import encode
from ..sampling import generate_ids
from .formats import Call, ToolFormat, clean_text, data_ids
from .openenv import OpenEnvSession, OpenEnvTool
from .registry import Toolbox, check_arguments
from .worker import WorkerTool

# The one definition of what a rollout counts (name: meaning). Every report reads it (a trajectory's record,
# rlvr's per-row fields, per-batch logs and stage totals, evaluation suites), so a new count reaches them all.
COUNTS = {
    "turns": "assistant turns sampled",
    "tool_calls": "tool calls run",
    "tool_errors": "calls that failed: unknown tool, wrong arguments, raised, past its timeout, or after the "
    "rollout's or the batch's tool time was spent",
    "parse_failures": "calls that could not be read",
    "skipped_calls": "calls past max_tool_calls in one turn, not run (one error result says how many)",
    "truncated_tool_outputs": "tool results cut at max_tool_output_tokens, with a marker",
    "reward_errors": "an environment's reward() that raised or was no finite number (the rollout scores 0 from it)",
}
LIMITS = (
    "max_turns",
    "max_tool_output_tokens",
    "tool_timeout",
    "max_tool_time",
    "max_tool_calls",
    "max_step_tool_time",
)  # the `ToolUse` keys it obeys
# A result is cut to the larger of these before it is tokenized, so a huge output costs no more than a long one:
# max_tool_output_tokens times MAX_CHARS_PER_TOKEN characters (a token rarely spans more, and a cut there is still
# marked), or MAX_TOKENIZED_CHARS, below which the marker can say exactly how many tokens were cut.
MAX_CHARS_PER_TOKEN = 16
MAX_TOKENIZED_CHARS = 1 << 16


def count_means(counts: list[Mapping[str, int]]) -> dict[str, float]:
    """`call_rate` (the share of rollouts that called a tool) and every count's mean per rollout, of one count
    mapping per rollout (0 for none)."""
    n = max(len(counts), 1)
    return {
        "call_rate": sum(c["tool_calls"] > 0 for c in counts) / n,
        **{k: sum(c[k] for c in counts) / n for k in COUNTS},
    }


def _configured(key: str):
    return ToolUse.model_fields[key].default


@dataclass(frozen=True)
class RolloutLimits:
    """The bounds of a rollout: the `ToolUse` keys (their defaults are the config's) and the tokens after the
    prompt, which a stage or suite always passes (rlvr's max_completion_length, rsft's and evaluation's
    max_new_tokens); its default serves direct calls."""

    max_turns: int = _configured("max_turns")
    max_completion_length: int = 256  # tokens after the prompt: model turns and tool results together
    max_tool_output_tokens: int = _configured("max_tool_output_tokens")
    tool_timeout: float = _configured("tool_timeout")
    max_tool_time: float = _configured("max_tool_time")
    max_tool_calls: int = _configured("max_tool_calls")
    max_step_tool_time: float | None = _configured("max_step_tool_time")

    @classmethod
    def of(cls, config, max_completion_length: int) -> RolloutLimits:
        """From a stage config or suite holding the `ToolUse` keys."""
        return cls(max_completion_length=max_completion_length, **{k: getattr(config, k) for k in LIMITS})


@dataclass
class Trajectory:
    prompt_ids: list[int]
    tools: dict[str, Callable]
    environment: Any = None
    parameters: dict[str, dict] = field(default_factory=dict)  # each tool's argument schema, as the model sees it
    ids: list[int] = field(default_factory=list)  # after the prompt
    mask: list[int] = field(default_factory=list)  # 1: sampled by the model
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)  # {"role": "assistant" | "tool", "content": text}
    counts: Counter = field(default_factory=Counter)  # of COUNTS
    stop_reason: str = ""
    tool_time: float = 0.0
    reward: float | None = None  # the environment's reward(), where it has one
    stuck: str | None = None  # the environment call that ignored its timeout and still runs

    @property
    def answer(self) -> str:
        """The last assistant turn's text: what the verifiers score."""
        return next((t["content"] for t in reversed(self.turns) if t["role"] == "assistant"), "")

    def add(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

    def record(self) -> dict:
        """The trajectory for samples.jsonl and stage logs: turns, counts, why it stopped."""
        return {
            "messages": self.turns,
            "stop_reason": self.stop_reason,
            **{k: self.counts[k] for k in COUNTS},
            **({"environment_reward": self.reward} if self.environment is not None else {}),
        }


def start(
    tokenizer, fmt: ToolFormat, toolbox: Toolbox, prompts: list, rows: list[dict], describe: bool = True
) -> list[Trajectory]:
    """One trajectory per (prompt, row): a fresh environment reset to the row (its note appended to the last
    user message), the prompt rendered with the tools described and tokenized once."""
    trajectories = []
    for prompt, row in zip(prompts, rows):
        environment, note = toolbox.new_environment(row)
        if note:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            prompt = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + note}]
        text = fmt.render_prompt(tokenizer, prompt, toolbox.schemas, describe)
        trajectories.append(
            Trajectory(encode(tokenizer, text), toolbox.bind(environment), environment, toolbox.parameters)
        )
    return trajectories


def rollout(
    model,
    tokenizer,
    trajectories: list[Trajectory],
    fmt: ToolFormat,
    settings: SamplingSpec,
    limits: RolloutLimits,
    progress: str | None = None,
) -> list[Trajectory]:
    """Run every trajectory to its end; returns them, filled in. A rollout ends when the model answers without a
    tool call (`stop_reason` "answer"), after `max_turns` turns ("max_turns": the calls of the last turn are not
    run), or when its tokens after the prompt would pass `max_completion_length` ("length": the turn is cut
    there, or the tool result that would not fit is left off), or when an OpenEnv environment's observation says
    the episode is done ("done"). A malformed call (bad JSON, no name), a call of
    an unknown tool or with wrong arguments, a tool that raises or runs past `tool_timeout`, and calls after the
    rollout's `max_tool_time` or the batch's `max_step_tool_time` is spent all come back to the model as an
    `error: ...` result, counted; so do the calls past `max_tool_calls` in one turn, which are not run."""
    settings = settings.model_copy(update={"n": 1})
    clock = StepClock(limits.max_step_tool_time)
    active = list(trajectories)
    for turn in range(limits.max_turns):
        room = [limits.max_completion_length - len(t.ids) for t in active]
        step = settings.model_copy(update={"max_new_tokens": max(1, min(settings.max_new_tokens, max(room)))})
        samples = generate_ids(model, tokenizer, [t.prompt_ids + t.ids for t in active], step, progress, logprobs=True)
        still = []
        for t, sample, left in zip(active, samples, room):
            ids, logprobs = sample.token_ids[:left], sample.logprobs[:left]
            t.add(ids, True, logprobs)
            t.counts["turns"] += 1
            closed = sample.finished and len(ids) == len(sample.token_ids)
            text = tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=False)
            t.turns.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
            if not closed:
                t.stop_reason = "length"
                continue
            calls, failures = fmt.parse(text)
            if not calls and not failures:
                t.stop_reason = "answer"
                continue
            if turn == limits.max_turns - 1:
                t.stop_reason = "max_turns"
                continue
            results = run_calls(t, calls, failures, limits, clock)
            results, cut = cut_outputs(tokenizer, results, limits.max_tool_output_tokens)
            t.counts["truncated_tool_outputs"] += cut
            suffix = fmt.result_ids(tokenizer, results)
            if len(t.ids) + len(suffix) >= limits.max_completion_length:
                t.stop_reason = "length"  # the result does not fit: the rollout ends at the call
                continue
            t.add(suffix, False)
            t.turns += [{"role": "tool", "name": name, "content": content} for name, content in results]
            if isinstance(t.environment, OpenEnvSession) and t.environment.done:
                t.stop_reason = "done"  # the environment ended the episode: no turn after its last observation
                continue
            still.append(t)
        active = still
        if not active:
            break
    for t in trajectories:
        t.reward = environment_reward(t, limits.tool_timeout)
    return trajectories


@dataclass
class StepClock:
    """The tool time of one `rollout` call (a batch of rollouts run one after another), against its bound."""

    bound: float | None
    spent: float = 0.0

    @property
    def left(self) -> float:
        return math.inf if self.bound is None else self.bound - self.spent


def run_calls(
    t: Trajectory, calls: list[Call], failures: list[str], limits: RolloutLimits, clock: StepClock | None = None
) -> list[tuple[str, str]]:
    """[(tool name, result text)] for one turn's calls, malformed ones first, at most `max_tool_calls` of them
    (one more result says how many were not run); every failure is a result, counted. Names and texts are valid
    UTF-8 (`clean_text`); a name the model made up is not echoed as a tool name."""
    clock = clock or StepClock(limits.max_step_tool_time)
    given = len(failures) + len(calls)
    failures, calls = failures[: limits.max_tool_calls], calls[: max(limits.max_tool_calls - len(failures), 0)]
    skipped = given - len(failures) - len(calls)
    results = []
    for reason in failures:
        t.counts["parse_failures"] += 1
        results.append(("invalid_call", f"error: could not read the tool call: {reason}"))
    for call in calls:
        t.counts["tool_calls"] += 1
        ok, output = call_tool(t, call, limits, clock)
        t.counts["tool_errors"] += not ok
        results.append((call.name if call.name in t.tools else "unknown_tool", output if ok else f"error: {output}"))
    if skipped:
        t.counts["skipped_calls"] += skipped
        note = f"{skipped} more tool call(s) in this turn were not run (at most {limits.max_tool_calls} per turn)"
        results.append(("invalid_call", f"error: {note}"))
    return [(clean_text(name), clean_text(text)) for name, text in results]


def call_tool(t: Trajectory, call: Call, limits: RolloutLimits, clock: StepClock) -> tuple[bool, str]:
    """(ok, output or the reason it failed) of one call: its arguments checked against the tool's schema, then
    run bounded by the tool timeout, the rollout's tool time and the batch's."""
    fn = t.tools.get(call.name)
    if fn is None:
        return False, f"unknown tool '{call.name}'; the tools are {', '.join(sorted(t.tools)) or 'none'}"
    problem = None
    if not isinstance(fn, WorkerTool):  # Python's own words first, as before schemas were checked
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as error:
            problem = str(error)
    if problem is None and call.name in t.parameters:
        problem = check_arguments(t.parameters[call.name], call.arguments)
    if problem:
        return False, f"wrong arguments for '{call.name}': {problem}"
    if limits.max_tool_time - t.tool_time <= 0:
        return False, f"this rollout's tool time ({limits.max_tool_time:g} s) is spent"
    if clock.left <= 0:
        return False, f"this batch's tool time ({limits.max_step_tool_time:g} s, every rollout together) is spent"
    budget = min(limits.tool_timeout, limits.max_tool_time - t.tool_time, clock.left)
    began = time.monotonic()
    if isinstance(fn, OpenEnvTool):  # a step of the rollout's session, which bounds its own wait
        ok, output = fn.call(call.arguments, budget)
        elapsed = time.monotonic() - began
        t.tool_time += elapsed
        clock.spent += elapsed
        return ok, output
    if isinstance(fn, WorkerTool):
        ok, output = fn.worker.call(call.name, call.arguments, budget)
        elapsed = time.monotonic() - began
        t.tool_time += elapsed - fn.worker.start_seconds  # a worker's start is the step's time, not the tool's
        clock.spent += elapsed
        return ok, output
    ok, output = _in_thread(t, fn, call, budget)
    elapsed = time.monotonic() - began
    t.tool_time += elapsed
    clock.spent += elapsed
    return ok, output


def _in_thread(t: Trajectory, fn: Callable, call: Call, budget: float) -> tuple[bool, str]:
    """A built-in tool or an environment's method in a daemon thread, joined with the timeout. An environment
    whose call is still running is not called again (its state may be half changed): `t.stuck` says which call."""
    environment_call = getattr(fn, "__self__", None) is t.environment is not None
    if environment_call and t.stuck:
        return False, f"the environment is still running '{t.stuck}', which passed its timeout; it takes no calls"
    outcome = _thread_call(fn, call.arguments, budget)
    if outcome is None:
        if environment_call:
            t.stuck = call.name
        return False, f"'{call.name}' did not finish within {budget:g} s"
    if "error" in outcome:
        return False, outcome["error"]
    value = outcome["value"]
    try:
        return True, value if isinstance(value, str) else str(value)
    except Exception as error:  # noqa: BLE001 - a value whose str() raises
        return False, f"its result could not be written as text ({type(error).__name__})"


def _thread_call(fn: Callable, arguments: dict, budget: float) -> dict | None:
    """{"value": what fn returned} or {"error": why it raised}; None when it runs past `budget` seconds."""
    outcome: dict = {}

    def work():
        try:
            outcome["value"] = fn(**arguments)
        except BaseException as error:  # noqa: BLE001 - a raising tool (SystemExit too) is an observation
            outcome["error"] = f"{type(error).__name__}: {error}"

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(budget)
    return None if worker.is_alive() else outcome


def cut_outputs(tokenizer, results: list[tuple[str, str]], max_tokens: int) -> tuple[list[tuple[str, str]], int]:
    """(the results [(tool name, text)] with each longer than `max_tokens` tokens cut there, with a marker saying
    how much was cut; how many were cut). Only a result's first characters are tokenized (as data, `data_ids`;
    see MAX_TOKENIZED_CHARS); a result cut there says how many characters it lost. `results` is left as it was: the
    caller counts."""
    kept, cut = [], 0
    for name, content in results:
        head = content[: max(max_tokens * MAX_CHARS_PER_TOKEN, MAX_TOKENIZED_CHARS)]
        ids = data_ids(tokenizer, head)
        if len(ids) > max_tokens or len(head) < len(content):
            cut += 1
            shown = tokenizer.decode(ids[:max_tokens])
            more = (
                f"{len(ids) - max_tokens} more tokens"
                if len(head) == len(content)
                else f"{len(content) - len(shown)} more characters"
            )
            content = f"{shown}\n[... {more} cut]"
        kept.append((name, content))
    return kept, cut


def environment_reward(t: Trajectory, timeout: float = _configured("tool_timeout")) -> float | None:
    """The environment's reward() of a finished rollout (None without one), run as a tool call is (`timeout`). One
    that raises, runs past the timeout, is no finite number, or belongs to an environment still running a call
    past its timeout is counted and scores 0."""
    reward = getattr(t.environment, "reward", None)
    if not callable(reward):
        return None
    outcome = _thread_call(reward, {}, timeout) if t.stuck is None else None
    try:
        value = float(outcome["value"]) if outcome and "value" in outcome else math.nan
    except Exception:  # noqa: BLE001 - the user's value (a string, an object without __float__)
        value = math.nan
    if not math.isfinite(value):
        t.counts["reward_errors"] += 1
        return 0.0
    return value
