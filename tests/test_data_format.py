"""What each stage records about its data (stage.json's `data_format`, the model card's "Data format" lines): the
format detected, the columns used and ignored, what was trained on. End to end for every hub layout in
tests/test_hub_recipes.py; here the layouts those recipes do not cover."""

from __future__ import annotations

import json
from types import SimpleNamespace

import datasets
import pytest
from conftest import SMALLEST_MODEL, write_recipe

from alignment.config.recipe import load_recipe
from alignment.run.model_card import data_format_lines
from alignment.run.runner import run_recipe
from alignment.training.pairs import normalize_pairs, pair_data_format
from alignment.training.prompts import prompt_data_format

CHAT = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


@pytest.mark.parametrize(
    "rows, layout, columns",
    [
        (
            [{"prompt": "2+2?", "chosen": "4", "rejected": "5", "id": 1}],
            "explicit prompt (1 rows)",
            ["prompt", "chosen", "rejected"],
        ),
        ([{"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"}], "implicit prompt (1 rows)", ["chosen", "rejected"]),
        (
            [{"prompt": "2+2?", "chosen": CHAT, "rejected": CHAT[:1] + [{"role": "assistant", "content": "5"}]}],
            "conversational (1 rows)",
            ["chosen", "rejected"],
        ),
        (
            [{"prompt": CHAT[:1], "chosen": "4", "rejected": "5"}],
            "explicit prompt (conversational) (1 rows)",
            ["prompt", "chosen", "rejected"],
        ),
    ],
)
def test_a_preference_stage_records_the_pair_layout_and_the_columns_it_read(rows, layout, columns):
    dataset = datasets.Dataset.from_list(rows)
    pairs, _ = normalize_pairs(dataset, "stages.dpo.data")
    info = pair_data_format(SimpleNamespace(config=SimpleNamespace(kind="dpo")), dataset, pairs)
    assert info["format"] == f"preference pairs: {layout}" and info["columns"] == columns
    assert info["ignored_columns"] == [c for c in dataset.column_names if c not in columns]
    assert ("implicit_prompt" in info) == layout.startswith("implicit")


def test_rl_prompts_from_messages_record_the_reference_answers_dropped():
    rows = [{"messages": CHAT, "answer": "4"}, {"messages": CHAT[:1], "answer": "4"}]
    verifier = SimpleNamespace(required_columns=("answer",))
    info = prompt_data_format(rows, ["messages", "answer"], [verifier])
    assert info["format"] == "prompts from the `messages` column (conversational)"
    assert info["columns"] == ["messages", "answer"] and info["final_assistant_turns_dropped"] == 1


def test_sft_on_text_rows_records_language_modelling_in_stage_json_and_the_model_card(tmp_path):
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i}", "source": "x"}) + "\n" for i in range(4)))
    recipe = load_recipe(
        write_recipe(
            tmp_path,
            {
                "name": "text",
                "model": SMALLEST_MODEL,
                "output_dir": str(tmp_path / "out"),
                "stages": {
                    "sft": {"data": {"dataset": str(data)}, "train": {"max_steps": 1, "per_device_train_batch_size": 2}}
                },
            },
        )
    )
    run_recipe(recipe)
    found = json.loads((recipe.stage_dir("sft") / "stage.json").read_text())["data_format"]
    assert found == {
        "data": {
            "format": "text (language modelling)",
            "columns": ["text"],
            "rows": 4,
            "ignored_columns": ["source"],
            "trained_on": "every token",
        }
    }
    card = (recipe.stage_dir("sft") / "README.md").read_text()
    assert data_format_lines(found)[0] in card
