"""Progress bars (rich) for long loops; silent on non-main processes and when disabled."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from .dist import is_main_process

T = TypeVar("T")


def track(items: Iterable[T], description: str, disable: bool = False, total: int | None = None) -> Iterable[T]:
    """`items` with a progress bar on stderr (main process only)."""
    if disable or not is_main_process() or os.environ.get("ALIGN_NO_PROGRESS"):
        yield from items
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as progress:
        yield from progress.track(items, total=total, description=description)


@contextmanager
def counting(description: str, total: int, disable: bool = False):
    """A progress bar of `total` items advanced by calls to the yielded `advance(k)`: for loops that finish items
    out of step with their iterations (a sampler whose rows end at different steps)."""
    if disable or not is_main_process() or os.environ.get("ALIGN_NO_PROGRESS"):
        yield lambda k=1: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda k=1: progress.advance(task, k)
