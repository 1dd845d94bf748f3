"""The conventions engines disagree on, each coded once: aux layer ids, weight names, the speculative config.

Aux layer id ``L`` (draftsmith's and vLLM's convention) is the residual stream *entering* decoder layer ``L``:
Hugging Face's ``output_hidden_states[L]``, where index 0 is the embedding output. SGLang's config field
``eagle_aux_hidden_state_layer_ids`` means "output of layer i" and its loader adds one, so SpecForge configs
list ``[1, 29, 57]`` for the layers vLLM calls ``(2, 30, 58)``. An off-by-one here trains or serves a drafter
on the wrong layer without any error, which is why every conversion goes through this module.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from draftsmith.core.errors import DraftsmithError

ENGINES_ONE_LOWER = frozenset({"sglang", "specforge", "eagle"})  # config ids = output of layer i = ours - 1


class ConventionError(DraftsmithError, ValueError):
    """A drafter or value that one engine's layout cannot express without losing something."""


# --- aux layer ids -----------------------------------------------------------------------------------------
def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The field's default (2, N//2, N-3); spread evenly when N is too small for it to be distinct."""
    layers = (2, num_layers // 2, num_layers - 3)
    if len(set(layers)) == 3 and all(0 <= x < num_layers for x in layers):
        return layers
    if num_layers < 3:
        raise ConventionError(f"a target needs at least 3 decoder layers for EAGLE-3, this one has {num_layers}")
    step = (num_layers - 1) / 2
    return (0, round(step), num_layers - 1)


def to_sglang_layer_ids(ids: Iterable[int]) -> list[int]:
    """draftsmith/vLLM ids (input of layer L) -> SGLang's ``eagle_config`` ids (output of layer L-1)."""
    ids = [int(i) for i in ids]
    out = [i - 1 for i in ids]
    if any(i < 0 for i in out):
        raise ConventionError(f"aux layer ids {ids} include layer 0 (the embedding output), which SGLang's "
                              "convention cannot express (its loader adds one to every id)")
    return out


def from_sglang_layer_ids(ids: Iterable[int]) -> list[int]:
    """SGLang's ``eagle_config`` ids (output of layer i) -> draftsmith/vLLM ids (input of layer i+1)."""
    return [int(i) + 1 for i in ids]


def to_llamacpp_layer_ids(ids: Iterable[int], num_layers: int | None = None) -> list[int]:
    """draftsmith/vLLM ids -> llama.cpp's ``eagle3.target_layers``: the same numbers (an id names the *input* of
    that target layer there too, HF ``hidden_states[id]``), but exactly three of them, each a real layer."""
    ids = [int(i) for i in ids]
    if len(ids) != 3:
        raise ConventionError(f"llama.cpp's EAGLE-3 reads exactly 3 aux layers, this drafter has {len(ids)} ({ids})")
    if any(i < 0 for i in ids) or (num_layers is not None and any(i >= num_layers for i in ids)):
        raise ConventionError(f"aux layer ids {ids} fall outside the target's {num_layers} layers")
    return ids


# --- weight names ------------------------------------------------------------------------------------------
LAYER_PREFIX = "layers.0."  # draftsmith's, vLLM's and SpecForge's name for the one decoder layer
MIDLAYER_PREFIX = "midlayer."  # the EAGLE reference implementation's name for it
LAYER_PARAMS = (
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
REQUIRED_WEIGHTS = ("fc.weight", "norm.weight", "lm_head.weight", *(LAYER_PREFIX + p for p in LAYER_PARAMS))
OPTIONAL_WEIGHTS = ("embed_tokens.weight", "d2t", "t2d")


def layer_param_shapes(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int
                       ) -> dict[str, tuple[int, ...]]:
    """The one decoder layer's tensors (canonical names) and their shapes; attention takes 2 * hidden inputs."""
    shapes = dict(zip(LAYER_PARAMS, [
        (hidden,), (hidden,), (hidden,),
        (heads * head_dim, 2 * hidden), (kv_heads * head_dim, 2 * hidden), (kv_heads * head_dim, 2 * hidden),
        (hidden, heads * head_dim),
        (intermediate, hidden), (intermediate, hidden), (hidden, intermediate),
    ], strict=True))
    return {LAYER_PREFIX + name: shape for name, shape in shapes.items()}


def canonical_weight_name(name: str) -> str:
    """draftsmith's name for a checkpoint tensor: no ``model.`` prefix, ``midlayer.`` -> ``layers.0.``."""
    name = name.removeprefix("model.")
    if name.startswith(MIDLAYER_PREFIX):
        name = LAYER_PREFIX + name.removeprefix(MIDLAYER_PREFIX)
    return name


def reference_weight_name(name: str) -> str:
    """The EAGLE reference (and SGLang layout) name for a canonical one: ``layers.0.`` -> ``midlayer.``."""
    return MIDLAYER_PREFIX + name.removeprefix(LAYER_PREFIX) if name.startswith(LAYER_PREFIX) else name


def is_drafter_weight(name: str) -> bool:
    """Whether a canonical name has a place in draftsmith's EAGLE-3 drafter."""
    return (name in REQUIRED_WEIGHTS or name in OPTIONAL_WEIGHTS
            or (name.startswith(LAYER_PREFIX) and name.removeprefix(LAYER_PREFIX) in LAYER_PARAMS))


# --- serving -----------------------------------------------------------------------------------------------
def speculative_config(drafter: str | Path, num_speculative_tokens: int) -> dict:
    """vLLM's ``--speculative-config`` for an EAGLE-3 drafter directory (an absolute path, so it works anywhere)."""
    return {"method": "eagle3", "model": str(Path(drafter).expanduser().resolve()),
            "num_speculative_tokens": int(num_speculative_tokens)}
