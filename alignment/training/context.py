"""What every stage shares: the context a stage runs in and the building of its TRL config.

A stage module (`stages/<kind>.py`) defines `Config` (a `config.stage.StageConfig` subclass), `check(ctx)`
(validation that needs data or models, run by `align check`) and `run(ctx) -> metrics`. The runner
builds a `StageContext`, calls `run`, and writes `stage.json` last.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import PartialState

from ..config.base import did_you_mean
from ..config.data import DataSpec
from ..config.model import LoraSpec
from ..config.stages.base import StageConfig
from ..data.loading import dataset_rows, load_rows
from ..errors import UserError
from ..models.loading import checkpoint_dtype, is_cuda
from ..models.tokenizer import load_tokenizer
from ..runtime.dist import keeps_configured_state
from ..runtime.files import write_atomic
from .fused_head import fit_fused_head_to_cpu
from .memory import needs_gradient_checkpointing
from .prompts import check_prompt_rows, prompt_data_format

if TYPE_CHECKING:
    from ..config.recipe import Recipe

log = logging.getLogger(__name__)


PAIR_KINDS = ("reward", "dpo")  # the stages that read preference pairs (training/pairs.py)


@dataclass
class StageContext:
    """Everything a stage needs to run; paths are already resolved."""

    recipe: Recipe
    stage_id: str
    config: StageConfig
    start_model: str
    out_dir: Path  # staging folder: the checkpoint goes here, the runner moves it into place
    work_dir: Path  # survives crashes: trainer checkpoints for resume
    lora: LoraSpec | None
    is_main: bool = True
    # What the stage made of each data key: the format detected, the columns read and what was trained on;
    # written into stage.json and the model card (`record_data`).
    data_formats: dict[str, dict] = field(default_factory=dict)

    @property
    def seed(self) -> int:
        return self.recipe.seed

    @property
    def where(self) -> str:
        return f"stages.{self.stage_id}"

    def load_data(self, spec: DataSpec | None, key: str = "data"):
        if spec is None:
            raise UserError(f"{self.where}.{key}: this stage needs a '{key}' spec (dataset or task).")
        if spec.format == "hh" and spec.task is None and self.config.kind not in PAIR_KINDS:
            raise UserError(
                f"{self.where}.{key}: `format: hh` reads Anthropic HH-RLHF preference transcripts "
                f"(chosen/rejected), which only {' and '.join(PAIR_KINDS)} stages train on; a "
                f"{self.config.kind} stage reads no pairs, so drop the key."
            )
        return load_rows(spec, self.seed, self.recipe.base_dir, where=f"{self.where}.{key}")

    def load_prompt_rows(self, spec: DataSpec | None, key: str, verifiers: list, gold: list = ()) -> list[dict]:
        """Prompt data of an RL stage (ppo, rsft, rlvr): a `prompt` or `messages` column of strings, and the
        columns the verifiers (and the `gold:` verifiers) need besides the prompt, which these stages hand them;
        checked before training."""
        dataset = self.load_data(spec, key)
        for entry, listed in (("verifiers", verifiers), ("gold", gold)):
            if listed or entry == "verifiers":
                check_prompt_rows(dataset, list(listed), f"{self.where}.{key}", spec, provided=("prompt",), entry=entry)
        rows = list(dataset_rows(dataset))
        self.record_data(key, **prompt_data_format(rows, dataset.column_names, [*verifiers, *gold]))
        return rows

    def record_data(self, key: str, **info) -> None:
        """Say what the stage made of data key `key` (format, columns, what is trained on) in stage.json and the
        model card; logged once."""
        if self.data_formats.get(key) != info:
            self.data_formats[key] = info
            log.info(
                f"[{self.where}.{key}] {info['format']}; columns used: {', '.join(info['columns'])}; trained on: "
                f"{info['trained_on']}"
            )

    def resolve_model(self, value: str) -> str:
        return self.recipe.resolve_model(value)

    def save_dtype(self):
        """The dtype to save this stage's weights in: the recipe's `save_dtype`, by default the start model's own
        (training upcasts to fp32 on CPU: a bf16 135M model would otherwise be saved at twice its size)."""
        if self.recipe.save_dtype != "auto":
            return getattr(torch, self.recipe.save_dtype)
        return checkpoint_dtype(self.start_model, self.recipe.trust_remote_code)

    def load_tokenizer(self):
        """The start model's tokenizer, with the recipe's `template:` settings written into its template."""
        return load_tokenizer(self.start_model, self.recipe.trust_remote_code, self.recipe.template)

    def computed_once(self, name: str, compute) -> tuple[list[dict], dict]:
        """`compute() -> (rows, stats)`, run by the main process first and kept in the work folder as JSON
        lines (stats, then rows), so every process trains on the same rows and a rerun after a crash reads
        them instead of sampling again (`files.write_atomic`: never half a file)."""
        path = self.work_dir / name
        with PartialState().main_process_first():
            if not path.exists():
                rows, stats = compute()
                write_atomic(path, "".join(json.dumps(r) + "\n" for r in [stats, *rows]))
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines[1:]], json.loads(lines[0])

    def trl_args(self, config_class, work_dir: Path | None = None, **stage_defaults):
        """The TRL config: device-aware defaults, then the stage's defaults, then the recipe's `train:`
        (`work_dir`: where the trainer checkpoints, by default the stage's).
        Unless the recipe sets it, gradient checkpointing is on only where the stage would not fit on its
        GPU without it (`memory.py`); TRL turns it on always. On a CPU, TRL's fused LM head is fitted to it first
        (`fused_head.py`: small tiles, labelled positions only)."""
        fit_fused_head_to_cpu()

        def build(checkpointing: bool):
            return build_trl_config(
                config_class,
                self.recipe,
                self.stage_id,
                self.config.train,
                work_dir or self.work_dir,
                checkpointing=checkpointing,
                **stage_defaults,
            )

        args = build(checkpointing=False)
        if sets_checkpointing(self.config.train) or not needs_gradient_checkpointing(
            args,
            self.config.kind,
            self.start_model,
            self.lora.r if self.lora else None,
            self.recipe.trust_remote_code,
            f"{self.where}.train",
        ):
            return args
        return build(checkpointing=True)


def device_defaults(recipe: Recipe, work_dir: Path) -> dict[str, Any]:
    """TRL defaults that suit the device: TRL's bf16=True fails or crawls on CPU (checkpointing: `trl_args`).
    Where the run set up FSDP2 itself (`dist.fsdp_on_cpu`), the trainer reuses that process state."""
    cuda = is_cuda()
    configured = {"accelerator_config": {"use_configured_state": True}} if keeps_configured_state() else {}
    return dict(
        **configured,
        output_dir=str(work_dir / "trainer"),
        seed=recipe.seed,
        data_seed=recipe.seed,
        bf16=cuda and torch.cuda.is_bf16_supported(),
        fp16=False,
        use_cpu=not cuda,
        report_to=recipe.report_to,
        logging_steps=10,
        save_strategy="steps",
        save_steps=200,
        save_total_limit=1,
        dataloader_pin_memory=cuda,
        ddp_find_unused_parameters=False,
    )


# transformers 5 renamed gradient checkpointing to activation checkpointing and keeps the old names as
# aliases that count only when the new ones are unset: a recipe may use either.
CHECKPOINTING_KEYS = ("activation_checkpointing", "gradient_checkpointing")


def sets_checkpointing(train: dict) -> bool:
    return any(key in train for key in CHECKPOINTING_KEYS)


def checkpointing_defaults(fields: set[str], on: bool) -> dict[str, Any]:
    """Checkpointing on or off under the name this transformers reads; non-reentrant, which needs no
    gradient on the inputs of frozen (LoRA) layers."""
    key = next(key for key in CHECKPOINTING_KEYS if key in fields)
    return {key: on, f"{key}_kwargs": {"use_reentrant": False}} if on else {key: False}


# TrainingArguments keys that would choose an engine per stage; the launch's accelerate config chooses it
# for the whole run (every stage, PPO's own loop included).
ENGINE_KEYS = ("deepspeed", "fsdp", "fsdp_config")


def build_trl_config(
    config_class,
    recipe: Recipe,
    stage_id: str,
    train: dict,
    work_dir: Path,
    checkpointing: bool = False,
    **stage_defaults,
):
    """Build `config_class` (e.g. trl.SFTConfig); unknown or rejected knobs become UserErrors."""
    where = f"stages.{stage_id}.train"
    fields = {f.name for f in dataclasses.fields(config_class)}
    for key in train:
        if key in ENGINE_KEYS:
            raise UserError(
                f"{where}.{key}: the engine (FSDP, DeepSpeed) is chosen by the accelerate config of the "
                "launch, for every stage at once, not per stage: drop this key and launch with e.g. "
                "`accelerate launch --config_file configs/accelerate/zero3.yaml -m alignment run RECIPE` "
                '(README "Distributed runs").'
            )
        if key not in fields:
            raise UserError(f"{where}: unknown {config_class.__name__} option '{key}'{did_you_mean(key, fields)}.")
    device = device_defaults(recipe, work_dir)
    if not sets_checkpointing(train):
        device.update(checkpointing_defaults(fields, checkpointing))
    kwargs = {**device, **stage_defaults, **train}
    kwargs = {k: v for k, v in kwargs.items() if k in fields}
    try:
        return config_class(**kwargs)
    except (ValueError, TypeError) as error:
        raise UserError(f"{where}: {config_class.__name__} rejected the settings: {error}") from None
