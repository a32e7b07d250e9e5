"""Which split a generated problem belongs to: a hash of the problem's text puts it in one of three disjoint bands,
so a held-out problem is never a training one whatever `n` and the seed are, and every seed draws its held-out
problems from the same bands.

    hash value in [0, 1):  [0, test_fraction)                          test (`test`, `eval`, `heldout`)
                           [test_fraction, + validation_fraction)     validation
                           the rest                                   train (any other split name)

`validation_fraction` is 0 by default: every problem outside the test band is then a training one, and asking for the
`validation` split is an error, since the only held-out problems are the test ones. Setting it moves problems from
the training band only: the test band is the same whatever it is.
Settings chosen on the validation band and reported on the test band are chosen on problems the report never
scores (docs/tuning.md).
"""

from __future__ import annotations

import hashlib

from ..errors import UserError

TEST_SPLITS = ("test", "eval", "heldout")


def band_of(split: str, task: str, validation_fraction: float) -> str:
    """The band (`test`, `validation` or `train`) that a split name draws its problems from."""
    if split == "validation":
        if validation_fraction <= 0:
            raise UserError(
                f"Task {task}, `split: validation`: the task has no validation problems unless "
                "`validation_fraction` is set (a share of problems, disjoint from the test and training ones, "
                "e.g. 0.1); without it the held-out problems are the test split's."
            )
        return "validation"
    return "test" if split in TEST_SPLITS else "train"


def band(text: str, test_fraction: float, validation_fraction: float) -> str:
    """The band of one problem, by the first four bytes of the SHA-256 of its text."""
    value = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") / 2**32
    if value < test_fraction:
        return "test"
    return "validation" if value < test_fraction + validation_fraction else "train"
