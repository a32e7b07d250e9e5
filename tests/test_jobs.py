"""`align run --jobs N`: independent stages at once, each in its own process (alignment/run/jobs.py)."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch
from conftest import REPO, SMALLEST_MODEL, run_cli, run_cli_here, write_recipe
from safetensors.torch import load_file

from alignment.config.recipe import load_recipe
from alignment.errors import UserError
from alignment.evaluation import block
from alignment.evaluation.handoff import Handoff
from alignment.run import jobs, runner
from alignment.run.runner import run_recipe
from alignment.runtime.cpu import torch_threads

TRAIN = {
    "num_train_epochs": 1,
    "per_device_train_batch_size": 16,
    "learning_rate": 3e-3,
    "max_length": 64,
    "logging_steps": 5,
}


def branching_recipe(tmp_path, name: str, **branch_b) -> dict:
    """sft, then two stages that both start from it and read nothing from each other."""
    branch = {"kind": "sft", "model": "${sft}", "data": {"task": "arithmetic", "n": 96}, "train": TRAIN}
    return {
        "name": name,
        "model": SMALLEST_MODEL,
        "output_dir": str(tmp_path / name),
        "seed": 3,
        "stages": {
            "sft": {"data": {"task": "arithmetic", "n": 160}, "train": TRAIN},
            "a": branch,
            "b": {**branch, **branch_b},
        },
    }


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_dependencies_are_references_and_the_implicit_start():
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml")
    assert {s: recipe.dependencies(s) for s in recipe.stages} == {
        "sft": [],
        "rm": ["sft"],
        "ppo": ["sft", "rm"],
        "rlvr": ["sft"],
        "dpo": ["sft"],
        "rsft": ["sft", "rm"],
    }


def test_dependencies_include_the_previous_policy_stage(tmp_path):
    recipe = load_recipe(
        write_recipe(
            tmp_path,
            {
                "name": "chain",
                "model": SMALLEST_MODEL,
                "output_dir": str(tmp_path / "out"),
                "stages": {
                    "sft": {"data": {"task": "arithmetic", "n": 8}},
                    "dpo": {"data": {"task": "arithmetic", "n": 8}},
                },
            },
        )
    )
    assert recipe.dependencies("dpo") == ["sft"]


@pytest.fixture(scope="module")
def branching_run(tmp_path_factory):
    """One `align run --jobs 2` of the branching recipe with an evaluate block, then its two reruns: `--only a
    --no-eval`, and the first command with nothing left to train. Run once; the tests below read what they did."""
    tmp_path = tmp_path_factory.mktemp("branching")
    recipe = branching_recipe(tmp_path, "par")
    recipe["stages"]["sft"]["data"]["n"] = 64
    recipe["evaluate"] = {
        "include_base": True,
        "reference": "sft",
        "suites": [
            {
                "name": "arith",
                "data": {"task": "arithmetic", "split": "test", "n": 12},
                "verifier": "arithmetic",
                "sampling": {"temperature": 0, "max_new_tokens": 6},
            }
        ],
    }
    path = write_recipe(tmp_path / "p", recipe)
    out = tmp_path / "par"
    run = {"tmp_path": tmp_path, "path": path, "out": out, "recipe": recipe}
    run["first"] = run_cli("run", path, "--jobs", "2", env={"OMP_NUM_THREADS": "2"})  # one thread per child
    assert run["first"].returncode == 0, run["first"].stderr[-3000:]
    run["eval_logs"] = sorted(p.name for p in (out / "logs").glob("eval-*.log"))
    run["work_eval_left"] = (out / ".work" / "eval").exists()
    run["metrics"] = json.loads((out / "eval" / "metrics.json").read_text())
    run["weights"] = {s: weights(out / s) for s in ("sft", "a", "b")}
    # The reruns' parents run in this process (their stages and evaluations still run in child processes), on the
    # two threads the first run's parent had: it gives each child its share of them.
    with torch_threads(2):
        run["only_a"] = run_cli_here("run", path, "--jobs", "2", "--only", "a", "--no-eval")
        run["rerun"] = run_cli_here("run", path, "--jobs", "2")  # nothing to train: scored again
    return run


def test_parallel_branches_train_the_same_weights_as_a_sequential_run(branching_run):
    """The branches overlap in time, write logs, and end bit-identical to running the stages in order."""
    result, out, tmp_path = branching_run["first"], branching_run["out"], branching_run["tmp_path"]
    lines = result.stdout.splitlines()
    position = {
        text: i
        for i, line in enumerate(lines)
        for text in ("[a] started", "[b] started", "[a] done", "[b] done", "[sft] done")
        if line.startswith(text)
    }
    assert "[sft] started in its own process (2 CPU threads)" in result.stdout  # nothing can run beside it
    assert position["[sft] done"] < position["[a] started"]
    assert max(position["[a] started"], position["[b] started"]) < min(position["[a] done"], position["[b] done"])
    assert all((out / s / "stage.json").exists() and (out / "logs" / f"{s}.log").exists() for s in ("sft", "a", "b"))
    assert "[b] done in" in (out / "logs" / "b.log").read_text()
    first = branching_run["weights"]
    rerun = branching_run["only_a"]
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "[a] started in its own process (1 CPU thread)" in rerun.stdout  # alone, still on its share
    assert all(torch.equal(first["a"][k], v) for k, v in weights(out / "a").items())

    sequential_dir = tmp_path / "seq"
    seq_recipe = {**branching_run["recipe"], "name": "seq", "output_dir": str(sequential_dir)}
    sequential = load_recipe(write_recipe(tmp_path / "s", seq_recipe))
    with torch_threads(2):  # sft: the whole machine
        run_recipe(sequential, only=["sft"])
    with torch_threads(1):  # the branches: each one's share of two threads
        run_recipe(sequential, only=["a", "b"])
    for stage in ("sft", "a", "b"):
        ours, reference = first[stage], weights(sequential_dir / stage)
        assert all(torch.equal(ours[k], reference[k]) for k in reference), stage
    assert not torch.equal(first["a"]["model.norm.weight"], first["sft"]["model.norm.weight"])


def test_a_failed_stage_names_itself_and_its_log_and_the_other_branch_is_kept(tmp_path):
    """Two branches from the base model at once (a reward model and an SFT policy read nothing from each other):
    the SFT stage's data is missing its columns."""
    rows = tmp_path / "no_prompts.jsonl"  # found only when the stage loads it, inside its own process
    rows.write_text('{"question": "1+1=", "reply": "2"}\n' * 8)
    recipe = {
        "name": "fail",
        "model": SMALLEST_MODEL,
        "output_dir": str(tmp_path / "fail"),
        "seed": 3,
        "stages": {
            "a": {"kind": "reward", "data": {"task": "arithmetic", "n": 32}, "train": TRAIN},
            "b": {"kind": "sft", "data": {"dataset": str(rows)}, "train": TRAIN},
        },
    }
    path = write_recipe(tmp_path, recipe)
    assert load_recipe(path).dependencies("b") == []  # b runs beside a
    result = run_cli("run", path, "--jobs", "2", "--no-eval")
    assert result.returncode == 2, result.stderr[-3000:]
    error = " ".join(result.stderr.split())
    log_path = tmp_path / "fail" / "logs" / "b.log"
    assert "stage 'b' failed (exit code 2)" in error and str(log_path) in error
    assert "no_prompts.jsonl" in error and "question" in error  # the end of the child's log: the stage's own error
    assert (tmp_path / "fail" / "a" / "stage.json").exists()
    assert not (tmp_path / "fail" / "b" / "stage.json").exists()


