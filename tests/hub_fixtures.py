"""A few rows of each hub dataset the shipped recipes (recipes/qwen2.5-0.5b/) train and evaluate on, laid out as
the hub holds them: the same columns and value types (from each dataset card), one JSONL file per split named by
the split, in a folder per dataset.

    folder = write_hub_fixtures(tmp_path)     # folder / "HuggingFaceH4/ultrachat_200k" / "train_sft.jsonl", ...
"""

from __future__ import annotations

import json
from pathlib import Path


def chat(*turns: str) -> list[dict]:
    """Alternating user/assistant messages."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(turns)]


def ultrachat(split: str) -> list[dict]:
    """HuggingFaceH4/ultrachat_200k: prompt (the first user turn), prompt_id, messages (multi-turn)."""
    conversations = [
        chat("What is the capital of France?", "Paris.", "And of Italy?", "Rome.", "Thanks!", "You're welcome."),
        chat("Name a prime number.", "Seven is prime.", "Is 9 prime?", "No: 9 = 3 x 3."),
        chat("Say hello in Spanish.", "Hola."),
        chat("Give me a colour.", "Blue.", "Another one?", "Green."),
    ]
    return [
        {"prompt": c[0]["content"], "prompt_id": f"{split}-{i:04x}", "messages": c} for i, c in enumerate(conversations)
    ]


def ultrafeedback(split: str) -> list[dict]:
    """HuggingFaceH4/ultrafeedback_binarized: prompt, prompt_id, chosen and rejected (the whole conversation as
    messages, the last turn the answer), messages (the chosen conversation), score_chosen, score_rejected."""
    rows = []
    for i, (question, good, bad) in enumerate(
        [
            ("What is 2+2?", "2+2 is 4.", "It is 5."),
            ("Name a fruit.", "An apple.", "A chair."),
            ("Capital of Spain?", "Madrid.", "Paris."),
            ("Opposite of hot?", "Cold.", "Warm, sort of."),
        ]
    ):
        chosen, rejected = chat(question, good), chat(question, bad)
        rows.append(
            {
                "prompt": question,
                "prompt_id": f"{split}-{i:04x}",
                "chosen": chosen,
                "rejected": rejected,
                "messages": chosen,
                "score_chosen": 8.0,
                "score_rejected": 3.5,
            }
        )
    return rows


def gsm8k(split: str) -> list[dict]:
    """openai/gsm8k (config main): question, answer (the worked solution, then "#### <number>")."""
    return [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
        }
        for a, b in [(3, 4), (10, 5), (7, 8), (2, 9)]
    ]


def math_lighteval(split: str) -> list[dict]:
    """DigitalLearningGmbH/MATH-lighteval: problem, level, type, solution (the answer in \\boxed{})."""
    return [
        {
            "problem": f"What is ${a} \\cdot {b}$?",
            "level": "Level 1",
            "type": "Prealgebra",
            "solution": f"We have ${a} \\cdot {b} = \\boxed{{{a * b}}}$.",
        }
        for a, b in [(2, 3), (4, 5), (6, 7), (8, 9)]
    ]


def math500(split: str) -> list[dict]:
    """HuggingFaceH4/MATH-500 (split test): problem, solution, answer, subject, level (an int), unique_id."""
    return [
        {
            "problem": f"Compute ${a}+{b}$.",
            "solution": f"${a}+{b} = \\boxed{{{a + b}}}$.",
            "answer": str(a + b),
            "subject": "Prealgebra",
            "level": 1,
            "unique_id": f"test/prealgebra/{i}.json",
        }
        for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 6), (7, 8)])
    ]


def mbpp(split: str) -> list[dict]:
    """google-research-datasets/mbpp (config full): task_id, text, code, test_list, test_setup_code,
    challenge_test_list."""
    tasks = [
        ("Write a function to add two numbers.", "def add(a, b):\n    return a + b", "add(1, 2) == 3"),
        ("Write a function to square a number.", "def square(x):\n    return x * x", "square(3) == 9"),
        ("Write a function to negate a number.", "def neg(x):\n    return -x", "neg(4) == -4"),
        ("Write a function to double a number.", "def double(x):\n    return 2 * x", "double(5) == 10"),
    ]
    return [
        {
            "task_id": 600 + i,
            "text": text,
            "code": code,
            "test_list": [f"assert {test}"],
            "test_setup_code": "",
            "challenge_test_list": [],
        }
        for i, (text, code, test) in enumerate(tasks)
    ]


# hub id -> (rows for a split, the splits the hub has)
DATASETS = {
    "HuggingFaceH4/ultrachat_200k": (ultrachat, ["train_sft", "test_sft", "train_gen", "test_gen"]),
    "HuggingFaceH4/ultrafeedback_binarized": (ultrafeedback, ["train_prefs", "test_prefs", "train_gen", "test_gen"]),
    "openai/gsm8k": (gsm8k, ["train", "test"]),
    "DigitalLearningGmbH/MATH-lighteval": (math_lighteval, ["train", "test"]),
    "HuggingFaceH4/MATH-500": (math500, ["test"]),
    "google-research-datasets/mbpp": (mbpp, ["train", "test", "validation", "prompt"]),
}


def write_hub_fixtures(folder: Path) -> Path:
    """Every dataset of DATASETS under `folder`/<hub id>/<split>.jsonl; returns `folder`."""
    for name, (rows, splits) in DATASETS.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        for split in splits:
            (folder / name / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(split)))
    return folder
