"""The bad-input catalogue: each case must exit 2 with one paragraph naming the culprit, print no
traceback, and leave the output folder (with an earlier finished stage in it) untouched.

Cases run the CLI in-process (`alignment.cli.main`) to keep the catalogue fast; a few are also run
as real subprocesses in tests/test_recipe.py. Each case is (id, setup, argv, expected fragments):
`setup(tmp)` writes whatever files the case needs and returns a dict of paths for the argv template.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from conftest import SMALLEST_MODEL

from alignment.cli import main

SFT_DATA = {"task": "arithmetic", "n": 20}


def recipe(tmp: Path, stages=None, **top) -> dict:
    return {
        "name": "bad",
        "model": SMALLEST_MODEL,
        "output_dir": str(tmp / "out"),
        "seed": 0,
        "stages": stages if stages is not None else {"sft": {"data": SFT_DATA}},
        **top,
    }


def put(tmp: Path, name: str, content) -> Path:
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, (dict, list)):
        content = yaml.safe_dump(content, sort_keys=False)
    path.write_text(content)
    return path


def put_bytes(tmp: Path, name: str, content: bytes) -> Path:
    path = tmp / name
    path.write_bytes(content)
    return path


def truncated_parquet(tmp: Path, name: str) -> Path:
    import pyarrow
    import pyarrow.parquet

    path = tmp / name
    pyarrow.parquet.write_table(pyarrow.table({"prompt": ["q"] * 50, "completion": ["a"] * 50}), path)
    return put_bytes(tmp, name, path.read_bytes()[: path.stat().st_size // 2])


def split_folder(tmp: Path, **contents: str) -> Path:
    """A folder with one .jsonl file per split (train and test unless given)."""
    row = '{"prompt": "q", "completion": "a"}\n'
    for split, text in {"train": row, "test": row, **contents}.items():
        put(tmp, f"splits/{split}.jsonl", text)
    return tmp / "splits"


def jsonl(tmp: Path, name: str, rows: list[dict]) -> Path:
    return put(tmp, name, "".join(json.dumps(r) + "\n" for r in rows))


def with_recipe(build):
    """A setup that writes the recipe `build(tmp)` returns as r.yaml."""
    return lambda tmp: {"recipe": put(tmp, "r.yaml", build(tmp))}


def sft_on(rows_or_path, **data):
    def build(tmp):
        path = rows_or_path(tmp) if callable(rows_or_path) else jsonl(tmp, "d.jsonl", rows_or_path)
        return recipe(tmp, {"sft": {"data": {"dataset": str(path), **data}, "train": {"max_length": 64}}})

    return with_recipe(build)


def model_dir_without_chat_template(tmp: Path) -> Path:
    from alignment.config.model import TinySpec
    from alignment.models.tiny import build_tiny_model

    path = build_tiny_model(TinySpec(**SMALLEST_MODEL["tiny"]), 0, tmp / "plain-model")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


def chat_without_template(tmp):
    model = model_dir_without_chat_template(tmp)
    data = jsonl(
        tmp, "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    )
    return recipe(tmp, {"sft": {"data": {"dataset": str(data)}}}, model=str(model))


def verifier_module(tmp, body: str, name="badverif.py"):
    put(tmp, name, body)


def eval_suite(verifier: str, **extra):
    return {
        "suites": [
            {"name": "s", "data": {"task": "arithmetic", "split": "test", "n": 5}, "verifier": verifier, **extra}
        ]
    }


CHECK = ["check", "{recipe}"]
RUN = ["run", "{recipe}"]

CASES = [
    # --- recipe files ---
    (
        "yaml-syntax",
        lambda t: {"recipe": put(t, "r.yaml", "name: x\nstages:\n  sft: {data: [\n")},
        CHECK,
        ["YAML syntax error at line"],
    ),
    ("recipe-not-mapping", lambda t: {"recipe": put(t, "r.yaml", "- a\n- b\n")}, CHECK, ["a recipe is a YAML mapping"]),
    ("recipe-missing", lambda t: {"recipe": t / "nope.yaml"}, CHECK, ["nope.yaml' does not exist"]),
    (
        "unknown-top-key",
        with_recipe(lambda t: {**recipe(t), "sed": 1}),
        CHECK,
        ["unknown key 'sed'", "did you mean 'seed'"],
    ),
    (
        "unknown-stage-key",
        with_recipe(lambda t: recipe(t, {"sft": {"data": SFT_DATA, "trainn": {}}})),
        CHECK,
        ["stages.sft.trainn", "did you mean 'train'"],
    ),
    ("wrong-type", with_recipe(lambda t: recipe(t, seed="abc")), CHECK, ["'seed'", "valid integer"]),
    (
        "missing-name",
        with_recipe(lambda t: {k: v for k, v in recipe(t).items() if k != "name"}),
        CHECK,
        ["missing required key 'name'"],
    ),
    ("stages-not-mapping", with_recipe(lambda t: recipe(t, ["sft"])), CHECK, ["'stages'"]),
    ("stage-not-mapping", with_recipe(lambda t: recipe(t, {"sft": 3})), CHECK, ["'stages.sft' must be a mapping"]),
    (
        "unknown-kind",
        with_recipe(lambda t: recipe(t, {"x": {"kind": "sfd", "data": SFT_DATA}})),
        CHECK,
        ["unknown stage kind 'sfd'", "available kinds"],
    ),
    (
        "undefined-ref",
        with_recipe(lambda t: recipe(t, {"sft": {"model": "${base}", "data": SFT_DATA}})),
        CHECK,
        ["'${base}'", "not a stage"],
    ),
    (
        "forward-ref",
        with_recipe(
            lambda t: recipe(
                t, {"a": {"kind": "sft", "model": "${b}", "data": SFT_DATA}, "b": {"kind": "sft", "data": SFT_DATA}}
            )
        ),
        CHECK,
        ["runs later"],
    ),
    (
        "reference-cycle",
        with_recipe(
            lambda t: recipe(
                t,
                {
                    "a": {"kind": "sft", "model": "${b}", "data": SFT_DATA},
                    "b": {"kind": "sft", "model": "${a}", "data": SFT_DATA},
                },
            )
        ),
        CHECK,
        ["reference cycle (a -> b -> a)"],
    ),
    (
        "self-reference",
        with_recipe(lambda t: recipe(t, {"a": {"kind": "sft", "model": "${a}", "data": SFT_DATA}})),
        CHECK,
        ["reference cycle (a -> a)"],
    ),
    (
        "duplicate-stage",
        lambda t: {"recipe": put(t, "r.yaml", "name: x\nmodel: m\nstages:\n  sft: {}\n  sft: {}\n")},
        CHECK,
        ["duplicate key 'sft' at line 5 (first at line 4)"],
    ),
    (
        "duplicate-top-key",
        lambda t: {"recipe": put(t, "r.yaml", "name: x\nseed: 1\nmodel: m\nseed: 2\nstages: {}\n")},
        CHECK,
        ["duplicate key 'seed' at line 4 (first at line 2)"],
    ),
    (
        "duplicate-train-knob",
        lambda t: {
            "recipe": put(
                t,
                "r.yaml",
                "name: x\nmodel: m\nstages:\n  sft:\n    train:\n"
                "      learning_rate: 1.0e-4\n      max_length: 64\n"
                "      learning_rate: 2.0e-4\n",
            )
        },
        CHECK,
        ["duplicate key 'learning_rate' at line 8 (first at line 6)"],
    ),
    (
        "duplicate-key-flow-style",
        lambda t: {
            "recipe": put(t, "r.yaml", "name: x\nmodel: m\nstages:\n  sft: {data: {task: arithmetic, n: 5, n: 6}}\n")
        },
        CHECK,
        ["duplicate key 'n' at line 4, column 40 (first at line 4, column 34)"],
    ),
    (
        "duplicate-key-in-list-item",
        lambda t: {
            "recipe": put(
                t,
                "r.yaml",
                "name: x\nmodel: m\nstages: {}\nevaluate:\n"
                "  suites:\n    - name: a\n      verifier: numeric\n"
                "    - name: b\n      verifier: numeric\n"
                "      name: c\n",
            )
        },
        CHECK,
        ["duplicate key 'name' at line 10 (first at line 8)"],
    ),
    (
        "bad-interpolation",
        with_recipe(lambda t: recipe(t, output_dir="${nowhere}/x")),
        CHECK,
        ["cannot resolve interpolation", "nowhere"],
    ),
    (
        "bad-override-syntax",
        with_recipe(recipe),
        ["check", "{recipe}", "stages.sft.train"],
        ["bad override 'stages.sft.train'"],
    ),
    (
        "override-unknown-key",
        with_recipe(recipe),
        ["check", "{recipe}", "stages.sft.trian.x=1"],
        ["stages.sft.trian", "did you mean 'train'"],
    ),
    (
        "unknown-trl-knob",
        with_recipe(lambda t: recipe(t, {"sft": {"data": SFT_DATA, "train": {"num_epochs": 1}}})),
        CHECK,
        ["unknown SFTConfig option 'num_epochs'", "num_train_epochs"],
    ),
    (
        "rejected-trl-value",
        with_recipe(lambda t: recipe(t, {"sft": {"data": SFT_DATA, "train": {"lr_scheduler_type": "bogus"}}})),
        CHECK,
        ["stages.sft.train: SFTConfig rejected the settings", "bogus"],
    ),
    ("bad-lora-value", with_recipe(lambda t: recipe(t, lora={"r": -1})), CHECK, ["'lora.r'", "greater than 0"]),
    (
        "lora-targets-missing",
        with_recipe(lambda t: recipe(t, lora={"target_modules": ["foo_proj"]})),
        CHECK,
        ["stages.sft.lora", "foo_proj", "not found"],
    ),
    (
        "output-dir-not-writable",
        with_recipe(lambda t: recipe(t, output_dir=str(put(t, "afile", "x") / "sub"))),
        CHECK,
        ["output_dir", "is not writable"],
    ),
    (
        "only-unknown-stage",
        with_recipe(recipe),
        ["run", "{recipe}", "--only", "sfd"],
        ["no stage 'sfd'", "did you mean 'sft'"],
    ),
    ("from-unknown-stage", with_recipe(recipe), ["run", "{recipe}", "--from", "dpo"], ["no stage 'dpo'"]),
    # --- models ---
    (
        "missing-model-path",
        with_recipe(lambda t: recipe(t, model="./no/such/model")),
        CHECK,
        ["model path './no/such/model' does not exist"],
    ),
    (
        "hub-id-offline",
        with_recipe(lambda t: recipe(t, model="nobody-xyz/not-a-model")),
        CHECK,
        ["'nobody-xyz/not-a-model'", "Without network access"],
    ),
    (
        "model-dir-not-a-model",
        with_recipe(lambda t: recipe(t, model=str((t / "empty").mkdir() or t / "empty"))),
        CHECK,
        ["is not a model folder"],
    ),
    ("chat-data-no-template", with_recipe(chat_without_template), CHECK, ["no chat template"]),
    (
        "merge-missing-source",
        lambda t: {},
        ["merge", "/no/such/adapter", "/tmp/x"],
        ["'/no/such/adapter' does not exist"],
    ),
    # --- data ---
    ("missing-data-file", sft_on(lambda t: t / "absent.jsonl"), CHECK, ["absent.jsonl' does not exist"]),
    ("unsupported-file-type", sft_on(lambda t: put(t, "d.txt", "hello")), CHECK, ["not a supported file type"]),
    ("folder-without-data", sft_on(lambda t: (t / "emptydir").mkdir() or t / "emptydir"), CHECK, ["holds no", "files"]),
    (
        "missing-column",
        sft_on([{"question": "q", "completion": "a"}]),
        CHECK,
        ["missing column(s) 'prompt'", "Columns present: question, completion"],
    ),
    (
        "rename-missing-column",
        sft_on([{"prompt": "q", "completion": "a"}], rename={"answer": "completion"}),
        CHECK,
        ["rename: column 'answer' does not exist"],
    ),
    ("empty-dataset", sft_on(lambda t: put(t, "empty.jsonl", "")), CHECK, ["empty.jsonl"]),
    (
        "non-string-values",
        sft_on([{"prompt": "q", "completion": 5}]),
        CHECK,
        ["line 1 of", "d.jsonl, column 'completion' is int"],
    ),
    (
        "all-rows-filtered",
        sft_on([{"prompt": "q", "completion": " "}, {"prompt": "r", "completion": ""}]),
        CHECK,
        ["all 2 rows were filtered out", "empty"],
    ),
    (
        "prompts-too-long",
        sft_on([{"prompt": "x" * 200, "completion": "a"}]),
        CHECK,
        ["every prompt is at least max_length=64 tokens"],
    ),
    (
        "chat-without-assistant-turn",
        sft_on([{"messages": [{"role": "user", "content": "hi"}]}]),
        CHECK,
        ["must end with an assistant turn"],
    ),
    # --- malformed data files: each names the file and the line as written ---
    (
        "jsonl-not-utf8",
        sft_on(
            lambda t: put_bytes(
                t, "d.jsonl", b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n'
            )
        ),
        CHECK,
        ["d.jsonl', line 2: byte 0xe9 at column 16 is not UTF-8"],
    ),
    (
        "csv-not-utf8",
        sft_on(lambda t: put_bytes(t, "d.csv", b"prompt,completion\na,b\ncaf\xe9,b\n")),
        CHECK,
        ["d.csv', line 3: byte 0xe9", "not UTF-8"],
    ),
    (
        "jsonl-broken-line",
        sft_on(lambda t: put(t, "d.jsonl", '{"prompt": "a", "completion": "b"}\n{"prompt": "c", "completion": "d"\n')),
        CHECK,
        ["d.jsonl', line 2: not valid JSON"],
    ),
    (
        "jsonl-line-not-object",
        sft_on(lambda t: put(t, "d.jsonl", '{"prompt": "a", "completion": "b"}\n\n[1, 2]\n')),
        CHECK,
        ["d.jsonl', line 3: a JSON list, not an object"],
    ),
    (
        "csv-ragged-first-row",
        sft_on(lambda t: put(t, "d.csv", "prompt,completion\na,b,c\nd,e\n")),
        CHECK,
        ["d.csv', line 2: 3 fields, but the header (line 1) names 2"],
    ),
    (
        "csv-ragged-later-row",
        sft_on(lambda t: put(t, "d.csv", 'prompt,completion\n"a\nb",c\nd,e,f\n')),
        CHECK,
        ["d.csv', line 4: 3 fields"],
    ),
    (
        "csv-missing-field",
        sft_on(lambda t: put(t, "d.csv", "prompt,completion\na,b\nc\n")),
        CHECK,
        ["line 3 of", "d.csv, column 'completion' is NoneType"],
    ),
    ("csv-header-only", sft_on(lambda t: put(t, "d.csv", "prompt,completion\n")), CHECK, ["d.csv' holds no rows"]),
    ("jsonl-blank-lines-only", sft_on(lambda t: put(t, "d.jsonl", "\n\n")), CHECK, ["d.jsonl' holds no rows"]),
    (
        "parquet-truncated",
        sft_on(lambda t: truncated_parquet(t, "d.parquet")),
        CHECK,
        ["d.parquet' is not a readable parquet file"],
    ),
    (
        "int-among-strings",
        sft_on([{"prompt": "q", "completion": "a"}, {"prompt": "r", "completion": 7}]),
        CHECK,
        ["line 2 of", "d.jsonl, column 'completion' is int 7"],
    ),
    (
        "unknown-chat-role",
        sft_on([{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}]),
        CHECK,
        ["line 1 of", "chat role 'bot'", "is not one chat templates know"],
    ),
    (
        "messages-not-a-list",
        sft_on([{"messages": "hello"}]),
        CHECK,
        ["line 1 of", "column 'messages': expected a list of chat messages, got str"],
    ),
    (
        "message-without-content",
        sft_on([{"messages": [{"role": "user", "text": "hi"}]}]),
        CHECK,
        ["line 1 of", "a chat message is not {'role': str, 'content': str}"],
    ),
    (
        "pair-unknown-chat-role",
        with_recipe(
            lambda t: recipe(
                t,
                {
                    "rm": {
                        "kind": "reward",
                        "data": {
                            "dataset": str(
                                jsonl(
                                    t,
                                    "p.jsonl",
                                    [
                                        {
                                            "chosen": [
                                                {"role": "user", "content": "q"},
                                                {"role": "bot", "content": "a"},
                                            ],
                                            "rejected": [
                                                {"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "b"},
                                            ],
                                        }
                                    ],
                                )
                            )
                        },
                    }
                },
            )
        ),
        CHECK,
        ["line 1 of", "p.jsonl, column 'chosen': chat role 'bot'"],
    ),
    (
        "empty-split-file",
        with_recipe(
            lambda t: recipe(t, {"sft": {"data": {"dataset": str(split_folder(t, test="")), "split": "test"}}})
        ),
        CHECK,
        ["test.jsonl' is empty"],
    ),
    (
        "hh-without-final-assistant-turn",
        with_recipe(
            lambda t: recipe(
                t,
                {
                    "rm": {
                        "kind": "reward",
                        "data": {
                            "dataset": str(
                                jsonl(
                                    t,
                                    "hh.jsonl",
                                    [
                                        {
                                            "chosen": "\n\nHuman: Hi?\n\nAssistant: Hello.",
                                            "rejected": "\n\nHuman: Hi?\n\nAssistant: Go away.\n\nHuman: Rude.",
                                        }
                                    ],
                                )
                            )
                        },
                    }
                },
            )
        ),
        CHECK,
        ["line 1 of", "column 'rejected' is not an Anthropic HH transcript", "no Assistant turn"],
    ),
    (
        "hh-prefixes-differ",
        with_recipe(
            lambda t: recipe(
                t,
                {
                    "rm": {
                        "kind": "reward",
                        "data": {
                            "format": "hh",
                            "dataset": str(
                                jsonl(
                                    t,
                                    "hh.jsonl",
                                    [
                                        {
                                            "chosen": "\n\nHuman: Hi?\n\nAssistant: Hello.",
                                            "rejected": "\n\nHuman: Hey?\n\nAssistant: Go away.",
                                        }
                                    ],
                                )
                            ),
                        },
                    }
                },
            )
        ),
        CHECK,
        ["line 1 of", "'chosen' and 'rejected' differ at turn 1"],
    ),
    (
        "hh-format-on-a-stage-without-pairs",
        sft_on([{"prompt": "q", "completion": "a"}], format="hh"),
        CHECK,
        ["stages.sft.data: `format: hh` reads Anthropic HH-RLHF preference transcripts", "a sft stage reads no pairs"],
    ),
    (
        "unknown-data-format",
        sft_on([{"prompt": "q", "completion": "a"}], format="HH"),
        CHECK,
        ["unknown format 'HH'", "did you mean 'hh'"],
    ),
    # --- split and config of local data ---
    (
        "split-on-single-file",
        sft_on([{"prompt": "q", "completion": "a"}], split="train_sft"),
        CHECK,
        ["stages.sft.data.split: 'train_sft' cannot apply to the single file", "d.jsonl"],
    ),
    (
        "config-on-local-file",
        sft_on([{"prompt": "q", "completion": "a"}], config="default"),
        CHECK,
        ["stages.sft.data.config: 'default' cannot apply to the local file", "d.jsonl"],
    ),
    (
        "folder-without-the-split",
        with_recipe(lambda t: recipe(t, {"sft": {"data": {"dataset": str(split_folder(t)), "split": "tset"}}})),
        CHECK,
        ["holds no split 'tset'", "did you mean 'test'"],
    ),
    (
        "unknown-task",
        with_recipe(lambda t: recipe(t, {"sft": {"data": {"task": "algebra"}}})),
        CHECK,
        ["Unknown task 'algebra'", "arithmetic"],
    ),
    (
        "bad-task-param",
        with_recipe(lambda t: recipe(t, {"sft": {"data": {"task": "arithmetic", "n": 0}}})),
        CHECK,
        ["task arithmetic.n", "greater than 0"],
    ),
    (
        "no-data-source",
        with_recipe(lambda t: recipe(t, {"sft": {"data": {"split": "train"}}})),
        CHECK,
        ["exactly one of 'dataset'"],
    ),
    # --- verifiers and evaluation ---
    (
        "unknown-verifier",
        with_recipe(lambda t: recipe(t, evaluate=eval_suite("arithmetc"))),
        CHECK,
        ["Unknown verifier 'arithmetc'", "arithmetic"],
    ),
    (
        "verifier-import-error",
        with_recipe(
            lambda t: verifier_module(t, "import not_a_module\n") or recipe(t, evaluate=eval_suite("badverif:check"))
        ),
        CHECK,
        ["badverif", "not_a_module"],
    ),
    (
        "verifier-missing-function",
        with_recipe(
            lambda t: (
                verifier_module(t, "def other(c): return 1.0\n") or recipe(t, evaluate=eval_suite("badverif:check"))
            )
        ),
        CHECK,
        ["badverif", "check"],
    ),
    (
        "verifier-unknown-option",
        with_recipe(lambda t: recipe(t, evaluate=eval_suite("numeric", verifier_options={"bogus": 1}))),
        CHECK,
        ["bogus"],
    ),
    (
        "evaluate-unknown-stage",
        with_recipe(lambda t: recipe(t, evaluate={"after": ["sfd"], **eval_suite("arithmetic")})),
        CHECK,
        ["evaluate.after names 'sfd'"],
    ),
    # --- the command line itself (typer/click usage errors) ---
    ("unknown-command", lambda t: {}, ["trian", "r.yaml"], ["No such command 'trian'"]),
    ("run-without-recipe", lambda t: {}, ["run"], ["Missing argument 'recipe'"]),
    ("unknown-option", with_recipe(recipe), ["run", "{recipe}", "--forse"], ["No such option: --forse"]),
    ("option-missing-value", with_recipe(recipe), ["run", "{recipe}", "--only"], ["'--only' requires an argument"]),
    ("option-bad-type", with_recipe(recipe), ["run", "{recipe}", "--jobs", "x"], ["'--jobs'", "valid integer"]),
    (
        "option-out-of-range",
        with_recipe(recipe),
        ["run", "{recipe}", "--jobs", "0"],
        ["'--jobs'", "greater than or equal to 1"],
    ),
    (
        "flag-given-a-value",
        with_recipe(recipe),
        ["run", "{recipe}", "--force=yes"],
        ["'--force' does not take a value"],
    ),
    ("eval-without-checkpoint", lambda t: {}, ["eval", "--suite", "arithmetic"], ["Missing argument 'checkpoints'"]),
    ("eval-without-suite", lambda t: {}, ["eval", "some/ckpt"], ["Missing option '--suite'"]),
    (
        "eval-negative-temperature",
        lambda t: {},
        ["eval", "some/ckpt", "--suite", "arithmetic", "--temperature", "-0.5"],
        ["'--temperature'", "greater than or equal to 0"],
    ),
    (
        "eval-negative-max-new-tokens",
        lambda t: {},
        ["eval", "some/ckpt", "--suite", "arithmetic", "--max-new-tokens", "-8"],
        ["'--max-new-tokens'", "greater than or equal to 1"],
    ),
    (
        "eval-zero-max-new-tokens",
        lambda t: {},
        ["eval", "some/ckpt", "--suite", "arithmetic", "--max-new-tokens", "0"],
        ["'--max-new-tokens'", "greater than or equal to 1"],
    ),
    (
        "verify-without-verifier",
        lambda t: {"data": jsonl(t, "c.jsonl", [{"completion": "1"}])},
        ["verify", "--data", "{data}"],
        ["Missing option '--verifier'"],
    ),
    (
        "verify-where-matches-nothing",
        lambda t: {"data": jsonl(t, "c.jsonl", [{"completion": "1", "answer": "1", "mode": "main"}])},
        ["verify", "--verifier", "numeric", "--data", "{data}", "--where", "mode=pass_k"],
        ["no row has mode=pass_k", "'mode' holds main"],
    ),
    (
        "verify-where-without-value",
        lambda t: {"data": jsonl(t, "c.jsonl", [{"completion": "1", "answer": "1"}])},
        ["verify", "--verifier", "numeric", "--data", "{data}", "--where", "main"],
        ["bad --where 'main'"],
    ),
    (
        "verify-file-missing-column",
        lambda t: {"data": jsonl(t, "c.jsonl", [{"text": "1", "answer": "1"}])},
        ["verify", "--verifier", "numeric", "--data", "{data}"],
        ["column 'completion' is missing", "text"],
    ),
]


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("case_id, setup, argv, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_clearly(tmp_path, capsys, case_id, setup, argv, expected):
    earlier = tmp_path / "out" / "earlier"
    earlier.mkdir(parents=True)
    (earlier / "model.safetensors").write_bytes(b"weights")
    (earlier / "stage.json").write_text('{"kind": "sft"}')
    before = snapshot(tmp_path / "out")
    paths = setup(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main([a.format(**{k: str(v) for k, v in paths.items()}) for a in argv])
    err = capsys.readouterr().err
    message = err.strip().splitlines()[-1] if err.strip() else ""
    assert exited.value.code == 2, err
    assert "Traceback" not in err
    assert message.startswith("error: "), err
    for fragment in expected:
        assert fragment in message, f"{case_id}: {fragment!r} not in {message!r}"
    after = snapshot(tmp_path / "out")
    assert {k: v for k, v in after.items() if k.startswith("earlier")} == before, "earlier output damaged"


def test_case_ids_are_unique():
    ids = [case[0] for case in CASES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


USAGE_CASES = {
    case[0]: case
    for case in CASES
    if case[0] in {"unknown-command", "run-without-recipe", "option-missing-value", "eval-without-suite"}
}


@pytest.mark.parametrize("case_id, setup, argv, expected", USAGE_CASES.values(), ids=USAGE_CASES.keys())
def test_usage_error_shows_the_command_usage(tmp_path, capsys, case_id, setup, argv, expected):
    paths = setup(tmp_path)
    with pytest.raises(SystemExit):
        main([a.format(**{k: str(v) for k, v in paths.items()}) for a in argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    command = argv[0] if argv[0] in {"run", "eval"} else ""
    assert lines[0].startswith(f"Usage: align {command}".rstrip()), lines
    assert "--help" in lines[0]
