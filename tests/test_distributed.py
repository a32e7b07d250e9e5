"""Every stage kind on two gloo processes: DDP, FSDP2, DeepSpeed ZeRO-2, ZeRO-3 (as two "machines" over loopback).

One recipe runs every stage kind twice, with LoRA and with full weights (the `_full` stages), a few steps
each, then the evaluate block; tiny models, fp32, loopback only. The DDP run (configs/accelerate/cpu_2proc.yaml)
is the baseline: each rank writes a digest of its trainable weights per stage (tests/rank_digests.py), and
the ranks must agree, since they trained on different data shards. Every engine run must end with the
DDP run's checkpoints: FSDP2 bit for bit or within FSDP2_TOLERANCE, DeepSpeed within DEEPSPEED_TOLERANCE
(its reduce-scatter sums gradients in another order), both far below how far training moved the weights.
In every engine run one PPO stage is killed (SIGKILL, every process) right after its checkpoint at update
2 and the rerun resumes it from there (`accelerator.save_state`/`load_state`), so "ends with the DDP
weights" also says the resume restored the engine's model, optimizer and scheduler state: full weights
under FSDP2 and ZeRO-3, LoRA under ZeRO-2.

    python -m pytest tests/test_distributed.py -q -m slow     (DeepSpeed tests skip without `deepspeed`)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO, TINY_MODEL, write_recipe
from safetensors.torch import load_file

# A random-init policy never gets an arithmetic answer right, so the RL stages would see all-zero rewards
# and not move; this verifier (a file next to the recipe) gives every sample a different score.
DIGITS = """
def digit_share(completion, **row):
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
"""
FEW = {"per_device_train_batch_size": 4, "max_steps": 3, "learning_rate": 1.0e-3, "max_length": 64}
FULL = {"lora": None}
# merge_lora off: FSDP2 cannot merge LoRA in place for sampling (sharding.can_merge_lora), and merged and
# unmerged sampling round differently, which would hide a real difference behind a loose tolerance. Two
# micro-batches per optimizer step: accumulation is each engine's own (DeepSpeed steps inside backward).
PPO = {
    "kind": "ppo",
    "verifiers": [{"name": "my_verifiers:digit_share"}],
    "data": {"task": "arithmetic", "n": 64},
    "rollout": {"batch_size": 8, "max_new_tokens": 6, "merge_lora": False},
    "train": {
        "total_updates": 3,
        "save_every": 1,
        "mini_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "ppo_epochs": 1,
        "learning_rate": 1.0e-3,
    },
}
DPO = {"kind": "dpo", "model": "${sft}", "data": {"task": "arithmetic", "n": 64}, "train": {**FEW, "beta": 0.1}}
RSFT = {
    "kind": "rsft",
    "model": "${sft}",
    "data": {"task": "arithmetic", "n": 16},
    "verifiers": ["arithmetic"],
    "sampling": {"n": 4, "max_new_tokens": 6},
    "select": "threshold",
    "threshold": 0.0,
    "train": FEW,
}
RLVR = {
    "kind": "rlvr",
    "model": "${sft}",
    "data": {"task": "arithmetic", "n": 32},
    "verifiers": ["my_verifiers:digit_share"],
    "train": {
        "max_steps": 2,
        "num_generations": 4,
        "per_device_train_batch_size": 8,
        "max_completion_length": 6,
        "learning_rate": 1.0e-3,
    },
}
RM = {"kind": "reward", "model": "${sft}", "data": {"task": "arithmetic", "n": 96}, "train": FEW}
STAGES = {
    "sft": {"data": {"task": "arithmetic", "n": 96}, "train": FEW, **FULL},
    "sft_lora": {"kind": "sft", "model": "${sft}", "data": {"task": "arithmetic", "n": 96}, "train": FEW},
    "rm": RM,
    "rm_full": {**RM, **FULL},
    "ppo": {
        **PPO,
        "policy": "${sft}",
        "reward_model": "${rm}",  # + recomputing layers under their own adapter
        "train": {**PPO["train"], "gradient_checkpointing": True},
    },
    "ppo_full": {**PPO, "policy": "${sft}", "reward_model": "${rm_full}", **FULL},
    "dpo": DPO,
    "dpo_full": {**DPO, **FULL},
    "rsft": RSFT,
    "rsft_full": {**RSFT, **FULL},
    "rlvr": RLVR,
    "rlvr_full": {**RLVR, **FULL},
}
EVALUATE = {
    "after": ["ppo", "ppo_full"],
    "suites": [
        {
            "name": "arith",
            "data": {"task": "arithmetic", "split": "test", "n": 8},
            "verifier": "arithmetic",
            "sampling": {"max_new_tokens": 6},
        }
    ],
}
# Largest differences to the DDP checkpoints measured (any stage): on a 2-core AMD EPYC, FSDP2 8.1e-7 (full-weight
# ppo; sft, reward, dpo and rlvr bit-identical), ZeRO-2 2.5e-5 and ZeRO-3 1.8e-5 (the full-weight reward model);
# on a 2-core Intel Xeon with AVX512/AMX, FSDP2 5.0e-5 (the full-weight reward model; 9e-6 to 1.4e-5 for the
# other full-weight stages, 8e-8 to 1.3e-6 with LoRA), its reduce-scatter summing gradients in another order than
# DDP's all-reduce there, which AdamW's normalised steps carry into the weights. Training moves them by far more.
FSDP2_TOLERANCE = 1e-4
DEEPSPEED_TOLERANCE = 1e-4
# PYTHONFAULTHANDLER: a process that dies of a signal (a segfault in a collective) prints its Python stack, which
# `crash_report` puts in the failure message ahead of the other ranks' "connection closed by peer".
ENV = {**os.environ, "ALIGN_NO_PROGRESS": "1", "PYTHONFAULTHANDLER": "1"}
needs_deepspeed = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True).returncode != 0,
    reason="DeepSpeed not installed (pip install 'alignment-toolkit[deepspeed]'; .ci/run installs it)",
)


def engine_recipe(folder: Path) -> Path:
    recipe = {
        "name": "engines",
        "model": TINY_MODEL,
        "output_dir": str(folder / "out"),
        "seed": 5,
        "lora": {"r": 4, "lora_alpha": 8},
        "stages": STAGES,
        "evaluate": EVALUATE,
    }
    path = write_recipe(folder, recipe)
    (folder / "my_verifiers.py").write_text(DIGITS)
    return path


def launch(
    config: str,
    port: int,
    digests: Path,
    recipe: Path,
    *extra: str,
    machine: tuple[int, int] | None = None,
    env: dict | None = None,
) -> subprocess.Popen:
    """`accelerate launch --config_file configs/accelerate/CONFIG.yaml tests/rank_digests.py ... run RECIPE`;
    `machine=(rank, count)` launches one "machine" of a multi-node run (one process each, loopback)."""
    nodes = (
        [
            "--num_machines",
            str(machine[1]),
            "--machine_rank",
            str(machine[0]),
            "--num_processes",
            str(machine[1]),
            "--main_process_ip",
            "127.0.0.1",
        ]
        if machine
        else []
    )
    if machine and config.startswith("zero"):  # torchrun on each machine, as for the other engines (not pdsh)
        nodes += ["--deepspeed_multinode_launcher", "standard"]
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / f"{config}.yaml"),
        *nodes,
        "--main_process_port",
        str(port),
        str(REPO / "tests" / "rank_digests.py"),
        str(digests),
        "run",
        str(recipe),
        *extra,
    ]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env={**ENV, **(env or {})}
    )


def finish(*processes: subprocess.Popen, timeout: int = 900) -> tuple[list[int], str]:
    outputs = [p.communicate(timeout=timeout)[0] for p in processes]
    return [p.returncode for p in processes], "\n".join(outputs)


def crash_report(output: str) -> str:
    """The faulthandler stacks of `output` (a rank that died of a signal), then its last 5000 characters."""
    stacks = [output[m.start() : m.start() + 2500] for m in re.finditer("Fatal Python error", output)]
    return "\n".join(stacks) + "\n...\n" + output[-5000:]


def tensors(stage_dir: Path) -> dict[str, object]:
    """Every tensor of a stage checkpoint (merged weights and adapter), keyed by file and name."""
    found = {}
    for path in sorted(stage_dir.rglob("*.safetensors")):
        for name, tensor in load_file(path).items():
            found[f"{path.relative_to(stage_dir)}:{name}"] = tensor.double()
    return found


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def trained_change(ours: dict, start: dict) -> float:
    """How far training moved a stage's weights: its adapter's B matrices (zero at the start) with LoRA, else
    the largest change of a weight it shares with the checkpoint it started from."""
    lora_b = [t.abs().max().item() for k, t in ours.items() if "lora_B" in k]
    if lora_b:
        return max(lora_b)
    return max(
        (ours[k] - start[k]).abs().max().item() for k in ours.keys() & start.keys() if ours[k].shape == start[k].shape
    )


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """The baseline: the recipe under 2-process DDP."""
    folder = tmp_path_factory.mktemp("ddp")
    codes, output = finish(launch("cpu_2proc", 29547, folder / "digests", engine_recipe(folder)))
    assert codes == [0], crash_report(output)
    return folder, output


@pytest.mark.slow
def test_every_stage_kind_runs_on_two_processes_with_identical_ranks(ddp_run):
    folder, output = ddp_run
    out, digests = folder / "out", folder / "digests"
    ours = Counter(line for line in output.splitlines() if line.startswith("["))
    assert max(ours.values()) == 1, f"a log line printed by both ranks: {ours.most_common(1)}"
    assert len({(digests / f"{stage}-rank0.txt").read_text() for stage in STAGES}) == len(STAGES)
    for stage in STAGES:
        ranks = {rank: (digests / f"{stage}-rank{rank}.txt").read_text() for rank in (0, 1)}
        assert ranks[0] == ranks[1], f"stage {stage}: the two processes ended with different weights"
        assert (out / stage / "stage.json").exists()
        assert output.count(f"[{stage}] done") == 1, f"stage {stage}: only rank 0 logs"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(["base", "eval", *STAGES])

    # Both processes really trained on their own shards: the DDP step counts say so.
    ppo = json.loads((out / "ppo" / "log_history.json").read_text())
    assert ppo[-1]["episodes"] == 3 * 2 * 8  # 3 updates x 2 processes x 8 prompts
    rlvr = json.loads((out / "rlvr" / "stage.json").read_text())["metrics"]
    assert rlvr["global_step"] == 2 and rlvr["reward_std"] > 0  # a real policy-gradient signal


def run_engine(folder: Path, config: str, port: int, crash: str, multi_node: bool = False) -> tuple[str, str]:
    """The recipe under `config`, twice: the first launch dies in stage `crash` after its checkpoint at update 2,
    the second resumes it and finishes. Returns the two launches' logs."""
    recipe, digests, logs, env = engine_recipe(folder), folder / "digests", [], {"CRASH_AFTER_SAVE": f"{crash}:2"}
    for attempt in range(2):
        machines = [(rank, 2) for rank in (0, 1)] if multi_node else [None]
        codes, output = finish(*(launch(config, port + attempt, digests, recipe, machine=m, env=env) for m in machines))
        logs.append(output)
        assert all(code == 0 for code in codes) == bool(attempt), f"launch {attempt + 1}:\n{crash_report(output)}"
        if not attempt:  # killed as planned, and the killed stage is not marked finished
            assert (digests / f"crashed-{crash}").exists() and not (folder / "out" / crash / "stage.json").exists()
    return logs[0], logs[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, port, crash, multi_node, tolerance",
    [
        pytest.param("fsdp2_cpu", 29610, "ppo_full", False, FSDP2_TOLERANCE, id="fsdp2"),
        pytest.param("zero2_cpu", 29620, "ppo", False, DEEPSPEED_TOLERANCE, id="zero2", marks=needs_deepspeed),
        pytest.param(
            "zero3_cpu", 29630, "ppo_full", True, DEEPSPEED_TOLERANCE, id="zero3-two-machines", marks=needs_deepspeed
        ),
    ],
)
def test_every_stage_under_the_engine_ends_with_the_ddp_weights(
    tmp_path, ddp_run, config, port, crash, multi_node, tolerance
):
    killed, resumed = run_engine(tmp_path, config, port, crash, multi_node)
    engine = config.removesuffix("_cpu")
    assert f"engine: {engine} on 2 processes" in killed
    assert f"[{crash}] done" not in killed and re.findall(r"resuming from update (\d+)", resumed) == ["2"]
    assert f"[{crash}] done" in resumed and f"[{crash}] ppo from" in resumed

    ddp, out = ddp_run[0] / "out", tmp_path / "out"
    differences, moved = {}, {}
    for stage in STAGES:
        ours, theirs = tensors(out / stage), tensors(ddp / stage)
        differences[stage] = max_difference(ours, theirs)
        moved[stage] = trained_change(ours, tensors(ddp / ("sft" if stage != "sft" else "base")))
        history = json.loads((out / stage / "log_history.json").read_text())
        if stage.startswith("ppo"):
            assert [e["update"] for e in history] == [1, 2, 3]  # resumed: update 3 logged after the first run's 1-2
    eval_metrics = json.loads((out / "eval" / "metrics.json").read_text())
    assert max(differences.values()) <= tolerance, differences
    assert min(moved.values()) > 10 * tolerance, moved  # the tolerance is far below what training changes
    ddp_metrics = json.loads((ddp / "eval" / "metrics.json").read_text())["checkpoints"]
    assert {k: sorted(v) for k, v in eval_metrics["checkpoints"].items()} == {
        k: sorted(v) for k, v in ddp_metrics.items()
    }


