"""dist.py: the one log path (rank 0 only, secrets masked, quiet until configured), the main-process test, and the
engine checks: the launch's engine and accelerate's, launches refused before any work, the shared output_dir,
loading whole models under ZeRO-3."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from alignment.runtime import dist


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
    dist.get_logger("alignment.run.runner").info("[sft] done")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    assert dist.is_main_process()


def test_unconfigured_library_prints_nothing_below_warning():
    """In a fresh process (as a user's script): INFO is silent, a warning still reaches stderr."""
    code = (
        "from alignment.runtime import dist; log = dist.get_logger('alignment.run.runner'); "
        "log.info('[sft] done'); log.warning('careful')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "" and "careful" in done.stderr


# ---------------------------------------------------------------------------------------------------
# Engines: what the launch asked for, what accelerate set up, and the checks before any work

ENGINE_ENV = (
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "ACCELERATE_USE_FSDP",
    "FSDP_VERSION",
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_USE_CPU",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
)


@pytest.fixture
def launch_env(monkeypatch):
    """`set(**env)`: the environment `accelerate launch` would give a process, and nothing else of it."""
    for name in ENGINE_ENV:
        monkeypatch.delenv(name, raising=False)

    def set_env(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return set_env


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "fsdp2"),
        ({"ACCELERATE_USE_FSDP": "true"}, "fsdp1"),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, "zero2"),
        (
            {
                "ACCELERATE_USE_DEEPSPEED": "true",
                "ACCELERATE_DEEPSPEED_CONFIG_FILE": "configs/accelerate/zero3_cpu.json",
            },
            "zero3",
        ),
    ],
)
def test_launched_engine_is_read_from_the_launch_environment(launch_env, monkeypatch, env, expected):
    from conftest import REPO

    monkeypatch.chdir(REPO)  # a deepspeed_config_file path is relative to where the launch runs
    launch_env(**env)
    assert dist.launched_engine() == expected


def state_of(kind, processes=2, zero_stage=None, fsdp_version=None):
    from types import SimpleNamespace

    return SimpleNamespace(
        distributed_type=kind,
        num_processes=processes,
        deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage),
        fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version),
    )


def test_engine_of_names_what_accelerate_set_up():
    from accelerate.utils import DistributedType

    assert dist.engine_of(state_of(DistributedType.DEEPSPEED, zero_stage=3)) == "zero3"
    assert dist.engine_of(state_of(DistributedType.FSDP, fsdp_version=2)) == "fsdp2"
    assert dist.engine_of(state_of(DistributedType.MULTI_CPU)) == "ddp"
    assert dist.engine_of(state_of(DistributedType.NO, processes=1)) == "single"


