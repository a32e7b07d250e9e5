"""What the sandbox's code can reach and use, beyond test_sandbox.py's hostile programs (docs/sandbox.md).

- File system: the code sees a minimal root (the system's program and library directories, the Python
  installation, a few /dev nodes, /proc, a private /tmp), so no host Unix-domain socket (world-writable
  ones included), no run data or outputs, no source tree. The same probes in "none" mode show that the
  planted sockets and files are really there to be found (the tests are not vacuous).
- Memory: every process of a call together stays under `memory_mb` (a per-call cgroup where one can be
  made, else rlimits: fewer processes sharing the budget); ordinary programs still run.
- Processes: a timed-out call leaves no zombie to whoever adopts orphans (a pid 1 without an init).
- User-namespace mode: the code holds no capability, so it cannot remount or unmount its view.
"""

import ast
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest
from conftest import REPO, require_isolation

from alignment.verifiers.sandbox import process
from alignment.verifiers.sandbox.process import Limits, execute

# as root both namespaced modes can be forced (test_sandbox.py does the same); otherwise only the user one
NAMESPACED = ["unshare-root", "unshare-userns"] if os.geteuid() == 0 else ["unshare-userns"]
# what the sandbox's root may hold besides the Python installation's top directory
ROOT_ENTRIES = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}
PYTHON_TOP = Path(os.path.realpath(sys.base_prefix)).parts[1]


def _run(mode: str, code: str, tests: str = "", **limits) -> process.SandboxResult:
    if mode != "none":
        require_isolation()
    return execute(mode, textwrap.dedent(code), tests, Limits(**{"timeout": 20, **limits}))


def _public_dir() -> Path:
    """A directory anyone may enter, outside the sandbox's work directory (pytest's tmp_path is private)."""
    path = Path(tempfile.mkdtemp(prefix="sandbox-isolation-"))
    path.chmod(0o755)
    return path


@pytest.fixture
def listeners():
    """World-writable Unix-domain sockets listening on the host: in a public temp dir, under /run where
    this user may create one (as a system daemon's would be), and in the abstract namespace."""
    made, cleanup = {}, []
    public = _public_dir()
    paths = [str(public / "daemon.sock")]
    if os.access("/run", os.W_OK):
        paths.append(f"/run/alignment-sandbox-test-{uuid.uuid4().hex}.sock")
    for path in paths:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        os.chmod(path, 0o777)
        made[path] = server
        cleanup.append(path)
    abstract = f"\0alignment-sandbox-test-{uuid.uuid4().hex}"
    made[abstract] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    made[abstract].bind(abstract)
    for server in made.values():
        server.listen()
        server.setblocking(False)
    yield made
    for server in made.values():
        server.close()
    for path in cleanup:
        os.unlink(path)
    public.rmdir()


CONNECT = """
    import socket
    for path in PATHS:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect(path)
            s.sendall(b"sent from the sandbox")
            print("CONNECTED", repr(path))
        except OSError as exc:
            print("refused", repr(path), exc)
"""


def _accepted(server: socket.socket) -> bytes | None:
    """What a client sent, or None if nobody connected."""
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return None
    with conn:
        conn.settimeout(2)
        return conn.recv(100)


@pytest.mark.parametrize("mode", NAMESPACED)
def test_host_unix_sockets_are_unreachable(mode, listeners):
    code = CONNECT.replace("PATHS", repr(list(listeners)))
    result = _run(mode, code)
    assert result.status == "passed", result.output
    assert "CONNECTED" not in result.output, result.output
    assert {path: _accepted(server) for path, server in listeners.items()} == dict.fromkeys(listeners)


def test_the_socket_probe_connects_without_namespaces(listeners):
    """The control: unsandboxed, the same program reaches every socket, so the test above is not vacuous."""
    result = _run("none", CONNECT.replace("PATHS", repr(list(listeners))))
    assert result.output.count("CONNECTED") == len(listeners), result.output
    assert all(_accepted(server) == b"sent from the sandbox" for server in listeners.values())


@pytest.fixture
def run_files(monkeypatch):
    """A run's data and outputs as a trainer leaves them: world-readable, in its working directory and
    in a temp directory; plus this repository's own files."""
    public = _public_dir()
    monkeypatch.chdir(public)
    (public / "outputs" / "run").mkdir(parents=True)
    (public / "outputs").chmod(0o755)
    (public / "outputs" / "run").chmod(0o755)
    files = [public / "data.jsonl", public / "outputs" / "run" / "samples.jsonl"]
    for path in files:
        path.write_text(json.dumps({"prompt": "2+2", "answer": "ANSWER-4"}) + "\n")
        path.chmod(0o644)
    yield [str(p) for p in files] + [str(REPO / "README.md"), str(REPO / "alignment" / "__init__.py")]
    for path in files:
        path.unlink()
    for path in (public / "outputs" / "run", public / "outputs", public):
        path.rmdir()


