"""Tiny Hugging Face hybrid targets (LFM2, Qwen3.5) written as the F32 GGUFs llama.cpp serves, for the engine tests.

Test-only on purpose: a user converts a real target with llama.cpp's own ``convert_hf_to_gguf.py`` (it knows every
architecture and recognises real tokenizers' pre-tokenizers); the tests need a target no hub provides, converted
without network. The facts come from llama.cpp (``convert_hf_to_gguf.py``'s LFM2 model, ``src/models/lfm2.cpp``,
gguf-py's tensor map); the code is draftsmith's:
  * keys ``lfm2.{context_length, embedding_length, feed_forward_length, block_count, vocab_size}``,
    ``lfm2.attention.{head_count, layer_norm_rms_epsilon}``, ``lfm2.rope.freq_base``, ``lfm2.shortconv.l_cache``
    (``conv_L_cache``) and ``lfm2.attention.head_count_kv`` as an array with 0 at every convolution layer: that 0
    is how llama.cpp tells a recurrent layer from an attention one;
  * per layer ``attn_norm`` (operator_norm), ``ffn_norm``, ``ffn_{gate,up,down}`` (w1, w3, w2), and either
    ``shortconv.{conv,in_proj,out_proj}`` (the depthwise kernel squeezed to 2-D) or ``attn_{q,k,v,output}`` with
    ``attn_{q,k}_norm``; ``token_embd``, ``token_embd_norm`` (LFM2's final norm, HF ``embedding_norm``), ``output``;
  * q and k rows stay in Hugging Face's rotate-half order: llama.cpp ropes LFM2 in NEOX order (no permutation);
  * the tokenizer as a ``gpt2`` byte-level BPE with the GPT-2 pre-tokenizer, which is what the tiny test tokenizers
    (``testing/tokenizer.py``) are.
Qwen3.5 (``qwen35``, from llama.cpp's ``Qwen3_5TextModel`` and its gated delta-net base): the ``ssm.*`` keys
(conv kernel, state size = key head dim, group count = key heads, time-step rank = value heads, inner size),
``full_attention_interval``, partial rope (``rope.dimension_count``) with ``rope.dimension_sections`` (required;
text positions are equal in the t, h and w sections, so a split that covers every rotated pair computes plain
rope); ``A_log`` stored as ``-exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, every norm but the delta-net's own
stored as ``1 + w`` (the model computes ``(1 + w) * x``), and the value heads reordered from grouped-by-key-head to
tiled when there are more value heads than key heads (ggml broadcasts tiled).
Tensor names come from gguf-py's tensor map.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCH = "lfm2"
QWEN35_TYPES = ("qwen3_5_text", "qwen3_5")
_LAYER = {  # HF name under model.layers.{i}. -> GGUF name under blk.{i}.
    "operator_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    "conv.conv.weight": "shortconv.conv.weight",
    "conv.in_proj.weight": "shortconv.in_proj.weight",
    "conv.out_proj.weight": "shortconv.out_proj.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.out_proj.weight": "attn_output.weight",
    "self_attn.q_layernorm.weight": "attn_q_norm.weight",
    "self_attn.k_layernorm.weight": "attn_k_norm.weight",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.embedding_norm.weight": "token_embd_norm.weight",
        "lm_head.weight": "output.weight"}


class TargetGgufError(ValueError):
    """The model directory is not one this converter writes (another architecture, tokenizer or layout)."""


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for one of a Hugging Face LFM2 checkpoint's tensors."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER:
        return f"blk.{int(parts[2])}.{_LAYER[parts[3]]}"
    raise TargetGgufError(f"{hf_name}: no place for this tensor in llama.cpp's {ARCH} graph")


def lfm2_tensors(state: dict[str, torch.Tensor], tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """Every tensor under its GGUF name, F32, the convolution kernel squeezed to (channels, width)."""
    out = {}
    for name, t in state.items():
        t = t.detach().float()
        if name.endswith("conv.conv.weight"):
            t = t.squeeze(1)  # (C, 1, L) -> (C, L): ggml_ssm_conv takes a 2-D kernel
        out[gguf_tensor_name(name)] = t.contiguous()
    if "output.weight" not in out and tie_word_embeddings:
        out["output.weight"] = out["token_embd.weight"]
    return out


def _add_hparams(w, cfg: dict, ffn: int) -> None:
    types = cfg["layer_types"]
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_feed_forward_length(ffn)
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_head_count_kv([0 if t == "conv" else int(cfg["num_key_value_heads"]) for t in types])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))))
    w.add_layer_norm_rms_eps(float(cfg["norm_eps"]))
    w.add_vocab_size(int(cfg["vocab_size"]))
    w.add_shortconv_l_cache(int(cfg["conv_L_cache"]))
    w.add_file_type(0)  # ALL_F32


def _tiled_v_heads(t: torch.Tensor, dim: int, key_heads: int, per_key: int, head_dim: int) -> torch.Tensor:
    """Value heads along ``dim`` from grouped by key head (k0v0, k0v1, k1v0, ...) to tiled (k0v0, k1v0, k0v1, ...)."""
    shape = list(t.shape)
    dim %= len(shape)
    t = t.reshape(*shape[:dim], key_heads, per_key, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def _qwen35_v_order(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """One gated delta-net tensor with its value heads tiled (a no-op with as many value heads as key heads)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    hk, hv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if "linear_attn." not in name or nk == nv:
        return t
    per, qk = nv // nk, 2 * hk * nk
    if ".in_proj_qkv." in name or ".conv1d." in name:  # q and k rows stay, the value rows are reordered
        return torch.cat([t[:qk], _tiled_v_heads(t[qk:], 0, nk, per, hv)])
    if ".in_proj_z." in name:
        return _tiled_v_heads(t, 0, nk, per, hv)
    if ".in_proj_a." in name or ".in_proj_b." in name or name.endswith((".A_log", ".dt_bias")):
        return _tiled_v_heads(t, 0, nk, per, 1)
    if ".out_proj." in name:
        return _tiled_v_heads(t, 1, nk, per, hv)
    return t


