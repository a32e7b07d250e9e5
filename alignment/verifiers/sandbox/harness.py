"""Program that runs inside the sandbox; `process.py` passes this file's text to ``python -I -S -B -c``.

Never imported by the package. Standard library only (``-S`` leaves site-packages out).
Arguments: RESULT_FD PAYLOAD_PATH. The payload (JSON, deleted once read) holds the code, the tests,
a per-run nonce, the isolation plan and the source of safe_compare.py.

Two processes: the *supervisor* (pid 1 of the new pid namespace: `_build_view`, `_supervise`) builds
a minimal read-only root and pivots into it, forks the runner and reaps everything until it exits;
the *runner* (`_run`) drops privileges, seals the process (`_seal_process`, `_guard`), runs the
solution, then the tests, and only if both finished raises the PASS audit event, on which the hook
writes the nonce to RESULT_FD. The caller counts a pass only for exit status 0 plus the nonce.
Details and what this does not close: docs/sandbox.md.

Exit codes: 0 tests passed (nonce written), 1 failed, 3 the solution is not valid Python,
70 the sandbox could not be set up.
"""

import _imp
import _thread
import builtins
import ctypes
import json
import os
import re
import signal
import sys
import traceback
import types
import unittest

# the harness's functions look builtins up in this copy, taken before any untrusted code runs, so
# patching the builtins module (builtins.len = ...) does not change what the verdict code calls
_PRISTINE_BUILTINS = dict(vars(builtins))
globals()["__builtins__"] = dict(_PRISTINE_BUILTINS)

EXIT_FAIL, EXIT_SYNTAX, EXIT_SETUP = 1, 3, 70
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 21
# statvfs flag -> mount flag (same numbers except relatime: ST_RELATIME is 4096 = MS_BIND)
_LOCKED_FLAGS = [
    (getattr(os, f"ST_{name}", 0), ms)
    for name, ms in [
        ("NODEV", MS_NODEV),
        ("NOEXEC", MS_NOEXEC),
        ("NOATIME", MS_NOATIME),
        ("NODIRATIME", MS_NODIRATIME),
        ("RELATIME", MS_RELATIME),
    ]
]
MS_PRIVATE, MNT_DETACH = 1 << 18, 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
# securebits: NOROOT, NO_SETUID_FIXUP and NO_CAP_AMBIENT_RAISE set, KEEP_CAPS clear, all four locked
SECURE_BITS = 0b1110_1111
_CAP_VERSION_3 = 0x20080522
# pivot_root has no libc wrapper: the syscall's number per machine (an unknown one is a setup error)
_PIVOT_ROOT_SYSCALL = {
    "x86_64": 155,
    "aarch64": 41,
    "riscv64": 41,
    "loongarch64": 41,
    "ppc64le": 203,
    "ppc64": 203,
    "s390x": 217,
    "i686": 217,
    "i386": 217,
    "armv7l": 218,
}
_DEV_LINKS = {
    "/dev/fd": "/proc/self/fd",
    "/dev/stdin": "/proc/self/fd/0",
    "/dev/stdout": "/proc/self/fd/1",
    "/dev/stderr": "/proc/self/fd/2",
}
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
    """Make every mount of the new root read-only except /tmp and the device nodes. A bind that
    refuses is a setup error; /proc's own submounts may refuse (the code cannot write there anyway)."""
    for point in _mount_points():
        if point == "/tmp" or point.startswith(("/tmp/", "/dev/")):
            continue
        try:
            _remount_read_only(point)
        except OSError:
            if not _under(point, "/proc"):
                raise


def _bind(source_fd, target, is_dir):
    os.makedirs(target if is_dir else os.path.dirname(target), 0o755, exist_ok=True)
    if not is_dir:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))  # a mount point for one file
    _mount(f"/proc/self/fd/{source_fd}", target, None, MS_BIND | MS_REC, None)


