"""The reduced draft vocabulary: ``d2t`` / ``t2d`` in the convention every EAGLE-3 tool shares.

``d2t[draft_id]`` is an offset: ``target_id = draft_id + d2t[draft_id]``; ``t2d`` is a bool mask over
the target vocabulary. Draft ids are the kept target ids in ascending order, so the mapping is monotone.
A misaligned mapping silently ruins acceptance, hence the validation on every load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import atomic_write


class VocabError(DraftsmithError, ValueError):
    """A d2t/t2d pair that does not describe a valid draft vocabulary."""


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # int64 [draft_vocab_size], offsets
    t2d: torch.Tensor  # bool [vocab_size]

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def vocab_size(self) -> int:
        return int(self.t2d.numel())

    def target_ids(self) -> torch.Tensor:
        """Target id of each draft id."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft id of each target id in ``target_ids``; -1 where the draft vocabulary does not hold it."""
        draft_of = torch.cumsum(self.t2d.long(), 0) - 1
        return torch.where(self.t2d[target_ids], draft_of[target_ids], -1)


def from_target_ids(target_ids: torch.Tensor, vocab_size: int) -> DraftVocab:
    """Build the pair from the set of kept target ids."""
    ids = torch.unique(target_ids.to(torch.long))  # sorted ascending
    if ids.numel() == 0:
        raise VocabError("a draft vocabulary needs at least one token")
    if ids[0] < 0 or ids[-1] >= vocab_size:
        raise VocabError(f"target ids must lie in [0, {vocab_size}), got [{int(ids[0])}, {int(ids[-1])}]")
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return DraftVocab(d2t=d2t, t2d=t2d)


def identity(vocab_size: int, draft_vocab_size: int | None = None) -> DraftVocab:
    """The first ``draft_vocab_size`` target ids (the whole vocabulary by default)."""
    n = vocab_size if draft_vocab_size is None else min(draft_vocab_size, vocab_size)
    return from_target_ids(torch.arange(n), vocab_size)


def from_counts(counts: torch.Tensor, draft_vocab_size: int) -> tuple[DraftVocab, float]:
    """Keep the most frequent target tokens; return the vocab and the share of counted tokens it covers."""
    vocab_size = counts.numel()
    k = min(draft_vocab_size, vocab_size)
    # Ties broken by lower id so the result is deterministic.
    order = torch.argsort(-counts.to(torch.float64), stable=True)[:k]
    total = float(counts.sum())
    coverage = float(counts[order].sum()) / total if total > 0 else 0.0
    return from_target_ids(order, vocab_size), coverage


def validate(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int | None = None) -> None:
    """Raise ``VocabError`` unless the pair is monotone, in range and mutually consistent."""
    d2t = d2t.to(torch.long)
    if d2t.ndim != 1 or d2t.numel() == 0:
        raise VocabError(f"d2t must be a non-empty 1-D tensor, got shape {tuple(d2t.shape)}")
    target = torch.arange(d2t.numel()) + d2t.cpu()
    if target.numel() > 1 and not bool((target[1:] > target[:-1]).all()):
        raise VocabError("d2t maps draft ids to target ids that are not strictly increasing")
    if int(target[0]) < 0:
        raise VocabError(f"d2t maps draft id 0 to negative target id {int(target[0])}")
    limit = vocab_size if vocab_size is not None else (t2d.numel() if t2d is not None else None)
    if limit is not None and int(target[-1]) >= limit:
        raise VocabError(f"d2t maps to target id {int(target[-1])}, outside the vocabulary of {limit} tokens")
    if t2d is not None:
        if vocab_size is not None and t2d.numel() != vocab_size:
            raise VocabError(f"t2d covers {t2d.numel()} tokens but the target vocabulary has {vocab_size}")
        kept = torch.nonzero(t2d.cpu().bool()).flatten()
        if kept.numel() != target.numel() or not torch.equal(kept, target):
            raise VocabError("d2t and t2d disagree on which target tokens are in the draft vocabulary")


# --- counting and the vocab file -----------------------------------------------------------------------
VOCAB_FILE = "vocab.safetensors"
VOCAB_FORMAT = "draftsmith-draft-vocab"


