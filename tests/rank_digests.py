"""Run the `align` CLI with every stage writing a digest of each process's trainable weights.

    python tests/rank_digests.py DIGEST_DIR run RECIPE [...]          (also as the script of accelerate launch)

Each process writes `DIGEST_DIR/<stage>-rank<R>.txt`, a sha256 of its trainable tensors at the end of
training, so a test can check that every rank ended with the same parameters (only rank 0 saves a
checkpoint, so the other ranks' weights are otherwise invisible) or that a resumed run ended where an
uninterrupted one did. Under FSDP2 and ZeRO-3 a process holds only its shard, so there the digests say
nothing and tests compare the saved checkpoints instead.

With `CRASH_AFTER_SAVE=ppo:2,...` in the environment, every process of a ppo stage named there kills
itself (SIGKILL) right after the resume checkpoint of that update is complete, once: a file in
DIGEST_DIR marks the crash done, so the rerun resumes and finishes. The hooks live here, in the tests,
not in the package.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path

import torch.distributed
from transformers import TrainerCallback

from alignment.cli import main
from alignment.runtime.dist import PARTITIONED, launched_engine
from alignment.stages import dpo, ppo, reward, rlvr
from alignment.training import trainer


def write_digest(folder: Path, named_tensors: dict, stage_id: str) -> None:
    if launched_engine() in PARTITIONED:  # each process holds a shard: nothing to compare
        return
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stage_id}-rank{rank}.txt").write_text(digest.hexdigest())


def install(folder: Path) -> None:
    """TRL stages: a callback at the end of training; ppo: after its loop, before the final save."""
    callbacks = trainer.trainer_callbacks

    class Digest(TrainerCallback):
        def __init__(self, stage_id: str):
            self.stage_id = stage_id

        def on_train_end(self, args, state, control, model=None, **kwargs):
            write_digest(folder, {n: p for n, p in model.named_parameters() if p.requires_grad}, self.stage_id)

    digesting = lambda ctx: [*callbacks(ctx), Digest(ctx.stage_id)]  # noqa: E731
    for module in (trainer, dpo, reward, rlvr):  # each binds trainer_callbacks by name
        module.trainer_callbacks = digesting
    save = ppo.PPOLoop.save_final

    def save_final(loop):
        trained = {n: p for n, p in loop.actor_critic.named_parameters() if p.requires_grad}
        write_digest(folder, trained, loop.ctx.stage_id)
        return save(loop)

    ppo.PPOLoop.save_final = save_final
    crashes = dict(item.split(":") for item in os.environ.get("CRASH_AFTER_SAVE", "").split(",") if item)
    save_state = ppo.PPOLoop.save_state

    def save_state_then_crash(loop):
        marker = folder / f"crashed-{loop.ctx.stage_id}"
        crash = crashes.get(loop.ctx.stage_id) == str(loop.update) and not marker.exists()
        save_state(loop)  # ends with a barrier: every process has decided before rank 0 writes the marker
        if crash:
            if loop.accelerator.is_main_process:
                folder.mkdir(parents=True, exist_ok=True)
                marker.write_text(str(loop.update))
            loop.accelerator.wait_for_everyone()
            os.kill(os.getpid(), signal.SIGKILL)

    ppo.PPOLoop.save_state = save_state_then_crash


if __name__ == "__main__":
    install(Path(sys.argv[1]))
    main(sys.argv[2:])
