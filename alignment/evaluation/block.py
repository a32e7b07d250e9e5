"""The recipe's `evaluate:` block: which checkpoints it compares (labels are stage ids and `base`), checked by
`align check`, run by the runner at the end of a run. Under `align run --jobs N` its checkpoints are scored in
evaluation processes that hand their results on (`handoff.py`), and the block at the end reads them back.

    evaluate:
      include_base: true
      reward_model: ${rm}           # rm_score, win_rate, reward_hacking
      baseline: sft                 # win rate against it
      reference: sft                # KL to it
      suites:
        - arithmetic-sycophancy     # a built-in suite by name
        - {name: arithmetic, data: {task: arithmetic, split: test, n: 300}, verifier: arithmetic,
           sampling: {temperature: 0, max_new_tokens: 8}, pass_k: {n: 8, k: [1, 8], limit: 100}}
The reward-hacking flag marks a checkpoint whose reward-model score rose over the baseline's while its gold
measure fell: the suite's `gold:` verifier's mean reward where given, else its verifier's pass@1.
"""

from __future__ import annotations

from pathlib import Path

from ..config.evaluate import EvaluateSpec, model_of, named_stage
from ..models.loading import check_model_source
from ..runtime.dist import distributed_state, get_logger
from .evaluate import Scoring, hand_on, load_suites, run_evaluation
from .handoff import Handoff
from .report import Report, markdown_table

log = get_logger(__name__)


def checkpoints_of(recipe) -> dict[str, str]:
    """{label: path} of the checkpoints the block compares: base, the chosen stages, and the baseline."""
    spec: EvaluateSpec = recipe.evaluate
    ids = spec.after or [s for s, c in recipe.stages.items() if c.produces_policy]
    found = {"base": recipe.base_model()} if spec.include_base else {}
    found.update({s: str(recipe.stage_dir(s)) for s in ids})
    baseline = model_of(recipe, spec.baseline)
    return found if baseline is None or baseline[0] in found else {baseline[0]: baseline[1], **found}


def check_evaluate_block(recipe) -> None:
    spec: EvaluateSpec = recipe.evaluate
    load_suites(spec.suites, recipe.seed, recipe.base_dir)
    for key in ("baseline", "reference", "reward_model"):
        value = getattr(spec, key)
        if value is not None and named_stage(recipe, value, f"evaluate.{key}") is None:
            check_model_source(model_of(recipe, value)[1], f"evaluate.{key}", recipe.trust_remote_code)


def evaluation_inputs(recipe, label: str, path: str) -> set[str]:
    """The stages whose outputs the evaluation of checkpoint `label` reads: its own stage, the reward model's
    and the KL reference's (the baseline is compared with only when the report is written)."""
    spec: EvaluateSpec = recipe.evaluate
    stages = {label} if label in recipe.stages and path == str(recipe.stage_dir(label)) else set()
    for value in (spec.reward_model, spec.reference):
        stage = named_stage(recipe, value, "evaluate") if value is not None else None
        if stage is not None:
            stages.add(stage)
    return stages


def run_evaluate_block(recipe, run: str | None = None) -> dict:
    """Evaluate the block's checkpoints and write the report; with `run`, reuse what that run's evaluation
    processes handed on (and remove it once the report is written). Only the main process evaluates."""
    if not distributed_state().is_main_process:
        return {}
    checkpoints, scoring = ready_checkpoints(recipe), block_scoring(recipe)
    spec: EvaluateSpec = recipe.evaluate
    baseline = model_of(recipe, spec.baseline)
    report = Report(
        recipe.out / spec.output,
        baseline=baseline[0] if baseline and baseline[0] in checkpoints else None,
        hacking_margin=spec.reward_hacking_margin,
        curves={s: recipe.stage_dir(s) for s in recipe.stages},
    )
    handoff = Handoff(recipe.out / ".work" / "eval", run) if run else None
    metrics = run_evaluation(checkpoints, scoring, report, handoff)
    log.info(markdown_table(metrics))
    if handoff is not None:
        handoff.clear()
    return metrics


def hand_on_block(recipe, labels: list[str], run: str) -> dict:
    """Score the block's checkpoints named in `labels` and hand their results on under the run id `run`, writing
    no report: an evaluation process of `align run --jobs` (`run/jobs.py`)."""
    if not distributed_state().is_main_process:
        return {}
    checkpoints, scoring = ready_checkpoints(recipe, labels), block_scoring(recipe)
    return hand_on(checkpoints, scoring, Handoff(recipe.out / ".work" / "eval", run))


def is_ready(recipe, path: str) -> bool:
    """Whether the model at `path` can be evaluated: a stage output that was never produced is skipped, not an
    error."""
    stage = any(path == str(recipe.stage_dir(s)) for s in recipe.stages)
    if stage and not (Path(path) / "stage.json").exists():
        log.info(f"[eval] skipping {path}: the stage has not finished")
        return False
    return True


def ready_checkpoints(recipe, labels: list[str] | None = None) -> dict[str, str]:
    """{label: path} of the block's checkpoints (those in `labels`, if given) that can be evaluated now."""
    return {
        label: path
        for label, path in checkpoints_of(recipe).items()
        if (labels is None or label in labels) and is_ready(recipe, path)
    }


def block_scoring(recipe) -> Scoring:
    """How the block scores: its suites, the recipe's seed and folder, the judges that exist now."""
    spec: EvaluateSpec = recipe.evaluate
    reference, judge = (model_of(recipe, v) for v in (spec.reference, spec.reward_model))
    return Scoring(
        spec.suites,
        seed=recipe.seed,
        base_dir=recipe.base_dir,
        reward_model=judge[1] if judge and is_ready(recipe, judge[1]) else None,
        reference=reference[1] if reference and is_ready(recipe, reference[1]) else None,
        trust_remote_code=recipe.trust_remote_code,
        batch_size=spec.batch_size,
    )
