"""`math` verifier: symbolic answer checking with Hugging Face's math-verify.

The completion's answer is compared with the `answer` column by ``math_verify.verify``, so
``\\frac{1}{2}`` equals 0.5, ``2\\sqrt{2}`` equals ``\\sqrt{8}``, ``x^2+2x+1`` equals ``(x+1)^2`` and
``{1,2}`` equals ``{2,1}``. The gold answer may be a number, a LaTeX string (with or without ``$``
or ``\\boxed``) or a GSM8K solution ending in ``#### 42``. Only a stated answer counts (a boxed one,
one after "the answer is", a closing "= X", or a bare expression), never an expression quoted from the
problem: the rules, and what they do not cover, are `extract_answer`'s.

Returns 1.0 / 0.0, or None when nothing could be parsed from the completion. A gold answer that
math-verify cannot parse raises ValueError (reported as an error row). math-verify handles its own
``timeout`` (seconds, per parse and per comparison) by giving up: a parse that times out counts as
unparseable, a comparison that times out as wrong. Outside the main thread the check runs in a worker
process (`run_in_worker`), whose backstop raises TimeoutError, an error row. Cases:
tests/test_verifiers_math.py.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.pool
import re
import threading
from collections.abc import Callable
from numbers import Real
from typing import Any

from alignment.errors import UserError
from alignment.verifiers.numeric import problem_text

_POOL: multiprocessing.pool.Pool | None = None
_POOL_LOCK = threading.Lock()
_STARTUP_SLACK_S = 5.0  # a spawned worker re-imports math-verify + sympy before its first answer


def _gold_text(answer: Any) -> str:
    if isinstance(answer, bool) or answer is None:
        raise ValueError(f"answer column is {answer!r}, expected a math answer")
    text = str(answer).strip()
    if "####" in text:  # a GSM8K solution: the answer is after the marker
        text = text.rsplit("####", 1)[1].strip()
    if isinstance(answer, Real) or ("$" not in text and "\\boxed" not in text):
        text = f"${text}$"  # bare LaTeX ("\\sqrt{8}") only parses inside math delimiters
    return text


_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_MARKER = re.compile(r"\banswer(?:\s+is\b|\s*\**\s*:)|####", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?;](?=\s|$)")
_MATHY = re.compile(r"[\d=$\\]")
_STARTS_MATH = re.compile(r"[-+\d$\\(\[{.]")
# an aside after a complete value: "85 (37 + 48)", "$18$ (9 * 2)"
_ASIDE = re.compile(r"(?<=[\d$}])\s+\(.*$")
_RESULT_SIGN = re.compile(r"=|\b(?:is|are|equals)\b")
# a word of prose: two or more letters that are not a LaTeX command's name
_PROSE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
_TEXT_GROUP = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{[^{}]*\}")
_PLAIN = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|[a-z])")
# spellings of the same LaTeX, for "is this copied from the problem"
_SAME_LATEX = (
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("\\dbinom", "\\binom"),
    ("\\tbinom", "\\binom"),
    ("\\left", ""),
    ("\\right", ""),
    ("\\,", ""),
    ("\\!", ""),
    ("\\;", ""),
    ("\\(", ""),
    ("\\)", ""),
    ("\\[", ""),
    ("\\]", ""),
    ("$", ""),
    ("**", ""),
)


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}/\\fbox{...} (nested braces allowed; unclosed runs to the end)."""
    opens = list(_BOX_OPEN.finditer(text))
    if not opens:
        return None
    start, depth = opens[-1].end(), 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]


def _to_sentence_end(text: str) -> str:
    """`text` up to the end of its first line and sentence ("42. Then..." -> "42")."""
    line = text.lstrip(" \t*:\n").split("\n", 1)[0]
    end = _SENTENCE_END.search(line)
    return line[: end.start()] if end else line


def _is_math(text: str) -> bool:
    """Whether `text` is math without prose (\\text{...} groups such as units allowed)."""
    return bool(text.strip()) and not _PROSE.search(_TEXT_GROUP.sub("", text))


def _canon(text: str) -> str:
    """One spelling of `text` for copy checks: no math delimiters, \\dfrac as \\frac, lower case,
    single spaces and none around symbols, no closing punctuation."""
    for spelling, same in _SAME_LATEX:
        text = text.replace(spelling, same)
    text = re.sub(r"\s+", " ", text.lower())
    return re.sub(r"\s*([^\w\s])\s*", r"\1", text).strip(" .!?,;:")


