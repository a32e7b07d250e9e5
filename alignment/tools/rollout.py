"""The multi-turn rollout with tools, token-in token-out.

    trajectories = start(tokenizer, fmt, toolbox, prompts, rows)          # render + environment reset
    rollout(model, tokenizer, trajectories, fmt, SamplingSpec(max_new_tokens=64), RolloutLimits(max_turns=4))
    t.prompt_ids, t.ids, t.mask, t.logprobs, t.counts, t.answer

Each turn samples the unfinished trajectories with the one sampler (`sampling.generate_ids`, fed the ids each holds,
never re-tokenized), runs the calls it parses and appends the tool result turn as ids. `mask` is 1 on sampled
tokens, 0 on tool results and the template's text around them; `logprobs` are the sampler's (0 elsewhere). Nothing
fails a rollout: each failure is an `error: ...` result the model sees, counted (`COUNTS`).

Limits: a tool runs in a daemon thread joined with a timeout; a Python function that ignores it cannot be
stopped and keeps its thread (without holding the rollout up). The `python` tool runs in its own sandboxed
process, killed at its own timeout (set it below `tool_timeout`).
"""

from __future__ import annotations

import inspect
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
from .formats import Call, ToolFormat
from .registry import Toolbox

# The one definition of what a rollout counts (name: meaning). Every report reads it (a trajectory's record,
# rlvr's per-row fields, per-batch logs and stage totals, evaluation suites), so a new count reaches them all.
COUNTS = {
    "turns": "assistant turns sampled",
    "tool_calls": "tool calls run",
    "tool_errors": "calls that failed: unknown tool, wrong arguments, raised, past its timeout or the tool time",
    "parse_failures": "calls that could not be read",
    "truncated_tool_outputs": "tool results cut at max_tool_output_tokens, with a marker",
    "reward_errors": "an environment's reward() that raised (the rollout scores 0 from it)",
}
LIMITS = ("max_turns", "max_tool_output_tokens", "tool_timeout", "max_tool_time")  # the `ToolUse` keys it obeys


def count_means(counts: list[Mapping[str, int]]) -> dict[str, float]:
    """`call_rate` (the share of rollouts that called a tool) and every count's mean per rollout, of one count
    mapping per rollout (0 for none)."""
    n = max(len(counts), 1)
    return {"call_rate": sum(c["tool_calls"] > 0 for c in counts) / n,
            **{k: sum(c[k] for c in counts) / n for k in COUNTS}}


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

    @classmethod
    def of(cls, config, max_completion_length: int) -> RolloutLimits:
        """From a stage config or suite holding the `ToolUse` keys."""
        return cls(max_completion_length=max_completion_length, **{k: getattr(config, k) for k in LIMITS})


@dataclass
class Trajectory:
    prompt_ids: list[int]
    tools: dict[str, Callable]
    environment: Any = None
    ids: list[int] = field(default_factory=list)  # after the prompt
    mask: list[int] = field(default_factory=list)  # 1: sampled by the model
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)  # {"role": "assistant" | "tool", "content": text}
    counts: Counter = field(default_factory=Counter)  # of COUNTS
    stop_reason: str = ""
    tool_time: float = 0.0
    reward: float | None = None  # the environment's reward(), where it has one

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
        return {"messages": self.turns, "stop_reason": self.stop_reason, **{k: self.counts[k] for k in COUNTS},
                **({"environment_reward": self.reward} if self.environment is not None else {})}


def start(tokenizer, fmt: ToolFormat, toolbox: Toolbox, prompts: list, rows: list[dict],
          describe: bool = True) -> list[Trajectory]:
    """One trajectory per (prompt, row): a fresh environment reset to the row (its note appended to the last
    user message), the prompt rendered with the tools described and tokenized once."""
    trajectories = []
    for prompt, row in zip(prompts, rows):
        environment, note = toolbox.new_environment(row)
        if note:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            prompt = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + note}]
        text = fmt.render_prompt(tokenizer, prompt, toolbox.schemas, describe)
        trajectories.append(Trajectory(encode(tokenizer, text), toolbox.bind(environment), environment))
    return trajectories


