"""Chat templates of the major model families, as fixtures: each family's template (the parts that matter
for rendering: default system prompts, BOS in the template, content trimming, the end-of-turn token, what
follows it) with its own special tokens, on the tests' character-level tokenizer.

    tokenizer = family_tokenizer("llama3")
"""

from __future__ import annotations

from dataclasses import dataclass, field

from alignment.models.tiny import build_tokenizer


@dataclass(frozen=True)
class Family:
    template: str
    bos: str | None
    eos: str
    end_of_turn: str
    specials: tuple[str, ...]
    pad: str | None = None
    system_marker: str = ""  # what opens a system turn; a default system prompt renders it too
    checkpoint_eos: tuple[str, ...] = ()  # extra EOS tokens the checkpoint's generation_config lists
    template_kwargs: dict = field(default_factory=dict)
    system_role: bool = True  # False: the template refuses system messages (Gemma 2)


CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\n{DEFAULT}<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

FAMILIES = {
    "llama3": Family(
        template=(
            "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system_message = "
            "messages[0]['content']|trim %}{%- set messages = messages[1:] %}{%- else %}{%- set "
            "system_message = '' %}{%- endif %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
            "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
            "{{- system_message }}{{- '<|eot_id|>' }}{%- for message in messages %}{{- '<|start_header_id|>' "
            "+ message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>"
            "\\n\\n' }}{%- endif %}"
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        end_of_turn="<|eot_id|>",
        specials=("<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"),
        system_marker="<|start_header_id|>system",
        checkpoint_eos=("<|end_of_text|>",),
    ),
    "qwen2.5": Family(
        template=CHATML.replace("{DEFAULT}", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
        bos=None,
        eos="<|im_end|>",
        end_of_turn="<|im_end|>",
        specials=("<|im_start|>",),
        pad="<|endoftext|>",
        system_marker="<|im_start|>system",
        checkpoint_eos=("<|endoftext|>",),
    ),
    "smollm2": Family(
        template=CHATML.replace("{DEFAULT}", "You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
        bos="<|im_start|>",
        eos="<|im_end|>",
        end_of_turn="<|im_end|>",
        specials=("<|endoftext|>",),
        system_marker="<|im_start|>system",
    ),
    "qwen3": Family(
        template=(
            "{%- for message in messages %}{%- if message.role == 'assistant' and loop.last %}"
            "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
            "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
            "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
            "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
            "{%- endif %}{%- endif %}"
        ),
        bos=None,
        eos="<|im_end|>",
        end_of_turn="<|im_end|>",
        specials=("<|im_start|>", "<think>", "</think>"),
        pad="<|endoftext|>",
        system_marker="<|im_start|>system",
        checkpoint_eos=("<|endoftext|>",),
    ),
    "gemma3": Family(
        template=(
            "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = "
            "messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}{% else %}{% set "
            "first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}{% for message in "
            "loop_messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
            "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + "
            "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<start_of_turn>model\\n' }}{% endif %}"
        ),
        bos="<bos>",
        eos="<eos>",
        end_of_turn="<end_of_turn>",
        specials=("<start_of_turn>",),
        pad="<pad>",
        checkpoint_eos=("<end_of_turn>",),
    ),
    # Gemma 2: Gemma 3's turns, but a system message is refused (raise_exception) rather than folded in.
    "gemma2": Family(
        template=(
            "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
            "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
            "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
            "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
            "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' "
            "+ role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if "
            "add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
        ),
        bos="<bos>",
        eos="<eos>",
        end_of_turn="<end_of_turn>",
        specials=("<start_of_turn>",),
        pad="<pad>",
        checkpoint_eos=("<end_of_turn>",),
        system_role=False,
    ),
    "mistral-v0.3": Family(
        template=(
            "{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
            "{{- '[INST] ' + message['content'] + '[/INST]' }}{%- elif message['role'] == 'system' %}"
            "{{- '[INST] ' + message['content'] + '\\n\\n' }}{%- elif message['role'] == 'assistant' %}"
            "{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}"
        ),
        bos="<s>",
        eos="</s>",
        end_of_turn="</s>",
        specials=(),
    ),
    # DeepSeek-R1-Distill (Qwen/Llama): the system prompt bare after BOS, no end-of-turn after a user turn, a
    # generation prompt that opens the reasoning (`<think>` and a newline), and an assistant turn rendered without its
    # reasoning (everything up to `</think>` is cut), so a whole conversation does not start with the prompt.
    "deepseek-r1": Family(
        template=(
            "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
            "{% set ns = namespace(system_prompt='') %}{%- for message in messages %}{%- if message['role'] "
            "== 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}"
            "{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}{%- if message['role'] == "
            "'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}{%- if message['role'] == "
            "'assistant' and message['content'] is not none %}{% set content = message['content'] %}"
            "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
            "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{%- endif %}"
            "{%- endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
        ),
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        end_of_turn="<｜end▁of▁sentence｜>",
        specials=("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"),
    ),
    "phi3": Family(
        template=(
            "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + "
            "message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + "
            "message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' "
            "+ message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
        ),
        bos=None,
        eos="<|endoftext|>",
        end_of_turn="<|end|>",
        specials=("<|system|>", "<|user|>", "<|assistant|>"),
        system_marker="<|system|>",
        checkpoint_eos=("<|end|>",),
    ),
    # Phi-4 (14B): ChatML turns with <|im_sep|> after the role and nothing between turns, unlike Phi-3's; its
    # BOS <|endoftext|> is not in the template, and it ships a pad token of its own.
    "phi4": Family(
        template=(
            "{% for message in messages %}{% if (message['role'] == 'system') %}{{'<|im_start|>system"
            "<|im_sep|>' + message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'user') %}"
            "{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}{% elif (message['role'] == "
            "'assistant') %}{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
        ),
        bos="<|endoftext|>",
        eos="<|im_end|>",
        end_of_turn="<|im_end|>",
        specials=("<|im_start|>", "<|im_sep|>"),
        pad="<|dummy_85|>",
        system_marker="<|im_start|>system",
    ),
}


def family_tokenizer(name: str):
    """The tests' character-level tokenizer dressed as `name`: its special tokens, BOS/EOS/pad and template."""
    family = FAMILIES[name]
    tokenizer = build_tokenizer()
    tokens = {"eos_token": family.eos}
    if family.bos:
        tokens["bos_token"] = family.bos
    extra = [t for t in (*family.specials, family.end_of_turn, family.pad) if t and t not in (family.eos, family.bos)]
    tokenizer.add_special_tokens({**tokens, "additional_special_tokens": extra})
    tokenizer.pad_token = family.pad  # None where the family ships no pad token
    tokenizer.chat_template = family.template
    return tokenizer


# Text with many newlines followed by indentation: the tokenizer learns to merge a newline with the spaces after it
# ("\n  " is one token), as the byte-level BPEs of GPT-2, Llama 3, Qwen and SmolLM2 do.
BPE_CORPUS = ["def f(x):\n    return x + 1\n\n", "What is 2+2?\n  4\n", "Answer:\n  four\n", "a b c d e f g\n"] * 50


def bpe_tokenizer(name: str = "qwen2.5"):
    """A real byte-level BPE tokenizer (trained here with the `tokenizers` library, no download) dressed as
    family `name`: its special tokens, BOS/EOS/pad and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    family = FAMILIES[name]
    specials = [
        t for t in dict.fromkeys((family.bos, family.eos, family.end_of_turn, family.pad, *family.specials)) if t
    ]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(
        BPE_CORPUS,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=family.eos,
        bos_token=family.bos,
        pad_token=family.pad,
        additional_special_tokens=specials,
    )
    tokenizer.chat_template = family.template
    return tokenizer
