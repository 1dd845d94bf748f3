"""Jobs: what to generate for one input line, what a turn and a conversation come back as, and seeds."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class _Job:
    """One conversation to produce. `segments[k]` are the system/user messages before assistant turn k."""

    id: str
    line: int | None
    segments: list[list[dict[str, str]]]


@dataclass
class _Reply:
    """One generated assistant turn."""

    content: str
    reasoning: str | None = None
    finish_reason: str | None = None
    num_tokens: int | None = None


@dataclass
class _Outcome:
    job: _Job
    messages: list[dict[str, str]] | None = None
    error: str | None = None
    num_tokens: int | None = None
    finish_reasons: list[str | None] = field(default_factory=list)
    truncated: bool = False


def plan_turns(messages: Sequence[Mapping[str, str]], system: str | None = None) -> list[list[dict[str, str]]]:
    """Split a conversation into the messages preceding each assistant turn to regenerate.

    Existing assistant turns only mark where the target answers; their text is dropped. An assistant turn
    with no user message before it (a greeting, two replies in a row) is dropped rather than regenerated
    from nothing, and a trailing user turn is answered. `system` is prepended when the conversation has
    no system message of its own. Returns [] when there is no user turn.
    """
    segments: list[list[dict[str, str]]] = []
    current: list[dict[str, str]] = []
    if system is not None and not (messages and messages[0]["role"] == "system"):
        current.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "assistant":
            if any(x["role"] == "user" for x in current):
                segments.append(current)
                current = []
            continue
        current.append({"role": m["role"], "content": m["content"]})
    if any(x["role"] == "user" for x in current):
        segments.append(current)
    return segments


def _derive_seed(seed: int, key: str) -> int:
    """A per-item seed independent of batching and of which items a resumed run still has to do."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _normalise_question(text: str) -> str:
    """The key self-prompted questions are deduplicated by, in this run and against an earlier one."""
    return " ".join(text.lower().split())
