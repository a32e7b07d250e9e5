"""Run untrusted Python (model-written code plus unit tests) in a separate, confined process: the caller's side.

    from alignment.verifiers.sandbox.process import run_python, Limits
    result = run_python("def add(a, b): return a + b", "assert add(1, 2) == 3", Limits(timeout=2))
    result.passed, result.status, result.output

`unshare` (new network, pid and mount namespaces) starts an isolated ``python -I -S -B`` running
`harness.py`, which sees only a minimal read-only root; under rlimits and a per-call cgroup bounding
the memory of all the call's processes together (`_CallGroup`; rlimits alone where none can be made),
with a stripped environment. Output is read back bounded; every process started is killed and reaped.
A run passes only if it exits 0 *and* writes a per-run nonce after the tests ran, so exiting early fails.
Isolation modes are probed once (`isolation`): "unshare-root", "unshare-userns", or "none", which
`require_isolation` refuses unless ``allow_unsandboxed: true``.
Limits: namespaces, cgroups and rlimits, not a VM (no protection against kernel exploits); the full
threat model, per mode, is docs/sandbox.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import re
import resource
import secrets
import select
import shutil
import signal
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
FALLBACK_PROCESSES = 4  # tasks per call where no cgroup can be made (see _fallback)
_WORKDIR_INSIDE = "/tmp/work"  # on the sandbox's own tmpfs
# the sandbox's root holds only these (where they exist) and the Python installation; see _view
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_LOADER_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
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
    memory_mb: int = 1024  # the call's total (cgroup, see _fallback without one) and RLIMIT_AS per process
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file, and largest output
    max_processes: int = 32  # RLIMIT_NPROC (namespaced modes only) and the cgroup's task count
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_mb: int = 64  # size of the private /tmp (the work directory lives there) and of /dev/shm
    output_bytes: int = 64 * 1024  # output read back into the caller (head and tail)


@dataclass(frozen=True)
class SandboxResult:
    """passed: exit 0 and the nonce was written after the tests.
    status: "passed", "failed", "timeout", "memory" (the call's processes together reached
    `memory_mb` and the kernel killed one of them: cgroup only), "syntax_error" (the code does not compile) or
    "setup_error" (the sandbox itself failed). output: head and tail of stdout+stderr.
    memory_bound: "cgroup" (the call's total) or "rlimit" (per process; see `_fallback`)."""

    passed: bool
    status: str
    returncode: int | None
    output: str
    duration_s: float
    mode: str
    memory_bound: str = "rlimit"


def _harness_source() -> str:
    return _HARNESS.read_text(encoding="utf-8")


def _python() -> str:
    # the real binary: a venv's bin/python is a symlink into the base installation
    return os.path.realpath(sys.executable)


def _python_paths() -> list[str]:
    """Directories the sandboxed interpreter needs: its installation and its binary's directory."""
    paths = sorted({os.path.realpath(sys.base_prefix), os.path.dirname(_python())})
    return [p for p in paths if not any(q != p and p.startswith(q.rstrip("/") + "/") for q in paths)]


def _view(host_root: str) -> dict:
    """What the sandbox's root holds, bound read-only from the host: directories and files to bind,
    symlinks to copy (merged-/usr systems link /bin to usr/bin)."""
    binds, links = [], {}
    for path in (*_SYSTEM_PATHS, *_LOADER_FILES, *_DEVICES):
        if os.path.islink(path) and not path.startswith("/dev/"):
            links[path] = os.readlink(path)
        elif os.path.exists(path):
            binds.append(path)
    for path in _python_paths():
        if not any(path == b or path.startswith(b + "/") for b in binds):
            binds.append(path)
    return {"new_root": host_root, "binds": binds, "links": links}


def _plan(mode: str, host_root: str, host_workdir: str, limits: Limits) -> dict:
    """What the harness does before running the code (see harness.py)."""
    plan = {"mode": mode, "max_processes": limits.max_processes, "tmpfs_mb": limits.tmpfs_mb}
    if mode == "none":
        return {**plan, "workdir": host_workdir}
    return {**plan, **_view(host_root), "workdir": _WORKDIR_INSIDE, "uid": SANDBOX_UID, "gid": SANDBOX_GID}


class _CallGroup:
    """A cgroup of one call, made under the caller's own: every process of the call together stays
    under `memory_mb` (no swap) and, where the pids controller is there, under max_processes + 2 tasks
    (unshare and the supervisor). `create` returns None where no such cgroup can be made (not root,
    a read-only cgroup file system, no memory controller): the caller then falls back to rlimits."""

    def __init__(self, dirs: list[str], events: str):
        self.dirs, self.events = dirs, events
        self.fds = [os.open(os.path.join(d, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC) for d in dirs]

    @classmethod
    def create(cls, limits: Limits) -> _CallGroup | None:
        try:
            bases = _cgroup_bases()
        except (OSError, ValueError):
            return None
        name, budget = f"alignment-sandbox-{secrets.token_hex(8)}", str(limits.memory_mb * 1024 * 1024)
        tasks = str(limits.max_processes + 2)
        if "memory" in bases:  # cgroup v1: one hierarchy per controller
            groups = [
                (bases["memory"], {"memory.limit_in_bytes": budget}, {"memory.memsw.limit_in_bytes": budget}),
                (bases.get("pids"), {}, {"pids.max": tasks}),
            ]
            events = "memory.oom_control"
        elif "v2" in bases and _enable_v2(bases["v2"]):
            groups, events = (
                [(bases["v2"], {"memory.max": budget}, {"memory.swap.max": "0", "pids.max": tasks})],
                "memory.events",
            )
        else:
            return None
        made: list[str] = []
        try:
            for base, required, optional in groups:
                if base is None:
                    continue
                try:
                    os.mkdir(os.path.join(base, name))
                except OSError:
                    if required:
                        raise
                    continue  # the pids group is a bonus: RLIMIT_NPROC still applies
                made.append(os.path.join(base, name))
                _write_settings(made[-1], required, optional)
                if not (
                    os.access(os.path.join(base, "cgroup.procs"), os.W_OK)  # moving a process needs both
                    and os.access(os.path.join(made[-1], "cgroup.procs"), os.W_OK)
                ):
                    raise PermissionError(f"cannot move processes into {made[-1]}")
            return cls(made, os.path.join(made[0], events))
        except OSError:
            _remove_groups(made)
            return None

    def enter(self) -> None:
        """In the child before exec (preexec_fn): move itself into every group ("0" = the writer)."""
        for fd in self.fds:
            os.write(fd, b"0")

    def oom_kills(self) -> int:
        try:
            with open(self.events, encoding="ascii") as f:
                counts = dict(line.split() for line in f if len(line.split()) == 2)
        except OSError:
            return 0
        return int(counts.get("oom_kill", 0))

    def close(self) -> None:
        """Kill whatever is still in the groups, then remove them."""
        for fd in self.fds:
            os.close(fd)
        _remove_groups(self.dirs)


def _cgroup_bases() -> dict[str, str]:
    """The caller's own cgroup directory for "memory" and "pids" (v1) and "v2" (the unified tree)."""
    own = {}
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else ["v2"]:
                own[controller] = path
    bases: dict[str, str] = {}
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            fstype, options = fields[fields.index("-") + 1], fields[fields.index("-") + 3].split(",")
            keys = ["v2"] if fstype == "cgroup2" else [k for k in ("memory", "pids") if k in options]
            root = fields[3]
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            for key in keys if fstype in ("cgroup", "cgroup2") else []:
                path = own.get(key)
                if key in bases or path is None or not (path + "/").startswith(root.rstrip("/") + "/"):
                    continue
                directory = os.path.join(point, path[len(root.rstrip("/")) :].lstrip("/"))
                if os.access(directory, os.W_OK):
                    bases[key] = directory
    return bases


def _enable_v2(base: str) -> bool:
    """Whether children of `base` get the memory controller (enabling it fails where `base` holds
    processes and is not the root: the v2 rule that processes live only in leaves)."""
    try:
        with open(os.path.join(base, "cgroup.subtree_control"), encoding="ascii") as f:
            if "memory" in f.read().split():
                return True
        with open(os.path.join(base, "cgroup.subtree_control"), "w", encoding="ascii") as f:
            f.write("+memory")
    except OSError:
        return False
    try:
        with open(os.path.join(base, "cgroup.subtree_control"), "w", encoding="ascii") as f:
            f.write("+pids")
    except OSError:
        pass  # RLIMIT_NPROC still applies
    return True


def _write_settings(directory: str, required: dict[str, str], optional: dict[str, str]) -> None:
    for name, value in {**required, **optional}.items():
        try:
            with open(os.path.join(directory, name), "w", encoding="ascii") as f:
                f.write(value)
        except OSError:
            if name in required:
                raise


def _remove_groups(dirs: list[str]) -> None:
    """SIGKILL what is left in each group, then rmdir it (retried while its last tasks exit)."""
    for directory in dirs:
        for _ in range(100):
            try:
                with open(os.path.join(directory, "cgroup.procs"), encoding="ascii") as f:
                    pids = [int(pid) for pid in f.read().split()]
                for pid in pids:
                    _kill(pid)
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)


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
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
    }


