"""Batches of rows of about one length: `train_sampling_strategy: bucket_by_length`.

A batch is padded to its longest row, so a few long rows among short ones (the quickstart's sycophancy-style
prompts are twice as long as the plain ones, one row in ten) make nearly every random batch pay for the long
length. Bucketing puts each row in a bucket of lengths within a power of two (16-31 tokens, 32-63, ...), shuffles
the rows within each bucket, cuts the buckets one after the other into batches and shuffles the batches: a
batch holds rows of one bucket (except where two buckets meet), in random order otherwise.

It is not transformers' `group_by_length`, which sorts rows by their exact length within megabatches of 50
batches: there a batch holds rows of one exact length, and where length follows content it holds one kind of
content. On the quickstart's sums the length is the number of digits, and SFT with it trained on batches of
3-digit sums, then of 2-digit ones, and learned neither (its loss stayed far above random batches').

PPO orders its minibatches with `bucketed_order` (`stages/ppo.py`); the TRL-backed stages take a length column on
their rows (`training_dataset`) and a trainer class that samples by it (`with_length_sampling`).
"""

from __future__ import annotations

import datasets
import torch
from torch.utils.data import Sampler


def bucket_of(length: int) -> int:
    """The power-of-two bucket of a length: 16-31 -> 5, 32-63 -> 6."""
    return max(int(length), 1).bit_length()


def bucketed_order(lengths, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A permutation of range(len(lengths)) whose consecutive runs of `batch_size` are batches of one bucket
    (`bucket_of`), rows random within a bucket, the batches in random order. Draws from `generator`, else from
    torch's global random state (seeded by the trainers)."""
    buckets = torch.tensor([bucket_of(n) for n in lengths], dtype=torch.float64)
    jitter = torch.rand(len(buckets), generator=generator, dtype=torch.float64) * 0.5
    batches = torch.argsort(buckets + jitter, stable=True).split(batch_size)
    return torch.cat([batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()])


class BucketSampler(Sampler[int]):
    """A transformers Trainer's train sampler for `bucket_by_length`: a new `bucketed_order` each epoch."""

    def __init__(self, lengths: list[int], batch_size: int):
        self.lengths, self.batch_size = list(lengths), batch_size

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        return iter(bucketed_order(self.lengths, self.batch_size).tolist())


# ---------------------------------------------------------------------------------------------------
# The TRL-backed stages (sft, reward, dpo, rsft): a length column on their rows, and the sampler that reads it

# `train_sampling_strategy` values whose sampler reads each row's length: transformers' own two, and
# `bucket_by_length`, which the TRL-backed stages add (`with_length_sampling`).
LENGTH_SAMPLERS = ("group_by_length", "batch_rebalance", "bucket_by_length")


def training_dataset(rows: list[dict], args, length) -> datasets.Dataset:
    """`rows` as the Dataset a TRL trainer takes, with each row's padded length (`length(row)` tokens) in
    `args.length_column_name` when the trainer's sampler reads it (`LENGTH_SAMPLERS`): transformers would
    otherwise look for an `input_ids` column, which the reward and DPO rows do not have. The collators ignore
    the column."""
    dataset = datasets.Dataset.from_list(rows)
    if getattr(args, "train_sampling_strategy", "random") in LENGTH_SAMPLERS and rows:
        dataset = dataset.add_column(args.length_column_name, [length(row) for row in rows])
    return dataset


def with_length_sampling(base):
    """`base` (a TRL trainer class) with `train_sampling_strategy: bucket_by_length` (`BucketSampler`:
    batches of rows of about one length, so a batch of short rows is not padded to a long one) and keeping
    `training_dataset`'s length column, which transformers would drop, with every column outside a trainer's
    signature, before it builds the sampler."""

    class LengthSampling(base):
        def _set_signature_columns_if_needed(self):
            super()._set_signature_columns_if_needed()
            name = self.args.length_column_name
            if self._signature_columns is not None and name not in self._signature_columns:
                self._signature_columns = [*self._signature_columns, name]

        def _get_train_sampler(self, train_dataset=None):
            if self.args.train_sampling_strategy != "bucket_by_length":
                return super()._get_train_sampler(train_dataset)
            dataset = self.train_dataset if train_dataset is None else train_dataset
            return BucketSampler(dataset[self.args.length_column_name], self.args.train_batch_size)

    LengthSampling.__name__ = LengthSampling.__qualname__ = base.__name__
    return LengthSampling
