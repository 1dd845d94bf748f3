"""The block kinds' export and import, as the export stage asks a kind: draftsmith's ``BlockDrafter`` to and from
the canonical ``BlockCheckpoint`` the layout writers and readers use.

``export_block_any`` takes a live drafter or a directory in any block layout; ``import_block`` writes draftsmith's
native layout (``BlockDrafter.save``) from any released one. z-lab's DFlash releases carry no lm_head (the
target's is used): import copies the target's rows then, which needs the target.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.core import block_facts as bf
from draftsmith.core import vocab as vocab_mod
from draftsmith.model.block_drafter import BlockDrafter, BlockDrafterConfig
from draftsmith.stages.export.block import (
    BlockCheckpoint,
    BlockExportReport,
    BlockSpec,
    ExportError,
    export_block,
)
from draftsmith.stages.export.block_readers import read_block_checkpoint


def checkpoint_from_drafter(d: BlockDrafter) -> BlockCheckpoint:
    """A live drafter as the canonical checkpoint (the shared target embedding is never part of it)."""
    cfg = d.config
    state = {k: v.detach().cpu().contiguous() for k, v in d.state_dict().items()}
    if cfg.draft_vocab_size == cfg.vocab_size:
        state.pop("d2t", None), state.pop("t2d", None)
    spec = BlockSpec(
        kind=cfg.kind, block_size=cfg.block_size, aux_layer_ids=tuple(cfg.aux_layer_ids),
        mask_token_id=cfg.mask_token_id, slot=bf.ANCHOR_FIRST if cfg.sample_from_anchor else bf.FILL_IN,
        num_hidden_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
        target_hidden_size=cfg.target_hidden_size, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        markov_rank=cfg.markov_rank if cfg.kind == "dspark" else 0,
        markov_head_type=cfg.markov_head_type if cfg.kind == "dspark" and cfg.markov_rank else None,
        confidence_head=cfg.enable_confidence_head, confidence_with_markov=cfg.confidence_head_with_markov,
        num_target_layers=(cfg.target or {}).get("num_layers"), target=dict(cfg.target or {}))
    return BlockCheckpoint(spec=spec, state=state, source="<in memory>", source_format="draftsmith").validate()


def drafter_from_checkpoint(ckpt: BlockCheckpoint, lm_head_from: torch.Tensor | None = None) -> BlockDrafter:
    """draftsmith's drafter holding exactly these tensors; ``lm_head_from``: the target's head, for a checkpoint
    without one (its rows are taken through d2t)."""
    s = ckpt.spec
    cfg = BlockDrafterConfig(
        kind=s.kind, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads, head_dim=s.head_dim, vocab_size=s.vocab_size,
        draft_vocab_size=s.draft_vocab_size, target_hidden_size=s.target_hidden_size,
        target_layer_ids=tuple(bf.to_output_layer_ids(s.aux_layer_ids, allow_embedding=True)),
        block_size=s.block_size, mask_token_id=s.mask_token_id, sample_from_anchor=s.slot == bf.ANCHOR_FIRST,
        markov_rank=s.markov_rank, markov_head_type=s.markov_head_type or "vanilla",
        enable_confidence_head=s.confidence_head, confidence_head_with_markov=s.confidence_with_markov,
        rms_norm_eps=s.rms_norm_eps, rope_theta=s.rope_theta, max_position_embeddings=s.max_position_embeddings,
        target=dict(s.target))
    state = dict(ckpt.state)
    if "d2t" in state:
        dv = vocab_mod.DraftVocab(d2t=state["d2t"].long(), t2d=state.get("t2d", _t2d(state["d2t"], s.vocab_size)))
    else:
        dv = vocab_mod.identity(s.vocab_size, s.draft_vocab_size)
    state["d2t"], state["t2d"] = dv.d2t, dv.t2d.bool()
    own = "embed_tokens.weight" in state and s.hidden_size != s.target_hidden_size
    if not own:
        state.pop("embed_tokens.weight", None)
    d = BlockDrafter(cfg, draft_vocab=dv, own_embedding=own).to(ckpt.state["fc.weight"].dtype)
    if "lm_head.weight" not in state:
        if lm_head_from is None:
            raise ExportError(f"{ckpt.source}: no lm_head.weight (z-lab's releases use the target's): pass the "
                              "target (--target) to copy its head")
        ids = torch.arange(s.draft_vocab_size) + (dv.d2t if s.draft_vocab_size != s.vocab_size else 0)
        state["lm_head.weight"] = lm_head_from[ids].to(d.fc.weight.dtype)
    missing, unexpected = d.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportError(f"{ckpt.source}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    return d.eval()


def _t2d(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t.long()] = True
    return t2d


def load_checkpoint(drafter: BlockDrafter | BlockCheckpoint | str | Path) -> BlockCheckpoint:
    if isinstance(drafter, BlockDrafter):
        return checkpoint_from_drafter(drafter)
    if isinstance(drafter, BlockCheckpoint):
        return drafter.validate()
    return read_block_checkpoint(drafter)


def export_block_any(drafter: BlockDrafter | BlockCheckpoint | str | Path, out: str | Path, fmt: str, *,
                     dtype: str = "bf16", target: str | Path | None = None, verifier: str | None = None,
                     overwrite: bool = False, card: dict | None = None):
    """``fmt`` one of vllm, speculators, sglang (a directory) or gguf (one file; ``target`` = the target's GGUF)."""
    ckpt = load_checkpoint(drafter)
    if isinstance(drafter, (str, Path)) and Path(out).resolve() == Path(drafter).resolve():
        raise ExportError(f"{out}: the export would overwrite its own source")
    if fmt == "gguf":
        from draftsmith.stages.export.block_gguf import export_block_gguf

        if target is None:
            raise ExportError("--format gguf needs --target: the target's .gguf file (or 'smollm2')")
        return export_block_gguf(ckpt, out, target=target, dtype=dtype, overwrite=overwrite, card=card)
    archs = _verifier_architectures(verifier) if verifier else []
    report: BlockExportReport = export_block(ckpt, out, fmt, dtype=dtype, verifier=verifier,
                                             verifier_architectures=archs, overwrite=overwrite, card=card)
    return report


def import_block(src: str | Path, out: str | Path, *, target: str | Path | None = None) -> BlockCheckpoint:
    """Read any block layout and write draftsmith's native one (``BlockDrafter.save``)."""
    ckpt = read_block_checkpoint(src)
    head = None
    if "lm_head.weight" not in ckpt.state and target is not None:
        from draftsmith.model.target import load_target_heads

        head = load_target_heads(target, dtype=torch.float32).lm_head_weight.detach()
    d = drafter_from_checkpoint(ckpt, lm_head_from=head)
    d.save(out)
    return ckpt


def _verifier_architectures(verifier: str) -> list[str]:
    import json

    try:
        return list(json.loads((Path(verifier) / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return []
