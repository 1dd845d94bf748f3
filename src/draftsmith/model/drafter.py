"""The EAGLE-3 draft model, its config, and save/load in the EAGLE-3 HF layout SGLang and vLLM read.

Per position t the drafter sees ``g_t = fc(cat(aux_hidden_states_t))`` and the embedding of token t+1
(the target's frozen table) and predicts token t+2 over a reduced draft vocabulary. Later drafting steps
feed the layer's own pre-norm output in place of ``g``. Module names equal the checkpoint's weight names
(``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), so ``state_dict()`` *is* the layout.

EAGLE-3.1 (speculators, vLLM, SpecForge) adds three switches, all off by default (then the drafter computes
EAGLE-3 exactly): ``norm_before_fc`` (``input_norm``: one RMSNorm over cat(aux states) before ``fc``), ``fc_norm``
(``fc_norm.{i}``: one RMSNorm per aux state) and ``norm_output`` (later steps are fed ``norm(out)``, not ``out``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith import __version__
from draftsmith.core import vocab as vocab_mod
from draftsmith.core.conventions import canonical_weight_name, from_sglang_layer_ids, norm_mismatches, norm_switches
from draftsmith.core.errors import DraftsmithError, one_line

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"


class DrafterError(DraftsmithError, ValueError):
    """A drafter that does not fit its target, or a checkpoint that is not an EAGLE-3 drafter."""


def register_draft_vocab(module: nn.Module, draft_vocab: vocab_mod.DraftVocab | None, vocab_size: int,
                         draft_vocab_size: int) -> None:
    """A drafter's ``d2t``/``t2d`` buffers (saved with it), checked against its config; the identity when none."""
    dv = draft_vocab or vocab_mod.identity(vocab_size, draft_vocab_size)
    vocab_mod.validate(dv.d2t, dv.t2d, vocab_size)
    if dv.draft_vocab_size != draft_vocab_size:
        raise DrafterError(f"d2t has {dv.draft_vocab_size} entries, config draft_vocab_size is {draft_vocab_size}")
    module.register_buffer("d2t", dv.d2t.clone())
    module.register_buffer("t2d", dv.t2d.clone())


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    # Aux layer ids in vLLM's convention: L = the residual stream entering target layer L.
    aux_layer_ids: tuple[int, ...] = (2, 4, 5)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False
    # EAGLE-3.1 (field names as speculators and vLLM write them; see core.conventions.NORM_SWITCHES)
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    target: dict = field(default_factory=dict)  # fingerprint of the target this drafter was made for

    @classmethod
    def from_target(cls, target, draft_vocab_size: int | None = None, **overrides) -> DrafterConfig:
        """Sizes default from the target's config, as the reference drafters do."""
        c = target.config
        hidden = int(c.hidden_size)
        # A target without attention (Mamba, Mamba-2, Falcon-Mamba) names no head count: heads of 128 (or 64) dims.
        heads = int(getattr(c, "num_attention_heads", None) or next(
            (hidden // d for d in (128, 64) if hidden % d == 0 and hidden >= d), 1))
        rope = getattr(c, "rope_parameters", None) or {}
        theta = getattr(c, "rope_theta", None) or (rope.get("rope_theta") if isinstance(rope, dict) else None)
        inter = getattr(c, "intermediate_size", None) or 4 * hidden
        kw = dict(
            hidden_size=hidden,
            intermediate_size=int(inter),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=hidden // heads,
            vocab_size=target.vocab_size,
            draft_vocab_size=min(draft_vocab_size or 32000, target.vocab_size),
            target_hidden_size=hidden,
            aux_layer_ids=tuple(target.aux_layers),
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6) or 1e-6),
            rope_theta=float(theta or 10000.0),
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 4096) or 4096),
            target=target.fingerprint(),
        )
        kw.update(overrides)
        if "hidden_size" in overrides and "head_dim" not in overrides:
            kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
        return cls(**kw)

    def __post_init__(self):
        if self.norm_before_fc and self.fc_norm:
            raise DrafterError("norm_before_fc and fc_norm exclude each other (one norm over the concatenated aux "
                               "states, or one per aux state); speculators refuses both, vLLM would apply both")

    @property
    def eagle31(self) -> bool:
        """Whether any EAGLE-3.1 norm is on."""
        return self.norm_before_fc or self.fc_norm or self.norm_output

    def norm_flags(self) -> dict[str, bool]:
        """The EAGLE-3.1 switches under the config names every engine reads."""
        return {"norm_before_fc": self.norm_before_fc, "fc_norm": self.fc_norm, "norm_output": self.norm_output}

    def shape_key(self) -> dict:
        """The sizes a timing of this drafter depends on (keys of the measurement cache)."""
        return {"hidden": self.hidden_size, "inter": self.intermediate_size, "heads": self.num_attention_heads,
                "kv": self.num_key_value_heads, "draft_vocab": self.draft_vocab_size,
                "aux": len(self.aux_layer_ids), "target_hidden": self.target_hidden_size}

    def to_hf_config(self, dtype: torch.dtype = torch.float32) -> dict:
        """config.json in the EAGLE-3 HF layout (SGLang/SpecForge), which vLLM also loads."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "norm_before_residual": self.norm_before_residual,
            **({k: True for k, on in self.norm_flags().items() if on}),
            "tie_word_embeddings": False,
            "attention_bias": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "draftsmith": {
                "version": __version__,
                "aux_layer_convention": "input_of_layer",
                "target": self.target,
            },
        }

    @classmethod
    def from_hf_config(cls, d: dict) -> DrafterConfig:
        if d.get("num_hidden_layers", 1) != 1:
            raise DrafterError(f"only one-layer EAGLE-3 drafters are supported, got {d['num_hidden_layers']}")
        heads = int(d["num_attention_heads"])
        ours = d.get("draftsmith", {})
        ids = d.get("eagle_aux_hidden_state_layer_ids")
        if ids is None and "eagle_config" in d:  # SGLang's nested field counts "output of layer i"
            sg = d["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
            ids = from_sglang_layer_ids(sg) if sg else None
        return cls(
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads", heads)),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            vocab_size=int(d["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
            target_hidden_size=int(d.get("target_hidden_size") or d["hidden_size"]),
            aux_layer_ids=tuple(ids) if ids else (),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            **norm_switches(d),
            target=ours.get("target", {}),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, D]


class KVCache:
    """The drafter's own KV cache: [B, H_kv, S, D], growing by concatenation, cropped after each round."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=-2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=-2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[..., :length, :], self.v[..., :length, :]


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        in_dim = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(in_dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projected, rotated q [B,H,T,D] and k, v [B,H_kv,T,D] (the trainer builds its own pattern on these)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def forward(self, x, cos, sin, cache: KVCache | None, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)
        s = k.shape[-2]
        if mask is None and t > 1:
            # Causal, aligned bottom-right: query i sees keys up to s - t + i.
            mask = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(s - t)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Llama layer whose attention reads cat(input_layernorm(embedding), hidden_norm(g))."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attention_input(self, g: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input of width 2*hidden, residual)."""
        h = self.hidden_norm(g)
        residual = h if self.norm_before_residual else g
        return torch.cat([self.input_layernorm(embeds), h], dim=-1), residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Residual add, MLP; returns the pre-norm output that later steps feed back as ``g``."""
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, g, embeds, cos, sin, cache: KVCache | None, mask: torch.Tensor | None) -> torch.Tensor:
        x, residual = self.attention_input(g, embeds)
        return self.finish(self.self_attn(x, cos, sin, cache, mask), residual)


class Eagle3Drafter(nn.Module):
    kind = "eagle3"  # model/kinds.py

    def __init__(self, cfg: DrafterConfig, embed_tokens: nn.Module | None = None,
                 draft_vocab: vocab_mod.DraftVocab | None = None, own_embedding: bool = False):
        super().__init__()
        self.config = cfg
        # A drafter narrower/wider than its target cannot share the target's table: it carries its own
        # (saved as embed_tokens.weight, which engines then load instead of sharing).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        n_aux = len(cfg.aux_layer_ids)
        # EAGLE-3.1 norms on the aux states (absent unless switched on: a 3.0 drafter has no such tensors).
        self.input_norm = RMSNorm(n_aux * cfg.target_hidden_size, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
                                     for _ in range(n_aux)) if cfg.fc_norm else None
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        register_draft_vocab(self, draft_vocab, cfg.vocab_size, cfg.draft_vocab_size)
        self._embed: list[nn.Module] = []  # shared with the target, not a parameter of the drafter
        if embed_tokens is not None:
            self.bind_embeddings(embed_tokens)

    # --- wiring --------------------------------------------------------------------------------------
    def bind_embeddings(self, embed_tokens: nn.Module) -> None:
        """Use the target's (frozen) input embedding; it is never saved with the drafter."""
        if self.embed_tokens is not None:
            return
        n, width = embed_tokens.weight.shape
        if n < self.config.vocab_size:
            raise DrafterError(f"embedding has {n} rows, drafter vocab_size is {self.config.vocab_size}")
        if width != self.config.hidden_size:
            raise DrafterError(f"target embedding width {width} != drafter hidden_size {self.config.hidden_size}; "
                               "a drafter of another width needs its own embed_tokens")
        self._embed = [embed_tokens]

    @property
    def layer(self) -> DecoderLayer:
        return self.layers[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        if not self._embed:
            raise DrafterError("drafter has no embedding: call bind_embeddings(target.embed_tokens)")
        # A raw table lookup, as vLLM's and SGLang's drafters do with the shared table (no Gemma-style
        # scaling that some HF embedding modules apply in forward).
        with torch.no_grad():
            return F.embedding(input_ids, self._embed[0].weight).to(self.fc.weight.dtype)

    def fuse(self, aux_hidden_states: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """g = fc(cat(low, mid, high)); EAGLE-3.1 norms the concatenation (norm_before_fc) or each state (fc_norm)."""
        x = aux_hidden_states if torch.is_tensor(aux_hidden_states) else torch.cat(list(aux_hidden_states), -1)
        x = x.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), -1), strict=True)], -1)
        return self.fc(x)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(position_ids, self.fc.weight.dtype)

    # --- forward -------------------------------------------------------------------------------------
    def forward(self, g: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """One drafter step over T positions; returns its output state [B, T, hidden] (see ``output_state``)."""
        cos, sin = self.rope(position_ids)
        return self.output_state(self.layer(g, self.embed(input_ids), cos, sin, cache, mask))

    def output_state(self, prenorm: torch.Tensor) -> torch.Tensor:
        """The state a step hands on, fed back as the next step's ``g`` and read by ``logits``: the layer's pre-norm
        output (EAGLE-3), or its final norm (EAGLE-3.1 ``norm_output``, as vLLM's and speculators' drafters do)."""
        return self.norm(prenorm) if self.config.norm_output else prenorm

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary of an ``output_state`` (always read through the final norm once)."""
        return self.lm_head(state if self.config.norm_output else self.norm(state))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # --- persistence ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        full = self.config.draft_vocab_size == self.config.vocab_size
        return save_checkpoint(path, self, self.config.to_hf_config(self.fc.weight.dtype), full_vocab=full)


def save_checkpoint(path: str | Path, module: nn.Module, config: dict, *, full_vocab: bool) -> Path:
    """A drafter of any kind as config.json + model.safetensors, each written atomically. A full vocabulary needs
    no mapping, and vLLM rejects a d2t it has no parameter for: d2t/t2d are dropped then."""
    from safetensors.torch import save as st_save

    from draftsmith.core.io import atomic_write

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    if full_vocab:
        state.pop("d2t"), state.pop("t2d")
    atomic_write(path / WEIGHTS_FILE, st_save(state, metadata={"format": "pt"}))
    atomic_write(path / "config.json", json.dumps(config, indent=2).encode())
    return path


def check_fits(cfg: DrafterConfig, target) -> None:
    """A drafter made for another target fails here, naming both values, instead of accepting nothing."""
    problems = []
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != target hidden_size {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target vocab_size {target.vocab_size}")
    if len(cfg.aux_layer_ids) != len(target.aux_layers):
        problems.append(f"{len(cfg.aux_layer_ids)} aux layers {list(cfg.aux_layer_ids)} != "
                        f"target's {len(target.aux_layers)} {list(target.aux_layers)}")
    if problems:
        raise DrafterError(f"drafter does not fit target {target.name}: " + "; ".join(problems))


def new_drafter(target, draft_vocab: vocab_mod.DraftVocab | None = None, seed: int | None = 0,
                **overrides) -> Eagle3Drafter:
    """A freshly initialised drafter sized for ``target`` (used by the trainer and for ``--random-drafter``)."""
    n = draft_vocab.draft_vocab_size if draft_vocab is not None else overrides.pop("draft_vocab_size", None)
    cfg = DrafterConfig.from_target(target, draft_vocab_size=n, **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    own = cfg.hidden_size != target.embed_tokens.weight.shape[1]
    drafter = Eagle3Drafter(cfg, draft_vocab=draft_vocab, own_embedding=own)
    _init_weights(drafter)
    drafter.bind_embeddings(target.embed_tokens)
    return drafter.to(device=target.device, dtype=target.dtype).eval()


def _init_weights(drafter: Eagle3Drafter, std: float = 0.02) -> None:
    for m in drafter.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
    # Scale fc by fan-in so g starts at the target's activation scale.
    nn.init.normal_(drafter.fc.weight, std=1.0 / math.sqrt(drafter.fc.in_features))


@torch.no_grad()
def init_head_from_target(drafter: Eagle3Drafter, lm_head_weight: torch.Tensor,
                          final_norm_weight: torch.Tensor | None = None) -> bool:
    """Start ``lm_head`` from the target's rows for the draft vocabulary and ``norm`` from its final norm.

    The drafter's last step predicts the target's next hidden state and reads it out through the target's
    head, so this puts the read-out where training would have to find it from random weights. False when
    the drafter's width differs from the target's (nothing to copy).
    """
    if lm_head_weight.shape[1] != drafter.config.hidden_size:
        return False
    ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size, device=drafter.d2t.device))
    drafter.lm_head.weight.copy_(lm_head_weight[ids.to(lm_head_weight.device)])
    if final_norm_weight is not None and final_norm_weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(final_norm_weight)
    return True


def check_config_sizes(cfg: DrafterConfig, cfg_file: Path, weight_elements: int) -> None:
    """Positive sizes whose tensors fit in the weights file: an edited size must not allocate terabytes first."""
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "vocab_size", "draft_vocab_size", "target_hidden_size"):
        if getattr(cfg, name) < 1:
            raise DrafterError(f"{cfg_file}: {name} must be >= 1, got {getattr(cfg, name)}")
    h = cfg.hidden_size
    for what, n in (("intermediate_size x hidden_size", cfg.intermediate_size * h),
                    ("num_attention_heads x head_dim x hidden_size", cfg.num_attention_heads * cfg.head_dim * h),
                    ("draft_vocab_size x hidden_size", cfg.draft_vocab_size * h)):
        if n > weight_elements:
            raise DrafterError(f"{cfg_file}: {what} = {n} parameters, more than the {weight_elements} its weights "
                               "hold: the config disagrees with the weights")


def load_drafter(path: str | Path, target=None, *, device=None, dtype: torch.dtype | None = None) -> Eagle3Drafter:
    """Load a drafter saved by draftsmith or an EAGLE/SpecForge checkpoint (``midlayer.*`` names)."""
    from safetensors.torch import load_file

    from draftsmith.core.tensorfile import corrupt_weights_named

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: not a drafter directory (no config.json)")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise DrafterError(f"{cfg_file}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise DrafterError(f"{cfg_file}: not an EAGLE-3 drafter config (a JSON {type(raw).__name__}, not an object)")
    try:
        cfg = DrafterConfig.from_hf_config(raw)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise DrafterError(f"{cfg_file}: not an EAGLE-3 drafter config ({type(e).__name__}: {e})") from e
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{path}: no {WEIGHTS_FILE}")
    with corrupt_weights_named(weights):
        state = load_file(str(weights))
    check_config_sizes(cfg, cfg_file, sum(t.numel() for t in state.values()))
    state = {canonical_weight_name(k): v for k, v in state.items()}
    # Keep a saved embedding only when the drafter cannot share the target's (different width).
    own = "embed_tokens.weight" in state and (
        cfg.hidden_size != (target.embed_tokens.weight.shape[1] if target is not None else cfg.target_hidden_size))
    if not own:
        state.pop("embed_tokens.weight", None)
    if target is None and not cfg.aux_layer_ids:
        raise DrafterError(f"{cfg_file} names no aux hidden state layer ids; load it with its target")
    if target is not None:
        if not cfg.aux_layer_ids:
            cfg.aux_layer_ids = tuple(target.aux_layers)
        check_fits(cfg, target)
        if tuple(cfg.aux_layer_ids) != tuple(target.aux_layers):
            target.set_aux_hidden_state_layers(cfg.aux_layer_ids)
    dv = vocab_mod.from_state(state, cfg.vocab_size, cfg.draft_vocab_size)
    state["d2t"], state["t2d"] = dv.d2t, dv.t2d
    drafter = Eagle3Drafter(cfg, draft_vocab=dv, own_embedding=own)
    mislabelled = norm_mismatches(cfg.norm_flags(), state, len(cfg.aux_layer_ids))
    if mislabelled:
        raise DrafterError(f"{path}: EAGLE-3.1 norms mislabelled: {'; '.join(mislabelled)}")
    try:
        missing, unexpected = drafter.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes other than config.json's sizes (an edited hidden_size)
        raise DrafterError(f"{cfg_file}: its sizes disagree with {weights} ({one_line(e)[:300]})") from e
    if missing or unexpected:
        raise DrafterError(f"{weights}: missing weights {sorted(missing)}, unexpected {sorted(unexpected)}")
    if target is not None:
        drafter.bind_embeddings(target.embed_tokens)
        device = device or target.device
        dtype = dtype or target.dtype
    drafter = drafter.to(device=device or "cpu", dtype=dtype or torch.float32).eval()
    if target is not None and getattr(target, "packed", False):
        # Packed where the target is: that was measured to step faster here (stages/step_config.py), and a
        # drafter step is the same kind of few-row GEMM. Training's autograd calls run the plain F.linear.
        from draftsmith.model.packing import pack_linears

        pack_linears(drafter)
    return drafter


