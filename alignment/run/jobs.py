"""Run a recipe's independent stages at the same time, each in its own process (`align run --jobs N`).

Stages form a graph through their `${stage}` references and the implicit start from the previous policy stage
(`Recipe.dependencies`). Up to N jobs run at once: a stage job runs `align run RECIPE [overrides] --only STAGE
--no-eval` once every stage it reads has finished; an evaluation job runs `align run RECIPE [overrides]
--eval-only LABEL ...` (`evaluation_process`) once a checkpoint and its judges exist and a slot is free of
stages, and hands its results to the evaluate block at the end (evaluation/handoff.py). Stages themselves are
unchanged: same code, files, `stage.json`, resume from `.work/`. Logs: `<output_dir>/logs/<stage>.log`,
`logs/eval-<labels>.log`.

Each job gets its slot's share of the machine: on CPU its share of torch's threads (at least one), on GPUs a GPU
of its own; a stage nothing can run beside (every other stage is up- or downstream of it) gets all the threads.
That is read from the graph, never from timing, so a stage trains on the same threads, and its floats come out
the same, in every run with the same `--jobs` (measured: docs/performance.md#parallel-stages). When a stage
fails, no new stage starts; running ones finish and the run stops with its error and the end of its log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import torch

from ..config.recipe import Recipe
from ..errors import UserError
from ..evaluation.block import hand_on_block
from ..evaluation.handoff import RUN_ENV
from ..runtime.dist import get_logger

log = get_logger(__name__)


class JobKind(Enum):
    STAGE = "stage"  # trains one stage (`stage_command`)
    EVALUATION = "evaluation"  # scores checkpoints of the evaluate block (`eval_command`)


@dataclass
class Job:
    kind: JobKind
    name: str  # the stage id; for an evaluation, "eval " and its labels
    process: subprocess.Popen
    log_path: Path


def slot_environments(jobs: int) -> list[dict[str, str]]:
    """The environment variables that give each of `jobs` children its share of the machine."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        if jobs > gpus:
            raise UserError(
                f"--jobs {jobs} asks for more parallel stages than there are GPUs ({gpus}); each stage "
                f"gets a GPU of its own, so use --jobs {gpus} or fewer."
            )
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
    return [
        sys.executable,
        "-m",
        "alignment",
        "run",
        str(recipe.path),
        *recipe.overrides,
        "--only",
        stage_id,
        "--no-eval",
    ]


def eval_command(recipe: Recipe, labels: list[str]) -> list[str]:
    """What an evaluation process runs: this recipe, with the same overrides, scoring `labels` only."""
    return [
        sys.executable,
        "-m",
        "alignment",
        "run",
        str(recipe.path),
        *recipe.overrides,
        *(arg for label in labels for arg in ("--eval-only", label)),
    ]


def evaluation_process(recipe: Recipe, labels: list[str]) -> dict:
    """What an evaluation job runs (`align run RECIPE --eval-only LABEL ...`): score `labels` and hand their
    results on under the id of the run that started it (in the environment). Refused anywhere else."""
    if recipe.evaluate is None or not os.environ.get(RUN_ENV):
        raise UserError(
            "--eval-only is the evaluation process of `align run --jobs N` and runs only under it "
            "(the recipe's evaluate block, the run's id in the environment); run `align run RECIPE` "
            "or `align eval` instead."
        )
    return hand_on_block(recipe, labels, os.environ[RUN_ENV])


@dataclass
class Launcher:
    """Starts jobs: each in a process of its own with its slot's share of the machine, its log in `log_dir`."""

    recipe: Recipe
    envs: list[dict[str, str]]  # each slot's environment (`slot_environments`)
    alone: dict[str, str]  # the environment of a stage that gets the whole machine (`whole_machine`)
    solo: set[str]  # the stages that do (`runs_alone`)
    log_dir: Path
    run: str  # the id evaluation jobs hand their results on under
    command_for: Callable[[Recipe, str], list[str]] = stage_command
    eval_command_for: Callable[[Recipe, list[str]], list[str]] = eval_command

    def stage(self, stage_id: str, slot: int) -> Job:
        share = self.alone if stage_id in self.solo else self.envs[slot]
        return self._launch(JobKind.STAGE, stage_id, self.command_for(self.recipe, stage_id), share, {}, stage_id)

    def evaluation(self, labels: list[str], slot: int) -> Job:
        return self._launch(
            JobKind.EVALUATION,
            f"eval {', '.join(labels)}",
            self.eval_command_for(self.recipe, labels),
            self.envs[slot],
            {RUN_ENV: self.run},
            "eval-" + "-".join(labels),
        )

    def _launch(
        self, kind: JobKind, name: str, command: list[str], share: dict[str, str], extra: dict[str, str], file: str
    ) -> Job:
        log_path = self.log_dir / f"{file}.log"
        env = {**os.environ, **share, **extra, "ALIGN_NO_PROGRESS": "1", "TQDM_DISABLE": "1"}
        with open(log_path, "w") as out:  # the child keeps its own copy of the descriptor
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        log.info(f"[{name}] started in its own process ({describe(share)}); log: {log_path}")
        return Job(kind, name, process, log_path)


