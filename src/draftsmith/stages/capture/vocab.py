"""The draft vocabulary (``d2t``/``t2d``), built right after capture from the tokens at loss positions."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from draftsmith.core.vocab import VOCAB_FILE, VocabError, count_tokens, from_counts, save_vocab
from draftsmith.data.store import FeatureStore
from draftsmith.stages.capture.common import CaptureConfig, CaptureReport, VocabReport


def _as_store(store: FeatureStore | str | Path) -> FeatureStore:
    return store if isinstance(store, FeatureStore) else FeatureStore(store)


def count_store_tokens(store: FeatureStore | str | Path, vocab_size: int) -> torch.Tensor:
    """Counts of each target id at loss positions over the whole store, reading only ids and masks.

    Going through ``FeatureStore.get`` would read (and for fp8 dequantise) every hidden state, which is
    >99% of the bytes; the shards are safetensors, so only the two small tensors per sample are read.
    """
    from safetensors import safe_open

    fs = _as_store(store)
    fs.verify_all()  # every reader checks what it reads: a flipped byte would give silently wrong counts
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for shard in fs.shards:
        with safe_open(str(fs.root / shard["file"]), framework="pt") as handle:
            for j in range(len(shard["samples"])):
                counts += count_tokens(handle.get_tensor(f"{j}.input_ids"), handle.get_tensor(f"{j}.loss_mask"),
                                       vocab_size)
    return counts


def count_store_target_tokens(store: FeatureStore | str | Path, lm_head_weight: torch.Tensor,
                              samples: list[int] | None = None) -> torch.Tensor:
    """Counts of the target's own greedy choice for each loss position: the token it decodes there at T=0.

    The store's final hidden state at position t-1, through the target's head, gives the target's choice for
    position t, which is what the drafter must propose, while the dataset's token at t may be another
    (a conversation written by someone else, or sampled). ``samples``: store indices (default every one).
    """
    from draftsmith.model.ttt import target_argmax

    fs = _as_store(store)
    counts = torch.zeros(lm_head_weight.shape[0], dtype=torch.int64)
    for i in range(len(fs)) if samples is None else samples:
        sample = fs.get(i)
        before = sample["loss_mask"][1:].nonzero().flatten()  # the positions whose next token is a loss token
        if before.numel():
            choice = target_argmax(sample["hidden_state"][before], lm_head_weight)
            counts += torch.bincount(choice, minlength=counts.numel())
    return counts


def _check_out(path: Path, fs: FeatureStore) -> None:
    """Refuse an ``--out`` that is one of the store's own files (its manifest, a shard, the writer's lock)."""
    from draftsmith.data.store import LOCK_NAME, MANIFEST_NAME

    if path.is_dir():
        raise VocabError(f"--out {path}: is a directory, not a file")
    own = [fs.root / MANIFEST_NAME, fs.root / LOCK_NAME, *(fs.root / sh["file"] for sh in fs.shards)]
    resolved = path.resolve()
    for p in own:
        if resolved == p.resolve() or (path.exists() and p.exists() and os.path.samefile(path, p)):
            raise VocabError(f"--out {path}: is the feature store's own {p.name}; writing the vocabulary there "
                             f"would destroy the store (default: {fs.root / VOCAB_FILE})")
    if resolved.parent == fs.root.resolve() and resolved.name.startswith("shard-"):
        raise VocabError(f"--out {path}: shard-* names in {fs.root} belong to the store")


VOCAB_SOURCES = ("data", "target")


def build_vocab(store: FeatureStore | str | Path, draft_vocab_size: int = 32000, *, out: str | Path | None = None,
                vocab_size: int | None = None, source: str = "data", lm_head_weight: torch.Tensor | None = None
                ) -> VocabReport:
    """Keep the ``draft_vocab_size`` most frequent loss-position tokens; write ``d2t``/``t2d``/``counts``.

    ``source``: ``data`` counts the store's tokens at loss positions; ``target`` the target's greedy choices
    there (``count_store_target_tokens``, from ``lm_head_weight``, the target's head), the tokens a T=0
    drafter must propose. ``vocab_size`` (the target's lm_head size, which may exceed the tokenizer's length)
    defaults to the one in the store's target fingerprint. The file goes to ``<store>/vocab.safetensors`` by
    default and is re-read and validated before returning.
    """
    from draftsmith.core.vocab import load_vocab_file

    if draft_vocab_size < 1:
        raise ValueError(f"--draft-vocab-size must be >= 1, got {draft_vocab_size}")
    fs = _as_store(store)
    if vocab_size is None:
        vocab_size = (fs.meta.get("target_fingerprint") or {}).get("vocab_size")
        if not vocab_size:
            raise ValueError(f"{fs.root}: the store meta has no target vocab size; pass vocab_size")
    vocab_size = int(vocab_size)
    if fs.total_loss_tokens == 0:
        raise ValueError(f"{fs.root}: the store holds no loss tokens to count")
    path = Path(out) if out is not None else fs.root / VOCAB_FILE
    _check_out(path, fs)
    if source == "target":
        if lm_head_weight is None or lm_head_weight.shape[0] != vocab_size:
            raise ValueError(f"counting the target's choices needs its lm_head of {vocab_size} rows")
        fs.verify_all()
        counts = count_store_target_tokens(fs, lm_head_weight)
        extra = {"counted": "the target's argmax at the position before each loss_mask == 1"}
    elif source == "data":
        counts = count_store_tokens(fs, vocab_size)
        extra = {"counted": "input_ids at loss_mask == 1"}
    else:
        raise ValueError(f"vocabulary source {source!r}: one of {', '.join(VOCAB_SOURCES)}")
    vocab, coverage = from_counts(counts, draft_vocab_size)
    for key in ("tokenizer_fingerprint", "target_fingerprint"):
        if key in fs.meta:
            extra[key] = json.dumps(fs.meta[key], sort_keys=True)
    save_vocab(path, vocab, counts, extra)
    loaded, _, meta = load_vocab_file(path, vocab_size)
    if not torch.equal(loaded.d2t, vocab.d2t):
        raise VocabError(f"{path}: read back a different d2t than was written")
    if not math.isclose(float(meta["coverage"]), coverage, rel_tol=1e-9, abs_tol=1e-12):
        raise VocabError(f"{path}: coverage {meta['coverage']} differs from the computed {coverage}")
    return VocabReport(path=path, draft_vocab_size=vocab.draft_vocab_size, vocab_size=vocab_size, coverage=coverage,
                       counted_tokens=int(counts.sum()), distinct_tokens=int((counts > 0).sum()))




def add_vocab(report: CaptureReport, config: CaptureConfig, vocab_size: int) -> CaptureReport:
    """The step after capture: the draft vocabulary from the store, unless ``config.draft_vocab_size`` is None."""
    if config.draft_vocab_size is not None:
        store = FeatureStore(config.out, verify_on_open=False)
        if store.total_loss_tokens > 0:
            report.vocab = build_vocab(store, config.draft_vocab_size, vocab_size=vocab_size)
        else:
            report.notes.append("draft vocab: skipped (the store holds no loss tokens)")
    return report