@pytest.mark.slow
def test_a_node_without_the_shared_output_dir_stops_at_once(tmp_path):
    """Two "machines" whose output_dir are two different local folders: both stop before any work, naming
    the folder and the rank that cannot see rank 0's file."""
    recipe = engine_recipe(tmp_path)
    processes = [
        launch("cpu_2proc", 29650, tmp_path / "digests", recipe, f"output_dir={tmp_path}/node{rank}", machine=(rank, 2))
        for rank in (0, 1)
    ]
    codes, output = finish(*processes, timeout=300)
    assert all(code != 0 for code in codes)
    assert "is not shared by all processes: rank 1 on" in output and "shared filesystem" in output
    assert not (tmp_path / "node0" / "base").exists() and not (tmp_path / "node1" / "base").exists()


@pytest.mark.slow
def test_rlvr_with_tools_runs_under_ddp_with_identical_ranks_and_counts_every_process(tmp_path):
    """Tool rollouts under 2-process DDP: each process samples its own prompts' multi-turn rollouts from its
    unwrapped model, the ranks end with the same weights, and stage.json's tool counts are summed over both
    processes (2 steps x 2 processes x 8 rollouts), not rank 0's half."""
    stage = {
        **RLVR,
        "model": None,
        "tools": ["calculator"],
        "tool_format": "hermes",
        "describe_tools": False,
        "max_turns": 2,
        "max_tool_output_tokens": 16,
        "train": {**RLVR["train"], "max_completion_length": 12},
    }
    recipe = {
        "name": "tools-ddp",
        "model": TINY_MODEL,
        "output_dir": str(tmp_path / "out"),
        "seed": 5,
        "lora": {"r": 4, "lora_alpha": 8},
        "stages": {"rlvr": {k: v for k, v in stage.items() if v is not None}},
    }
    (tmp_path / "my_verifiers.py").write_text(DIGITS)
    codes, output = finish(
        launch("cpu_2proc", 29670, tmp_path / "digests", write_recipe(tmp_path, recipe)), timeout=600
    )
    assert codes == [0], crash_report(output)
    ranks = [(tmp_path / "digests" / f"rlvr-rank{rank}.txt").read_text() for rank in (0, 1)]
    assert ranks[0] == ranks[1], "the two processes ended with different weights"
    metrics = json.loads((tmp_path / "out" / "rlvr" / "stage.json").read_text())["metrics"]
    assert metrics["global_step"] == 2 and metrics["tools/rollouts"] == 2 * 2 * 8
    assert metrics["tools/turns"] >= metrics["tools/rollouts"]
    assert (tmp_path / "out" / "rlvr" / "tools.json").exists()
