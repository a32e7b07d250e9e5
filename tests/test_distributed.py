"""Every stage kind under `accelerate launch` with the 2-process CPU config (configs/accelerate/cpu_2proc.yaml).

One quickstart-shaped recipe (sft -> rm -> ppo; dpo, rsft, rlvr from sft; LoRA so the reference is the
adapter-disabled policy) runs a few steps per stage on two gloo processes. Each rank writes a digest of
its trainable weights at the end of every stage (tests/rank_digests.py), so the test can check
that gradients were synchronised: the ranks see different data shards, so unsynchronised training
would leave them with different weights. Only rank 0 may write stage outputs and logs.

    python -m pytest tests/test_distributed.py -q -m slow
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest
from conftest import REPO, TINY_MODEL, write_recipe

# A random-init policy never gets an arithmetic answer right, so the RL stages would see all-zero rewards
# and not move; this verifier (a file next to the recipe) gives every sample a different score.
DIGITS = '''
def digit_share(completion, **row):
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
'''
FEW = {"per_device_train_batch_size": 4, "max_steps": 3, "learning_rate": 1.0e-3, "max_length": 64}
STAGES = {
    "sft": {"data": {"task": "arithmetic", "n": 96}, "train": FEW},
    "rm": {"kind": "reward", "model": "${sft}", "data": {"task": "arithmetic", "n": 96}, "train": FEW},
    "ppo": {"policy": "${sft}", "reward_model": "${rm}", "verifiers": [{"name": "my_verifiers:digit_share"}],
            "data": {"task": "arithmetic", "n": 64}, "rollout": {"batch_size": 8, "max_new_tokens": 6},
            "train": {"total_updates": 2, "mini_batch_size": 4, "ppo_epochs": 1, "learning_rate": 1.0e-3}},
    "dpo": {"model": "${sft}", "data": {"task": "arithmetic", "n": 64}, "train": {**FEW, "beta": 0.1}},
    "rsft": {"model": "${sft}", "data": {"task": "arithmetic", "n": 16}, "verifiers": ["arithmetic"],
             "sampling": {"n": 4, "max_new_tokens": 6}, "select": "threshold", "threshold": 0.0,
             "train": FEW},
    "rlvr": {"model": "${sft}", "data": {"task": "arithmetic", "n": 32}, "verifiers": ["my_verifiers:digit_share"],
             "train": {"max_steps": 2, "num_generations": 4, "per_device_train_batch_size": 8,
                       "max_completion_length": 6, "learning_rate": 1.0e-3}},
}


@pytest.mark.slow
def test_every_stage_kind_runs_on_two_processes_with_identical_ranks(tmp_path):
    recipe = {"name": "ddp-all", "model": TINY_MODEL, "output_dir": str(tmp_path / "out"), "seed": 5,
              "lora": {"r": 4, "lora_alpha": 8}, "stages": STAGES}
    path = write_recipe(tmp_path, recipe)
    (tmp_path / "my_verifiers.py").write_text(DIGITS)
    digests = tmp_path / "digests"
    env = {**os.environ, "ALIGN_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(REPO / "configs/accelerate/cpu_2proc.yaml"), "--main_process_port", "29547",
         str(REPO / "tests" / "rank_digests.py"), str(digests), "run", str(path)],
        capture_output=True, text=True, timeout=900, env=env, cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(f"\n2-process run of {list(STAGES)}: {time.time() - started:.0f}s")

    out = tmp_path / "out"
    ours = Counter(line for line in done.stdout.splitlines() if line.startswith("["))
    assert max(ours.values()) == 1, f"a log line printed by both ranks: {ours.most_common(1)}"
    found = {p.name for p in digests.iterdir()}
    assert len({(digests / f"{stage}-rank0.txt").read_text() for stage in STAGES}) == len(STAGES)
    for stage in STAGES:
        ranks = {rank: (digests / f"{stage}-rank{rank}.txt").read_text() for rank in (0, 1)}
        assert ranks[0] == ranks[1], f"stage {stage}: the two processes ended with different weights"
        assert (out / stage / "stage.json").exists()
        assert done.stdout.count(f"[{stage}] done") == 1, f"stage {stage}: only rank 0 logs"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(["base", *STAGES])

    # Both processes really trained on their own shards: the DDP step counts say so.
    ppo = json.loads((out / "ppo" / "log_history.json").read_text())
    assert ppo[-1]["episodes"] == 2 * 2 * 8  # 2 updates x 2 processes x 8 prompts
    rlvr = json.loads((out / "rlvr" / "stage.json").read_text())["metrics"]
    assert rlvr["global_step"] == 2 and rlvr["reward_std"] > 0  # a real policy-gradient signal
    assert found == {f"{stage}-rank{rank}.txt" for stage in STAGES for rank in (0, 1)}
