"""Hostile programs against the python_tests sandbox: each must score 0 in time, leave no process
behind, and the caller (this pytest process) must survive. Correct programs must still pass.

Runs in the best isolation mode this machine offers (`process.isolation()`); the network tests,
kill(-1) and the file-hiding tests need namespaces and are skipped ONLY when none works, because
without a network namespace a connect would send real traffic (with the reason in the summary; under
CI they fail instead: see conftest's `require_isolation`). Short limits keep it fast.
"""

import os
import socket
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from conftest import require_isolation

from alignment.errors import UserError
from alignment.verifiers import resolve
from alignment.verifiers.sandbox import process
from alignment.verifiers.sandbox.process import Limits, run_python

ISOLATION = process.isolation()
MODE = ISOLATION or "none"
TIMEOUT = 2.0
OPTIONS = {"timeout": TIMEOUT, "memory_mb": 256, "max_processes": 16, "allow_unsandboxed": True}
TESTS = "assert add(2, 3) == 5\n"
NOBODY_BEFORE = {p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == 65534}


@dataclass(frozen=True)
class Hostile:
    name: str
    code: str
    tests: str = TESTS
    needs_namespaces: bool = False
    endless: bool = False  # never ends by itself: only the sandbox's own timeout can stop it


HOSTILE = [
    # without namespaces (root ignores RLIMIT_NPROC) a fork bomb would hit the host: namespaces only
    Hostile(
        "fork_bomb",
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """,
        needs_namespaces=True,
        endless=True,
    ),
    Hostile("infinite_loop", "while True:\n    pass\n", endless=True),
    Hostile(
        "busy_threads",
        """
        import threading
        def spin():
            while True:
                sum(i * i for i in range(10000))
        for _ in range(4):
            threading.Thread(target=spin).start()
        spin()
    """,
        endless=True,
    ),
    Hostile(
        "sleep_forever_ignoring_signals",
        """
        import signal, time
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM):
            signal.signal(s, signal.SIG_IGN)
        time.sleep(1000)
    """,
    ),
    Hostile("memory_hog_at_once", "x = bytearray(10 ** 10)\n"),
    Hostile("memory_hog_gradual", "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))\n"),
    Hostile(
        "disk_filler_one_file",
        """
        with open("big.bin", "wb") as f:
            while True:
                f.write(b"x" * 10 ** 6)
    """,
    ),
    Hostile(
        "disk_filler_many_files",
        """
        import os
        for i in range(10 ** 6):
            with open(os.path.join(os.environ.get("TMPDIR", "."), f"f{i}"), "wb") as f:
                f.write(b"x" * 10 ** 6)
    """,
        needs_namespaces=True,
    ),  # without a private /tmp this fills the host disk until the timeout
    Hostile("huge_output", "while True:\n    print('x' * 10 ** 9)\n"),
    Hostile("endless_output", "import sys\nwhile True:\n    sys.stdout.write('y' * 10 ** 6)\n"),
    Hostile(
        "env_secrets",
        """
        import os
        def add(a, b):
            return a + b
        assert os.environ.get("HF_TOKEN") == "hf_sandbox_test_secret"
    """,
    ),
    Hostile(
        "caller_environ_via_proc",
        """
        def add(a, b):
            return a + b
        assert open("/proc/CALLER_PID/environ", "rb").read()  # the caller's start-up environment
    """,
        needs_namespaces=True,
    ),
    Hostile(
        "kill_parent",
        """
        import os, time
        os.kill(os.getppid(), 9)
        time.sleep(0.5)
    """,
    ),
    Hostile("kill_process_group", "import os\nos.killpg(os.getpgid(0), 9)\n"),
    Hostile("kill_everything", "import os, signal\nos.kill(-1, signal.SIGKILL)\n", needs_namespaces=True),
    Hostile("ctypes_segfault", "import ctypes\nctypes.string_at(0)\n"),
    Hostile(
        "c_stack_overflow",
        """
        import sys
        sys.setrecursionlimit(10 ** 9)
        nested = []
        for _ in range(10 ** 5):
            nested = [nested]
        repr(nested)
    """,
    ),
    Hostile(
        "daemon_double_fork_setsid",
        """
        import os, sys
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(1000)", "MARK"])
            os._exit(0)
        def add(a, b):
            return a + b
    """,
        tests="assert add(2, 3) == 6\n",
    ),
    Hostile(
        "runner_leaves_its_session",
        """
        import os
        os.setsid()
        while True:
            pass
    """,
        endless=True,
    ),
    Hostile(
        "background_child_then_exit",
        """
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)", "MARK"], start_new_session=True)
        def add(a, b):
            return 0
    """,
    ),
    Hostile("sys_exit_before_tests", "def add(a, b):\n    return 0\nimport sys\nsys.exit(0)\n"),
    Hostile("os_exit_before_tests", "def add(a, b):\n    return 0\nimport os\nos._exit(0)\n"),
    Hostile("system_exit_from_tested_function", "def add(a, b):\n    raise SystemExit(0)\n"),
    Hostile(
        "exit_zero_from_atexit",
        """
        import atexit, os
        atexit.register(lambda: os._exit(0))
        def add(a, b):
            return 0
    """,
    ),
    Hostile(
        "redefine_assertion_error",
        """
        import builtins
        class AssertionError(Exception):
            pass
        builtins.AssertionError = AssertionError
        def add(a, b):
            return 0
    """,
    ),
    Hostile(
        "disable_exec",
        """
        import builtins
        builtins.exec = lambda *args, **kwargs: None
        def add(a, b):
            return 0
    """,
    ),
    Hostile(
        "patch_unittest",
        """
        import unittest
        unittest.TestCase.assertEqual = lambda self, a, b, msg=None: None
        def add(a, b):
            return 0
    """,
        tests=textwrap.dedent("""
        import unittest
        class T(unittest.TestCase):
            def test_add(self):
                self.assertEqual(add(2, 3), 5)
    """),
    ),
    Hostile(
        "patch_test_result_during_tests",
        """
        def add(a, b):
            import unittest
            unittest.TestResult.addFailure = lambda *args: None
            unittest.TestResult.wasSuccessful = lambda self: True
            return 0
    """,
        tests=textwrap.dedent("""
        import unittest
        class T(unittest.TestCase):
            def test_add(self):
                self.assertEqual(add(2, 3), 5)
    """),
    ),
    Hostile(
        "forge_sentinel_on_every_fd",
        """
        import os
        for fd in range(3, 256):
            try:
                os.write(fd, b"0" * 32)
            except OSError:
                pass
        os._exit(0)
    """,
    ),
    Hostile("become_root", "import os\nos.setuid(0)\ndef add(a, b):\n    return a + b\n", needs_namespaces=True),
    Hostile(
        "connect_localhost",
        """
        import socket
        s = socket.create_connection(("127.0.0.1", PORT), timeout=1)
        s.sendall(b"hello")
        def add(a, b):
            return a + b
    """,
        needs_namespaces=True,
    ),
    Hostile(
        "connect_public_ip",
        """
        import socket
        socket.create_connection(("1.1.1.1", 443), timeout=1)
        def add(a, b):
            return a + b
    """,
        needs_namespaces=True,
    ),
    Hostile(
        "dns_lookup",
        """
        import socket
        socket.getaddrinfo("example.com", 443)
        def add(a, b):
            return a + b
    """,
        needs_namespaces=True,
    ),
    Hostile(
        "read_world_readable_tmp_file",
        """
        def add(a, b):
            return a + b
        assert "TOPSECRET" in open("SECRET_PATH").read()
    """,
        needs_namespaces=True,
    ),
    Hostile(
        "read_private_file",
        """
        def add(a, b):
            return a + b
        assert "TOPSECRET" in open("PRIVATE_PATH").read()
    """,
        needs_namespaces=True,
    ),
    Hostile(
        "read_callers_home",
        """
        import os
        def add(a, b):
            return a + b
        assert os.path.exists("HOME_SECRET")
    """,
        needs_namespaces=True,
    ),
    Hostile(
        "write_outside_workdir",
        """
        import os
        os.chmod(".", 0)
        for path in ("/etc/sandbox-test", "/usr/sandbox-test", os.getcwd() + "/../../sandbox-test"):
            open(path, "w").write("x")  # the first one already fails: read-only file systems
        os.chmod("/", 0o777)
        def add(a, b):
            return a + b
    """,
        needs_namespaces=True,
    ),  # as root without namespaces this would really chmod /
]


def _survivors(marker: str) -> list[str]:
    """Processes that belong to a sandbox run: the marker, a payload path, or uid nobody."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "uids", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmd = " ".join(p.info["cmdline"] or [])
        nobody = p.info["uids"] is not None and p.info["uids"].real == 65534 and p.pid not in NOBODY_BEFORE
        if marker in cmd or "alignment-sandbox-" in cmd or nobody:
            found.append(f"{p.pid}: {cmd[:120]}")
    return found


