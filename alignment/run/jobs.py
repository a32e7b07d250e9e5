"""Run a recipe's independent stages at the same time, each in its own process (`align run --jobs N`).

A recipe's stages form a graph through their `${stage}` references and the implicit start from the
previous policy stage (`Recipe.dependencies`): in the quickstart, `ppo`, `dpo`, `rsft` and `rlvr` all
start from `sft` and read nothing from each other. With `--jobs N`, up to N stages run at once, each as
`align run RECIPE [overrides] --only STAGE --no-eval` in a child process, and a stage starts once every
stage it reads has finished. The stages themselves are unchanged: same code, same files, same
`stage.json`, same resume from `.work/`.

The machine is split between the jobs: on CPU each child gets its share of torch's threads (at least
one), on GPUs each child gets a GPU of its own. Why it pays on CPU: one process does not keep two cores
busy on a small model (two threads ran the quickstart's SFT 1.65x faster than one, not 2x), while two
one-thread processes ran side by side each as fast as alone. A stage that can never run beside another
(every other stage of the recipe is upstream or downstream of it, as the quickstart's `sft`) gets all
the threads instead. That is read from the recipe's graph, never from timing, so a stage trains on the
same number of threads in every run with the same `--jobs` (also `--only` one stage), and its floats come
out the same. A child's output goes to
`<output_dir>/logs/<stage>.log`.

The evaluate block's checkpoints are scored the same way, in evaluation processes (`align run RECIPE
[overrides] --eval-only LABEL ...`, logs `logs/eval-<labels>.log`): a checkpoint as soon as it and its judges
(reward model, KL reference) exist and a slot is free of stages, so that most of the evaluation runs while
the last stages train. The evaluate block at the end reads what they handed on (evaluation/handoff.py) and
writes the report: the quickstart's evaluation of six checkpoints ends 20 s after its last stage, where in
one process after the stages it took about 50 s (docs/performance.md). When a stage fails, no new stage starts; the stages already running
finish (their work is kept) and the run stops with the failed stage's error and the end of its log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config.recipe import Recipe
from ..errors import UserError
from ..evaluation.handoff import RUN_ENV
from ..runtime.dist import get_logger

log = get_logger(__name__)


@dataclass
class Job:
    stage_id: str
    process: subprocess.Popen
    log_path: Path


def slot_environments(jobs: int) -> list[dict[str, str]]:
    """The environment variables that give each of `jobs` children its share of the machine."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        if jobs > gpus:
            raise UserError(f"--jobs {jobs} asks for more parallel stages than there are GPUs ({gpus}); each stage "
                            f"gets a GPU of its own, so use --jobs {gpus} or fewer.")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
        return [{"CUDA_VISIBLE_DEVICES": ids[slot]} for slot in range(jobs)]
    threads = str(max(1, torch.get_num_threads() // jobs))
    return [{"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads} for _ in range(jobs)]


def whole_machine(slot: dict[str, str]) -> dict[str, str]:
    """The environment of a child that runs alone, from a slot's (`slot_environments`): every CPU thread; on
    GPUs the slot's own GPU (a one-process stage uses one)."""
    if "CUDA_VISIBLE_DEVICES" in slot:
        return slot
    threads = str(torch.get_num_threads())
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def upstream(recipe: Recipe, stage_id: str) -> set[str]:
    """Every stage whose output `stage_id` reads, directly or through others."""
    found, todo = set(), list(recipe.dependencies(stage_id))
    while todo:
        needed = todo.pop()
        if needed not in found:
            found.add(needed)
            todo.extend(recipe.dependencies(needed))
    return found


def runs_alone(recipe: Recipe, stage_id: str) -> bool:
    """Whether `stage_id` can never run at the same time as another stage of the recipe: each other stage
    is upstream of it or downstream of it."""
    before = upstream(recipe, stage_id)
    return all(s in before or stage_id in upstream(recipe, s) for s in recipe.stages if s != stage_id)


def describe(env: dict[str, str]) -> str:
    if "CUDA_VISIBLE_DEVICES" in env:
        return f"GPU {env['CUDA_VISIBLE_DEVICES']}"
    threads = env["OMP_NUM_THREADS"]
    return f"{threads} CPU thread{'s' if threads != '1' else ''}"


def stage_command(recipe: Recipe, stage_id: str) -> list[str]:
    """What a child runs: this recipe, with the same overrides, for one stage."""
    return [sys.executable, "-m", "alignment", "run", str(recipe.path), *recipe.overrides, "--only", stage_id,
            "--no-eval"]


def eval_command(recipe: Recipe, labels: list[str]) -> list[str]:
    """What an evaluation process runs: this recipe, with the same overrides, scoring `labels` only."""
    return [sys.executable, "-m", "alignment", "run", str(recipe.path), *recipe.overrides,
            *(arg for label in labels for arg in ("--eval-only", label))]


def run_in_parallel(recipe: Recipe, stage_ids: list[str], jobs: int,
                    command_for: Callable[[Recipe, str], list[str]] = stage_command,
                    poll_s: float = 0.2, evaluations: dict[str, set[str]] | None = None, run: str = "",
                    eval_command_for: Callable[[Recipe, list[str]], list[str]] = eval_command) -> dict[str, dict]:
    """Run `stage_ids` (in recipe order, dependencies respected) with up to `jobs` at once; returns each
    finished stage's record (metrics, wall time) as `run_stage` does. `run_recipe` has checked that every
    stage they read is among them or finished. `command_for(recipe, stage_id)`: a child's command line.

    `evaluations` ({checkpoint label: the stages its evaluation reads}): each checkpoint of the evaluate block
    is scored in an evaluation process once those stages have finished, in a slot no startable stage needs;
    the checkpoints ready at that moment are shared out among the free slots. Such a process hands its results
    to the evaluate block at the end of the run under the run id `run` (evaluation/handoff.py). One that fails
    stops nothing: the evaluate block scores its checkpoints itself, where their error shows."""
    envs = slot_environments(jobs)
    alone = whole_machine(envs[0])
    solo = {s for s in stage_ids if runs_alone(recipe, s)}
    log_dir = recipe.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    pending, running, results, failed = list(stage_ids), {}, {}, []
    waiting = dict(evaluations or {})  # checkpoints not yet handed to an evaluation process
    # Stages that others wait on start first (they unblock more work), then recipe order.
    unblocking = {needed for s in stage_ids for needed in recipe.dependencies(s)}

    def ready(stage_id: str) -> bool:
        unfinished = set(pending) | {job.stage_id for job in running.values()}
        return not (set(recipe.dependencies(stage_id)) & unfinished)

    def launch(name: str, command: list[str], share: dict[str, str], extra: dict[str, str], file: str) -> Job:
        log_path = log_dir / f"{file}.log"
        env = {**os.environ, **share, **extra, "ALIGN_NO_PROGRESS": "1", "TQDM_DISABLE": "1"}
        with open(log_path, "w") as out:  # the child keeps its own copy of the descriptor
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        log.info(f"[{name}] started in its own process ({describe(share)}); log: {log_path}")
        return Job(name, process, log_path)

    def start(stage_id: str, slot: int) -> Job:
        return launch(stage_id, command_for(recipe, stage_id), alone if stage_id in solo else envs[slot], {}, stage_id)

    def start_evaluations(free: list[int]) -> None:
        labels = [label for label, needs in waiting.items() if needs <= set(results)]
        shares = [labels[i::len(free)] for i in range(min(len(free), len(labels)))]
        for slot, share in zip(free, shares):
            for label in share:
                del waiting[label]
            running[slot] = launch(f"eval {', '.join(share)}", eval_command_for(recipe, share), envs[slot],
                                   {RUN_ENV: run}, "eval-" + "-".join(share))

    try:
        while pending or running or (waiting and not failed):
            startable = [] if failed else sorted((s for s in pending if ready(s)), key=lambda s: s not in unblocking)
            for stage_id in startable:
                free = [slot for slot in range(jobs) if slot not in running]
                if not free:
                    break
                pending.remove(stage_id)
                running[free[0]] = start(stage_id, free[0])
            free = [slot for slot in range(jobs) if slot not in running]
            if free and waiting and not failed:
                start_evaluations(free)
            if not running:
                break  # only after a failure: what is left waits on it
            time.sleep(poll_s)
            for slot, job in list(running.items()):
                code = job.process.poll()
                if code is None:
                    continue
                del running[slot]
                if job.stage_id.startswith("eval "):
                    log.info(f"[{job.stage_id}] " + ("done" if code == 0 else
                             f"failed (exit code {code}; log: {job.log_path}): the evaluation at the end of the run "
                             "scores these checkpoints itself"))
                elif code == 0:
                    results[job.stage_id] = finished_record(recipe, job.stage_id)
                    log.info(f"[{job.stage_id}] done in {results[job.stage_id]['wall_time_s']:.1f}s -> "
                             f"{recipe.stage_dir(job.stage_id)}")
                else:
                    failed.append((job, code))
                    log.info(f"[{job.stage_id}] failed (exit code {code}); stages already running will finish, "
                             "no new stage starts")
    except BaseException:  # Ctrl-C or an error here: stop the children rather than orphan them
        for job in running.values():
            job.process.terminate()
        for job in running.values():
            job.process.wait()
        raise
    if failed:
        job, code = failed[0]
        not_run = ", ".join(pending)
        raise UserError(
            f"stage '{job.stage_id}' failed (exit code {code}); its log is {job.log_path}. "
            + (f"Not started because of it: {not_run}. " if not_run else "")
            + "Stages that finished are kept; fix the cause and rerun the recipe (finished stages are skipped). "
            f"The end of the log:\n{log_tail(job.log_path)}"
        )
    return results


def finished_record(recipe: Recipe, stage_id: str) -> dict:
    """The record `run_stage` returns, read back from the `stage.json` the child wrote."""
    record = json.loads((recipe.stage_dir(stage_id) / "stage.json").read_text())
    return {"metrics": record["metrics"], "wall_time_s": record["wall_time_s"]}


def log_tail(path: Path, lines: int = 15) -> str:
    """The last `lines` of a stage's log, indented; what happened to it where it can no longer be read (removed,
    say, while the stage ran), so the report of a failure never fails itself."""
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError as error:
        return f"  (the log cannot be read: {error.strerror or error})"
    return "\n".join("  " + line for line in text[-lines:])
