"""OpenEnv environments in rollouts: `environment: {openenv: {url: ...}}` or `{openenv: {app: module:Class}}`.

    with serving(stage_out_dir):                # one scope per stage (the runner's); its servers stop at its end
        connection = connect(OpenEnvServer(app="my_env:GuessEnv"), search_dirs, "stages.rlvr")
        session = connection.session_class()()  # one per rollout; reset(row): the row's columns go to reset()
        ok, text = session.call("guess", {"number": 3}, timeout=10.0)   # opens, resets (1st call), steps
        session.reward()                        # the sum of its observations' rewards; closes it

Client and server are openenv-core's (`MCPToolClient` over its WebSocket; `create_fastapi_app` under uvicorn). An
`app:` is served in its own process on a port bound on 127.0.0.1, health-checked for `start_timeout`, logged to
`openenv-<name>.log` in the scope's folder; a server that fails to start or ends mid-stage is an error naming it.
Bounds: a session opens at its first call; a request waits at most the call's tool budget; past it the session takes
no calls and its reward is refused. An observation's `done` ends the rollout. openenv's JSON sends a non-finite reward
as null, so a served class checks its own (the call fails, the reward is refused); a `url:` server's goes unseen.
Limits: openenv-core is an optional extra; its gradio web UI is not imported; reset's observation is not shown.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from ..config.tools import OpenEnvServer
from ..errors import UserError
from ..verifiers.registry import _load_target

# The toolkit's logger (runtime.dist.get_logger names the same one; importing it would bring torch into the server).
log = logging.getLogger(__name__)
INSTALL = 'pip install -e ".[tasks]" (or pip install openenv-core)'
NON_FINITE = "non-finite reward"  # the served environment's error for a reward that is no finite number
STOP_GRACE = 5.0  # seconds a served environment has to exit on SIGTERM before it is killed
LOG_TAIL = 6  # lines of a served environment's log quoted in its error


@contextlib.contextmanager
def _without_gradio():
    """openenv-core imports gradio (its optional web UI, seconds to import) unless that import fails."""
    blocked = "gradio" not in sys.modules
    if blocked:
        sys.modules["gradio"] = None  # an import of gradio raises ModuleNotFoundError, which openenv-core expects
    try:
        yield
    finally:
        if blocked and "gradio" in sys.modules and sys.modules["gradio"] is None:
            del sys.modules["gradio"]


def _library():
    """openenv-core's client class and MCP types, or a UserError saying how to install it."""
    try:
        with _without_gradio():
            from openenv.core.env_server import mcp_types
            from openenv.core.mcp_client import MCPToolClient
    except ImportError as error:
        message = f"An OpenEnv environment needs openenv-core, which cannot be imported ({error}); {INSTALL}."
        raise UserError(message) from None
    return MCPToolClient, mcp_types


# ---------------------------------------------------------------------------------------------------
# Scopes: what a stage started, stopped when it ends


