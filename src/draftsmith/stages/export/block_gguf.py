"""Write a block drafter (DFlash, DSpark) as the ``dflash`` GGUF llama.cpp serves (``--spec-type draft-dflash`` or
``draft-dspark``; in xllamacpp ``COMMON_SPECULATIVE_TYPE_DRAFT_DFLASH`` / ``_DSPARK``).

Layout (llama.cpp ``src/models/dflash.cpp`` and ``common/speculative.cpp``, the strings of xllamacpp 2026.10.11549):
keys ``dflash.target_layers`` (required; each id's layer *input* is extracted from the target, draftsmith's
numbering), ``dflash.target_hidden_size``, ``dflash.block_size``, ``dflash.sample_from_anchor`` (the DSpark type reads
it; the DFlash type is always fill-in), ``dflash.attention.causal`` (false: the block attends non-causally),
``dflash.has_confidence_head``, the Qwen3-style sizes under ``dflash.``, and the target's tokenizer with
``tokenizer.ggml.mask_token_id`` set to the drafter's mask id (the DFlash type fills its block with the vocab's
mask token). Tensors: ``fc``, ``enc.output_norm`` (hidden_norm), ``output_norm``, ``output`` (the drafter's head),
``blk.i.attn_{norm,q,k,v,output,q_norm,k_norm}``, ``blk.i.ffn_{norm,gate,up,down}``, ``d2t`` (absolute target
ids, reduced vocabularies only), DSpark ``markov_w1`` [r x V], ``markov_w2`` [r x Vd], ``conf_proj.{weight,bias}``.
Rope is neox (Qwen3's), so q/k rows keep Hugging Face's order (no permutation, unlike the llama eagle3 export).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith import __version__
from draftsmith.core import block_facts as bf
from draftsmith.core import llamacpp_facts
from draftsmith.stages.export.block import BlockCheckpoint, ExportError
from draftsmith.stages.export.gguf import GGUF_DTYPES, _array, copy_field, finish_gguf, read_target_gguf

GGUF_ARCH = "dflash"
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP = {
    "fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "embed_tokens.weight": "token_embd.weight",
    "markov_head.markov_w1.weight": "markov_w1.weight", "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight", "confidence_head.proj.bias": "conf_proj.bias",
}


@dataclass
class BlockGgufReport:
    path: Path
    kind: str
    tensors: list[str]
    dtype: str
    target_layers: list[int]
    slot: str
    draft_max: int
    target: str

    def summary(self) -> str:
        spec_type = f"draft-{self.kind}"
        return "\n".join([
            f"exported gguf {self.kind} drafter to {self.path} ({len(self.tensors)} tensors, {self.dtype}, "
            "arch dflash)",
            f"target layers: {self.target_layers} (input of layer L; llama.cpp's dflash.target_layers)",
            f"blocks: {self.slot.replace('_', '-')}, at most {self.draft_max} drafts a round",
            f"serve: llama-server -m {self.target} --model-draft {self.path} --spec-type {spec_type} "
            f"--draft-max {self.draft_max} --draft-min 0" + (" --spec-draft-p-min 0" if self.kind == "dspark" else ""),
        ])

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "path": str(self.path)}


def check_gguf_servable(ckpt: BlockCheckpoint, target_arch: str | None, target_layers: int | None,
                        target_hidden: int | None, target_vocab: int | None) -> None:
    """Refuse what llama.cpp would misread or abort on (one line each), before anything is written."""
    s = ckpt.spec
    if s.kind == "dflash" and s.slot != bf.FILL_IN:
        raise ExportError("llama.cpp's DFlash type fills [last token, mask...] blocks (fill-in); this DFlash drafter "
                          "was trained anchor-first and would draft every token one position off")
    if s.kind == "dspark" and s.markov_rank > 0 and s.markov_head_type not in bf.LLAMACPP.markov_types:
        raise ExportError(f"llama.cpp computes only vanilla Markov heads; this drafter's is {s.markov_head_type!r}")
    if "lm_head.weight" not in ckpt.state:
        raise ExportError("the drafter has no lm_head.weight: llama.cpp would borrow the target's output "
                          "projection, which a tied-embedding target's GGUF does not have")
    if llamacpp_facts.target_supported(target_arch) is False:
        raise ExportError(f"llama.cpp extracts layer inputs only for targets of architecture "
                          f"{', '.join(sorted(llamacpp_facts.TARGET_ARCHES))}; this target is {target_arch}")
    if target_layers is not None and any(not 0 <= i < target_layers for i in s.aux_layer_ids):
        raise ExportError(f"target layer ids {list(s.aux_layer_ids)} fall outside the target's {target_layers} layers")
    if s.hidden_size != s.target_hidden_size:
        raise ExportError(f"llama.cpp sizes fc's input as target layers x the drafter's own width, so it serves only "
                          f"drafters as wide as the target; this one is {s.hidden_size} wide, the target "
                          f"{s.target_hidden_size}")
    if target_hidden is not None and target_hidden != s.target_hidden_size:
        raise ExportError(f"the target's hidden size is {target_hidden}, the drafter was made for "
                          f"{s.target_hidden_size}")
    if target_vocab is not None and target_vocab != s.vocab_size:
        raise ExportError(f"the target's vocabulary has {target_vocab} tokens, the drafter's {s.vocab_size}")
    problem = bf.mask_token_problem(s.mask_token_id, target_vocab or s.vocab_size, None)
    if problem:
        raise ExportError(problem)


def block_gguf_tensors(ckpt: BlockCheckpoint) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in ckpt.state.items():
        if name in ("d2t", "t2d"):
            continue
        if name.startswith("layers."):
            i, short = name.removeprefix("layers.").split(".", 1)
            out[f"blk.{i}.{_LAYER[short]}"] = t
        else:
            out[_TOP[name]] = t
    s = ckpt.spec
    if s.draft_vocab_size != s.vocab_size:
        d2t = ckpt.state["d2t"].to(torch.int64)
        out["d2t"] = torch.arange(d2t.numel(), dtype=torch.int64) + d2t  # llama.cpp reads absolute ids
    return out


def export_block_gguf(ckpt: BlockCheckpoint, out: str | Path, *, target: str | Path, dtype: str = "bf16",
                      overwrite: bool = False, card: dict | None = None) -> BlockGgufReport:
    """Write ``ckpt`` as one ``dflash`` GGUF; ``target`` is the target's GGUF (its tokenizer goes into the draft).
    The model card goes beside it; a README.md of the user's there is kept (``card.updated_readme``)."""
    from gguf import GGUFWriter

    from draftsmith.stages.export.card import shown_path

    if dtype not in GGUF_DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(GGUF_DTYPES)}")
    ckpt.validate()
    tgt = read_target_gguf(target)
    check_gguf_servable(ckpt, tgt.arch, tgt.num_layers, tgt.hidden_size, tgt.vocab_size)
    out = Path(out)
    if out.is_dir() or out.suffix != ".gguf":
        out = out / "drafter.gguf"
    if out.exists() and not overwrite:
        raise ExportError(f"{out}: exists (pass --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    s = ckpt.spec
    tensors = block_gguf_tensors(ckpt)
    tmp = out.with_name(f".{out.name}.tmp")
    w = GGUFWriter(tmp, GGUF_ARCH)
    _write_keys(w, ckpt)
    for field in tgt.tokenizer_fields:
        if field.name != "tokenizer.ggml.mask_token_id":
            copy_field(w, field)
    w.add_uint32("tokenizer.ggml.mask_token_id", s.mask_token_id)
    from draftsmith.stages.export.block import _DTYPES

    for name, t in tensors.items():
        arr, raw = _array(name, t, _DTYPES.get(dtype, dtype))
        w.add_tensor(name, arr, raw_dtype=raw)
    finish_gguf(w, tmp, out)
    _write_card(ckpt, out, target, shown_path(tgt.path), card)
    return BlockGgufReport(path=out, kind=s.kind, tensors=sorted(tensors), dtype=dtype,
                           target_layers=list(s.aux_layer_ids), slot=s.slot, draft_max=s.drafts, target=str(tgt.path))


def _write_keys(w, ckpt: BlockCheckpoint) -> None:
    s = ckpt.spec
    w.add_name(f"draftsmith {s.kind} drafter")
    w.add_string("general.source.draftsmith_version", __version__)
    w.add_block_count(s.num_hidden_layers)
    w.add_context_length(s.max_position_embeddings)
    w.add_embedding_length(s.hidden_size)
    w.add_feed_forward_length(s.intermediate_size)
    w.add_head_count(s.num_attention_heads)
    w.add_head_count_kv(s.num_key_value_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_norm_eps)
    w.add_vocab_size(s.vocab_size)
    w.add_array(f"{GGUF_ARCH}.target_layers", list(s.aux_layer_ids))
    w.add_uint32(f"{GGUF_ARCH}.target_hidden_size", s.target_hidden_size)
    w.add_uint32(f"{GGUF_ARCH}.block_size", s.block_size)
    w.add_bool(f"{GGUF_ARCH}.sample_from_anchor", s.slot == bf.ANCHOR_FIRST)
    w.add_bool(f"{GGUF_ARCH}.attention.causal", False)
    w.add_bool(f"{GGUF_ARCH}.has_confidence_head", s.confidence_head)


def _write_card(ckpt: BlockCheckpoint, out: Path, target, target_gguf: str, card: dict | None) -> None:
    from draftsmith.stages.export.block import _card_facts
    from draftsmith.stages.export.card import write_card

    folder = out.parent
    extra = dict(card or {})
    if not extra.get("base_model") and str(target) == "smollm2":
        from draftsmith.stages.export.card import base_model_of

        extra["base_model"] = base_model_of("smollm2")
    facts = _card_facts(ckpt, "gguf", out, None, [out.name], extra, target_gguf=target_gguf)
    write_card(folder, facts)
