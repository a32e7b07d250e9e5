"""`rsft` stage: rejection-sampling fine-tuning (best-of-N filtering, then SFT), for several rounds.

Each round: sample `sampling.n` completions per prompt from the current policy (`sampling.generate`),
score them with `verifiers:` (weighted sum) or a `reward_model:` (`scoring.score_texts`), keep the
selected ones (`select:` best_of_n, top_k or threshold, optionally regularised by `kl_coef`: rules in
`select_samples`) and fine-tune on them with `trl.SFTTrainer`. The next round samples from the policy just
trained (expert iteration; Anthony et al. 2017, "RAFT" Dong et al. 2023, ReST-EM Singh et al. 2023).
`gold:` verifiers are scored and logged, never selected by; with `tools:` samples are multi-turn rollouts
(`sample_and_select`). Rounds, LoRA and resume: `run`. Round k's selected data is
`selected_round<k>.jsonl` in the output (prompt, completion, score), ready to reuse as SFT data.

    stages:
      rsft: {model: "${sft}", data: {task: arithmetic, split: train, n: 1000}, verifiers: [arithmetic],
             rounds: 2, sampling: {n: 8, temperature: 1.0, max_new_tokens: 16}, select: best_of_n,
             train: {learning_rate: 1.0e-4, num_train_epochs: 1}}           # train: -> trl.SFTConfig
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from accelerate import PartialState
from transformers import set_seed

from ..config.base import stage_ref
from ..data.formatting import encode, render_pair, render_prompt
from ..models.loading import check_model_source, load_policy, load_reward_model
from ..models.saving import save_checkpoint
from ..models.tokenizer import load_tokenizer, pad_token_id
from ..rl import completion_logprob_sums
from ..runtime.cpu import refuse_slow_bf16
from ..runtime.files import write_atomic
from ..sampling import generate, server
from ..sampling.samples import stop_token_ids
from ..tools.rollout import COUNTS
from ..training.context import StageContext
from ..training.health import report as report_health
from ..training.health import round_trend
from ..training.prompt_filter import filter_rows
from ..training.prompts import prompt_of
from ..training.rewards import (
    build_gold,
    build_rewards,
    combined_scores,
    gold_means,
    resolve_all,
)
from ..training.rows import count_truncated, drop_overlong, row_lengths, token_rows
from ..training.scoring import score_texts
from ..training.tool_rollouts import ToolRollouts, sample_trajectories
from ..training.trainer import make_sft_trainer, save_model, sft_config, train

log = logging.getLogger(__name__)


def sft_args(ctx: StageContext, folder: Path):
    return sft_config(
        ctx, work_dir=folder, completion_only_loss=True, max_length=1024, learning_rate=2e-5, num_train_epochs=1
    )


# ---------------------------------------------------------------------------------------------------
# Selection (pure)


def select_samples(
    candidates: list[dict], mode: str, k: int, threshold: float | None, by_verifier: bool, kl_coef: float = 0.0
) -> list[dict]:
    """The kept candidates of ONE prompt. A candidate: {'completion', 'score', 'parsed', 'passed', 'finished'},
    and with `kl_coef` its 'logprob' (summed over its tokens): ranked by score + kl_coef * logprob.

    Before selecting, empty, unfinished (no end-of-turn token; they would teach the model to stop mid-answer)
    and duplicate completions are dropped. Then `best_of_n` (default) keeps the best completion, `top_k` the
    `k` best, `threshold` every one left. With verifiers, a completion must pass every verifier unless
    `threshold` is set, in which case it must parse and score (weighted sum) at least `threshold`; with a reward
    model, `threshold` (if set) is the minimum score. `kl_coef` > 0 ranks by score + kl_coef * log p(y|x), p the
    policy that sampled the round at temperature 1 (regularized best-of-n, Jinnai et al. 2024): the candidate
    most probable under the KL-regularised optimum p * exp(score / kl_coef). A reward model's highest scores can
    go to the policy's odd samples, which the log-prob term discounts (measured on SmolLM2: docs/results.md)."""
    eligible, seen = [], set()
    rank = (lambda c: -c["score"] - kl_coef * c["logprob"]) if kl_coef else (lambda c: -c["score"])
    for c in sorted(candidates, key=rank):  # stable: ties keep sampling order
        text = c["completion"].strip()
        if not text or not c["finished"] or text in seen:
            continue
        if threshold is None and by_verifier and not c["passed"]:
            continue
        if threshold is not None and (c["score"] < threshold or not c["parsed"]):
            continue
        seen.add(text)
        eligible.append(c)
    return {"best_of_n": eligible[:1], "top_k": eligible[:k], "threshold": eligible}[mode]


