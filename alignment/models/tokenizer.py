"""Load a model's tokenizer the way every stage uses it: a pad token distinct from EOS and the end-of-turn
token where the vocabulary has one to spare, and the recipe's `template:` settings written into the chat
template (so a saved checkpoint renders exactly as training did)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import (
    AutoTokenizer,
)

from ..config.model import TemplateSpec
from ..data.formatting import (
    end_of_turn,
    has_chat_template,
    marker_tokens,
    render_completion,
    render_prompt,
)
from ..errors import UserError
from .loading import adapter_base, is_adapter_dir


def load_tokenizer(name: str, trust_remote_code: bool = False, template: TemplateSpec | None = None):
    source = (
        adapter_base(name) if is_adapter_dir(name) and not (Path(name) / "tokenizer_config.json").exists() else name
    )
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None or tokenizer.pad_token in (tokenizer.eos_token, end_of_turn(tokenizer)):
        tokenizer.pad_token = spare_pad_token(tokenizer) or tokenizer.eos_token
    if template is not None:
        apply_template(tokenizer, template, name)
    return tokenizer


def pad_token_id(tokenizer) -> int:
    """The id batches are padded with: the pad token's, else the EOS token's (a checkpoint that ships none)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def jinja_literal(value) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "none"}[value]
    return json.dumps(value)


TEMPLATE_START, TEMPLATE_END = "{#- alignment template -#}", "{#- /alignment template -#}"


def apply_template(tokenizer, spec: TemplateSpec, name: str = "the model") -> None:
    """Write the recipe's `template:` into the tokenizer's chat template: the variables set first, then a
    system prompt put before conversations that bring none (the template's default then never shows). The
    settings sit between two markers, so a later stage replaces them rather than stacking a second copy."""
    if not has_chat_template(tokenizer):
        raise UserError(
            f"template: {name} has no chat template, so there is nothing to set; drop `template:` "
            "(a model without one trains on plain prompt/completion or text rows)."
        )
    template = tokenizer.chat_template
    if template.startswith(TEMPLATE_START) and TEMPLATE_END in template:
        template = template.split(TEMPLATE_END, 1)[1]
    head = "".join(f"{{%- set {k} = {jinja_literal(v)} %}}" for k, v in spec.kwargs.items())
    if spec.system_prompt is not None:
        head += (
            "{%- if not messages or messages[0]['role'] != 'system' %}{%- set messages = [{'role': 'system', "
            f"'content': {json.dumps(spec.system_prompt)}}}] + messages %}}{{%- endif %}}"
        )
    tokenizer.chat_template = TEMPLATE_START + head + TEMPLATE_END + template


def spare_pad_token(tokenizer) -> str | None:
    """A special token to pad with when a tokenizer has none (SmolLM2, Llama 3): one that never ends or
    shapes a turn. Padding with EOS, the usual choice, hides the end of every answer: a reward model's head
    reads the last token that is not padding, so `68<|im_end|>` would score as `68`, and a finished answer
    as a cut-off one. Names with "pad" first, then unk, then any other unused special token."""
    used = {tokenizer.eos_token, tokenizer.bos_token, end_of_turn(tokenizer)}
    if has_chat_template(tokenizer):
        try:
            probe = render_prompt(tokenizer, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
        except UserError:  # a template without a system role (Gemma 2)
            probe = render_prompt(tokenizer, "u")
        used |= {t for t in marker_tokens(tokenizer) if t in probe + render_completion(tokenizer, "u", "a")}

    def preference(token: str) -> tuple[int, str]:
        return (0 if "pad" in token.lower() else 1 if token == tokenizer.unk_token else 2), token

    return min(marker_tokens(tokenizer) - used - {None}, key=preference, default=None)