def test_a_stage_set_up_unsharded_under_a_sharding_launch_stops(launch_env):
    """accelerate quietly trains DDP where it cannot set up FSDP (CPU) or DeepSpeed (ACCELERATE_USE_CPU)."""
    from accelerate.utils import DistributedType

    launch_env(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
    with pytest.raises(
        dist.UserError,
        match=r"stages.sft: the launch asks for fsdp2, but accelerate set this stage up "
        r"as ddp, so it would train unsharded; stopped before training",
    ):
        dist.check_engine(state_of(DistributedType.MULTI_CPU), "stages.sft")
    assert dist.check_engine(state_of(DistributedType.FSDP, fsdp_version=2), "stages.sft") == "fsdp2"


@pytest.mark.parametrize(
    "env, processes, expected",
    [
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, 1, "has 1 process: nothing would be sharded"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, 2, "runs FSDP2 only"),
        (
            {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_USE_CPU": "1"},
            2,
            "ACCELERATE_USE_CPU is set",
        ),
        (
            {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_MIXED_PRECISION": "bf16"},
            2,
            "configs/accelerate/fsdp2_cpu.yaml",
        ),
    ],
)
def test_launches_that_would_not_run_as_asked_stop_before_any_work(launch_env, monkeypatch, env, processes, expected):
    monkeypatch.setattr(dist, "find_spec", lambda name: object())  # as if DeepSpeed were installed
    monkeypatch.setattr(dist.torch.cuda, "is_available", lambda: False)
    launch_env(**env)
    with pytest.raises(dist.UserError, match=re.escape(expected)):
        dist.check_launch(dist.launched_engine(), processes)


def test_a_deepspeed_launch_without_deepspeed_says_how_to_install_it(launch_env, monkeypatch):
    monkeypatch.setattr(dist, "find_spec", lambda name: None)
    launch_env(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="2")
    with pytest.raises(dist.UserError, match=re.escape("pip install 'alignment-toolkit[deepspeed]'")):
        dist.check_launch("zero2", 2)
    launch_env(ACCELERATE_MIXED_PRECISION="no")
    dist.check_launch(None, 2)  # plain DDP in fp32: nothing to refuse


def test_shared_output_dir_passes_and_leaves_nothing_behind(tmp_path):
    dist.check_shared_folder(tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_process_that_cannot_see_rank_zeros_file_stops_with_the_folder_and_host(tmp_path, monkeypatch):
    """As a process on a second machine with its own local output_dir: rank 0's token never arrives there."""
    monkeypatch.setattr(dist, "is_main_process", lambda: False)
    with pytest.raises(
        dist.UserError,
        match=re.escape(
            f"output_dir '{tmp_path}' is not shared by all processes: rank 0 on {dist.socket.gethostname()} cannot see"
        ),
    ):
        dist.check_shared_folder(tmp_path)


def test_full_weights_loads_whole_models_under_a_zero3_config(monkeypatch):
    """Inside `full_weights`, transformers sees no ZeRO-3 config (so no zero.Init) and no FSDP rank-0-only
    loading; outside, both are back."""
    from transformers.integrations import deepspeed as hf_deepspeed

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")

    class Zero3Config:  # what transformers registers for a ZeRO-3 run (its HfDeepSpeedConfig needs deepspeed)
        def is_zero3(self):
            return True

    config = Zero3Config()
    hf_deepspeed.set_hf_deepspeed_config(config)
    try:
        assert hf_deepspeed.is_deepspeed_zero3_enabled() and dist.loads_partitioned()
        with dist.full_weights():
            assert not hf_deepspeed.is_deepspeed_zero3_enabled() and not dist.loads_partitioned()
            assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"
        assert hf_deepspeed.is_deepspeed_zero3_enabled() and os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()
        del config


@pytest.mark.parametrize("key", ["deepspeed", "fsdp"])
def test_a_recipe_cannot_choose_an_engine_per_stage(tmp_path, key):
    """TrainingArguments would take `deepspeed`/`fsdp` per stage; the launch's accelerate config chooses it."""
    from conftest import SMALLEST_MODEL, write_recipe

    from alignment.config.recipe import load_recipe
    from alignment.run.runner import check_recipe

    stage = {"data": {"task": "arithmetic", "n": 8}, "train": {key: "configs/accelerate/zero3_cpu.json"}}
    recipe = load_recipe(
        write_recipe(
            tmp_path,
            {"name": "x", "model": SMALLEST_MODEL, "output_dir": str(tmp_path / "o"), "stages": {"sft": stage}},
        )
    )
    with pytest.raises(
        dist.UserError,
        match=rf"stages.sft.train.{key}: the engine .* is chosen by the accelerate "
        r"config of the launch",
    ):
        check_recipe(recipe)


def test_a_zero3_launch_that_cannot_gather_weights_for_saving_stops(launch_env, monkeypatch):
    monkeypatch.setattr(dist, "find_spec", lambda name: object())
    launch_env(
        ACCELERATE_USE_DEEPSPEED="true",
        ACCELERATE_DEEPSPEED_ZERO_STAGE="3",
        ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL="false",
    )
    with pytest.raises(dist.UserError, match="set zero3_save_16bit_model: true"):
        dist.check_launch("zero3", 2)


def test_shipped_accelerate_configs_load_and_the_cpu_ones_really_shard_in_fp32():
    import json as json_module

    from accelerate.commands.config.config_args import load_config_from_file
    from conftest import REPO

    folder = REPO / "configs" / "accelerate"
    configs = {p.stem: load_config_from_file(str(p)) for p in sorted(folder.glob("*.yaml"))}
    assert {"fsdp2", "zero2", "zero3", "fsdp2_cpu", "zero2_cpu", "zero3_cpu"} <= set(configs)
    for name in ("fsdp2_cpu", "zero2_cpu", "zero3_cpu"):
        assert configs[name].num_processes == 2 and configs[name].mixed_precision in ("no", None), name
    assert configs["fsdp2_cpu"].fsdp_config["fsdp_version"] == 2
    zero3 = json_module.loads((REPO / configs["zero3_cpu"].deepspeed_config["deepspeed_config_file"]).read_text())
    assert zero3["zero_optimization"]["stage3_param_persistence_threshold"] == 0  # tiny models really partitioned
    assert zero3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert configs["zero3"].deepspeed_config["zero3_save_16bit_model"] is True


def test_a_few_dropped_rows_are_a_note_and_more_are_a_warning(caplog):
    log = dist.get_logger("alignment.test")
    caplog.set_level(logging.INFO, logger="alignment")
    dist.log_share(log, 5, 100, "five of a hundred")  # at LOUD_SHARE: routine
    dist.log_share(log, 6, 100, "six of a hundred")  # above it
    levels = {r.getMessage(): r.levelno for r in caplog.records}
    assert levels == {"five of a hundred": logging.INFO, "six of a hundred": logging.WARNING}
