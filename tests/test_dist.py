"""dist.py: the one log path (rank 0 only, secrets masked, quiet until configured) and the main-process test."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from alignment import dist


@pytest.fixture
def configured():
    """The CLI's logging for one test, removed afterwards so other tests see the library default."""
    logger = logging.getLogger(dist.ROOT)
    before, level = list(logger.handlers), logger.level
    dist.configure_logging()
    dist.configure_logging()  # idempotent: still one handler
    yield logger
    logger.handlers[:] = before
    logger.setLevel(level)


def test_configured_log_prints_plain_lines_on_stdout_once(configured, capsys):
    assert sum(isinstance(h, dist.StdoutHandler) for h in configured.handlers) == 1
    dist.get_logger("alignment.stages.sft").info("[sft] done in %.1fs", 1.25)
    assert capsys.readouterr().out == "[sft] done in 1.2s\n"


def test_secrets_are_masked_in_printed_lines(configured, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefgh12345")
    dist.get_logger("runner").info("loading with token hf_abcdefgh12345 from %s", "hub")
    out = capsys.readouterr().out
    assert "hf_abcdefgh12345" not in out and "loading with token *** from hub" in out


def test_only_rank_zero_prints(configured, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert not dist.is_main_process()
    dist.get_logger("alignment.runner").info("[sft] done")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    assert dist.is_main_process()


def test_unconfigured_library_prints_nothing_below_warning():
    """In a fresh process (as a user's script): INFO is silent, a warning still reaches stderr."""
    code = ("from alignment import dist; log = dist.get_logger('alignment.runner'); "
            "log.info('[sft] done'); log.warning('careful')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "" and "careful" in done.stderr
