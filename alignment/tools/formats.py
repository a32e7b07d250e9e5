"""How tool calls are written and tool results shown: the checkpoint's own tool-calling template where it has one,
else a recipe-level `tool_format` (`STYLES`; `ToolFormat` says how each style writes a call).

    fmt = ToolFormat.for_tokenizer(tokenizer, config.tool_format)      # UserError when neither says one
    prompt = fmt.render_prompt(tokenizer, row_prompt, schemas)          # tools described to the model
    calls, failures = fmt.parse(assistant_text)                         # Call(name, arguments) / reasons
    suffix = fmt.result_text(tokenizer, [("calculator", "42")])         # the tool turn, to the next assistant turn

Native templates (the template itself renders `tools=` and tool turns: detected from its text) describe the tools
and render results their own way. A template without tool support (ChatML of SmolLM2, the tiny model's) gets a
system message describing the tools in the chosen format, and results as a `tool` turn through the template
(`<tool_response>` tags for hermes). A result turn is rendered as text on its own (`result_text`): the rollout
tokenizes only that piece and appends the ids; the conversation is never re-tokenized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..data.formatting import (
    as_messages,
    encode,
    end_of_turn,
    marker_tokens,
    render_prompt,
)
from ..errors import UserError

STYLES = ("hermes", "llama3_json", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MAX_JSON_DEPTH = 32  # deepest nesting of a call's JSON; deeper is a parse failure (json's C decoder would recurse)
DUMMY_USER = {"role": "user", "content": "dummy"}
# Stands for a result's content while the template renders around it: private-use characters, which no template
# trims (a `| trim` strips whitespace) or writes itself.
SENTINEL = "\ue000tool-result-{}\ue000"
WORD_JOINER = "\u2060"  # breaks a marker's text where a tokenizer would still match it


def clean_text(text: str) -> str:
    """`text` as valid UTF-8: a lone surrogate (JSON's "\\ud800" decodes to one) is written as its escape, which
    a tokenizer and a JSON file both accept."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def control_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special and added tokens (the template's markers), the unknown token aside."""
    ids = set(tokenizer.convert_tokens_to_ids(sorted(marker_tokens(tokenizer))))
    return ids - {tokenizer.unk_token_id, None}


def data_ids(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as data: the text of a special token in it is tokenized as plain characters
    (`split_special_tokens`), so it cannot become a control token. Text without such text gets the ids `encode`
    gives it. Where the tokenizer still matches a marker (an added token that is not special), each marker's
    text is broken by a word joiner after its first character."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if not set(ids) & control_ids(tokenizer):
        return ids
    return encode(tokenizer, defang(tokenizer, text))


def defang(tokenizer, text: str) -> str:
    """`text` with every marker token's text broken by a word joiner, so no tokenizer reads it as the marker."""
    for marker in sorted(marker_tokens(tokenizer), key=len, reverse=True):
        if len(marker) > 1:
            text = text.replace(marker, marker[0] + WORD_JOINER + marker[1:])
    return text


@dataclass
class Call:
    name: str
    arguments: dict


def native_style(tokenizer) -> str | None:
    """The tool-call style the chat template itself renders, or None when it has no tool support."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str) or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


def _call_from(data, keys: tuple[str, ...]) -> Call:
    """A Call from a decoded JSON object, or ValueError saying what is wrong with it."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ValueError('a tool call must be a JSON object with a string "name"')
    arguments = next((data[k] for k in keys if k in data), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError(f'"{keys[0]}" must be a JSON object')
    return Call(data["name"], arguments)


def _loads(text: str):
    """Decoded JSON, or ValueError: malformed, or nested deeper than MAX_JSON_DEPTH (json's decoder recurses,
    so a deep text would raise RecursionError, which no caller expects)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"invalid JSON ({error.msg} at character {error.pos})") from None
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def json_depth(data) -> int:
    """Nesting depth of decoded JSON (a scalar is 0), computed without recursion."""
    deepest, stack = 0, [(data, 0)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > MAX_JSON_DEPTH:
            return deepest  # enough to refuse; the rest need not be walked
        stack += [(child, depth + 1) for child in children]
    return deepest


def hermes_bodies(text: str) -> list[str]:
    """The bodies of `<tool_call>...</tool_call>` pairs, left to right, each closed by the first closing tag after
    it (a lazy regex's matches), found with `str.find` so that many unclosed tags stay linear to scan."""
    bodies, position = [], 0
    while (start := text.find(HERMES_OPEN, position)) >= 0:
        end = text.find(HERMES_CLOSE, start + len(HERMES_OPEN))
        if end < 0:
            break
        bodies.append(text[start + len(HERMES_OPEN) : end])
        position = end + len(HERMES_CLOSE)
    return bodies


@dataclass(frozen=True)
class ToolFormat:
    """How one style writes tool calls and shows their results:

    - `hermes` (Qwen2.5, Hermes, Qwen3): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, any
      number per turn, text around them allowed;
    - `llama3_json` (Llama 3.1 / 3.2 custom tools): the whole turn is `{"name": ..., "parameters": {...}}`,
      optionally after `<|python_tag|>`; a turn that does not start with `{` is an answer;
    - `mistral` (Mistral v0.3): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
    """

    style: str
    native: bool  # the chat template renders tools and tool turns itself

    @classmethod
    def for_tokenizer(cls, tokenizer, tool_format: str | None, where: str = "stage") -> ToolFormat:
        """The recipe's `tool_format` (rendered by us) or the template's own; neither is a UserError."""
        if tool_format:
            if tool_format not in STYLES:
                raise UserError(f"{where}.tool_format: '{tool_format}' is not one of {', '.join(STYLES)}.")
            return cls(tool_format, native=native_style(tokenizer) == tool_format)
        style = native_style(tokenizer)
        if style is None:
            raise UserError(
                f"{where}: the model's chat template has no tool-calling support (it renders no "
                f"`tools`), so it does not say how to write a tool call. Set `tool_format:` to one of "
                f"{', '.join(STYLES)} (hermes: <tool_call>{{json}}</tool_call>, as Qwen2.5)."
            )
        return cls(style, native=True)

    # --- parsing what the model wrote ---------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[list[Call], list[str]]:
        """(well-formed calls, one reason per malformed call) in the assistant turn `text`."""
        parse = {"hermes": self._parse_hermes, "llama3_json": self._parse_llama, "mistral": self._parse_mistral}
        try:
            return parse[self.style](text)
        except Exception as error:  # noqa: BLE001 - model text must never end the step: what is not read is a failure
            return [], [f"the tool call could not be read ({type(error).__name__})"]

    @staticmethod
    def _parse_hermes(text: str) -> tuple[list[Call], list[str]]:
        calls, failures = [], []
        for body in hermes_bodies(text):
            try:
                calls.append(_call_from(_loads(body.strip()), ("arguments", "parameters")))
            except ValueError as error:
                failures.append(str(error))
        if text.count("<tool_call>") > text.count("</tool_call>"):
            failures.append("<tool_call> without </tool_call>")
        return calls, failures

    @staticmethod
    def _parse_llama(text: str) -> tuple[list[Call], list[str]]:
        body = text.replace("<|python_tag|>", "").strip()
        if not body.startswith("{"):
            return [], []
        try:
            return [_call_from(_loads(body), ("parameters", "arguments"))], []
        except ValueError as error:
            return [], [str(error)]

    @staticmethod
    def _parse_mistral(text: str) -> tuple[list[Call], list[str]]:
        if "[TOOL_CALLS]" not in text:
            return [], []
        try:
            data = _loads(text.split("[TOOL_CALLS]", 1)[1].strip())
            items = data if isinstance(data, list) else [data]
            return [_call_from(item, ("arguments", "parameters")) for item in items], []
        except ValueError as error:
            return [], [str(error)]

    # --- writing calls and results ------------------------------------------------------------------------------
    def call_text(self, calls: list[Call]) -> str:
        """An assistant turn's text making `calls` (demonstrations for SFT; dummy turns for rendering)."""
        if self.style == "hermes":
            return "\n".join(
                f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n</tool_call>" for c in calls
            )
        if self.style == "llama3_json":
            return json.dumps({"name": calls[0].name, "parameters": calls[0].arguments})
        return "[TOOL_CALLS]" + json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])

    def describe(self, schemas: list[dict]) -> str:
        """System text telling a template without tool support which tools exist and how to call them."""
        listing = "\n".join(json.dumps(s) for s in schemas)
        example = self.call_text([Call("<function-name>", {"<argument>": "<value>"})])
        return (
            f"You may call tools. Their signatures:\n{listing}\nTo call one, answer with only:\n{example}\n"
            "The result comes back in the next turn."
        )

    def render_prompt(self, tokenizer, prompt, schemas: list[dict], describe: bool = True) -> str:
        """The prompt with the tools described, ending where the model's answer starts. `describe=False`: as
        written in the data (a model taught its calls by demonstrations)."""
        messages = as_messages(prompt)
        if not describe:
            return render_prompt(tokenizer, messages)
        if self.native:
            return tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=False)
        description = self.describe(schemas)
        if messages and messages[0]["role"] == "system":
            messages = [{"role": "system", "content": f"{messages[0]['content']}\n\n{description}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": description}, *messages]
        return render_prompt(tokenizer, messages)

    def _messages(self, results: list[tuple[str, str]]) -> tuple[dict, list[dict]]:
        calls = [Call(name, {}) for name, _ in results]
        if self.native:
            assistant = {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
                ],
            }
            return assistant, [{"role": "tool", "name": name, "content": content} for name, content in results]
        wrap = "<tool_response>\n{}\n</tool_response>" if self.style == "hermes" else "{}"
        return (
            {"role": "assistant", "content": self.call_text(calls)},
            [{"role": "tool", "name": name, "content": wrap.format(content)} for name, content in results],
        )

    def result_text(self, tokenizer, results: list[tuple[str, str]]) -> str:
        """The text after an assistant turn's end-of-turn token that shows `results` [(tool name, output)] and
        opens the next assistant turn: the template's rendering of a short dummy conversation with and without the
        tool messages, the difference taken from the end of the assistant turn (its end-of-turn token, where
        sampling stopped) to the next assistant turn's opening."""
        assistant, tools = self._messages(results)
        try:
            before = tokenizer.apply_chat_template([DUMMY_USER, assistant], tokenize=False)
            after = tokenizer.apply_chat_template(
                [DUMMY_USER, assistant, *tools], tokenize=False, add_generation_prompt=True
            )
        except Exception as error:  # jinja2 TemplateError, or a template that raises on the tool role
            raise UserError(
                f"The chat template cannot render a tool result turn: {error}. Use tool_format with a "
                "template that accepts a `tool` role."
            ) from None
        token = end_of_turn(tokenizer)
        cut = before.rfind(token)
        if cut < 0 or after[: cut + len(token)] != before[: cut + len(token)]:
            raise UserError(
                "The chat template renders an assistant turn differently once a tool result follows it "
                "(it is not prefix-preserving), so tool results cannot be appended to what the model "
                "sampled."
            )
        return after[cut + len(token) :]

    def result_ids(self, tokenizer, results: list[tuple[str, str]]) -> list[int]:
        """The token ids of `result_text`: the template's own text with its control tokens, each result's content
        as data (`data_ids`), so a tool's output cannot forge the template's turn markers. Results without any
        marker's text are tokenized whole, exactly as `encode(result_text)`."""
        markers = marker_tokens(tokenizer)
        if not any(marker in content for _, content in results for marker in markers):
            return encode(tokenizer, self.result_text(tokenizer, results))
        tags = [SENTINEL.format(i) for i in range(len(results))]
        text = self.result_text(tokenizer, [(name, tag) for (name, _), tag in zip(results, tags)])
        pieces, rest = [], text
        for tag in tags:
            head, found, rest = rest.partition(tag)
            if not found:  # the template changed the stand-in (escaped it): break the markers' text instead
                return encode(tokenizer, self.result_text(tokenizer, [(n, defang(tokenizer, c)) for n, c in results]))
            pieces.append(head)
        ids = []
        for head, (_, content) in zip(pieces, results):
            ids += encode(tokenizer, head) + data_ids(tokenizer, content)
        return ids + encode(tokenizer, rest)