# ---------------------------------------------------------------------------------------------------
# Data, scoring, sampling


# With tools, a selected row also holds its trajectory's token row and record (training/tool_rollouts.py).
TRAJECTORY_KEYS = ("input_ids", "completion_mask", "trajectory")


def make_scorer(ctx: StageContext):
    """(score(rows, prompts, samples) -> [{'score', 'parsed', 'passed'}], verifier rewards)."""
    if ctx.config.verifiers:
        rewards = build_rewards(ctx.config.verifiers, [ctx.recipe.base_dir], ctx.where)

        def score_by_verifiers(rows, prompts, samples):
            return combined_scores(
                rewards, [s.text for s in samples], [{**row, "prompt": p} for row, p in zip(rows, prompts)]
            )

        return score_by_verifiers, rewards

    path = ctx.resolve_model(ctx.config.reward_model)
    model = load_reward_model(path, ctx.recipe.trust_remote_code).to(_device())
    tokenizer = load_tokenizer(path, ctx.recipe.trust_remote_code)

    def score(rows, prompts, samples):
        values = score_texts(
            model,
            tokenizer,
            prompts,
            [s.text for s in samples],
            batch_size=ctx.config.rm_batch_size,
            finished=[s.finished for s in samples],
        )
        return [{"score": v, "parsed": True, "passed": True} for v in values]

    return score, []


def _device():
    return PartialState().device


def sample_logprobs(model, tokenizer, prompts: list, samples: list, batch_size: int, temperature: float) -> list[float]:
    """log p(y|x) of each sample's token ids under the policy that sampled it, at temperature 1 (`kl_coef`).
    Samples drawn at temperature 1 that carry the sampler's own log-probs (`engine: loop`: log-softmax of the
    logits before any truncation) are summed as they are, as evaluation's KL does; the rest are re-scored."""
    if temperature == 1.0 and all(s.logprobs is not None and len(s.logprobs) == len(s.token_ids) for s in samples):
        return [sum(s.logprobs) for s in samples]
    encoded = [encode(tokenizer, render_prompt(tokenizer, p)) for p in prompts]
    pad = pad_token_id(tokenizer)
    return completion_logprob_sums(
        model, [encoded[s.prompt_index] for s in samples], [s.token_ids for s in samples], pad, batch_size
    )


def round_prompts(rows: list[dict], round_index: int, per_round: int | None) -> list[dict]:
    """All rows, or the round's slice of `per_round` rows (wrapping around the data)."""
    if not per_round or per_round >= len(rows):
        return rows
    start = (round_index - 1) * per_round
    return [rows[(start + i) % len(rows)] for i in range(per_round)]


