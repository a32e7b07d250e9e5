"""Program that runs inside the sandbox; `sandbox.py` passes this file's text to ``python -I -S -B -c``.

Never imported by the package. Standard library only (``-S`` leaves site-packages out).
Arguments: RESULT_FD PAYLOAD_PATH. The payload (JSON, deleted once read) holds the code, the tests,
a per-run nonce and the isolation plan.

Two processes:

- the *supervisor* (pid 1 inside the new pid namespace, still root there in "unshare-root" mode)
  builds the file-system view (every mount read-only; tmpfs over /tmp and the other world-writable
  directories and over the caller's home; the Python installation bind-mounted back read-only;
  see `sandbox.py` for the full list of guarantees), then forks the runner,
  reaps every process until the runner exits, and exits with the runner's status. Its exit tears
  down the pid namespace, which SIGKILLs whatever the program left behind. Being pid 1 it cannot
  be killed from inside the namespace, so ``os.kill(os.getppid(), 9)`` only hurts the program.
  Without namespaces ("none" mode) it is a child subreaper and kills leftover children itself.
- the *runner* drops to an unprivileged uid (root mode), sets RLIMIT_NPROC and no_new_privs, runs
  the solution, then the tests, and only if both finished writes the nonce to RESULT_FD. The
  caller counts a pass only for exit status 0 plus the nonce, so ``sys.exit(0)``/``os._exit(0)``
  before or during the tests is a failure.

Exit codes: 0 tests passed (nonce written), 1 failed, 3 the solution is not valid Python,
70 the sandbox could not be set up.
"""

import builtins
import ctypes
import json
import os
import re
import signal
import sys
import traceback
import unittest

EXIT_FAIL, EXIT_SYNTAX, EXIT_SETUP = 1, 3, 70
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 21
# statvfs flag -> mount flag (same numbers except relatime: ST_RELATIME is 4096 = MS_BIND)
_LOCKED_FLAGS = [(getattr(os, f"ST_{name}", 0), ms) for name, ms in
                 [("NODEV", MS_NODEV), ("NOEXEC", MS_NOEXEC), ("NOATIME", MS_NOATIME),
                  ("NODIRATIME", MS_NODIRATIME), ("RELATIME", MS_RELATIME)]]
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
_LIBC = ctypes.CDLL(None, use_errno=True)


def _mount(source, target, fstype, flags, data):
    def enc(s):
        return s.encode() if s is not None else None

    if _LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _prctl(option, value):
    if not hasattr(_LIBC, "prctl"):  # not Linux: only the unsandboxed mode runs there
        return
    if _LIBC.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def _under(path, parent):
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _remount_read_only(path):
    """Bind-remount one mount read-only, keeping the flags a user namespace locks."""
    flags = os.statvfs(path).f_flag
    kept = sum(ms for st, ms in _LOCKED_FLAGS if flags & st)
    _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept, None)


def _mount_points():
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        points = [line.split()[4] for line in f]
    # mountinfo escapes spaces etc. as \ooo octal
    return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) for p in points]


def _freeze_file_systems():
    """Make every existing mount read-only in our mount namespace (the host is unaffected), so the
    program can write only to the tmpfs mounted afterwards. Mounts that refuse are left as they
    are; the probe checks that / itself ended up read-only."""
    for point in _mount_points():
        try:
            _remount_read_only(point)
        except OSError:
            pass


