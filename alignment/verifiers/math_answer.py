"""`math` verifier: symbolic answer checking with Hugging Face's math-verify.

The completion is parsed by ``math_verify.parse`` (boxed answers, LaTeX, plain expressions; the
boxed answer has priority) and compared with the `answer` column by ``math_verify.verify``, so
``\\frac{1}{2}`` equals 0.5, ``2\\sqrt{2}`` equals ``\\sqrt{8}``, ``x^2+2x+1`` equals ``(x+1)^2`` and
``{1,2}`` equals ``{2,1}``. The gold answer may be a number, a LaTeX string (with or without ``$``
or ``\\boxed``) or a GSM8K solution ending in ``#### 42``.

Returns 1.0 / 0.0, or None when nothing could be parsed from the completion. A gold answer that
math-verify cannot parse raises ValueError (reported as an error row). math-verify handles its own
``timeout`` (seconds, per parse and per comparison) by giving up: a parse that times out counts as
unparseable, a comparison that times out as wrong. Our process backstop (below) raises TimeoutError,
an error row.

Timeouts: math-verify interrupts itself with ``signal.alarm``, which only works in the main thread
of the main interpreter. In the main thread we let it do that. Anywhere else (a thread pool in an
evaluation, a dataloader thread) we run the check in a worker process instead, a one-process
``multiprocessing.Pool`` started with "spawn" (forking a process that has threads can deadlock):
the worker calls math-verify in *its* main thread, so the alarm-based timeouts still apply there,
and the caller waits at most ``timeout`` (x2 + 5 s slack for start-up) on the result; if that
backstop fires, the worker is killed and a fresh one starts on the next call. Calls from threads
are serialised through one worker (math-verify takes milliseconds; a slow one does not eat the
others' timeout budget). Run ``python -m pytest tests/test_verifiers_math.py`` for the cases.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.pool
import threading
from collections.abc import Callable
from numbers import Real
from typing import Any

from alignment.errors import UserError

_POOL: multiprocessing.pool.Pool | None = None
_POOL_LOCK = threading.Lock()
_STARTUP_SLACK_S = 5.0  # a spawned worker re-imports math-verify + sympy before its first answer


def _gold_text(answer: Any) -> str:
    if isinstance(answer, bool) or answer is None:
        raise ValueError(f"answer column is {answer!r}, expected a math answer")
    text = str(answer).strip()
    if "####" in text:  # a GSM8K solution: the answer is after the marker
        text = text.rsplit("####", 1)[1].strip()
    if isinstance(answer, Real) or ("$" not in text and "\\boxed" not in text):
        text = f"${text}$"  # bare LaTeX ("\\sqrt{8}") only parses inside math delimiters
    return text


def check(completion: str, answer: Any, timeout: int) -> float | None:
    """The comparison itself; call only in a main thread (math-verify sets signal.alarm)."""
    from math_verify import parse
    from math_verify import verify as math_verify

    gold = parse(_gold_text(answer), parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the answer column {str(answer)[:80]!r}")
    predicted = parse(completion, parsing_timeout=timeout)
    if not predicted:
        return None
    return 1.0 if math_verify(gold, predicted, timeout_seconds=timeout) else 0.0


def _pool() -> multiprocessing.pool.Pool:
    global _POOL
    if _POOL is None:
        _POOL = multiprocessing.get_context("spawn").Pool(processes=1)
    return _POOL


def _shutdown_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.terminate()
        _POOL = None


atexit.register(_shutdown_pool)


def run_in_worker(func: Callable, args: tuple, timeout: float) -> Any:
    """Run func(*args) in the worker process; TimeoutError (and a fresh worker) if it takes too long.

    func must be importable by name (the worker is a spawned process)."""
    with _POOL_LOCK:
        pending = _pool().apply_async(func, args)
        try:
            return pending.get(timeout)
        except multiprocessing.TimeoutError:
            _shutdown_pool()  # the only way to stop a stuck computation is to kill its process
            raise TimeoutError(f"math verification took longer than {timeout:g} s; worker restarted") from None


def verify(completion: str, answer: Any, *, timeout: int = 5) -> float | None:
    """1.0 if the completion's answer equals `answer` mathematically, 0.0 if not, None if none."""
    if threading.current_thread() is threading.main_thread():
        return check(completion, answer, timeout)
    return run_in_worker(check, (completion, answer, timeout), 2 * timeout + _STARTUP_SLACK_S)


def check_options(options: dict) -> None:
    """Called by resolve(): the timeout is whole seconds because signal.alarm takes an int."""
    timeout = options.get("timeout", 5)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
        raise UserError(f"Verifier 'math': option timeout={timeout!r} must be a whole number of seconds >= 1.")


verify.check_options = check_options  # type: ignore[attr-defined]
