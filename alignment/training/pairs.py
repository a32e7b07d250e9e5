"""Preference pairs for the `reward` and `dpo` stages.

- `normalize_pairs(dataset, where)`: rows in any usual preference format (explicit prompt, chat message
  lists, implicit shared prompt, Anthropic HH-RLHF transcripts) -> (prompt, chosen, rejected) with the
  answers as plain strings; bad rows dropped and counted, a missing column a UserError.
- `on_policy_pairs(...)`: sample N completions per prompt from the policy (`sampling.generate`),
  grade them with a verifier, pair a verified-correct completion (chosen) with an incorrect or
  unparseable one (rejected). Prompts without both kinds are dropped and counted.

Every stage that renders pairs uses `render_pairs`, so DPO and the reward model see one text, the text
`scoring.score_texts` scores.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from typing import Any

import torch
from accelerate import PartialState

from ..config.sampling import OnPolicySpec
from ..data.formatting import encode_prompt_completion, render_completion, render_prompt
from ..data.loading import check_columns, dataset_rows, file_rows, messages_problem
from ..errors import UserError, row_name
from ..runtime.dist import get_logger
from ..sampling import generate
from ..verifiers import is_pass, resolve
from .prompts import check_prompt_rows, prompt_data_format, prompt_of

log = get_logger(__name__)


PAIR_COLUMNS = [("prompt", "chosen", "rejected"), ("chosen", "rejected")]


# ---------------------------------------------------------------------------------------------------
# Normalising dataset rows


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def _answer(value: Any, column: str, index: int, where: str) -> tuple[list | None, str | None]:
    """(prompt messages before the answer or None, answer text or None when empty) of a chosen/rejected value."""
    if value is None or isinstance(value, str):
        return None, (value if value and value.strip() else None)
    if _is_chat(value):
        if problem := messages_problem(value):
            raise UserError(f"{where}: {row_name(index)}, column '{column}': {problem}.")
        if not value or value[-1].get("role") != "assistant":
            raise UserError(
                f"{where}: {row_name(index)}, column '{column}' is a chat that does not end with an assistant "
                "turn; the last assistant message is the answer being compared."
            )
        content = value[-1].get("content")
        return list(value[:-1]), (content if isinstance(content, str) and content.strip() else None)
    raise UserError(
        f"{where}: {row_name(index)}, column '{column}' is {type(value).__name__} {str(value)[:60]!r}; expected "
        "a string or a list of chat messages ({'role': ..., 'content': ...})."
    )


def _shared_prefix(a: str, b: str) -> str:
    """The shared beginning of two full texts, cut after the last whitespace so no word is split."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    cut = max(a.rfind(" ", 0, n), a.rfind("\n", 0, n))
    return a[: cut + 1] if cut >= 0 else ""


