"""Output, resume, progress: what an earlier run finished, the record writer, the progress bar."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.stages.generate.jobs import _normalise_question


@dataclass
class _Finished:
    """What an earlier run completed: ids only (plus self-prompted questions for deduplication)."""

    ids: set[str] = field(default_factory=set)
    questions: set[str] = field(default_factory=set)
    unreadable: int = 0


def _cut_torn_tail(out: Path) -> None:
    """Drop a last line without its newline: the record being written when the run was killed."""
    with open(out, "rb+") as fh:
        size = fh.seek(0, os.SEEK_END)
        pos = size
        while pos > 0:
            step = min(1 << 16, pos)
            fh.seek(pos - step)
            chunk = fh.read(step)
            i = chunk.rfind(b"\n")
            if i >= 0:
                pos = pos - step + i + 1
                break
            pos -= step
        if pos < size:
            fh.truncate(pos)


def _read_finished(out: Path) -> _Finished:
    """Scan an earlier run's output (streamed: it may hold hundreds of thousands of conversations)."""
    done = _Finished()
    if not out.exists():
        return done
    _cut_torn_tail(out)
    with open(out, "rb") as fh:
        for raw in fh:
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except ValueError:
                done.unreadable += 1
                continue
            if not (isinstance(rec, dict) and isinstance(rec.get("id"), str) and isinstance(rec.get("messages"), list)):
                done.unreadable += 1
                continue
            done.ids.add(rec["id"])
            if rec["id"].startswith("self-"):
                users = [m.get("content") for m in rec["messages"] if isinstance(m, dict) and m.get("role") == "user"]
                if users and isinstance(users[0], str):
                    done.questions.add(_normalise_question(users[0]))
    return done


class _Writer:
    """Append one JSON line per record and flush it; fsync at most every few seconds (and on close)."""

    def __init__(self, path: Path, fsync_every: float, mode: str = "a") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = open(path, mode, encoding="utf-8", buffering=1)  # noqa: SIM115 (closed in close())
        self._every = fsync_every
        self._last = time.monotonic()
        self.count = 0

    def write(self, record: Mapping[str, Any]) -> None:
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()
        self.count += 1
        now = time.monotonic()
        if now - self._last >= self._every:
            os.fsync(self._fh.fileno())
            self._last = now

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()


class _Progress:
    """tqdm on stderr: input lines as they end, with conversations/s and generated tokens/s of this run's new work.

    Batched backends hand over a whole round at once, minutes apart (vLLM: 256 conversations). With tqdm's
    defaults the bar drew only the first record of a round (it draws at most every 0.1 s) and then sat on it
    until the next round, and its ETA was a moving average of the rate between draws, i.e. one conversation
    per round: `1/800 [09:24<125:13:57]` with 256 on disk. So every line the backend finishes is drawn, and
    the ETA is the run's average rate over the lines it worked on; lines that end without the backend (done
    by an earlier run, skipped, unreadable) advance the bar but stay out of that rate (tqdm's ``initial``).
    """

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="conv", file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                        desc="generate", smoothing=0, miniters=1)
        self.start = time.monotonic()
        self.new = 0
        self.tokens = 0

    def step(self, generated: bool, tokens: int | None = None, *, worked: bool = True) -> None:
        """Count one input line that ended: `generated` (its record written) or not; `worked`: by the backend."""
        if generated:
            self.new += 1
            self.tokens += tokens or 0
            elapsed = max(time.monotonic() - self.start, 1e-9)
            self.bar.set_postfix_str(f"{self.new / elapsed:.2f} conv/s, {self.tokens / elapsed:.1f} tok/s",
                                     refresh=False)
        if not worked and not self.bar.disable:
            self.bar.initial += 1  # took no time: counting it in the rate would shrink the ETA
        if not self.bar.update(1) and worked:
            self.bar.refresh()  # drawn even when its round lands within tqdm's 0.1 s between draws

    def close(self) -> None:
        self.bar.close()


def _count_lines(path: Path) -> int:
    """Non-blank lines, for the progress bar's total (same rule as chat.read_jsonl)."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())
