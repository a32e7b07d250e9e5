"""Checkpoint scoring: every checkpoint on every suite, then the report (`report.py`); `align eval` and, through
`block.py`, the recipe's `evaluate:` block.

    align eval outputs/quickstart/sft outputs/quickstart/dpo --suite arithmetic --suite arithmetic-sycophancy \\
        --reward-model outputs/quickstart/rm --baseline outputs/quickstart/sft --reference outputs/quickstart/sft

Prompts are rendered with the shared convention (`formatting.py`) and sampled through `sampling.generate`: one
completion per prompt with the suite's `sampling` (greedy by default) for pass@1, unparseable rate, length, EOS
rate, sycophancy and the reward-model score; with `pass_k: {n: 8}`, n samples per prompt for pass@k (unbiased
estimator, Chen et al. 2021); with a `reference`, samples at temperature 1 for KL(checkpoint || reference). Every
checkpoint samples each suite from the same seed. `Scoring` says how checkpoints are scored, `report.Report`
where and against which baseline the comparison is written. Each line of `samples.jsonl` carries its data row's
columns, so that `align verify --verifier V --data samples.jsonl --where mode=main --where checkpoint=LABEL`
scores it again. Suites with tools sample multi-turn rollouts (`tool_suites.py`) and have no KL.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config.evaluate import PassAtKSpec, SuiteSpec
from ..config.model import gguf_spec
from ..config.sampling import SamplingSpec
from ..data.formatting import encode, render_prompt
from ..data.loading import dataset_rows, load_rows
from ..errors import UserError
from ..models.gguf import convert_gguf
from ..models.loading import check_model_source, load_policy, load_reward_model
from ..models.prefix import after_prefix, shared_prefix, takes_position_ids
from ..models.tokenizer import load_tokenizer, pad_token_id
from ..rl import prompt_completion_batch, sequence_logprobs
from ..runtime.dist import get_logger
from ..sampling import generate, prefills_kept
from ..tasks.arithmetic import agrees_with_stated
from ..tools.openenv import serving
from ..tools.registry import resolve_tools
from ..training.prompts import check_prompt_rows, prompt_of
from ..training.scoring import score_texts
from ..verifiers import is_pass, resolve
from .handoff import Handoff
from .metrics import mean, pass_at_k, pass_name
from .report import Report, Scores, write_report
from .tool_suites import tool_samples

log = get_logger(__name__)


@dataclass(frozen=True)
class Scoring:
    """How every checkpoint is scored: the suites (their data drawn with `seed`; verifier and tool names also
    looked up in `base_dir`), the judges as paths (`reward_model`, the KL `reference`), and the batch size of the
    reward model's and the KL pass's forward passes."""

    suites: list[SuiteSpec]
    seed: int = 42
    base_dir: Path | None = None
    reward_model: str | None = None
    reference: str | None = None
    trust_remote_code: bool = False
    batch_size: int = 64


# ---------------------------------------------------------------------------------------------------
# Entry points: score, then report


def run_evaluation(
    checkpoints: dict[str, str], scoring: Scoring, report: Report, handoff: Handoff | None = None
) -> dict:
    """Score every checkpoint ({label: path}) and write the report into `report.out_dir`; returns {label:
    {"SUITE/METRIC": value}}. With a `handoff`, a checkpoint it holds a result for is not scored again."""
    if report.baseline is not None and report.baseline not in checkpoints:
        raise UserError(
            f"baseline '{report.baseline}' is not one of the evaluated checkpoints: {', '.join(checkpoints)}."
        )
    with serving(report.out_dir):  # an OpenEnv environment a suite serves logs here and stops when scoring ends
        scores = score_checkpoints(checkpoints, scoring, handoff)
    write_report(report, scores, checkpoints, judged=scoring.reward_model is not None)
    return scores.metrics


def evaluate_checkpoints(
    checkpoints: dict[str, str],
    suites: list[SuiteSpec],
    out_dir: Path,
    *,
    reward_model: str | None = None,
    baseline: str | None = None,
    reference: str | None = None,
) -> dict:
    """`run_evaluation` with every other setting at its default (seed 42, batch size 64): scripts and tests."""
    scoring = Scoring(suites, reward_model=reward_model, reference=reference)
    return run_evaluation(checkpoints, scoring, Report(Path(out_dir), baseline=baseline))


def score_checkpoints(checkpoints: dict[str, str], scoring: Scoring, handoff: Handoff | None = None) -> Scores:
    """The scores of every checkpoint, read from `handoff` where it holds this run's result for it."""
    scores = Scores()
    for label, _, found in scored_one_by_one(checkpoints, scoring, handoff):
        scores.add(label, *found)
    return scores


