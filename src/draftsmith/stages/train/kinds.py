"""What each drafter kind trains with: its objective. The loop and the run ask here, and never branch on a name.

An objective is called ``objective(drafter, batch, teacher, generator=None) -> (loss, TTTStats)``; its
``positions`` is the length of the per-position statistics (TTT steps for EAGLE-3, drafted slots for a block).
``generator`` fixes whatever the objective draws at random (a block kind's anchors) for held-out evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from draftsmith.core.conventions import aux_to_block_layer_ids
from draftsmith.model.block_drafter import BlockDrafter
from draftsmith.model.block_drafter import init_head_from_target as init_block_head
from draftsmith.model.drafter import init_head_from_target as init_eagle3_head
from draftsmith.model.ttt import TTTBatch, TTTStats, ttt_forward
from draftsmith.stages.train.block import BlockObjective, BlockSpec
from draftsmith.stages.train.config import TrainConfig, TrainError


class Objective(Protocol):
    """What the loop calls per batch, and the length of the per-position statistics it returns."""

    @property
    def positions(self) -> int: ...

    def __call__(self, drafter, batch: TTTBatch, teacher, generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, TTTStats]: ...


@dataclass(frozen=True)
class TTTObjective:
    """EAGLE-3's: the drafter unrolled ``ttt_steps`` times on its own outputs (model/ttt.py)."""

    ttt_steps: int
    decay: float
    loss: str = "kl"

    @property
    def positions(self) -> int:
        return self.ttt_steps

    def __call__(self, drafter, batch: TTTBatch, teacher, generator: torch.Generator | None = None):
        return ttt_forward(drafter, batch, teacher, self.ttt_steps, self.decay, loss=self.loss)


def objective_for(cfg: TrainConfig, drafter) -> Objective:
    """The run's objective; a block drafter's own config decides its block size and slot convention."""
    if cfg.kind == "eagle3":
        return TTTObjective(cfg.ttt_steps, cfg.step_decay, cfg.loss)
    conf = drafter.config
    opt = cfg.block_option
    spec = BlockSpec(block_size=int(conf.block_size), next_token=bool(conf.sample_from_anchor),
                     num_anchors=int(opt("num_anchors")), gamma=float(opt("loss_decay_gamma")),
                     ce_weight=float(opt("ce_weight")), l1_weight=float(opt("l1_weight")),
                     confidence_weight=float(opt("confidence_weight")))
    return BlockObjective(spec)


def block_overrides(cfg: TrainConfig, store_aux: tuple[int, ...] | None) -> dict:
    """A new block drafter's config fields from the run's options (the model's defaults where not given).

    ``store_aux``: the layers an offline store holds (draftsmith's ids); the drafter reads exactly those.
    """
    out = {}
    ids = _layer_ids(cfg, store_aux)
    if ids is not None:
        out["target_layer_ids"] = ids
    for ours, theirs in (("block_size", "block_size"), ("draft_layers", "num_hidden_layers"),
                         ("mask_token_id", "mask_token_id"), ("markov_rank", "markov_rank"),
                         ("markov_head_type", "markov_head_type")):
        if getattr(cfg, ours) is not None:
            out[theirs] = getattr(cfg, ours)
    if cfg.kind == "dspark":
        markov = cfg.markov_rank is None or cfg.markov_rank > 0  # the model's default rank is > 0
        head = float(cfg.block_option("confidence_weight")) > 0  # DeepSpec: no loss weight, no head
        out.update(enable_confidence_head=head, confidence_head_with_markov=head and markov)
    return out


def _layer_ids(cfg: TrainConfig, store_aux: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The drafter's target_layer_ids (output-of-layer convention): given, else the store's; a store holding other
    layers than the ones given is refused (it would train on states the drafter never sees at inference)."""
    given = cfg.layer_ids()
    if store_aux is None:
        return given
    held = aux_to_block_layer_ids(store_aux)
    if given is not None and tuple(given) != tuple(held):
        raise TrainError(layer_mismatch(cfg, given, store_aux))
    return held


def layer_mismatch(cfg: TrainConfig, ids, store_aux) -> str:
    ids = [int(i) for i in ids]
    return (f"--store {cfg.store} holds target layers {list(aux_to_block_layer_ids(store_aux))} (captured with "
            f"--aux-layers {','.join(map(str, store_aux))}), the drafter reads target_layer_ids {ids}: capture with "
            f"--aux-layers {','.join(str(i + 1) for i in ids)} or train with --target-layer-ids "
            f"{','.join(str(i) for i in aux_to_block_layer_ids(store_aux))}")


def check_drafter_layers(cfg: TrainConfig, drafter, store_aux: tuple[int, ...] | None, target=None) -> None:
    """A drafter (an ``init_drafter``, or a new one) reads its own layers: the store must hold exactly those
    (online: the target is pointed at them here)."""
    if cfg.kind == "eagle3":
        return
    ids = tuple(drafter.config.target_layer_ids)
    given = cfg.layer_ids()
    if given is not None and tuple(given) != ids:
        raise TrainError(f"--init-drafter {cfg.init_drafter} reads target_layer_ids {list(ids)}, not the "
                         f"--target-layer-ids {list(given)} given")
    if target is not None:
        target.set_aux_hidden_state_layers(drafter.config.aux_layer_ids)
    elif store_aux and tuple(aux_to_block_layer_ids(store_aux)) != ids:
        raise TrainError(layer_mismatch(cfg, ids, store_aux))


def init_head(drafter, lm_head_weight: torch.Tensor, final_norm_weight: torch.Tensor | None) -> None:
    """The drafter's lm_head rows (and final norm) from the target's, as its kind lays them out."""
    init = init_block_head if isinstance(drafter, BlockDrafter) else init_eagle3_head
    init(drafter, lm_head_weight, final_norm_weight)
