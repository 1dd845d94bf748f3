"""The reduced draft vocabulary: ``d2t`` / ``t2d`` in the convention every EAGLE-3 tool shares.

``d2t[draft_id]`` is an offset: ``target_id = draft_id + d2t[draft_id]``; ``t2d`` is a bool mask over
the target vocabulary. Draft ids are the kept target ids in ascending order, so the mapping is monotone.
A misaligned mapping silently ruins acceptance, hence the validation on every load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class VocabError(ValueError):
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
