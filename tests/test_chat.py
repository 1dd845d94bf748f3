"""Chat parsing, template probing and assistant-only loss masks against real chat templates."""

from __future__ import annotations

import gzip
import json

import pytest
from transformers import AutoTokenizer

from draftsmith.data import chat
from draftsmith.data.chat import (
    ChatTemplateError,
    Conversation,
    EmptyConversation,
    RecordError,
    SequenceTooLong,
    assistant_content,
    assistant_turn_prefix,
    end_of_turn_texts,
    parse_record,
    read_jsonl,
    tokenize_conversation,
    user_turn_prefix,
)
from draftsmith.testing.tokenizer import CHATML_TEMPLATE, SMOLLM2_SYSTEM, STYLES, make_tokenizer

EOT = {
    "llama3": "<|eot_id|>",
    "llama3_1": "<|eot_id|>",
    "chatml": "<|im_end|>",
    "deepseek_v3": "<｜end▁of▁sentence｜>",
}
HEADERS = {
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"],
    "llama3_1": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"],
    "chatml": ["<|im_start|>"],
    "deepseek_v3": ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
}
GEN_HEADER = {
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "llama3_1": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "chatml": "<|im_start|>assistant\n",
    "deepseek_v3": "<｜Assistant｜>",
}

CONVO = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Write a short poem about the sea."},
    {"role": "assistant", "content": "Wind and stars,\nthe sea at night.\n\nThank you for asking!"},
]


@pytest.fixture(scope="module", params=STYLES)
def style(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def tok(style: str):
    return make_tokenizer(style)


def masked_runs(tokenizer, tc) -> list[str]:
    """Decode each maximal run of masked tokens separately."""
    runs: list[list[int]] = []
    current: list[int] = []
    for token_id, m in zip(tc.input_ids, tc.loss_mask, strict=True):
        if m:
            current.append(token_id)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def assistant_texts(messages) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "assistant"]


# ---- fixtures themselves -------------------------------------------------------------------------------


def test_fixture_tokenizer_is_byte_level_and_saveable(style: str, tmp_path) -> None:
    tok = make_tokenizer(style)
    assert len(tok) >= 300
    text = "héllo wörld 🙂 ｜ <b> \t\n 42"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.chat_template == tok.chat_template
    assert again.eos_token == tok.eos_token
    ref = tokenize_conversation(tok, CONVO)
    got = tokenize_conversation(again, CONVO)
    assert (got.input_ids, got.loss_mask) == (ref.input_ids, ref.loss_mask)


# ---- loss mask -----------------------------------------------------------------------------------------


def test_mask_is_assistant_content_plus_end_of_turn(style: str, tok) -> None:
    tc = tokenize_conversation(tok, CONVO)
    assert len(tc.input_ids) == len(tc.loss_mask)
    assert not tc.truncated
    eot = EOT[style]
    assert masked_runs(tok, tc) == [c + eot for c in assistant_texts(CONVO)]


def test_no_header_or_prompt_token_is_masked(style: str, tok) -> None:
    tc = tokenize_conversation(tok, CONVO)
    header_ids = {tok.convert_tokens_to_ids(t) for t in HEADERS[style]}
    assert header_ids and None not in header_ids
    for token_id, m in zip(tc.input_ids, tc.loss_mask, strict=True):
        if token_id in header_ids:
            assert m == 0
    # Nothing before the first assistant header is masked (system + first user turn).
    rendered = tok.apply_chat_template(CONVO, tokenize=False)
    first_header = rendered.index(GEN_HEADER[style]) + len(GEN_HEADER[style])
    n_prefix = len(tok(rendered[:first_header], add_special_tokens=False)["input_ids"])
    assert not any(tc.loss_mask[:n_prefix])


def test_masked_count_matches_separate_tokenization(style: str, tok) -> None:
    tc = tokenize_conversation(tok, CONVO)
    expected = sum(len(tok(c + EOT[style], add_special_tokens=False)["input_ids"]) for c in assistant_texts(CONVO))
    assert tc.num_loss_tokens == sum(tc.loss_mask) == expected