def _occurs(needle: str, haystack: str) -> bool:
    """Whether canonical `needle` occurs in canonical `haystack`, not as part of a longer word or
    number ("x=3" does not occur in "x=30")."""
    before = r"(?<![\w.])" if needle[:1].isalnum() else ""
    after = r"(?!\w|\.\d)" if needle[-1:].isalnum() else ""
    return bool(re.search(before + re.escape(needle) + after, haystack))


def _marked_answer(text: str) -> str | None:
    """Rule 2: the math after the last answer marker that is followed by math, up to the first word
    of prose ("18 dollars" is 18) or an aside ("85 (37 + 48)" is 85); "the answer is clear" states
    nothing."""
    for marker in reversed(list(_MARKER.finditer(text))):
        span = _TEXT_GROUP.sub("", _to_sentence_end(text[marker.end() :])).strip()
        if _STARTS_MATH.match(span) or _is_math(span):
            prose = _PROSE.search(span)
            return _ASIDE.sub("", span[: prose.start()] if prose else span)
    return None


def _closing_answer(text: str, problem: str) -> str | None:
    """Rule 3: X of the closing statement "... = X" / "... is X", None when it has none or is copied."""
    sentences = [s for line in text.splitlines() for s in re.split(r"(?<=[.!?;])\s+", line) if _MATHY.search(s)]
    if not sentences:
        return None
    sentence = sentences[-1].strip()
    signs = list(_RESULT_SIGN.finditer(sentence))
    if not signs or sentence.endswith("?"):
        return None  # no result stated, or a question ("What is $\\frac{18}{6}$?") asks for one
    result = sentence[signs[-1].end() :].rstrip(" .!?;$*").removesuffix("\\]").removesuffix("\\)").strip(" $")
    if not _is_math(result):
        return None  # nothing after the "=" (cut off), or the sentence goes on in words
    lhs = sentence[: signs[-1].start()]
    lhs = lhs[max((m.end() for m in _PROSE.finditer(lhs)), default=0) :]  # the equation starts after the prose
    equation = f"{lhs}={result}" if signs[-1].group() == "=" and lhs.strip(" $,:") else ""
    copied = [c for c in (sentence, equation) if c and _occurs(_canon(c), problem)]
    return None if copied else result


def extract_answer(completion: str, problem: str = "") -> str | None:
    """The text of the completion's stated answer, or None. `problem` is canonical problem text (`_canon`).

    Which text is the answer. Only a stated answer counts, never any expression math-verify can find in
    the text: "I am not sure how to compute $\\frac{24}{8}$." would otherwise answer 3, and RL pays for
    exactly that. In this order, the first that applies is the answer:

    1. the last ``\\boxed{...}`` (or ``\\fbox{...}``);
    2. the last explicit answer: what follows "answer is", "answer:" (also "Final answer:", "**Answer:**")
       or ``####``, to the end of that sentence or line, when that is math ("the answer is clear" is no
       answer; "the answer is 18 dollars" is 18);
    3. the closing statement: the last sentence that holds any math (a digit, ``=``, ``$`` or ``\\``;
       sign-offs such as "I hope this helps!" are passed over) when it ends in ``= X`` or "is X" (also
       "are", "equals"), X being everything after it and no prose ("So x = 5.", "Thus the sum is $36$.");
       a statement cut off after the ``=`` ("$\\frac{18}{6} =") has no answer, nor has one that goes on
       in words after X ("We know a = 18 from the problem"), nor a question ("What is $\\frac{18}{6}$?");
    4. the whole completion, when it is nothing but a math expression ("42", "$\\frac{1}{2}$").

    Otherwise the completion states no answer: None. And the problem (the ``problem``, ``question`` or
    ``prompt`` column, whichever the row has) is not the answer: a closing statement copied from the
    problem, or whose equation is ("We need x such that 2x + 3 = 11." for "If $2x+3=11$, ...") is no
    answer (None); an answer that is an expression copied from the problem ("The answer is
    $\\dbinom{31}{28}$" for "Compute $\\dbinom{31}{28}$") is not evaluated, so it is wrong (0.0) even
    where math-verify would evaluate it to the gold value. A plain number or letter, and an expression
    spelled as the gold answer is, are exempt (multiple choice: "Which is larger, $\\frac{1}{2}$ or
    $\\frac{1}{3}$?"). Not covered: a choice copied from the problem in another spelling than the gold
    answer's counts as unevaluated (0.0)."""
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed
    found = _marked_answer(completion)
    if found is None:
        found = _closing_answer(completion, problem)
    if found is not None:
        return found
    whole = completion.strip()
    return whole if _is_math(whole) and "=" not in whole else None


