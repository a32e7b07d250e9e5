"""Hostile calls of the `python` tool are contained by the sandbox it runs in (alignment/verifiers/sandbox/): a fork
bomb, endless output, the network, and reading the verifier's answer out of the process that holds it. Through the
rollout, each is an observation the model sees, and the ones that fail are counted as tool errors."""

from __future__ import annotations

import json
import os
import socket

import pytest
from test_tools import run_script

from alignment.config.tools import ToolSpec
from alignment.tools.builtins import make_python
from alignment.verifiers.sandbox.process import isolation

pytestmark = pytest.mark.skipif(isolation() is None, reason="no sandbox isolation on this machine")

FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
SECRET = "answer-7f3a9c-4242"  # what a verifier compares with: held by the training process only


def test_a_fork_bomb_is_killed_and_the_next_call_works():
    python = make_python(timeout=3)
    with pytest.raises(TimeoutError, match="ran past 3 s"):
        python(FORK_BOMB)
    assert python("print(6 * 7)") == "42\n"


def test_endless_output_is_cut():
    python = make_python(timeout=2, output_chars=500)
    try:  # killed at the file-size limit (RLIMIT_FSIZE) or at the timeout, whichever comes first
        out = python("while True:\n    print('x' * 1000)\n")
    except TimeoutError as error:
        out = str(error)
    assert "[... output cut ...]" in out and len(out) < 1000
    out = python("print('y' * 100000)")
    assert len(out) < 600 and "[... output cut ...]" in out


def test_no_network_not_even_to_a_port_of_ours():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = (f"import socket\nfor host in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
            "    try:\n        socket.create_connection(host, timeout=1)\n        print('CONNECTED', host)\n"
            "    except OSError as e:\n        print('refused', type(e).__name__)\n")
    try:
        out = make_python(timeout=5)(code)
    finally:
        server.close()
    assert "CONNECTED" not in out and out.count("refused") == 2


def test_the_answer_held_by_the_trainer_cannot_be_read(monkeypatch):
    monkeypatch.setenv("ALIGNMENT_VERIFIER_ANSWER", SECRET)  # in our environment and memory
    parent = os.getpid()
    # The code never holds the secret's bytes until it runs (it is written as hex), so only its own process could
    # match, and that one is skipped.
    code = f"""
import os
needle = bytes.fromhex('{SECRET.encode().hex()}')
found = []
for pid in [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()] + ['{parent}']:
    for name in ('environ', 'cmdline', 'mem'):
        try:
            with open(f'/proc/{{pid}}/{{name}}', 'rb') as f:
                if needle in f.read(1 << 20):
                    found.append((pid, name))
        except OSError:
            pass
print('FOUND' if found or needle.decode() in str(os.environ) else 'nothing', found)
"""
    out = make_python(timeout=5)(code)
    assert out.startswith("nothing"), out


def test_hostile_calls_through_the_rollout_are_observations(monkeypatch):
    def py(code: str) -> str:
        return f'<tool_call>{json.dumps({"name": "python", "arguments": {"code": code}})}</tool_call>'

    scripts = {"bomb": [py(FORK_BOMB), "done"],
               "flood": [py("print('z' * 10**6)"), "done"]}
    tools = [ToolSpec(name="python", options={"timeout": 2, "output_chars": 20000})]
    _, _, t = run_script(monkeypatch, scripts, tools, max_tool_output_tokens=100, tool_timeout=10,
                         max_completion_length=5000)
    assert t["bomb"].counts["tool_errors"] == 1 and "ran past 2 s" in t["bomb"].turns[1]["content"]
    assert t["flood"].counts["truncated_tool_outputs"] == 1 and t["flood"].counts["tool_errors"] == 0
    assert all(x.stop_reason == "answer" for x in t.values())
