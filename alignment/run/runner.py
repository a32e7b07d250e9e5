"""Run a recipe's stages in order; `check_recipe` validates everything without training.

Output layout under the recipe's `output_dir`:
  base/             the tiny from-scratch model, or the plain checkpoint converted from a GGUF `model:`
  <stage>/          finished stage: checkpoint + tokenizer + log_history.json + README.md + stage.json
  .staging/<stage>/ a stage being written; moved to <stage>/ in one rename when complete
  .work/<stage>/    trainer checkpoints for resume; removed when the stage finishes
`stage.json` present = stage finished. Reruns skip finished stages (`force`, `only`, `start_from`).
Every process runs every stage (distributed training); only the main process writes files.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import torch.distributed

from .. import sampling
from ..config.base import did_you_mean
from ..config.recipe import GgufSpec, Recipe, TinyModel
from ..errors import UserError
from ..evaluation.block import (
    check_evaluate_block,
    checkpoints_of,
    evaluation_inputs,
    run_evaluate_block,
)
from ..models.gguf import convert_gguf
from ..models.loading import check_model_source
from ..models.lora import check_lora_targets
from ..models.tiny import build_tiny_model
from ..runtime.cpu import refuse_slow_bf16
from ..runtime.dist import distributed_state, get_logger, start_engine
from ..runtime.files import write_atomic
from ..runtime.redact import redact
from ..stages import stage_module
from ..tools.openenv import serving
from ..training.context import StageContext
from .jobs import evaluation_process, run_in_parallel
from .model_card import write_model_card

log = get_logger(__name__)


def select_stages(recipe: Recipe, only: list[str] | None, start_from: str | None) -> list[str]:
    order = list(recipe.stages)
    for name in (only or []) + ([start_from] if start_from else []):
        if name not in recipe.stages:
            raise UserError(f"no stage '{name}'{did_you_mean(name, order)} in the recipe; stages: {', '.join(order)}.")
    if only:
        return [s for s in order if s in only]
    if start_from:
        return order[order.index(start_from) :]
    return order


def is_finished(recipe: Recipe, stage_id: str) -> bool:
    return (recipe.stage_dir(stage_id) / "stage.json").exists()


def make_context(recipe: Recipe, stage_id: str, is_main: bool = True) -> StageContext:
    out = recipe.out
    return StageContext(
        recipe=recipe,
        stage_id=stage_id,
        config=recipe.stages[stage_id],
        start_model=recipe.start_model(stage_id),
        out_dir=out / ".staging" / stage_id,
        work_dir=out / ".work" / stage_id,
        lora=recipe.lora_for(stage_id),
        is_main=is_main,
    )


def ensure_writable(folder: Path) -> None:
    """Fail before any work when the output folder cannot be created or written."""
    probe = folder / f".write-test-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise UserError(
            f"output_dir '{folder}' is not writable ({error.strerror}); choose another output_dir "
            "or fix its permissions."
        ) from None


def ensure_base_model(recipe: Recipe) -> str:
    """The recipe's model as a loadable name; a tiny from-scratch model is built, or a GGUF file converted,
    there on first use."""
    if isinstance(recipe.model, TinyModel):
        build_tiny_model(recipe.model.tiny, recipe.seed, recipe.out / "base")
    elif isinstance(recipe.model, GgufSpec):
        convert_gguf(recipe.model.locate(), recipe.out / "base")
    return recipe.base_model()


def check_recipe(recipe: Recipe) -> None:
    """Deep validation: models resolve, data loads with the right columns, TRL configs build, verifiers
    resolve, LoRA targets exist. Stages that start from a stage not yet run are checked against the base."""
    with serving(None):  # an OpenEnv environment served to check a stage or suite stops when the check ends
        _check_recipe(recipe)


def _check_recipe(recipe: Recipe) -> None:
    ensure_writable(recipe.out)
    ensure_base_model(recipe)
    for stage_id, config in recipe.stages.items():
        ctx = make_context(recipe, stage_id)
        if not _is_stage_output(recipe, ctx.start_model):
            check_model_source(
                ctx.start_model, f"stages.{stage_id}.{config.start_model_key()}", recipe.trust_remote_code
            )
        else:
            ctx.start_model = _checkable(recipe, ctx.start_model)
        if ctx.lora is not None:
            check_lora_targets(ctx.start_model, ctx.lora, f"stages.{stage_id}.lora", recipe.trust_remote_code)
        stage_module(config.kind).check(ctx)
        log.info(f"  {stage_id} ({config.kind}): ok")
    if recipe.evaluate is not None:
        refuse_slow_bf16(recipe.evaluate, "evaluate")
        check_evaluate_block(recipe)
        log.info("  evaluate: ok")


def _is_stage_output(recipe: Recipe, model: str) -> bool:
    return any(model == str(recipe.stage_dir(s)) for s in recipe.stages)


def _checkable(recipe: Recipe, model: str) -> str:
    """A stage output that does not exist yet is checked with the base model's tokenizer."""
    return model if (Path(model) / "config.json").exists() else recipe.base_model()


