"""Load a model's tokenizer the way every stage uses it: a pad token distinct from EOS and the end-of-turn
token where the vocabulary has one to spare, and the recipe's `template:` settings written into the chat
template (so a saved checkpoint renders exactly as training did). A tokenizer saved as a plain `tokenizers`
pipeline (the tiny model's) is read back as that pipeline, whatever the model type; `check_round_trip` is
the check every saved checkpoint passes (`models.saving`): its folder reloads to the tokenizer it was
trained with."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerFast,
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
    if saved_as_plain_pipeline(source):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
    else:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None or tokenizer.pad_token in (tokenizer.eos_token, end_of_turn(tokenizer)):
        tokenizer.pad_token = spare_pad_token(tokenizer) or tokenizer.eos_token
    if template is not None:
        apply_template(tokenizer, template, name)
    return tokenizer


# The class names that load tokenizer.json as written (every model-specific class derives from it).
# transformers picks a model-specific class by the model type for some types (qwen2 among them), even over
# tokenizer_config.json's `tokenizer_class`, and such a class builds its own pre-tokenizer and decoder from the
# vocabulary: the tiny character tokenizer reloaded that way dropped every space and newline.
PLAIN_CLASS_NAMES = ("TokenizersBackend", "PreTrainedTokenizerFast")
ROUND_TRIP_PROBE = "What is 12*3? a b\n  x\tY"


def saved_as_plain_pipeline(source: str) -> bool:
    """Whether the local folder `source` holds a tokenizer saved as a plain `tokenizers` pipeline (no
    model-specific tokenizer class named in its tokenizer_config.json)."""
    config = Path(source) / "tokenizer_config.json"
    if not config.is_file() or not (Path(source) / "tokenizer.json").is_file():
        return False
    try:
        declared = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False
    return declared in PLAIN_CLASS_NAMES


def check_round_trip(tokenizer, folder: Path) -> None:
    """Refuse a saved checkpoint whose tokenizer does not reload to `tokenizer` (the one it was trained with):
    the probe text must encode to the same ids and decode to the same text. A checkpoint that tokenizes
    differently after loading is evaluated and trained on text its weights never saw."""
    reloaded = load_tokenizer(str(folder))
    probe = ROUND_TRIP_PROBE + (render_completion(tokenizer, "q", "a") if has_chat_template(tokenizer) else "")
    before = tokenizer(probe, add_special_tokens=False)["input_ids"]
    after = reloaded(probe, add_special_tokens=False)["input_ids"]
    if before != after or tokenizer.decode(before) != reloaded.decode(after):
        raise UserError(
            f"the tokenizer saved in {folder} does not reload to the one the model was trained with: "
            f"{probe!r} encodes as {tokenizer.decode(before)!r} before saving and as "
            f"{reloaded.decode(after)!r} after ({type(tokenizer).__name__} saved, "
            f"{type(reloaded).__name__} loaded). The stage is not marked finished."
        )


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
