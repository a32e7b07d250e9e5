"""Process state, the training engine, and the one log path.

`distributed_state()` is the process group of a run (accelerate's PartialState, gloo on CPU);
`is_main_process()` says whether this process is rank 0, before or after the group exists.

Engines (README "Distributed runs"): `accelerate launch` names one in the environment it gives each
process (`launched_engine()`: fsdp2, zero1/2/3, or None for plain data parallel); `engine_of(state)`
names the one accelerate actually set up (adding ddp and single). `start_engine()` checks the launch at the
start of a recipe, `check_engine` each stage's accelerator before training. `full_weights()` loads a model
whole on every process even under ZeRO-3 or FSDP's CPU-RAM-efficient loading, for the models that are used
but not trained.

Every message of the toolkit goes through Python `logging`, under the `alignment` logger
(`get_logger(__name__)` in each module); `configure_logging()` prints it from rank 0 with secrets masked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import uuid
from importlib.util import find_spec
from pathlib import Path
from unittest import mock

import torch
import torch.distributed
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    broadcast_object_list,
    gather_object,
)
from transformers.integrations import deepspeed as hf_deepspeed

from ..errors import UserError
from .redact import redact, secret_values

ROOT = "alignment"


def distributed_state() -> PartialState:
    """The process group of this run. Without a GPU we ask for the CPU (gloo) backend: a plain
    PartialState() under torchrun on CPU would quietly treat every worker as rank 0 of 1."""
    return PartialState(cpu=not torch.cuda.is_available())


def is_main_process() -> bool:
    """Rank 0 of the process group, or, before one exists, of the launcher's `RANK`."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0


# Engines that partition the parameters themselves across processes: no process holds the whole model.
PARTITIONED = ("fsdp2", "zero3")
CPU_CONFIGS = {"fsdp2": "fsdp2_cpu", "zero1": "zero2_cpu", "zero2": "zero2_cpu", "zero3": "zero3_cpu"}


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def launched_engine() -> str | None:
    """The engine `accelerate launch` asked for, read from the environment it sets: 'fsdp1', 'fsdp2', 'zero1',
    'zero2', 'zero3', or None (plain data parallel or no launcher)."""
    if _flag("ACCELERATE_USE_DEEPSPEED"):
        return f"zero{deepspeed_stage()}"
    if _flag("ACCELERATE_USE_FSDP"):
        return f"fsdp{os.environ.get('FSDP_VERSION', '1')}"
    return None