def test_ids_match_transformers_and_single_bos(style: str, tok) -> None:
    tc = tokenize_conversation(tok, CONVO)
    ref = tok.apply_chat_template(CONVO, tokenize=True, return_dict=True)["input_ids"]
    assert tc.input_ids == list(ref)
    if tok.bos_token and style != "chatml":
        bos = tok.convert_tokens_to_ids(tok.bos_token)
        assert tc.input_ids[0] == bos
        assert tc.input_ids.count(bos) == 1


def test_offsets_and_segment_fallback_agree(style: str, tok) -> None:
    text = tok.apply_chat_template(CONVO, tokenize=False)
    spans = chat._assistant_spans(text, chat._prepare(CONVO), chat.chat_format(tok))
    assert chat._encode_segments(tok, text, spans) == chat._encode_masked(tok, text, spans)


def test_chatml_default_system_prompt_is_not_masked() -> None:
    tok = make_tokenizer("chatml")
    convo = [m for m in CONVO if m["role"] != "system"]
    assert SMOLLM2_SYSTEM in tok.apply_chat_template(convo, tokenize=False)
    tc = tokenize_conversation(tok, convo)
    assert masked_runs(tok, tc) == [c + "<|im_end|>" for c in assistant_texts(convo)]
    # The newline ChatML writes after <|im_end|> is not the assistant's.
    last = max(i for i, m in enumerate(tc.loss_mask) if m)
    assert tok.decode(tc.input_ids[last : last + 2]) == "<|im_end|>\n"


def test_reply_that_occurs_in_headers_or_user_turn(style: str, tok) -> None:
    convo = [
        {"role": "user", "content": "assistant"},
        {"role": "assistant", "content": "assistant"},
        {"role": "user", "content": "Say: user"},
        {"role": "assistant", "content": "user"},
    ]
    tc = tokenize_conversation(tok, convo)
    assert masked_runs(tok, tc) == ["assistant" + EOT[style], "user" + EOT[style]]


def test_llama3_trims_content() -> None:
    tok = make_tokenizer("llama3")
    convo = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello there!\n"}]
    assert masked_runs(tok, tokenize_conversation(tok, convo)) == ["Hello there!<|eot_id|>"]


def test_reasoning_content_is_kept(style: str, tok) -> None:
    record = {
        "messages": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Let me think step by step."},
        ]
    }
    convo = parse_record(record, 1)
    expected = "<think>\nLet me think step by step.\n</think>\n\n4"
    assert convo.messages[1]["content"] == expected
    # tokenize_conversation folds reasoning too when given raw messages.
    for messages in (convo.messages, record["messages"]):
        tc = tokenize_conversation(tok, messages)
        assert masked_runs(tok, tc) == [expected + EOT[style]]


def test_template_that_drops_earlier_reasoning() -> None:
    """DeepSeek-R1 keeps only what follows </think> in history: the visible answer is still masked."""
    tok = make_tokenizer("deepseek_v3")
    tok.chat_template = tok.chat_template.replace(
        "{% set content = message['content'] %}",
        "{% set content = message['content'] %}{% if '</think>' in content %}"
        "{% set content = content.split('</think>')[-1] %}{% endif %}",
    )
    convo = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye!"},
    ]
    tc = tokenize_conversation(tok, convo)
    assert masked_runs(tok, tc) == ["Hello!<｜end▁of▁sentence｜>", "Goodbye!<｜end▁of▁sentence｜>"]