def test_the_failure_report_survives_a_log_that_was_removed(tmp_path):
    log = tmp_path / "b.log"
    log.write_text("".join(f"line {i}\n" for i in range(20)))
    assert jobs.log_tail(log).splitlines() == [f"  line {i}" for i in range(5, 20)]
    log.unlink()
    assert "the log cannot be read" in jobs.log_tail(log) and "No such file" in jobs.log_tail(log)


FAKE_STAGE = """
import json, pathlib, sys, time
stage, out, seconds, partner = sys.argv[1], pathlib.Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
events = out / "events.txt"
with open(events, "a") as f: f.write(f"start {stage}\\n")
deadline = time.monotonic() + 300  # generous: only a scheduler that never runs the partner beside it waits it out
while partner and not any(line.startswith(f"start {partner}") for line in events.read_text().splitlines()):
    if time.monotonic() > deadline:
        sys.exit(f"{stage} never saw {partner} start while it ran: the two did not run at once")
    time.sleep(0.01)
time.sleep(seconds)  # some work, so that a stage started beyond the job limit would overlap the running ones
(out / stage).mkdir(parents=True, exist_ok=True)
(out / stage / "stage.json").write_text(json.dumps({"metrics": {"x": 1}, "wall_time_s": seconds}))
with open(events, "a") as f: f.write(f"end {stage}\\n")
"""


