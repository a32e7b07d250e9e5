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
from trl import SFTConfig, SFTTrainer

from ..data.formatting import eos_as_end_of_turn
from ..errors import UserError
from ..models.lora import peft_config
from ..runtime.dist import check_engine
from .buckets import training_dataset, with_length_sampling
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


# `trl.SFTConfig` options that the sft and rsft stages' own rendering and tokenization (`training.rows.token_rows`:
# rows of input_ids and a completion mask, which TRL takes as they are) would make silently meaningless or
# break, each with why; `align check` refuses them (`sft_config`). Packing and padding-free training keep the
# mask (TRL turns it into labels before packing) and are left to TRL.
REFUSED_SFT_OPTIONS = {
    "completion_only_loss": (
        lambda v: v is None,
        "null lets TRL decide from the columns of the rows it is handed, "
        "and the stage hands it tokenized rows, so it would train on every token, prompts "
        "included; set true (the default: the loss on the answers, every assistant turn of a "
        "conversation) or false (every token)",
    ),
    "dataset_text_field": (
        lambda v: v != "text",
        "plain-text rows are read from the `text` column; map yours to it "
        "with `data: {rename: {<column>: text}}` instead",
    ),
    "dataset_kwargs": (
        lambda v: bool(v),
        "the stage prepares the rows itself; `skip_prepare_dataset` would also skip "
        "TRL's turning of the stage's completion mask into labels (TRL 1.16 reads no other key)",
    ),
    "chat_template_path": (
        lambda v: v is not None,
        "the rows are rendered with the start model's chat template "
        "before TRL sees them, so a template given to TRL would not be trained on and would "
        "differ from the one saved; set the recipe's `template:` or start from a tokenizer with "
        "that template",
    ),
    "eos_token": (
        lambda v: v is not None,
        "the stage ends every answer with the chat template's end-of-turn token "
        "itself (and plain-text rows with it too), so TRL's EOS setting would change nothing but the "
        "tokenizer; set the end of a turn in the chat template (`template:`) instead",
    ),
}


def sft_config(ctx: StageContext, work_dir: Path | None = None, **stage_defaults):
    """The `trl.SFTConfig` of the sft stage and of each rsft round. `assistant_only_loss: true` is what the stage
    does already (its completion mask covers every assistant turn, content and end-of-turn token), so it is
    accepted and not passed on: TRL would apply it to untokenized conversations only and fail on the stage's
    rows. With `completion_only_loss: false` it contradicts itself; that and `REFUSED_SFT_OPTIONS` are errors."""
    train = ctx.config.train
    for key, (refused, why) in REFUSED_SFT_OPTIONS.items():
        if key in train and refused(train[key]):
            raise UserError(f"{ctx.where}.train.{key}: {train[key]!r} is not supported here: {why}.")
    if train.get("assistant_only_loss") and train.get("completion_only_loss") is False:
        raise UserError(
            f"{ctx.where}.train: assistant_only_loss: true asks for the loss on the assistant turns only "
            "and completion_only_loss: false for the loss on every token; drop one of the two."
        )
    args = ctx.trl_args(SFTConfig, work_dir=work_dir, **stage_defaults)
    args.assistant_only_loss = False  # the stage's completion mask does it (see above)
    return args


def make_sft_trainer(
    ctx: StageContext, args, model, tokenizer, train_rows: list[dict], eval_rows: list[dict] | None = None
):
    """The SFTTrainer of the `sft` stage and of each `rsft` round: token rows (`token_rows`) or text rows,
    the stage's LoRA and callbacks, and a tokenizer whose EOS is the end-of-turn token (see
    `formatting.eos_as_end_of_turn`)."""
    return with_length_sampling(SFTTrainer)(
        model=model,
        args=args,
        processing_class=eos_as_end_of_turn(tokenizer),
        train_dataset=training_dataset(train_rows, args, sft_row_length),
        eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
        peft_config=peft_config(ctx.lora) if ctx.lora else None,
        callbacks=trainer_callbacks(ctx),
    )


def sft_row_length(row: dict) -> int:
    """A token row's length (`rows.token_rows`), or a plain-text row's characters, which order rows alike."""
    return len(row["input_ids"]) if "input_ids" in row else len(row["text"])
