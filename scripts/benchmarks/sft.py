"""The `sft` section: tokens/s of the `sft` stage's TRL config against `trl.SFTConfig()` defaults (on CPU the
defaults need bf16 off to run at all, which is the only change made to them), and ours with TRL's
padding-free packing (`packing: true, packing_strategy: bfd`), all on the same rows of varied length.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from .common import Peak, row, text


def sft_rows(size: dict, n: int) -> list[dict]:
    """Rows of varied length (an eighth to all of `seq`), as chat data has, so padding costs something."""
    rng = random.Random(1)
    half = size["seq"] // 2 - 4
    lengths = [rng.randint(max(1, half // 8), half) for _ in range(n)]
    return [{"prompt": text(rng, k), "completion": text(rng, k)} for k in lengths]


def bench_sft(model_dir: Path, size: dict, args, work: Path) -> list[dict]:
    """Our sft stage's trainer settings vs TRL's defaults, identical data and batch."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from alignment.config.recipe import load_recipe
    from alignment.data.formatting import render_pair
    from alignment.models.loading import is_cuda, load_policy
    from alignment.models.tokenizer import load_tokenizer
    from alignment.run.runner import make_context
    from alignment.stages import sft

    tokenizer = load_tokenizer(str(model_dir))
    n = size["batch"] * size["steps"]
    data = datasets.Dataset.from_list([render_pair(tokenizer, r) for r in sft_rows(size, n)])
    common = dict(
        per_device_train_batch_size=size["batch"],
        max_steps=size["steps"],
        max_length=size["seq"],
        report_to="none",
        save_strategy="no",
        logging_steps=size["steps"],
        seed=0,
    )
    recipe_path = work / "sft.yaml"
    recipe_path.write_text(
        json.dumps(
            {
                "name": "bench",
                "model": str(model_dir),
                "output_dir": str(work / "out"),
                "stages": {"sft": {"data": {"task": "arithmetic"}, "train": common}},
            }
        )
    )
    ours = sft.trl_config(make_context(load_recipe(recipe_path), "sft"))
    plain = SFTConfig(
        output_dir=str(work / "plain"), **common, **({} if is_cuda() else {"bf16": False, "use_cpu": True})
    )
    # Packed rows hold several examples each: the same number of examples takes fewer steps.
    packed = dataclasses.replace(ours, packing=True, packing_strategy="bfd")
    results = []
    for variant, config in (
        ("ours: sft stage defaults", ours),
        ("plain: trl.SFTConfig defaults", plain),
        ("ours: packed, padding-free (opt-in)", packed),
    ):
        model = load_policy(str(model_dir))
        trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
        with Peak() as peak:
            trainer.train()
        # Tokens trained on in max_steps batches (packed rows are fewer and longer), padding excluded.
        rows = trainer.train_dataset["input_ids"]
        tokens = sum(len(x) for x in rows) * size["steps"] * size["batch"] / len(rows)
        results.append(row("sft", variant, tokens / peak.seconds, "tokens/s", peak, model, args, True))
        del trainer, model
    return results
