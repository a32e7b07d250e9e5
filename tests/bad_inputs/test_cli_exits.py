"""How the CLI exits outside the bad-input catalogue: help exits 0, a bare `align` prints help and exits 2, usage
errors of click or typer's vendored click exit 2 with the usage line, Ctrl-C exits 130."""

from __future__ import annotations

import pytest

from alignment.cli import main


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["eval", "--help"]])
def test_help_exits_0(capsys, argv):
    try:
        main(argv)  # returning is exit status 0 too
    except SystemExit as exited:
        assert exited.code in (0, None)
    assert "Usage" in capsys.readouterr().out


def test_bare_align_prints_help_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2
    assert "run" in capsys.readouterr().out


def click_context():
    import click

    return click.exceptions, click.Context(click.Command("run"), info_name="align run")


def typer_context():
    import typer
    import typer._click.exceptions

    import alignment.cli

    group = typer.main.get_command(alignment.cli.app)
    return typer._click.exceptions, group.context_class(group, info_name="align")


@pytest.mark.parametrize("click_of", [click_context, typer_context], ids=["click", "typer-vendored"])
def test_usage_errors_of_either_click_exit_2(monkeypatch, capsys, click_of):
    """typer vendors click (typer._click) but older typer raises click's own classes: both are usage errors."""
    import alignment.cli

    exceptions, ctx = click_of()

    def raise_usage_error(**_):
        raise exceptions.NoSuchOption("--forse", ctx=ctx)

    monkeypatch.setattr(alignment.cli, "app", raise_usage_error)
    with pytest.raises(SystemExit) as exited:
        main(["run", "--forse"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.splitlines()[0].startswith("Usage: align")
    message = err.strip().splitlines()[-1]
    assert message.startswith("error: No such option") and "--forse" in message, message


def test_ctrl_c_in_a_command_exits_130(monkeypatch, capsys):
    """typer turns Ctrl-C inside a command into a returned 130; it must not become exit status 0."""
    import alignment.config.recipe

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(alignment.config.recipe, "load_recipe", interrupted)
    with pytest.raises(SystemExit) as exited:
        main(["run", "r.yaml"])
    assert exited.value.code == 130
    assert capsys.readouterr().err.strip() == "aborted"
