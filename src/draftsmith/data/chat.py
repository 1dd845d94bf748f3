"""Conversations in, token ids and an assistant-only loss mask out.

A drafter is trained to predict what the target model *generates*, so the loss mask must cover exactly
the assistant's tokens, including the end-of-turn token (the drafter has to learn when the target
stops) and nothing the serving engine feeds in: system/user turns and role headers. Chat templates
differ per model, so nothing here is hard-coded per family. Instead the template is probed once with
sentinel messages to learn what it emits after an assistant's content (its end-of-turn marker); a real
conversation is rendered as text, each assistant content is located in that text, extended over the
marker, and the character spans are mapped onto tokens through the fast tokenizer's offsets.

Records come in through `draftsmith.data.records` (re-exported here); this module also exposes the
template prefixes a Magpie-style generator needs to let the target write its own prompts.
"""

from __future__ import annotations

import bisect
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from draftsmith.core.errors import DraftsmithError
from draftsmith.data.records import (
    ROLES,
    Conversation,
    EmptyConversation,
    RecordError,
    assistant_content,
    conversation_id,
    normalize_message,
    parse_record,
    read_jsonl,
)

__all__ = [
    "ROLES",
    "ChatFormat",
    "ChatTemplateError",
    "Conversation",
    "EmptyConversation",
    "RecordError",
    "SequenceTooLong",
    "TokenizedConversation",
    "assistant_content",
    "assistant_turn_prefix",
    "chat_format",
    "conversation_id",
    "encode_rendered",
    "encode_prompt",
    "end_of_turn_texts",
    "stop_token_ids",
    "stop_tokens",
    "parse_record",
    "read_jsonl",
    "tokenize_conversation",
    "user_turn_prefix",
]

# Sentinels for probing templates: plain ASCII without whitespace so `| trim` and friends leave them alone.
_USER_PROBE = "dsprobeU7f3a9c"
_USER_PROBE_2 = "dsprobeV7f3a9c"
_ASSISTANT_PROBE = "dsprobeA7f3a9c"
_SYSTEM_PROBE = "dsprobeS7f3a9c"


class ChatTemplateError(DraftsmithError, ValueError):
    """The tokenizer's chat template is missing, fails to render, or hides the assistant's content."""


class SequenceTooLong(DraftsmithError, ValueError):
    """The tokenized conversation exceeds `max_length` and truncation was not allowed."""

    def __init__(self, length: int, max_length: int) -> None:
        super().__init__(f"conversation has {length} tokens, more than max_length={max_length}")
        self.length = length
        self.max_length = max_length


@dataclass
class TokenizedConversation:
    """Token ids of the rendered chat and a 0/1 mask that is 1 on assistant-generated tokens."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True)
class ChatFormat:
    """What probing a tokenizer's chat template learned.

    `assistant_ends` are the texts the template emits right after an assistant's content, up to and
    including the first control token (longest first; e.g. ``<|im_end|>``); `stop_texts` are the bare
    control tokens that end a turn (assistant end, user end, eos) for a generator to stop on.
    """

    name: str
    assistant_ends: tuple[str, ...]
    stop_texts: tuple[str, ...] = field(default=())


# --------------------------------------------------------------------------------------------------------
# Template probing


def _tokenizer_name(tokenizer: Any) -> str:
    name = getattr(tokenizer, "name_or_path", None) or ""
    cls = type(tokenizer).__name__
    return f"{name!r} ({cls})" if name else cls


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Render with the tokenizer's template, turning any failure into a ChatTemplateError."""
    name = _tokenizer_name(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"tokenizer {name} has no chat template; set tokenizer.chat_template or use a chat model's tokenizer"
        )
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # Jinja errors, raise_exception() in templates, missing variables ...
        raise ChatTemplateError(f"chat template of tokenizer {name} failed to render: {exc}") from exc
    if not isinstance(out, str):
        raise ChatTemplateError(f"chat template of tokenizer {name} rendered {type(out).__name__}, not text")
    return out


def _control_tokens(tokenizer: Any) -> list[str]:
    """Special and added tokens (plus eos), longest first: the candidates for turn markers."""
    found: set[str] = set()
    for tok in getattr(tokenizer, "all_special_tokens", None) or []:
        found.add(str(tok))
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for tok in decoder.values():
        found.add(str(getattr(tok, "content", tok)))
    eos = getattr(tokenizer, "eos_token", None)
    if eos:
        found.add(str(eos))
    return sorted((t for t in found if t), key=lambda t: (-len(t), t))