def test_scheduler_respects_dependencies_and_the_job_limit_and_starts_unblocking_stages_first(tmp_path, caplog):
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [f"output_dir={tmp_path}"])
    seconds = {"sft": 0.3, "rm": 0.6, "ppo": 0.3, "rlvr": 0.9, "dpo": 0.3, "rsft": 0.3}
    # rm and rlvr start together once sft is done: each ends only after it has seen the other start.
    partner = {"rm": "rlvr", "rlvr": "rm"}
    command = lambda _, s: [sys.executable, "-c", FAKE_STAGE, s, str(tmp_path), str(seconds[s]), partner.get(s, "")]
    with caplog.at_level(logging.INFO, logger="alignment"):
        results = jobs.run_in_parallel(recipe, list(recipe.stages), 2, command, poll_s=0.02)
    assert results["rlvr"] == {"metrics": {"x": 1}, "wall_time_s": 0.9}
    # The events in the order the stages wrote them (a stage writes its end before it exits): no clocks.
    events = [tuple(line.split()) for line in (tmp_path / "events.txt").read_text().splitlines()]
    for stage in recipe.stages:
        for needed in recipe.dependencies(stage):
            assert events.index(("end", needed)) < events.index(("start", stage)), (needed, stage)
    running, most = set(), 0
    for kind, stage in events:
        running = running | {stage} if kind == "start" else running - {stage}
        most = max(most, len(running))
    assert most == 2  # two at once (rm and rlvr, by their handshake), never more
    started = [m.split("]")[0][1:] for m in caplog.messages if " started in its own process (1 CPU thread" in m]
    assert started[:3] == ["sft", "rm", "rlvr"]  # rm unblocks ppo, so it goes before the first leaf
    assert sorted(started) == sorted(recipe.stages)


FAKE_EVALUATION = """
import pathlib, sys, time
out, labels = pathlib.Path(sys.argv[1]), sys.argv[2:]
with open(out / "events.txt", "a") as f: f.write(f"start eval {','.join(labels)}\\n")
time.sleep(0.1)
with open(out / "events.txt", "a") as f: f.write(f"end eval {','.join(labels)}\\n")
"""


