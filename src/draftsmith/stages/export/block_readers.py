"""Read a block drafter (DFlash, DSpark) from any released layout into the canonical ``BlockCheckpoint``.

Layouts: z-lab's DFlash releases (``DFlashDraftModel`` + ``dflash_config``, no lm_head/embeddings), DeepSpec's
(``Qwen3DSparkModel``, top-level ``target_layer_ids``, anchor-first, no ``sample_from_anchor`` key), speculators
0.9 (``speculators_model_type`` dflash/dflash2/dspark, ``aux_hidden_state_layer_ids`` in draftsmith numbering),
and draftsmith's own vllm/sglang exports (the first two layouts, with ``sample_from_anchor`` stated). Every id is
converted once, through ``core.block_facts``; nothing is unpickled (safetensors only).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.core import block_facts as bf
from draftsmith.core.conventions import MIDLAYER_PREFIX
from draftsmith.core.layouts import MANIFEST_FILE
from draftsmith.stages.export.block import BlockCheckpoint, BlockSpec, ExportError


def is_block_drafter(path: str | Path) -> bool:
    """Whether the directory holds a block drafter (any layout), from its config.json alone."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and bf.kind_from_config(raw) is not None


def detect_block_layout(raw: dict) -> str:
    """``speculators`` | ``deepspec`` | ``zlab`` for a block drafter's config.json."""
    if raw.get("speculators_model_type") in ("dflash", "dflash2", "dspark"):
        return "speculators"
    if any("DSpark" in str(a) for a in raw.get("architectures") or []) or "target_layer_ids" in raw:
        return "deepspec"
    return "zlab"


def zlab_default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's ``build_target_layer_ids`` (output-of-layer numbering), used when a config lists no ids."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def read_block_checkpoint(path: str | Path) -> BlockCheckpoint:
    """The drafter in ``path`` (any block layout) as a validated canonical checkpoint."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}/config.json: cannot be read ({e})") from e
    kind = bf.kind_from_config(raw)
    if kind is None:
        raise ExportError(f"{path}: not a DFlash/DSpark drafter (config.json names neither)")
    layout = detect_block_layout(raw)
    state = _read_state(path)
    notes: list[str] = []
    if raw.get("speculators_model_type") == "dflash2" or any(k.startswith("selector_") or "conv" in k for k in state):
        raise ExportError(f"{path}: a DFlash2 drafter (grouped convolutions and a selector head): draftsmith "
                          "reads DFlash and DSpark only")
    spec = _spec(raw, layout, kind, state, path, notes)
    if not spec.target and isinstance(manifest_of(path).get("target"), dict):  # a draftsmith export says it
        spec.target = manifest_of(path)["target"]
    ckpt = BlockCheckpoint(spec=spec, state=state, source=str(path), source_format=layout, warnings=notes)
    return ckpt.validate()


def _spec(raw: dict, layout: str, kind: str, state: dict[str, torch.Tensor], path: Path, notes: list[str]) -> BlockSpec:
    q = raw.get("transformer_layer_config") if layout == "speculators" else raw
    if not isinstance(q, dict):
        raise ExportError(f"{path}/config.json: no decoder fields (transformer_layer_config)")
    dcfg = raw.get("dflash_config") or {}
    hidden, heads = int(q["hidden_size"]), int(q["num_attention_heads"])
    n_layers = int(q["num_hidden_layers"])
    ids = _layer_ids(raw, layout, dcfg, n_layers, path, notes)
    fc = state.get("fc.weight")
    if fc is None:
        raise ExportError(f"{path}: no fc.weight (not a DFlash/DSpark drafter's weights)")
    target_hidden = int(raw.get("target_hidden_size") or fc.shape[1] // max(len(ids), 1))
    vocab = int(q.get("vocab_size") or raw.get("vocab_size"))
    draft_vocab = int(raw.get("draft_vocab_size") or (state["lm_head.weight"].shape[0] if "lm_head.weight" in state
                                                          else vocab))
    mask = dcfg.get("mask_token_id", raw.get("mask_token_id", raw.get("dspark_noise_token_id")))
    if mask is None:
        raise ExportError(f"{path}/config.json: no mask_token_id (every block layout needs one)")
    block = raw.get("block_size", dcfg.get("block_size", raw.get("dspark_block_size")))
    if block is None:
        raise ExportError(f"{path}/config.json: no block_size")
    w1 = state.get("markov_head.markov_w1.weight")
    rank = int(raw.get("markov_rank") or (w1.shape[1] if w1 is not None else 0))
    head_type = raw.get("markov_head_type") or ("vanilla" if rank else None)
    conf = "confidence_head.proj.weight" in state
    conf_width = state["confidence_head.proj.weight"].shape[1] if conf else hidden
    rope = q.get("rope_theta") or (q.get("rope_parameters") or {}).get("rope_theta") or 1_000_000.0
    return BlockSpec(
        kind=kind, block_size=int(block), aux_layer_ids=tuple(ids), mask_token_id=int(mask),
        slot=bf.slot_from_config(raw, layout), num_hidden_layers=n_layers, hidden_size=hidden,
        intermediate_size=int(q["intermediate_size"]), num_attention_heads=heads,
        num_key_value_heads=int(q.get("num_key_value_heads") or heads),
        head_dim=int(q.get("head_dim") or hidden // heads),
        vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=target_hidden,
        rms_norm_eps=float(q.get("rms_norm_eps", 1e-6)), rope_theta=float(rope),
        max_position_embeddings=int(q.get("max_position_embeddings", 4096)),
        markov_rank=rank if kind == "dspark" else 0,
        markov_head_type=head_type if kind == "dspark" else None, confidence_head=conf,
        confidence_with_markov=conf and conf_width != hidden,
        num_target_layers=raw.get("num_target_layers") or dcfg.get("num_target_layers"),
        target={"verifier": ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")}
        if layout == "speculators" else {})


def _layer_ids(raw: dict, layout: str, dcfg: dict, n_layers: int, path: Path, notes: list[str]) -> list[int]:
    """Target layer ids in draftsmith numbering, from whichever key the layout uses."""
    if layout == "speculators":
        ids = raw.get("aux_hidden_state_layer_ids")
        if not ids:
            raise ExportError(f"{path}/config.json: no aux_hidden_state_layer_ids")
        return [int(i) for i in ids]
    out_ids = dcfg.get("target_layer_ids") or raw.get("target_layer_ids") or raw.get("dspark_target_layer_ids")
    if not out_ids:
        n_target = raw.get("num_target_layers") or dcfg.get("num_target_layers")
        if not n_target:
            raise ExportError(f"{path}/config.json: no target_layer_ids and no num_target_layers to derive them")
        out_ids = zlab_default_layer_ids(int(n_target), n_layers)
        notes.append(f"no target_layer_ids: z-lab's default for {n_target} target layers, {out_ids} (output of "
                     "layer i)")
    return bf.from_output_layer_ids(out_ids)


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{path}: no safetensors weights (draftsmith reads safetensors only)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            state[_canonical(name)] = t
    for drop in [k for k in state if k.startswith(("verifier_", "rotary_emb."))]:
        state.pop(drop)
    return state


def _canonical(name: str) -> str:
    name = name.removeprefix("model.")
    if name.startswith(MIDLAYER_PREFIX):
        name = "layers.0." + name.removeprefix(MIDLAYER_PREFIX)
    return name


def manifest_of(path: str | Path) -> dict:
    try:
        return json.loads((Path(path) / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return {}