READ = """
    import os
    for path in PATHS:
        try:
            with open(path) as f:
                print("GOT-CONTENT", path, f.read(20))
        except OSError as exc:
            print("unreadable", path, exc)
    print("ROOT", sorted(os.listdir("/")))
"""


@pytest.mark.parametrize("mode", NAMESPACED)
def test_run_data_outputs_and_source_are_invisible(mode, run_files):
    result = _run(mode, READ.replace("PATHS", repr(run_files)))
    assert result.status == "passed", result.output
    assert "GOT-CONTENT" not in result.output, result.output
    root = ast.literal_eval(result.output.split("ROOT", 1)[1].strip())
    assert set(root) <= ROOT_ENTRIES | {PYTHON_TOP}, root
    assert not {"work", "run", "home", "var", "mnt", "srv", "opt"} & (set(root) - {PYTHON_TOP}), root


def test_the_file_probe_reads_without_namespaces(run_files):
    result = _run("none", READ.replace("PATHS", repr(run_files)))
    assert result.output.count("GOT-CONTENT") == len(run_files), result.output


ORDINARY = """
    import collections, itertools, json, math, multiprocessing, re, subprocess, sys, tempfile, threading, time

    counts = collections.Counter(re.findall(r"\\w+", "a b a"))
    pairs = list(itertools.combinations(range(4), 2))
    child = subprocess.run([sys.executable, "-c", "import math; print(math.factorial(5))"],
                           capture_output=True, text=True, timeout=10)
    shell = subprocess.run("echo piped | tr a-z A-Z", shell=True, capture_output=True, text=True, timeout=10)
    with tempfile.NamedTemporaryFile("w+", suffix=".json") as f:
        json.dump({"x": [1, 2]}, f)
        f.flush()
        f.seek(0)
        loaded = json.load(f)
    with open("notes.txt", "w") as f:
        f.write("kept")
    results = []
    worker = threading.Thread(target=lambda: results.append(math.isqrt(49)))
    worker.start()
    worker.join()
    with open("/dev/null", "w") as devnull:
        devnull.write("discarded")
    noise = open("/dev/urandom", "rb").read(8)
    today = time.localtime()
    with multiprocessing.get_context("fork").Pool(2) as pool:  # its semaphores live in /dev/shm
        squares = pool.map(abs, [-1, -2, -3])
"""
ORDINARY_TESTS = """
assert counts["a"] == 2 and len(pairs) == 6
assert child.stdout.strip() == "120", child
assert shell.stdout.strip() == "PIPED", shell
assert loaded == {"x": [1, 2]} and open("notes.txt").read() == "kept"
assert results == [7] and len(noise) == 8 and today.tm_year > 2000
assert squares == [1, 2, 3]
"""


@pytest.mark.parametrize("mode", NAMESPACED)
def test_ordinary_programs_still_work(mode):
    result = _run(mode, ORDINARY, ORDINARY_TESTS, memory_mb=512)
    assert result.passed, result.output


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_userns_code_holds_no_capabilities():
    """In user-namespace mode the code is uid 0 of its namespace: without capabilities it cannot
    remount its read-only view read-write or unmount it, in itself or in a program it starts, and a
    child cannot read the runner's memory."""
    code = """
        import subprocess, sys
        def caps(status):
            return {k: v.split()[0] for k, v in (l.split(":", 1) for l in status.splitlines() if ":" in l) \
if k.startswith("Cap")}
        mine = caps(open("/proc/self/status").read())
        child = caps(subprocess.run([sys.executable, "-c", "print(open('/proc/self/status').read())"],
                                    capture_output=True, text=True).stdout)
        peek = "import os; open(f'/proc/{os.getppid()}/mem', 'rb')"  # fails: exit status 1
        runner_memory = subprocess.run([sys.executable, "-c", peek], capture_output=True).returncode
        remount = subprocess.run(["mount", "-o", "remount,bind,rw", "/usr"], capture_output=True)
        unmount = subprocess.run(["umount", "-l", "/usr"], capture_output=True)
    """
    tests = """
zero = "0000000000000000"
assert set(mine.values()) == {zero} and set(child.values()) == {zero}, (mine, child)
assert remount.returncode != 0 and unmount.returncode != 0
assert runner_memory == 1  # a child cannot read the runner's memory (the tests' answers)
"""
    result = _run("unshare-userns", code, tests)
    assert result.passed, result.output


