"""The health line of an RL stage: did the reward move, and if not, the likely cause and the setting to change.

`health(kind, metrics)` is pure: it reads the counters a `ppo`, `rlvr` or `rsft` stage returns in its metrics
(`reward_start`/`reward_end`/`reward_std` from `reward_trend` or `round_trend`, `zero_variance_groups` or, with
dynamic sampling, `zero_variance_groups_trained`, truncated and unparseable completions, `kl`, rsft's
`prompt_coverage`) and returns `(status, paragraph)`; `report` logs the paragraph and adds `health` (the
status) and `health_summary` (the paragraph) to the metrics, so stage.json holds both.
Status: `ok` (the reward rose, nothing flagged), `warn` (it rose, something flagged), `flat` (it did not move),
`fell`, or `unknown` (no reward was logged twice). The thresholds are rules of thumb, named below; a flag is a
place to look first, never proof (docs/tuning.md#when-rl-does-not-move).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# The reward moved when its change from the first to the last third of the run exceeds this share of its spread
# within a batch (or of 1 where no spread was logged): a change smaller than that is within one batch's noise.
MOVED = 0.1
ZERO_VARIANCE_HIGH = 0.5  # share of GRPO/RLOO groups scored alike above which most steps carried no signal
TRUNCATED_HIGH = 0.2  # share of completions cut at the length limit
UNPARSEABLE_HIGH = 0.2  # share of completions a verifier could not parse (or failed on)
COVERAGE_LOW = 0.5  # rsft: share of prompts with a sample kept, below which most prompts taught nothing
# KL to the start policy below which the policy barely moved: TRL logs a per-token mean, ppo a per-sequence sum.
KL_STILL = {"rlvr": 1e-3, "ppo": 1e-2}

# The settings to change, per stage kind.
LENGTH_KEY = {"rlvr": "train.max_completion_length", "ppo": "rollout.max_new_tokens", "rsft": "sampling.max_new_tokens"}
STEP_KEY = {"rlvr": "train.learning_rate (or train.max_steps)", "ppo": "train.learning_rate (or train.total_updates)"}
# What to try when the reward did not move and no counter explains it. rsft's reward is the mean score of each
# round's samples at the sampling temperature, on fresh prompts, which can stay flat while greedy pass@1 rises; and
# on the reasoning-gym recipe more rounds of fewer prompts gained where a higher learning rate lost
# (docs/results.md#smollm2-on-reasoning-gym-tasks).
NO_CAUSE_ADVICE = {
    "rsft": "compare the start and final policies' evaluation first (this reward is the mean score of each "
    "round's samples, which can stay flat while greedy pass@1 rises), then try more rounds of fewer prompts "
    "(rounds, prompts_per_round) before a higher train.learning_rate, which overfits the policy's own answers",
}


def reward_trend(history: list[dict], key: str, std_key: str | None = None) -> dict[str, float]:
    """{reward_start, reward_end[, reward_std]}: the mean of `key` over the first and the last third of the
    entries of `history` that log it (at least one each), and the mean of `std_key`; {} with fewer than two."""
    values = [h[key] for h in history if isinstance(h.get(key), (int, float))]
    if len(values) < 2:
        return {}
    third = max(1, len(values) // 3)
    found = {"reward_start": sum(values[:third]) / third, "reward_end": sum(values[-third:]) / third}
    spreads = [h[std_key] for h in history if std_key and isinstance(h.get(std_key), (int, float))]
    if spreads:
        found["reward_std"] = sum(spreads) / len(spreads)
    return found


def unparseable_share(metrics: dict) -> float | None:
    """Share of scored completions the stage's verifiers (not its `gold:` ones) could not parse or failed on."""
    scored = bad = 0
    for key, value in metrics.items():
        if key.startswith("verifier/") and not key.startswith("verifier/gold/") and key.endswith("/scored"):
            name = key[: -len("/scored")]
            scored += value
            bad += metrics.get(f"{name}/unparseable", 0) + metrics.get(f"{name}/errors", 0)
    return bad / scored if scored else None


def truncated_share(kind: str, metrics: dict) -> float | None:
    """Share of completions cut at the length limit: rlvr's counts, ppo's `eos_fraction`, rsft's rounds."""
    if kind == "rlvr" and metrics.get("completions_sampled"):
        return metrics["completions_truncated"] / metrics["completions_sampled"]
    if kind == "ppo" and isinstance(metrics.get("eos_fraction"), (int, float)):
        return 1.0 - metrics["eos_fraction"]
    if kind == "rsft" and isinstance(metrics.get("unfinished_rate"), (int, float)):
        return metrics["unfinished_rate"]
    return None


