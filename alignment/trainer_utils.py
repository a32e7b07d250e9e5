"""Glue shared by the TRL-backed stages: resume, the non-finite guard, final metrics.

Resume: the Trainer checkpoints into the stage's work folder (`<output_dir>/.work/<stage>/trainer`);
a rerun after a crash passes the newest checkpoint to `trainer.train(resume_from_checkpoint=...)`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import UserError


class NonFiniteError(UserError):
    """Training produced a NaN/inf loss or gradient; raised before the optimizer step."""


def resume_checkpoint(trainer_dir: str | Path) -> str | None:
    """The newest `checkpoint-N` folder in a trainer's output dir, if any."""
    from transformers.trainer_utils import get_last_checkpoint

    path = Path(trainer_dir)
    return get_last_checkpoint(str(path)) if path.is_dir() else None


def gradient_norm(model) -> float:
    import torch

    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def make_nonfinite_guard(stage_id: str):
    """A TrainerCallback that stops before an optimizer step whose gradients or loss are not finite, so
    the weights and the last good checkpoint stay intact."""
    from transformers import TrainerCallback

    class NonFiniteGuard(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            norm = gradient_norm(model) if model is not None else 0.0
            if not math.isfinite(norm):
                raise NonFiniteError(
                    f"stage '{stage_id}': non-finite gradient norm ({norm}) at step {state.global_step + 1}; "
                    "stopped before the optimizer step. The last checkpoint is intact; lower the learning rate, "
                    "check the data for empty or corrupt rows, or use fp32/bf16 instead of fp16."
                )

        def on_log(self, args, state, control, logs=None, **kwargs):
            loss = (logs or {}).get("loss")
            if loss is not None and not math.isfinite(loss):
                raise NonFiniteError(f"stage '{stage_id}': non-finite loss ({loss}) at step {state.global_step}.")

    return NonFiniteGuard()


PARAMETER_DIGEST_ENV = "ALIGN_DEBUG_PARAM_CHECKSUM_DIR"  # tests of the distributed path


def write_parameter_digest(named_tensors: dict, stage_id: str, rank: int) -> None:
    """When PARAMETER_DIGEST_ENV names a folder, write `<stage>-rank<R>.txt`: a sha256 of this process's
    trainable weights, so a test can check that every rank ended with the same parameters (only rank 0
    saves a checkpoint, so the other ranks' weights are otherwise invisible)."""
    import hashlib

    folder = os.environ.get(PARAMETER_DIGEST_ENV)
    if not folder:
        return
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"{stage_id}-rank{rank}.txt").write_text(digest.hexdigest())


def make_parameter_digest(stage_id: str):
    from transformers import TrainerCallback

    class ParameterDigest(TrainerCallback):
        def on_train_end(self, args, state, control, model=None, **kwargs):
            trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
            write_parameter_digest(trainable, stage_id, args.process_index)

    return ParameterDigest()


def trainer_callbacks(ctx) -> list:
    callbacks = [make_nonfinite_guard(ctx.stage_id)]
    if os.environ.get(PARAMETER_DIGEST_ENV):
        callbacks.append(make_parameter_digest(ctx.stage_id))
    return callbacks


def final_metrics(trainer, **extra) -> dict:
    """Last logged value of each metric, plus the log history written beside the checkpoint."""
    history = trainer.state.log_history
    metrics: dict = {}
    for entry in history:
        metrics.update({k: v for k, v in entry.items() if isinstance(v, (int, float))})
    metrics["global_step"] = trainer.state.global_step
    metrics.update(extra)
    return {"metrics": metrics, "log_history": history}
