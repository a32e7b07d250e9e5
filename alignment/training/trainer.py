"""Glue shared by the TRL-backed stages: training (engine check, resume), saving, the non-finite guard,
final metrics.

Resume: the Trainer checkpoints into the stage's work folder (`<output_dir>/.work/<stage>/trainer`);
a rerun after a crash passes the newest checkpoint to `trainer.train(resume_from_checkpoint=...)`.
Saving goes through `sharding.save_trained`, so it works the same under DDP, FSDP2 and ZeRO-2/3.
"""

from __future__ import annotations

import math
from pathlib import Path

import datasets
import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import SFTTrainer

from ..data.formatting import eos_as_end_of_turn
from ..errors import UserError
from ..models.lora import peft_config
from ..runtime.dist import check_engine
from .context import StageContext
from .sharding import save_trained


class NonFiniteError(UserError):
    """Training produced a NaN/inf loss or gradient; raised before the optimizer step."""


def resume_checkpoint(trainer_dir: str | Path) -> str | None:
    """The newest `checkpoint-N` folder in a trainer's output dir, if any."""
    path = Path(trainer_dir)
    return get_last_checkpoint(str(path)) if path.is_dir() else None


def train(ctx, trainer) -> None:
    """Check the engine the trainer's accelerator runs is the one the launch asked for, then train (resuming
    from the newest checkpoint in the work folder, if any)."""
    check_engine(trainer.accelerator.state, ctx.where)
    trainer.train(resume_from_checkpoint=resume_checkpoint(trainer.args.output_dir))


def save_model(trainer, tokenizer, out_dir: Path, dtype=None, save=None) -> None:
    """The trained model as a stage checkpoint: gathered on every process, written by rank 0 with `save`
    (default `models.save_checkpoint`)."""
    save_trained(trainer.accelerator, trainer.model_wrapped, tokenizer, out_dir, dtype, save=save)


def gradient_norm(model) -> float:
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def make_nonfinite_guard(stage_id: str):
    """A TrainerCallback that stops before an optimizer step whose gradients or loss are not finite, so
    the weights and the last good checkpoint stay intact."""
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


def trainer_callbacks(ctx) -> list:
    """The callbacks every TRL-backed stage trains with."""
    return [make_nonfinite_guard(ctx.stage_id)]


def final_metrics(trainer, **extra) -> dict:
    """Last logged value of each metric, plus the log history written beside the checkpoint."""
    history = trainer.state.log_history
    metrics: dict = {}
    for entry in history:
        metrics.update({k: v for k, v in entry.items() if isinstance(v, (int, float))})
    metrics["global_step"] = trainer.state.global_step
    metrics.update(extra)
    return {"metrics": metrics, "log_history": history}


def make_sft_trainer(ctx: StageContext, args, model, tokenizer, train_rows: list[dict], eval_rows: list[dict] | None = None):
    """The SFTTrainer of the `sft` stage and of each `rsft` round: token rows (`token_rows`) or text rows,
    the stage's LoRA and callbacks, and a tokenizer whose EOS is the end-of-turn token (see
    `formatting.eos_as_end_of_turn`)."""
    return SFTTrainer(
        model=model, args=args, processing_class=eos_as_end_of_turn(tokenizer),
        train_dataset=datasets.Dataset.from_list(train_rows),
        eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
        peft_config=peft_config(ctx.lora) if ctx.lora else None, callbacks=trainer_callbacks(ctx),
    )