def test_truncation(style: str, tok) -> None:
    full = tokenize_conversation(tok, CONVO)
    n = len(full.input_ids)
    same = tokenize_conversation(tok, CONVO, max_length=n)
    assert not same.truncated and same.input_ids == full.input_ids
    cut = tokenize_conversation(tok, CONVO, max_length=n - 5)
    assert cut.truncated
    assert cut.input_ids == full.input_ids[: n - 5] and cut.loss_mask == full.loss_mask[: n - 5]
    with pytest.raises(SequenceTooLong) as exc:
        tokenize_conversation(tok, CONVO, max_length=n - 1, truncate=False)
    assert exc.value.length == n and exc.value.max_length == n - 1
    first_masked = full.loss_mask.index(1)
    with pytest.raises(EmptyConversation):
        tokenize_conversation(tok, CONVO, max_length=first_masked)
    with pytest.raises(ValueError):
        tokenize_conversation(tok, CONVO, max_length=0)


def test_empty_conversations(tok) -> None:
    with pytest.raises(EmptyConversation):
        tokenize_conversation(tok, [])
    with pytest.raises(EmptyConversation):
        tokenize_conversation(tok, [{"role": "user", "content": "Hi"}])
    with pytest.raises(EmptyConversation):
        tokenize_conversation(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}])


def test_missing_template_names_tokenizer() -> None:
    tok = make_tokenizer("llama3")
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="tiny-llama3"):
        tokenize_conversation(tok, CONVO)
    with pytest.raises(ChatTemplateError, match="tiny-llama3"):
        user_turn_prefix(tok)


def test_template_without_assistant_content_names_tokenizer() -> None:
    tok = make_tokenizer("chatml")
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="tiny-chatml"):
        tokenize_conversation(tok, CONVO)


def test_template_that_raises_names_tokenizer() -> None:
    tok = make_tokenizer("deepseek_v3")
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="tiny-deepseek_v3.*alternate"):
        tokenize_conversation(tok, CONVO)


def test_chat_template_error_is_value_error() -> None:
    assert issubclass(ChatTemplateError, ValueError)
    assert issubclass(EmptyConversation, ValueError)
    assert issubclass(SequenceTooLong, ValueError)


# ---- input parsing -------------------------------------------------------------------------------------


