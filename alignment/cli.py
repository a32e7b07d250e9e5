"""The `align` command line (typer).

  align run RECIPE [key=value ...] [--force] [--only STAGE] [--from STAGE] [--no-eval]
  align check RECIPE [key=value ...]
  align merge SOURCE OUT
  align eval CHECKPOINT ... --task arithmetic --verifier arithmetic
  align verify --verifier NAME --data FILE [--column completion]

User errors (bad recipe, data, paths, verifiers) print one paragraph on stderr and exit 2, without a
traceback. Under `accelerate launch -m alignment run RECIPE` every process runs the recipe.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from .errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Alignment post-training toolkit: run and check YAML recipes, evaluate and merge checkpoints.")


def _quiet_libraries() -> None:
    import os
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


@app.command()
def run(
    recipe: Path = typer.Argument(..., help="recipe YAML"),
    overrides: Optional[List[str]] = typer.Argument(None, help="dotted overrides, e.g. stages.sft.train.learning_rate=1e-4"),
    force: bool = typer.Option(False, "--force", help="rerun stages that already finished"),
    only: Optional[List[str]] = typer.Option(None, "--only", help="run only this stage (repeatable)"),
    start_from: Optional[str] = typer.Option(None, "--from", help="run this stage and every later one"),
    no_eval: bool = typer.Option(False, "--no-eval", help="skip the recipe's evaluate block"),
):
    """Run a recipe: every unfinished stage in order, then its evaluation."""
    from .recipe import load_recipe
    from .runner import run_recipe

    _quiet_libraries()
    loaded = load_recipe(recipe, overrides or [])
    run_recipe(loaded, force=force or bool(only) or bool(start_from), only=only, start_from=start_from,
               evaluate=not no_eval)


@app.command()
def check(
    recipe: Path = typer.Argument(..., help="recipe YAML"),
    overrides: Optional[List[str]] = typer.Argument(None, help="dotted overrides"),
):
    """Validate a recipe without training: schema, references, data columns, models, verifiers, TRL configs."""
    from .recipe import load_recipe
    from .runner import check_recipe

    _quiet_libraries()
    loaded = load_recipe(recipe, overrides or [])
    print(f"{recipe}: {len(loaded.stages)} stage(s)")
    check_recipe(loaded)
    print(f"{recipe}: ok")


@app.command()
def merge(
    source: str = typer.Argument(..., help="adapter folder (or a stage output with adapter/) to merge"),
    out: Path = typer.Argument(..., help="where to write the plain merged checkpoint"),
):
    """Export a plain merged checkpoint (base + LoRA adapter) that loads without peft."""
    from .models import check_model_source, load_policy, load_tokenizer

    check_model_source(source, "merge source")
    model = load_policy(source)  # an adapter folder is merged into its base here
    tokenizer = load_tokenizer(source)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"merged checkpoint written to {out}")


def main() -> None:
    try:
        app(standalone_mode=False)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except Exception as error:
        import click

        if isinstance(error, click.exceptions.UsageError):
            print(f"error: {error.format_message()}", file=sys.stderr)
            sys.exit(2)
        if isinstance(error, click.exceptions.Exit):
            sys.exit(error.exit_code)
        raise


if __name__ == "__main__":
    main()