def qwen35_tensors(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face Qwen3.5 text checkpoint under its ``qwen35`` GGUF name, as llama.cpp reads it."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, int(cfg["num_hidden_layers"]))
    out = {}
    for name, t in state.items():
        t = t.detach().float()
        if ".conv1d." in name:
            t = t.squeeze(1)  # (C, 1, K) -> (C, K)
        t = _qwen35_v_order(name, t, cfg)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1  # Qwen3.5's RMSNorm scales by (1 + w); llama.cpp's by w
        hf = name.removesuffix(".dt_bias") + ".dt_proj.bias" if name.endswith(".dt_bias") else name
        gguf_name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise TargetGgufError(f"{name}: no place for this tensor in llama.cpp's qwen35 graph")
        out[gguf_name] = t.contiguous()
    if "output.weight" not in out and cfg.get("tie_word_embeddings"):
        out["output.weight"] = out["token_embd.weight"]
    return out


def _add_qwen35_hparams(w, cfg: dict) -> None:
    rope = cfg.get("rope_parameters") or {}
    head = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    n_rot = int(head * rope.get("partial_rotary_factor", 0.25))
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_head_count_kv(int(cfg["num_key_value_heads"]))
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_rope_freq_base(float(rope.get("rope_theta", 10_000.0)))
    w.add_rope_dimension_count(n_rot)
    # Interleaved M-RoPE gives rotated pair i to section i % 3 while that section has room: a split that leaves a
    # pair uncovered rotates it by the 4th section's position, 0 for text ([11, 11, 10] for Qwen3.5's 32 pairs).
    pairs = n_rot // 2
    sections = list(rope.get("mrope_section") or [(pairs - k + 2) // 3 for k in range(3)])
    w.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(int(cfg["vocab_size"]))
    w.add_ssm_conv_kernel(int(cfg["linear_conv_kernel_dim"]))
    w.add_ssm_state_size(int(cfg["linear_key_head_dim"]))
    w.add_ssm_group_count(int(cfg["linear_num_key_heads"]))
    w.add_ssm_time_step_rank(int(cfg["linear_num_value_heads"]))
    w.add_ssm_inner_size(int(cfg["linear_value_head_dim"]) * int(cfg["linear_num_value_heads"]))
    types = cfg["layer_types"]
    interval = types.index("full_attention") + 1
    if any((t == "full_attention") != ((i + 1) % interval == 0) for i, t in enumerate(types)):
        raise TargetGgufError("llama.cpp's qwen35 places attention every n-th layer; these layer_types do not")
    w.add_full_attention_interval(interval)
    w.add_file_type(0)  # ALL_F32


def add_tokenizer(w, model_dir: Path) -> None:
    """The byte-level BPE of ``tokenizer.json`` as llama.cpp's ``gpt2`` tokenizer, with its special tokens and chat
    template (gguf-py's SpecialVocab reads those from the HF files)."""
    from gguf import SpecialVocab, TokenType

    spec = json.loads((model_dir / "tokenizer.json").read_text())
    model, pre = spec.get("model", {}), spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise TargetGgufError(f"{model_dir}: only a byte-level BPE tokenizer with the GPT-2 split converts here")
    vocab = dict(model["vocab"])
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    vocab.update({a["content"]: i for i, a in added.items()})
    by_id = {i: s for s, i in vocab.items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise TargetGgufError(f"{model_dir}: the tokenizer's ids are not contiguous")
    tokens = [by_id[i] for i in range(len(by_id))]
    types = [(TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED) if i in added
             else TokenType.NORMAL for i in range(len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def write_target_gguf(model_dir: str | Path, out: str | Path) -> Path:
    """Write the Hugging Face LFM2 model in ``model_dir`` (config.json, model.safetensors, tokenizer.json) as one
    F32 GGUF at ``out``."""
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    model_type = cfg.get("model_type")
    if model_type not in (ARCH, *QWEN35_TYPES):
        raise TargetGgufError(f"{model_dir}: model_type {model_type!r}; this converter writes lfm2 and "
                              "qwen3_5_text only")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise TargetGgufError(f"{model_dir}: no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    out.parent.mkdir(parents=True, exist_ok=True)
    if model_type == ARCH:
        tensors = lfm2_tensors(state, bool(cfg.get("tie_word_embeddings", False)))
        w = GGUFWriter(out, ARCH)
        _add_hparams(w, cfg, int(tensors["blk.0.ffn_gate.weight"].shape[0]))  # the built width
    else:
        tensors = qwen35_tensors(state, cfg)
        w = GGUFWriter(out, "qwen35")
        _add_qwen35_hparams(w, cfg)
    w.add_name(f"tiny {model_type} (draftsmith test target)")
    add_tokenizer(w, model_dir)
    for name, t in tensors.items():
        w.add_tensor(name, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# --- a fitted hybrid pair for llama.cpp: the tiny target fitted to a chat corpus, a drafter fitted to its answers ----
TARGET_STEPS = 300  # fit the tiny target so that its greedy answers vary with the prompt (random: one answer)
TARGET_LR = 6e-3


def hybrid_llamacpp_world(root: str | Path, arch: str = ARCH, n_prompts: int = 12, new_tokens: int = 48) -> dict:
    """A tiny ``arch`` target (``lfm2`` or ``qwen3_5_text``; 4 layers: three recurrent ones, then attention) fitted
    to ``tiny_chat_corpus``, its F32 GGUF, chat prompts (held-out conversations' user turns, as token ids), plain
    greedy answers (up to the end-of-turn token), and an EAGLE-3 drafter fitted to those answers
    (``fit_chain_drafter``) exported as an fp32 GGUF. Built once per folder."""
    from draftsmith.core import vocab as vocab_mod
    from draftsmith.model.target import load_target
    from draftsmith.stages.decode import SpeculativeDecoder
    from draftsmith.stages.export.gguf import export_gguf
    from draftsmith.testing.models import build_tiny_model, fit_tiny_chat_model, tiny_chat_corpus
    from draftsmith.testing.planted import fit_chain_drafter
    from draftsmith.testing.tokenizer import make_tokenizer

    root = Path(root)
    model_dir, tok = root / "target", make_tokenizer("chatml")
    if not (model_dir / "config.json").is_file():
        model = build_tiny_model(arch, num_hidden_layers=4, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        fit_tiny_chat_model(model, tok, TARGET_STEPS, lr=TARGET_LR)
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    target_gguf = root / "target.gguf"
    if not target_gguf.is_file():
        write_target_gguf(model_dir, target_gguf)
    target = load_target(str(model_dir), pack=False, dtype=torch.float32)
    convs = tiny_chat_corpus(n_prompts, seed=999)  # the target was fitted on seeds 10_000 and up
    prompts = [list(tok.apply_chat_template(c[:1], add_generation_prompt=True, return_dict=True)["input_ids"])
               for c in convs]
    eos = [tok.eos_token_id]
    plain = SpeculativeDecoder(target)
    answers = [plain.generate(p, max_new_tokens=new_tokens, eos_token_ids=eos).token_ids for p in prompts]
    drafter_dir = root / "drafter"
    if not (drafter_dir / "config.json").is_file():
        seqs = [p + a for p, a in zip(prompts, answers, strict=True)]
        kept = torch.cat([torch.tensor([t for s in seqs for t in s]), torch.arange(64)])
        drafter, _ = fit_chain_drafter(target, vocab_mod.from_target_ids(kept, target.vocab_size), seqs)
        drafter.save(drafter_dir)
    drafter_gguf = root / "drafter.gguf"
    if not drafter_gguf.is_file():
        export_gguf(drafter_dir, drafter_gguf, target=target_gguf, dtype="fp32")
    return {"arch": arch, "target": target, "model_dir": model_dir, "target_gguf": target_gguf,
            "drafter_dir": drafter_dir, "drafter_gguf": drafter_gguf, "prompts": prompts, "answers": answers,
            "eos": eos, "tokenizer": tok,
            "new_tokens": new_tokens}
