"""Process state and the one log path.

`distributed_state()` is the process group of a run (accelerate's PartialState, gloo on CPU);
`is_main_process()` says whether this process is rank 0, before or after the group exists.

Every message of the toolkit goes through Python `logging`, under the `alignment` logger
(`get_logger(__name__)` in each module). `configure_logging()`, called by the CLI, prints INFO
and above to stdout as plain lines, from rank 0 only (every rank runs every stage, and one line
per event is what a user wants), with secrets masked (`redact.py`). Without it, as under pytest
or in a user's own script, the logger prints nothing below WARNING until the host configures it.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed
from accelerate import PartialState

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


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` (a child of `alignment`, so one configuration covers them all)."""
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")


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
    """Plain `message` lines on stdout from rank 0, secrets masked; idempotent."""
    logger = logging.getLogger(ROOT)
    logger.setLevel(level)
    if not any(isinstance(h, StdoutHandler) for h in logger.handlers):
        logger.addHandler(StdoutHandler())