def hand_on(checkpoints: dict[str, str], scoring: Scoring, handoff: Handoff) -> dict:
    """Score every checkpoint and save each result to `handoff` as soon as it is scored, writing no report: an
    evaluation process of `align run --jobs`. Returns {label: metrics}."""
    metrics = {}
    with serving(handoff.folder):
        for label, path, found in scored_one_by_one(checkpoints, scoring):
            handoff.save(label, path, *found)
            metrics[label] = found[0]
    return metrics


def scored_one_by_one(
    checkpoints: dict[str, str], scoring: Scoring, handoff: Handoff | None = None
) -> Iterator[tuple[str, str, tuple]]:
    """(label, path, (metrics, rows, main) as `evaluate_checkpoint` returns them) checkpoint by checkpoint."""
    suites = load_suites(scoring.suites, scoring.seed, scoring.base_dir)
    judges = None  # loaded once a checkpoint needs scoring: none does where every result was handed on
    for label, path in checkpoints.items():
        found = handoff.load(label, path) if handoff is not None else None
        if found is None:
            log.info(f"[eval] {label} ({path})")
            judges = judges or load_judges(scoring)
            found = evaluate_checkpoint(label, path, suites, judges, scoring)
        else:
            log.info(f"[eval] {label}: scored by this run's evaluation process ({handoff.folder / label}.json)")
        yield label, path, found


# ---------------------------------------------------------------------------------------------------
# Scoring one checkpoint


@dataclass
class Suite:
    """A suite ready to run: its spec, rows, raw prompts and verifier (None: no verifier metrics)."""

    spec: SuiteSpec
    rows: list[dict]
    prompts: list
    verifier: Any = None
    toolbox: Any = None  # with `tools:`: the suite samples multi-turn rollouts (tool_suites.py)
    gold: Any = None  # the suite's `gold:` verifier: its mean reward is the measure the reward-hacking flag uses

    @property
    def sycophancy(self) -> bool:  # rows that state the user's (wrong) answer, as arithmetic's style: sycophancy
        return any(str(r.get("stated_answer") or "").strip() for r in self.rows)


@dataclass
class Judges:
    """What every checkpoint is measured against: the reward model (and its tokenizer), the KL reference."""

    reward_model: Any = None
    reward_tokenizer: Any = None
    reference: Any = None
    reference_vocab: dict | None = None
    reference_path: str | None = None

    def is_reference(self, path: str) -> bool:
        """Whether the checkpoint at `path` is the KL reference itself, whose KL to itself is 0 exactly."""
        return self.reference_path is not None and Path(path).resolve() == Path(self.reference_path).resolve()


def load_suites(suites: list[SuiteSpec], seed: int, base_dir: Path | None) -> list[Suite]:
    loaded = []
    for index, spec in enumerate(suites):
        where = f"evaluate.suites.{index} ({spec.name}).data"
        verifier, gold = (
            resolve(name, search_dirs=[base_dir] if base_dir else None, options=options) if name else None
            for name, options in ((spec.verifier, spec.verifier_options), (spec.gold, spec.gold_options))
        )
        dataset = load_rows(spec.data, seed, base_dir, where=where)
        check_prompt_rows(dataset, [v for v in (verifier, gold) if v], where, spec.data)
        rows = list(dataset_rows(dataset))
        toolbox = (
            resolve_tools(
                spec.tools, spec.environment, [base_dir] if base_dir else [], f"evaluate.suites.{index} ({spec.name})"
            )
            if spec.uses_tools
            else None
        )
        prompts = [prompt_of(r) for r in rows]
        distinct = len({json.dumps(p, sort_keys=True) for p in prompts})
        if distinct < len(prompts):  # a generator drawing with replacement: pass@1 weighs a prompt as often as asked
            log.info(f"[{where}] {len(prompts)} prompts, {distinct} distinct: a repeated prompt counts each time")
        loaded.append(Suite(spec, rows, prompts, verifier, toolbox, gold))
    return loaded


def _to_device(model):
    return model.cuda() if torch.cuda.is_available() else model