def deepspeed_setting(key: str, env: str, default):
    """A `zero_optimization` setting of the launch: from its `deepspeed_config_file` if it has one, else the
    accelerate config's field (`env`, as accelerate launch passes it)."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path:
        return os.environ.get(env, default)
    try:
        return json.loads(Path(path).read_text()).get("zero_optimization", {}).get(key, default)
    except (OSError, ValueError) as error:
        raise UserError(
            f"the accelerate config's deepspeed_config_file '{path}' could not be read ({error}); its "
            "path is relative to the folder `accelerate launch` runs in."
        ) from None


def deepspeed_stage() -> int:
    """The ZeRO stage of the launch: `zero_stage` of the accelerate config, or of its `deepspeed_config_file`."""
    return int(deepspeed_setting("stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE", 0))


def engine_of(state: AcceleratorState) -> str:
    """The engine an initialised AcceleratorState runs: 'zero<N>', 'fsdp<N>', 'ddp' or 'single'."""
    if state.distributed_type == DistributedType.DEEPSPEED:
        return f"zero{state.deepspeed_plugin.zero_stage}"
    if state.distributed_type == DistributedType.FSDP:
        return f"fsdp{state.fsdp_plugin.fsdp_version}"
    return "ddp" if state.num_processes > 1 else "single"


def check_launch(asked: str | None, num_processes: int) -> None:
    """Refuse, before any work, a launch that would not run the way it asked (accelerate would quietly fall
    back to DDP or to one process, or train in a precision the toolkit does not use on CPU)."""
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    cpu = not torch.cuda.is_available()
    if cpu and precision not in ("no", ""):
        config = f"configs/accelerate/{CPU_CONFIGS.get(asked, 'cpu_2proc')}.yaml"
        raise UserError(
            f"the launch asks for mixed_precision {precision}, but this machine has no GPU: on CPU every "
            f"stage trains in fp32 (bf16 matmuls there are slow and imprecise). Launch with "
            f"mixed_precision: 'no' (e.g. --config_file {config})."
        )
    if not cpu and precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise UserError(
            "the launch asks for mixed_precision bf16, which this GPU does not support; the stages train "
            "in fp32 here: launch with mixed_precision: 'no'."
        )
    if asked is None:
        return
    if asked.startswith("fsdp") and asked != "fsdp2":
        raise UserError(
            f"the launch asks for FSDP version {asked[4:]}; this toolkit runs FSDP2 only (set "
            "fsdp_version: 2 in the accelerate config, as configs/accelerate/fsdp2.yaml does)."
        )
    if num_processes < 2:
        raise UserError(
            f"the launch asks for {asked}, but the run has {num_processes} process: nothing would be "
            "sharded. Launch with num_processes of 2 or more, or without the FSDP/DeepSpeed config."
        )
    if asked.startswith("zero") and find_spec("deepspeed") is None:
        raise UserError(
            f"the launch asks for DeepSpeed {asked}, which is not installed; install it with "
            "`pip install 'alignment-toolkit[deepspeed]'` (it builds from source, about a minute)."
        )
    if asked.startswith("zero") and _flag("ACCELERATE_USE_CPU"):
        raise UserError(
            f"the launch asks for DeepSpeed {asked}, but ACCELERATE_USE_CPU is set, with which accelerate "
            "runs plain DDP instead; unset it (DeepSpeed runs on CPU without it)."
        )
    if asked == "zero3" and str(
        deepspeed_setting(  # false is accelerate's and DeepSpeed's default
            "stage3_gather_16bit_weights_on_model_save", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false"
        )
    ).lower() not in ("true", "1"):
        raise UserError(
            "the launch's ZeRO-3 config does not gather the weights for saving, so no stage could write its "
            "checkpoint: set zero3_save_16bit_model: true in the accelerate config (or "
            "stage3_gather_16bit_weights_on_model_save in its deepspeed_config_file)."
        )


def check_engine(state: AcceleratorState, where: str) -> str:
    """The engine a stage's accelerator runs; an error when it is not the one the launch asked for."""
    asked, actual = launched_engine(), engine_of(state)
    if asked is not None and actual != asked:
        raise UserError(
            f"{where}: the launch asks for {asked}, but accelerate set this stage up as {actual}, so it "
            f"would train unsharded; stopped before training."
        )
    return actual


def fsdp_on_cpu() -> None:
    """Switch FSDP2 on where accelerate leaves it off. accelerate enables FSDP only for GPU-like process groups
    and trains plain DDP on a CPU (gloo) group, although torch's `fully_shard` runs there. We initialise the
    AcceleratorState with the launch's FSDP plugin and mark it FSDP; every later Accelerator reuses it (the
    TRL configs say `use_configured_state`, so TrainingArguments does not reset it: `keeps_configured_state`)."""
    state = Accelerator().state
    if state.distributed_type != DistributedType.FSDP:
        state.fsdp_plugin = FullyShardedDataParallelPlugin()
        state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def keeps_configured_state() -> bool:
    """Whether the process state was set up by `fsdp_on_cpu` and trainers must reuse it as it is."""
    shared = AcceleratorState._shared_state
    return shared.get("distributed_type") == DistributedType.FSDP and not torch.cuda.is_available()


def start_engine(output_dir: Path) -> str | None:
    """At the start of a run: check the launch, set up FSDP2 on CPU, check `output_dir` is shared.

    It refuses launches that would not shard (one process, FSDP1, DeepSpeed missing, mixed precision on CPU),
    turns FSDP2 on where accelerate leaves it off (CPU process groups), and checks that every process sees the
    same `output_dir`. Every stage then checks the engine its accelerator really runs (`check_engine`)."""
    state = distributed_state()
    asked = launched_engine()
    check_launch(asked, state.num_processes)
    if asked == "fsdp2" and state.distributed_type == DistributedType.MULTI_CPU:
        fsdp_on_cpu()
    if state.num_processes > 1:
        check_shared_folder(output_dir)
    return asked