def sample_and_select(ctx: StageContext, round_index: int, policy: str, tokenizer, rows, scorer, gold=()):
    """Sample the round's prompts from `policy`, score, select; returns (selected rows, round stats). The `gold:`
    verifiers score every sample too (`gold/<name>` in the stats), never the selection.

    `gold:` verifiers score every sample of a round (`gold/<name>`, the round's mean, in the log history and as
    `round<k>/gold/<name>` in the metrics) and the selected ones (`selected_gold/<name>`: how often what the
    reward model chose is right, the quality of the data the round trains on). With `tools:` (or `environment:`)
    each sample is a multi-turn rollout: the scorers read its final answer, and a selected rollout is trained on
    as sampled, its own token ids with the tool results masked out of the loss; its trajectory is kept in the
    selected data."""
    cfg = ctx.config
    set_seed(ctx.seed + round_index)
    batch = round_prompts(rows, round_index, cfg.prompts_per_round)
    prompts = [prompt_of(r) for r in batch]
    model = load_policy(policy, ctx.recipe.trust_remote_code).to(_device())
    progress, token_rows_of = f"{ctx.where} round {round_index} sampling", None
    if cfg.uses_tools:  # multi-turn rollouts; each keeps its token row, tool results masked out of the loss
        tools = ToolRollouts(cfg, tokenizer, [ctx.recipe.base_dir], ctx.where)
        samples, token_rows_of = sample_trajectories(model, tokenizer, tools, prompts, batch, cfg.sampling, progress)
    elif cfg.sampling.server:
        samples = sample_on_server(ctx, policy, model, tokenizer, prompts)
    else:
        samples = generate(
            model, tokenizer, [render_prompt(tokenizer, p) for p in prompts], cfg.sampling, progress=progress
        )
    logprobs = (
        sample_logprobs(model, tokenizer, prompts, samples, cfg.sampling.batch_size, cfg.sampling.temperature)
        if cfg.kl_coef
        else None
    )
    del model
    scored = scorer([batch[s.prompt_index] for s in samples], [prompts[s.prompt_index] for s in samples], samples)
    selected, sources, covered, solved = [], [], 0, 0  # sources: each selected sample's row, for its gold score
    for i, prompt in enumerate(prompts):
        group = [
            {
                "completion": s.text,
                "finished": s.finished,
                **scored[i * cfg.sampling.n + j],
                **(token_rows_of[i * cfg.sampling.n + j] if token_rows_of else {}),
                **({"logprob": logprobs[i * cfg.sampling.n + j]} if logprobs else {}),
            }
            for j, s in enumerate(samples[i * cfg.sampling.n : (i + 1) * cfg.sampling.n])
        ]
        kept = select_samples(
            group, cfg.select, cfg.k, cfg.threshold, by_verifier=bool(cfg.verifiers), kl_coef=cfg.kl_coef
        )
        covered += bool(kept)
        if kept and cfg.max_pass_rate is not None and sum(c["passed"] for c in group) > cfg.max_pass_rate * len(group):
            solved += 1  # already answered most of the time: no row this round
            continue
        selected += [
            {
                "round": round_index,
                "prompt": prompt,
                "completion": c["completion"],
                "score": c["score"],
                **{k: c[k] for k in (*TRAJECTORY_KEYS, "logprob") if k in c},
            }
            for c in kept
        ]
        sources += [{**batch[i], "prompt": prompt}] * len(kept)
    n = max(len(samples), 1)
    stats = {
        "round": round_index,
        "prompts": len(prompts),
        "samples": len(samples),
        "selected": len(selected),
        "acceptance_rate": len(selected) / n,
        "prompt_coverage": covered / max(len(prompts), 1),
        "mean_score": sum(s["score"] for s in scored) / n,
        "selected_mean_score": sum(s["score"] for s in selected) / len(selected) if selected else 0.0,
        "unfinished_rate": sum(not s.finished for s in samples) / n,
    }
    if cfg.max_pass_rate is not None:
        stats["solved_skipped"] = solved
    if cfg.verifiers:
        stats["pass_rate"] = sum(s["passed"] for s in scored) / n
    if token_rows_of:  # what the rollouts did with their tools, per sample
        records = [r["trajectory"] for r in token_rows_of]
        stats["tool_call_rate"] = sum(r["tool_calls"] > 0 for r in records) / n
        stats.update({key: sum(r[key] for r in records) for key in COUNTS})
    stats.update(
        gold_means(
            list(gold),
            [s.text for s in samples],
            [{**batch[s.prompt_index], "prompt": prompts[s.prompt_index]} for s in samples],
        )
    )
    if selected:  # how good the selection is by the gold measure: the data the round trains on
        stats.update(
            {
                f"selected_{key}": value
                for key, value in gold_means(list(gold), [s["completion"] for s in selected], sources).items()
            }
        )
    log.info(
        f"[{ctx.where}] round {round_index}: kept {len(selected)} of {len(samples)} samples "
        f"(acceptance {stats['acceptance_rate']:.2f}, prompts covered {stats['prompt_coverage']:.2f}, "
        f"mean score {stats['mean_score']:.3f}"
        + (f"; {solved} prompts passing above max_pass_rate skipped" if cfg.max_pass_rate is not None else "")
        + ")"
    )
    return selected, stats


# ---------------------------------------------------------------------------------------------------
# Rounds