def health(kind: str, metrics: dict) -> tuple[str, str]:
    """(status, one paragraph) from a stage's metrics; see the module docstring."""
    start, end = metrics.get("reward_start"), metrics.get("reward_end")
    if start is None or end is None:
        trend, status = "the reward was not logged twice, so whether it moved is unknown", "unknown"
    else:
        scale = metrics.get("reward_std") or 1.0
        change = end - start
        status = "ok" if change > MOVED * scale else "fell" if change < -MOVED * scale else "flat"
        verb = {"ok": "rose", "fell": "fell", "flat": "did not move"}[status]
        trend = f"the reward {verb} ({start:.3g} to {end:.3g}, first to last third of the run)"
    causes = flags(kind, metrics, status)
    if status == "ok" and causes:
        status = "warn"
    if not causes:
        if status in ("ok", "unknown"):
            return status, f"Health ({kind}): {trend}. Nothing in its counters looks wrong."
        return status, f"Health ({kind}): {trend}. No counter explains it: {no_cause_advice(kind)}."
    first, *rest = causes
    more = (" Also: " + " ".join(c[0].upper() + c[1:] for c in rest)) if rest else ""
    return status, f"Health ({kind}): {trend}. Likely cause: {first}{more}"


def no_cause_advice(kind: str) -> str:
    """What to try when the reward did not move and no counter points at a cause."""
    if kind in NO_CAUSE_ADVICE:
        return NO_CAUSE_ADVICE[kind]
    return (
        f"try more steps or a higher learning rate ({STEP_KEY.get(kind, 'train.learning_rate')}), "
        "or check the data's answers"
    )


def flags(kind: str, metrics: dict, status: str) -> list[str]:
    """The causes the counters point at, most likely first, each with the setting to change."""
    found = []
    unparseable = unparseable_share(metrics)
    if unparseable is not None and unparseable > UNPARSEABLE_HIGH:
        found.append(
            f"the verifiers could not parse (or failed on) {unparseable:.0%} of completions, which all "
            "scored 0: the policy does not write the answer in the format the verifier reads; check one "
            "sample against the verifier (`align verify`), then teach the format first (an sft stage) or "
            "choose a verifier (`verifiers:`) or prompt format that matches."
        )
    zero, trained = metrics.get("zero_variance_groups"), metrics.get("zero_variance_groups_trained")
    if kind == "rlvr" and trained is not None and trained > ZERO_VARIANCE_HIGH:
        found.append(
            f"dynamic sampling was on, yet {trained:.0%} of the groups trained on scored alike "
            "(zero_variance_groups_trained: the draws ran out): raise dynamic_sampling.max_draws, or set "
            "`prompt_filter` (keep the prompts the start policy solves sometimes)."
        )
    elif kind == "rlvr" and trained is None and zero is not None and zero > ZERO_VARIANCE_HIGH:
        found.append(
            f"{zero:.0%} of the prompt groups scored alike (zero_variance_groups), and such a group gives "
            "GRPO/RLOO no gradient: turn on `dynamic_sampling` (such groups dropped and refilled), or "
            "`prompt_filter` (keep the prompts the start policy solves sometimes), or raise "
            "train.num_generations or train.temperature."
        )
    coverage = metrics.get("prompt_coverage")
    if kind == "rsft" and coverage is not None and coverage < COVERAGE_LOW:
        found.append(
            f"only {coverage:.0%} of prompts had a sample kept, so most prompts taught nothing: set "
            "`prompt_filter` (keep the prompts the start policy solves sometimes) or raise sampling.n."
        )
    cut = truncated_share(kind, metrics)
    if cut is not None and cut > TRUNCATED_HIGH:
        found.append(
            f"{cut:.0%} of completions were cut at the length limit before their end-of-turn token: "
            f"raise {LENGTH_KEY[kind]}."
        )
    kl = metrics.get("kl")
    if kind in KL_STILL and isinstance(kl, (int, float)) and status in ("flat", "unknown") and kl < KL_STILL[kind]:
        found.append(
            f"the KL to the start policy stayed at {kl:.2g}: the policy barely changed; raise {STEP_KEY[kind]}."
        )
    return found


def report(kind: str, where: str, metrics: dict) -> dict:
    """`metrics` with `health` and `health_summary` added; the paragraph is logged (a warning unless `ok`)."""
    status, paragraph = health(kind, metrics)
    log.log(logging.INFO if status in ("ok", "unknown") else logging.WARNING, f"[{where}] {paragraph}")
    return {**metrics, "health": status, "health_summary": paragraph}


def round_trend(stats: list[dict]) -> dict[str, float]:
    """rsft's counters from its rounds' stats: the last round's `prompt_coverage` and `unfinished_rate`, and the
    mean score of the first and the last round's samples as `reward_start`/`reward_end` (with two rounds or more:
    a round samples before it trains, so one round never samples the policy it trained)."""
    if not stats:
        return {}
    found = {k: stats[-1][k] for k in ("prompt_coverage", "unfinished_rate") if k in stats[-1]}
    if len(stats) > 1:
        found.update(reward_start=stats[0]["mean_score"], reward_end=stats[-1]["mean_score"])
    return found
