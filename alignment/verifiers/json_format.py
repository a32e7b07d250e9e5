"""`json` verifier: the completion must be one JSON object (optionally with required keys).

What is read: the completion trimmed of whitespace, or the content of its last ```json (or bare
```) fenced block if it has one. With ``extract: true`` the span from the first ``{`` to the last
``}`` is read instead, so "Here you go: {...}" passes.

Scores (decided for this toolkit, see docs/architecture.md, house rule 3):

- no ``{`` anywhere in that text -> None: the model did not attempt JSON (unparseable);
- attempted but invalid JSON, or valid JSON that is not an object (a list, a string) -> 0.0:
  wrong format;
- an object missing any of ``required_keys`` (option, list of top-level key names) -> 0.0;
- otherwise 1.0.

    resolve("json", options={"required_keys": ["name", "age"]})
"""

from __future__ import annotations

import json
import re

from alignment.errors import UserError

_FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def _candidate(completion: str, extract: bool) -> str:
    fenced = _FENCE.findall(completion)
    text = (fenced[-1] if fenced else completion).strip()
    if extract and "{" in text and "}" in text:
        text = text[text.index("{") : text.rindex("}") + 1]
    return text


def verify(completion: str, *, required_keys: list[str] | tuple[str, ...] = (), extract: bool = False) -> float | None:
    """1.0 for a JSON object with all required keys, 0.0 for bad JSON, None if no JSON attempted."""
    text = _candidate(completion, extract)
    if "{" not in text:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting is just bad JSON
        return 0.0
    if not isinstance(value, dict):
        return 0.0
    return 1.0 if all(key in value for key in required_keys) else 0.0


def check_options(options: dict) -> None:
    """Called by resolve(): required_keys must be a list of strings."""
    keys = options.get("required_keys", [])
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
        raise UserError(f"Verifier 'json': option required_keys must be a list of key names, got {keys!r}.")


verify.check_options = check_options  # type: ignore[attr-defined]
