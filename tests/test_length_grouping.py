"""`train_sampling_strategy: bucket_by_length` (alignment/training/buckets.py): the order is a permutation whose
batches hold rows of one power-of-two bucket yet mix the lengths within it; on the TRL-backed stages (sft,
reward, dpo; rsft trains through sft's trainer) the stage gives each row its padded length, and the batches pad
less than random ones while every row is still trained on. transformers' own `group_by_length` works on the
reward and DPO rows too (it would look for an `input_ids` column they lack). PPO's use: tests/test_ppo.py.

    python -m pytest tests/test_length_grouping.py -q
"""

from __future__ import annotations

import pytest
import torch
from conftest import write_recipe

from alignment.config.recipe import load_recipe
from alignment.run.runner import make_context
from alignment.stages import dpo, reward, sft
from alignment.training.buckets import bucket_of, bucketed_order


def test_bucketed_order_batches_one_bucket_each_in_random_order():
    lengths = [18, 19, 36, 18, 34, 19, 19, 18, 36, 19, 18, 19]  # bucket 5 (16-31) x 9, bucket 6 (32-63) x 3
    orders = [bucketed_order(lengths, 3, torch.Generator().manual_seed(seed)) for seed in range(20)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(12))
        batches = [{bucket_of(lengths[i]) for i in batch} for batch in order.split(3)]
        assert all(len(b) == 1 for b in batches)  # 9 and 3 rows: no batch straddles the two buckets
    assert len({tuple(o.tolist()) for o in orders}) > 10
    # within the bucket the exact lengths stay mixed (transformers' group_by_length sorts by them)
    assert any(len({lengths[i] for i in batch}) > 1 for o in orders for batch in o.split(3))
    assert any(bucket_of(lengths[int(o[0])]) == 6 for o in orders)  # the long batch is not always last
    assert [bucket_of(n) for n in (1, 15, 16, 31, 32)] == [1, 4, 5, 5, 6]


# Half the prompts sycophancy-style ("I think 37+48 is 84. What is 37+48?"), twice as long as the plain ones.
DATA = {"task": "arithmetic", "split": "train", "n": 256, "sycophancy_fraction": 0.5}
# stage: (module, stage keys, sequences per row in a batch: the preference collators stack chosen and rejected)
STAGES = {
    "sft": (sft, {}, 1),
    "rm": (reward, {"kind": "reward"}, 2),
    "dpo": (dpo, {"kind": "dpo"}, 2),
}


def trainer_for(tmp_path, tiny_model, stage: str, strategy: str):
    module, extra, _ = STAGES[stage]
    train = {"per_device_train_batch_size": 16, "max_length": 64, "train_sampling_strategy": strategy}
    recipe = {
        "name": "grouping",
        "model": str(tiny_model),
        "output_dir": str(tmp_path / strategy / "out"),
        "seed": 1,
        "lora": None,
        "stages": {stage: {**extra, "data": DATA, "train": train}},
    }
    built = module.build_trainer(make_context(load_recipe(write_recipe(tmp_path / strategy, recipe)), stage))
    return built[0]


def padded_and_rows(trainer, per_row: int) -> tuple[int, int]:
    """Token positions the epoch's batches hold (sequences x padded width), and rows seen."""
    positions = rows = 0
    for batch in trainer.get_train_dataloader():
        positions += batch["input_ids"].numel()
        rows += len(batch["input_ids"]) // per_row
    return positions, rows


@pytest.mark.parametrize("stage", sorted(STAGES))
@pytest.mark.parametrize("strategy", ["bucket_by_length", "group_by_length"])
def test_length_sampled_batches_pad_less_and_keep_every_row(tmp_path, tiny_model, stage, strategy):
    torch.manual_seed(0)
    grouped = trainer_for(tmp_path, tiny_model, stage, strategy)
    random = trainer_for(tmp_path, tiny_model, stage, "random")
    assert "length" in grouped.train_dataset.column_names and "length" not in random.train_dataset.column_names
    lengths = grouped.train_dataset["length"]
    assert min(lengths) < 0.75 * max(lengths)  # the data mixes short and long rows
    per_row = STAGES[stage][2]
    grouped_positions, grouped_rows = padded_and_rows(grouped, per_row)
    random_positions, random_rows = padded_and_rows(random, per_row)
    assert grouped_rows == random_rows == len(grouped.train_dataset)
    assert grouped_positions < 0.9 * random_positions  # measured 0.76-0.86
