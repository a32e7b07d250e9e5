"""The `async` section (not in the default list: it needs vLLM, e.g. the environment of scripts/vllm_env.sh): PPO
updates a minute with the rollouts sampled in the trainer's process, then on `rollout: {server: local}` (vLLM's own
server on 127.0.0.1) synchronously (`async: {max_staleness: 0}`) and with sampling ahead (`max_staleness: k` for
each k of `--staleness`), and the held-out greedy pass@1 each policy reaches after the same number of updates.

The policy: recipes/smollm2-135m/arithmetic.yaml's SFT stage (640 rows, one epoch, LoRA r 16) shared by every run,
then `--async-updates` updates of that recipe's PPO stage (32 prompts x 8 new tokens) with the arithmetic verifier as
its only reward, from the same seed; `importance_sampling: {cap: 5}` under every server run (sequence-level
truncated IS corrects the staleness and the sampler's numerics). Each run is `align run` in a process of its own. On
a CPU with two or more cores the server's threads are bound to the first core (`vllm.server_cpus`) and the trainer to
the others (taskset, OMP_NUM_THREADS), so that the overlap is between two processes that do not share a core; the
in-process run gets every core. updates/min is 60 over the mean `update_seconds` of the updates after the first (the
first also fills the pipeline); the row's seconds are the stage's whole wall time, server start included, its peak
the trainer's resident set (`stage.json`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

# The SmolLM2 arithmetic recipe's blocks, read from it so that the bench measures the shipped shapes.
RECIPE = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m" / "arithmetic.yaml").read_text()
)
SUITE = {
    "name": "arithmetic",
    "data": {"task": "arithmetic", "split": "test", "n": 100, "phrasing": "chat"},
    "verifier": "arithmetic",
    "sampling": {"temperature": 0, "max_new_tokens": 32, "batch_size": 100},
}


def ppo_stage(policy: Path, updates: int, staleness: int | None, engine: dict) -> dict:
    """The recipe's PPO stage from `policy` for `updates` updates, the arithmetic verifier its only reward (no reward
    model to train first): in the trainer's process (`staleness` None) or on a local server with `async` at it."""
    ppo = RECIPE["stages"]["ppo"]
    stage = {
        **{key: value for key, value in ppo.items() if key != "reward_model"},
        "policy": str(policy),
        "verifiers": ["arithmetic"],
        "rollout": dict(ppo["rollout"]),
        "train": {**ppo["train"], "total_updates": updates},
    }
    if staleness is not None:
        stage["rollout"].update(server="local", vllm=engine)
        stage["importance_sampling"] = {"cap": 5.0}
        stage["async"] = {"max_staleness": staleness}
    return stage


def recipe(folder: Path, model: Path, stages: dict, evaluate: bool) -> Path:
    """A recipe of `stages` on `model` writing to folder/out, with the held-out suite after ppo when `evaluate`."""
    body = {
        "name": folder.name,
        "model": str(model),
        "output_dir": str(folder / "out"),
        "seed": 1,
        "lora": RECIPE["lora"],
        "stages": stages,
    }
    if evaluate:
        body["evaluate"] = {"after": ["ppo"], "suites": [SUITE]}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "recipe.yaml").write_text(yaml.safe_dump(body, sort_keys=False))
    return folder / "recipe.yaml"


def align_run(path: Path, cores: list[int] | None, *args: str) -> None:
    """`align run PATH` in a process of its own, bound to `cores` (every core of this process when None) with
    as many threads; its output in run.log beside the recipe, whose tail the error carries when it fails (the bench's
    temporary folder is gone by the time the error is read)."""
    command = [sys.executable, "-m", "alignment", "run", str(path), *args]
    if cores is not None:
        command = ["taskset", "-c", ",".join(map(str, cores)), *command]
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores or os.sched_getaffinity(0)))}
    log = path.parent / "run.log"
    with log.open("w") as out:
        failed = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if failed:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"async section: `{' '.join(command)}` failed (exit {failed}); its output ends:\n{tail}")


def measured(folder: Path, variant: str) -> dict:
    """The row of one run: updates/min from its log, pass@1 from its evaluation."""
    out = folder / "out"
    history = json.loads((out / "ppo" / "log_history.json").read_text())
    stage = json.loads((out / "ppo" / "stage.json").read_text())
    pass_at_1 = json.loads((out / "eval" / "metrics.json").read_text())["checkpoints"]["ppo"]["arithmetic/pass@1"]
    steady = history[1:] or history  # the first update also fills the pipeline
    return {
        "section": "async",
        "variant": f"{variant} (pass@1 {pass_at_1:.2f})",
        "rate": round(60 / statistics.mean(entry["update_seconds"] for entry in steady), 2),
        "unit": "updates/min",
        "peak_mib": stage["peak_rss_mib"],
        "seconds": stage["wall_time_s"],
        "mfu": None,
        "pass_at_1": pass_at_1,
        "sample_seconds": round(statistics.mean(entry["sample_seconds"] for entry in steady), 3),
        "policy_lag": history[-1].get("policy_lag", 0.0),
    }


def bench_async(model_dir: Path, args, work: Path) -> list[dict]:
    """In-process sampling, then the server at each staleness of `args.staleness`; rows printed as they come."""
    cores = sorted(os.sched_getaffinity(0))
    engine = {"kv_cache_gib": args.vllm_kv_gib, "max_model_len": args.vllm_max_len}
    trainer_cores = None  # one core: server and trainer share it
    if len(cores) > 1:
        engine["server_cpus"], trainer_cores = str(cores[0]), cores[1:]
    sft = recipe(work / "async-sft", model_dir, {"sft": RECIPE["stages"]["sft"]}, evaluate=False)
    align_run(sft, None, "--no-eval")
    policy = work / "async-sft" / "out" / "sft"
    runs = [("in process, every core", None, None)] + [
        (f"server, max_staleness {k}", k, trainer_cores) for k in args.staleness
    ]
    results = []
    for variant, staleness, bound in runs:
        folder = work / f"async-{'local' if staleness is None else staleness}"
        stage = ppo_stage(policy, args.async_updates, staleness, engine)
        align_run(recipe(folder, model_dir, {"ppo": stage}, evaluate=True), bound)
        results.append(measured(folder, variant))
        print(json.dumps(results[-1]), flush=True)
    return results
