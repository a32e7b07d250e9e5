"""Run the `align` CLI with every stage writing a digest of each process's trainable weights.

    python tests/rank_digests.py DIGEST_DIR run RECIPE [...]          (also as the script of accelerate launch)

Each process writes `DIGEST_DIR/<stage>-rank<R>.txt`, a sha256 of its trainable tensors at the end of
training, so a test can check that every rank ended with the same parameters (only rank 0 saves a
checkpoint, so the other ranks' weights are otherwise invisible) or that a resumed run ended where an
uninterrupted one did. The hooks live here, in the tests, not in the package.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch.distributed
from transformers import TrainerCallback

from alignment import trainer_utils
from alignment.cli import main
from alignment.stages import ppo


def write_digest(folder: Path, named_tensors: dict, stage_id: str) -> None:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stage_id}-rank{rank}.txt").write_text(digest.hexdigest())


def install(folder: Path) -> None:
    """TRL stages: a callback at the end of training; ppo: after its loop, before the final save."""
    callbacks = trainer_utils.trainer_callbacks

    class Digest(TrainerCallback):
        def __init__(self, stage_id: str):
            self.stage_id = stage_id

        def on_train_end(self, args, state, control, model=None, **kwargs):
            write_digest(folder, {n: p for n, p in model.named_parameters() if p.requires_grad}, self.stage_id)

    trainer_utils.trainer_callbacks = lambda ctx: [*callbacks(ctx), Digest(ctx.stage_id)]
    save = ppo.PPOLoop.save_final

    def save_final(loop):
        write_digest(folder, loop.ac.trainable_state(), loop.ctx.stage_id)
        return save(loop)

    ppo.PPOLoop.save_final = save_final


if __name__ == "__main__":
    install(Path(sys.argv[1]))
    main(sys.argv[2:])
