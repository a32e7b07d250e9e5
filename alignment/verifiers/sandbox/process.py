"""Run untrusted Python (model-written code plus unit tests) in a separate, confined process: the caller's side.

    from alignment.verifiers.sandbox.process import run_python, Limits
    result = run_python("def add(a, b): return a + b", "assert add(1, 2) == 3", Limits(timeout=2))
    result.passed, result.status, result.output

`unshare` (new network, pid and mount namespaces) starts an isolated ``python -I -S -B`` running
`harness.py` under rlimits, in an empty work directory, with a stripped environment (no HF_TOKEN or any
other variable of the caller); output is read back bounded; the process group is killed after the run.
A run passes only if it exits 0 *and* writes a per-run nonce after the tests ran, so exiting early fails.
Isolation modes are probed once (`isolation`): "unshare-root", "unshare-userns", or "none", which
`require_isolation` refuses unless ``allow_unsandboxed: true``.

Limits: namespaces plus rlimits, not a VM (no protection against kernel exploits, reads of world-readable
files, or the total memory of many processes); the full threat model is docs/sandbox.md.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from alignment.errors import UserError

MODES = ("unshare-root", "unshare-userns", "none")
EXIT_SYNTAX, EXIT_SETUP = 3, 70  # must match harness.py
SANDBOX_UID = SANDBOX_GID = 65534  # "nobody"/"nogroup" on Debian, Ubuntu, Fedora
_WORKDIR_INSIDE = "/tmp/work"  # on the sandbox's own tmpfs
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_SYSTEM_DIRS = {"/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/opt", "/var", "/proc", "/dev", "/sys"}
_HARNESS = Path(__file__).with_name("harness.py")
_SAFE_COMPARE = Path(__file__).with_name("safe_compare.py")  # run by the harness, not imported
_PR_SET_PDEATHSIG = 1
try:
    _LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: dlopen in preexec_fn could deadlock
except OSError:  # pragma: no cover - not a POSIX libc
    _LIBC = None


@dataclass(frozen=True)
class Limits:
    """Resource limits for one run. timeout is wall-clock seconds; sizes in MiB."""

    timeout: float = 5.0
    memory_mb: int = 1024  # RLIMIT_AS, per process
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file, and largest output
    max_processes: int = 32  # RLIMIT_NPROC (namespaced modes only)
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_mb: int = 64  # size of the private /tmp (the work directory lives there)
    output_bytes: int = 64 * 1024  # output read back into the caller (head and tail)


@dataclass(frozen=True)
class SandboxResult:
    """passed: exit 0 and the nonce was written after the tests.
    status: "passed", "failed", "timeout", "syntax_error" (the code does not compile) or
    "setup_error" (the sandbox itself failed). output: head and tail of stdout+stderr."""

    passed: bool
    status: str
    returncode: int | None
    output: str
    duration_s: float
    mode: str


def _harness_source() -> str:
    return _HARNESS.read_text(encoding="utf-8")


def _python() -> str:
    # the real binary: a venv's bin/python is a symlink into the base installation
    return os.path.realpath(sys.executable)


def _python_paths() -> list[str]:
    """Directories the sandboxed interpreter needs: its installation and its binary's directory."""
    paths = sorted({os.path.realpath(sys.base_prefix), os.path.dirname(_python())})
    return [p for p in paths if not any(q != p and p.startswith(q.rstrip("/") + "/") for q in paths)]


def _blocked_ancestors(paths: list[str], uid: int) -> list[str]:
    """The highest directory above each path that `uid` cannot traverse (e.g. /root, mode 700)."""
    blocked = []
    for path in paths:
        parts = Path(path).parts
        for i in range(2, len(parts) + 1):
            d = str(Path(*parts[:i]))
            st = os.stat(d)
            if st.st_uid != uid and not st.st_mode & stat.S_IXOTH:
                blocked.append(d)
                break
    return blocked


