"""Checkpoint evaluation: the recipe's `evaluate:` block and `align eval`.

For each checkpoint and suite, prompts are rendered with the shared convention, sampled through
`generation.py` and scored by the suite's verifier. Outputs in the evaluation folder:
`metrics.json` shaped {"checkpoints": {LABEL: {"SUITE/METRIC": value}}}, per-sample
`samples.jsonl` and a Markdown `report.md` with one comparison table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from .data import DataSpec
from .errors import UserError
from .generation import SamplingSpec
from .schema import Strict, did_you_mean, explain


def greedy() -> SamplingSpec:
    return SamplingSpec(temperature=0.0, max_new_tokens=16)


class SuiteSpec(Strict):
    name: str
    data: DataSpec
    verifier: str = Field(description="verifier key or module:function scoring each completion")
    verifier_options: dict[str, Any] = Field(default_factory=dict)
    sampling: SamplingSpec = Field(default_factory=greedy)


class EvaluateSpec(Strict):
    after: list[str] | None = Field(None, description="stages to evaluate (default: every policy stage)")
    include_base: bool = False
    suites: list[SuiteSpec] = Field(min_length=1)
    output: str = "eval"


def validate_evaluate_block(recipe, path: Path) -> EvaluateSpec:
    try:
        spec = EvaluateSpec.model_validate(recipe.evaluate)
    except ValidationError as error:
        raise UserError(f"{path}: {explain(error, EvaluateSpec, prefix='evaluate')}") from None
    for stage_id in spec.after or []:
        if stage_id not in recipe.stages:
            raise UserError(f"{path}: evaluate.after names '{stage_id}', which is not a stage"
                            f"{did_you_mean(stage_id, recipe.stages)}; stages: {', '.join(recipe.stages)}.")
    return spec


def checkpoints_of(recipe) -> dict[str, str]:
    from .stages import NON_POLICY_KINDS

    spec: EvaluateSpec = recipe.evaluate
    ids = spec.after or [s for s, c in recipe.stages.items() if c.kind not in NON_POLICY_KINDS]
    found = {"base": recipe.base_model()} if spec.include_base else {}
    found.update({s: str(recipe.stage_dir(s)) for s in ids})
    return found


def check_evaluate_block(recipe) -> None:
    from .data import check_columns, load_rows
    from .verifiers import resolve

    for index, suite in enumerate(recipe.evaluate.suites):
        where = f"evaluate.suites.{index}"
        resolve(suite.verifier, search_dirs=[recipe.base_dir], options=suite.verifier_options)
        dataset = load_rows(suite.data, recipe.seed, recipe.base_dir, where=f"{where}.data")
        check_columns(dataset, [("prompt",), ("messages",)], f"{where}.data", suite.data)


def run_evaluate_block(recipe, log=print) -> dict:
    from .runner import distributed_state

    if not distributed_state().is_main_process:
        return {}
    spec: EvaluateSpec = recipe.evaluate
    return evaluate_checkpoints(checkpoints_of(recipe), spec.suites, recipe.out / spec.output, recipe.seed,
                                recipe.base_dir, recipe.trust_remote_code, log=log)


def evaluate_checkpoints(checkpoints: dict[str, str], suites: list[SuiteSpec], out_dir: Path, seed: int = 42,
                         base_dir: Path | None = None, trust_remote_code: bool = False, log=print) -> dict:
    """Score every checkpoint on every suite; write metrics.json, samples.jsonl and report.md."""
    from .data import load_rows
    from .verifiers import resolve

    out_dir.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, dict[str, float]] = {}
    samples: list[dict] = []
    loaded = [(s, load_rows(s.data, seed, base_dir, where=f"suite {s.name}"),
               resolve(s.verifier, search_dirs=[base_dir] if base_dir else None, options=s.verifier_options))
              for s in suites]
    for label, path in checkpoints.items():
        metrics[label] = {}
        for suite, dataset, verifier in loaded:
            scores, rows = score_checkpoint(path, suite, dataset, verifier, trust_remote_code, label)
            metrics[label].update({f"{suite.name}/{k}": v for k, v in scores.items()})
            samples.extend(rows)
    write_outputs(out_dir, metrics, samples)
    log(render_table(metrics))
    return metrics


def score_checkpoint(path: str, suite: SuiteSpec, dataset, verifier, trust_remote_code: bool, label: str):
    import torch

    from .formatting import render_prompt
    from .generation import generate
    from .models import load_policy, load_tokenizer

    tokenizer = load_tokenizer(path, trust_remote_code)
    model = load_policy(path, trust_remote_code)
    if torch.cuda.is_available():
        model = model.cuda()
    rows = [dict(r) for r in dataset]
    prompts = [render_prompt(tokenizer, r.get("prompt", r.get("messages"))) for r in rows]
    generated = generate(model, tokenizer, prompts, suite.sampling, progress=f"eval {label}/{suite.name}")
    n = suite.sampling.n
    results = [verifier.score(s.text, rows[s.prompt_index]) for s in generated]
    per_sample = [{"checkpoint": label, "suite": suite.name, "prompt_index": s.prompt_index, "completion": s.text,
                   "reward": r.reward, "status": r.status, "finished": s.finished} for s, r in zip(generated, results)]
    correct = [r.reward >= 1.0 for r in results]
    scores = {
        "accuracy": sum(correct[i * n] for i in range(len(rows))) / len(rows),
        "mean_reward": sum(r.reward for r in results) / len(results),
        "unparseable_rate": sum(r.status == "unparseable" for r in results) / len(results),
        "eos_rate": sum(s.finished for s in generated) / len(generated),
        "mean_length": sum(len(s.token_ids) for s in generated) / len(generated),
    }
    del model
    return scores, per_sample


def write_outputs(out_dir: Path, metrics: dict, samples: list[dict]) -> None:
    (out_dir / "metrics.json").write_text(json.dumps({"checkpoints": metrics}, indent=2))
    with open(out_dir / "samples.jsonl", "w") as handle:
        for row in samples:
            handle.write(json.dumps(row) + "\n")
    (out_dir / "report.md").write_text("# Evaluation\n\n" + markdown_table(metrics) + "\n")


def markdown_table(metrics: dict[str, dict[str, float]]) -> str:
    columns = sorted({k for m in metrics.values() for k in m})
    lines = ["| checkpoint | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for label, values in metrics.items():
        cells = [f"{values[c]:.3f}" if c in values else "" for c in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_table(metrics: dict[str, dict[str, float]]) -> str:
    return markdown_table(metrics)