class Scope:
    """The servers and connections opened inside one `serving` block, and the folder their logs go to."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.connections: dict[tuple, Connection] = {}
        self.servers: list[Server] = []

    def log_path(self, name: str) -> Path:
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="align-openenv-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        for index in range(1, 1000):  # several servers (or processes) in one folder each get their own log
            path = self.folder / (f"openenv-{name}.log" if index == 1 else f"openenv-{name}-{index}.log")
            try:
                path.open("x").close()
                return path
            except FileExistsError:
                continue
        raise UserError(f"{self.folder} holds too many OpenEnv logs named openenv-{name}*.log; remove them.")

    def close(self) -> None:
        for connection in self.connections.values():
            connection.close()
        for server in self.servers:
            server.stop()
        self.connections.clear()
        self.servers.clear()


_SCOPES: list[Scope] = []
_OUTSIDE: list[Scope] = []  # the scope of work outside any `serving` block, closed when the process exits


@contextlib.contextmanager
def serving(folder: Path | str | None):
    """A block whose OpenEnv servers log into `folder` (a temporary folder for None) and stop when it ends."""
    scope = Scope(Path(folder) if folder is not None else None)
    _SCOPES.append(scope)
    try:
        yield scope
    finally:
        _SCOPES.remove(scope)
        scope.close()


def _scope() -> Scope:
    if _SCOPES:
        return _SCOPES[-1]
    if not _OUTSIDE:
        _OUTSIDE.append(Scope(None))
        atexit.register(_OUTSIDE[0].close)
    return _OUTSIDE[0]


def connect(spec: OpenEnvServer, search_dirs: list[Path], where: str) -> Connection:
    """The connection to the environment `spec` names (served first for `app:`), its tools listed; one per scope."""
    scope = _scope()
    key = (spec.model_dump_json(), tuple(str(d) for d in search_dirs))
    found = scope.connections.get(key)
    if found is not None:
        if found.server is not None:
            found.server.check()  # one that ended is an error, never silently served again
        return found
    server = None
    if spec.app:
        load_app(spec, search_dirs, where)
        server = Server.start(spec, search_dirs, scope.log_path(spec.app.rpartition(":")[2]), where)
        scope.servers.append(server)
    connection = Connection(server.url if server else spec.url, spec, server, where)
    try:
        connection.list_tools()
    except BaseException:
        connection.close()
        raise
    scope.connections[key] = connection
    served = f" (served; its log: {server.log})" if server else ""
    log.info(f"[{where}] OpenEnv environment at {connection.url}{served}: tools {', '.join(connection.names)}")
    return connection


# ---------------------------------------------------------------------------------------------------
# Serving an `app:`


def load_app(spec: OpenEnvServer, search_dirs: list[Path], where: str) -> Any:
    """The `app:` target imported here, so a wrong name is an error before a server starts: an OpenEnv MCP
    environment class (`MCPEnvironment`), or a FastAPI app (as `create_app` builds one) served as it is."""
    _library()  # openenv-core first, without gradio: the app's own imports of it then find it loaded
    try:
        target = _load_target(spec.app, spec.app, search_dirs)
    except UserError as error:
        message = str(error).replace("Verifier ", "OpenEnv app ", 1)
        raise UserError(f"{where}.environment.openenv.app: {message}") from None
    from fastapi import FastAPI
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.mcp_environment import MCPEnvironment

    if isinstance(target, FastAPI):
        return target
    if not (isinstance(target, type) and issubclass(target, Environment)):
        raise UserError(
            f"{where}.environment.openenv.app: '{spec.app}' is a {type(target).__name__}, neither an OpenEnv "
            "environment class (openenv.core.env_server.mcp_environment.MCPEnvironment) nor a FastAPI app."
        )
    if not issubclass(target, MCPEnvironment):
        raise UserError(
            f"{where}.environment.openenv.app: '{spec.app}' is an OpenEnv Environment without MCP tools; the model "
            "calls an environment's tools, so derive it from MCPEnvironment and register its tools on a FastMCP."
        )
    if spec.max_sessions > 1 and not getattr(target, "SUPPORTS_CONCURRENT_SESSIONS", False):
        raise UserError(
            f"{where}.environment.openenv.app: every rollout of a batch holds its own session at once, and "
            f"'{spec.app}' does not say it supports concurrent sessions. Set SUPPORTS_CONCURRENT_SESSIONS = True "
            "on the class (each session is its own instance; share no state between instances), or "
            "max_sessions: 1 for batches of one rollout."
        )
    return target


class Server:
    """A served `app:`: its process (own session and process group), its address and its log."""

    def __init__(self, process: subprocess.Popen, url: str, log: Path, app: str, where: str):
        self.process, self.url, self.log, self.app, self.where = process, url, log, app, where

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    @classmethod
    def start(cls, spec: OpenEnvServer, search_dirs: list[Path], log: Path, where: str) -> Server:
        """Bind a free port on 127.0.0.1, start the server process on it, wait until /health answers."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(socket.SOMAXCONN)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        # The folder this process imported the app's module from comes first: the server imports the same file.
        folders = [*_import_root(spec.app.partition(":")[0]), *search_dirs]
        settings = {"app": spec.app, "search_dirs": [str(d) for d in folders], "max_sessions": spec.max_sessions}
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            with log.open("ab") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(listener.fileno()), json.dumps(settings)],
                    pass_fds=[listener.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=environment,
                    start_new_session=True,
                )
        finally:
            listener.close()  # the server holds its own copy
        server = cls(process, url, log, spec.app, where)
        deadline = time.monotonic() + spec.start_timeout
        try:
            while not _healthy(url):
                if not server.running:
                    server.fail(f"it ended (exit code {process.returncode}) before it answered")
                if time.monotonic() > deadline:
                    server.fail(f"it did not answer {url}/health within start_timeout ({spec.start_timeout:g} s)")
                time.sleep(0.1)
        except BaseException:  # the error above, or an interrupt: nothing is left running
            server.stop()
            raise
        return server

    def fail(self, why: str):
        lines = self.log.read_text(errors="replace").strip().splitlines()[-LOG_TAIL:] if self.log.exists() else []
        tail = (" Its last lines: " + " | ".join(line.strip() for line in lines)) if lines else ""
        raise UserError(
            f"{self.where}.environment: the OpenEnv environment '{self.app}' served at {self.url} failed: {why}. "
            f"Its log: {self.log}.{tail}"
        )

    def check(self) -> None:
        """An error naming the log when the server ended while the stage used it."""
        if not self.running:
            self.fail(f"its process ended (exit code {self.process.returncode}) while the stage used it")

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def _import_root(name: str) -> list[Path]:
    """[the sys.path entry module `name` was imported from], or [] when it was not imported from a file."""
    file = getattr(sys.modules.get(name), "__file__", None)
    if not file:
        return []
    depth = name.count(".") + (Path(file).name == "__init__.py")
    return [Path(file).resolve().parents[depth]]