def normalize_row(row: dict, index: int, where: str) -> dict | str:
    """{'prompt', 'chosen', 'rejected'} (answers as strings), or the reason the row is dropped."""
    chosen_context, chosen = _answer(row.get("chosen"), "chosen", index, where)
    rejected_context, rejected = _answer(row.get("rejected"), "rejected", index, where)
    if chosen is None or rejected is None:
        return "empty chosen or rejected"
    prompt = row.get("prompt")
    if chosen_context or rejected_context:  # chat pair that carries its own prompt
        if chosen_context != rejected_context:
            return "chosen and rejected chats differ before the last turn"
        prompt = chosen_context
    elif prompt is None:  # implicit prompt: the shared beginning of two full texts
        if chosen_context is not None:
            return "chat answers without a prompt"
        prompt = _shared_prefix(chosen, rejected)
        chosen, rejected = chosen[len(prompt) :], rejected[len(prompt) :]
        if not prompt.strip():
            return "no shared prompt in the full texts"
        if not chosen.strip() or not rejected.strip():
            return "empty chosen or rejected"
    elif not (isinstance(prompt, str) or _is_chat(prompt)):
        raise UserError(
            f"{where}: {row_name(index)}, column 'prompt' is {type(prompt).__name__}; expected a string or "
            "a list of chat messages."
        )
    elif _is_chat(prompt) and (problem := messages_problem(prompt)):
        raise UserError(f"{where}: {row_name(index)}, column 'prompt': {problem}.")
    if (isinstance(prompt, str) and not prompt.strip()) or (isinstance(prompt, list) and not prompt):
        return "empty prompt"
    if chosen.strip() == rejected.strip():
        return "chosen identical to rejected"
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def normalize_pairs(dataset, where: str, spec=None) -> tuple[list[dict], Counter]:
    """Every row of a preference dataset as {'prompt', 'chosen', 'rejected'}; drops counted by reason.

    Formats: explicit `prompt` + `chosen`/`rejected` strings; chat `chosen`/`rejected` message lists (the
    messages before the last assistant turn are the prompt, as in HuggingFaceH4/ultrafeedback_binarized; with
    only the assistant turn, the `prompt` column is); implicit prompt (`chosen`/`rejected` full texts, the
    prompt is their shared beginning cut at a word boundary); Anthropic HH-RLHF transcripts (`format: hh` on the
    data, or detected and said in the log), read as chat turns, which a malformed transcript makes a UserError
    naming the row. Bad rows (empty answer, chosen == rejected, chat pairs with different prompts, no shared
    prompt) are dropped and counted; a missing column or a wrong type is a UserError, and so is a dataset where
    every row is dropped."""
    check_columns(dataset, PAIR_COLUMNS, where, spec)
    hh = uses_hh(dataset, spec, where)
    pairs, dropped = [], Counter()
    for index, row in zip(file_rows(dataset), dataset_rows(dataset)):
        if hh:
            row = hh_chats(row, index, where)
        result = normalize_row(row, index, where)
        if isinstance(result, str):
            dropped[result] += 1
        else:
            pairs.append(result)
    report_drops(len(pairs), dropped, where, "rows")
    return pairs, dropped


# Anthropic HH-RLHF (Anthropic/hh-rlhf) holds each side of a pair as one transcript,
# "\n\nHuman: ...\n\nAssistant: ...\n\nHuman: ...\n\nAssistant: <answer>". Left as text it would be one user
# turn of the chat template, so the reward model and DPO would see a prompt the samplers never render. Parsed,
# the turns before the last Assistant turn are the prompt (a conversation) and that turn is the answer.
HH_TURN = re.compile(r"\n\n(Human|Assistant):")
HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def looks_like_hh(text: Any) -> bool:
    return isinstance(text, str) and text.lstrip("\n").startswith("Human:") and "\n\nAssistant:" in text


def uses_hh(dataset, spec, where: str) -> bool:
    """Whether the pairs are HH transcripts: `format: hh`, or detected on the first row (said in the log)."""
    if spec is not None and spec.format == "hh":
        return True
    if "prompt" in dataset.column_names or len(dataset) == 0:
        return False
    first = dataset[0]
    if looks_like_hh(first["chosen"]) and looks_like_hh(first["rejected"]):
        log.info(
            f"[{where}] 'chosen' and 'rejected' hold Anthropic HH transcripts (\\n\\nHuman: ... \\n\\nAssistant: "
            "...): each is read as chat turns, the turns before the last Assistant turn being the prompt. Set "
            "`format: hh` on the data to say so."
        )
        return True
    return False


def hh_turns(text: Any, column: str, row: Any, where: str) -> list[dict]:
    """An HH transcript as chat messages; one that is not a Human/Assistant transcript ending with an Assistant
    turn is an error naming the row."""

    def malformed(problem: str) -> UserError:
        return UserError(
            f"{where}: {row_name(row)}, column '{column}' is not an Anthropic HH transcript "
            f"(\\n\\nHuman: ... \\n\\nAssistant: ...): {problem}: {str(text)[:80]!r}."
        )

    if not isinstance(text, str):
        raise malformed(f"it is {type(text).__name__}")
    head, *turns = HH_TURN.split("\n\n" + text.lstrip("\n"))
    if head.strip() or not turns or turns[0] != "Human":
        raise malformed("it does not start with a 'Human:' turn")
    # strip: the space after "Assistant:" and the blank lines around turns are the format's, not the text's
    messages = [{"role": HH_ROLES[role], "content": content.strip()} for role, content in zip(turns[::2], turns[1::2])]
    if messages[-1]["role"] != "assistant":
        raise malformed("it has no Assistant turn after its last Human turn, so there is no answer")
    return messages


