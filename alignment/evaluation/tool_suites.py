"""Evaluation suites with tools: a suite with `tools:` (and the other `ToolUse` keys) samples each prompt as a
multi-turn rollout (alignment/tools/rollout.py) instead of one completion.

    suites:
      - {name: products, data: {task: tool_arithmetic, split: test, n: 100}, verifier: arithmetic,
         tools: [calculator], tool_format: hermes, describe_tools: false, max_turns: 2,
         sampling: {temperature: 0, max_new_tokens: 96}}

The verifier scores the final assistant turn (pass@1 with tools); the suite adds `tool_call_rate` (share of
rollouts with at least one call), `tool_errors`, `parse_failures`, `turns` and `truncated_tool_outputs` (means per
rollout); every line of samples.jsonl holds the whole trajectory (`trajectory`: its messages, counts and why it
stopped). `sampling.max_new_tokens` bounds the tokens of the whole trajectory after the prompt (model turns and
tool results). pass@k and KL are not computed for tool suites (KL would need the tool-result mask).
"""

from __future__ import annotations

from ..sampling import Sample
from ..tools.formats import ToolFormat
from ..tools.rollout import COUNTS, RolloutLimits, rollout, start

SUITE_METRICS = {"tool_calls": "tool_call_rate"}


def tool_samples(model, tokenizer, suite, where: str) -> tuple[list[Sample], dict, list[dict]]:
    """(one Sample per prompt holding the final answer, tool metrics, trajectory records) of a tool suite."""
    spec = suite.spec
    fmt = ToolFormat.for_tokenizer(tokenizer, spec.tool_format, f"evaluate.suites ({spec.name})")
    trajectories = start(tokenizer, fmt, suite.toolbox, suite.prompts, suite.rows, spec.describe_tools)
    rollout(model, tokenizer, trajectories, fmt, spec.sampling, RolloutLimits.of(spec, spec.sampling.max_new_tokens),
            progress=where)
    samples = [Sample(i, t.answer, [x for x, m in zip(t.ids, t.mask) if m], finished=t.stop_reason == "answer")
               for i, t in enumerate(trajectories)]
    n = max(len(trajectories), 1)
    scores = {"tool_call_rate": sum(t.counts["tool_calls"] > 0 for t in trajectories) / n}
    scores.update({k: sum(t.counts[k] for t in trajectories) / n for k in COUNTS if k != "tool_calls"})
    return samples, scores, [t.record() for t in trajectories]
