"""The `dpo` section: pairs/s of the `dpo` stage with LoRA against `trl.DPOConfig()` defaults with the same
LoRA, on the same pairs (prompts and answers of half the sequence length each).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .common import Peak, row, text


def bench_dpo(model_dir: Path, size: dict, args, work: Path) -> list[dict]:
    """Our dpo stage's settings (LoRA) vs TRL's DPOConfig defaults with the same LoRA."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    from alignment.config.model import LoraSpec
    from alignment.config.recipe import load_recipe
    from alignment.data.formatting import render_completion, render_prompt
    from alignment.models.loading import is_cuda, load_policy
    from alignment.models.lora import peft_config
    from alignment.models.tokenizer import load_tokenizer
    from alignment.run.runner import make_context
    from alignment.stages import dpo

    tokenizer = load_tokenizer(str(model_dir))
    rng, half = random.Random(2), size["seq"] // 2 - 4
    rows = []
    for _ in range(size["pairs"]):
        prompt = text(rng, half)
        rows.append(
            {
                "prompt": render_prompt(tokenizer, prompt),
                "chosen": render_completion(tokenizer, prompt, text(rng, half)),
                "rejected": render_completion(tokenizer, prompt, text(rng, half)),
            }
        )
    data = datasets.Dataset.from_list(rows)
    common = dict(
        per_device_train_batch_size=size["batch"],
        num_train_epochs=1,
        max_length=size["seq"],
        report_to="none",
        save_strategy="no",
        logging_steps=1000,
        seed=0,
    )
    recipe_path = work / "dpo.yaml"
    recipe_path.write_text(
        json.dumps(
            {
                "name": "bench",
                "model": str(model_dir),
                "output_dir": str(work / "out"),
                "lora": {"r": 16, "lora_alpha": 32},
                "stages": {"dpo": {"data": {"task": "arithmetic"}, "train": common}},
            }
        )
    )
    ours = dpo.trl_config(make_context(load_recipe(recipe_path), "dpo"))
    plain = DPOConfig(
        output_dir=str(work / "plain-dpo"), **common, **({} if is_cuda() else {"bf16": False, "use_cpu": True})
    )
    results = []
    for variant, config in (("ours: dpo stage defaults, LoRA", ours), ("plain: trl.DPOConfig defaults, LoRA", plain)):
        model = load_policy(str(model_dir))
        trainer = DPOTrainer(
            model=model,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            peft_config=peft_config(LoraSpec(r=16, lora_alpha=32)),
        )
        with Peak() as peak:
            trainer.train()
        results.append(row("dpo", variant, len(rows) / peak.seconds, "pairs/s", peak, model, args, True))
        del trainer, model
    return results