def _assert_no_survivors(marker: str) -> None:
    deadline = time.monotonic() + 2
    while _survivors(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _survivors(marker) == []


def _sandbox_dirs() -> set[str]:
    return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("alignment-sandbox-")}


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """Secrets the programs try to reach: env vars, a world-readable and a private file, a file in
    the caller's home, a listening socket on 127.0.0.1."""
    monkeypatch.setenv("HF_TOKEN", "hf_sandbox_test_secret")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_sandbox_test_secret")
    public_dir = Path(tempfile.mkdtemp())
    public_dir.chmod(0o755)
    (public_dir / "secret.txt").write_text("TOPSECRET")
    (public_dir / "secret.txt").chmod(0o644)
    (tmp_path / "private.txt").write_text("TOPSECRET")
    (tmp_path / "private.txt").chmod(0o600)
    home_secret = Path.home() / f".alignment-sandbox-test-{uuid.uuid4().hex}"
    home_secret.write_text("TOPSECRET")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    yield {
        "SECRET_PATH": str(public_dir / "secret.txt"),
        "PRIVATE_PATH": str(tmp_path / "private.txt"),
        "HOME_SECRET": str(home_secret),
        "PORT": str(server.getsockname()[1]),
        "CALLER_PID": str(os.getpid()),
        "server": server,
    }
    server.close()
    home_secret.unlink()
    (public_dir / "secret.txt").unlink()
    public_dir.rmdir()


