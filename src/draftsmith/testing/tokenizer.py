"""Tiny in-process tokenizers that carry the real special tokens and chat templates of popular models.

Tests and the demo's tiny preset cannot reach a model hub, yet chat-template handling is only worth
testing against the templates real targets ship. So each style trains a byte-level BPE (any text
round-trips, ~500 tokens) on a few sentences in milliseconds and wraps it in ``PreTrainedTokenizerFast``
with that model's special tokens, post-processor (BOS or not) and Jinja chat template (tool-calling
branches dropped). ``save_pretrained``/``AutoTokenizer`` round-trip.
"""

from __future__ import annotations

import functools

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

STYLES = ("llama3", "llama3_1", "chatml", "deepseek_v3")

# Meta-Llama-3-8B-Instruct, verbatim.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Llama-3.1-8B-Instruct without the tool branches; strftime_now is pinned to the default date so renders
# are reproducible.
LLAMA3_1_TEMPLATE = (
    "{{- bos_token }}\n"
    '{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}\n'
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    '    {%- set system_message = "" %}\n'
    "{%- endif %}\n"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
    "{{- system_message }}\n"
    '{{- "<|eot_id|>" }}\n'
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# HuggingFaceTB/SmolLM2-135M-Instruct, verbatim (ChatML with a default system prompt).
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + SMOLLM2_SYSTEM + "<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# deepseek-ai/DeepSeek-V3 without the tool-call/tool-output branches.
DEEPSEEK_V3_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', "
    "is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}"
    "{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}"
    "{%- set ns.is_tool = false -%}"
    "{%- else %}{% set content = message['content'] %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- endif %}"
    "{%- endfor -%}"
    "{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding lets a small draft model propose tokens that a large target model verifies.",
    "Hello! How can I help you today? I am a helpful assistant.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a short poem about the sea, the wind and the stars at night.",
    "Python is a programming language; def main(): return 42",
    "Sure, here is an answer: first, second, third. Thank you for asking!",
    "The user asked a question and the assistant gave an answer with reasoning.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols + - * / = < > ( ) [ ] { }.",
    "Let me think step by step about this problem before I answer.",
]


@functools.cache
def _spec(style: str) -> dict:
    """Special tokens and chat template per style; `specials` are (content, special) in id order."""
    if style in ("llama3", "llama3_1"):
        specials = [
            ("<|begin_of_text|>", True),
            ("<|end_of_text|>", True),
            ("<|finetune_right_pad_id|>", True),
            ("<|start_header_id|>", True),
            ("<|end_header_id|>", True),
            ("<|eom_id|>", True),
            ("<|eot_id|>", True),
            ("<|python_tag|>", True),
        ]
        return {
            "specials": specials,
            "bos": "<|begin_of_text|>",
            "eos": "<|eot_id|>",
            "pad": None,
            "prepend_bos": True,  # Llama-3's tokenizer.json post-processor adds BOS
            "trim_offsets": False,
            "template": LLAMA3_TEMPLATE if style == "llama3" else LLAMA3_1_TEMPLATE,
        }
    if style == "chatml":
        specials = [
            ("<|endoftext|>", True),
            ("<|im_start|>", True),
            ("<|im_end|>", True),
        ]
        return {
            "specials": specials,
            "bos": "<|im_start|>",
            "eos": "<|im_end|>",
            "pad": "<|im_end|>",
            "unk": "<|endoftext|>",
            "prepend_bos": False,
            "trim_offsets": True,
            "template": CHATML_TEMPLATE,
        }
    if style == "deepseek_v3":
        # In DeepSeek-V3's tokenizer.json the role markers are added tokens that are NOT special.
        specials = [
            ("<｜begin▁of▁sentence｜>", True),
            ("<｜end▁of▁sentence｜>", True),
            ("<｜▁pad▁｜>", True),
            ("<｜User｜>", False),
            ("<｜Assistant｜>", False),
            ("<think>", False),
            ("</think>", False),
            ("<｜tool▁outputs▁end｜>", False),
        ]
        return {
            "specials": specials,
            "bos": "<｜begin▁of▁sentence｜>",
            "eos": "<｜end▁of▁sentence｜>",
            "pad": "<｜▁pad▁｜>",
            "prepend_bos": True,
            "trim_offsets": False,
            "template": DEEPSEEK_V3_TEMPLATE,
        }
    raise ValueError(f"unknown tokenizer style {style!r}; expected one of {STYLES}")


@functools.cache
def _backend_json(style: str) -> str:
    """Train once per style and cache the serialised backend (training is deterministic and fast)."""
    spec = _spec(style)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_CORPUS * 3, trainer=trainer)
    # Added after training so they sit at the top of the vocabulary like in the real models.
    for content, special in spec["specials"]:
        added = AddedToken(content, special=special, normalized=False)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    byte_level = processors.ByteLevel(trim_offsets=spec["trim_offsets"])
    if spec["prepend_bos"]:
        bos = spec["bos"]
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.Sequence(
            [
                byte_level,
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
                ),
            ]
        )
    else:
        tok.post_processor = byte_level
    return tok.to_str()


def make_tokenizer(style: str) -> PreTrainedTokenizerFast:
    """A fresh tiny tokenizer for `style` ("llama3", "llama3_1", "chatml" or "deepseek_v3")."""
    spec = _spec(style)
    kwargs = {
        "tokenizer_object": Tokenizer.from_str(_backend_json(style)),
        "bos_token": spec["bos"],
        "eos_token": spec["eos"],
        "chat_template": spec["template"],
        "name_or_path": f"tiny-{style}",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }
    if spec.get("pad"):
        kwargs["pad_token"] = spec["pad"]
    if spec.get("unk"):
        kwargs["unk_token"] = spec["unk"]
    return PreTrainedTokenizerFast(**kwargs)