def _fallback(limits: Limits, mode: str, group: _CallGroup | None) -> Limits:
    """The limits to apply: as given under a cgroup; without one, the call's total is bounded by
    rlimits instead, at most FALLBACK_PROCESSES tasks (RLIMIT_NPROC, threads count) sharing
    `memory_mb` of address space. "none" mode has no per-call process count, so no total."""
    if group is not None or mode == "none":
        return limits
    processes = max(1, min(limits.max_processes, FALLBACK_PROCESSES))
    return dataclasses.replace(limits, max_processes=processes, memory_mb=max(1, limits.memory_mb // processes))


def _limiter(limits: Limits, group: _CallGroup | None):
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
        if group is not None:
            group.enter()
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


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def _stop(proc: subprocess.Popen, mode: str, timed_out: bool) -> int:
    """End the run and reap its top process, leaving no zombie behind for the caller's init.

    Killing unshare and the namespace's init together would orphan the init, and its zombie would
    go to the caller's init (a trainer that is pid 1 of a container never reaps it). So the init
    dies first, unshare reaps it and exits, and only then is the group killed and unshare reaped."""
    if timed_out and mode == "none":  # no pid namespace: let the supervisor kill orphans first
        os.kill(proc.pid, signal.SIGTERM)  # not proc.send_signal: it may reap the leader
        _wait(proc, 1.0)
    elif timed_out:
        for child in _children(proc.pid):
            _kill(child)  # the namespace's init: every process inside dies with it
        _wait(proc, 1.0)
    _kill_group(proc.pid)  # the leader is not reaped yet, so its pgid cannot be reused
    return proc.wait()


def _read_available(fd: int, limit: int = 256) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, limit)
    except BlockingIOError:
        return b""


def _read_output(path: str, limit: int, size: int) -> str:
    """Head and tail of the first `size` bytes of the output file (a failing test's traceback is at
    the end)."""
    with open(path, "rb") as f:
        if size <= limit:
            return f.read(size).decode("utf-8", "replace")
        head = f.read(limit // 2)
        f.seek(size - limit // 2)
        tail = f.read(limit // 2)
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


def _classify(timed_out: bool, rc: int, nonce_ok: bool, out_of_memory: bool) -> str:
    # a call whose processes together broke the budget fails, whatever its own exit (the kernel may
    # have killed a child it did not wait for) and before the timeout it may have caused
    if out_of_memory:
        return "memory"
    if timed_out:
        return "timeout"
    if rc == 0 and nonce_ok:
        return "passed"
    return {EXIT_SYNTAX: "syntax_error", EXIT_SETUP: "setup_error"}.get(rc, "failed")


def _write_payload(path: str, plan: dict, code: str, tests: str, nonce: str) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
        json.dump(
            {
                "plan": plan,
                "code": code,
                "tests": tests,
                "nonce": nonce,
                "safe_compare": _SAFE_COMPARE.read_text(encoding="utf-8"),
            },
            f,
        )


def execute(mode: str, code: str, tests: str, limits: Limits) -> SandboxResult:
    """One run in the given mode, without the isolation check (see `run_python`)."""
    start = time.monotonic()
    host = tempfile.mkdtemp(prefix="alignment-sandbox-")  # mode 0700
    read_fd, write_fd = os.pipe()
    group = _CallGroup.create(limits)
    try:
        applied = _fallback(limits, mode, group)
        workdir = os.path.join(host, "work")
        os.mkdir(workdir, 0o700)
        plan = _plan(mode, host, workdir, applied)
        nonce = secrets.token_hex(16)
        payload = os.path.join(host, "payload.json")
        _write_payload(payload, plan, code, tests, nonce)
        out_path = os.path.join(host, "output")
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                _command(mode, write_fd, payload),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_env(plan["workdir"]),
                cwd=host,
                start_new_session=True,
                pass_fds=(write_fd,),
                preexec_fn=_limiter(applied, group),
            )
        os.close(write_fd)
        write_fd = -1
        timed_out = _wait(proc, limits.timeout)
        printed = os.path.getsize(out_path)  # unshare adds a line of its own when _stop kills its child
        rc = _stop(proc, mode, timed_out)
        out_of_memory = group is not None and group.oom_kills() > 0
        nonce_ok = _read_available(read_fd) == nonce.encode()
        output = _read_output(out_path, limits.output_bytes, printed)
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
        if group is not None:
            group.close()
        _remove_tree(host)
    status = _classify(timed_out, rc, nonce_ok, out_of_memory)
    if status == "memory":
        output += "\n[sandbox: the call's processes together reached memory_mb; the kernel killed one]\n"
    return SandboxResult(
        status == "passed",
        status,
        None if timed_out else rc,
        output,
        time.monotonic() - start,
        mode,
        "rlimit" if group is None else "cgroup",
    )


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
        except (OSError, subprocess.SubprocessError) as exc:
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