def _first_control(tail: str, controls: Sequence[str]) -> tuple[str, str] | None:
    """(text up to and including the first control token in `tail`, that token), or None."""
    best: tuple[int, str] | None = None
    for tok in controls:  # longest first, so on a tie at one position the longest token wins
        i = tail.find(tok)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, tok)
    if best is None:
        return None
    i, tok = best
    return tail[: i + len(tok)], tok


def _probe(tokenizer: Any) -> ChatFormat:
    name = _tokenizer_name(tokenizer)
    controls = _control_tokens(tokenizer)
    user = {"role": "user", "content": _USER_PROBE}
    assistant = {"role": "assistant", "content": _ASSISTANT_PROBE}
    # Some templates insist on a system message or reject a trailing user turn: try plain shapes first.
    final_render: str | None = None
    first_error: ChatTemplateError | None = None
    for prefix in ([], [{"role": "system", "content": _SYSTEM_PROBE}]):
        try:
            final_render = _render(tokenizer, [*prefix, user, assistant])
            break
        except ChatTemplateError as exc:
            first_error = first_error or exc
    if final_render is None:
        assert first_error is not None
        raise first_error
    if _ASSISTANT_PROBE not in final_render:
        raise ChatTemplateError(
            f"chat template of tokenizer {name} does not render assistant message content, so the "
            "assistant tokens cannot be located"
        )

    ends: list[str] = []
    stops: list[str] = []
    # End of the final assistant turn: everything after its content to the end of the render.
    tail = final_render[final_render.rindex(_ASSISTANT_PROBE) + len(_ASSISTANT_PROBE) :]
    hit = _first_control(tail, controls)
    if hit:
        ends.append(hit[0])
        stops.append(hit[1])
    # End of a mid-conversation assistant turn: up to the next user's content.
    try:
        mid = _render(tokenizer, [user, assistant, {"role": "user", "content": _USER_PROBE_2}])
        start = mid.find(_ASSISTANT_PROBE)
        stop = mid.find(_USER_PROBE_2, start)
        if start >= 0 and stop >= 0:
            hit = _first_control(mid[start + len(_ASSISTANT_PROBE) : stop], controls)
            if hit:
                ends.append(hit[0])
                stops.append(hit[1])
    except ChatTemplateError:
        pass
    # End of a user turn (for a self-prompting generator writing the user's question).
    try:
        gen = _render(tokenizer, [user], add_generation_prompt=True)
        if _USER_PROBE in gen:
            hit = _first_control(gen[gen.index(_USER_PROBE) + len(_USER_PROBE) :], controls)
            if hit:
                stops.append(hit[1])
    except ChatTemplateError:
        pass
    eos = getattr(tokenizer, "eos_token", None)
    if eos:
        stops.append(str(eos))
    uniq_ends = tuple(sorted(dict.fromkeys(e for e in ends if e), key=len, reverse=True))
    return ChatFormat(name=name, assistant_ends=uniq_ends, stop_texts=tuple(dict.fromkeys(stops)))


_FORMATS: weakref.WeakKeyDictionary[Any, tuple[tuple[str, ...], ChatFormat]] = weakref.WeakKeyDictionary()


