"""Tests for resolve(), the Verifier wrapper, summarize() and plugin entry points."""

import math
import pickle
import subprocess
import sys
import textwrap
import uuid
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from alignment.errors import UserError
from alignment.verifiers import (
    BUILTINS,
    Verifier,
    VerifyResult,
    available,
    registry,
    resolve,
    summarize,
)


@pytest.fixture
def user_module(tmp_path):
    """Write a module with a unique name into tmp_path; yields a function source -> module name."""
    created = []

    def make(source: str) -> str:
        name = f"my_verifiers_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        created.append(name)
        return name

    yield make
    for name in created:
        sys.modules.pop(name, None)


# --- resolution ------------------------------------------------------------------------------


def test_builtin_keys():
    assert {
        "numeric",
        "gsm8k",
        "math",
        "regex",
        "think_format",
        "answer_tag",
        "json",
        "python_tests",
        "arithmetic",
    } <= set(BUILTINS)
    assert BUILTINS["gsm8k"] == BUILTINS["numeric"]
    v = resolve("numeric")
    assert isinstance(v, Verifier) and v.name == "numeric" and v.target == BUILTINS["numeric"]
    assert v.required_columns == ("answer",)


def test_importing_the_package_is_lazy():
    """No built-in module (math-verify, sympy, the arithmetic task) is imported until resolved."""
    code = textwrap.dedent("""
        import sys
        import alignment.verifiers as v
        heavy = ["math_verify", "sympy", "alignment.tasks.arithmetic", "alignment.verifiers.numeric",
                 "alignment.verifiers.sandbox.process", "alignment.verifiers.math_answer"]
        assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
        v.resolve("numeric")
        assert "alignment.tasks.arithmetic" not in sys.modules and "math_verify" not in sys.modules
        assert v.BUILTINS["arithmetic"] == "alignment.tasks.arithmetic:verify"
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_unknown_name_has_hint_and_lists_builtins():
    with pytest.raises(UserError) as info:
        resolve("numric")
    message = str(info.value)
    assert "Unknown verifier 'numric'" in message and "Did you mean 'numeric'" in message
    assert "python_tests" in message and "module:function" in message
    assert "\n" not in message  # one paragraph


@pytest.mark.parametrize("bad", ["", "   ", None, 3])
def test_empty_or_non_string_name(bad):
    with pytest.raises(UserError):
        resolve(bad)


def test_module_function_from_search_dir(tmp_path, user_module):
    name = user_module("""
        def brevity(completion, max_words=5):
            return 1.0 if len(completion.split()) <= max_words else 0.0
    """)
    path_before = list(sys.path)
    v = resolve(f"{name}:brevity", search_dirs=[tmp_path])
    assert sys.path == path_before  # the recipe dir was only on sys.path during the import
    assert v.score("one two", {"answer": "unused", "prompt": "p"}).reward == 1.0
    strict = resolve(f"{name}:brevity", options={"max_words": 1}, search_dirs=[tmp_path])
    assert strict.score("one two", {}).reward == 0.0


def test_same_module_name_in_two_recipe_dirs(tmp_path):
    name = f"recipe_verifiers_{uuid.uuid4().hex[:8]}"
    first, second = tmp_path / "a", tmp_path / "b"
    for folder, reward in ((first, 0.25), (second, 0.75)):
        folder.mkdir()
        (folder / f"{name}.py").write_text(f"def check(completion):\n    return {reward}\n")
    try:
        assert resolve(f"{name}:check", search_dirs=[first]).score("x", {}).reward == 0.25
        assert resolve(f"{name}:check", search_dirs=[second]).score("x", {}).reward == 0.75
    finally:
        sys.modules.pop(name, None)


def test_missing_module(tmp_path):
    with pytest.raises(UserError, match=r"cannot import module 'no_such_module_xyz'.*Built-in verifiers"):
        resolve("no_such_module_xyz:check", search_dirs=[tmp_path])


def test_missing_function_has_hint(tmp_path, user_module):
    name = user_module("def brevity(completion):\n    return 1.0\n")
    with pytest.raises(UserError, match=r"has no function 'brevty'.*Did you mean 'brevity'"):
        resolve(f"{name}:brevty", search_dirs=[tmp_path])


def test_syntax_error_in_user_module_names_file_and_line(tmp_path, user_module):
    name = user_module("def broken(completion)\n    return 1.0\n")
    with pytest.raises(UserError, match=rf"SyntaxError.*{name}\.py, line 1"):
        resolve(f"{name}:broken", search_dirs=[tmp_path])


def test_exception_at_import_and_missing_dependency(tmp_path, user_module):
    name = user_module("raise RuntimeError('boom')\n")
    with pytest.raises(UserError, match=r"importing module .* failed: RuntimeError: boom"):
        resolve(f"{name}:f", search_dirs=[tmp_path])
    name = user_module("import not_installed_pkg_xyz\n")
    with pytest.raises(UserError, match="imports 'not_installed_pkg_xyz', which is not installed"):
        resolve(f"{name}:f", search_dirs=[tmp_path])


def test_not_callable_and_bad_signature(tmp_path, user_module):
    name = user_module("THRESHOLD = 3\ndef kw_only(*, completion):\n    return 1.0\n")
    with pytest.raises(UserError, match="not a function"):
        resolve(f"{name}:THRESHOLD", search_dirs=[tmp_path])
    with pytest.raises(UserError, match="first positional parameter"):
        resolve(f"{name}:kw_only", search_dirs=[tmp_path])
    with pytest.raises(UserError, match="form 'package.module:function'"):
        resolve(f"{name}:", search_dirs=[tmp_path])


def test_entry_point_plugins(monkeypatch, tmp_path, user_module):
    name = user_module("def shout(completion):\n    return 1.0 if completion.isupper() else 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [
        EntryPoint(name="shout", value=f"{name}:shout", group=registry.ENTRY_POINT_GROUP),
        EntryPoint(name="numeric", value=f"{name}:shout", group=registry.ENTRY_POINT_GROUP),  # cannot shadow
        EntryPoint(name="broken", value="no_such_plugin_module:f", group=registry.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(registry, "entry_points", lambda group: [e for e in eps if e.group == group])
    v = resolve("shout")
    assert v.target == f"{name}:shout" and v.score("HI", {}).reward == 1.0
    assert resolve("numeric").target == BUILTINS["numeric"]
    assert available()["shout"] == f"{name}:shout"
    with pytest.raises(UserError, match="registered by .* but loading it failed"):
        resolve("broken")
    with pytest.raises(UserError, match=r"Did you mean 'shout'.*plugin verifiers: broken, numeric, shout"):
        resolve("shuot")


# --- the Verifier wrapper --------------------------------------------------------------------


def two_columns(completion, answer):
    return 1.0 if completion.strip() == str(answer) else 0.0


def all_columns(completion, **example):
    return float(len(example))


def raises(completion, answer):
    raise ZeroDivisionError("division by zero")


def test_extra_columns_are_dropped_for_plain_functions():
    v = resolve(two_columns)
    assert v.score("4", {"answer": 4, "question": "2+2?", "id": 7}).reward == 1.0


def test_kwargs_functions_get_every_column():
    v = resolve(all_columns)
    assert v.score("x", {"a": 1, "b": 2, "completion": "dup"}).reward == 2.0  # completion is not passed twice


def test_exceptions_become_error_rows():
    r = resolve(raises).score("4", {"answer": 4})
    assert r == VerifyResult(0.0, "error", "ZeroDivisionError: division by zero")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, VerifyResult(1.0, "ok")),
        (True, VerifyResult(1.0, "ok")),
        (0.25, VerifyResult(0.25, "ok")),
        (None, VerifyResult(0.0, "unparseable")),
        ("1.0", None),
        ([1.0], None),
        (float("nan"), None),
        (math.inf, None),
    ],
)
def test_return_values(value, expected):
    r = resolve(lambda completion: value).score("x", {})
    if expected is None:
        assert r.status == "error" and r.reward == 0.0 and r.detail
    else:
        assert r == expected


def test_missing_required_column_is_a_user_error():
    with pytest.raises(UserError, match=r"needs the column\(s\) 'answer'.*\['question'\]"):
        resolve(two_columns).score("4", {"question": "2+2?"})


def test_options():
    def graded(completion, answer, *, scale=1.0):
        return scale * two_columns(completion, answer)

    assert resolve(graded, options={"scale": 0.5}).score("4", {"answer": 4}).reward == 0.5
    # keyword-only parameters are options: a column of the same name does not fill them
    assert resolve(graded).score("4", {"answer": 4, "scale": 9}).reward == 1.0
    with pytest.raises(UserError, match=r"no option 'scal'.*Did you mean 'scale'.*Accepted options: answer, scale"):
        resolve(graded, options={"scal": 2})
    # an option may also fix a column
    assert resolve(two_columns, options={"answer": "4"}).score("4", {}).reward == 1.0


def test_chat_format_completion_and_bad_type():
    v = resolve(two_columns)
    assert v.score([{"role": "assistant", "content": "4"}], {"answer": 4}).reward == 1.0
    assert v.score(42, {"answer": 4}).status == "error"


def test_score_batch_sequential_and_parallel():
    v = resolve(two_columns)
    completions = ["1", "2", "x", "4"]
    rows = [{"answer": 1}, {"answer": 3}, {"answer": "y"}, {"answer": 4}]
    expected = [1.0, 0.0, 0.0, 1.0]
    assert [r.reward for r in v.score_batch(completions, rows)] == expected
    assert [r.reward for r in v.score_batch(completions, rows, max_workers=4)] == expected
    with pytest.raises(ValueError):
        v.score_batch(["a"], [])


def test_verifier_pickles():
    v = resolve("numeric", options={"mode": "strict"})
    clone = pickle.loads(pickle.dumps(v))
    assert clone.score("#### 3", {"answer": 3}).reward == 1.0 and clone.options == {"mode": "strict"}


def test_summarize():
    results = [
        VerifyResult(1.0, "ok"),
        VerifyResult(0.0, "ok"),
        VerifyResult(0.5, "ok"),
        VerifyResult(0.0, "unparseable"),
        VerifyResult(0.0, "error", "ValueError: x"),
    ]
    assert summarize(results) == {
        "n": 5,
        "pass_rate": 0.2,
        "mean_reward": 0.3,
        "unparseable_rate": 0.2,
        "error_rate": 0.2,
    }
    assert summarize([])["n"] == 0
    assert summarize(results, threshold=0.5)["pass_rate"] == 0.4
    with pytest.raises(ValueError):
        VerifyResult(1.0, "weird")
