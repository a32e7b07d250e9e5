"""Turn a verifier name from a recipe into a `Verifier`.

A name is a built-in key of `BUILTINS` ("numeric", "math", "python_tests", ...), a name an installed
package registers under the entry-point group ``alignment.verifiers``, or ``package.module:function`` (a
file ``my_verifiers.py`` next to the recipe is found as ``my_verifiers:brevity``); precedence in `resolve`.
Anything that does not resolve raises `UserError` with one paragraph naming the culprit, a
"did you mean" hint and the built-in names. Options are checked against the function's
parameters at resolve time (unknown option = UserError), never at the first training step.

    from alignment.verifiers import resolve
    v = resolve("numeric", options={"mode": "strict"})
    v = resolve("my_verifiers:brevity", search_dirs=[recipe_dir])
"""

from __future__ import annotations

import difflib
import importlib
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from alignment.errors import UserError
from alignment.verifiers.base import Verifier, inspect_function

ENTRY_POINT_GROUP = "alignment.verifiers"

# key -> "module:function"; strings so nothing is imported until a verifier is resolved.
BUILTINS: dict[str, str] = {
    "numeric": "alignment.verifiers.numeric:verify",
    "gsm8k": "alignment.verifiers.numeric:verify",
    "math": "alignment.verifiers.math_answer:verify",
    "regex": "alignment.verifiers.formats:regex",
    "think_format": "alignment.verifiers.formats:think_format",
    "answer_tag": "alignment.verifiers.formats:answer_tag",
    "json": "alignment.verifiers.json_format:verify",
    "python_tests": "alignment.verifiers.python_tests:verify",
    "arithmetic": "alignment.tasks.arithmetic:verify",
    "reasoning_gym": "alignment.tasks.reasoning_gym:verify",
}


def _plugins() -> dict[str, Any]:
    """Entry points in our group, by name (the first one wins if two packages clash)."""
    found: dict[str, Any] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)
    return found


def available() -> dict[str, str]:
    """Every resolvable short name -> its target, built-ins first, then installed plugins."""
    names = dict(BUILTINS)
    for name, ep in _plugins().items():
        names.setdefault(name, ep.value)
    return names


def _catalogue(plugins: Iterable[str]) -> str:
    plugin_list = ", ".join(sorted(plugins)) or "none"
    return (
        f"Built-in verifiers: {', '.join(sorted(BUILTINS))}. Installed plugin verifiers: {plugin_list}. "
        f"Your own function is named 'module:function' (e.g. 'my_verifiers:check' for a file "
        f"my_verifiers.py next to the recipe)."
    )