def _plan(mode: str, host_workdir: str, limits: Limits) -> dict:
    """What the harness does before running the code (see harness.py)."""
    plan = {"mode": mode, "max_processes": limits.max_processes, "tmpfs_mb": limits.tmpfs_mb}
    if mode == "none":
        return {**plan, "workdir": host_workdir}
    home = os.path.realpath(os.path.expanduser("~"))
    cover = list(_WORLD_WRITABLE)
    if os.path.isdir(home) and home not in _SYSTEM_DIRS:
        cover.append(home)  # ~/.cache/huggingface/token, ~/.netrc, ~/.ssh ...
    expose = _python_paths()
    if mode == "unshare-root":
        cover += _blocked_ancestors(expose, SANDBOX_UID)
    return {**plan, "workdir": _WORKDIR_INSIDE, "uid": SANDBOX_UID, "gid": SANDBOX_GID,
            "cover": sorted(set(cover)), "expose": expose}


def _command(mode: str, result_fd: int, payload: str) -> list[str]:
    python = [_python(), "-I", "-S", "-B", "-c", _harness_source(), str(result_fd), payload]
    if mode == "none":
        return python
    namespaces = ["--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc"]
    if mode == "unshare-userns":
        namespaces = ["--user", "--map-root-user", *namespaces]
    return [shutil.which("unshare") or "unshare", *namespaces, "--", *python]


def _env(workdir: str) -> dict[str, str]:
    # nothing from the caller's environment: tokens and keys live there
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "HOME": workdir, "TMPDIR": workdir}


def _limiter(limits: Limits):
    """preexec_fn: runs in the forked child before exec; only async-signal-safe-ish syscalls."""
    cpu = math.ceil(limits.timeout) + 1
    mib = 1024 * 1024
    settings = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU, then SIGKILL a second later
        (resource.RLIMIT_AS, (limits.memory_mb * mib,) * 2),
        (resource.RLIMIT_FSIZE, (limits.file_size_mb * mib,) * 2),
        (resource.RLIMIT_NOFILE, (limits.max_open_files,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ]

    # RLIMIT_NPROC is set by the harness instead, after the drop to uid 65534 or inside the user
    # namespace: root ignores it, and set before unshare creates a user namespace it would cap that
    # namespace at the caller's own process count (ucounts are checked at every level).
    def preexec() -> None:
        for which, value in settings:
            resource.setrlimit(which, value)
        if _LIBC is not None and sys.platform.startswith("linux"):
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return preexec


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for the process to exit without reaping it (so its pgid stays valid); True on timeout."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            return not select.select([pidfd], [], [], timeout)[0]
        finally:
            os.close(pidfd)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return False
        time.sleep(0.01)
    return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_available(fd: int, limit: int = 256) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, limit)
    except BlockingIOError:
        return b""