def run_command(
    recipe: Recipe,
    *,
    force: bool = False,
    only: list[str] | None = None,
    start_from: str | None = None,
    evaluate: bool = True,
    jobs: int = 1,
    eval_only: list[str] | None = None,
) -> None:
    """What `align run` does: run the recipe (`run_recipe`), then tear the process group down; with `eval_only`
    (the hidden `--eval-only LABEL`), be an evaluation process of a `--jobs` run instead (`jobs.py`)."""
    if eval_only:
        evaluation_process(recipe, eval_only)
        return
    try:
        run_recipe(recipe, force=force, only=only, start_from=start_from, evaluate=evaluate, jobs=jobs)
    finally:
        close_process_group()


def run_recipe(
    recipe: Recipe,
    force: bool = False,
    only: list[str] | None = None,
    start_from: str | None = None,
    evaluate: bool = True,
    jobs: int = 1,
) -> dict[str, dict]:
    """Run the selected unfinished stages, then the evaluate block. With `jobs` > 1, independent stages
    run at once, each in its own process (`jobs.py`)."""
    state = distributed_state()
    flush_denormals()
    if jobs > 1 and state.num_processes > 1:
        raise UserError(
            f"--jobs {jobs} runs stages as separate one-process runs, so it cannot be combined with "
            f"accelerate launch ({state.num_processes} processes); drop one of the two."
        )
    if state.is_main_process:
        ensure_writable(recipe.out)
    engine = start_engine(recipe.out)
    if engine:
        log.info(f"engine: {engine} on {state.num_processes} processes")
    with state.main_process_first():
        ensure_base_model(recipe)
    to_run = []
    for stage_id in select_stages(recipe, only, start_from):
        if is_finished(recipe, stage_id) and not force:
            log.info(
                f"[{stage_id}] finished earlier ({recipe.stage_dir(stage_id) / 'stage.json'}); "
                "skipping (--force reruns)"
            )
        else:
            to_run.append(stage_id)
    check_inputs_produced(recipe, to_run)
    evaluating = evaluate and recipe.evaluate is not None
    run = uuid.uuid4().hex if jobs > 1 and evaluating else None
    if jobs > 1 and (to_run or evaluating):  # under --jobs a stage (or an evaluation) gets the threads it gets in a
        results = run_in_parallel(
            recipe,
            to_run,
            jobs,  # whole run, even alone
            evaluations=planned_evaluations(recipe, to_run) if evaluating else None,
            run=run or "",
        )
    else:
        results = {stage_id: run_stage(recipe, stage_id, state) for stage_id in to_run}
    if evaluating:
        run_evaluate_block(recipe, run=run)
    state.wait_for_everyone()
    return results


def planned_evaluations(recipe: Recipe, to_run: list[str]) -> dict[str, set[str]]:
    """{label: the stages among `to_run` it waits for} of each evaluate-block checkpoint that will exist once they
    have run: under --jobs each is scored in an evaluation process as soon as they have (`jobs.py`)."""
    planned = {}
    for label, path in checkpoints_of(recipe).items():
        needs = evaluation_inputs(recipe, label, path)
        if all(s in to_run or is_finished(recipe, s) for s in needs):
            planned[label] = needs & set(to_run)
    return planned


def check_inputs_produced(recipe: Recipe, stage_ids: list[str]) -> None:
    """Before any stage runs: every stage that one of `stage_ids` reads (`Recipe.dependencies`) runs too
    or has finished."""
    for stage_id in stage_ids:
        for needed in recipe.dependencies(stage_id):
            if needed not in stage_ids and not is_finished(recipe, needed):
                raise UserError(
                    f"stage '{stage_id}' reads the output of '{needed}', which has not been produced; run "
                    "the earlier stage first (drop --only/--from)."
                )


def flush_denormals() -> bool:
    """Make CPU arithmetic treat denormal floats (below ~1.2e-38 in fp32) as zero. Once a reward model
    separates its pairs by wide margins, its loss gradients shrink to e^-30 and below, and x86 CPUs
    compute with such numbers in slow microcode, so a long reward-model run slows down as it trains
    (measured: docs/performance.md#denormals). No training signal lives in values that small. Returns
    False where the CPU cannot flush them."""
    return torch.set_flush_denormal(True)