def sample_on_server(ctx: StageContext, policy: str, model, tokenizer, prompts: list) -> list:
    """`sampling.server: local`: vLLM's server started on this round's policy (its merged weights, so no adapter is
    pushed), the round's samples drawn and checked against the policy (`server.sample_policy`), the server stopped."""
    settings = ctx.config.sampling
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    ids = [encode(tokenizer, render_prompt(tokenizer, p)) for p in prompts]  # as `generate` feeds the HF sampler
    logs, where = ctx.out_dir / "logs", f"{ctx.where}.sampling"
    with server.start_local(str(policy), settings.vllm, 1, dtype, logs, where) as running:
        return server.sample_policy(running, model, tokenizer, ids, settings, stop_token_ids(tokenizer, model))


def cached_selection(ctx, round_index, policy, tokenizer, rows, scorer, gold=()) -> tuple[list[dict], dict]:
    """The round's selection, sampled once and kept in the work folder (`StageContext.computed_once`), so
    every process trains on the same data and a crash during training does not resample."""
    return ctx.computed_once(
        f"round{round_index}/selected.jsonl",
        lambda: sample_and_select(ctx, round_index, policy, tokenizer, rows, scorer, gold),
    )


def train_round(ctx: StageContext, round_index: int, policy: str, tokenizer, selected: list[dict]):
    """SFT the policy on the selected pairs; returns (new policy folder, trainer log history, rows truncated
    at max_length, which TRL cuts: counted and said as the sft stage does)."""
    folder = ctx.work_dir / f"round{round_index}"
    args = sft_args(ctx, folder)
    where = f"{ctx.where} round {round_index}"
    if "input_ids" in selected[0]:  # trajectories with tools: their own ids, tool results masked
        rows = [{k: r[k] for k in ("input_ids", "completion_mask")} for r in selected]
        rows = drop_overlong(rows, args.max_length, where, length=lambda r: r["completion_mask"].index(1))
    else:
        rows = drop_overlong(
            token_rows(tokenizer, [render_pair(tokenizer, r) for r in selected]), args.max_length, where
        )
    truncated = count_truncated(row_lengths(tokenizer, rows), args.max_length, where)
    policy_model = load_policy(policy, ctx.recipe.trust_remote_code, partitioned=True)
    trainer = make_sft_trainer(ctx, args, policy_model, tokenizer, rows)
    train(ctx, trainer)
    save_model(trainer, tokenizer, folder / "policy", ctx.save_dtype())
    return str(folder / "policy"), trainer.state.log_history, truncated


def finished_rounds(ctx: StageContext) -> list[dict]:
    """Records of the rounds a previous run finished, in order."""
    records = []
    for k in range(1, ctx.config.rounds + 1):
        path = ctx.work_dir / f"round{k}" / "round.json"
        if not path.exists():
            break
        records.append(json.loads(path.read_text()))
    return records


def check(ctx: StageContext) -> None:
    refuse_slow_bf16(ctx.config, ctx.where)
    sft_args(ctx, ctx.work_dir)
    if ctx.config.uses_tools:
        ToolRollouts(ctx.config, ctx.load_tokenizer(), [ctx.recipe.base_dir], ctx.where)
    if ctx.config.sampling.server:
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        spec = ctx.config.sampling.vllm
        server.check_settings("local", spec, ctx.lora, processes, f"{ctx.where}.sampling", adapters=False)
    verifiers = resolve_all(ctx.config.verifiers, [ctx.recipe.base_dir], ctx.where)
    gold = resolve_all(ctx.config.gold, [ctx.recipe.base_dir], ctx.where, entry="gold")
    rows = ctx.load_prompt_rows(ctx.config.data, "data", verifiers, gold)
    if ctx.config.reward_model and not stage_ref(ctx.config.reward_model):
        check_model_source(ctx.config.reward_model, f"{ctx.where}.reward_model", ctx.recipe.trust_remote_code)
    tokenizer = ctx.load_tokenizer()
    render_prompt(tokenizer, prompt_of(rows[0]))  # chat prompts need a chat template