def _build_view(plan):
    """Freeze the file systems; hide /tmp & co. and the caller's home behind fresh tmpfs mounts;
    re-expose the Python installation read-only."""
    # O_PATH handles taken before anything is hidden let us bind-mount the originals back later
    handles = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in plan["expose"]}
    _freeze_file_systems()
    covered = []
    for target in sorted(plan["cover"], key=lambda p: p.count("/")):
        if os.path.isdir(target) and not os.path.islink(target):
            mode, size = ("1777", plan["tmpfs_mb"]) if target == "/tmp" else ("755", 8)
            _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size}m,mode={mode}")
            covered.append(target)
    for path, fd in handles.items():
        if any(_under(path, c) for c in covered):
            os.makedirs(path, 0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
            _remount_read_only(path)
        os.close(fd)
    os.makedirs(plan["workdir"], 0o700, exist_ok=True)
    if plan["mode"] == "unshare-root":
        os.chown(plan["workdir"], plan["uid"], plan["gid"])


def _supervise(runner_pid, plan):
    """Reap children until the runner exits; return its status as an exit code."""
    code = EXIT_FAIL
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == runner_pid:
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code  # killed by a signal -> 128 + signum
            break
    if plan["mode"] == "none":
        _kill_leftovers()
    return code


def _terminate(runner_pid):
    try:
        os.kill(runner_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _kill_leftovers()
    os._exit(EXIT_FAIL)


def _kill_leftovers():
    """Without a pid namespace: kill orphans that were reparented to us (we are a subreaper)."""
    for _ in range(100):
        try:
            with open(f"/proc/self/task/{os.getpid()}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            return
        if not kids:
            return
        for kid in kids:
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def _drop_privileges(plan):
    import resource

    nproc = plan["max_processes"]
    if plan["mode"] != "none":  # as a normal user outside a namespace this would count all their processes
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if plan["mode"] == "unshare-root":
        os.setgroups([])
        os.setgid(plan["gid"])
        os.setuid(plan["uid"])
    _prctl(PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries (su, sudo, ping) cannot gain privileges
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    os.chdir(plan["workdir"])


# what the verdict depends on: a solution that patches these could turn failures into passes
_GUARDED = (unittest.TestCase, unittest.TestResult, unittest.TextTestResult, unittest.TextTestRunner,
            unittest.TestSuite, unittest.TestLoader)


def _snapshot(with_builtins=True):
    spaces = ([vars(builtins)] if with_builtins else []) + [vars(cls) for cls in _GUARDED]
    return [dict(space) for space in spaces]


def _tampered(before, with_builtins=True):
    """True if anything in the snapshot changed (builtins may be patched by tests, e.g. input)."""
    now = _snapshot(with_builtins)
    for old, new in zip(before[-len(now):], now, strict=True):
        if old.keys() != new.keys() or any(old[k] is not new[k] for k in old):
            return True
    return False


def _run(code, tests, nonce, result_fd):
    """Runner body: solution, then tests, then the nonce. Returns an exit code."""
    exec_, write, print_exc = exec, os.write, traceback.print_exc  # kept before user code runs
    try:
        solution = compile(code, "solution.py", "exec")
    except (SyntaxError, ValueError):
        print_exc()
        return EXIT_SYNTAX
    namespace = {"__name__": "__solution__", "__builtins__": builtins}
    before = _snapshot()
    try:
        exec_(solution, namespace)
    except BaseException:  # SystemExit too: exiting before the tests is not passing them
        print_exc()
        return EXIT_FAIL
    if _tampered(before):
        write(2, b"sandbox: the solution modified builtins or unittest; tests not run\n")
        return EXIT_FAIL
    unittest.main = lambda *a, **k: None  # an unguarded unittest.main() in the tests must not exit
    existing = {id(v) for v in namespace.values()}
    try:
        exec_(compile(tests, "tests.py", "exec"), namespace)
        cases = [
            v for v in list(namespace.values())
            if isinstance(v, type) and issubclass(v, unittest.TestCase) and id(v) not in existing
        ]
        if cases:
            suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromTestCase(c) for c in cases)
            result = unittest.TextTestRunner(stream=sys.stderr, verbosity=1).run(suite)
            if not result.wasSuccessful() or result.testsRun == 0:
                return EXIT_FAIL
    except BaseException:
        print_exc()
        return EXIT_FAIL
    if _tampered(before, with_builtins=False):  # e.g. a tested function patched TestResult
        write(2, b"sandbox: unittest was modified while the tests ran; not counted as a pass\n")
        return EXIT_FAIL
    write(result_fd, nonce)
    return 0


def _runner(plan, code, tests, nonce, result_fd):
    try:
        _drop_privileges(plan)
    except BaseException:
        print_exc = traceback.print_exc
        print_exc()
        os._exit(EXIT_SETUP)
    status = _run(code, tests, nonce, result_fd)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(status)


def main():
    result_fd, payload_path = int(sys.argv[1]), sys.argv[2]
    try:
        with open(payload_path, encoding="utf-8") as f:
            payload = json.load(f)
        os.unlink(payload_path)
        plan = payload["plan"]
        if plan["mode"] == "none":
            _prctl(PR_SET_CHILD_SUBREAPER, 1)
        else:
            _build_view(plan)
    except BaseException:
        traceback.print_exc()
        os._exit(EXIT_SETUP)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        _runner(plan, payload["code"], payload["tests"], payload["nonce"].encode(), result_fd)
    os.close(result_fd)  # only the runner may write the nonce
    if plan["mode"] == "none":  # the caller's SIGTERM on timeout: clean up before it SIGKILLs us
        signal.signal(signal.SIGTERM, lambda *_: _terminate(pid))
    os._exit(_supervise(pid, plan))


main()
