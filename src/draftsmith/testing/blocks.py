"""Tiny random block drafters (canonical ``BlockCheckpoint``) and synthetic released layouts, for tests only."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.stages.export.block import BlockCheckpoint, BlockSpec, expected_shapes


def tiny_spec(kind: str = "dspark", **over) -> BlockSpec:
    """A small spec: 2 layers over a 256-token target with 8 layers of width 64."""
    base = dict(kind=kind, block_size=4, aux_layer_ids=(2, 4, 6), mask_token_id=250,
                slot="anchor_first" if kind == "dspark" else "fill_in", num_hidden_layers=2, hidden_size=64,
                intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                draft_vocab_size=256, target_hidden_size=64, num_target_layers=8,
                markov_rank=8 if kind == "dspark" else 0, markov_head_type="vanilla" if kind == "dspark" else None,
                confidence_head=kind == "dspark", confidence_with_markov=kind == "dspark")
    base.update(over)
    return BlockSpec(**base)


def random_block_checkpoint(spec: BlockSpec, seed: int = 0, *, lm_head: bool = True, scale: float = 0.05
                            ) -> BlockCheckpoint:
    """Random tensors of every shape the spec needs (norms at 1; d2t/t2d for a reduced vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    if lm_head:
        state["lm_head.weight"] = torch.empty(0)
    if spec.draft_vocab_size != spec.vocab_size:
        keep = torch.sort(torch.randperm(spec.vocab_size, generator=g)[: spec.draft_vocab_size]).values
        state["d2t"] = keep - torch.arange(spec.draft_vocab_size)
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[keep] = True
        state["t2d"] = t2d
    for name, shape in expected_shapes(spec, state).items():
        if name in ("d2t", "t2d"):
            continue
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
        else:
            state[name] = torch.randn(shape, generator=g) * scale
    return BlockCheckpoint(spec=spec, state=state).validate()


def write_released(path: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    """A directory as a released checkpoint would be: config.json and model.safetensors, nothing of draftsmith's."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path