def hh_chats(row: dict, index: Any, where: str) -> dict:
    """The row with `chosen` and `rejected` as chats that share every turn but the last."""
    if row.get("prompt") is not None:
        raise UserError(
            f"{where}: {row_name(index)}: `format: hh` takes the prompt from the transcripts in 'chosen' "
            "and 'rejected', but the row also has a 'prompt'; remove one of them."
        )
    chosen, rejected = (hh_turns(row.get(c), c, index, where) for c in ("chosen", "rejected"))
    if chosen[:-1] != rejected[:-1]:
        turn = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
        raise UserError(
            f"{where}: {row_name(index)}: the HH transcripts in 'chosen' and 'rejected' differ at turn "
            f"{turn + 1}, before their last Assistant turn; the turns they share are the prompt, so only "
            "the last Assistant turn may differ."
        )
    return {**row, "chosen": chosen, "rejected": rejected}


def report_drops(kept: int, dropped: Counter, where: str, what: str) -> None:
    """Log the drops; dropping everything is an error naming the reasons."""
    reasons = ", ".join(f"{count} {reason}" for reason, count in dropped.most_common())
    if kept == 0:
        raise UserError(
            f"{where}: no usable preference pairs: all {sum(dropped.values())} {what} were dropped "
            f"({reasons or 'no rows'})."
        )
    if dropped:
        log.info(f"[{where}] dropped {sum(dropped.values())} of {kept + sum(dropped.values())} {what}: {reasons}")


def render_pairs(tokenizer, pairs: list[dict]) -> list[dict]:
    """{'prompt', 'chosen', 'rejected'} as the text the model sees (shared convention, plain strings)."""
    rendered = []
    for pair in pairs:
        prompt = pair["prompt"]
        rendered.append(
            {
                "prompt": render_prompt(tokenizer, prompt),
                "chosen": render_completion(tokenizer, prompt, pair["chosen"]),
                "rejected": render_completion(tokenizer, prompt, pair["rejected"]),
            }
        )
    return rendered