def _healthy(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    try:
        with opener.open(f"{url}/health", timeout=1.0) as response:
            return response.status == 200
    except OSError:
        return False


def _serve(fd: int, settings: dict) -> None:
    """The server process: import the app as the parent did, serve it with uvicorn on the socket it was handed."""
    import uvicorn

    with _without_gradio():  # create_fastapi_app serves no web UI; the app may still import gradio itself
        from openenv.core.env_server.http_server import create_fastapi_app
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    target = _load_target(settings["app"], settings["app"], settings["search_dirs"])
    if isinstance(target, type) and issubclass(target, Environment):
        target = create_fastapi_app(
            _checked_rewards(target), CallToolAction, CallToolObservation, max_concurrent_envs=settings["max_sessions"]
        )
    listener = socket.socket(fileno=fd)
    # large messages are let in; a stop waits at most a second for calls still running (a hung tool)
    config = uvicorn.Config(target, log_level="warning", ws_max_size=1 << 26, timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=[listener])


def _checked_rewards(cls: type) -> type:
    """`cls` whose steps fail on a reward that is no finite number: openenv's JSON would send it as null."""

    def check(observation):
        reward = getattr(observation, "reward", None)
        if isinstance(reward, int | float) and not math.isfinite(reward):
            raise ValueError(f"{NON_FINITE} {reward!r} from {cls.__name__}")
        return observation

    async def step_async(self, action, *args, **kwargs):
        return check(await cls.step_async(self, action, *args, **kwargs))

    def step(self, action, *args, **kwargs):
        return check(cls.step(self, action, *args, **kwargs))

    return type(cls.__name__, (cls,), {"step_async": step_async, "step": step, "__module__": cls.__module__})


# ---------------------------------------------------------------------------------------------------
# The client side: one connection per environment, one session per rollout


class Connection:
    """The client side of one environment: its address, its tools, and an event loop thread its sessions share."""

    def __init__(self, url: str, spec: OpenEnvServer, server: Server | None, where: str):
        self.url, self.spec, self.server, self.where = url, spec, server, where
        self.client_class, self.types = _library()
        self.schemas: list[dict] = []
        self.closing: list = []  # the sessions' close requests still running on the loop
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="openenv-client", daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout: float):
        """The coroutine's result on the connection's loop; TimeoutError past `timeout` seconds (it is cancelled)."""
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coroutine, timeout), self.loop)
        try:
            return future.result(timeout + STOP_GRACE)  # wait_for has cancelled it by then; this is a backstop
        except TimeoutError:
            future.cancel()
            raise

    def client(self):
        # Our own wait_for bounds each request, so the client's own receive timeout is set out of its way.
        return self.client_class(base_url=self.url, connect_timeout_s=self.spec.timeout, message_timeout_s=1e6)

    def failed(self, error: BaseException, refused: bool = False) -> UserError:
        """The error for a server that cannot be reached or refuses a session (a served one's log is named)."""
        if self.server is not None:
            self.server.check()
        detail = f"{type(error).__name__}: {error}"
        if refused:  # every rollout of a batch that calls a tool holds a session until the batch ends
            more = "`max_sessions`" if self.server is not None else "its sessions (max_concurrent_envs)"
            log = f" (its log: {self.server.log})" if self.server is not None else ""
            return UserError(
                f"{self.where}.environment: the OpenEnv server at {self.url} refused a session ({detail}){log}. A "
                f"batch holds one session per rollout that calls a tool, all at once: raise {more}, or sample fewer "
                "rollouts at once; or the environment could not be built."
            )
        return UserError(
            f"{self.where}.environment: the OpenEnv server at {self.url} could not be used ({detail}). Start it "
            "(or check the address), or let the stage serve the environment with `openenv: {app: module:Class}`."
        )

    def list_tools(self) -> None:
        """Fill `schemas` with the environment's MCP tools as chat templates take them; none is an error."""
        client = self.client()

        async def listed():
            try:
                await client.connect()
                return await client.list_tools(use_cache=False)
            finally:
                await client.close()

        try:
            tools = self.run(listed(), self.spec.timeout)
        except Exception as error:  # noqa: BLE001 - connection refused, timeout, a server error
            raise self.failed(error) from None
        if not tools:
            raise UserError(f"{self.where}.environment: the OpenEnv environment at {self.url} lists no MCP tools.")
        self.schemas = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description or "",
                    "parameters": tool.input_schema or {"type": "object", "properties": {}},
                },
            }
            for tool in tools
        ]

    @property
    def names(self) -> list[str]:
        return [schema["function"]["name"] for schema in self.schemas]

    def session_class(self) -> type:
        """A class built without arguments, one instance per rollout, as the toolbox's environment."""
        return type("OpenEnvSession", (OpenEnvSession,), {"connection": self})

    def close(self) -> None:
        """Wait (bounded) for the sessions still closing, then stop the loop."""
        concurrent.futures.wait(self.closing, timeout=self.spec.timeout)
        self.closing.clear()
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(STOP_GRACE)


