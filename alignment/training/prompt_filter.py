"""`prompt_filter:` the prompts of an RL stage kept by the start policy's pass rate, measured before training.

`filter_rows(ctx, rows, rewards, sampling)` samples `k` completions of every row's prompt from the start policy,
scores them with the stage's verifiers (a completion passes when every verifier passes it) and returns the
indices of the rows whose pass rate lies in [low, high] (`signal.pass_rate_bounds`), with counts for stage.json
(`prompt_filter/measured`, `kept`, `too_hard`, `too_easy`). The main process measures once and keeps the result in
the work folder (`StageContext.computed_once`), so every process keeps the same rows and a rerun does not sample
again. No row left is a UserError naming the bounds and the rates found. Limits: one turn, no tools; it costs k
samples of every prompt before the stage starts.
"""

from __future__ import annotations

from collections import Counter

from accelerate import PartialState

from ..config.sampling import SamplingSpec
from ..data.formatting import render_prompt
from ..errors import UserError
from ..models.loading import load_policy
from ..runtime.dist import get_logger
from ..sampling import generate
from .prompts import prompt_of
from .rewards import SOURCE_PROMPT, VerifierReward, combined_scores
from .signal import pass_rate_bounds

log = get_logger(__name__)


def filter_rows(ctx, rows: list[dict], rewards: list, sampling: SamplingSpec) -> tuple[list[int], dict]:
    """(indices of the rows kept, counts) under `ctx.config.prompt_filter`; all rows and {} when it is unset.
    `sampling`: the stage's own settings, used unless the filter gives its own; `rewards`: VerifierRewards."""
    spec = ctx.config.prompt_filter
    if spec is None:
        return list(range(len(rows))), {}
    settings = (spec.sampling or sampling).model_copy(update={"n": spec.k})
    found, stats = ctx.computed_once("prompt_filter.jsonl", lambda: measure(ctx, rows, rewards, settings))
    rates = [r["pass_rate"] for r in found]
    kept, counts = pass_rate_bounds(rates, spec.low, spec.high)
    counts = {f"prompt_filter/{k}": v for k, v in {"measured": len(rates), **counts}.items()}
    if not kept:
        histogram = ", ".join(f"{rate:.2f}: {n}" for rate, n in sorted(Counter(rates).items()))
        raise UserError(
            f"{ctx.where}.prompt_filter: no prompt has a pass rate within [{spec.low}, {spec.high}] under "
            f"the start policy ({spec.k} samples each; pass rates found, with their prompt counts: "
            f"{histogram}). Widen low/high, or give prompts the policy solves some of the time."
        )
    log.info(
        f"[{ctx.where}] prompt_filter kept {len(kept)} of {len(rates)} prompts with a pass rate in "
        f"[{spec.low}, {spec.high}] ({counts['prompt_filter/too_hard']} too hard, "
        f"{counts['prompt_filter/too_easy']} too easy; {spec.k} samples each from the start policy)"
    )
    return kept, {**counts, **stats}


def measure(ctx, rows: list[dict], rewards: list, settings: SamplingSpec) -> tuple[list[dict], dict]:
    """([{'pass_rate'}] per row, {'prompt_filter/start_pass_rate'}): `settings.n` samples of every prompt."""
    sources = [row.get(SOURCE_PROMPT) or prompt_of(row) for row in rows]  # rlvr's rows hold the rendered prompt
    tokenizer = ctx.load_tokenizer()
    model = load_policy(ctx.start_model, ctx.recipe.trust_remote_code).to(PartialState().device)
    samples = generate(
        model,
        tokenizer,
        [render_prompt(tokenizer, s) for s in sources],
        settings,
        progress=f"{ctx.where} prompt_filter",
    )
    del model
    fresh = [VerifierReward(r.verifier, r.weight, r.__name__) for r in rewards]  # the stage's counts stay its own
    examples = [
        {**{k: v for k, v in rows[i].items() if k != SOURCE_PROMPT}, "prompt": sources[i]} for i in range(len(rows))
    ]
    scored = combined_scores(fresh, [s.text for s in samples], [examples[s.prompt_index] for s in samples])
    passes = Counter(s.prompt_index for s, score in zip(samples, scored) if score["passed"])
    rates = [{"pass_rate": passes[i] / settings.n} for i in range(len(rows))]
    start = sum(r["pass_rate"] for r in rates) / max(len(rates), 1)
    return rates, {"prompt_filter/start_pass_rate": start}


def trl_sampling(args) -> SamplingSpec:
    """rlvr's own sampling settings (a TRL GRPOConfig or RLOOConfig) as the filter's SamplingSpec."""
    return SamplingSpec(
        max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or 0
    )