def run(ctx: StageContext) -> dict:
    """Run the rounds not finished yet; returns the stage's metrics.

    Every round loads the policy the previous round produced (merged weights), trains a fresh adapter (with
    LoRA) or all weights, and saves merged weights. The stage output is the last round's policy; its
    `adapter/` is kept only with one round (with more, the adapter's base is an intermediate round that is not
    kept). Resume: each finished round leaves `round<k>/round.json` in the stage's work folder with its policy;
    a rerun continues with the next round. A round that crashed after sampling reuses its samples and resumes
    its trainer checkpoint."""
    cfg = ctx.config
    tokenizer = ctx.load_tokenizer()
    scorer, rewards = make_scorer(ctx)
    gold = build_gold(cfg.gold, [ctx.recipe.base_dir], ctx.where)
    rows = ctx.load_prompt_rows(ctx.config.data, "data", [r.verifier for r in rewards], [g.verifier for g in gold])
    kept, filtered = filter_rows(ctx, rows, rewards, cfg.sampling)  # every row, unless prompt_filter is set
    rows = [rows[i] for i in kept]
    records = finished_rounds(ctx)
    policy = records[-1]["policy"] if records else ctx.start_model
    if records:
        log.info(f"[{ctx.where}] resuming after round {len(records)} (policy {policy})")
    for k in range(len(records) + 1, cfg.rounds + 1):
        selected, stats = cached_selection(ctx, k, policy, tokenizer, rows, scorer, gold)
        history, truncated = [], 0
        if selected:
            policy, history, truncated = train_round(ctx, k, policy, tokenizer, selected)
        else:
            log.info(f"[{ctx.where}] round {k}: nothing selected; the policy is unchanged this round")
        record = {
            "round": k,
            "policy": policy,
            "stats": {**stats, "rows_truncated": truncated},
            "log_history": [{**h, "round": k} for h in history],
        }
        if ctx.is_main:
            write_atomic(ctx.work_dir / f"round{k}" / "round.json", json.dumps(record))
        records.append(record)
    if ctx.is_main:
        write_output(ctx, policy, records, load_policy, save_checkpoint, tokenizer)
        if cfg.uses_tools:  # how the policy calls its tools, beside the checkpoint
            ToolRollouts(cfg, tokenizer, [ctx.recipe.base_dir], ctx.where).save(ctx.out_dir)
    result = stage_result(records, rewards)
    signals = {**result["metrics"], **filtered, **round_trend([r["stats"] for r in records])}
    return {**result, "metrics": report_health("rsft", ctx.stage_id, signals)}


def write_output(ctx, policy: str, records: list[dict], load_policy, save_checkpoint, tokenizer) -> None:
    """The last policy (merged weights) and every round's selected data into the stage output."""
    if Path(policy).is_relative_to(ctx.work_dir):
        shutil.copytree(policy, ctx.out_dir, dirs_exist_ok=True)
        if len(records) > 1:  # its base is an intermediate round that is not kept (see `run`)
            shutil.rmtree(ctx.out_dir / "adapter", ignore_errors=True)
    else:  # no round selected anything: the output is the starting policy
        save_checkpoint(load_policy(policy, ctx.recipe.trust_remote_code), tokenizer, ctx.out_dir, ctx.save_dtype())
    for record in records:
        k = record["round"]
        source = ctx.work_dir / f"round{k}" / "selected.jsonl"
        lines = source.read_text().splitlines()[1:] if source.exists() else []
        (ctx.out_dir / f"selected_round{k}.jsonl").write_text("".join(line + "\n" for line in lines))


def stage_result(records: list[dict], rewards) -> dict:
    metrics, history = {}, []
    for record in records:
        k, stats = record["round"], record["stats"]
        history += record["log_history"]
        history.append(
            {
                "round": k,
                **{
                    key if key.startswith(("gold/", "selected_gold/")) else f"rsft/{key}": v
                    for key, v in stats.items()
                    if key != "round"
                },
            }
        )
        metrics.update(
            {
                f"round{k}/{key}": v
                for key, v in stats.items()
                if key
                in (
                    "acceptance_rate",
                    "mean_score",
                    "pass_rate",
                    "selected",
                    "prompt_coverage",
                    "solved_skipped",
                    "rows_truncated",
                    "tool_call_rate",
                    *COUNTS,
                )
                or key.startswith(("gold/", "selected_gold/"))
            }
        )
    for entry in records[-1]["log_history"] if records else []:
        metrics.update({k: v for k, v in entry.items() if isinstance(v, (int, float)) and k != "round"})
    metrics["rounds"] = len(records)
    metrics["rows_truncated"] = sum(record["stats"].get("rows_truncated", 0) for record in records)
    for reward in rewards:
        metrics.update(reward.totals())
    return {"metrics": metrics, "log_history": history}
