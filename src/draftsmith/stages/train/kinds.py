"""What each drafter kind trains with: its objective. The loop and the run ask here, and never branch on a name.

An objective is called ``objective(drafter, batch, teacher, generator=None) -> (loss, TTTStats)``; its
``positions`` is the length of the per-position statistics (TTT steps for EAGLE-3, drafted slots for a block).
``generator`` fixes whatever the objective draws at random (a block kind's anchors) for held-out evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.model.ttt import TTTBatch, ttt_forward
from draftsmith.stages.train.block import BlockObjective, BlockSpec
from draftsmith.stages.train.config import TrainConfig


@dataclass(frozen=True)
class TTTObjective:
    """EAGLE-3's: the drafter unrolled ``ttt_steps`` times on its own outputs (model/ttt.py)."""

    ttt_steps: int
    decay: float

    @property
    def positions(self) -> int:
        return self.ttt_steps

    def __call__(self, drafter, batch: TTTBatch, teacher, generator: torch.Generator | None = None):
        return ttt_forward(drafter, batch, teacher, self.ttt_steps, self.decay)


# Slot conventions of the block kinds (notes/block-training.md): DSpark's slot k predicts the token after
# position a+k, DFlash's slot k the token at a+k. A kind's model says which it is; these are the defaults.
NEXT_TOKEN = {"dflash": False, "dspark": True}


def objective_for(cfg: TrainConfig, drafter=None) -> TTTObjective | BlockObjective:
    """The run's objective; a block drafter's own config decides its block size and slot convention."""
    if cfg.kind == "eagle3":
        return TTTObjective(cfg.ttt_steps, cfg.step_decay)
    conf = getattr(drafter, "config", None)
    block_size = int(getattr(conf, "block_size", None) or cfg.block_option("block_size"))
    next_token = getattr(conf, "next_token_slots", None)
    opt = cfg.block_option
    spec = BlockSpec(block_size=block_size,
                     next_token=NEXT_TOKEN[cfg.kind] if next_token is None else bool(next_token),
                     num_anchors=int(opt("num_anchors")), gamma=float(opt("loss_decay_gamma")),
                     ce_weight=float(opt("ce_weight")), l1_weight=float(opt("l1_weight")),
                     confidence_weight=float(opt("confidence_weight")))
    return BlockObjective(spec)
