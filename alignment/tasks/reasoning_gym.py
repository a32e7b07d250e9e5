"""reasoning-gym's procedural generators as a built-in task, and the verifier that scores with their own scorers.

`data: {task: reasoning_gym, tasks: {leg_counting: 1, spell_backward: {weight: 2, config: {...}}}, n: 2000}` gives
`n` rows shared among the tasks by weight: `prompt` (or `messages`), `completion` (`<answer>ANSWER</answer>`; None
where the task has no single reference answer), `answer`, `rg_task` and `rg_entry` (the generated entry as JSON,
what the verifier scores against). Train and held-out splits draw from disjoint seeds derived from the recipe
seed, and each task's questions are split by a hash of their text (`test_fraction`), so a held-out question is
never a training question whatever `n` and seed are; a question phrased differently is a different question.
The `reasoning_gym` verifier reads the last `<answer>...</answer>` (reasoning-gym's convention; none: unparseable)
and returns the task's own `score_answer` (partial credit on some tasks; pass = full credit).
Limits: the scorers are reasoning-gym's code, run in this process without a time or memory bound; some read the
answer with sympy's `parse_expr`, which evaluates Python, so an answer holding `__` or past `MAX_ANSWER_CHARS` is
an error row, never scored. That narrows, but does not close, what a hostile policy could make them run.
Needs the optional extra: `pip install -e ".[tasks]"`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import random
from typing import Any

from ..config.base import did_you_mean
from ..config.tasks import ReasoningGymParams
from ..errors import UserError
from ..verifiers.base import VerifyResult
from .splits import band, band_of

log = logging.getLogger(__name__)  # under the toolkit's `alignment` logger, without importing torch

MAX_ANSWER_CHARS = 20_000
# Train seeds lie in [0, 2**30), held-out ones 2**30 above: generators draw item i from Random(seed + i) (numpy
# seeds must stay below 2**32), so the two streams never share an item seed below 2**30 items.
SEED_SPAN = 2**30


def _library():
    """The reasoning_gym package, imported on first use (it takes seconds); missing: a UserError naming the extra."""
    try:
        import reasoning_gym
        import reasoning_gym.utils
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "reasoning_gym":
            raise
        raise UserError(
            "Task 'reasoning_gym' needs the reasoning-gym package, which is not installed: "
            'pip install -e ".[tasks]" (or pip install reasoning-gym).'
        ) from None
    return reasoning_gym


def task_names() -> list[str]:
    """The installed reasoning-gym's task names (`composite` left out: a mix is given by `tasks:` itself)."""
    from_factory = _library().factory.DATASETS
    return sorted(name for name in from_factory if name != "composite")


def build(params: ReasoningGymParams, split: str, seed: int) -> list[dict]:
    """`params.n` rows of the split (`train`, `test` or `validation`: alignment/tasks/splits.py), deterministic in
    (params, split, seed). Each task gets its weight's share of `n` (largest remainders), and the rows of all tasks
    are interleaved in a seeded order. A generator draws with replacement, so a task whose questions are few repeats
    them: the log line counts each task's distinct questions where they are fewer than its rows. Not covered: a few
    generators iterate over sets of strings (word_ladder, ransom_note, ...), so their rows also depend on the
    interpreter's hash seed; set PYTHONHASHSEED for the same rows in every run and every process of one."""
    library = _library()
    known = task_names()
    for name in params.tasks:
        if name not in known:
            raise UserError(
                f"Task reasoning_gym, `tasks: {{{name}: ...}}`: unknown reasoning-gym task '{name}'"
                f"{did_you_mean(name, known)}; the installed reasoning-gym has {len(known)}: "
                f"{', '.join(known)}."
            )
    wanted = band_of(split, "reasoning_gym", params.validation_fraction)
    instruction = _instruction(library, params.system_prompt)
    rows: list[dict] = []
    counts = []
    shares = _shares(params.n, {name: task.weight for name, task in params.tasks.items()})
    for name, count in shares.items():
        config = params.tasks[name].config
        entries = _entries(library, name, config, count, wanted, params, seed)
        rows += [_row(name, config, entry, instruction, params.format) for entry in entries]
        distinct = len({entry["question"] for entry in entries})
        counts.append(f"{name} {count}" + (f" ({distinct} distinct)" if distinct < count else ""))
    random.Random(f"{seed}-{split}-reasoning_gym").shuffle(rows)
    unanswered = sum(row["answer"] is None for row in rows)
    log.info(
        f"reasoning_gym ({wanted} questions): "
        + ", ".join(counts)
        + (f"; {unanswered} rows without a reference answer (no `completion`)" if unanswered else "")
    )
    return rows


def _shares(n: int, weights: dict[str, float]) -> dict[str, int]:
    """`n` split in proportion to `weights`: the floors, then one more to the largest remainders (ties: in order)."""
    total = sum(weights.values())
    exact = {name: n * weight / total for name, weight in weights.items()}
    shares = {name: math.floor(value) for name, value in exact.items()}
    by_remainder = sorted(exact, key=lambda name: shares[name] - exact[name])
    for name in by_remainder[: n - sum(shares.values())]:
        shares[name] += 1
    return shares


