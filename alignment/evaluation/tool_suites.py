"""Evaluation suites with tools: a suite with `tools:` (and the other `ToolUse` keys) samples each prompt as a
multi-turn rollout (alignment/tools/rollout.py) instead of one completion.

    suites:
      - {name: products, data: {task: tool_arithmetic, split: test, n: 100}, verifier: arithmetic,
         tools: [calculator], tool_format: hermes, describe_tools: false, max_turns: 2,
         sampling: {temperature: 0, max_new_tokens: 96}}

The verifier scores the final assistant turn (pass@1 with tools); the suite adds `tool_call_rate` (share of rollouts
with at least one call) and the mean per rollout of every other count of `tools.rollout.COUNTS`; every line of
samples.jsonl holds the whole trajectory (`trajectory`: its messages, counts and why it stopped).
`sampling.max_new_tokens` bounds the tokens of the whole trajectory after the prompt (model turns and tool results).
`pass_k:` samples `n` whole rollouts of each of its prompts (pass@k on their final answers, lines with mode
`pass_k`). KL is not computed for tool suites (it would need the tool-result mask).
"""

from __future__ import annotations

from ..config.sampling import SamplingSpec
from ..sampling import Sample
from ..tools.formats import ToolFormat
from ..tools.rollout import COUNTS, RolloutLimits, count_means, rollout, start


def tool_samples(
    model, tokenizer, suite, where: str, settings: SamplingSpec | None = None, limit: int | None = None
) -> tuple[list[Sample], dict, list[dict]]:
    """(one Sample per rollout holding the final answer, tool metrics, trajectory records) of a tool suite:
    `settings.n` rollouts of each of the first `limit` prompts (default: the suite's sampling, every prompt),
    prompt by prompt, each Sample's `prompt_index` naming its prompt."""
    spec = suite.spec
    settings = settings or spec.sampling
    fmt = ToolFormat.for_tokenizer(tokenizer, spec.tool_format, f"evaluate.suites ({spec.name})")
    indices = [i for i in range(len(suite.prompts[:limit])) for _ in range(settings.n)]
    trajectories = start(
        tokenizer,
        fmt,
        suite.toolbox,
        [suite.prompts[i] for i in indices],
        [suite.rows[i] for i in indices],
        spec.describe_tools,
    )
    rollout(
        model, tokenizer, trajectories, fmt, settings, RolloutLimits.of(spec, settings.max_new_tokens), progress=where
    )
    samples = [
        Sample(i, t.answer, [x for x, m in zip(t.ids, t.mask) if m], finished=t.stop_reason == "answer")
        for i, t in zip(indices, trajectories)
    ]
    means = count_means([t.counts for t in trajectories])
    scores = {"tool_call_rate": means["call_rate"], **{k: means[k] for k in COUNTS if k != "tool_calls"}}
    return samples, scores, [t.record() for t in trajectories]