def test_parse_sharegpt() -> None:
    record = {
        "id": 17,
        "conversations": [
            {"from": "system", "value": "Be nice."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
        ],
    }
    convo = parse_record(record, 3)
    assert convo == Conversation(
        id="17",
        messages=[
            {"role": "system", "content": "Be nice."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
        ],
    )


def test_parse_openai_and_plain_and_stable_ids() -> None:
    openai = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    sharegpt = {"conversations": [{"from": "user", "value": "Hi"}, {"from": "assistant", "value": "Hello!"}]}
    a, b = parse_record(openai, 1), parse_record(sharegpt, 2)
    assert a.messages == b.messages
    assert a.id == b.id == parse_record(openai, 9).id
    assert len(a.id) == 16 and int(a.id, 16) >= 0
    assert parse_record({"messages": [{"role": "user", "content": "Hi!"}]}, 1).id != a.id

    plain = parse_record({"prompt": "Tell me a joke."}, 4)
    assert plain.messages == [{"role": "user", "content": "Tell me a joke."}]
    assert parse_record({"id": "p-1", "prompt": "x"}, 5).id == "p-1"

    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert parse_record(parts, 6).messages == [{"role": "user", "content": "ab"}]


def test_parse_errors() -> None:
    with pytest.raises(ValueError, match="line 7: unknown record shape"):
        parse_record({"text": "hello"}, 7)
    with pytest.raises(ValueError, match=r"line 8: .*unknown role 'tool'"):
        parse_record({"messages": [{"role": "tool", "content": "{}"}]}, 8)
    with pytest.raises(ValueError, match="line 9"):
        parse_record({"conversations": [{"from": "human"}]}, 9)
    with pytest.raises(EmptyConversation):
        parse_record({"messages": []}, 10)


def test_assistant_content() -> None:
    assert assistant_content({"role": "assistant", "content": "x"}) == "x"
    assert assistant_content({"role": "assistant", "content": "x", "reasoning_content": "r"}) == (
        "<think>\nr\n</think>\n\nx"
    )
    assert assistant_content({"role": "assistant", "content": None, "reasoning_content": "r"}) == (
        "<think>\nr\n</think>\n\n"
    )


def test_read_jsonl_reports_bad_lines(tmp_path) -> None:
    lines = [
        json.dumps({"prompt": "first"}),
        "",
        "{not json",
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
        "   ",
        json.dumps({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}),
        "[1, 2]",
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    results = list(read_jsonl(path))
    assert [n for n, _ in results] == [1, 3, 4, 6, 7]
    kinds = {n: r for n, r in results}
    assert isinstance(kinds[1], Conversation) and isinstance(kinds[6], Conversation)
    assert isinstance(kinds[3], RecordError) and kinds[3].line_no == 3
    assert "line 3" in str(kinds[3]) and "invalid JSON" in str(kinds[3])
    assert isinstance(kinds[4], ValueError) and "line 4" in str(kinds[4])
    assert isinstance(kinds[7], ValueError) and "line 7" in str(kinds[7])

    gz = tmp_path / "data.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    assert [n for n, _ in read_jsonl(gz)] == [1, 3, 4, 6, 7]


# ---- self-prompting ------------------------------------------------------------------------------------


USER_PREFIX = {
    "llama3": ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"),
    "llama3_1": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
    ),
    "chatml": f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n<|im_start|>user\n",
    "deepseek_v3": "<｜begin▁of▁sentence｜><｜User｜>",
}
USER_PREFIX_WITH_SYSTEM = {
    "llama3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
    ),
    "llama3_1": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
    ),
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n",
    "deepseek_v3": "<｜begin▁of▁sentence｜>Be brief.<｜User｜>",
}
STOPS = {
    "llama3": ["<|eot_id|>"],
    "llama3_1": ["<|eot_id|>"],
    "chatml": ["<|im_end|>"],
    "deepseek_v3": ["<｜end▁of▁sentence｜>", "<｜Assistant｜>"],
}


def test_user_turn_prefix(style: str, tok) -> None:
    assert user_turn_prefix(tok) == USER_PREFIX[style]
    assert user_turn_prefix(tok, system="Be brief.") == USER_PREFIX_WITH_SYSTEM[style]
    # Tokenized as a serving engine would: exactly one BOS.
    ids = chat.encode_rendered(tok, user_turn_prefix(tok))
    if style != "chatml":
        assert ids.count(tok.convert_tokens_to_ids(tok.bos_token)) == 1


def test_assistant_turn_prefix_and_stops(style: str, tok) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    prefix = assistant_turn_prefix(tok, messages)
    after_user = {"llama3": EOT["llama3"], "llama3_1": EOT["llama3_1"], "chatml": "<|im_end|>\n"}
    assert prefix.endswith("Hi" + after_user.get(style, "") + GEN_HEADER[style])
    assert end_of_turn_texts(tok) == STOPS[style]
    assert tok.eos_token in end_of_turn_texts(tok)


def test_stop_tokens_come_from_the_template_for_decode_and_generate_alike():
    """An end-of-turn token no hard-coded list would know: decode, bench and generate all stop on it."""
    from draftsmith.data.chat import stop_token_ids, stop_tokens

    tok = make_tokenizer("chatml")
    tok.add_special_tokens({"additional_special_tokens": ["<|turn_done|>"]})
    tok.chat_template = CHATML_TEMPLATE.replace("<|im_end|>", "<|turn_done|>")
    tok.eos_token = "<|endoftext|>"
    done = tok.convert_tokens_to_ids("<|turn_done|>")
    ids, texts = stop_tokens(tok)
    assert done in stop_token_ids(tok)
    assert set(stop_token_ids(tok)) == ids and texts == []
    assert tok.convert_tokens_to_ids("<|im_end|>") not in ids  # not this template's end of turn