def rollout(model, tokenizer, trajectories: list[Trajectory], fmt: ToolFormat, settings: SamplingSpec,
            limits: RolloutLimits, progress: str | None = None) -> list[Trajectory]:
    """Run every trajectory to its end; returns them, filled in. A rollout ends when the model answers without a
    tool call (`stop_reason` "answer"), after `max_turns` turns ("max_turns": the calls of the last turn are not
    run), or when its tokens after the prompt would pass `max_completion_length` ("length": the turn is cut
    there, or the tool result that would not fit is left off). A malformed call (bad JSON, no name), a call of
    an unknown tool or with wrong arguments, a tool that raises or runs past `tool_timeout`, and calls after the
    rollout's `max_tool_time` is spent all come back to the model as an `error: ...` result, counted."""
    settings = settings.model_copy(update={"n": 1})
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
            results, cut = cut_outputs(tokenizer, run_calls(t, calls, failures, limits), limits.max_tool_output_tokens)
            t.counts["truncated_tool_outputs"] += cut
            suffix = encode(tokenizer, fmt.result_text(tokenizer, results))
            if len(t.ids) + len(suffix) >= limits.max_completion_length:
                t.stop_reason = "length"  # the result does not fit: the rollout ends at the call
                continue
            t.add(suffix, False)
            t.turns += [{"role": "tool", "name": name, "content": content} for name, content in results]
            still.append(t)
        active = still
        if not active:
            break
    for t in trajectories:
        t.reward = environment_reward(t)
    return trajectories


def run_calls(t: Trajectory, calls: list[Call], failures: list[str], limits: RolloutLimits) -> list[tuple[str, str]]:
    """[(tool name, result text)] for one turn's calls; every failure is a result, counted."""
    results = []
    for reason in failures:
        t.counts["parse_failures"] += 1
        results.append(("invalid_call", f"error: could not read the tool call: {reason}"))
    for call in calls:
        t.counts["tool_calls"] += 1
        ok, output = call_tool(t, call, limits)
        t.counts["tool_errors"] += not ok
        results.append((call.name, output if ok else f"error: {output}"))
    return results


def call_tool(t: Trajectory, call: Call, limits: RolloutLimits) -> tuple[bool, str]:
    """(ok, output or the reason it failed) of one call, bounded by the tool timeout and the rollout's time."""
    fn = t.tools.get(call.name)
    if fn is None:
        return False, f"unknown tool '{call.name}'; the tools are {', '.join(sorted(t.tools)) or 'none'}"
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as error:
        return False, f"wrong arguments for '{call.name}': {error}"
    budget = min(limits.tool_timeout, limits.max_tool_time - t.tool_time)
    if budget <= 0:
        return False, f"this rollout's tool time ({limits.max_tool_time:g} s) is spent"
    outcome: dict = {}

    def work():
        try:
            outcome["value"] = fn(**call.arguments)
        except Exception as error:  # noqa: BLE001 - a raising tool is an observation, not a crash
            outcome["error"] = f"{type(error).__name__}: {error}"

    began = time.monotonic()
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(budget)
    t.tool_time += time.monotonic() - began
    if worker.is_alive():
        return False, f"'{call.name}' did not finish within {budget:g} s"
    if "error" in outcome:
        return False, outcome["error"]
    value = outcome.get("value")
    return True, value if isinstance(value, str) else str(value)


def cut_outputs(tokenizer, results: list[tuple[str, str]], max_tokens: int) -> tuple[list[tuple[str, str]], int]:
    """(the results [(tool name, text)] with each longer than `max_tokens` tokens cut there, with a marker saying
    how much was cut; how many were cut). `results` is left as it was: the caller counts."""
    kept, cut = [], 0
    for name, content in results:
        ids = encode(tokenizer, content)
        if len(ids) > max_tokens:
            cut += 1
            content = f"{tokenizer.decode(ids[:max_tokens])}\n[... {len(ids) - max_tokens} more tokens cut]"
        kept.append((name, content))
    return kept, cut


def environment_reward(t: Trajectory) -> float | None:
    """The environment's reward() of a finished rollout (None without one); one that raises is counted."""
    reward = getattr(t.environment, "reward", None)
    if not callable(reward):
        return None
    try:
        return float(reward())
    except Exception:  # noqa: BLE001 - the user's scoring; counted, the rollout scores 0 from it
        t.counts["reward_errors"] += 1
        return 0.0
