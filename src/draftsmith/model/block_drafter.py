"""DFlash and DSpark: drafters that fill a whole block of draft tokens in one non-causal pass.

The target's hidden states at ``target_layer_ids`` (the *output* of those layers) are fused per position,
``c_t = hidden_norm(fc(cat(states)))``, and injected as keys/values into every drafter layer (each layer projects
``c_t`` with its own k/v projections, no layer norm). The block's queries are ``[anchor, mask, ..., mask]`` at
positions ``a, a+1, ...``: they attend to all context positions before ``a`` and to each other. DSpark adds a
Markov head (sampled left to right) and a confidence head (model/markov.py). This computes what vLLM 0.32's
``qwen3_dflash.py`` / ``qwen3_dspark.py`` and DeepSpec's ``Qwen3DSparkModel`` compute; module names equal their
checkpoint names, so ``state_dict()`` is the layout. Details and the slot convention: notes/block-interface.md.

Slot convention (``sample_from_anchor``): fill-in (DFlash, speculators): slot j >= 1 predicts position a+j, slot 0
predicts nothing; anchor-first (DeepSpec DSpark): slot j predicts a+j+1. Either way draft j (0-based) predicts
position a+1+j, and that is the order every method here returns drafts in.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith import __version__
from draftsmith.core import vocab as vocab_mod
from draftsmith.core.conventions import block_to_aux_layer_ids
from draftsmith.core.errors import one_line
from draftsmith.model.drafter import (
    MLP,
    WEIGHTS_FILE,
    DrafterError,
    RMSNorm,
    RotaryEmbedding,
    register_draft_vocab,
    rotate_half,
    save_checkpoint,
)
from draftsmith.model.markov import MARKOV_HEAD_TYPES, ConfidenceHead, MarkovHead, build_markov_head

BLOCK_KINDS = ("dflash", "dspark")
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel"}
#: The longest block: a block's attention is square in its size, and acceptance past a few dozen is nil.
MAX_BLOCK_SIZE = 64


@dataclass
class BlockDrafterConfig:
    kind: str  # "dflash" | "dspark"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (embedding rows, markov_w1 rows)
    draft_vocab_size: int
    target_hidden_size: int
    # DFlash convention: id i = the output of target layer i (HF hidden_states[i+1]); -1 = the embedding output.
    target_layer_ids: tuple[int, ...] = (1,)
    block_size: int = 8  # query slots per block at training (anchor included)
    mask_token_id: int = 0
    sample_from_anchor: bool = False
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    target: dict = field(default_factory=dict)  # fingerprint of the target this drafter was made for

    def __post_init__(self):
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        problems = self._problems()
        if problems:
            raise DrafterError(f"{self.kind} drafter config: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        out = []
        if self.kind not in BLOCK_KINDS:
            out.append(f"kind {self.kind!r} is not one of {', '.join(BLOCK_KINDS)}")
        if self.kind == "dflash" and (self.sample_from_anchor or self.markov_rank or self.enable_confidence_head):
            out.append("DFlash has no Markov or confidence head and fills in after the anchor "
                       "(sample_from_anchor false; vLLM refuses it true)")
        if not 1 <= self.num_drafts <= MAX_BLOCK_SIZE or self.block_size > MAX_BLOCK_SIZE:
            out.append(f"block_size {self.block_size} leaves {self.num_drafts} drafts (1..{MAX_BLOCK_SIZE})")
        if not self.target_layer_ids or list(self.target_layer_ids) != sorted(set(self.target_layer_ids)):
            out.append(f"target_layer_ids {list(self.target_layer_ids)} must be strictly increasing and not empty "
                       "(engines concatenate the states in layer order)")
        if any(i < -1 for i in self.target_layer_ids):
            out.append(f"target_layer_ids {list(self.target_layer_ids)} go below -1 (the embedding output)")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            out.append(f"markov_head_type {self.markov_head_type!r} is not one of {', '.join(MARKOV_HEAD_TYPES)}")
        if self.markov_rank < 0:
            out.append(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.confidence_head_with_markov and not (self.enable_confidence_head and self.markov_rank):
            out.append("confidence_head_with_markov needs a confidence head and markov_rank > 0")
        if not 0 <= self.mask_token_id < self.vocab_size:
            out.append(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        return out

    @property
    def num_drafts(self) -> int:
        """Draft tokens per block: every slot (anchor-first) or every slot after the anchor (fill-in)."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def shape_key(self) -> dict:
        """The sizes a timing of this drafter depends on (keys of the measurement cache)."""
        return {"kind": self.kind, "hidden": self.hidden_size, "inter": self.intermediate_size,
                "layers": self.num_hidden_layers, "heads": self.num_attention_heads, "kv": self.num_key_value_heads,
                "draft_vocab": self.draft_vocab_size, "aux": len(self.target_layer_ids),
                "target_hidden": self.target_hidden_size, "markov": [self.markov_rank, self.markov_head_type],
                "anchor_first": self.sample_from_anchor}

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The Target's aux ids (input of layer i+1) for ``target_layer_ids``."""
        return block_to_aux_layer_ids(self.target_layer_ids)

    @classmethod
    def from_target(cls, target, kind: str, draft_vocab_size: int | None = None, **overrides) -> BlockDrafterConfig:
        """Sizes from the target's config, the paper's heads for DSpark; any field can be overridden."""
        from draftsmith.model.drafter import DrafterConfig

        base = asdict(DrafterConfig.from_target(target, draft_vocab_size=draft_vocab_size))
        for key in ("aux_layer_ids", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
            base.pop(key)
        n_ids = overrides.pop("num_target_layers", 5)
        base.update(kind=kind, num_hidden_layers=2, target_layer_ids=default_target_layer_ids(target.num_layers,
                                                                                              n_ids),
                    mask_token_id=default_mask_token_id(target))
        if kind == "dspark":
            base.update(block_size=7, sample_from_anchor=True, markov_rank=256, enable_confidence_head=True,
                        confidence_head_with_markov=True)
        base.update(overrides)
        if "hidden_size" in overrides and "head_dim" not in overrides:
            base["head_dim"] = base["hidden_size"] // base["num_attention_heads"]
        return cls(**base)

    def to_config_dict(self, dtype: torch.dtype = torch.float32) -> dict:
        """config.json of draftsmith's native layout (keys as vLLM's Qwen3 DFlash/DSpark configs name them)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("kind", "target")}
        d["target_layer_ids"] = list(self.target_layer_ids)
        return {
            "architectures": [ARCHITECTURES[self.kind]], "model_type": "qwen3", **d,
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                              "block_size": self.block_size},
            "torch_dtype": str(dtype).removeprefix("torch."),
            "draftsmith": {"kind": self.kind, "version": __version__, "target_layer_convention": "output_of_layer",
                           "target": self.target},
        }

    @classmethod
    def from_config_dict(cls, d: dict) -> BlockDrafterConfig:
        ours = d.get("draftsmith") or {}
        names = set(cls.__dataclass_fields__) - {"kind", "target"}
        kw = {k: d[k] for k in names if k in d}
        return cls(kind=ours.get("kind") or kind_of_config(d) or "", target=ours.get("target", {}), **kw)


def kind_of_config(d: dict) -> str | None:
    """'dflash' / 'dspark' for a block drafter's config.json, None for anything else (EAGLE-3 included)."""
    kind = (d.get("draftsmith") or {}).get("kind")
    if kind in BLOCK_KINDS:
        return kind
    archs = " ".join(d.get("architectures") or []).lower()
    if "dspark" in archs or d.get("markov_rank"):
        return "dspark"
    if "dflash" in archs or d.get("dflash_config"):
        return "dflash"
    return None


def default_target_layer_ids(num_layers: int, n: int = 5) -> tuple[int, ...]:
    """z-lab's spread (DeepSpec's Qwen3-4B [1, 9, 17, 25, 33] for 36 layers): ids 1..N-3, evenly; fewer distinct
    ones on a target too shallow for n. Every id is below N-1, so its state is the input of a real layer."""
    if num_layers < 2:
        raise DrafterError(f"a block drafter needs a target of at least 2 layers, this one has {num_layers}")
    start, end = 1, max(1, num_layers - 3)
    ids = [round(start + j * (end - start) / (n - 1)) for j in range(n)] if n > 1 else [num_layers // 2]
    return tuple(sorted(set(min(i, num_layers - 2) for i in ids)))


def default_mask_token_id(target) -> int:
    """A row the target never emits: the first embedding row past the tokenizer's tokens where the table is
    padded (Qwen3: 151669, DeepSpec's and z-lab's choice), else a pad or unknown token that is not an end token,
    else the last row. DFlash and DSpark embed it with the target's own table."""
    tok, cfg, vocab = getattr(target, "tokenizer", None), target.config, target.vocab_size
    if tok is not None and len(tok) < vocab:
        return len(tok)
    ends = {getattr(tok, "eos_token_id", None)}
    ends |= set(cfg.eos_token_id) if isinstance(cfg.eos_token_id, list) else {cfg.eos_token_id}
    for cand in (getattr(tok, "pad_token_id", None), getattr(cfg, "pad_token_id", None),
                 getattr(tok, "unk_token_id", None)):
        if isinstance(cand, int) and 0 <= cand < vocab and cand not in ends:
            return cand
    return vocab - 1


class BlockAttention(nn.Module):
    """Qwen3 attention (per-head q/k RMSNorm before RoPE) whose keys start with the injected context."""

    def __init__(self, cfg: BlockDrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [B, H_kv, T, D] of x (the fused context, or the block's normed input)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return k * cos + rotate_half(k) * sin, v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k, v = self.kv(x, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=-2), torch.cat([ctx_v, v], dim=-2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class BlockLayer(nn.Module):
    def __init__(self, cfg: BlockDrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = BlockAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class BlockCache:
    """The drafter's context keys/values per layer ([1, H_kv, L, D]); only verified positions ever enter it."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[-2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k], dim=-2)
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v], dim=-2)


@dataclass
class BlockTrainOutput:
    """One training pass; draft j of anchor a predicts position ``positions[..., j]`` (-1: past the sequence)."""

    logits: torch.Tensor  # [B, A, K, Vd], Markov bias included (teacher-forced)
    hidden: torch.Tensor  # [B, A, K, H], the backbone's normed output of each draft slot
    positions: torch.Tensor  # [B, A, K] long
    prev_ids: torch.Tensor  # [B, A, K] the Markov head's previous token for each draft
    confidence: torch.Tensor | None  # [B, A, K] logits of the acceptance probability


class BlockDrafter(nn.Module):
    def __init__(self, cfg: BlockDrafterConfig, draft_vocab: vocab_mod.DraftVocab | None = None,
                 own_embedding: bool = False):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.markov_head: MarkovHead | None = build_markov_head(
            cfg.markov_head_type, cfg.vocab_size, cfg.draft_vocab_size, cfg.markov_rank, cfg.hidden_size)
        self.confidence_head = (ConfidenceHead(cfg.hidden_size, cfg.markov_rank, cfg.confidence_head_with_markov)
                                if cfg.enable_confidence_head else None)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        register_draft_vocab(self, draft_vocab, cfg.vocab_size, cfg.draft_vocab_size)
        self._embed: list[nn.Module] = []  # the target's table, shared and never saved

    @property
    def kind(self) -> str:
        return self.config.kind

    # --- wiring --------------------------------------------------------------------------------------
    def bind_embeddings(self, embed_tokens: nn.Module) -> None:
        """Use the target's (frozen) input embedding, as DFlash and DSpark do; it is never saved."""
        if self.embed_tokens is not None:
            return
        n, width = embed_tokens.weight.shape
        if n < self.config.vocab_size or width != self.config.hidden_size:
            raise DrafterError(f"target embedding {n}x{width} does not fit the drafter (vocab_size "
                               f"{self.config.vocab_size}, hidden_size {self.config.hidden_size}); a drafter of "
                               "another width needs its own embed_tokens")
        self._embed = [embed_tokens]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        if not self._embed:
            raise DrafterError("drafter has no embedding: call bind_embeddings(target.embed_tokens)")
        with torch.no_grad():  # a raw row lookup, as the engines do with the shared table
            return F.embedding(ids, self._embed[0].weight).to(self.fc.weight.dtype)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # --- building blocks -----------------------------------------------------------------------------
    def context(self, aux_hidden_states: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(cat(states)))`` [B, T, hidden]: what every layer's context keys/values project."""
        x = aux_hidden_states if torch.is_tensor(aux_hidden_states) else torch.cat(list(aux_hidden_states), -1)
        return self.hidden_norm(self.fc(x.to(self.fc.weight.dtype)))

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(position_ids, self.fc.weight.dtype)

    def backbone(self, block_ids: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor | None = None,
                 ctx_pos: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 cache: BlockCache | None = None) -> torch.Tensor:
        """The block's normed hidden states [B, Q, H]: context keys from ``ctx`` at ``ctx_pos``, or from ``cache``.

        ``mask`` (bool [B, 1, Q, ctx + Q], True = attend) defaults to everything: the whole context, the whole
        block (decoding). Training passes DeepSpec's mask (see ``forward_train``).
        """
        x = self.embed(block_ids)
        cos, sin = self.rope(block_pos)
        if cache is None:
            ccos, csin = self.rope(ctx_pos)
        for i, layer in enumerate(self.layers):
            if cache is None:
                ctx_k, ctx_v = layer.self_attn.kv(ctx, ccos, csin)
            else:
                ctx_k, ctx_v = cache.k[i], cache.v[i]
            x = layer(x, cos, sin, ctx_k, ctx_v, mask)
        return self.norm(x)

    def logits(self, hid: torch.Tensor) -> torch.Tensor:
        """Base logits over the draft vocabulary (DSpark adds the Markov bias per position)."""
        return self.lm_head(hid)

    def markov_bias(self, prev_ids: torch.Tensor, hid: torch.Tensor,
                    state: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One position's Markov bias from the previous target token (None without a Markov head)."""
        if self.markov_head is None:
            return None, None
        return self.markov_head.step(prev_ids, hid, state)

    def confidence_logits(self, hid: torch.Tensor, prev_ids: torch.Tensor,
                          markov_embedded: torch.Tensor | None = None) -> torch.Tensor | None:
        """The confidence head's logit; ``markov_embedded``: ``markov_head.embed(prev_ids)`` if the caller has it."""
        if self.confidence_head is None:
            return None
        e = None
        if self.config.confidence_head_with_markov:
            e = self.markov_head.embed(prev_ids) if markov_embedded is None else markov_embedded
        return self.confidence_head(hid, e)

    # --- training --------------------------------------------------------------------------------------
    def forward_train(self, aux_hidden_states, input_ids: torch.Tensor, anchors: torch.Tensor,
                      anchor_keep: torch.Tensor | None = None, prev_ids: torch.Tensor | None = None
                      ) -> BlockTrainOutput:
        """All anchors' blocks of B sequences in one pass (DeepSpec's layout): anchor a's slots see the context
        positions < a and their own block. ``anchors`` [B, A] positions; ``prev_ids`` overrides the Markov head's
        teacher-forced previous tokens (default ``input_ids[p-1]`` for the draft predicting p)."""
        cfg, (b, t), a = self.config, input_ids.shape, anchors.shape[1]
        s, k, first = cfg.block_size, cfg.num_drafts, 0 if cfg.sample_from_anchor else 1
        dev = input_ids.device
        offs = torch.arange(s, device=dev)
        block_pos = (anchors[..., None] + offs).reshape(b, a * s)
        block_ids = torch.full((b, a, s), cfg.mask_token_id, dtype=torch.long, device=dev)
        block_ids[..., 0] = input_ids.gather(1, anchors)
        mask = self._train_mask(anchors, t, anchor_keep)
        ctx_pos = torch.arange(t, device=dev).expand(b, t)
        hid = self.backbone(block_ids.reshape(b, a * s), block_pos, self.context(aux_hidden_states), ctx_pos, mask)
        hid = hid.view(b, a, s, -1)[:, :, first:first + k]
        positions = anchors[..., None] + 1 + torch.arange(k, device=dev)
        if prev_ids is None:
            prev_ids = input_ids.gather(1, (positions - 1).clamp(max=t - 1).reshape(b, a * k)).view(b, a, k)
        logits = self.logits(hid)
        if self.markov_head is not None:
            logits = logits + self.markov_head.block(prev_ids, hid)
        positions = positions.masked_fill(positions >= t, -1)
        return BlockTrainOutput(logits=logits, hidden=hid, positions=positions, prev_ids=prev_ids,
                                confidence=self.confidence_logits(hid, prev_ids))

    def _train_mask(self, anchors: torch.Tensor, t: int, keep: torch.Tensor | None) -> torch.Tensor:
        """bool [B, 1, A*S, T + A*S]: context before the block's anchor (if kept), and the block itself."""
        b, a = anchors.shape
        s, dev = self.config.block_size, anchors.device
        ctx = torch.arange(t, device=dev)[None, None, :] < anchors[..., None]  # [B, A, T]
        if keep is not None:
            ctx = ctx & keep[..., None]
        own = torch.eye(a, dtype=torch.bool, device=dev)  # [A, A]
        own = own[:, None, :, None].expand(a, s, a, s).reshape(a * s, a * s)
        ctx = ctx[:, :, None, :].expand(b, a, s, t).reshape(b, a * s, t)
        return torch.cat([ctx, own.expand(b, -1, -1)], dim=-1)[:, None]

    # --- decoding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def extend_context(self, aux_hidden_states, positions: torch.Tensor, cache: BlockCache) -> None:
        """Append the context keys/values of newly verified positions ([1, n] each) to every layer's cache."""
        c = self.context(aux_hidden_states)
        cos, sin = self.rope(positions)
        for i, layer in enumerate(self.layers):
            cache.append(i, *layer.self_attn.kv(c, cos, sin))

    @torch.no_grad()
    def draft_hidden(self, anchor_id: int, anchor_pos: int, k: int, cache: BlockCache) -> torch.Tensor:
        """The normed hidden [1, k, H] of draft slots 0..k-1 (draft j predicts position anchor_pos + 1 + j)."""
        first = 0 if self.config.sample_from_anchor else 1
        dev = self.d2t.device
        ids = torch.full((1, first + k), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = anchor_id
        pos = torch.arange(anchor_pos, anchor_pos + first + k, device=dev)[None]
        return self.backbone(ids, pos, cache=cache)[:, first:]

    # --- persistence -----------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """config.json + model.safetensors (d2t/t2d only for a reduced vocabulary, as EAGLE-3's save)."""
        full = self.config.draft_vocab_size == self.config.vocab_size
        return save_checkpoint(path, self, self.config.to_config_dict(self.fc.weight.dtype), full_vocab=full)


def init_weights(drafter: BlockDrafter, std: float = 0.02) -> None:
    """Small normal weights; ``fc`` by fan-in so the fused context starts at the target's scale."""
    for m in drafter.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)) and m is not drafter.embed_tokens:
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    nn.init.normal_(drafter.fc.weight, std=drafter.fc.in_features ** -0.5)


def check_fits(cfg: BlockDrafterConfig, target) -> None:
    """A drafter made for another target fails here, naming both values, instead of accepting nothing."""
    problems = []
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != target hidden_size {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target vocab_size {target.vocab_size}")
    bad = [i for i in cfg.target_layer_ids if i >= target.num_layers - 1]
    if bad:
        problems.append(f"target_layer_ids {bad} need the output of a layer past N-2 (the target has "
                        f"{target.num_layers} layers)")
    if problems:
        raise DrafterError(f"{cfg.kind} drafter does not fit target {target.name}: " + "; ".join(problems))


def attach(drafter: BlockDrafter, target) -> BlockDrafter:
    """Fit checks, the target's aux layers set to the drafter's, the target's embedding bound (loading with a
    target, as ``load_drafter`` points the target at an EAGLE-3 drafter's layers)."""
    check_fits(drafter.config, target)
    if tuple(target.aux_layers) != drafter.config.aux_layer_ids:
        target.set_aux_hidden_state_layers(drafter.config.aux_layer_ids)
    drafter.bind_embeddings(target.embed_tokens)
    return drafter


def new_block_drafter(target, kind: str = "dflash", draft_vocab: vocab_mod.DraftVocab | None = None,
                      seed: int | None = 0, **overrides) -> BlockDrafter:
    """A freshly initialised block drafter sized for ``target`` (the trainer's start, ``--random-drafter``).

    ``target`` is only read (sizes, embedding table): its aux layers stay as they are. Whoever runs the target
    for this drafter points them at ``drafter.config.aux_layer_ids`` (the decoder does, ``resolve_block_spec``;
    the online trainer does), so that making a drafter never changes what another user of the target sees.
    """
    n = draft_vocab.draft_vocab_size if draft_vocab is not None else overrides.pop("draft_vocab_size", None)
    cfg = BlockDrafterConfig.from_target(target, kind, draft_vocab_size=n, **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    own = cfg.hidden_size != target.embed_tokens.weight.shape[1]
    drafter = BlockDrafter(cfg, draft_vocab=draft_vocab, own_embedding=own)
    init_weights(drafter)
    check_fits(cfg, target)
    drafter.bind_embeddings(target.embed_tokens)
    return drafter.to(device=target.device, dtype=target.dtype).eval()


@torch.no_grad()
def init_head_from_target(drafter: BlockDrafter, lm_head_weight: torch.Tensor,
                          final_norm_weight: torch.Tensor | None = None) -> bool:
    """``lm_head`` from the target's rows of the draft vocabulary and ``norm`` from its final norm (DFlash
    shares the target's head); False when the widths differ."""
    if lm_head_weight.shape[1] != drafter.config.hidden_size:
        return False
    ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size, device=drafter.d2t.device))
    drafter.lm_head.weight.copy_(lm_head_weight[ids.to(lm_head_weight.device)])
    if final_norm_weight is not None and final_norm_weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(final_norm_weight)
    return True


def read_config(path: str | Path) -> tuple[Path, dict]:
    """(config.json path, its object), or one clear error for a missing or malformed file."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: not a drafter directory (no config.json)")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise DrafterError(f"{cfg_file}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise DrafterError(f"{cfg_file}: not a drafter config (a JSON {type(raw).__name__}, not an object)")
    return cfg_file, raw


def _check_sizes(cfg: BlockDrafterConfig, cfg_file: Path, weight_elements: int) -> None:
    """Positive sizes whose tensors fit in the weights file: an edited size must not allocate terabytes first."""
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size", "target_hidden_size"):
        if getattr(cfg, name) < 1:
            raise DrafterError(f"{cfg_file}: {name} must be >= 1, got {getattr(cfg, name)}")
    h = cfg.hidden_size
    need = cfg.num_hidden_layers * (cfg.intermediate_size + cfg.num_attention_heads * cfg.head_dim) * h
    need += cfg.draft_vocab_size * h + cfg.markov_rank * (cfg.vocab_size + cfg.draft_vocab_size)
    if need > weight_elements:
        raise DrafterError(f"{cfg_file}: its sizes need {need} parameters, more than the {weight_elements} its "
                           "weights hold: the config disagrees with the weights")


def load_block_drafter(path: str | Path, target=None, *, device=None, dtype: torch.dtype | None = None
                       ) -> BlockDrafter:
    """Load a block drafter saved by ``BlockDrafter.save``; with ``target``, check the fit and attach to it."""
    from safetensors.torch import load_file

    from draftsmith.core.tensorfile import corrupt_weights_named

    cfg_file, raw = read_config(path)
    try:
        cfg = BlockDrafterConfig.from_config_dict(raw)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        hint = "" if "draftsmith" in raw else "; an engine's layout (z-lab, DeepSpec, speculators): `draftsmith import`"
        raise DrafterError(f"{cfg_file}: not a DFlash/DSpark drafter config ({one_line(e)[:300]}){hint}") from e
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{path}: no {WEIGHTS_FILE}")
    with corrupt_weights_named(weights):
        state = load_file(str(weights))
    _check_sizes(cfg, cfg_file, sum(t.numel() for t in state.values()))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    own = "embed_tokens.weight" in state and (
        cfg.hidden_size != (target.embed_tokens.weight.shape[1] if target is not None else cfg.target_hidden_size))
    if not own:
        state.pop("embed_tokens.weight", None)
    dv = vocab_mod.from_state(state, cfg.vocab_size, cfg.draft_vocab_size)
    state["d2t"], state["t2d"] = dv.d2t, dv.t2d
    drafter = BlockDrafter(cfg, draft_vocab=dv, own_embedding=own)
    try:
        missing, unexpected = drafter.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes other than config.json's sizes
        raise DrafterError(f"{cfg_file}: its sizes disagree with {weights} ({one_line(e)[:300]})") from e
    if missing or unexpected:
        raise DrafterError(f"{weights}: missing weights {sorted(missing)}, unexpected {sorted(unexpected)}")
    if target is not None:
        attach(drafter, target)
        device, dtype = device or target.device, dtype or target.dtype
    drafter = drafter.to(device=device or "cpu", dtype=dtype or torch.float32).eval()
    if target is not None and getattr(target, "packed", False):  # as load_drafter: packed where the target is
        from draftsmith.model.packing import pack_linears

        pack_linears(drafter)
    return drafter