def chat_format(tokenizer: Any) -> ChatFormat:
    """Probe (and cache per tokenizer) its chat template; call once up front to fail fast.

    Raises ChatTemplateError naming the tokenizer when there is no usable template.
    """
    key = (
        repr(getattr(tokenizer, "chat_template", None)),
        str(getattr(tokenizer, "bos_token", None)),
        str(getattr(tokenizer, "eos_token", None)),
        str(len(getattr(tokenizer, "added_tokens_decoder", None) or {})),
    )
    try:
        cached = _FORMATS.get(tokenizer)
    except TypeError:  # not weak-referenceable
        return _probe(tokenizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    fmt = _probe(tokenizer)
    _FORMATS[tokenizer] = (key, fmt)
    return fmt


# --------------------------------------------------------------------------------------------------------
# Tokenisation with the loss mask


def _prepare(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    return [normalize_message(m, f"message {i}") for i, m in enumerate(messages)]


def _find_candidates(content: str, assistant: bool) -> list[str]:
    """Forms a template may render a content in: verbatim, trimmed, and (assistant) without reasoning."""
    out = [content, content.strip()]
    if assistant and "</think>" in content:
        # Reasoning templates (DeepSeek-R1, Qwen3) drop the thinking of earlier turns.
        out.append(content.split("</think>")[-1].strip())
    return [c for c in dict.fromkeys(out) if c]


_WS = re.compile(r"\s*")


def _end_after(text: str, pos: int, ends: Sequence[str]) -> int | None:
    """Position just after the end-of-turn marker that follows `pos`, or None when none follows."""
    for end in ends:
        if text.startswith(end, pos):
            return pos + len(end)
    gap = _WS.match(text, pos)
    after = gap.end() if gap else pos
    for end in ends:
        core = end.lstrip()
        if core and text.startswith(core, after):
            return after + len(core)
    return None


def _assistant_spans(text: str, messages: list[dict[str, str]], fmt: ChatFormat) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant content plus its end-of-turn marker in `text`.

    Messages are located in order, each searching forward from the previous one; user contents are
    consumed too so an assistant reply that repeats the user's words is not matched inside the user
    turn. System messages are skipped because templates move them around (or add default ones).
    """
    cursor = 0
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "system":
            continue
        if role == "user":
            for cand in _find_candidates(content, assistant=False):
                j = text.find(cand, cursor)
                if j >= 0:
                    cursor = j + len(cand)
                    break
            continue
        located: tuple[int, int] | None = None
        for cand in _find_candidates(content, assistant=True):
            first = text.find(cand, cursor)
            if first < 0:
                continue
            # Prefer the first occurrence that is closed by an end-of-turn marker: a reply such as
            # "assistant" also occurs inside the role header.
            j = first
            while j >= 0:
                end = _end_after(text, j + len(cand), fmt.assistant_ends) if fmt.assistant_ends else None
                if end is not None:
                    located = (j, end)
                    break
                j = text.find(cand, j + 1)
            if located is None:
                located = (first, first + len(cand))
            break
        if located is None:
            if not content.strip():
                continue  # an empty reply has nothing to locate and nothing to learn
            raise ChatTemplateError(
                f"assistant message {i} was not found in the text rendered by the chat template of "
                f"tokenizer {fmt.name} (the template rewrites assistant content)"
            )
        spans.append(located)
        cursor = located[1]
    return spans


def _strip_span(text: str, start: int, end: int) -> tuple[int, int]:
    """Shrink a token's span by surrounding whitespace (byte-level and metaspace tokens carry it)."""
    s, e = start, end
    while s < e and text[s].isspace():
        s += 1
    while e > s and text[e - 1].isspace():
        e -= 1
    return (s, e) if s < e else (start, end)


def _mask_from_offsets(text: str, offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    starts = [s for s, _ in spans]
    mask = []
    for start, end in offsets:
        if end <= start:  # zero-width: tokens inserted by a post-processor
            mask.append(0)
            continue
        s, e = _strip_span(text, start, end)
        k = bisect.bisect_right(starts, s) - 1
        mask.append(int(k >= 0 and e <= spans[k][1]))
    return mask


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """Token ids of template-rendered text exactly as a serving engine would see them.

    The template already writes BOS and every control token, and vLLM/SGLang/transformers tokenize
    chat renders with ``add_special_tokens=False``; adding special tokens here would double BOS and
    make the drafter train on a prefix the target never sees.
    """
    return _encode(tokenizer, text)


def _encode_masked(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
        ids = list(enc["input_ids"])
    except (NotImplementedError, TypeError, ValueError, KeyError):
        offsets = None
    if offsets is None or len(offsets) != len(ids):
        return _encode_segments(tokenizer, text, spans)
    return ids, _mask_from_offsets(text, offsets, spans)


def _encode_segments(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Fallback for tokenizers without offsets: tokenize masked and unmasked pieces separately.

    Boundaries fall on role headers and control tokens, where merges rarely cross, so the ids match
    whole-text tokenization for common templates.
    """
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for start, end in spans:
        for a, b, m in ((pos, start, 0), (start, end, 1)):
            if b > a:
                piece = _encode(tokenizer, text[a:b])
                ids.extend(piece)
                mask.extend([m] * len(piece))
        pos = end
    if pos < len(text):
        piece = _encode(tokenizer, text[pos:])
        ids.extend(piece)
        mask.extend([0] * len(piece))
    return ids, mask


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    max_length: int | None = None,
    truncate: bool = True,
) -> TokenizedConversation:
    """Render `messages` with the tokenizer's chat template; mask 1 exactly on assistant-generated tokens.

    Masked: each assistant content (reasoning kept, see `assistant_content`) and the end-of-turn
    token(s) the template writes right after it. Unmasked: system/user turns, role headers, and
    anything after the end-of-turn token. Raises EmptyConversation when there is no assistant token
    (also after truncation), ChatTemplateError when the template is unusable, SequenceTooLong when
    longer than `max_length` and `truncate` is False.
    """
    if max_length is not None and max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    msgs = _prepare(messages)
    if not msgs:
        raise EmptyConversation("conversation has no messages")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
        raise EmptyConversation("conversation has no assistant content")
    fmt = chat_format(tokenizer)
    text = _render(tokenizer, msgs)
    spans = _assistant_spans(text, msgs, fmt)
    ids, mask = _encode_masked(tokenizer, text, spans)
    if not any(mask):
        raise EmptyConversation("no assistant tokens in the rendered conversation")
    truncated = False
    if max_length is not None and len(ids) > max_length:
        if not truncate:
            raise SequenceTooLong(len(ids), max_length)
        ids, mask, truncated = ids[:max_length], mask[:max_length], True
        if not any(mask):
            raise EmptyConversation(f"no assistant tokens within the first {max_length} tokens")
    return TokenizedConversation(input_ids=ids, loss_mask=mask, truncated=truncated)


# --------------------------------------------------------------------------------------------------------
# Self-prompting (Magpie)


def user_turn_prefix(tokenizer: Any, system: str | None = None) -> str:
    """Text the template emits before a user's content (BOS, system block, user header).

    Magpie: feed this to the target model and it writes a plausible user question itself, giving
    prompts from the target's own distribution without any dataset. Tokenize with `encode_rendered`.
    """
    messages = [{"role": "user", "content": _USER_PROBE}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    text = _render(tokenizer, messages)
    i = text.find(_USER_PROBE)
    if i < 0:
        raise ChatTemplateError(
            f"chat template of tokenizer {_tokenizer_name(tokenizer)} does not render user message content"
        )
    return text[:i]


def assistant_turn_prefix(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> str:
    """The rendered conversation followed by the assistant header, ready for the target to answer."""
    msgs = _prepare(messages)
    if not msgs:
        raise EmptyConversation("conversation has no messages")
    return _render(tokenizer, msgs, add_generation_prompt=True)


def end_of_turn_texts(tokenizer: Any) -> list[str]:
    """Control tokens that end a turn, for a generator's stop strings.

    The assistant end-of-turn token(s) found by probing the template, then the token that closes a
    user turn (e.g. DeepSeek's ``<｜Assistant｜>``, which a Magpie user-turn generation stops on), then
    eos; duplicates removed, order kept.
    """
    return list(chat_format(tokenizer).stop_texts)


# --------------------------------------------------------------------------------------------------------
# Stopping: one definition for generate, decode and bench


def stop_tokens(tokenizer: Any, extra_eos: Any = None) -> tuple[set[int], list[str]]:
    """Where an assistant turn ends: (token ids, texts that are more than one token).

    eos (and `extra_eos`, e.g. a generation config's), plus the template's end-of-turn texts found by
    probing it (`end_of_turn_texts`): single tokens as ids, longer ones as text for engines that stop on
    strings. A tokenizer without a chat template stops on eos only.
    """
    ids: set[int] = set()
    for c in (tokenizer.eos_token_id, extra_eos):
        for x in c if isinstance(c, list | tuple) else [c]:
            if x is not None:
                ids.add(int(x))
    texts: list[str] = []
    if getattr(tokenizer, "chat_template", None):
        for text in end_of_turn_texts(tokenizer):
            enc = tokenizer.encode(text, add_special_tokens=False)
            if len(enc) == 1:
                ids.add(int(enc[0]))
            else:
                texts.append(text)
    return ids, texts


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The token ids a decoder stops on (see `stop_tokens`), sorted."""
    return sorted(stop_tokens(tokenizer)[0])


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """A user prompt as token ids: wrapped in the chat template as one user turn, or as plain text."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(f"--chat: tokenizer {tokenizer.name_or_path!r} has no chat template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]