def _hint(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _describe_failure(exc: BaseException) -> str:
    """'ExcType: msg (file.py, line N)' for an exception raised while importing user code."""
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _forget_stale(module: str, dirs: list[str]) -> None:
    """If `module` was imported from elsewhere but a search dir has its own copy (two recipes,
    each with a my_verifiers.py), drop the cached one so the recipe's file is the one used."""
    top = module.split(".")[0]
    loaded = getattr(sys.modules.get(top), "__file__", None)
    for d in dirs:
        for candidate in (Path(d) / f"{top}.py", Path(d) / top / "__init__.py"):
            if loaded and candidate.is_file() and Path(loaded).resolve() != candidate.resolve():
                for key in [k for k in sys.modules if k == top or k.startswith(top + ".")]:
                    del sys.modules[key]
                return


def _import_module(module: str, name: str, search_dirs: Iterable[str | Path] | None) -> Any:
    """Import `module`, with search_dirs temporarily at the front of sys.path."""
    dirs = [str(Path(d).resolve()) for d in (search_dirs or [])]
    _forget_stale(module, dirs)
    added = [d for d in dirs if d not in sys.path]
    sys.path[:0] = added
    try:
        importlib.invalidate_caches()  # the file may have been written after the last import
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module == missing or module.startswith(missing + "."):
            looked = f"the directories {dirs} and sys.path" if dirs else "sys.path"
            raise UserError(
                f"Verifier '{name}': cannot import module '{module}' (looked in {looked}). Check the "
                f"spelling, or put {module.replace('.', '/')}.py next to the recipe. "
                f"{_catalogue(_plugins())}"
            ) from None
        raise UserError(
            f"Verifier '{name}': module '{module}' imports '{missing}', which is not installed "
            f"(pip install the package that provides it)."
        ) from None
    except Exception as exc:  # an error inside the user's module: show where, not a traceback
        raise UserError(f"Verifier '{name}': importing module '{module}' failed: {_describe_failure(exc)}.") from None
    finally:
        for d in added:
            if d in sys.path:
                sys.path.remove(d)


def _load_target(target: str, name: str, search_dirs: Iterable[str | Path] | None) -> Callable:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise UserError(f"Verifier '{name}': '{target}' is not of the form 'package.module:function'.")
    module = _import_module(module_name, name, search_dirs)
    obj: Any = module
    for part in attr.split("."):  # allow module:Class.method style paths
        if not hasattr(obj, part):
            public = [k for k in dir(module) if not k.startswith("_") and callable(getattr(module, k))]
            raise UserError(
                f"Verifier '{name}': module '{module_name}' ({getattr(module, '__file__', '?')}) has no "
                f"function '{attr}'.{_hint(attr, public)} Functions it defines: "
                f"{', '.join(sorted(public)) or 'none'}."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"Verifier '{name}': '{target}' is a {type(obj).__name__}, not a function.")
    return obj


def _load_plugin(ep: Any, name: str) -> Callable:
    try:
        obj = ep.load()
    except Exception as exc:
        dist = getattr(getattr(ep, "dist", None), "name", None) or "an installed package"
        raise UserError(
            f"Verifier '{name}' is registered by {dist} as '{ep.value}', but loading it failed: "
            f"{_describe_failure(exc)}."
        ) from None
    if not callable(obj):
        raise UserError(f"Verifier '{name}': plugin entry point '{ep.value}' is not a function.")
    return obj


def _find(name: str, search_dirs: Iterable[str | Path] | None) -> tuple[Callable, str]:
    if name in BUILTINS:
        return _load_target(BUILTINS[name], name, None), BUILTINS[name]
    plugins = _plugins()
    if name in plugins:
        return _load_plugin(plugins[name], name), plugins[name].value
    if ":" in name:
        return _load_target(name, name, search_dirs), name
    raise UserError(f"Unknown verifier '{name}'.{_hint(name, list(BUILTINS) + list(plugins))} {_catalogue(plugins)}")


def _check_options(fn: Callable, name: str, options: Mapping[str, Any]) -> None:
    sig = inspect_function(fn, name)
    if not sig.var_keyword:
        unknown = [k for k in options if k not in sig.options]
        if unknown:
            accepted = ", ".join(sig.options) or "none"
            raise UserError(
                f"Verifier '{name}' has no option {', '.join(map(repr, unknown))}."
                f"{_hint(unknown[0], sig.options)} Accepted options: {accepted}."
            )
    missing = [k for k in sig.required_options if k not in options]
    if missing:
        raise UserError(f"Verifier '{name}' needs the option(s) {', '.join(map(repr, missing))}.")
    check = getattr(fn, "check_options", None)
    if callable(check):
        check(dict(options))


def resolve(
    name: str | Callable,
    options: Mapping[str, Any] | None = None,
    search_dirs: Iterable[str | Path] | None = None,
) -> Verifier:
    """Resolve a built-in key, plugin name, 'module:function' or a callable to a `Verifier`.

    options: keyword options bound to every call (unknown option -> UserError).
    search_dirs: directories searched first for 'module:function' (e.g. the recipe's directory).

    A name is, in this order of precedence: a built-in key of `BUILTINS`, imported lazily (so importing
    `alignment.verifiers` never imports math-verify/sympy or the task modules); a name registered by an
    installed package under the entry-point group ``alignment.verifiers`` (in the plugin's pyproject.toml:
    ``[project.entry-points."alignment.verifiers"]`` ``brevity = "my_plugin.verifiers:brevity"``); or
    ``package.module:function``, with `search_dirs` put in front of ``sys.path`` while the module is imported.
    """
    options = dict(options or {})
    if callable(name):
        fn, target = name, f"{getattr(name, '__module__', '?')}:{getattr(name, '__qualname__', repr(name))}"
        label = getattr(name, "__name__", target)
    elif isinstance(name, str) and name.strip():
        label = name.strip()
        fn, target = _find(label, search_dirs)
    else:
        raise UserError(f"A verifier name must be a non-empty string, got {name!r}. {_catalogue(_plugins())}")
    _check_options(fn, label, options)
    return Verifier(name=label, fn=fn, options=options, target=target)
