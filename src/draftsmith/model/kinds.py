"""Drafter kinds: the one place that maps a kind's name (or a saved drafter's config) to its model functions.

Stages ask the kind (``get_kind(name).new(target)``, ``load_any(path, target)``) instead of branching on the
name. Each floor keeps its own part of a kind (training objective in stages/train, proposer in stages/decode,
writers in stages/export); this registry is the model floor's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from draftsmith.core.conventions import DRAFTER_KINDS
from draftsmith.core.errors import UsageError
from draftsmith.model import block_drafter, drafter


@runtime_checkable
class DrafterKind(Protocol):
    """What a stage needs from a kind's model: make one for a target, load a saved one, recognise its config."""

    name: str
    drafts_blocks: bool  # one pass drafts a block (DFlash, DSpark) rather than one token (EAGLE-3)

    def new(self, target, draft_vocab=None, seed: int | None = 0, **overrides) -> nn.Module: ...

    def load(self, path: str | Path, target=None, *, device=None, dtype: torch.dtype | None = None
             ) -> nn.Module: ...

    def owns(self, config: dict) -> bool: ...


@dataclass(frozen=True)
class Eagle3Kind:
    name: str = "eagle3"
    drafts_blocks: bool = False

    def new(self, target, draft_vocab=None, seed=0, **overrides):
        return drafter.new_drafter(target, draft_vocab=draft_vocab, seed=seed, **overrides)

    def load(self, path, target=None, *, device=None, dtype=None):
        return drafter.load_drafter(path, target, device=device, dtype=dtype)

    def owns(self, config: dict) -> bool:
        return block_drafter.kind_of_config(config) is None


@dataclass(frozen=True)
class BlockKind:
    name: str
    drafts_blocks: bool = True

    def new(self, target, draft_vocab=None, seed=0, **overrides):
        return block_drafter.new_block_drafter(target, self.name, draft_vocab=draft_vocab, seed=seed, **overrides)

    def load(self, path, target=None, *, device=None, dtype=None):
        d = block_drafter.load_block_drafter(path, target, device=device, dtype=dtype)
        if d.kind != self.name:
            raise drafter.DrafterError(f"{path} is a {d.kind} drafter, not {self.name}")
        return d

    def owns(self, config: dict) -> bool:
        return block_drafter.kind_of_config(config) == self.name


KINDS: dict[str, DrafterKind] = {k.name: k for k in (Eagle3Kind(), BlockKind("dflash"), BlockKind("dspark"))}
KIND_NAMES = tuple(KINDS)
assert KIND_NAMES == DRAFTER_KINDS, "core/conventions.py names the kinds the CLI offers"


def get_kind(name: str) -> DrafterKind:
    try:
        return KINDS[name]
    except KeyError:
        raise UsageError(f"unknown drafter kind {name!r}: choose one of {', '.join(KIND_NAMES)}") from None


def kind_of_config(config: dict) -> str:
    """The kind whose config this is (EAGLE-3 for anything that is not a block drafter's)."""
    return next(name for name, kind in KINDS.items() if kind.owns(config))


def kind_of_dir(path: str | Path) -> str:
    """The kind of a saved drafter directory, read from its config.json."""
    return kind_of_config(block_drafter.read_config(path)[1])


def kind_of(model: nn.Module) -> str:
    """The kind of a drafter object."""
    return model.kind


def load_any(path: str | Path, target=None, *, device=None, dtype: torch.dtype | None = None) -> nn.Module:
    """Load a saved drafter of whichever kind its config says."""
    return get_kind(kind_of_dir(path)).load(path, target, device=device, dtype=dtype)