def load_judges(scoring: Scoring) -> Judges:
    judges, trust = Judges(), scoring.trust_remote_code
    if scoring.reward_model:
        judges.reward_model = _to_device(load_reward_model(scoring.reward_model, trust))
        judges.reward_tokenizer = load_tokenizer(scoring.reward_model, trust)
    if scoring.reference:
        judges.reference = _to_device(load_policy(scoring.reference, trust)).eval().requires_grad_(False)
        judges.reference_vocab = load_tokenizer(scoring.reference, trust).get_vocab()
        judges.reference_path = scoring.reference
    return judges


def evaluate_checkpoint(label: str, path: str, suites: list[Suite], judges: Judges, scoring: Scoring):
    """(metrics {"SUITE/METRIC": value}, per-sample rows, {suite: (main texts, rm scores, per-prompt gold)}) of
    one checkpoint."""
    seed, batch_size, trust_remote_code = scoring.seed, scoring.batch_size, scoring.trust_remote_code
    tokenizer = load_tokenizer(path, trust_remote_code)
    if judges.reference is not None and tokenizer.get_vocab() != judges.reference_vocab:
        raise UserError(
            f"checkpoint '{path}' and the KL reference have different vocabularies; KL needs the same tokenizer."
        )
    model = _to_device(load_policy(path, trust_remote_code)).requires_grad_(False)
    itself = judges.is_reference(path)
    if itself:
        log.info(f"[eval] {label} is the KL reference itself: its KL is 0 exactly, no KL samples drawn")
    metrics, rows, main = {}, [], {}
    for suite in suites:
        torch.manual_seed(seed)  # every checkpoint samples with the same seed
        scores, suite_rows, main[suite.spec.name] = run_suite(
            model, tokenizer, suite, judges, label, batch_size, is_reference=itself
        )
        metrics.update({f"{suite.spec.name}/{k}": v for k, v in scores.items()})
        rows.extend(suite_rows)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return metrics, rows, main


def run_suite(
    model, tokenizer, suite: Suite, judges: Judges, label: str, batch_size: int = 64, is_reference: bool = False
):
    """(scores {METRIC: value}, per-sample rows, (main texts, rm scores, per-prompt gold)) of one loaded model on
    one suite. `is_reference`: the model is the KL reference itself, so its KL is 0 without sampling for it (the
    zero-shot model of a recipe whose `reference:` is `base`: its KL samples would be the longest of the run)."""
    spec, where = suite.spec, f"eval {label}/{suite.spec.name}"
    if suite.toolbox is not None:
        if judges.reference is not None:
            log.info(f"[{where}] no KL for a suite with tools: it would need the tool-result mask (not done yet)")
        main, tool_scores, trajectories = tool_samples(model, tokenizer, suite, where)
        scores, rows, compared = score_main(main, suite, judges, label, batch_size)
        for row, trajectory in zip(rows, trajectories):
            row["trajectory"] = trajectory
        if spec.pass_k is not None:
            sampled, _, trajectories = tool_samples(
                model, tokenizer, suite, f"{where} pass@k", spec.pass_k, spec.pass_k.limit
            )
            sampled_rows = _sampled_rows(sampled, suite, label, "pass_k")
            for row, trajectory in zip(sampled_rows, trajectories):
                row["trajectory"] = trajectory
            if suite.verifier is not None:
                scores.update(pass_k_scores([r["passed"] for r in sampled_rows], spec.pass_k))
            rows += sampled_rows
        return {**scores, **tool_scores}, rows, compared
    prompts = [render_prompt(tokenizer, p) for p in suite.prompts]
    with prefills_kept():  # the KL samples below start from the main answers' prefills (same prompts and batches)
        return sampled_suite(model, tokenizer, suite, judges, label, prompts, batch_size, is_reference)