def test_evaluations_start_in_free_slots_while_stages_still_run_once_their_inputs_exist(tmp_path, caplog):
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [f"output_dir={tmp_path}"])
    planned = runner.planned_evaluations(recipe, list(recipe.stages))
    # Each checkpoint waits for its own stage, the reward model (rm) and the KL reference (sft).
    assert planned == {
        "base": {"rm", "sft"},
        "sft": {"rm", "sft"},
        "ppo": {"ppo", "rm", "sft"},
        "dpo": {"dpo", "rm", "sft"},
        "rsft": {"rsft", "rm", "sft"},
        "rlvr": {"rlvr", "rm", "sft"},
    }
    seconds = {"sft": 0.3, "rm": 0.3, "ppo": 0.2, "rlvr": 0.2, "dpo": 0.2, "rsft": 0.2}
    # rlvr ends only once it has seen an evaluation start: they run at once, or rlvr waits out its deadline.
    partner = {"rlvr": "eval"}
    command = lambda _, s: [sys.executable, "-c", FAKE_STAGE, s, str(tmp_path), str(seconds[s]), partner.get(s, "")]
    evaluation = lambda _, labels: [sys.executable, "-c", FAKE_EVALUATION, str(tmp_path), *labels]
    with caplog.at_level(logging.INFO, logger="alignment"):
        jobs.run_in_parallel(
            recipe,
            list(recipe.stages),
            2,
            command,
            poll_s=0.02,
            evaluations=planned,
            run="r1",
            eval_command_for=evaluation,
        )
    events = [tuple(line.split()) for line in (tmp_path / "events.txt").read_text().splitlines()]
    scored = [
        (i, label)
        for i, (kind, what, *rest) in enumerate(events)
        if kind == "start" and what == "eval"
        for label in rest[0].split(",")
    ]
    assert sorted(label for _, label in scored) == sorted(planned)  # each checkpoint once
    for i, label in scored:
        assert all(events.index(("end", needed)) < i for needed in planned[label]), label
    assert min(i for i, _ in scored) < events.index(("end", "rlvr"))
    running, most = set(), 0
    for kind, *what in events:
        running = running | {tuple(what)} if kind == "start" else running - {tuple(what)}
        most = max(most, len(running))
    assert most == 2
    assert any(m.startswith("[eval ") and "started in its own process (1 CPU thread)" in m for m in caplog.messages)


def test_a_failed_evaluation_process_stops_nothing_and_its_checkpoints_are_scored_at_the_end(tmp_path, caplog):
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [f"output_dir={tmp_path}"])
    command = lambda _, s: [sys.executable, "-c", FAKE_STAGE, s, str(tmp_path), "0.05", ""]
    broken = lambda _, labels: [sys.executable, "-c", "import sys; sys.exit(3)"]
    with caplog.at_level(logging.INFO, logger="alignment"):
        results = jobs.run_in_parallel(
            recipe,
            list(recipe.stages),
            2,
            command,
            poll_s=0.02,
            run="r1",
            evaluations=runner.planned_evaluations(recipe, list(recipe.stages)),
            eval_command_for=broken,
        )
    assert sorted(results) == sorted(recipe.stages)
    assert any("failed (exit code 3" in m and "scores these checkpoints itself" in m for m in caplog.messages)


def test_evaluation_processes_hand_on_results_the_report_reuses_unchanged(branching_run):
    """A recipe with an evaluate block under --jobs 2: its checkpoints are scored in evaluation processes, the
    report reads their results, and they equal an evaluation in one process on the same thread count."""
    result, path = branching_run["first"], branching_run["path"]
    scored = [label for name in branching_run["eval_logs"] for label in name[: -len(".log")].split("-")[1:]]
    assert sorted(scored) == ["a", "b", "base", "sft"]  # each checkpoint in one evaluation process
    assert "scored by this run's evaluation process" in result.stdout
    assert not branching_run["work_eval_left"]  # the handed-on results are gone once the report is written
    parallel = branching_run["metrics"]
    assert sorted(parallel["checkpoints"]) == ["a", "b", "base", "sft"]
    assert parallel["checkpoints"]["sft"]["arith/kl"] == 0.0 and parallel["checkpoints"]["a"]["arith/kl"] != 0.0

    with torch_threads(1):  # what each evaluation process had
        alone = block.run_evaluate_block(load_recipe(path))  # a was retrained by the last rerun: the same weights
    assert alone == parallel["checkpoints"]

    rerun = branching_run["rerun"]
    assert rerun.returncode == 0 and "finished earlier" in rerun.stdout and "[eval base" in rerun.stdout


