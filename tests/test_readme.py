"""The README is a user's manual: at most 300 lines, opening with the two commands (install + quickstart, and
the test command CI runs); every relative link in it and in docs/*.md reaches an existing file, and a heading
of that file where it names an anchor; every `align` command it shows exists with the options it shows; its
YAML examples parse, and its example recipe validates."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
import typer
import yaml
from conftest import REPO

from alignment.cli import app
from alignment.config.recipe import load_recipe

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
INSTALL = 'pip install torch==2.13.0 && pip install -e ".[dev]" && align run recipes/quickstart.yaml --jobs 2'
TESTS = "python -m pytest -q -n 2"

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
# [text](target): text may wrap across lines, the target holds no spaces; images and bare URLs alike.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def code_blocks(text: str, language: str | None = None) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if language is None or lang == language]


def prose(text: str) -> str:
    """The text outside fenced code blocks (a link or heading inside a code block is not one)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lowercased, every character that is not a
    letter, digit, space, hyphen or underscore dropped, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, duplicates numbered as GitHub numbers them, and explicit
    `<a id=...>`/`<a name=...>` anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text()
    for line in prose(text).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    found |= set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return found


def test_readme_is_a_manual_of_at_most_300_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, (
        f"README.md has {len(lines)} lines: results go to docs/results.md, lessons to docs/tuning.md"
    )


def test_readme_opens_with_the_install_and_the_test_command():
    """The first two code blocks are the two commands, exactly, before any section; CI runs the second."""
    text = README.read_text()
    first_section = text.index("\n## ")
    blocks = [(match.start(), match.group(2).strip()) for match in FENCE.finditer(text)][:2]
    assert [body for _, body in blocks] == [INSTALL, TESTS]
    assert all(start < first_section for start, _ in blocks)
    assert TESTS in (REPO / ".ci" / "run").read_text()


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda path: path.name)
def test_every_relative_link_reaches_a_file_and_its_heading(path):
    broken = []
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    assert not broken, f"{path.name}: " + "; ".join(broken)


def shown_align_commands(text: str) -> list[list[str]]:
    """Every `align ...` command line of the README's shell blocks and inline code, as tokens."""
    lines = [line for block in code_blocks(text, "bash") for line in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"`(align [^`]*)`", prose(text))
    commands = []
    for line in lines:
        for part in re.split(r"&&|\$\(|\)", line.split(" #")[0]):
            part = part.strip()
            if part.startswith("align "):
                commands.append(shlex.split(part.replace("...", "")))
    return commands


def test_every_align_command_the_readme_shows_exists_with_its_options():
    cli = typer.main.get_command(app)  # the group of subcommands
    commands = shown_align_commands(README.read_text())
    assert len(commands) >= 10, commands
    wrong = []
    for tokens in commands:
        if len(tokens) < 2:
            continue  # `align` alone, as a name
        name = tokens[1]
        if name not in cli.commands:
            wrong.append(f"`{' '.join(tokens)}`: no command {name!r}")
            continue
        options = {opt for param in cli.commands[name].params for opt in [*param.opts, *param.secondary_opts]}
        options.add("--help")
        for token in tokens[2:]:
            option = token.split("=")[0]
            if option.startswith("-") and option not in options:
                wrong.append(f"`{' '.join(tokens)}`: `align {name}` has no option {option}")
    assert not wrong, "; ".join(wrong)


def test_readme_yaml_examples_parse_and_its_recipe_validates(tmp_path):
    blocks = code_blocks(README.read_text(), "yaml")
    assert blocks
    for block in blocks:
        yaml.safe_load(block)
    recipes = [block for block in blocks if block.startswith("name:")]
    assert recipes, "the Recipes section shows a whole recipe"
    for i, block in enumerate(recipes):
        path = tmp_path / f"recipe{i}.yaml"
        path.write_text(block)
        load_recipe(path)  # schema, references, TRL configs: no model or dataset is fetched


def test_the_files_and_functions_the_readme_names_exist():
    """Paths like `alignment/data/formatting.py`, tests/test_x.py, configs/..., recipes/... and dotted callables
    like `alignment.runtime.dist.configure_logging()`: a rename elsewhere must update the manual."""
    text = README.read_text()
    paths = set(re.findall(r"(?<![\w/.-])((?:alignment|tests|scripts|configs|recipes)/[\w./-]*\w)", text))
    missing = sorted(path for path in paths if not (REPO / path).exists())
    for dotted in set(re.findall(r"\b(alignment(?:\.\w+)+)\(\)", text)):
        module, _, name = dotted.rpartition(".")
        if not hasattr(importlib.import_module(module), name):
            missing.append(dotted)
    assert paths and not missing, missing
