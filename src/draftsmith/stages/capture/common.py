"""What every capture backend shares: the config, the counts and report, the store meta, and the reading side.

Reading, de-duplicating, resuming (``has()`` before tokenizing), tokenizing with loss masks, counting every
record into one bucket and writing the errors sidecar happen here once (``_Run``, ``capture_with``); a
backend only says how a window of tokenized conversations becomes features (``run_window``): the HF prefill
in ``hf.py``, vLLM's engine and the spool ingest in ``vllm.py``.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from draftsmith import __version__
from draftsmith.core.errors import UsageError, one_line
from draftsmith.core.fingerprint import tokenizer_fingerprint
from draftsmith.data.chat import (
    ChatTemplateError,
    EmptyConversation,
    SequenceTooLong,
    chat_format,
    tokenize_conversation,
)
from draftsmith.data.prompts import (
    EvaluationPromptDropped,
    conversation_source,
    drop_evaluation_prompts,
    evaluation_keys,
)
from draftsmith.data.records import Conversation, first_turns, read_records
from draftsmith.data.store import LOCK_NAME, MANIFEST_NAME, FeatureStore, FeatureStoreWriter

LongPolicy = Literal["truncate", "skip"]
_SHOWN_REASONS = 3  # skipped lines named in the one-line error of an unusable input


class CaptureInputError(UsageError):
    """The conversations file holds no usable conversation (empty, or every line skipped)."""


def errors_path(out: str | Path) -> Path:
    """The sidecar listing the input lines this run skipped and why (``STORE.errors.jsonl``, as generate's)."""
    out = Path(out)
    if not out.name:
        out = out.absolute()
    return out.with_name(out.name + ".errors.jsonl")
AUX_CONVENTION = "input of decoder layer L = HF output_hidden_states[L] (vLLM ids; SGLang/SpecForge ids are L-1)"


# --- configuration and results ------------------------------------------------------------------------


@dataclass
class CaptureConfig:
    """Everything one capture run needs; ``target``/``device``/``target_dtype``/``aux_layers`` are only
    read by ``run_capture`` (``capture`` takes an already loaded target)."""

    conversations: Path
    out: Path
    target: str = "smollm2"
    device: str = "cpu"
    target_dtype: str | None = None  # float32 | bfloat16 | float16; default float32 on CPU, bf16 on CUDA
    aux_layers: tuple[int, ...] | None = None
    dtype: Literal["bf16", "fp8"] = "bf16"  # store dtype
    max_length: int = 2048
    long: LongPolicy = "truncate"
    batch_size: int = 8
    max_tokens_per_batch: int | None = 16384  # padded tokens per forward pass
    draft_vocab_size: int | None = 32000  # None: skip the vocab step
    limit: int | None = None  # read at most this many records
    max_turns: int | None = None  # keep each conversation's first N user turns (and their answers)
    shard_max_bytes: int = 256 * 1024 * 1024
    flush_interval_s: float = 60.0
    sort_window: int = 1024
    progress: bool | None = None  # None: a bar only when stderr is a terminal

    def validate(self) -> None:
        """Reject bad values before a multi-minute target load, with the flag's name in the message."""
        self.conversations, self.out = conversation_source(self.conversations), Path(self.out)
        if self.dtype not in ("bf16", "fp8"):
            raise ValueError(f"--dtype must be bf16 or fp8, got {self.dtype!r}")
        if self.long not in ("truncate", "skip"):
            raise ValueError(f"--long must be truncate or skip, got {self.long!r}")
        for name in ("max_length", "batch_size", "sort_window", "shard_max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens_per_batch is not None and self.max_tokens_per_batch < 1:
            raise ValueError(f"--max-tokens-per-batch must be >= 1, got {self.max_tokens_per_batch}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"--draft-vocab-size must be >= 1, got {self.draft_vocab_size}")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"--limit must be >= 0, got {self.limit}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"--max-turns must be >= 1, got {self.max_turns}")
        if self.target_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"--target-dtype must be float32, bfloat16 or float16, got {self.target_dtype!r}")
        if not self.conversations.exists():
            raise FileNotFoundError(f"{self.conversations}: no such conversations file")
        if not self.conversations.is_file():
            raise ValueError(f"{self.conversations}: not a file")
        if self.out.exists():
            if not self.out.is_dir():
                raise ValueError(f"--out {self.out}: exists and is not a directory")
            # A writer killed before its first manifest leaves only its lock or temp files behind.
            foreign = [p for p in self.out.iterdir()
                       if p.name != LOCK_NAME and not (p.name.startswith(".") and p.name.endswith(".tmp"))]
            if not (self.out / MANIFEST_NAME).is_file() and foreign:
                raise ValueError(f"--out {self.out}: directory is not empty and is not a feature store")
        else:
            parent = next((p for p in self.out.parents if p.exists()), None)
            if parent is not None and not parent.is_dir():
                raise ValueError(f"--out {self.out}: {parent} is not a directory")


@dataclass
class CaptureCounts:
    """Where each input record went. Every record lands in exactly one bucket except ``truncated``,
    which counts captured samples cut to ``max_length`` (a subset of ``captured``)."""

    records: int = 0  # non-blank input lines read (the total the buckets add up to)
    captured: int = 0
    already_stored: int = 0  # committed by an earlier run: resume
    duplicate_id: int = 0  # id seen earlier in this input
    invalid: int = 0  # bad JSON, unknown record shape, bad message, ids outside the target vocab
    evaluation_prompt: int = 0  # a user turn is an MT-bench/HumanEval prompt: never trained on
    template_error: int = 0  # the chat template hides or rewrites assistant content
    no_loss_tokens: int = 0  # no assistant token to learn from (also after truncation)
    too_long: int = 0  # longer than max_length under the "skip" policy
    nonfinite: int = 0  # NaN/Inf in the features: never stored
    truncated: int = 0  # captured, but cut to max_length

    BUCKETS = ("captured", "already_stored", "duplicate_id", "invalid", "evaluation_prompt", "template_error",
               "no_loss_tokens", "too_long", "nonfinite")

    def accounted(self) -> int:
        return sum(getattr(self, b) for b in self.BUCKETS)

    def check(self) -> None:
        """Raise if a record fell through the cracks (a bug, not a data problem)."""
        if self.accounted() != self.records:
            raise AssertionError(f"capture counts do not add up: {self.accounted()} accounted of {self.records}")


@dataclass
class VocabReport:
    """The draft vocabulary built from a store."""

    path: Path
    draft_vocab_size: int
    vocab_size: int
    coverage: float  # share of loss-position tokens inside the draft vocabulary
    counted_tokens: int
    distinct_tokens: int

    def summary(self) -> str:
        return (f"draft vocab: {self.draft_vocab_size} of {self.vocab_size} tokens cover {self.coverage:.2%} of "
                f"{self.counted_tokens} loss tokens ({self.distinct_tokens} distinct) -> {self.path}")


@dataclass
class CaptureReport:
    """Counts, throughput and the resulting store of one capture run."""

    store: Path
    counts: CaptureCounts
    tokens: int = 0  # real (unpadded) tokens captured this run
    loss_tokens: int = 0
    padded_tokens: int = 0  # tokens actually run through the target, padding included
    forward_s: float = 0.0
    elapsed_s: float = 0.0
    store_samples: int = 0
    store_tokens: int = 0
    store_bytes: int = 0
    vocab: VocabReport | None = None
    notes: list[str] = field(default_factory=list)
    skipped_lines: int = 0  # input lines not captured for a reason (listed in errors_file)
    errors_file: Path | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.counts.captured / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.store_bytes / self.store_tokens if self.store_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        c = asdict(self.counts)
        return {
            "store": str(self.store), "counts": c, "tokens": self.tokens, "loss_tokens": self.loss_tokens,
            "padded_tokens": self.padded_tokens, "forward_s": round(self.forward_s, 4),
            "elapsed_s": round(self.elapsed_s, 4), "tokens_per_s": round(self.tokens_per_s, 2),
            "samples_per_s": round(self.samples_per_s, 3), "store_samples": self.store_samples,
            "store_tokens": self.store_tokens, "store_bytes": self.store_bytes,
            "bytes_per_token": round(self.bytes_per_token, 1),
            "vocab": None if self.vocab is None else {**asdict(self.vocab), "path": str(self.vocab.path)},
            "notes": list(self.notes),
            "skipped_lines": self.skipped_lines,
            "errors_file": None if self.errors_file is None else str(self.errors_file),
        }

    def summary(self) -> str:
        c = self.counts
        parts = [f"{b.replace('_', ' ')} {getattr(c, b)}" for b in c.BUCKETS if getattr(c, b) or b == "captured"]
        lines = [
            f"records {c.records} = " + " + ".join(parts) + (f" (truncated {c.truncated})" if c.truncated else ""),
            f"captured {self.tokens} tokens ({self.loss_tokens} loss tokens) in {self.elapsed_s:.1f} s: "
            f"{self.tokens_per_s:.0f} tok/s, {self.samples_per_s:.1f} samples/s; padding overhead "
            f"{(self.padded_tokens / self.tokens - 1) if self.tokens else 0.0:.1%}",
            f"store {self.store}: {self.store_samples} samples, {self.store_tokens} tokens, "
            f"{self.store_bytes / 2**20:.1f} MiB ({self.bytes_per_token:.0f} B/token)",
        ]
        if self.vocab is not None:
            lines.append(self.vocab.summary())
        if self.errors_file is not None:
            n = self.skipped_lines
            lines.append(f"skipped {n} line{'s' if n != 1 else ''}; reasons in {self.errors_file}")
        lines.extend(self.notes)
        return "\n".join(lines)


# --- the store's provenance and the reading side ----------------------------------------------------------
#: What a store holds: the target's features (aux hidden states at any layers, the final hidden state), which
#: every drafter kind trains from. Stores written before the block kinds name it by its first user.
FEATURES_KIND = "target-features"
LEGACY_FEATURES_KINDS = ("eagle3-features",)


def store_meta(target, tokenizer, *, max_length: int, long: LongPolicy, target_dtype: str | None = None
               ) -> dict[str, Any]:
    """The provenance a store carries; identical meta is what lets a rerun resume into the same store.

    ``target_dtype`` names the dtype the features were computed in when ``target`` is not what computed them
    (vLLM capture: a weightless view of the target gives the fingerprint, the engine the numbers).
    """
    return {
        "kind": FEATURES_KIND,
        "aux_layer_ids": [int(x) for x in target.aux_layers],
        "aux_layer_convention": AUX_CONVENTION,
        "hidden_size": int(target.hidden_size),
        "hidden_state": "final decoder output after the final norm (teacher)",
        "target_fingerprint": target.fingerprint(),
        "target_dtype": target_dtype or str(target.dtype).removeprefix("torch."),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "draftsmith_version": __version__,
        "max_length": int(max_length),
        "long_policy": long,
    }


def resume_meta(root: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` as an existing store at ``root`` names its kind: a store written under the legacy kind name (same
    features) resumes instead of being refused as different. Anything else about the store is the writer's to
    check."""
    try:
        stored = json.loads((Path(root) / MANIFEST_NAME).read_text(encoding="utf-8")).get("meta") or {}
    except (OSError, ValueError, AttributeError, RecursionError):  # none yet, or the writer's error to report
        return meta
    if stored.get("kind") in LEGACY_FEATURES_KINDS and meta.get("kind") == FEATURES_KIND:
        return {**meta, "kind": stored["kind"]}
    return meta


def read_conversations(config: CaptureConfig):
    """``(line, conversation or error)`` for the input (JSONL or a JSON array such as ShareGPT's), with
    evaluation prompts turned into errors and each conversation cut to ``max_turns``."""
    records = drop_evaluation_prompts(read_records(config.conversations), evaluation_keys())
    for line_no, item in records:
        yield line_no, first_turns(item, config.max_turns) if isinstance(item, Conversation) else item


def record_tokens(config: CaptureConfig, tokenizer: Any) -> list[int]:
    """Tokens capture would store for each record it reads, in order, up to ``config.limit`` (0: one it skips).

    What a budget needs to size capture before running it: tokenizing is a small fraction of a forward pass.
    """
    out: list[int] = []
    for _, item in read_conversations(config):
        if config.limit is not None and len(out) >= config.limit:
            break
        if isinstance(item, Exception):  # a record capture reports and skips
            out.append(0)
            continue
        try:
            ids = tokenize_conversation(tokenizer, item.messages, config.max_length,
                                        truncate=config.long == "truncate").input_ids
        except ValueError:  # skipped by capture too (too long, nothing to learn from, a template error)
            ids = []
        out.append(len(ids))
    return out


def _count_records(path: Path, limit: int | None) -> int:
    if path.suffix == ".json":  # an array has no lines to count: the limit is the total, else one parsing pass
        return limit if limit is not None else sum(1 for _ in read_records(path))
    opener = gzip.open if path.suffix == ".gz" else open
    n = 0
    with opener(path, "rb") as fh:
        for raw in fh:
            if raw.strip():
                n += 1
                if limit is not None and n >= limit:
                    break
    return n


class _Progress:
    """tqdm bar over the tokens prefilled, with records and samples/s beside it (stderr: stdout stays clean).

    Tokens, not records: each window runs longest first, so records come out at a rate that climbs through
    the window, and a bar over records promised the end far too early. A window's tokens are known once it is
    tokenized; past it, the total is estimated from the tokens per record read so far.
    """

    def __init__(self, total_records: int | None, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=None, unit="tok", unit_scale=True, desc="capture", disable=not enabled,
                        file=sys.stderr, dynamic_ncols=True)
        self.total_records = total_records
        self.expected = 0  # tokens of the records read so far (0 for a record that is skipped)
        self.records = 0
        self.start = time.perf_counter()

    def read(self, records_read: int, tokens: int) -> None:
        """One more record was read, with ``tokens`` to prefill (0: skipped)."""
        self.expected += tokens
        if self.bar.disable or not self.expected:
            return
        total = self.expected
        if self.total_records and records_read < self.total_records:
            total = round(self.expected * self.total_records / records_read)
        self.bar.total = max(total, self.bar.n)

    def update(self, records: int, captured: int, tokens: int) -> None:
        self.records += records
        if self.bar.disable:
            return
        dt = max(time.perf_counter() - self.start, 1e-9)
        of = f"/{self.total_records}" if self.total_records else ""
        self.bar.set_postfix_str(f"{self.records}{of} records, {captured / dt:.1f} samples/s", refresh=False)
        self.bar.update(tokens - self.bar.n)

    def close(self) -> None:
        self.bar.close()


@dataclass
class _Pending:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool
    line: int | None = None


def _bare_reason(e: BaseException) -> str:
    """An input error's message without the file and line prefix the readers put in front of it."""
    text = one_line(e)
    marker = f"line {getattr(e, 'line_no', '')}: " if getattr(e, "line_no", None) is not None else None
    if marker and marker in text:
        return text.split(marker, 1)[1]
    if text.startswith("line ") and ": " in text:
        head, rest = text.split(": ", 1)
        if head[5:].isdigit():
            return rest
    return text


class _Run:
    """One run's reading side: the writer, the window being tokenized, counters and the progress bar.

    A backend subclasses it with ``run_window`` (features for ``self.window``, handed to the writer) and, when
    it holds resources past the writer's last commit, ``after_close``.
    """

    def __init__(self, tokenizer, vocab_size: int, config: CaptureConfig, writer: FeatureStoreWriter,
                 report: CaptureReport, progress: _Progress) -> None:
        self.tokenizer, self.vocab_size, self.config = tokenizer, int(vocab_size), config
        self.writer, self.report, self.counts, self.progress = writer, report, report.counts, progress
        self.seen: set[str] = set()
        self.window: list[_Pending] = []
        self.last_flush = time.perf_counter()
        self.skipped: list[dict[str, Any]] = []  # one row per input line not captured, with its reason

    def skip(self, bucket: str, line: int | None, sid: str | None, reason: str) -> None:
        self.skipped.append({"line": line, "id": sid, "bucket": bucket, "reason": reason})

    def _bump(self, bucket: str, line: int | None = None, sid: str | None = None, reason: str | None = None) -> None:
        setattr(self.counts, bucket, getattr(self.counts, bucket) + 1)
        if reason is not None:
            self.skip(bucket, line, sid, reason)
        self.progress.read(self.counts.records, 0)
        self.progress.update(1, self.counts.captured, self.report.tokens)

    def add_record(self, item: Any, line: int | None = None) -> None:
        """Tokenize one record into the window, or count (and note) why it is not captured."""
        self.counts.records += 1
        if isinstance(item, EmptyConversation):
            return self._bump("no_loss_tokens", line, None, _bare_reason(item))
        if isinstance(item, EvaluationPromptDropped):
            return self._bump("evaluation_prompt", line, None, _bare_reason(item))
        if isinstance(item, Exception):
            return self._bump("invalid", line, None, _bare_reason(item))
        sid = item.id
        if sid in self.seen:
            return self._bump("duplicate_id", line, sid, f"duplicate id {sid!r} (an earlier line has it)")
        self.seen.add(sid)
        if self.writer.has(sid):  # committed by an earlier run: skip before paying for tokenization
            return self._bump("already_stored")
        cfg = self.config
        try:
            tok = tokenize_conversation(self.tokenizer, item.messages, cfg.max_length, truncate=cfg.long == "truncate")
        except SequenceTooLong as e:
            return self._bump("too_long", line, sid, f"too long ({_bare_reason(e)})")
        except EmptyConversation as e:
            return self._bump("no_loss_tokens", line, sid, f"no assistant token to learn from ({_bare_reason(e)})")
        except ChatTemplateError as e:
            return self._bump("template_error", line, sid, f"chat template error: {_bare_reason(e)}")
        except ValueError as e:
            return self._bump("invalid", line, sid, _bare_reason(e))
        except TypeError as e:  # what a fast tokenizer raises for text it cannot take
            return self._bump("invalid", line, sid, f"the tokenizer cannot encode it ({one_line(e)})")
        if max(tok.input_ids) >= self.vocab_size:
            return self._bump("invalid", line, sid, f"token id {max(tok.input_ids)} outside the target's "
                              f"vocabulary of {self.vocab_size}")
        self.window.append(_Pending(sid, tok.input_ids, tok.loss_mask, tok.truncated, line))
        self.progress.read(self.counts.records, len(tok.input_ids))
        if len(self.window) >= cfg.sort_window:
            self.run_window()

    def run_window(self) -> None:
        raise NotImplementedError

    def after_close(self) -> None:
        """Called once the writer has committed its last shard (release what only that commit makes safe)."""

    def added(self, p: _Pending, accepted: bool, rejected_before: int, reason: str = "NaN/Inf in the target's features"
              ) -> None:
        """Count one ``writer.add`` outcome (``rejected_before``: the writer's non-finite count before it)."""
        counts = self.counts
        if accepted:
            counts.captured += 1
            counts.truncated += int(p.truncated)
            self.report.tokens += len(p.input_ids)
            self.report.loss_tokens += sum(p.loss_mask)
        elif self.writer.rejected_nonfinite > rejected_before:
            counts.nonfinite += 1
            self.skip("nonfinite", p.line, p.sample_id, reason)
        else:  # cannot happen: ids are de-duplicated before tokenizing
            counts.duplicate_id += 1


RunFactory = Callable[[FeatureStoreWriter, CaptureReport, _Progress], _Run]


def capture_with(target, tokenizer, config: CaptureConfig, make_run: RunFactory, *, target_dtype: str | None = None
                 ) -> CaptureReport:
    """Capture features for every conversation in ``config.conversations`` into the store ``config.out``,
    with the backend ``make_run`` builds (``target`` gives the meta and vocabulary size; it need not hold weights).

    Returns the report (its counts add up to the records read); the draft vocabulary is the caller's step
    (``vocab.add_vocab``). Raises ``ValueError`` for unusable inputs (no chat
    template, a tokenizer larger than the target's vocabulary), ``StoreMismatch`` when resuming into a
    store captured under other meta, ``StoreWriteError``/``OSError`` when the disk fails; the store on
    disk stays valid in every case and a rerun resumes where the last committed shard ended.
    """
    config.validate()
    if tokenizer is None:
        raise ValueError("capture needs the target's tokenizer (none was found next to the model)")
    if len(tokenizer) > target.vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but the target's vocabulary has {target.vocab_size}: "
            "is this the target's own tokenizer?"
        )
    chat_format(tokenizer)  # fail fast on a tokenizer without a usable chat template
    context_note = _bound_by_context(config, target)
    meta = store_meta(target, tokenizer, max_length=config.max_length, long=config.long,
                      target_dtype=target_dtype)
    report = CaptureReport(store=config.out, counts=CaptureCounts(), notes=[context_note] if context_note else [])
    show = sys.stderr.isatty() if config.progress is None else config.progress
    total = _count_records(config.conversations, config.limit) if show else None
    start = time.perf_counter()
    progress = _Progress(total, show)
    fresh = not config.out.exists()
    try:
        with FeatureStoreWriter(config.out, meta=resume_meta(config.out, meta), dtype=config.dtype,
                                shard_max_bytes=config.shard_max_bytes) as writer:
            run = make_run(writer, report, progress)
            for line_no, item in read_conversations(config):
                if config.limit is not None and report.counts.records >= config.limit:
                    break
                run.add_record(item, line_no)
            run.run_window()
            _report_skipped(config, report, run.skipped)
        run.after_close()
    except BaseException:
        if fresh:
            _remove_empty_store(config.out)
        raise
    finally:
        progress.close()
    report.elapsed_s = time.perf_counter() - start
    report.counts.check()

    store = FeatureStore(config.out, verify_on_open=False)
    report.store_samples, report.store_tokens, report.store_bytes = len(store), store.total_tokens, store.bytes_on_disk
    return report


def _bound_by_context(config: CaptureConfig, target) -> str | None:
    """Lower ``config.max_length`` to the target's context (``max_position_embeddings``), saying so.

    Features past the positions a model was trained on are not what it computes at inference, so a longer
    conversation is over-long like any other: cut or skipped per ``--long``, and counted.
    """
    max_pos = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if not isinstance(max_pos, int) or isinstance(max_pos, bool) or not 0 < max_pos < config.max_length:
        return None
    what = "cut to" if config.long == "truncate" else "skipped past"
    note = (f"note: --max-length {config.max_length} is past the target's context of {max_pos} positions "
            f"(max_position_embeddings): conversations are {what} {max_pos} tokens")
    config.max_length = max_pos
    return note


def _remove_empty_store(root: Path) -> None:
    """Take away a store this failed run created and committed nothing to (its manifest, lock, temp files)."""
    try:
        manifest = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
        names = {p.name for p in root.iterdir()}
    except (OSError, ValueError):
        return
    if not isinstance(manifest, dict) or manifest.get("num_samples") != 0 or manifest.get("shards") != []:
        return
    if not names <= {MANIFEST_NAME, LOCK_NAME, f".{MANIFEST_NAME}.tmp"}:
        return
    for name in names:
        (root / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        root.rmdir()


def _report_skipped(config: CaptureConfig, report: CaptureReport, skipped: list[dict[str, Any]]) -> None:
    """Write this run's skipped lines to the sidecar (or remove a stale one); refuse an input with nothing usable."""
    sidecar = errors_path(config.out)
    skipped.sort(key=lambda r: (r["line"] is None, r["line"] or 0))
    if skipped:
        with open(sidecar, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in skipped)
        report.skipped_lines, report.errors_file = len(skipped), sidecar
    else:
        sidecar.unlink(missing_ok=True)
    c = report.counts
    if c.captured or c.already_stored or config.limit == 0:
        return
    shown = "; ".join(f"line {r['line']}: {r['reason']}" for r in skipped[:_SHOWN_REASONS])
    more = f"; {len(skipped) - _SHOWN_REASONS} more" if len(skipped) > _SHOWN_REASONS else ""
    where = f"; all reasons in {sidecar}" if skipped else ""
    raise CaptureInputError(f"{config.conversations}: no usable conversation in {c.records} line"
                            f"{'s' if c.records != 1 else ''}" + (f" ({shown}{more}{where})" if shown else ""))