def _pivot_root(new_root):
    """Make new_root the root of this mount namespace and detach the old root: unlike chroot, the
    host's tree is then unreachable, even for a process with capabilities in a user namespace."""
    number = _PIVOT_ROOT_SYSCALL.get(os.uname().machine)
    if number is None:
        raise OSError(f"pivot_root: no syscall number known for {os.uname().machine}")
    os.chdir(new_root)
    if _LIBC.syscall(number, b".", b".") != 0:  # the old root is now stacked on top of "."
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root: {os.strerror(err)}")
    if _LIBC.umount2(b".", MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount the old root: {os.strerror(err)}")
    os.chdir("/")


def _build_view(plan):
    """A fresh root: an empty tmpfs into which only what the interpreter needs (plan["binds"]: the
    system's program and library directories, the Python installation, the loader's files, a few
    /dev nodes, /proc) is bind-mounted, then frozen read-only; a private tmpfs /tmp holds the work
    directory, another /dev/shm. No host socket, no data, no home, no /run and no /work exist inside."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)  # nothing mounted here propagates to the host
    binds = {p: os.open(p, os.O_PATH) for p in [*plan["binds"], "/proc"]}
    root = plan["new_root"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path, fd in binds.items():
        _bind(fd, root + path, os.path.isdir(f"/proc/self/fd/{fd}"))
        os.close(fd)
    for path, target in {**plan["links"], **_DEV_LINKS}.items():
        os.makedirs(os.path.dirname(root + path), 0o755, exist_ok=True)
        os.symlink(target, root + path)
    os.makedirs(root + "/etc", 0o755, exist_ok=True)
    for name, text in _etc_files(plan).items():
        with open(f"{root}/etc/{name}", "w", encoding="utf-8") as f:
            f.write(text)
    for scratch in ("/tmp", "/dev/shm"):  # /dev/shm: multiprocessing's semaphores
        os.makedirs(root + scratch, 0o755)
        _mount("tmpfs", root + scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={plan['tmpfs_mb']}m,mode=1777")
    os.makedirs(root + plan["workdir"], 0o700)
    if plan["mode"] == "unshare-root":
        os.chown(root + plan["workdir"], plan["uid"], plan["gid"])
    _pivot_root(root)
    _freeze_file_systems()


def _etc_files(plan):
    """Account files naming only the sandbox's users, not the host's."""
    uid, gid = plan.get("uid", 0), plan.get("gid", 0)
    return {
        "passwd": f"root:x:0:0:root:/:/bin/false\nsandbox:x:{uid}:{gid}::{plan['workdir']}:/bin/false\n",
        "group": f"root:x:0:\nsandbox:x:{gid}:\n",
    }


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
    """Without a pid namespace: kill the orphans reparented to us (we are a subreaper) and reap each
    one, so that none is left a zombie of the caller's init when we exit."""
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
        for _ in kids:  # each was killed: the wait is short
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return


def _drop_capabilities():
    """User-namespace mode: the code is root of its namespace, with every capability over its own
    mounts and processes (it could remount a bind read-write, or trace the runner). Drop them all for
    good: the bounding and ambient sets, the process's own sets, and (securebits) uid 0's regaining
    them at exec."""
    _prctl(PR_SET_SECUREBITS, SECURE_BITS)
    with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap)
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    header, data = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0), (ctypes.c_uint32 * 6)()
    if _LIBC.capset(header, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")


def _drop_privileges(plan):
    import resource

    nproc = plan["max_processes"]
    if plan["mode"] != "none":  # as a normal user outside a namespace this would count all their processes
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if plan["mode"] == "unshare-root":
        os.setgroups([])
        os.setgid(plan["gid"])
        os.setuid(plan["uid"])  # clears every capability
    elif plan["mode"] == "unshare-userns":
        _drop_capabilities()
    _prctl(PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries (su, sudo, ping) cannot gain privileges
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    _prctl(PR_SET_DUMPABLE, 0)  # other processes (its own children too) cannot read its memory
    os.chdir(plan["workdir"])


# what the verdict depends on: a solution that patches these could turn failures into passes
_GUARDED = (unittest.TestCase, unittest.TestResult, unittest.TestSuite, unittest.TestLoader)
FAIL_EVENT, PASS_EVENT = "alignment.sandbox.fail", "alignment.sandbox.pass"
# audit events that hand out frames, every live object or raw memory: the ways from the untrusted
# code to the harness's state and to the tests' expected values. sys._getframe fails with
# ValueError, as on too shallow a stack, which namedtuple, typing and logging tolerate.
_DENIED = {
    "sys._getframe": ValueError,
    "sys._current_frames": RuntimeError,
    "sys._current_exceptions": RuntimeError,
    "sys.settrace": RuntimeError,
    "sys.setprofile": RuntimeError,
    "sys.addaudithook": RuntimeError,
    "gc.get_objects": RuntimeError,
    "gc.get_referrers": RuntimeError,
    "gc.get_referents": RuntimeError,
}
# object.__getattr__ events: frames are always denied (f_back leads to every caller); a code
# object only if it is the tests', the helpers' or this harness's (its constants are the answers)
_FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
_TRUSTED_FILES = frozenset({"tests.py", "safe_compare.py", "isolated.py"})
# object.__setattr__ events: what safe_compare's isolated functions keep their state in
_SEALED_ATTRIBUTES = frozenset({"__code__", "__defaults__", "__kwdefaults__"})
_DENIED_PREFIXES = ("ctypes.", "sys.monitoring.")
# loaded before the solution so that the tests see these as they were (safe_compare.freeze_modules);
# a module first imported by the solution is taken as the solution left it
_PRELOADED = (
    "math",
    "cmath",
    "re",
    "collections",
    "itertools",
    "functools",
    "operator",
    "heapq",
    "bisect",
    "string",
    "random",
    "fractions",
    "decimal",
    "statistics",
    "copy",
)


def _snapshot(with_builtins=True):
    spaces = ([vars(builtins)] if with_builtins else []) + [vars(cls) for cls in _GUARDED]
    return [dict(space) for space in spaces]


def _tampered(before, with_builtins=True):
    """True if anything in the snapshot changed (builtins may be patched by tests, e.g. input)."""
    now = _snapshot(with_builtins)
    for old, new in zip(before[-len(now) :], now, strict=True):
        if old.keys() != new.keys() or any(old[k] is not new[k] for k in old):
            return True
    return False


def _guard(nonce, result_fd, solution, tests):
    """Install the audit hook that denies introspection and alone holds the nonce.

    The nonce is written when the PASS event comes from the very frame that exec'd the solution
    (recorded from the "exec" event), after it exec'd the tests, and before any FAIL event: the
    untrusted code can neither read the nonce (no frames, gc or memory) nor raise the event from
    that frame. After a FAIL nothing can pass, so introspection is allowed again (tracebacks)."""
    write, getframe, ident, names_mem = os.write, sys._getframe, _thread.get_ident, _names_mem
    # everything the hook reads is its own: this module's globals are not reachable from inside,
    # but nothing here relies on that
    always_denied, denied_prefixes, trusted_files = dict(_DENIED), _DENIED_PREFIXES, _TRUSTED_FILES
    frame_attributes, sealed_attributes = _FRAME_ATTRIBUTES, _SEALED_ATTRIBUTES
    state = {"failed": False, "frame": None, "tests": False}
    inside = set()  # threads inside the hook's own getframe call

    def origin():
        inside.add(ident())
        try:
            return getframe(2)  # 0 origin, 1 hook, 2 the code that raised the event
        finally:
            inside.discard(ident())

    def trusted_code(obj, name):
        inside.add(ident())
        try:
            return getattr(getattr(obj, name), "co_filename", None) in trusted_files
        finally:
            inside.discard(ident())

    def hook(event, args):
        if ident() in inside:
            return
        if event == "exec" and args[0] is solution and state["frame"] is None:
            state["frame"] = origin()
        elif event == "exec" and args[0] is tests and origin() is state["frame"]:
            state["tests"] = True
        elif event == PASS_EVENT:
            if not state["failed"] and state["tests"] and origin() is state["frame"]:
                write(result_fd, nonce)
            state["failed"] = True  # once only
        elif event == FAIL_EVENT:
            state["failed"] = True
        if state["failed"]:
            return
        denied = always_denied.get(event) or (RuntimeError if event.startswith(denied_prefixes) else None)
        if event == "object.__getattr__" and (args[1] in frame_attributes or trusted_code(*args)):
            denied = AttributeError
        if event == "object.__setattr__" and args[1] in sealed_attributes:
            denied = AttributeError
        if event == "open" and names_mem(args[0]):
            denied = PermissionError  # /proc/self/mem, also opened relative to a dir_fd
        if denied is not None:
            raise denied(f"{event} is not available in the sandbox")

    sys.addaudithook(hook)


def _names_mem(path):
    if isinstance(path, bytes):
        path = path.decode("utf-8", "replace")
    return isinstance(path, str) and path.rstrip("/").rsplit("/", 1)[-1] == "mem"


def _one_signal_module(spec):
    # a second _signal module would bring back an unwrapped signal(); a fixed spec, so that a
    # spec whose name changes between reads cannot get one
    name = spec.name
    if type(name) is not str or name == "_signal":
        raise ImportError(f"module {name!r} cannot be created again in the sandbox")
    return (types.SimpleNamespace(name=name, origin="built-in"),), {}


def _seal_process(tools):
    """What runs before the untrusted code besides the audit hook: no frames through signal
    handlers, no unittest.main() exit, no way back to this harness's globals through __main__.
    `tools`: safe_compare.isolated(), whose functions lead nowhere (see there)."""
    import _signal

    def frameless(args, kwargs):
        # a Python signal handler is called with the interrupted frame, which no audit event
        # covers and from which every frame below is one f_back away: handlers get None instead
        signum, handler = args
        return (signum, tools["frameless"](handler) if callable(handler) else handler), {}

    _signal.signal = signal.signal = tools["seal"](_signal.signal, frameless)
    _imp.create_builtin = tools["seal"](_imp.create_builtin, lambda args, kwargs: _one_signal_module(*args))
    # an unguarded unittest.main() in the tests must not exit; a lambda of the harness would lead
    # to its globals, this one to an empty dict
    unittest.main = eval("lambda *a, **k: None", {"__builtins__": {}})
    sys.modules["__main__"] = types.ModuleType("__main__")


def _trusted_helpers(source):
    """safe_compare.py run in a namespace of its own, with its own copy of the builtins."""
    namespace = {"__name__": "alignment_safe_compare", "__builtins__": dict(_PRISTINE_BUILTINS)}
    exec(compile(source, "safe_compare.py", "exec"), namespace)
    return namespace


def _run(payload, result_fd):
    """Runner body: compile, guard, solution, tests, verdict. Returns an exit code."""
    exec_, audit, write, print_exc = exec, sys.audit, os.write, traceback.print_exc
    format_exception, TestCase = traceback.format_exception, unittest.TestCase
    try:
        solution = compile(payload.pop("code"), "solution.py", "exec")
    except (SyntaxError, ValueError):
        print_exc()
        return EXIT_SYNTAX
    trusted = _trusted_helpers(payload.pop("safe_compare"))
    source = payload.pop("tests")
    tests = trusted["compile_tests"](source)
    namespace = {"__name__": "__solution__", "__builtins__": builtins}
    _seal_process(trusted["isolated"]())
    for name in _PRELOADED:
        __import__(name)
    trusted["freeze_modules"](sys.modules)
    tests_builtins = trusted["tests_builtins"](_PRISTINE_BUILTINS, builtins.__import__)
    before = _snapshot()
    _guard(payload.pop("nonce").encode(), result_fd, solution, tests)

    def fail(message=None):
        audit(FAIL_EVENT)  # from here on nothing can pass, so the traceback may walk the frames
        if message is None:
            print_exc()
        else:
            write(2, message.encode("utf-8", "replace"))
        return EXIT_FAIL

    def report(title, exc):
        audit(FAIL_EVENT)
        write(2, (title + "\n" + ("".join(format_exception(exc)) if exc else "")).encode("utf-8", "replace"))

    try:
        exec_(solution, namespace)
    except BaseException:  # SystemExit too: exiting before the tests is not passing them
        return fail()
    changed = trusted["modules_tampered"]() + trusted["shadowed_builtins"](source, namespace)
    if _tampered(before) or changed:
        return fail(f"sandbox: the solution modified {', '.join(changed) or 'builtins or unittest'}; tests not run\n")
    namespace["__builtins__"] = tests_builtins
    try:
        exec_(tests, namespace)
        cases = trusted["test_cases"](TestCase)
        if cases and not trusted["run_cases"](cases, report):
            return fail("")
    except BaseException:
        return fail()
    if _tampered(before, with_builtins=False) or not trusted["builtins_intact"](namespace):
        return fail("sandbox: unittest or the tests' builtins were modified while the tests ran\n")
    audit(PASS_EVENT)
    return 0


def _runner(plan, payload, result_fd):
    try:
        _drop_privileges(plan)
    except BaseException:
        print_exc = traceback.print_exc
        print_exc()
        os._exit(EXIT_SETUP)
    status = _run(payload, result_fd)
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
        _runner(plan, payload, result_fd)
    os.close(result_fd)  # only the runner may write the nonce
    if plan["mode"] == "none":  # the caller's SIGTERM on timeout: clean up before it SIGKILLs us
        signal.signal(signal.SIGTERM, lambda *_: _terminate(pid))
    os._exit(_supervise(pid, plan))


main()
