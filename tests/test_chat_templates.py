"""The one rendering convention (formatting.py) on the chat templates of the major families (tests/chat_templates.py):
one system prompt, no double BOS, exactly one end-of-turn after a completion whatever its surrounding
whitespace, the prompt that training renders is the prompt sampling feeds, one stop set, a pad that is not EOS."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from chat_templates import FAMILIES, bpe_tokenizer, family_tokenizer
from transformers import GenerationConfig

from alignment.config.model import TemplateSpec
from alignment.config.sampling import SamplingSpec
from alignment.data.formatting import (
    encode,
    end_of_turn,
    render_completion,
    render_pair,
    render_prompt,
)
from alignment.errors import UserError
from alignment.models.tokenizer import TEMPLATE_START, apply_template, spare_pad_token
from alignment.sampling import generate, stop_token_ids
from alignment.stages.rlvr import without_leading_bos
from alignment.training.pairs import pair_token_ids, render_pairs, reward_token_ids
from alignment.training.rows import token_rows

NAMES = sorted(FAMILIES)
SYSTEM = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2+2?"}]


def conversation(spec) -> list[dict]:
    """SYSTEM, or its user turn alone for a template that refuses system messages (Gemma 2)."""
    return SYSTEM if spec.system_role else SYSTEM[1:]


@pytest.fixture(scope="module", params=NAMES)
def family(request):
    return FAMILIES[request.param], family_tokenizer(request.param)


def test_the_end_of_turn_token_is_the_familys(family):
    spec, tokenizer = family
    assert end_of_turn(tokenizer) == spec.end_of_turn


@pytest.mark.parametrize("completion", ["4", " 4", "4 ", "\n4\n", "  four  "])
def test_exactly_one_end_of_turn_closes_a_completion_whatever_its_whitespace(family, completion):
    spec, tokenizer = family
    rendered = render_completion(tokenizer, "What is 2+2?", completion)
    assert rendered.endswith(spec.end_of_turn) and rendered.count(spec.end_of_turn) == 1, rendered
    assert completion.strip() in rendered


def test_one_system_prompt_a_given_one_replaces_the_default(family):
    spec, tokenizer = family
    if not spec.system_role:  # refused with the template's own reason, not a traceback
        with pytest.raises(UserError, match=r"refused a conversation with roles \['system', 'user'\]: System role"):
            render_prompt(tokenizer, SYSTEM)
        with pytest.raises(UserError, match=r"^row 3: .*System role not supported"):
            render_pair(tokenizer, {"prompt": SYSTEM, "completion": "4"}, 3)
        return
    given = render_prompt(tokenizer, SYSTEM)
    assert given.count("Answer with a number.") == 1
    if spec.system_marker:
        assert given.count(spec.system_marker) == 1
        assert render_prompt(tokenizer, "What is 2+2?").count(spec.system_marker) <= 1


def test_no_double_bos_in_the_rendered_prompt_nor_in_trls_tokenization(family):
    spec, tokenizer = family
    prompt = render_prompt(tokenizer, conversation(spec))
    if spec.bos:
        assert not prompt.startswith(spec.bos * 2)
        assert encode(tokenizer, prompt)[:2].count(tokenizer.convert_tokens_to_ids(spec.bos)) <= 1
    # TRL's GRPO tokenizes with special tokens on: the tokenizer's own BOS plus the template's must not double.
    trl_ids = tokenizer(without_leading_bos(tokenizer, prompt))["input_ids"]
    if spec.bos:
        assert trl_ids[:2].count(tokenizer.convert_tokens_to_ids(spec.bos)) <= 1


class RecordingModel(torch.nn.Module):
    """Stands in for a policy in `sampling.generate`: records the prompt ids it is fed (without the padding)
    and answers every prompt with EOS."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.fed: list[list[int]] = []

    def generate(self, input_ids, attention_mask, eos_token_id, **_):
        self.fed += [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
        return torch.cat([input_ids, torch.full((len(input_ids), 1), eos_token_id[0])], dim=1)


def sampled_prompt_ids(tokenizer, prompt) -> list[int]:
    model = RecordingModel()
    # engine generate: the stand-in has no forward; both engines feed the same encoded prompt (tests/test_sampling.py)
    generate(
        model, tokenizer, [render_prompt(tokenizer, prompt)], SamplingSpec(n=1, max_new_tokens=1, engine="generate")
    )
    (fed,) = model.fed
    return fed


def training_sequences(tokenizer, prompt, completion: str) -> dict[str, tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) as the sft, dpo and reward stages hand them to TRL."""
    pair = render_pair(tokenizer, {"prompt": prompt, "completion": completion})
    (sft_row,) = token_rows(tokenizer, [pair])
    n = sft_row["completion_mask"].count(0)
    rendered = render_pairs(tokenizer, [{"prompt": prompt, "chosen": completion, "rejected": "5"}])
    (dpo_row,) = pair_token_ids(tokenizer, rendered)
    (reward_row,) = reward_token_ids(tokenizer, rendered)
    prompt_ids = dpo_row["prompt_ids"]
    return {
        "sft": (sft_row["input_ids"][:n], sft_row["input_ids"][n:]),
        "dpo": (prompt_ids, dpo_row["chosen_ids"]),
        "reward": (reward_row["chosen_ids"][: len(prompt_ids)], reward_row["chosen_ids"][len(prompt_ids) :]),
    }


@pytest.mark.parametrize("completion", ["4", " 4", "  4", "\n4\n"])
def test_training_sequences_are_the_sampled_prompt_then_the_completion_then_one_end_of_turn(family, completion):
    spec, tokenizer = family
    fed = sampled_prompt_ids(tokenizer, conversation(spec))
    end = tokenizer.convert_tokens_to_ids(spec.end_of_turn)
    for stage, (prompt_ids, completion_ids) in training_sequences(tokenizer, conversation(spec), completion).items():
        assert prompt_ids == fed, stage
        assert completion_ids[-1] == end and completion_ids.count(end) == 1, stage
        assert completion.strip() in tokenizer.decode(completion_ids), stage


def test_a_reasoning_answer_follows_the_generation_prompt_that_opens_the_reasoning():
    """DeepSeek-R1's generation prompt opens the reasoning and its template renders a past answer without it:
    the answer is trained as the model produces it after the generation prompt, reasoning included, once."""
    tokenizer = family_tokenizer("deepseek-r1")
    prompt = render_prompt(tokenizer, SYSTEM)
    assert prompt.endswith("<｜Assistant｜><think>\n")
    eos = "<｜end▁of▁sentence｜>"
    reasoning = "2 and 2 make 4.\n</think>\n\n4"
    assert render_completion(tokenizer, SYSTEM, reasoning) == reasoning + eos
    assert render_completion(tokenizer, SYSTEM, "<think>\n" + reasoning) == reasoning + eos  # not opened twice
    assert render_completion(tokenizer, SYSTEM, "4") == "4" + eos


def test_a_template_that_renders_the_conversation_otherwise_differently_is_an_error():
    tokenizer = family_tokenizer("smollm2")
    tokenizer.chat_template = (
        "{% for m in messages %}{% if add_generation_prompt %}[{{ m['content'] }}]{% else %}"
        "({{ m['content'] }}){% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    with pytest.raises(UserError, match="renders a prompt differently alone and followed by an answer"):
        render_completion(tokenizer, "What is 2+2?", "4")


@pytest.mark.parametrize("completion", ["  4", "    four"])
def test_a_byte_level_bpe_merge_at_the_boundary_leaves_the_sampled_prompt_intact(completion):
    tokenizer = bpe_tokenizer("qwen2.5")
    pair = render_pair(tokenizer, {"prompt": SYSTEM, "completion": completion})
    fed = sampled_prompt_ids(tokenizer, SYSTEM)
    joined = encode(tokenizer, pair["prompt"] + pair["completion"])
    assert joined[: len(fed)] != fed  # the prompt's final newline merges with the leading spaces in the joined text
    for stage, (prompt_ids, completion_ids) in training_sequences(tokenizer, SYSTEM, completion).items():
        assert prompt_ids == fed, stage
        assert tokenizer.decode(prompt_ids + completion_ids) == pair["prompt"] + pair["completion"], stage


def test_trls_sft_and_dpo_trainers_train_on_the_sampled_prompt_ids(tmp_path):
    """Through TRL: what SFTTrainer and DPOTrainer prepare from the stages' rows starts with exactly the prompt
    ids the sampler feeds, also where a byte-level BPE merges tokens across the boundary (TRL, tokenizing the
    joined text, would start the answer one token early and drop the prompt's last token)."""
    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from alignment.stages.dpo import pretokenized

    tokenizer = bpe_tokenizer("qwen2.5")
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    fed = sampled_prompt_ids(tokenizer, SYSTEM)
    rows = [render_pair(tokenizer, {"prompt": SYSTEM, "completion": c}) for c in ("  4", "    four")]
    common = {"report_to": [], "use_cpu": True, "max_length": 128}
    sft = SFTTrainer(
        model=model,
        args=SFTConfig(output_dir=str(tmp_path / "sft"), completion_only_loss=True, **common),
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(token_rows(tokenizer, rows)),
    )
    for row, pair in zip(sft.train_dataset, rows):
        assert row["input_ids"][: len(fed)] == fed and set(row["labels"][: len(fed)]) == {-100}
        assert tokenizer.decode([t for t in row["labels"] if t != -100]) == pair["completion"]
    pairs = render_pairs(tokenizer, [{"prompt": SYSTEM, "chosen": "  4", "rejected": "    four"}])
    dpo = pretokenized(DPOTrainer)(
        model=model,
        ref_model=copy.deepcopy(model),
        args=DPOConfig(output_dir=str(tmp_path / "dpo"), **common),
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(pair_token_ids(tokenizer, pairs)),
    )
    (row,) = dpo.train_dataset
    assert row["prompt_ids"] == fed
    assert tokenizer.decode(row["chosen_ids"]) == pairs[0]["chosen"]


def test_the_stop_set_is_eos_end_of_turn_and_the_checkpoints_eos_ids(family):
    spec, tokenizer = family
    listed = [tokenizer.convert_tokens_to_ids(t) for t in (spec.eos, *spec.checkpoint_eos)]
    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=listed))
    expected = {tokenizer.convert_tokens_to_ids(t) for t in (spec.eos, spec.end_of_turn, *spec.checkpoint_eos)}
    assert set(stop_token_ids(tokenizer, model)) == expected