@pytest.mark.timeout(120)  # a hang guard far above any run (the sandbox stops each at TIMEOUT), not a speed bound
@pytest.mark.parametrize("case", HOSTILE, ids=[c.name for c in HOSTILE])
def test_hostile_program_scores_zero(case, planted):
    if case.needs_namespaces:
        require_isolation()
    marker = f"sandbox-test-{uuid.uuid4().hex}"
    code = textwrap.dedent(case.code).replace("MARK", marker)
    for key in ("SECRET_PATH", "PRIVATE_PATH", "HOME_SECRET", "PORT", "CALLER_PID"):
        code = code.replace(key, planted[key])
    dirs_before = _sandbox_dirs()
    verifier = resolve("python_tests", options=OPTIONS)
    result = verifier.score(f"```python\n{code}\n```", {"tests": case.tests})
    assert (result.reward, result.status) == (0.0, "ok"), result.detail
    if case.endless:  # "in time": the sandbox's own timer stopped it (and below: nothing of it is left running)
        assert result.detail.startswith(f"timeout after {TIMEOUT:g} s"), result.detail[-500:]
    assert len(result.detail) < 5000  # output is capped, whatever the program printed
    _assert_no_survivors(marker)
    assert _sandbox_dirs() == dirs_before  # the temporary directory is gone
    if case.name.startswith(("connect_", "dns_")):
        # Refused at once by the empty network namespace (not a socket timeout): the program's own error says so.
        assert (
            ("Network is unreachable" in result.detail or "name resolution" in result.detail)
            and "timed out" not in result.detail
            and not result.detail.startswith("timeout")
        ), result.detail[-500:]
        with pytest.raises(socket.timeout):
            planted["server"].accept()  # nothing reached the caller's loopback


CORRECT = [
    ("plain_asserts", "def add(a, b):\n    return a + b\n", TESTS),
    (
        "unittest_class",
        "def add(a, b):\n    return a + b\n",
        textwrap.dedent("""
        import unittest
        class TestAdd(unittest.TestCase):
            def test_small(self):
                self.assertEqual(add(2, 3), 5)
            def test_negative(self):
                self.assertEqual(add(-2, -3), -5)
        if __name__ == "__main__":
            unittest.main()
    """),
    ),
    (
        "tests_patch_builtins_input",
        "def double():\n    return 2 * int(input())\n",
        textwrap.dedent("""
        import builtins
        builtins.input = lambda *args: "21"
        assert double() == 42
    """),
    ),
    (
        "unguarded_unittest_main",
        "def add(a, b):\n    return a + b\n",
        textwrap.dedent("""
        import unittest
        class T(unittest.TestCase):
            def test(self):
                self.assertEqual(add(1, 1), 2)
        unittest.main()
    """),
    ),
    (
        "files_threads_subprocess_output",
        textwrap.dedent("""
        import os, subprocess, sys, tempfile, threading
        with open("notes.txt", "w") as f:
            f.write("hello")
        with tempfile.NamedTemporaryFile() as t:
            t.write(b"data")
        results = []
        worker = threading.Thread(target=lambda: results.append(sum(range(10))))
        worker.start()
        worker.join()
        child = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
        print("z" * 200_000)  # more than the caller reads back
        def add(a, b):
            return a + b
    """),
        (
            "assert open('notes.txt').read() == 'hello'\nassert results == [45]\n"
            "assert child.stdout.strip() == '42', child\nassert add(2, 3) == 5\n"
        ),
    ),
]


