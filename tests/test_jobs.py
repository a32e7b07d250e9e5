"""`align run --jobs N`: independent stages at once, each in its own process (alignment/run/jobs.py)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from conftest import REPO, SMALLEST_MODEL, run_cli, write_recipe
from safetensors.torch import load_file

from alignment.config.recipe import load_recipe
from alignment.errors import UserError
from alignment.run import jobs
from alignment.run.runner import run_recipe

TRAIN = {"num_train_epochs": 1, "per_device_train_batch_size": 16, "learning_rate": 3e-3, "max_length": 64,
         "logging_steps": 5}


def branching_recipe(tmp_path, name: str, **branch_b) -> dict:
    """sft, then two stages that both start from it and read nothing from each other."""
    branch = {"kind": "sft", "model": "${sft}", "data": {"task": "arithmetic", "n": 96}, "train": TRAIN}
    return {"name": name, "model": SMALLEST_MODEL, "output_dir": str(tmp_path / name), "seed": 3,
            "stages": {"sft": {"data": {"task": "arithmetic", "n": 160}, "train": TRAIN},
                       "a": branch, "b": {**branch, **branch_b}}}


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_dependencies_are_references_and_the_implicit_start():
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml")
    assert {s: recipe.dependencies(s) for s in recipe.stages} == {
        "sft": [], "rm": ["sft"], "ppo": ["sft", "rm"], "rlvr": ["sft"], "dpo": ["sft"], "rsft": ["sft", "rm"]}


def test_dependencies_include_the_previous_policy_stage(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, {
        "name": "chain", "model": SMALLEST_MODEL, "output_dir": str(tmp_path / "out"),
        "stages": {"sft": {"data": {"task": "arithmetic", "n": 8}},
                   "dpo": {"data": {"task": "arithmetic", "n": 8}}}}))
    assert recipe.dependencies("dpo") == ["sft"]


def test_parallel_branches_train_the_same_weights_as_a_sequential_run(tmp_path):
    """The branches overlap in time, write logs, and end bit-identical to running the stages in order."""
    path = write_recipe(tmp_path / "p", branching_recipe(tmp_path, "par"))
    result = run_cli("run", path, "--jobs", "2", env={"OMP_NUM_THREADS": "2"})  # one thread per child
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    position = {text: i for i, line in enumerate(lines) for text in ("[a] started", "[b] started", "[a] done",
                                                                     "[b] done", "[sft] done") if line.startswith(text)}
    assert "[sft] started in its own process (2 CPU threads)" in result.stdout  # nothing can run beside it
    assert position["[sft] done"] < position["[a] started"]
    assert max(position["[a] started"], position["[b] started"]) < min(position["[a] done"], position["[b] done"])
    out = tmp_path / "par"
    assert all((out / s / "stage.json").exists() and (out / "logs" / f"{s}.log").exists() for s in ("sft", "a", "b"))
    assert "[b] done in" in (out / "logs" / "b.log").read_text()
    first = weights(out / "a")
    rerun = run_cli("run", path, "--jobs", "2", "--only", "a", env={"OMP_NUM_THREADS": "2"})
    assert "[a] started in its own process (1 CPU thread)" in rerun.stdout  # alone, still on its share
    assert all(torch.equal(first[k], v) for k, v in weights(out / "a").items())

    threads = torch.get_num_threads()
    sequential = load_recipe(write_recipe(tmp_path / "s", branching_recipe(tmp_path, "seq")))
    try:
        torch.set_num_threads(2)  # sft: the whole machine
        run_recipe(sequential, only=["sft"])
        torch.set_num_threads(1)  # the branches: each one's share of two threads
        run_recipe(sequential, only=["a", "b"])
    finally:
        torch.set_num_threads(threads)
    for stage in ("sft", "a", "b"):
        ours, reference = weights(out / stage), weights(tmp_path / "seq" / stage)
        assert all(torch.equal(ours[k], reference[k]) for k in reference), stage
    assert not torch.equal(weights(out / "a")["model.norm.weight"], weights(out / "sft")["model.norm.weight"])


def test_a_failed_stage_names_itself_and_its_log_and_the_other_branch_is_kept(tmp_path):
    rows = tmp_path / "no_prompts.jsonl"  # found only when the stage loads it, inside its own process
    rows.write_text('{"question": "1+1=", "reply": "2"}\n' * 8)
    recipe = branching_recipe(tmp_path, "fail", data={"dataset": str(rows)})
    result = run_cli("run", write_recipe(tmp_path, recipe), "--jobs", "2", "--no-eval")
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
while partner and f"start {partner}" not in events.read_text().splitlines():
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
    chain = load_recipe(write_recipe(tmp_path, {
        "name": "chain", "model": SMALLEST_MODEL, "output_dir": str(tmp_path / "out"),
        "stages": {"sft": {"data": {"task": "arithmetic", "n": 8}}, "dpo": {"data": {"task": "arithmetic", "n": 8}},
                   "rsft": {"data": {"task": "arithmetic", "n": 8}, "verifiers": ["arithmetic"]}}}))
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