@dataclass
class Schedule:
    """Where a `--jobs` run stands: what is left to start, what runs in which slot, what finished or failed."""

    recipe: Recipe
    slots: int
    pending: list[str]  # stages not started yet, in recipe order
    waiting: dict[str, set[str]]  # checkpoints not yet given to an evaluation job: {label: the stages it reads}
    running: dict[int, Job] = field(default_factory=dict)  # {slot: job}
    results: dict[str, dict] = field(default_factory=dict)  # {stage: record} of the stages that finished
    failed: list[tuple[Job, int]] = field(default_factory=list)  # (stage job, exit code)
    unblocking: set[str] = field(init=False)  # the stages pending stages read: started first

    def __post_init__(self) -> None:
        self.unblocking = {needed for s in self.pending for needed in self.recipe.dependencies(s)}

    def busy(self) -> bool:
        return bool(self.pending or self.running or (self.waiting and not self.failed))

    def free(self) -> list[int]:
        return [slot for slot in range(self.slots) if slot not in self.running]

    def startable(self) -> list[str]:
        """Pending stages whose inputs have all finished: none after a failure. Stages that others wait on
        come first (they unblock more work), then recipe order."""
        if self.failed:
            return []
        unfinished = set(self.pending) | {job.name for job in self.running.values() if job.kind is JobKind.STAGE}
        ready = (s for s in self.pending if not set(self.recipe.dependencies(s)) & unfinished)
        return sorted(ready, key=lambda s: s not in self.unblocking)

    def start_stages(self, launcher: Launcher) -> None:
        for stage_id in self.startable():
            free = self.free()
            if not free:
                break
            self.pending.remove(stage_id)
            self.running[free[0]] = launcher.stage(stage_id, free[0])

    def start_evaluations(self, launcher: Launcher) -> None:
        """Share the checkpoints whose inputs have finished among the free slots, one evaluation job each."""
        free = self.free()
        if not free or not self.waiting or self.failed:
            return
        labels = [label for label, needs in self.waiting.items() if needs <= set(self.results)]
        shares = [labels[i :: len(free)] for i in range(min(len(free), len(labels)))]
        for slot, share in zip(free, shares):
            for label in share:
                del self.waiting[label]
            self.running[slot] = launcher.evaluation(share, slot)

    def collect_finished(self) -> None:
        for slot, job in list(self.running.items()):
            code = job.process.poll()
            if code is None:
                continue
            del self.running[slot]
            if job.kind is JobKind.EVALUATION:
                log.info(
                    f"[{job.name}] "
                    + (
                        "done"
                        if code == 0
                        else f"failed (exit code {code}; log: {job.log_path}): the evaluation at the end of the run "
                        "scores these checkpoints itself"
                    )
                )
            elif code == 0:
                self.results[job.name] = finished_record(self.recipe, job.name)
                log.info(
                    f"[{job.name}] done in {self.results[job.name]['wall_time_s']:.1f}s -> "
                    f"{self.recipe.stage_dir(job.name)}"
                )
            else:
                self.failed.append((job, code))
                log.info(
                    f"[{job.name}] failed (exit code {code}); stages already running will finish, no new stage starts"
                )

    def stop(self) -> None:
        """Stop the running children rather than orphan them (Ctrl-C, or an error in this process)."""
        for job in self.running.values():
            job.process.terminate()
        for job in self.running.values():
            job.process.wait()

    def failure(self) -> UserError:
        job, code = self.failed[0]
        not_run = ", ".join(self.pending)
        return UserError(
            f"stage '{job.name}' failed (exit code {code}); its log is {job.log_path}. "
            + (f"Not started because of it: {not_run}. " if not_run else "")
            + "Stages that finished are kept; fix the cause and rerun the recipe (finished stages are skipped). "
            f"The end of the log:\n{log_tail(job.log_path)}"
        )


def run_in_parallel(
    recipe: Recipe,
    stage_ids: list[str],
    jobs: int,
    command_for: Callable[[Recipe, str], list[str]] = stage_command,
    poll_s: float = 0.2,
    evaluations: dict[str, set[str]] | None = None,
    run: str = "",
    eval_command_for: Callable[[Recipe, list[str]], list[str]] = eval_command,
) -> dict[str, dict]:
    """Run `stage_ids` (in recipe order, dependencies respected) with up to `jobs` at once; returns each
    finished stage's record (metrics, wall time) as `run_stage` does. `run_recipe` has checked that every
    stage they read is among them or finished. `command_for(recipe, stage_id)`: a child's command line.

    `evaluations` ({checkpoint label: the stages its evaluation reads}): each checkpoint of the evaluate block
    is scored in an evaluation job once those stages have finished, in a slot no startable stage needs; the
    checkpoints ready at that moment are shared out among the free slots. Such a job hands its results to the
    evaluate block at the end of the run under the run id `run`. One that fails stops nothing: the evaluate
    block scores its checkpoints itself, where their error shows."""
    envs = slot_environments(jobs)
    solo = {s for s in stage_ids if runs_alone(recipe, s)}
    log_dir = recipe.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    launcher = Launcher(recipe, envs, whole_machine(envs[0]), solo, log_dir, run, command_for, eval_command_for)
    schedule = Schedule(recipe, jobs, list(stage_ids), dict(evaluations or {}))
    try:
        while schedule.busy():
            schedule.start_stages(launcher)
            schedule.start_evaluations(launcher)
            if not schedule.running:
                break  # only after a failure: what is left waits on it
            time.sleep(poll_s)
            schedule.collect_finished()
    except BaseException:
        schedule.stop()
        raise
    if schedule.failed:
        raise schedule.failure()
    return schedule.results


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
