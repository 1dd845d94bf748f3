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

# The drafter kinds, by name: EAGLE-3 drafts a token a pass, DFlash and DSpark a block. Here, below torch, so the CLI
# can offer them without importing the models (model/kinds.py maps each name to its model functions).
DRAFTER_KINDS = ("eagle3", "dflash", "dspark")

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


def block_to_aux_layer_ids(ids: Iterable[int]) -> tuple[int, ...]:
    """Block-drafter ``target_layer_ids`` (DFlash/DeepSpec/SGLang: the *output* of layer i, ``-1`` = the embedding
    output) -> draftsmith/vLLM aux ids (the *input* of layer i+1, HF ``hidden_states[i+1]``), what the Target
    captures. vLLM's ``get_eagle3_aux_layers_from_config`` adds the same one."""
    ids = [int(i) for i in ids]
    if any(i < -1 for i in ids):
        raise ConventionError(f"block target_layer_ids {ids} go below -1 (-1 is the embedding output)")
    return tuple(i + 1 for i in ids)


def aux_to_block_layer_ids(ids: Iterable[int]) -> tuple[int, ...]:
    """draftsmith/vLLM aux ids -> block-drafter ``target_layer_ids`` (one lower; aux 0 is -1, the embedding)."""
    return tuple(int(i) - 1 for i in ids)


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
    """Whether a canonical name has a place in draftsmith's EAGLE-3 drafter (EAGLE-3.1 norms included)."""
    return (name in REQUIRED_WEIGHTS or name in OPTIONAL_WEIGHTS or is_norm_weight(name)
            or (name.startswith(LAYER_PREFIX) and name.removeprefix(LAYER_PREFIX) in LAYER_PARAMS))


# --- EAGLE-3.1 norms ---------------------------------------------------------------------------------------
# The config switches, as speculators (models/eagle3/config.py), vLLM (llama_eagle3.py, speculators/algos.py) and
# SpecForge/SGLang (llama3_eagle.py) spell them, all top-level booleans, default false:
#   norm_before_fc: one RMSNorm over cat(aux states) before fc; tensor ``input_norm.weight`` [n_aux * target_hidden]
#   fc_norm:        one RMSNorm per aux state before the concat; tensors ``fc_norm.{i}.weight`` [target_hidden]
#   norm_output:    the state fed back to the next draft step is norm(out), not out; no tensor (reuses norm.weight)
# norm_before_fc and fc_norm exclude each other (speculators refuses both; vLLM would apply both).
# vLLM's HF-layout loader reads ``eagle_config.norm_before_fc`` before the top-level field.
NORM_SWITCHES = ("norm_before_fc", "fc_norm", "norm_output")
INPUT_NORM_WEIGHT = "input_norm.weight"
FC_NORM_PREFIX = "fc_norm."


def fc_norm_weight_names(n_aux: int) -> list[str]:
    return [f"{FC_NORM_PREFIX}{i}.weight" for i in range(n_aux)]


def is_norm_weight(name: str) -> bool:
    """``input_norm.weight`` or ``fc_norm.{i}.weight`` (canonical names)."""
    if name == INPUT_NORM_WEIGHT:
        return True
    index = name.removeprefix(FC_NORM_PREFIX).removesuffix(".weight")
    return name.startswith(FC_NORM_PREFIX) and name.endswith(".weight") and index.isdigit()


def norm_switches(config: dict) -> dict[str, bool]:
    """The EAGLE-3.1 switches a flat (Llama-style) drafter config turns on, read as vLLM reads them."""
    nested = config.get("eagle_config") or {}
    on = {k: bool(config.get(k, False)) for k in NORM_SWITCHES}
    if isinstance(nested, dict) and "norm_before_fc" in nested:
        on["norm_before_fc"] = bool(nested["norm_before_fc"])
    return on


# --- layer kinds of a hybrid target ----------------------------------------------------------------------
# A hybrid target keeps a recurrent state (gated delta-net, Mamba, a short convolution) in some decoder layers and
# attention in others; its config says which, in one of several spellings. Aux id L reads the stream *leaving*
# layer L - 1, so which kind of layer an aux id lands on is the kind of layer L - 1 (id 0: the embedding).
ATTENTION = "attention"
RECURRENT = "recurrent"
MLP = "mlp"  # a block with neither (Nemotron-H's "-" and "E" blocks)
PARALLEL = "attention+recurrent"  # both side by side in one layer (Falcon-H1)
RECURRENT_KINDS = frozenset({RECURRENT, PARALLEL})
EMBEDDING = "embedding"  # what aux id 0 reads

_KIND_NAMES = {
    **dict.fromkeys(("full_attention", "attention", "sliding_attention", "chunked_attention", "swa_attention",
                     "global", "local", "*"), ATTENTION),
    **dict.fromkeys(("linear_attention", "mamba", "mamba2", "conv", "short_conv", "gdn", "kda", "M"), RECURRENT),
    **dict.fromkeys(("mlp", "moe", "-", "E"), MLP),
    "hybrid": PARALLEL,  # Zamba: a mamba layer with the shared attention block beside it
}