class OpenEnvSession:
    """One rollout's session: reset to `reset(row)`'s row at its first call, a step per `call`, the rewards of its
    observations summed by `reward()`, which closes it. A failure is a reason in `broken`: later calls fail with it."""

    connection: Connection

    def __init__(self):
        self.client = None
        self.arguments: dict = {}
        self.rewards: list[float] = []
        self.done = False
        self.broken: str | None = None
        self.bad_reward: str | None = None

    def tools(self, names: list[str]) -> dict[str, OpenEnvTool]:
        return {name: OpenEnvTool(self, name) for name in names}

    def reset(self, row: dict) -> None:
        """Keep the row; the session is opened and reset at the rollout's first call, within that call's time, so a
        hung server costs no more than the tool bounds allow (and a rollout that calls no tool opens none)."""
        self.arguments = json.loads(json.dumps(row, default=str))  # the columns as JSON gives them to reset()

    def _open(self, timeout: float) -> None:
        c = self.connection
        self.client = c.client()

        async def opened():
            await self.client.connect()
            return await self.client.reset(**self.arguments)

        from websockets.exceptions import ConnectionClosed

        try:
            self._observe(c.run(opened(), timeout))
        except TimeoutError:
            self.broken = f"opening and resetting its session took more than {timeout:g} s"
        except (ConnectionError, OSError) as error:
            raise c.failed(error) from None
        except ConnectionClosed as error:  # closed as it opened: the server is full or cannot build the environment
            raise c.failed(error, refused=True) from None
        except Exception as error:  # noqa: BLE001 - the environment's reset raised on the server
            if "CAPACITY" in str(error).upper():
                raise c.failed(error, refused=True) from None
            self.broken = f"its reset failed: {error}"

    def call(self, name: str, arguments: dict, timeout: float) -> tuple[bool, str]:
        """(ok, the observation's text or why it failed) of one step calling tool `name`, within `timeout` seconds
        (the session's opening included, at the first call)."""
        c, budget = self.connection, timeout
        if self.client is None and not self.broken:
            began = time.monotonic()
            self._open(min(timeout, c.spec.timeout))
            timeout -= time.monotonic() - began
        if self.broken:
            return False, f"the environment's session takes no calls: {self.broken}"
        if self.done:
            return False, "the environment's episode is over"
        if timeout <= 0:
            return False, f"opening the environment's session left no time for '{name}'"
        try:
            result = c.run(self.client.step(c.types.CallToolAction(tool_name=name, arguments=arguments)), timeout)
        except TimeoutError:
            self.broken = f"'{name}' passed its timeout, and the session may still answer it"
            return False, f"'{name}' did not finish within {budget:g} s"
        except (ConnectionError, OSError) as error:
            raise c.failed(error) from None
        except Exception as error:  # noqa: BLE001 - the server's error reply, or the session closed
            if c.server is not None:
                c.server.check()  # a closed session of a served environment that ended: the error naming its log
            if NON_FINITE in str(error):
                self.bad_reward = str(error)
                return False, f"the environment's reward after '{name}' was no finite number"
            self.broken = f"{type(error).__name__}: {error}"
            return False, f"the environment failed: {error}"
        self._observe(result)
        observation = result.observation
        if getattr(observation, "error", None) is not None:
            kind = getattr(observation.error.error_type, "value", observation.error.error_type)
            return False, f"{kind}: {observation.error.message}"
        return _text(getattr(observation, "result", None))

    def _observe(self, result) -> None:
        if result.reward is not None and not isinstance(result.reward, bool | int | float):
            self.bad_reward = f"a reward of type {type(result.reward).__name__}"
        elif result.reward is not None and not math.isfinite(result.reward):
            self.bad_reward = f"{NON_FINITE} {result.reward!r}"
        elif result.reward is not None:
            self.rewards.append(float(result.reward))
        self.done = self.done or bool(result.done)

    def reward(self) -> float:
        """The sum of the rewards its observations gave (nan, refused by the caller, after a failure); closes it."""
        self.close()
        return math.nan if self.broken or self.bad_reward else sum(self.rewards)

    def close(self) -> None:
        """Close the session without waiting for it: the connection waits for every close when its scope ends."""
        client, self.client = self.client, None
        if client is not None:
            c = self.connection
            closing = asyncio.wait_for(client.close(), c.spec.timeout)
            c.closing.append(asyncio.run_coroutine_threadsafe(_quietly(closing), c.loop))


