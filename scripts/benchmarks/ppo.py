"""The `ppo` section: episodes/s of the `ppo` stage with LoRA (policy, reference and critic on one base; a
verifier as the reward, so no reward model), prompts of half the sequence length as in `dpo`. TRL 1.16 has no
PPO to compare with; on a GPU, when `dpo` ran in the same process, the table adds PPO's peak memory over
DPO-LoRA's, the ratio docs/performance.md sets a goal for.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .common import Peak, row, text

BREVITY = "def brevity(completion):\n    return -len(completion) / 64.0\n"


def bench_ppo(model_dir: Path, size: dict, args, work: Path) -> list[dict]:
    """Our ppo stage with LoRA for `updates` updates: rollout, scoring, reference and critic passes,
    `ppo_epochs` of minibatch steps. Reward: a verifier (shorter is better), so the memory is the
    policy/reference/critic trio alone, comparable with DPO-LoRA's policy/reference pair."""
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import run_recipe

    rng, half = random.Random(3), size["seq"] // 2 - 4
    prompts = work / "ppo-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text(rng, half)}) + "\n" for _ in range(size["pairs"])))
    (work / "bench_rewards.py").write_text(BREVITY)
    batch = size["batch"]
    stage = {
        "kind": "ppo",
        "policy": str(model_dir),
        "data": {"dataset": str(prompts)},
        "verifiers": [{"name": "bench_rewards:brevity"}],
        "rollout": {"batch_size": 2 * batch, "max_new_tokens": min(size["new_tokens"], size["seq"] - half)},
        "train": {
            "total_updates": size["updates"],
            "mini_batch_size": batch,
            "ppo_epochs": 1,
            "learning_rate": 1.0e-5,
            "save_every": 10_000,
        },
    }
    recipe_path = work / "ppo.yaml"
    recipe_path.write_text(
        json.dumps(
            {
                "name": "bench",
                "model": str(model_dir),
                "output_dir": str(work / "out-ppo"),
                "lora": {"r": 16, "lora_alpha": 32},
                "stages": {"ppo": stage},
            }
        )
    )
    recipe = load_recipe(recipe_path)
    with Peak() as peak:
        run_recipe(recipe)
    episodes = 2 * batch * size["updates"]
    return [
        row(
            "ppo",
            "ours: ppo stage, LoRA (policy + reference + critic on one base)",
            episodes / peak.seconds,
            "episodes/s",
            peak,
            None,
            args,
            True,
        )
    ]


def memory_ratio(results: list[dict]) -> dict | None:
    """PPO's peak GPU memory over DPO-LoRA's (ours), when both ran on a GPU in this process."""
    import torch

    peaks = {
        r["section"]: r["peak_mib"]
        for r in results
        if r["variant"].startswith("ours") and r["section"] in ("ppo", "dpo")
    }
    if not torch.cuda.is_available() or len(peaks) < 2:
        return None
    return {
        "section": "ppo",
        "variant": "ours: peak memory / dpo-LoRA peak memory",
        "rate": round(peaks["ppo"] / peaks["dpo"], 2),
        "unit": "x",
        "peak_mib": peaks["ppo"],
        "seconds": 0.0,
        "mfu": None,
    }