def check_shared_folder(folder: Path) -> None:
    """Every process must see the files rank 0 writes in `folder` (stages read earlier stages' outputs, and
    only rank 0 writes): rank 0 writes a random token there, every process reads it back. A node that has its
    own local folder instead fails here, before any work, rather than at its first stage."""
    state = PartialState()
    token = uuid.uuid4().hex
    probe = folder / ".shared-check"
    if is_main_process():
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    token = broadcast_object_list([token])[0]
    state.wait_for_everyone()
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    results = gather_object([(state.process_index, socket.gethostname(), seen)])
    state.wait_for_everyone()
    if is_main_process():
        probe.unlink(missing_ok=True)
    blind = [f"rank {rank} on {host}" for rank, host, ok in results if not ok]
    if blind:
        raise UserError(
            f"output_dir '{folder}' is not shared by all processes: {', '.join(blind)} cannot see the "
            "file rank 0 wrote there. Every process reads the outputs of earlier stages and only rank 0 "
            "writes them, so on several machines output_dir must be on a shared filesystem (NFS, a "
            "cluster filesystem) mounted at the same path on every node."
        )


def loads_partitioned() -> bool:
    """Whether `from_pretrained` may now give this process less than the whole model: ZeRO-3's zero.Init (a
    DeepSpeed config with stage 3 is registered with transformers), or FSDP's CPU-RAM-efficient loading, under
    which transformers leaves the weights a checkpoint lacks (a fresh score head) on the meta device on every
    rank but 0, for the engine to broadcast rank 0's when it wraps the model."""
    fsdp_rank0_loading = _flag("ACCELERATE_USE_FSDP") and _flag("FSDP_CPU_RAM_EFFICIENT_LOADING")
    return hf_deepspeed.is_deepspeed_zero3_enabled() or (fsdp_rank0_loading and torch.distributed.is_initialized())


@contextlib.contextmanager
def full_weights():
    """Load models whole on every process inside this block, also under ZeRO-3 (transformers otherwise loads
    into zero.Init partitions once a ZeRO-3 config exists) and FSDP's CPU-RAM-efficient loading (`meta`
    tensors on the other ranks for weights the checkpoint lacks). For models that are used but never wrapped by the
    engine: samplers, reward models,
    references of our own loop, evaluation."""
    registered = hf_deepspeed._hf_deepspeed_config_weak_ref  # transformers keeps it as a weak reference
    config = registered() if registered is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        with mock.patch.dict(os.environ, {"FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}):
            yield
    finally:
        if config is not None:
            hf_deepspeed.set_hf_deepspeed_config(config)


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` (a child of `alignment`, so one configuration covers them all)."""
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")


# Above this share of a stage's rows dropped, truncated or cut, saying so is a warning, not a note.
LOUD_SHARE = 0.05


def log_share(logger: logging.Logger, count: int, total: int, message: str) -> None:
    """Say `message` about `count` of `total` rows: a warning when they are more than LOUD_SHARE of them, else
    a note (a few cut rows are routine; many change what the stage trains on)."""
    (logger.warning if count > LOUD_SHARE * total else logger.info)(message)


class MainProcessOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return is_main_process()


class Redacted(logging.Filter):
    """Masks secret values (HF_TOKEN, ...) in the formatted message."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact(message, secret_values())
        if masked != message:
            record.msg, record.args = masked, None
        return True


class StdoutHandler(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is at the time of each message (a test's capture, a redirect)."""

    def __init__(self):
        super().__init__()
        self.addFilter(MainProcessOnly())
        self.addFilter(Redacted())
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value):
        pass


def configure_logging(level: int = logging.INFO) -> None:
    """Plain `message` lines on stdout from rank 0, secrets masked; idempotent.

    Called by the CLI: INFO and above as plain lines, from rank 0 only (every rank runs every stage, and one
    line per event is what a user wants), with secrets masked (`redact.py`). Without it, as under pytest or in
    a user's own script, the logger prints nothing below WARNING until the host configures it."""
    logger = logging.getLogger(ROOT)
    logger.setLevel(level)
    if not any(isinstance(h, StdoutHandler) for h in logger.handlers):
        logger.addHandler(StdoutHandler())