def _copied_expression(found: str, problem: str, gold: str) -> bool:
    """An expression copied from the problem and not spelled as the gold answer: left unevaluated."""
    answer = _canon(found)
    if not answer or _PLAIN.fullmatch(answer) or answer == _canon(_last_boxed(gold) or gold):
        return False
    return _occurs(answer, problem)


def check(completion: str, answer: Any, timeout: int, problem: str = "") -> float | None:
    """The comparison itself; call only in a main thread (math-verify sets signal.alarm).
    `problem`: the problem's plain text (`numeric.problem_text`), empty when the row has none."""
    from math_verify import parse
    from math_verify import verify as math_verify

    gold_text = _gold_text(answer)
    gold = parse(gold_text, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the answer column {str(answer)[:80]!r}")
    problem = _canon(problem) if problem else ""
    found = extract_answer(completion, problem)
    if found is None or not found.strip(" $"):
        return None
    if problem and _copied_expression(found, problem, gold_text):
        return 0.0
    predicted = parse(found if "$" in found else f"\\boxed{{{found}}}", parsing_timeout=timeout)
    if not predicted:
        return None
    return 1.0 if math_verify(gold, predicted, timeout_seconds=timeout) else 0.0


def _pool() -> multiprocessing.pool.Pool:
    global _POOL
    if _POOL is None:
        _POOL = multiprocessing.get_context("spawn").Pool(processes=1)
    return _POOL


def _shutdown_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.terminate()
        _POOL = None


atexit.register(_shutdown_pool)


def run_in_worker(func: Callable, args: tuple, timeout: float) -> Any:
    """Run func(*args) in the worker process; TimeoutError (and a fresh worker) if it takes too long.

    func must be importable by name (the worker is a spawned process).

    Timeouts: math-verify interrupts itself with ``signal.alarm``, which only works in the main thread
    of the main interpreter. In the main thread we let it do that. Anywhere else (a thread pool in an
    evaluation, a dataloader thread) we run the check in a worker process instead, a one-process
    ``multiprocessing.Pool`` started with "spawn" (forking a process that has threads can deadlock):
    the worker calls math-verify in *its* main thread, so the alarm-based timeouts still apply there,
    and the caller waits at most ``timeout`` (twice, plus `_STARTUP_SLACK_S` for start-up) on the result; if that
    backstop fires, the worker is killed and a fresh one starts on the next call. Calls from threads
    are serialised through one worker (math-verify takes milliseconds; a slow one does not eat the
    others' timeout budget)."""
    with _POOL_LOCK:
        pending = _pool().apply_async(func, args)
        try:
            return pending.get(timeout)
        except multiprocessing.TimeoutError:
            _shutdown_pool()  # the only way to stop a stuck computation is to kill its process
            raise TimeoutError(f"math verification took longer than {timeout:g} s; worker restarted") from None


def verify(
    completion: str,
    answer: Any,
    problem: Any = None,
    question: Any = None,
    prompt: Any = None,
    *,
    timeout: int = 5,
) -> float | None:
    """1.0 if the completion's stated answer equals `answer` mathematically, 0.0 if not, None if it
    states none. `problem`/`question`/`prompt` (whichever the row has) hold the problem, which a
    completion may restate without answering."""
    args = (completion, answer, timeout, problem_text(problem, question, prompt))
    if threading.current_thread() is threading.main_thread():
        return check(*args)
    return run_in_worker(check, args, 2 * timeout + _STARTUP_SLACK_S)


def check_options(options: dict) -> None:
    """Called by resolve(): the timeout is whole seconds because signal.alarm takes an int."""
    timeout = options.get("timeout", 5)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
        raise UserError(f"Verifier 'math': option timeout={timeout!r} must be a whole number of seconds >= 1.")


verify.check_options = check_options  # type: ignore[attr-defined]