def _read_output(path: str, limit: int) -> str:
    """Head and tail of the output file (a failing test's traceback is at the end)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= limit:
            return f.read().decode("utf-8", "replace")
        head = f.read(limit // 2)
        f.seek(size - limit // 2)
        tail = f.read()
    skipped = size - len(head) - len(tail)
    return f"{head.decode('utf-8', 'replace')}\n[... {skipped} bytes skipped ...]\n{tail.decode('utf-8', 'replace')}"


def _remove_tree(path: str) -> None:
    def retry(func, p, _exc):  # the code may have chmod-ed its files to 000
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)


def _classify(timed_out: bool, rc: int, nonce_ok: bool) -> str:
    if timed_out:
        return "timeout"
    if rc == 0 and nonce_ok:
        return "passed"
    return {EXIT_SYNTAX: "syntax_error", EXIT_SETUP: "setup_error"}.get(rc, "failed")


def execute(mode: str, code: str, tests: str, limits: Limits) -> SandboxResult:
    """One run in the given mode, without the isolation check (see `run_python`)."""
    start = time.monotonic()
    host = tempfile.mkdtemp(prefix="alignment-sandbox-")  # mode 0700
    read_fd, write_fd = os.pipe()
    try:
        workdir = os.path.join(host, "work")
        os.mkdir(workdir, 0o700)
        plan = _plan(mode, workdir, limits)
        nonce = secrets.token_hex(16)
        payload = os.path.join(host, "payload.json")
        with open(os.open(payload, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
            json.dump({"plan": plan, "code": code, "tests": tests, "nonce": nonce,
                       "safe_compare": _SAFE_COMPARE.read_text(encoding="utf-8")}, f)
        out_path = os.path.join(host, "output")
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                _command(mode, write_fd, payload), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env=_env(plan["workdir"]), cwd=host,
                start_new_session=True, pass_fds=(write_fd,), preexec_fn=_limiter(limits),
            )
        os.close(write_fd)
        write_fd = -1
        timed_out = _wait(proc, limits.timeout)
        if timed_out and mode == "none":  # no pid namespace: let the supervisor kill orphans first
            os.kill(proc.pid, signal.SIGTERM)  # not proc.send_signal: it may reap the leader
            _wait(proc, 1.0)
        _kill_group(proc.pid)  # the leader is not reaped yet, so its pgid cannot be reused
        rc = proc.wait()
        nonce_ok = _read_available(read_fd) == nonce.encode()
        output = _read_output(out_path, limits.output_bytes)
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
        _remove_tree(host)
    status = _classify(timed_out, rc, nonce_ok)
    return SandboxResult(status == "passed", status, None if timed_out else rc, output,
                         time.monotonic() - start, mode)


_PROBE_CODE = "import os, socket\ninterfaces = [name for _, name in socket.if_nameindex()]\n"
_PROBE_TESTS = (
    "assert interfaces == ['lo'], interfaces\n"  # a fresh network namespace has only loopback
    "assert os.getpid() < 10, os.getpid()\n"  # a fresh pid namespace
    "assert os.listdir('/tmp') == ['work'], os.listdir('/tmp')\n"  # our own /tmp
    "assert os.statvfs('/').f_flag & os.ST_RDONLY\n"  # the host file systems are read-only
)
_probe_lock = threading.Lock()
_probe_result: dict[str, object] = {}


def _probe() -> tuple[str | None, dict[str, str]]:
    failures: dict[str, str] = {}
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return None, {"unshare": "not available (Linux util-linux `unshare` is required)"}
    # as root a user namespace maps the code to real root on the host file system: never fall back
    candidates = ["unshare-root"] if os.geteuid() == 0 else ["unshare-userns"]
    for mode in candidates:
        tests = _PROBE_TESTS + ("assert os.getuid() == 65534\n" if mode == "unshare-root" else "")
        try:
            result = execute(mode, _PROBE_CODE, tests, Limits(timeout=30))
        except OSError as exc:
            failures[mode] = str(exc)
            continue
        if result.passed:
            return mode, failures
        failures[mode] = f"{result.status}: {result.output.strip()[-300:]}"
    return None, failures


def isolation() -> str | None:
    """The isolation mode that works on this machine ("unshare-root", "unshare-userns") or None.
    Probed once per process by running a tiny program that checks the namespaces."""
    with _probe_lock:
        if "mode" not in _probe_result:
            _probe_result["mode"], _probe_result["failures"] = _probe()
        return _probe_result["mode"]  # type: ignore[return-value]


def require_isolation(allow_unsandboxed: bool = False) -> str:
    """The mode to run in; UserError when no isolation works and unsandboxed runs are not allowed."""
    mode = isolation()
    if mode is not None:
        return mode
    if allow_unsandboxed:
        return "none"
    reasons = "; ".join(f"{k}: {v}" for k, v in _probe_result.get("failures", {}).items())  # type: ignore[union-attr]
    raise UserError(
        "The python_tests verifier runs model-written code and needs a sandbox, but no isolation "
        f"mechanism works on this machine ({reasons or 'unknown reason'}). It needs Linux `unshare` "
        "(util-linux) able to create network, pid and mount namespaces: run as root (in Docker add "
        "--cap-add SYS_ADMIN --security-opt seccomp=unconfined) or enable unprivileged user "
        "namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 also "
        "kernel.apparmor_restrict_unprivileged_userns=0). If you trust the code, set the verifier "
        "option allow_unsandboxed: true (then there is no network, file or process isolation)."
    )


def run_python(
    code: str,
    tests: str = "",
    limits: Limits | None = None,
    allow_unsandboxed: bool = False,
    mode: str | None = None,
) -> SandboxResult:
    """Run `code` then `tests` (asserts or unittest.TestCase classes) in the sandbox.

    mode: force one of MODES (tests use it); by default the best mode that works here."""
    if mode is None:
        mode = require_isolation(allow_unsandboxed)
    elif mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return execute(mode, code, tests, limits or Limits())