# Each child holds its block until the parent has heard from all four (a "+" each, or the end of the pipe once
# every child has written or died), so the blocks are resident at the same time without a fixed sleep.
FORKS = """
    import os
    read_end, write_end = os.pipe()
    release_read, release_write = os.pipe()
    for _ in range(4):
        if os.fork() == 0:
            os.close(release_write)
            block = b"\\x01" * (CHILD_MB * 1024 * 1024)  # written, so resident
            os.write(write_end, b"+")
            os.close(write_end)
            os.read(release_read, 1)  # returns when the parent closes its end
            os._exit(0)
    os.close(write_end)
    held = b""
    while len(held) < 4:
        chunk = os.read(read_end, 4)
        if not chunk:
            break
        held += chunk
    os.close(release_write)
    for _ in range(4):
        os.wait()
    print("HOLDING", len(held))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["best", "none"])
def test_forked_children_share_one_memory_budget(mode):
    """Four children of a third of the budget each cannot all hold it at once: with a cgroup the call
    ends with the "memory" status, with rlimits each child's allocation fails. Small children pass."""
    mode = require_isolation() if mode == "best" else mode
    hog = _run(mode, FORKS.replace("CHILD_MB", "150"), "assert len(held) == 4\n", memory_mb=256)
    assert not hog.passed and "HOLDING 4" not in hog.output, hog.output
    if hog.memory_bound == "cgroup":
        assert hog.status == "memory", hog
    elif mode == "none":
        pytest.skip("no cgroup here: 'none' mode has no per-call process count, so no total bound")
    small = _run(mode, FORKS.replace("CHILD_MB", "10"), "assert len(held) == 4\n", memory_mb=256)
    assert small.passed, small.output


@pytest.mark.timeout(300)
def test_without_a_cgroup_rlimits_bound_the_total(monkeypatch):
    """The fallback: at most FALLBACK_PROCESSES tasks, each with its share of `memory_mb`."""
    mode = require_isolation()
    monkeypatch.setattr(process._CallGroup, "create", classmethod(lambda cls, limits: None))
    limits = (
        "import resource\n"
        "limits = [resource.getrlimit(resource.RLIMIT_AS)[0], resource.getrlimit(resource.RLIMIT_NPROC)[0]]\n"
    )
    share = 256 // process.FALLBACK_PROCESSES * 1024 * 1024
    seen = _run(mode, limits, f"assert limits == [{share}, {process.FALLBACK_PROCESSES}], limits\n", memory_mb=256)
    assert seen.passed and seen.memory_bound == "rlimit", seen.output
    hog = _run(mode, FORKS.replace("CHILD_MB", "80"), "assert len(held) == 4\n", memory_mb=256)
    assert not hog.passed and "HOLDING 4" not in hog.output, hog.output
    one = _run(mode, "block = b'x' * (30 * 1024 * 1024)\n", "assert len(block) > 0\n", memory_mb=256)
    assert one.passed, one.output


def test_cgroups_are_removed_after_each_call(monkeypatch):
    made = []
    create = process._CallGroup.create

    def recording(cls, limits):
        group = create(limits)
        made.extend(group.dirs if group is not None else [])
        return group

    monkeypatch.setattr(process._CallGroup, "create", classmethod(recording))
    for _ in range(2):
        _run("none", "print('x')\n")
        _run("none", "while True:\n    pass\n", timeout=0.5)
    if not made:
        pytest.skip("no cgroup can be made here")
    assert [d for d in made if os.path.exists(d)] == []


ZOMBIES = """
import ctypes, os, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to us, as to a pid 1
from alignment.verifiers.sandbox.process import Limits, execute
code = "import os\\nif os.fork() == 0:\\n    os.setsid()\\nwhile True:\\n    pass\\n"
for mode in sys.argv[1:]:
    for _ in range(3):
        assert execute(mode, code, "", Limits(timeout=0.5)).status == "timeout"
time.sleep(0.5)
zombies = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        state, parent = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[:2]
    except (OSError, ValueError):
        continue
    if state == "Z" and parent == str(os.getpid()):
        zombies.append(pid)
print("ZOMBIES", len(zombies))
"""


@pytest.mark.timeout(300)
def test_timed_out_calls_leave_no_zombie():
    """The caller adopts orphans (as a trainer that is pid 1 of a container does) and runs timed-out
    calls: every process the sandbox started must have been reaped by someone of ours."""
    modes = ([*NAMESPACED] if process.isolation() else []) + ["none"]
    done = subprocess.run(
        [sys.executable, "-c", ZOMBIES, *modes],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["ZOMBIES", "0"], done.stdout