@pytest.mark.parametrize(("name", "code", "tests"), CORRECT, ids=[c[0] for c in CORRECT])
def test_correct_programs_pass(name, code, tests):
    result = run_python(code, tests, Limits(timeout=5, memory_mb=512), mode=MODE)
    assert result.passed and result.status == "passed", result.output[-2000:]
    assert len(result.output) < Limits().output_bytes + 200


def test_verifier_end_to_end():
    v = resolve("python_tests", options=OPTIONS)
    fenced = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nHope it helps."
    assert v.score(fenced, {"tests": TESTS}).reward == 1.0
    assert v.score(fenced, {"tests": ["assert add(1, 1) == 2", "assert add(0, 0) == 0"]}).reward == 1.0
    bare = "def add(a, b):\n    return a + b\n"
    assert v.score(bare, {"tests": TESTS}).reward == 1.0
    wrong = v.score("```python\ndef add(a, b):\n    return a - b\n```", {"tests": TESTS})
    assert wrong.reward == 0.0 and "AssertionError" in wrong.detail
    assert v.score("I cannot solve this.", {"tests": TESTS}).status == "unparseable"
    assert v.score("   ", {"tests": TESTS}).status == "unparseable"
    broken = v.score("```python\ndef add(a, b)\n    return a\n```", {"tests": TESTS})
    assert (broken.reward, broken.status) == (0.0, "ok")  # fenced code that does not compile is wrong
    assert v.score(bare, {"tests": ""}).status == "error"  # no tests is a data error
    assert v.score(bare, {"tests": "assert ("}).status == "error"
    rows = [{"tests": TESTS}] * 4
    assert [r.reward for r in v.score_batch([bare, "x = (", fenced, bare], rows)] == [1.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("mode", [m for m in process.MODES if m != "none"])
def test_each_namespace_mode(mode):
    require_isolation()
    if mode == "unshare-root" and os.geteuid() != 0:
        pytest.skip("unshare-root needs root")
    passed = run_python("def add(a, b):\n    return a + b\n", TESTS, Limits(timeout=5), mode=mode)
    assert passed.passed, passed.output
    connect = "import socket\nsocket.create_connection(('1.1.1.1', 443), timeout=1)\n"
    net = run_python(connect, "", Limits(timeout=5), mode=mode)
    assert net.status == "failed" and "Network is unreachable" in net.output
    hog = run_python("while True:\n    pass\n", "", Limits(timeout=1), mode=mode)
    assert hog.status == "timeout"
    marker = f"sandbox-test-{uuid.uuid4().hex}"
    daemon = textwrap.dedent(HOSTILE[[h.name for h in HOSTILE].index("daemon_double_fork_setsid")].code)
    daemon = daemon.replace("MARK", marker)
    assert not run_python(daemon, "assert add(2, 3) == 6\n", Limits(timeout=2), mode=mode).passed
    _assert_no_survivors(marker)


def test_unsandboxed_mode_still_cleans_up():
    """'none' mode (allow_unsandboxed): timeouts, exit tricks and leftover children still handled."""
    marker = f"sandbox-test-{uuid.uuid4().hex}"
    daemon = textwrap.dedent(HOSTILE[[h.name for h in HOSTILE].index("daemon_double_fork_setsid")].code)
    daemon = daemon.replace("MARK", marker)
    for code in (
        "while True:\n    pass\n",
        "import os\nos._exit(0)\n",
        daemon,
        daemon + "while True:\n    pass\n",
        "import os, time\nos.kill(os.getppid(), 9)\ntime.sleep(0.5)\n",
    ):
        result = run_python(code, "assert add(2, 3) == 6\n", Limits(timeout=TIMEOUT), mode="none")
        assert not result.passed, code
    _assert_no_survivors(marker)
    assert run_python("def add(a, b):\n    return a + b + 1\n", "assert add(2, 3) == 6\n", mode="none").passed


def test_no_isolation_refuses_unless_allowed(monkeypatch):
    monkeypatch.setattr(process, "_probe_result", {"mode": None, "failures": {"unshare-root": "EPERM"}})
    with pytest.raises(UserError, match="allow_unsandboxed: true"):
        resolve("python_tests")
    assert resolve("python_tests", options={"allow_unsandboxed": True}).name == "python_tests"
    with pytest.raises(UserError, match="timeout"):
        resolve("python_tests", options={"timeout": 0, "allow_unsandboxed": True})