class OpenEnvTool:
    """One of a session's tools: `call(arguments, timeout)` is a step; calling it directly waits `spec.timeout`."""

    def __init__(self, session: OpenEnvSession, name: str):
        self.session, self.__name__ = session, name

    def call(self, arguments: dict, timeout: float) -> tuple[bool, str]:
        return self.session.call(self.__name__, arguments, timeout)

    def __call__(self, **arguments) -> str:
        ok, output = self.call(arguments, self.session.connection.spec.timeout)
        if not ok:
            raise RuntimeError(output)
        return output


async def _quietly(coroutine) -> None:
    with contextlib.suppress(Exception):
        await coroutine


def _text(result: Any) -> tuple[bool, str]:
    """(ok, text) of an MCP tool result as openenv's JSON carries it: its text parts, else its data as JSON."""
    if not isinstance(result, dict):
        return True, result if isinstance(result, str) else json.dumps(result, default=str)
    parts = [p.get("text", "") for p in result.get("content") or [] if isinstance(p, dict) and p.get("type") == "text"]
    if parts:
        text = "\n".join(parts)
    elif result.get("data") is not None:
        data = result["data"]
        text = data if isinstance(data, str) else json.dumps(data, default=str)
    else:
        text = json.dumps(result.get("structured_content"), default=str)
    return not result.get("is_error"), text


if __name__ == "__main__":  # a served environment: argv is the listening socket's descriptor and the settings
    _serve(int(sys.argv[1]), json.loads(sys.argv[2]))
