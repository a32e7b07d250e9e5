"""The one rendering convention (formatting.py) on the chat templates of the major families (tests/chat_templates.py):
one system prompt, no double BOS, exactly one end-of-turn after a completion whatever its surrounding
whitespace, the prompt that training renders is the prompt sampling feeds, one stop set, a pad that is not EOS."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from chat_templates import FAMILIES, family_tokenizer
from transformers import GenerationConfig

from alignment.config.model import TemplateSpec
from alignment.errors import UserError
from alignment.formatting import encode, end_of_turn, render_completion, render_pair, render_prompt
from alignment.models import TEMPLATE_START, apply_template, spare_pad_token
from alignment.sampling import stop_token_ids
from alignment.stages.rlvr import without_leading_bos

NAMES = sorted(FAMILIES)
SYSTEM = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2+2?"}]


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
    given = render_prompt(tokenizer, SYSTEM)
    assert given.count("Answer with a number.") == 1
    if spec.system_marker:
        assert given.count(spec.system_marker) == 1
        assert render_prompt(tokenizer, "What is 2+2?").count(spec.system_marker) <= 1


def test_no_double_bos_in_the_rendered_prompt_nor_in_trls_tokenization(family):
    spec, tokenizer = family
    prompt = render_prompt(tokenizer, SYSTEM)
    if spec.bos:
        assert not prompt.startswith(spec.bos * 2)
        assert encode(tokenizer, prompt)[:2].count(tokenizer.convert_tokens_to_ids(spec.bos)) <= 1
    # TRL's GRPO tokenizes with special tokens on: the tokenizer's own BOS plus the template's must not double.
    trl_ids = tokenizer(without_leading_bos(tokenizer, prompt))["input_ids"]
    if spec.bos:
        assert trl_ids[:2].count(tokenizer.convert_tokens_to_ids(spec.bos)) <= 1


def test_training_renders_the_prompt_sampling_feeds(family):
    _, tokenizer = family
    pair = render_pair(tokenizer, {"prompt": SYSTEM, "completion": " 4"})
    assert pair["prompt"] == render_prompt(tokenizer, SYSTEM)
    prompt_ids = encode(tokenizer, pair["prompt"])
    assert encode(tokenizer, pair["prompt"] + pair["completion"])[: len(prompt_ids)] == prompt_ids


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
    conversation = render_prompt(tokenizer, SYSTEM) + render_completion(tokenizer, SYSTEM, "4")
    assert pad not in conversation


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