def test_a_missing_pad_is_a_spare_token_that_never_ends_or_opens_a_turn(family):
    spec, tokenizer = family
    pad = spare_pad_token(tokenizer)
    assert pad is not None and pad not in (spec.eos, spec.end_of_turn, spec.bos)
    prompt = conversation(spec)
    assert pad not in render_prompt(tokenizer, prompt) + render_completion(tokenizer, prompt, "4")


def test_template_system_prompt_replaces_the_default_and_a_given_one_wins():
    tokenizer = family_tokenizer("smollm2")
    apply_template(tokenizer, TemplateSpec(system_prompt="Be brief."))
    apply_template(tokenizer, TemplateSpec(system_prompt="Be brief."))  # a later stage replaces, never stacks
    prompt = render_prompt(tokenizer, "What is 2+2?")
    assert "SmolLM" not in prompt and prompt.count("Be brief.") == 1
    given = render_prompt(tokenizer, SYSTEM)
    assert "Be brief." not in given and given.count("Answer with a number.") == 1
    assert tokenizer.chat_template.count(TEMPLATE_START) == 1


def test_template_variables_reach_the_template():
    tokenizer = family_tokenizer("qwen3")
    assert "</think>" not in render_prompt(tokenizer, "hi")
    apply_template(tokenizer, TemplateSpec(kwargs={"enable_thinking": False}))
    assert render_prompt(tokenizer, "hi").endswith("<think>\n\n</think>\n\n")
    assert render_completion(tokenizer, "hi", "4") == "4<|im_end|>"


def test_template_settings_need_a_chat_template_and_names():
    tokenizer = family_tokenizer("phi3")
    tokenizer.chat_template = None
    with pytest.raises(UserError, match="has no chat template"):
        apply_template(tokenizer, TemplateSpec(system_prompt="x"), "base-model")
    with pytest.raises(ValueError, match="not a name"):
        TemplateSpec(kwargs={"enable thinking": False})