def _instruction(library, name: str) -> str | None:
    if name == "none":
        return None
    prompts = library.utils.SYSTEM_PROMPTS
    if name not in prompts:
        raise UserError(
            f"Task reasoning_gym: system_prompt '{name}' is not among the installed reasoning-gym's "
            f"prompts ({', '.join(prompts)})."
        )
    return prompts[name].strip()


def _entries(library, name: str, config: dict, count: int, wanted: str, params: ReasoningGymParams, seed: int):
    """`count` entries of task `name` whose questions fall in the `wanted` band. The generator is made in chunks
    (some precompute per item at construction), each continuing the same seed stream (the training band's, or the
    held-out one that the test and validation bands share); a band that stays empty after many draws (a task with
    very few distinct questions) is an error."""
    test, validation = params.test_fraction, params.validation_fraction
    share = {"test": test, "validation": validation, "train": 1 - test - validation}[wanted]
    start = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:4], "big") % SEED_SPAN
    start += 0 if wanted == "train" else SEED_SPAN
    if count == 0:  # a task whose weight rounds to no rows: its config is still checked
        _dataset(library, name, config, seed=start, size=1)
        return []
    budget, drawn, found = math.ceil((count + 20) / share * 4), 0, []
    while len(found) < count and drawn < budget:
        size = min(budget - drawn, math.ceil((count - len(found)) / share * 1.2) + 8)
        dataset = _dataset(library, name, config, seed=start + drawn, size=size)
        found += [e for e in (dataset[i] for i in range(size)) if band(e["question"], test, validation) == wanted]
        drawn += size
    if len(found) < count:
        raise UserError(
            f"Task reasoning_gym: '{name}' gave only {len(found)} of {count} {wanted} questions in {drawn} "
            f"draws: its config yields too few distinct questions for test_fraction {test} and "
            f"validation_fraction {validation}."
        )
    return found[:count]


def _dataset(library, name: str, config: dict, **fixed):
    """reasoning-gym's dataset object; a config it refuses is a UserError naming the key."""
    config_class = library.factory.DATASETS[name][1]
    fields = list(getattr(config_class, "__dataclass_fields__", {}))
    unknown = [key for key in config if key not in fields]
    if unknown:
        keys = ", ".join(f for f in fields if f not in fixed)
        raise UserError(
            f"Task reasoning_gym: '{name}' has no config key '{unknown[0]}'"
            f"{did_you_mean(unknown[0], fields)}; its keys: {keys}."
        )
    try:
        return library.create_dataset(name, **config, **fixed)
    except (AssertionError, ValueError, TypeError) as error:  # reasoning-gym validates configs with assert
        raise UserError(
            f"Task reasoning_gym: '{name}' refused its config {config}: {error or type(error).__name__}."
        ) from None


def _row(name: str, config: dict, entry: dict, instruction: str | None, fmt: str) -> dict:
    question, answer = entry["question"], entry["answer"]
    completion = None if answer is None else f"<answer>{answer}</answer>"
    stored = {"task": name, "config": config, "question": question, "answer": answer, "metadata": entry["metadata"]}
    row = {"answer": answer, "rg_task": name, "rg_entry": json.dumps(_encode(stored))}
    if fmt == "messages":
        system = [{"role": "system", "content": instruction}] if instruction else []
        reply = [{"role": "assistant", "content": completion}] if completion is not None else []
        return {"messages": [*system, {"role": "user", "content": question}, *reply], **row}
    prompt = f"{instruction}\n\n{question}" if instruction else question
    return {"prompt": prompt, "completion": completion, **row}


# Metadata is whatever each generator puts there: tuples (ARC grids, compared as tuples by their scorer), sets and
# dicts with non-string keys would come back from plain JSON as lists and string keys, so they are tagged.
def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [_encode(v) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v) for k, v in value.items()}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _encode(value.tolist())
    raise UserError(f"Task reasoning_gym: an entry's metadata holds a {type(value).__name__}, which cannot be stored.")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        if len(value) == 1 and "__set__" in value:
            return {_decode(v) for v in value["__set__"]}
        if len(value) == 1 and "__items__" in value:
            return {_decode(k): _decode(v) for k, v in value["__items__"]}
        return {k: _decode(v) for k, v in value.items()}
    return value


@functools.lru_cache(maxsize=64)
def _scorer(name: str, config_json: str):
    """The dataset whose `score_answer` scores entries of task `name` made with this config (built once)."""
    return _dataset(_library(), name, json.loads(config_json), size=1)


def verify(completion: str, rg_entry: str, **_) -> float | VerifyResult | None:
    """The task's own `score_answer` of the completion's last `<answer>...</answer>` against the row's entry:
    1.0 correct, partial credit on some tasks, 0.0 wrong; None when the completion has no answer tags."""
    answer = _library().utils.extract_answer(completion)
    if answer is None:
        return None
    if len(answer) > MAX_ANSWER_CHARS or "__" in answer:
        why = "longer than MAX_ANSWER_CHARS" if len(answer) > MAX_ANSWER_CHARS else "holding '__'"
        return VerifyResult(0.0, "error", f"answer {why}: not handed to reasoning-gym's scorer")
    entry = _decode(json.loads(rg_entry))
    dataset = _scorer(entry["task"], json.dumps(entry["config"], sort_keys=True))
    scored = {"question": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}
    return float(dataset.score_answer(answer, scored))