def layer_kinds(config: dict) -> tuple[str, ...] | None:
    """Each decoder layer's kind, read from a (text) config.json; None when it names no recurrent layer.

    Spellings: ``layer_types`` (Qwen3-Next, Qwen3.5, LFM2, Granite-4), ``layers_block_type`` (Nemotron-H as
    transformers 5 writes it, Jamba, Zamba), ``hybrid_override_pattern`` (Nemotron-H: ``M`` Mamba-2, ``*``
    attention, ``-``/``E`` MLP/MoE), ``attn_layer_indices`` (Bamba), ``attn_layer_period``/``attn_layer_offset``
    (Jamba), ``linear_attn_config.kda_layers`` (Kimi-Linear, 1-based as its modeling code counts them),
    ``full_attention_interval`` (early Qwen3-Next) and Falcon-H1, whose every layer runs attention and Mamba-2 side
    by side. A list of unknown names is not guessed at: None.
    """
    n = config.get("num_hidden_layers")
    for key in ("layer_types", "layers_block_type"):
        names = config.get(key)
        if isinstance(names, list) and names and all(isinstance(x, str) for x in names):
            kinds = tuple(_KIND_NAMES.get(x) for x in names)
            return _hybrid_or_none(kinds)
    pattern = config.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        return _hybrid_or_none(tuple(_KIND_NAMES.get(c) for c in pattern))
    if not isinstance(n, int) or n < 1:
        return None
    if isinstance(config.get("attn_layer_indices"), list):
        attn = {int(i) for i in config["attn_layer_indices"]}
        return _hybrid_or_none(tuple(ATTENTION if i in attn else RECURRENT for i in range(n)))
    period, offset = config.get("attn_layer_period"), config.get("attn_layer_offset")
    if isinstance(period, int) and period > 0 and isinstance(offset, int):
        return _hybrid_or_none(tuple(ATTENTION if i % period == offset else RECURRENT for i in range(n)))
    linear = config.get("linear_attn_config")
    if isinstance(linear, dict) and isinstance(linear.get("kda_layers"), list):
        kda = {int(i) for i in linear["kda_layers"]}
        return _hybrid_or_none(tuple(RECURRENT if i + 1 in kda else ATTENTION for i in range(n)))
    interval = config.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0:
        return _hybrid_or_none(tuple(ATTENTION if (i + 1) % interval == 0 else RECURRENT for i in range(n)))
    if config.get("model_type") == "falcon_h1":
        return (PARALLEL,) * n
    return None


def _hybrid_or_none(kinds: tuple[str | None, ...]) -> tuple[str, ...] | None:
    if any(k is None for k in kinds) or not any(k in RECURRENT_KINDS for k in kinds):
        return None
    return kinds  # type: ignore[return-value]


def aux_layer_sources(ids: Iterable[int], kinds: tuple[str, ...]) -> list[str]:
    """The kind of layer each aux id reads the output of (id L: layer L - 1; id 0: the embedding)."""
    return [EMBEDDING if int(i) == 0 else kinds[int(i) - 1] if 0 < int(i) <= len(kinds) else "?" for i in ids]


# --- serving -----------------------------------------------------------------------------------------------
def speculative_config(drafter: str | Path, num_speculative_tokens: int) -> dict:
    """vLLM's ``--speculative-config`` for an EAGLE-3 drafter directory (an absolute path, so it works anywhere)."""
    return {"method": "eagle3", "model": str(Path(drafter).expanduser().resolve()),
            "num_speculative_tokens": int(num_speculative_tokens)}


def norm_mismatches(switches: dict[str, bool], names: Iterable[str], n_aux: int | None) -> list[str]:
    """How a drafter's EAGLE-3.1 switches and its norm tensors disagree (empty: they agree).

    A switch on without its tensor is a 3.0 drafter labelled 3.1 (an engine would run a norm it never trained);
    a tensor with its switch off is a 3.1 drafter labelled 3.0 (vLLM drops ``input_norm.*`` without a word).
    ``norm_output`` has no tensor of its own and cannot be checked this way.
    """
    names = set(names)
    out = []
    has_input = INPUT_NORM_WEIGHT in names
    fc = sorted(n for n in names if is_norm_weight(n) and n != INPUT_NORM_WEIGHT)
    if switches.get("norm_before_fc") and not has_input:
        out.append(f"norm_before_fc is on but the weights have no {INPUT_NORM_WEIGHT}")
    if not switches.get("norm_before_fc") and has_input:
        out.append(f"the weights hold {INPUT_NORM_WEIGHT} but norm_before_fc is off")
    if switches.get("fc_norm"):
        want = fc_norm_weight_names(n_aux) if n_aux else []
        if not fc or (want and fc != sorted(want)):
            out.append(f"fc_norm is on but the weights hold {fc or 'no fc_norm.*'}"
                       + (f", not {want}" if want else ""))
    elif fc:
        out.append(f"the weights hold {', '.join(fc)} but fc_norm is off")
    return out