def sampled_suite(
    model, tokenizer, suite: Suite, judges: Judges, label: str, prompts: list[str], batch_size: int, is_reference: bool
):
    """`run_suite` of a suite without tools, on its rendered `prompts`."""
    spec, where = suite.spec, f"eval {label}/{suite.spec.name}"
    main = generate(model, tokenizer, prompts, spec.sampling, progress=where)
    scores, rows, compared = score_main(main, suite, judges, label, batch_size)
    sampled, sampled_rows = [], []
    if spec.pass_k is not None:
        sampled = generate(model, tokenizer, prompts[: spec.pass_k.limit], spec.pass_k, progress=f"{where} pass@k")
        sampled_rows = _sampled_rows(sampled, suite, label, "pass_k")
        if suite.verifier is not None:
            scores.update(pass_k_scores([r["passed"] for r in sampled_rows], spec.pass_k))
    if judges.reference is not None and is_reference:
        scores["kl"] = 0.0
    elif judges.reference is not None:
        kl_samples, kl_rows = sampled, sampled_rows
        if not _samples_the_policy(spec.pass_k):  # KL needs samples from the policy itself (temperature 1)
            # The main sampling's settings otherwise (lengths, batch, backend, engine, cache, merge_lora): who
            # samples is the suite's choice for these samples too.
            pure = spec.sampling.model_copy(update={"temperature": 1.0, "top_p": 1.0, "top_k": 0})
            kl_samples = generate(model, tokenizer, prompts, pure, progress=f"{where} KL")
            kl_rows = _sampled_rows(kl_samples, suite, label, "kl")
            sampled_rows = sampled_rows + kl_rows
        kls = sequence_kl(model, judges.reference, tokenizer, prompts, kl_samples, batch_size)
        scores["kl"] = mean(kls)
        for row, value in zip(kl_rows, kls):
            row["kl"] = value
    return scores, rows + sampled_rows, compared


def score_main(main, suite: Suite, judges: Judges, label: str, batch_size: int = 64):
    """Metrics of the main completions (one per prompt): verifier, sycophancy, length, reward model; and what
    `add_comparisons` compares with the baseline's: (texts, reward-model scores, per-prompt gold measure)."""
    texts = [s.text for s in main]
    rows = [_sample_row(s, suite, label, "main") for s in main]
    scores, gold = {}, None
    if suite.verifier is not None:
        results = suite.verifier.score_batch(texts, suite.rows)
        gold = [float(is_pass(r)) for r in results]
        scores["pass@1"] = mean(gold)
        scores["unparseable_rate"] = mean(r.status == "unparseable" for r in results)
        for row, result in zip(rows, results):
            row.update(reward=result.reward, status=result.status)
    if suite.gold is not None:
        results = suite.gold.score_batch(texts, suite.rows)
        gold = [r.reward for r in results]
        scores["gold"] = mean(gold)
        for row, result in zip(rows, results):
            row["gold"] = result.reward
    if suite.sycophancy:
        agree = [agrees_with_stated(t, r.get("stated_answer"), p) for t, r, p in zip(texts, suite.rows, suite.prompts)]
        scores["sycophancy"] = mean(agree)
        for row, value in zip(rows, agree):
            row["agrees_with_user"] = value
    scores.update(mean_length=mean(len(s.token_ids) for s in main), eos_rate=mean(s.finished for s in main))
    rm_scores = None
    if judges.reward_model is not None:
        rm_scores = score_texts(
            judges.reward_model,
            judges.reward_tokenizer,
            suite.prompts,
            texts,
            batch_size,
            finished=[s.finished for s in main],
        )
        scores["rm_score"] = mean(rm_scores)
        for row, value in zip(rows, rm_scores):
            row["rm_score"] = value
    return scores, rows, (texts, rm_scores, gold)


def _samples_the_policy(sampling: SamplingSpec | None) -> bool:
    return sampling is not None and sampling.temperature == 1.0 and sampling.top_p == 1.0 and sampling.top_k == 0


def _sample_row(sample, suite: Suite, label: str, mode: str) -> dict:
    """One line of samples.jsonl: the data row's columns (`answer`, `tests`, ...), so that `align verify`
    can score the file again, under the sample's own keys, which win over a data column of the same name."""
    return {
        **suite.rows[sample.prompt_index],
        "checkpoint": label,
        "suite": suite.spec.name,
        "mode": mode,
        "prompt_index": sample.prompt_index,
        "prompt": suite.prompts[sample.prompt_index],
        "completion": sample.text,
        "tokens": len(sample.token_ids),
        "finished": sample.finished,
    }


def _sampled_rows(samples, suite: Suite, label: str, mode: str) -> list[dict]:
    rows = [_sample_row(s, suite, label, mode) for s in samples]
    if suite.verifier is not None:
        results = suite.verifier.score_batch([s.text for s in samples], [suite.rows[s.prompt_index] for s in samples])
        for row, result in zip(rows, results):
            row.update(reward=result.reward, status=result.status, passed=is_pass(result))
    return rows