def test_a_handed_on_result_is_read_only_by_its_own_run_and_for_the_checkpoint_as_it_was(tmp_path):
    checkpoint = tmp_path / "ppo"
    checkpoint.mkdir()
    (checkpoint / "stage.json").write_text("{}")
    result = ({"arith/pass@1": 0.5}, [{"completion": "7"}], {"arith": (["7"], None, [1.0])})
    Handoff(tmp_path / "eval", "run-1").save("ppo", str(checkpoint), *result)
    assert Handoff(tmp_path / "eval", "run-1").load("ppo", str(checkpoint)) == result
    assert Handoff(tmp_path / "eval", "run-2").load("ppo", str(checkpoint)) is None  # another run scores again
    assert Handoff(tmp_path / "eval", "run-1").load("sft", str(checkpoint)) is None
    stamp = (checkpoint / "stage.json").stat().st_mtime_ns
    os.utime(checkpoint / "stage.json", ns=(stamp + 10**9, stamp + 10**9))  # the stage was written again
    assert Handoff(tmp_path / "eval", "run-1").load("ppo", str(checkpoint)) is None


def test_eval_only_outside_a_jobs_run_is_refused(tmp_path):
    result = run_cli_here("run", REPO / "recipes" / "quickstart.yaml", f"output_dir={tmp_path}", "--eval-only", "sft")
    assert result.returncode == 2 and "--eval-only is the evaluation process of `align run --jobs N`" in result.stderr


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_stage_whose_input_was_never_produced_is_refused_before_anything_starts(tmp_path, jobs):
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [f"output_dir={tmp_path}"])
    with pytest.raises(UserError, match="stage 'ppo' reads the output of 'sft', which has not been produced"):
        run_recipe(recipe, only=["ppo", "dpo"], jobs=jobs)
    with pytest.raises(UserError, match="stage 'ppo' reads the output of 'rm', which has not been produced"):
        run_recipe(recipe, only=["sft", "ppo"], jobs=jobs)
    assert not (tmp_path / "logs").exists() and not (tmp_path / ".staging").exists()


def test_a_stage_gets_the_whole_machine_only_where_the_graph_lets_nothing_run_beside_it(tmp_path, monkeypatch):
    quickstart = load_recipe(REPO / "recipes" / "quickstart.yaml")
    assert {s for s in quickstart.stages if jobs.runs_alone(quickstart, s)} == {"sft"}
    assert jobs.upstream(quickstart, "ppo") == {"sft", "rm"}
    chain = load_recipe(
        write_recipe(
            tmp_path,
            {
                "name": "chain",
                "model": SMALLEST_MODEL,
                "output_dir": str(tmp_path / "out"),
                "stages": {
                    "sft": {"data": {"task": "arithmetic", "n": 8}},
                    "dpo": {"data": {"task": "arithmetic", "n": 8}},
                    "rsft": {"data": {"task": "arithmetic", "n": 8}, "verifiers": ["arithmetic"]},
                },
            },
        )
    )
    assert all(jobs.runs_alone(chain, s) for s in chain.stages)  # each starts from the one before
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert jobs.whole_machine(jobs.slot_environments(2)[0]) == {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"}
    assert jobs.whole_machine({"CUDA_VISIBLE_DEVICES": "3"}) == {"CUDA_VISIBLE_DEVICES": "3"}


def test_jobs_split_cpu_threads_or_give_each_job_a_gpu(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert jobs.slot_environments(2) == [{"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}] * 2
    assert jobs.slot_environments(8)[0]["OMP_NUM_THREADS"] == "1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert jobs.slot_environments(2) == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    with pytest.raises(UserError, match="more parallel stages than there are GPUs"):
        jobs.slot_environments(3)


def test_jobs_cannot_be_combined_with_a_multi_process_launch(tmp_path, monkeypatch):
    from alignment.run import runner

    class TwoProcesses:
        num_processes, is_main_process = 2, True

    monkeypatch.setattr(runner, "distributed_state", lambda: TwoProcesses())
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [f"output_dir={tmp_path}"])
    with pytest.raises(UserError, match="cannot be combined with accelerate launch"):
        run_recipe(recipe, jobs=2)
