"""A recipe's own tools (`module:function`) run in a worker process that a timeout can stop.

    worker = ToolWorker([("my_tools:lookup", {"table": "t"})], search_dirs)
    ok, output = worker.call("lookup", {"key": "a"}, timeout=10.0)

One worker per toolbox, started at its first call: a fresh interpreter (`python -m alignment.tools.worker`: nothing
of the trainer's is copied into it, no model, no CUDA context, and unlike multiprocessing's `spawn` it never re-runs
the trainer's main script) that imports the tools itself, the recipe's folder first, binds their `options:` and runs
one call at a time. A call past its timeout, or one that ends the process, is an error; the worker is then killed and
the next call starts a new one (its start is not a call's time). A tool must therefore be importable from its file.
Limits: the worker bounds time only; it is an ordinary process of this user (the machine's files, network and
memory). The `python` tool runs model code in its own sandbox instead; environments stay in the training process
(tools/rollout.py says why).
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from ..errors import UserError
from ..verifiers.registry import _load_target

START_TIMEOUT = 120.0  # seconds a new worker may take to import the tools before its calls fail


def bind_options(fn: Callable, name: str, options: dict) -> Callable:
    """`fn` with the recipe's options as fixed keyword arguments; an option `fn` does not take is an error."""
    if not options:
        return fn
    parameters = inspect.signature(fn).parameters
    unknown = [k for k in options if k not in parameters]
    if unknown:
        raise UserError(
            f"Tool '{name}' has no argument(s) {', '.join(map(repr, unknown))} to bind from `options:`; "
            f"its arguments: {', '.join(parameters) or 'none'}."
        )

    def bound(**arguments):
        return fn(**arguments, **options)

    bound.__name__, bound.__doc__ = name, fn.__doc__
    return bound


def tool_name(target: str) -> str:
    """The name a `module:function` tool is called by: the function's own name."""
    return target.rpartition(":")[2].rpartition(".")[2]


def _serve(connection, targets: list[tuple[str, dict]], search_dirs: list[str]) -> None:
    """The worker's loop: import the tools, say "ready", then answer each (name, arguments) with (ok, text)."""
    try:
        tools = {
            tool_name(target): bind_options(
                _load_target(target, target, [Path(d) for d in search_dirs]), tool_name(target), options
            )
            for target, options in targets
        }
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which turns it into call errors
        # The verifier loader's messages name a verifier; say what this is.
        connection.send(("failed", f"{type(error).__name__}: {error}".replace("Verifier '", "tool '", 1)))
        return
    connection.send(("ready", ""))
    while True:
        try:
            name, arguments = connection.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        try:
            value = tools[name](**arguments)
            reply = (True, value if isinstance(value, str) else str(value))
        except Exception as error:  # noqa: BLE001 - a raising tool is an observation, not a crash
            reply = (False, f"{type(error).__name__}: {error}")
        connection.send(reply)


def _alive(process: subprocess.Popen) -> bool:
    """Whether the worker runs, without reaping it: its pid stays its own until `_kill` has killed its group."""
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _kill(process: subprocess.Popen, connection: Connection) -> None:
    """Close the channel and kill the worker's process group: the processes a tool started die with it."""
    connection.close()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # already gone
        pass
    process.wait()


class ToolWorker:
    """The worker process of one toolbox's `module:function` tools: `call` starts it when needed and kills it
    when a call runs past its timeout. `start_seconds` is how long the last start took (0 when none was needed),
    so the caller can leave it out of a tool's time and count it in the step's."""

    def __init__(self, targets: list[tuple[str, dict]], search_dirs: list[Path]):
        self.targets = list(targets)
        self.search_dirs = [str(d) for d in search_dirs]
        self.process = self.connection = self._finalizer = None
        self.start_seconds = 0.0
        self.broken: str | None = None  # why the tools could not be loaded: it is said again, not retried

    def _start(self) -> str | None:
        """None once a worker is ready, else why none could start."""
        self.start_seconds = 0.0
        if self.broken or self.process is not None and _alive(self.process):
            return self.broken
        self.stop()
        began = time.monotonic()
        ours, theirs = socket.socketpair()
        # The trainer's import path, so the worker imports this package and the tools as the trainer does.
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=environment,
            start_new_session=True,
        )
        theirs.close()
        connection = Connection(ours.detach())
        try:
            connection.send((self.targets, self.search_dirs))
            state, detail = (
                connection.recv() if connection.poll(START_TIMEOUT) else ("failed", "it did not start in time")
            )
        except (EOFError, OSError):
            state, detail = "failed", f"it ended while starting (exit code {process.poll()})"
        self.start_seconds = time.monotonic() - began
        if state != "ready":
            _kill(process, connection)
            self.broken = f"the tools' worker process could not start: {detail}"
            return self.broken
        self.process, self.connection = process, connection
        self._finalizer = weakref.finalize(self, _kill, process, connection)
        return None

    def call(self, name: str, arguments: dict, timeout: float) -> tuple[bool, str]:
        """(ok, output or why it failed) of one call; past `timeout` seconds the worker is killed."""
        problem = self._start()
        if problem:
            return False, problem
        try:
            self.connection.send((name, arguments))
            if not self.connection.poll(timeout):
                self.stop()
                return False, f"'{name}' did not finish within {timeout:g} s (its worker process was stopped)"
            return self.connection.recv()
        except (EOFError, OSError):  # the tool ended the process (os._exit, a crash, SystemExit)
            process = self.process
            self.stop()
            return False, f"'{name}' ended its worker process (exit code {process.returncode})"

    def stop(self) -> None:
        """Kill the worker, if any; the next call starts a new one."""
        if self._finalizer is not None:
            self._finalizer()
        self.process = self.connection = self._finalizer = None


class WorkerTool:
    """One tool of a `ToolWorker`, callable like the function itself (`timeout` per call; a failure raises)."""

    def __init__(self, worker: ToolWorker, name: str, timeout: float = START_TIMEOUT):
        self.worker, self.__name__, self.timeout = worker, name, timeout

    def __call__(self, **arguments) -> str:
        ok, output = self.worker.call(self.__name__, arguments, self.timeout)
        if not ok:
            raise RuntimeError(output)
        return output


if __name__ == "__main__":  # the worker: its end of the socket pair is argv[1]
    channel = Connection(int(sys.argv[1]))
    _serve(channel, *channel.recv())