def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each target id at loss positions: the tokens the drafter will have to predict.

    Prompt and role-header tokens are never drafted, so counting them would spend draft-vocabulary slots
    on tokens that cost acceptance nothing.
    """
    ids = input_ids.reshape(-1).to(torch.long)
    keep = ids[loss_mask.reshape(-1).to(torch.bool)]
    if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= vocab_size):
        raise VocabError(
            f"token ids [{int(keep.min())}, {int(keep.max())}] fall outside the target vocabulary of {vocab_size}"
        )
    return torch.bincount(keep, minlength=vocab_size)


def save_vocab(path, vocab: DraftVocab, counts: torch.Tensor, metadata: dict[str, str] | None = None) -> None:
    """Write ``d2t`` (int64), ``t2d`` (bool), ``counts`` (int64) and metadata atomically to a safetensors file.

    The coverage recorded is the share of counted tokens the draft vocabulary keeps; a reader sees the
    old file or the new one, never half of one (temp file, fsync, rename).
    """
    from pathlib import Path

    from safetensors.torch import save as st_save

    validate(vocab.d2t, vocab.t2d, vocab.vocab_size)
    counts = counts.to(torch.int64).reshape(-1)
    if counts.numel() != vocab.vocab_size:
        raise VocabError(f"counts cover {counts.numel()} tokens but the vocabulary has {vocab.vocab_size}")
    total = int(counts.sum())
    covered = int(counts[vocab.t2d.cpu()].sum())
    meta = {
        "format": VOCAB_FORMAT,
        "draft_vocab_size": str(vocab.draft_vocab_size),
        "vocab_size": str(vocab.vocab_size),
        "coverage": repr(covered / total if total else 0.0),
        "counted_tokens": str(total),
        **{k: str(v) for k, v in (metadata or {}).items()},
    }
    data = st_save(
        {"d2t": vocab.d2t.to(torch.int64).cpu().contiguous(), "t2d": vocab.t2d.to(torch.bool).cpu().contiguous(),
         "counts": counts.cpu().contiguous()},
        metadata=meta,
    )

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)


def load_vocab_file(path, vocab_size: int | None = None) -> tuple[DraftVocab, torch.Tensor | None, dict[str, str]]:
    """(vocab, counts or None, metadata) from a vocab file, validated before anything uses it.

    ``vocab_size`` is the target's (lm_head) vocabulary size; a file made for another target is refused
    here rather than silently drafting the wrong tokens.
    """
    from pathlib import Path

    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such vocab file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            keys = set(f.keys())
            missing = {"d2t", "t2d"} - keys
            if missing:
                raise VocabError(f"{path}: missing tensors {sorted(missing)}")
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
            counts = f.get_tensor("counts") if "counts" in keys else None
    except SafetensorError as e:
        raise VocabError(f"{path}: not a safetensors file ({e})") from e
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise VocabError(f"{path}: d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    for key, have in (("draft_vocab_size", d2t.numel()), ("vocab_size", t2d.numel())):
        if key in meta and meta[key] != str(have):
            raise VocabError(f"{path}: metadata {key}={meta[key]} but the tensor holds {have}")
    if counts is not None and counts.numel() != t2d.numel():
        raise VocabError(f"{path}: counts cover {counts.numel()} tokens, t2d {t2d.numel()}")
    validate(d2t, t2d, vocab_size)
    return DraftVocab(d2t=d2t, t2d=t2d), counts, meta


def load_vocab(path, vocab_size: int | None = None) -> DraftVocab:
    """The validated ``d2t``/``t2d`` pair of a vocab file (see ``load_vocab_file``)."""
    return load_vocab_file(path, vocab_size)[0]


def from_state(state: dict, vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    """The draft vocabulary a saved drafter's weights carry: its d2t (t2d rebuilt from it when absent), or the
    identity for a full vocabulary. One reading for every drafter kind."""
    if "d2t" not in state:
        return identity(vocab_size, draft_vocab_size)
    d2t = state["d2t"].long()
    t2d = state.get("t2d")
    if t2d is None:
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[torch.arange(d2t.numel()) + d2t] = True
    return DraftVocab(d2t=d2t, t2d=t2d.bool())