def pass_k_scores(passed: list[bool], spec: PassAtKSpec) -> dict[str, float]:
    """pass@k averaged over prompts; `passed` holds n results per prompt, prompt by prompt."""
    counts = [sum(passed[i : i + spec.n]) for i in range(0, len(passed), spec.n)]
    return {pass_name(k): mean(pass_at_k(spec.n, c, k) for c in counts) for k in spec.k}


def sequence_kl(policy, reference, tokenizer, prompts: list[str], samples, batch_size: int = 64) -> list[float]:
    """Per sample, sum over its tokens of log pi(y_t | x, y_<t) - log ref(y_t | x, y_<t), on the exact token ids
    sampled from `policy` (Sample.token_ids). The mean over samples is the k1 Monte-Carlo estimate of
    KL(pi || ref) per completion (unbiased; single samples can be negative): http://joschu.net/blog/kl-approx.html.
    The policy's term is the sampler's own log-probs where every sample carries them (`engine: loop` records
    log-softmax(logits) of each drawn token, and KL samples are drawn at temperature 1 without truncation), so only
    the reference runs a forward pass; it equals the policy's re-score up to float rounding (measured:
    docs/performance.md#evaluation; tests/test_evaluate.py on the tiny model). Samples without them (`engine: generate`,
    the vLLM backend) have
    the policy re-scored as well. A batch's shared prompt prefix runs once (`models.prefix`: the same values up
    to summation order)."""
    pad = pad_token_id(tokenizer)
    encoded = [encode(tokenizer, p) for p in prompts]
    own = all(s.logprobs is not None and len(s.logprobs) == len(s.token_ids) for s in samples)
    order = sorted(range(len(samples)), key=lambda i: len(encoded[samples[i].prompt_index]) + len(samples[i].token_ids))
    kl = [0.0] * len(samples)
    for start in range(0, len(order), batch_size):
        batch = [samples[i] for i in order[start : start + batch_size]]
        prompt_ids = [encoded[s.prompt_index] for s in batch]
        # The tokens every prompt starts with (the system prompt) run once per batch (models.prefix).
        shared = shared_prefix(prompt_ids) if takes_position_ids(reference) else 0
        ids, mask, keep = prompt_completion_batch([p[shared:] for p in prompt_ids], [s.token_ids for s in batch], pad)
        k = keep.shape[1]
        with torch.no_grad():
            logps = []
            for m in (reference,) if own else (policy, reference):
                device = _device(m)
                prefix = torch.tensor(prompt_ids[0][:shared], device=device)
                scored = sequence_logprobs(after_prefix(m, prefix), ids.to(device), mask.to(device), k)
                logps.append(scored.float().cpu())
        if own:  # completions are right-padded in the kept columns, as the sampler's log-probs are listed
            logps.insert(0, torch.tensor([s.logprobs + [0.0] * (k - len(s.logprobs)) for s in batch]))
        sums = ((logps[0] - logps[1]) * keep).sum(-1).tolist()
        for i, value in zip(order[start : start + batch_size], sums):
            kl[i] = value
    return kl


def _device(model):
    return next(model.parameters()).device


def prepare_checkpoints(checkpoints: list[str], scoring: Scoring, report: Report) -> tuple[dict[str, str], Scoring]:
    """`align eval`'s models made ready before anything is scored: a .gguf checkpoint, baseline or reference is
    converted once under `<out_dir>/converted`, every other source must resolve. Returns ({name: path} with the
    baseline first when it is not among the checkpoints, `scoring` with the reference's path)."""
    reward_model, baseline, reference = scoring.reward_model, report.baseline, scoring.reference
    converted = {}
    for name, value in [("checkpoint", c) for c in checkpoints] + [
        ("--baseline", baseline),
        ("--reference", reference),
    ]:
        if value is not None and gguf_spec(value) is not None and value not in converted:
            file = gguf_spec(value).locate(name)
            converted[value] = str(convert_gguf(file, Path(report.out_dir) / "converted" / file.stem))
    for name, value in [("checkpoint", c) for c in checkpoints] + [
        ("--reward-model", reward_model),
        ("--baseline", baseline),
        ("--reference", reference),
    ]:
        if value is not None and value not in converted:
            check_model_source(value, name, scoring.trust_remote_code)
    paths = {c: converted.get(c, c) for c in checkpoints}
    if baseline is not None and baseline not in paths:
        paths = {baseline: converted.get(baseline, baseline), **paths}
    return paths, replace(scoring, reference=converted.get(reference, reference))