def split_eval(pairs: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) with `fraction` of the pairs (at least one) held out; fraction 0 holds none out."""
    if fraction <= 0 or len(pairs) < 2:
        return pairs, []
    shuffled = list(pairs)
    random.Random(seed).shuffle(shuffled)
    n_eval = max(1, round(len(shuffled) * fraction))
    return shuffled[n_eval:], shuffled[:n_eval]


# ---------------------------------------------------------------------------------------------------
# On-policy pairs graded by a verifier


def pair_samples(texts: list[str], results: list, finished: list[bool], limit: int) -> list[tuple[str, str]]:
    """Up to `limit` (correct, incorrect) text pairs from one prompt's graded samples.

    Correct = the verifier passed it; incorrect = it parsed and failed, or could not be parsed; verifier
    errors are left out. Distinct texts are ranked finished first (ended with the end-of-turn token),
    then most frequent: the most frequent wrong answer is the policy's most confident mistake, the
    one most worth pushing down."""
    count, done, kind = Counter(), {}, {}
    for text, result, end in zip(texts, results, finished):
        if not text.strip() or result.status == "error":
            continue
        count[text] += 1
        done[text] = done.get(text, False) or end
        kind[text] = is_pass(result)
    ranked = sorted(count, key=lambda t: (not done[t], -count[t]))  # stable: first seen wins ties
    good, bad = [t for t in ranked if kind[t]], [t for t in ranked if not kind[t]]
    if not good or not bad:
        return []
    return [(good[k % len(good)], bad[k % len(bad)]) for k in range(min(limit, max(len(good), len(bad))))]


def on_policy_pairs(
    model, tokenizer, rows: list[dict], spec: OnPolicySpec, verifier, where: str
) -> tuple[list[dict], dict]:
    """Sample `spec.n` completions per prompt, grade them, build pairs; returns (pairs, stats).

    A verified-correct completion (chosen) is paired with an incorrect or unparseable one (rejected);
    prompts without both kinds are dropped and counted."""
    prompts = [prompt_of(r) for r in rows]
    samples = generate(
        model, tokenizer, [render_prompt(tokenizer, p) for p in prompts], spec, progress=f"{where} sampling"
    )
    results = verifier.score_batch([s.text for s in samples], [rows[s.prompt_index] for s in samples])
    pairs, no_correct, no_incorrect = [], 0, 0
    for i, prompt in enumerate(prompts):
        chunk = slice(i * spec.n, (i + 1) * spec.n)
        texts, graded, done = [s.text for s in samples[chunk]], results[chunk], [s.finished for s in samples[chunk]]
        built = pair_samples(texts, graded, done, spec.pairs_per_prompt)
        pairs.extend({"prompt": prompt, "chosen": c, "rejected": r} for c, r in built)
        if not built:
            passed = sum(1 for t, g in zip(texts, graded) if t.strip() and is_pass(g))
            no_correct += passed == 0
            no_incorrect += passed > 0
    stats = {
        "pairs_built": len(pairs),
        "prompts_dropped": no_correct + no_incorrect,
        "prompts_sampled": len(prompts),
        "prompts_without_correct": no_correct,
        "prompts_without_incorrect": no_incorrect,
        "sample_pass_rate": sum(is_pass(r) for r in results) / max(len(results), 1),
    }
    log.info(
        f"[{where}] on-policy pairs: {len(pairs)} built from {len(prompts)} prompts x {spec.n} samples "
        f"(pass rate {stats['sample_pass_rate']:.2f}); dropped {stats['prompts_dropped']} prompts "
        f"({no_correct} with no correct sample, {no_incorrect} with no incorrect one)"
    )
    if not pairs:
        raise UserError(
            f"{where}.on_policy: no pairs could be built: {no_correct} prompts had no correct sample and "
            f"{no_incorrect} no incorrect one. Raise on_policy.n or temperature, or use easier/harder prompts."
        )
    return pairs, stats


def cached_on_policy_pairs(ctx, make_model, tokenizer, spec: OnPolicySpec) -> tuple[list[dict], dict]:
    """On-policy pairs for a stage, built once on the main process and kept in the stage's work folder, so
    every process trains on the same pairs and a resumed run does not resample (the file name carries a
    hash of the settings: changed settings resample)."""
    settings = json.dumps(
        [spec.model_dump(mode="json"), ctx.config.data.model_dump(mode="json"), ctx.start_model, ctx.seed],
        sort_keys=True,
    )

    def sample_pairs():
        verifier = resolve(spec.verifier, options=spec.verifier_options, search_dirs=[ctx.recipe.base_dir])
        dataset = ctx.load_data(ctx.config.data, "data")
        check_prompt_rows(dataset, [verifier], f"{ctx.where}.data", ctx.config.data)
        model = make_model().to(PartialState().device)
        torch.manual_seed(ctx.seed)  # the same pairs on a rerun from scratch
        return on_policy_pairs(model, tokenizer, list(dataset_rows(dataset)), spec, verifier, ctx.where)

    return ctx.computed_once(
        f"on_policy_pairs-{hashlib.sha256(settings.encode()).hexdigest()[:12]}.jsonl", sample_pairs
    )


def pair_layout(row: dict) -> str:
    """Which preference layout a row has (TRL's names): its answers as chat messages, or as text after an explicit
    `prompt`, or as full texts whose shared beginning is the prompt."""
    if _is_chat(row.get("chosen")):
        return "conversational"
    if row.get("prompt") is None:
        return "implicit prompt"
    return "explicit prompt (conversational)" if _is_chat(row["prompt"]) else "explicit prompt"


TRAINED_ON = {
    "dpo": "the chosen and rejected answers after their prompt (DPO's log-ratio to the reference)",
    "reward": "the prompt and each answer, scored at the answer's last token",
}


def pair_data_format(ctx, dataset, pairs: list[dict]) -> dict:
    """What a preference stage made of its data, for stage.json and the model card (`record_data`)."""
    rows = list(dataset_rows(dataset))
    layouts = Counter(pair_layout(row) for row in rows)
    # The prompt column is read unless every row's chosen chat carries its own prompt (the turns before the answer).
    reads_prompt = any(
        row.get("prompt") is not None and not (_is_chat(row["chosen"]) and len(row["chosen"]) > 1) for row in rows
    )
    used = ["prompt", "chosen", "rejected"] if reads_prompt else ["chosen", "rejected"]
    info = {
        "format": "preference pairs: " + ", ".join(f"{layout} ({n} rows)" for layout, n in layouts.most_common()),
        "columns": used,
        "ignored_columns": [c for c in dataset.column_names if c not in used],
        "pairs": len(pairs),
        "trained_on": TRAINED_ON.get(ctx.config.kind, "the chosen and rejected answers"),
    }
    if layouts["conversational"]:
        info["prompt_from"] = (
            "the turns before the last assistant turn of chosen/rejected (the `prompt` column only "
            "where a chat holds the answer alone)"
        )
    if layouts["implicit prompt"]:
        info["implicit_prompt"] = "the shared beginning of chosen and rejected, cut at a word boundary"
    return info


def stage_pairs(ctx, tokenizer, make_model=None) -> tuple[list[dict], dict]:
    """The stage's training pairs (from `data`, or sampled `on_policy`) and counts for the metrics."""
    spec = getattr(ctx.config, "on_policy", None)
    if spec is not None:
        pairs, stats = cached_on_policy_pairs(ctx, make_model, tokenizer, spec)
        dataset = ctx.load_data(ctx.config.data, "data")
        verifier = resolve(spec.verifier, options=spec.verifier_options, search_dirs=[ctx.recipe.base_dir])
        info = prompt_data_format(list(dataset_rows(dataset)), dataset.column_names, [verifier])
        fmt = f"on-policy pairs: {info['format']}, the start policy's samples graded by `{spec.verifier}`"
        if spec.with_data_pairs:
            data_pairs, dropped = normalize_pairs(dataset, f"{ctx.where}.data", ctx.config.data)
            pairs = pairs + data_pairs
            stats = {**stats, "data_pairs": len(data_pairs), "data_pairs_dropped": sum(dropped.values())}
            fmt += f", and the data's own {len(data_pairs)} chosen/rejected pairs"
        ctx.record_data(
            "data",
            **{
                **info,
                "format": fmt,
                "pairs": len(pairs),
                "trained_on": TRAINED_ON.get(ctx.config.kind, "the chosen and rejected answers"),
            },
        )
        return pairs, stats
    dataset = ctx.load_data(ctx.config.data, "data")
    pairs, dropped = normalize_pairs(dataset, f"{ctx.where}.data", ctx.config.data)
    ctx.record_data("data", **pair_data_format(ctx, dataset, pairs))
    return pairs, {"pairs": len(pairs), "pairs_dropped": sum(dropped.values())}


def eval_pairs(ctx) -> list[dict]:
    """The held-out pairs of a preference stage's `eval_data`."""
    dataset = ctx.load_data(ctx.config.eval_data, "eval_data")
    pairs, _ = normalize_pairs(dataset, f"{ctx.where}.eval_data", ctx.config.eval_data)
    ctx.record_data("eval_data", **pair_data_format(ctx, dataset, pairs))
    return pairs


def check_stage_data(ctx) -> None:
    """`align check` for a preference stage: data columns, pair validity or verifier and prompt columns."""
    spec = getattr(ctx.config, "on_policy", None)
    dataset = ctx.load_data(ctx.config.data, "data")
    if spec is not None:
        verifier = resolve(spec.verifier, options=spec.verifier_options, search_dirs=[ctx.recipe.base_dir])
        check_prompt_rows(dataset, [verifier], f"{ctx.where}.data", ctx.config.data)
        if spec.with_data_pairs:
            normalize_pairs(dataset, f"{ctx.where}.data", ctx.config.data)
    else:
        normalize_pairs(dataset, f"{ctx.where}.data", ctx.config.data)
    if ctx.config.eval_data is not None:
        eval_pairs(ctx)


def pair_token_ids(tokenizer, rendered: list[dict]) -> list[dict]:
    """{'prompt_ids', 'chosen_ids', 'rejected_ids'}: the prompt's ids exactly as the samplers feed them, then
    each answer's (`formatting.encode_prompt_completion`), the form `trl.DPOTrainer`'s collator takes."""
    rows = []
    for r in rendered:
        prompt, chosen = encode_prompt_completion(tokenizer, r["prompt"], r["chosen"])
        _, rejected = encode_prompt_completion(tokenizer, r["prompt"], r["rejected"])
        rows.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
    return rows


def reward_token_ids(tokenizer, rendered: list[dict]) -> list[dict]:
    """{'chosen_ids', 'rejected_ids'}: prompt+answer token ids (as `pair_token_ids`), the form
    `trl.RewardTrainer` trains on as is and `scoring.score_texts` scores."""
    return [
        {"chosen_ids": r["prompt_ids"] + r["chosen_ids"], "rejected_ids": r["prompt_ids"] + r["rejected_ids"]}
        for r in pair_token_ids(tokenizer, rendered)
    ]