def close_process_group() -> None:
    """Tear down torch.distributed before exit: a gloo group left to interpreter shutdown can abort a
    worker ("terminate called without an active exception") after all its work is done. A vLLM engine
    (`backend: vllm`) is shut down first: its own exit hook tears down sub-groups of this group, and
    raises once the group is gone."""
    sampling.close()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_stage(recipe: Recipe, stage_id: str, state=None) -> dict:
    state = state or distributed_state()
    ctx = make_context(recipe, stage_id, is_main=state.is_main_process)
    if state.is_main_process:
        shutil.rmtree(ctx.out_dir, ignore_errors=True)
        ctx.out_dir.mkdir(parents=True)
        ctx.work_dir.mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()
    log.info(f"[{stage_id}] {ctx.config.kind} from {ctx.start_model}")
    started, cpu_started = time.time(), time.process_time()
    # serving: the OpenEnv environments the stage serves log into its folder and stop with it, error or not
    with disk_errors_explained(ctx), memory_errors_explained(ctx), serving(ctx.out_dir):
        result = stage_module(ctx.config.kind).run(ctx) or {}
        state.wait_for_everyone()
        record = {
            "metrics": result.get("metrics", {}),
            "wall_time_s": round(time.time() - started, 2),
            "cpu_time_s": round(time.process_time() - cpu_started, 2),
            "peak_rss_mib": peak_rss_mib(),
        }
        if state.is_main_process:
            finalize(ctx, record, result.get("log_history"))
    state.wait_for_everyone()
    log.info(f"[{stage_id}] done in {record['wall_time_s']:.1f}s -> {recipe.stage_dir(stage_id)}")
    return record


def peak_rss_mib() -> int:
    """This process's peak resident memory so far, in MiB: under `--jobs 1` the stages run in one process, so a
    stage's figure is the largest of its own and the stages before it. Next to `cpu_time_s` (this process's
    CPU seconds in the stage, all its threads) it says what a stage costs on a machine shared with other work,
    where `wall_time_s` does not."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / 1024) if os.uname().sysname == "Linux" else round(peak / 2**20)  # KiB on Linux, bytes on macOS


@contextlib.contextmanager
def disk_errors_explained(ctx: StageContext):
    """Turn a full disk or a permission error while writing into a clear error; the stage stays
    unfinished (its staging folder is never moved into place) and earlier stages are untouched."""
    try:
        yield
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT):
            raise
        raise UserError(
            f"stage '{ctx.stage_id}': could not write {error.filename or ctx.out_dir} ({error.strerror}). The stage "
            "is not marked finished and earlier stages are intact; free space or fix permissions, then rerun the "
            "recipe (it resumes from the last checkpoint)."
        ) from None


@contextlib.contextmanager
def memory_errors_explained(ctx: StageContext):
    """Turn an accelerator out-of-memory error into the settings that shrink this stage; like a disk
    error, it leaves the stage unfinished and its last checkpoint in place for a rerun."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        knobs = ctx.config.memory_knobs
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
        raise UserError(
            f"stage '{ctx.stage_id}' ({ctx.config.kind}) ran out of memory: {first_line}. The stage is not marked "
            f"finished and earlier stages are intact. To fit, change one of these under stages.{ctx.stage_id}: "
            f"{'; '.join(knobs)}; then rerun the recipe (it resumes from the last checkpoint)."
        ) from None


def stage_record(ctx: StageContext, record: dict) -> dict:
    lora = ctx.lora.model_dump(mode="json") if ctx.lora else None
    # The stage's own `lora` is unset when it inherits the recipe-level one; show what it trained with. Keys by
    # their recipe names (`async`, not the field's `async_`), so the record reads as the recipe did.
    config = {**ctx.config.model_dump(mode="json", by_alias=True), "lora": lora}
    return redact(
        {
            "stage": ctx.stage_id,
            "kind": ctx.config.kind,
            "recipe": ctx.recipe.name,
            "start_model": ctx.start_model,
            "lora": lora,
            "seed": ctx.seed,
            "config": config,
            "data_format": ctx.data_formats,
            **record,
            "versions": package_versions(),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    )


def finalize(ctx: StageContext, record: dict, log_history: list | None) -> None:
    """Write the stage's records into staging, then move staging into place in one rename.
    `stage.json` is written last inside staging, so a finished folder always has complete weights."""
    if log_history is not None:
        _write_json(ctx.out_dir / "log_history.json", redact(log_history))
    data = stage_record(ctx, record)
    write_model_card(ctx, data)
    _write_json(ctx.out_dir / "stage.json", data)
    final = ctx.recipe.stage_dir(ctx.stage_id)
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(ctx.out_dir, final)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(ctx.work_dir, ignore_errors=True)
    for parent in (ctx.out_dir.parent, ctx.work_dir.parent):  # .staging/ and .work/ once empty
        if parent.is_dir() and not any(parent.iterdir()):
            with contextlib.suppress(OSError):  # a stage running beside this one (--jobs) may have just used it
                parent.rmdir()


def _write_json(path: Path, data) -> None:
    write_atomic(path, json.dumps(data, indent=2, default=str))


def package_versions() -> dict[str, str]:
    names = ["alignment-toolkit", "torch", "transformers", "trl", "peft", "accelerate", "datasets"]
    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found
