"""Target adapter: any Hugging Face decoder, exposing the auxiliary hidden states EAGLE-3 needs.

One forward pass returns the logits, the final post-norm hidden state (the teacher signal) and the
*aux hidden states*: the residual stream entering decoder layer L for each requested L, which is
``output_hidden_states[L]`` in Hugging Face terms and what vLLM collects for ``SupportsEagle3``.
They are captured with forward pre-hooks on just those layers, so no other layer's output is kept.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from draftsmith.core.conventions import default_aux_layers
from draftsmith.core.errors import DraftsmithError, UsageError, one_line
from draftsmith.core.tensorfile import corrupt_weights_named
from draftsmith.model.target_cache import (
    MIN_TRANSFORMERS_FOR_RECURRENT,
    BlockStepper,
    RecurrentTargetError,
    TargetCache,
    find_recurrent_mixers,
    new_target_cache,
    recurrent_cache_class,
    recurrent_layer_ids,
)

# Attribute paths where known decoder families keep their layer list, tried before a generic search.
_KNOWN_LAYER_PATHS = (
    "model.layers",  # Llama, Qwen2/3, Mistral, Mixtral, Gemma 2/3, Phi-3, DeepSeek-V3
    "model.language_model.layers",  # multimodal wrappers (Gemma 3, Kimi-K2.5, Llava-style) in transformers 5
    "model.language_model.model.layers",
    "language_model.model.layers",
    "language_model.layers",
    "model.model.layers",
    "model.decoder.layers",
    "transformer.h",
    "gpt_neox.layers",
    "layers",
)


class TargetError(DraftsmithError, ValueError):
    """A target that cannot be used: bad path, unknown structure, bad aux layer ids."""


@runtime_checkable
class SupportsEagle3(Protocol):
    """The target side of EAGLE-3, named as vLLM names it so the concept maps 1:1 onto the engine."""

    supports_eagle3: ClassVar[bool]

    def set_aux_hidden_state_layers(self, layers: Sequence[int]) -> None: ...

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]: ...


def validate_aux_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Reject ids out of [0, N) or duplicated before any weights are loaded."""
    layers = tuple(int(x) for x in layers)
    if not layers:
        raise TargetError("aux hidden state layer ids must not be empty")
    bad = [x for x in layers if not 0 <= x < num_layers]
    if bad:
        raise TargetError(
            f"aux hidden state layer ids {bad} out of range: the target has {num_layers} decoder layers, "
            f"valid ids are 0..{num_layers - 1} (id L = the residual stream entering layer L)"
        )
    if len(set(layers)) != len(layers):
        raise TargetError(f"aux hidden state layer ids {list(layers)} contain duplicates")
    return layers


def text_config_of(config):
    """The language model's config, also for wrappers that nest it as ``text_config``."""
    getter = getattr(config, "get_text_config", None)
    text = getter(decoder=True) if getter is not None else None
    if text is None or not hasattr(text, "num_hidden_layers"):
        text = getattr(config, "text_config", None) or config
    if isinstance(text, dict):
        raise TargetError("text_config is a plain dict; load the config with transformers.AutoConfig")
    # A wrapper's aliased text model (Kimi-K2.5's kimi_k2) is built as the real architecture's config, but
    # transformers 5.17 leaves the alias on the instance: name the architecture it is, as newer releases do.
    real = _MODEL_TYPE_ALIASES.get(getattr(text, "model_type", None))
    if real is not None and getattr(type(text), "model_type", None) == real:
        text.model_type = real
    return text


def _get_path(root: nn.Module, path: str) -> nn.Module | None:
    node = root
    for part in path.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


def find_decoder_layers(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList]:
    """Locate the decoder's layer list: known paths first, then any ModuleList of N same-class blocks."""
    for path in _KNOWN_LAYER_PATHS:
        node = _get_path(model, path)
        if isinstance(node, nn.ModuleList) and len(node) == num_layers:
            return path, node
    candidates = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList)
        and len(mod) == num_layers
        and len({type(m).__name__ for m in mod}) == 1
        and not any(k in name for k in ("vision", "visual", "audio", "encoder", "mm_projector"))
    ]
    if candidates:
        name, mod = min(candidates, key=lambda c: c[0].count("."))
        return name, mod
    raise TargetError(
        f"cannot find the decoder layers of {type(model).__name__}: looked for an nn.ModuleList of "
        f"{num_layers} layers (text config num_hidden_layers) at {', '.join(_KNOWN_LAYER_PATHS)} "
        "and anywhere outside vision/audio towers"
    )


def _parent_path(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


# --- attention ---------------------------------------------------------------------------------------------
IN_PLACE_GQA_SDPA = "draftsmith_sdpa"


def _sdpa_in_place_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """Hugging Face's SDPA attention, except that grouped K/V heads are read in place under a mask as well.

    HF's CPU path repeats K and V for every query head whenever a mask is given, which is every multi-token
    pass over a KV cache: a verify pass copies the whole cache in every layer. SmolLM2 on 2 AMX cores: a
    3-token pass 1.14x -> 1.04x a 1-token step, a 10-token tree pass 1.21x -> 1.11x. Everything else (one
    query, no mask, position bias, soft-capping, attention sinks, MLA's unequal head dims) goes to HF's own.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = query.shape[1] != key.shape[1] and query.shape[1] % key.shape[1] == 0
    if (not grouped or attention_mask is None or query.shape[2] == 1 or key.shape[-1] != value.shape[-1]
            or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux", "sinks"))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_in_place_gqa(model: nn.Module) -> bool:
    """Switch a model on HF's SDPA attention to ``_sdpa_in_place_gqa`` (same masks); False if it uses another."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IN_PLACE_GQA_SDPA, _sdpa_in_place_gqa)
    AttentionMaskInterface.register(IN_PLACE_GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(IN_PLACE_GQA_SDPA)
    return True


@dataclass
class TargetOutput:
    """What one target pass yields for the positions it computed."""

    logits: torch.Tensor  # [B, q, V] for the kept positions (see ``logits_to_keep``)
    hidden_state: torch.Tensor  # [B, T, H] final post-norm hidden state (teacher signal)
    aux_hidden_states: tuple[torch.Tensor, ...]  # each [B, T, H], in aux layer order


class Target:
    """A Hugging Face causal LM with EAGLE-3 aux hidden state capture and a rollback-able KV cache."""

    supports_eagle3: ClassVar[bool] = True

    def __init__(self, model: nn.Module, tokenizer=None, aux_layers: Sequence[int] | None = None,
                 name: str | None = None):
        self.model = model.eval()
        use_in_place_gqa(model)  # HF's SDPA math without its K/V copy on multi-token passes
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "name_or_path", None) or type(model).__name__
        self.config = text_config_of(model.config)
        self.num_layers = int(self.config.num_hidden_layers)
        self.layers_path, self.layers = find_decoder_layers(model, self.num_layers)
        decoder = _get_path(model, _parent_path(self.layers_path)) if "." in self.layers_path else model
        self._decoder = decoder
        params = inspect.signature(model.forward).parameters
        # transformers renamed past_key_values -> cache (5.2x); accept both.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._accepts_logits_to_keep = "logits_to_keep" in params
        self._captured: dict[int, torch.Tensor] | None = None
        self._final: list[torch.Tensor] = []
        self._hooks: list = []
        self._final_hook = decoder.register_forward_hook(self._capture_final)
        # Layers with a recurrent state (gated delta-net, Mamba, short convolutions): decode steps them through
        # each verified block so that rejected drafts leave no trace (model/target_cache.py).
        self.recurrent_layers = recurrent_layer_ids(model.config)
        self._stepper: BlockStepper | None = None
        self._stepping_error: str | None = None
        if self.recurrent_layers:
            try:
                if recurrent_cache_class() is None:
                    import transformers

                    raise RecurrentTargetError(
                        f"{type(model).__name__} keeps a recurrent state in layers {list(self.recurrent_layers)}, and "
                        f"transformers {transformers.__version__} cannot keep it per token to roll back rejected "
                        f"drafts: install transformers>={MIN_TRANSFORMERS_FOR_RECURRENT} to decode it with draftsmith")
                self._stepper = BlockStepper(find_recurrent_mixers(self.layers, self.recurrent_layers))
            except RecurrentTargetError as e:
                self._stepping_error = str(e)
        self.aux_layers: tuple[int, ...] = ()
        self.set_aux_hidden_state_layers(
            aux_layers if aux_layers is not None else self.get_eagle3_default_aux_hidden_state_layers()
        )

    # --- the SupportsEagle3 protocol -------------------------------------------------------------
    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return default_aux_layers(self.num_layers)

    def set_aux_hidden_state_layers(self, layers: Sequence[int]) -> None:
        layers = validate_aux_layers(layers, self.num_layers)
        for h in self._hooks:
            h.remove()
        self._hooks = [
            self.layers[layer_id].register_forward_pre_hook(self._make_pre_hook(layer_id), with_kwargs=True)
            for layer_id in layers
        ]
        self.aux_layers = layers

    # --- properties --------------------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def embed_tokens(self) -> nn.Module:
        """The target's input embedding (shared, frozen, by the drafter)."""
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def fingerprint(self) -> dict:
        """What identifies this target for later stages (a store or drafter made for another refuses)."""
        from draftsmith.core.fingerprint import target_fingerprint

        return target_fingerprint(self.config, architecture=type(self.model).__name__)

    # --- capture -------------------------------------------------------------------------------------
    def _make_pre_hook(self, layer_id: int):
        def hook(module, args, kwargs):
            if self._captured is not None:
                self._captured[layer_id] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _capture_final(self, module, args, output):
        if self._captured is not None:
            hidden = getattr(output, "last_hidden_state", None)
            self._final.append(hidden if hidden is not None else output[0])

    # --- forward -------------------------------------------------------------------------------------
    @property
    def is_recurrent(self) -> bool:
        """True for hybrids: some layers keep a recurrent state instead of (or beside) a KV cache."""
        return bool(self.recurrent_layers)

    def new_cache(self) -> TargetCache:
        """The decoding state for one request (attention KV, and recurrent states where the target has them)."""
        if self._stepping_error:
            raise RecurrentTargetError(self._stepping_error)
        return new_target_cache(self.model.config, self.recurrent_layers)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cache=None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> TargetOutput:
        """One pass. ``attention_mask`` may be 2D (padding) or a 4D additive mask (tree verification).

        ``cache``: a ``TargetCache`` (``new_cache``); after ``cache.begin_block`` the pass is a block that
        ``cache.keep`` cuts back, and recurrent layers step it token by token.
        """
        block = cache.block if isinstance(cache, TargetCache) else None
        hf_cache = cache.hf if isinstance(cache, TargetCache) else cache
        kwargs = {"input_ids": input_ids, "use_cache": cache is not None, self._cache_kw: hf_cache}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if logits_to_keep and self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        self._captured, self._final = {}, []
        if block is not None and self._stepper is not None:
            self._stepper.active, self._stepper.hf_cache = block, hf_cache
        try:
            out = self.model(**kwargs)
            captured = self._captured
            if len(self._final) != 1 or len(captured) != len(self.aux_layers):
                raise TargetError(
                    f"aux capture failed for {type(self.model).__name__}: got layers {sorted(captured)}, "
                    f"expected {list(self.aux_layers)}"
                )
            logits = out.logits
            if logits_to_keep and not self._accepts_logits_to_keep:
                logits = logits[:, -logits_to_keep:]
            return TargetOutput(
                logits=logits,
                hidden_state=self._final[0],
                aux_hidden_states=tuple(captured[layer] for layer in self.aux_layers),
            )
        finally:
            self._captured, self._final = None, []
            if self._stepper is not None:
                self._stepper.active, self._stepper.hf_cache = None, None

    __call__ = forward

    def pack(self) -> int:
        """Prepack the linears with oneDNN for CPU fp32/bf16 inference (model/packing.py); how many."""
        from draftsmith.model.packing import pack_linears

        return pack_linears(self.model)

    def unpack(self) -> int:
        """Put the plain ``nn.Linear`` modules back (before training or reshaping the model); how many."""
        from draftsmith.model.packing import unpack_linears

        return unpack_linears(self.model)

    @property
    def packed(self) -> bool:
        from draftsmith.model.packing import PackedLinear

        return any(isinstance(m, PackedLinear) for m in self.model.modules())

    @torch.no_grad()
    def compute_logits(self, hidden_state: torch.Tensor) -> torch.Tensor:
        """Teacher logits from a stored final hidden state (applies Gemma-style soft-capping too)."""
        logits = self.lm_head(hidden_state.to(self.dtype))
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def context_budget(target: Target, prompt_len: int, max_new_tokens: int) -> int:
    """``max_new_tokens`` clamped to what the prompt leaves of ``max_position_embeddings``; a prompt past it refused."""
    max_pos = getattr(target.config, "max_position_embeddings", None)
    if not isinstance(max_pos, int) or max_pos < 1:
        return max_new_tokens
    if prompt_len >= max_pos:
        raise UsageError(f"the prompt has {prompt_len} tokens but the target's context is {max_pos} positions "
                         "(max_position_embeddings): shorten the prompt")
    return min(max_new_tokens, max_pos - prompt_len)


# --- loading -------------------------------------------------------------------------------------------
def default_dtype(device: str | torch.device) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def bf16_native(device: str | torch.device) -> bool:
    """True where bf16 matmuls run in hardware: CUDA, and CPUs with AMX tiles. There a k-token verify pass
    costs about what a 1-token step does (SmolLM2 on 2 AMX cores: 4 tokens 1.0-1.1x a step in bf16, 1.6x in fp32),
    which is what speculative decoding lives on; elsewhere bf16 is emulated and slower than fp32."""
    kind = torch.device(device).type
    if kind == "cuda":
        return True
    return kind == "cpu" and bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def load_target(
    path: str | Path,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    aux_layers: Sequence[int] | None = None,
    pack: bool | None = None,
) -> Target:
    """Load a target from a model directory, a GGUF file, or the name of the embedded default.

    ``pack``: prepack CPU linears for inference (``Target.pack``); default on, ``DRAFTSMITH_PACK=0`` turns it off.
    """
    from transformers import AutoConfig, AutoTokenizer

    from draftsmith.core.device import resolve_device
    from draftsmith.model.sources import resolve_model_path

    device = resolve_device(device)  # "auto" and bad spellings: the one reading every command shares
    dtype = dtype or default_dtype(device)
    model_dir, gguf_file = resolve_model_path(path)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(model_dir, **extra)
    except Exception as e:  # also a field of the wrong type ("eight"): huggingface_hub's strict dataclass errors
        config = _aliased_config(model_dir)
        if config is None:
            raise TargetError(f"{path}: not a loadable model ({model_dir / 'config.json'}: {one_line(e)[:300]})") from e
        extra["config"] = config
    # Check aux ids against the config before any weights are read.
    text = text_config_of(config)
    if aux_layers is not None:
        validate_aux_layers(aux_layers, int(text.num_hidden_layers))
    model = None
    errors = []
    for auto in _auto_classes():
        try:
            with corrupt_weights_named(model_dir):
                model, info = auto.from_pretrained(model_dir, dtype=dtype, output_loading_info=True, **extra)
            break
        except ValueError as e:  # config not mapped by this auto class
            errors.append(f"{auto.__name__}: {str(e).splitlines()[0]}")
        except OSError as e:  # no weights next to the config: not something a rerun fixes
            raise TargetError(f"{path}: not a loadable model ({one_line(e)})") from e
        except RuntimeError as e:  # weights of other shapes than config.json says (an edited vocab_size)
            raise TargetError(f"{path}: the weights' shapes disagree with its config.json (vocab_size or another "
                              "size edited?)") from e
    if model is None:
        raise TargetError(f"{path}: no causal LM class for this config ({'; '.join(errors)})")
    missing = sorted(info.get("missing_keys") or ()) if gguf_file else []
    if missing:  # transformers left them at their random initialisation: decoding would run on noise
        raise TargetError(f"{path}: the GGUF lacks {len(missing)} of the model's weights ({', '.join(missing[:3])}"
                          f"{', ...' if len(missing) > 3 else ''}); a model loaded from it would run on random weights")
    model.to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, **({"gguf_file": gguf_file} if gguf_file else {}))
    except Exception as e:  # tokenizers raises plain Exception for a damaged tokenizer.json
        if (model_dir / "tokenizer.json").is_file():
            raise TargetError(f"{model_dir / 'tokenizer.json'}: cannot load the tokenizer ({one_line(e)[:200]})") from e
        tokenizer = None
    target = Target(model, tokenizer, aux_layers=aux_layers, name=str(path))
    if pack if pack is not None else packing_wanted():
        target.pack()
    return target


def packing_wanted() -> bool:
    """Whether the user allows prepacked linears (``DRAFTSMITH_PACK=0`` turns them off everywhere)."""
    return os.environ.get("DRAFTSMITH_PACK", "1").strip() != "0"


# Model types transformers does not register but whose weights are another architecture's (as vLLM maps them).
_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def _aliased_config(model_dir: Path):
    """Config of a model whose ``model_type`` is an alias (Kimi-K2 is a DeepSeek-V3), or None."""
    import json as _json

    from transformers import AutoConfig

    cfg_file = Path(model_dir) / "config.json"
    if not cfg_file.is_file():
        return None
    try:
        raw = _json.loads(cfg_file.read_text())
    except (_json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TargetError(f"{cfg_file}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise TargetError(f"{cfg_file}: not a JSON object")
    real = _MODEL_TYPE_ALIASES.get(raw.get("model_type"))
    if real is None:
        return None
    raw = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
    return AutoConfig.for_model(real, **raw)


def _auto_classes():
    import transformers

    names = ("AutoModelForCausalLM", "AutoModelForImageTextToText")
    return [getattr(transformers, n) for n in names if hasattr(transformers, n)]


# --- the two target tensors offline training needs ------------------------------------------------------
@dataclass
class TargetHeads:
    """The target's input embedding and output head: all offline training needs from a (possibly 1T) target."""

    embed_tokens: nn.Module
    lm_head_weight: torch.Tensor  # [V, H]
    final_logit_softcapping: float | None
    config: object  # the text config (for fingerprints and drafter sizes)
    final_norm_weight: torch.Tensor | None = None  # [H], as a plain x * w RMSNorm scale (Gemma's 1 + w folded)

    @property
    def hidden_size(self) -> int:
        return int(self.lm_head_weight.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)


def heads_of(target: Target) -> TargetHeads:
    norm = getattr(getattr(target._decoder, "norm", None), "weight", None)
    return TargetHeads(target.embed_tokens, target.lm_head.weight,
                       getattr(target.config, "final_logit_softcapping", None), target.config,
                       _plain_norm_scale(norm.detach(), target.config) if norm is not None else None)


def _plain_norm_scale(weight: torch.Tensor, config) -> torch.Tensor:
    """The final norm's scale as a plain RMSNorm's: Gemma's norms multiply by ``1 + weight``."""
    gemma = str(getattr(config, "model_type", "")).startswith("gemma")
    return weight + 1 if gemma else weight


def load_target_heads(path: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None) -> TargetHeads:
    """Read only ``embed_tokens``, ``lm_head`` and the final norm from the target's safetensors (seconds, even
    for 1T models)."""
    import json as _json

    from safetensors import safe_open
    from transformers import AutoConfig

    from draftsmith.core.device import resolve_device
    from draftsmith.model.sources import resolve_model_path

    device = resolve_device(device)
    dtype = dtype or default_dtype(device)
    model_dir, gguf = resolve_model_path(path)
    if gguf:  # no tensor index in a GGUF: load it whole (small models only)
        return heads_of(load_target(path, device=device, dtype=dtype, pack=False))
    try:
        config = text_config_of(AutoConfig.from_pretrained(model_dir))
    except Exception as e:  # also a field of the wrong type ("eight"): huggingface_hub's strict dataclass errors
        raise TargetError(f"{model_dir / 'config.json'}: not a loadable config ({one_line(e)[:300]})") from e
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json.loads(index.read_text())["weight_map"]
    elif (model_dir / "model.safetensors").is_file():
        with corrupt_weights_named(model_dir / "model.safetensors"), \
                safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")

    def find(suffix: str) -> str | None:
        names = sorted((k for k in weight_map if k.endswith(suffix) and "vision" not in k and "mtp" not in k),
                       key=len)
        return names[0] if names else None

    embed_key, head_key = find("embed_tokens.weight"), find("lm_head.weight")
    if embed_key is None:
        raise TargetError(f"{path}: no embed_tokens.weight among the checkpoint's tensors")
    head_key = head_key or embed_key  # tied embeddings

    def read(key: str) -> torch.Tensor:
        with corrupt_weights_named(model_dir / weight_map[key]), \
                safe_open(str(model_dir / weight_map[key]), framework="pt", device="cpu") as f:
            return f.get_tensor(key).to(device=device, dtype=dtype)

    embed_w = read(embed_key)
    head_w = embed_w if head_key == embed_key else read(head_key)
    embed = nn.Embedding.from_pretrained(embed_w, freeze=True)
    # The final norm: the shortest "norm.weight" outside the decoder layers (model.norm.weight and its kin).
    norm_keys = sorted((k for k in weight_map if k.endswith("norm.weight") and ".layers." not in k
                        and not any(s in k for s in ("vision", "visual", "mtp"))), key=len)
    norm_w = read(norm_keys[0]) if norm_keys else None
    if norm_w is not None and norm_w.shape != (head_w.shape[1],):
        norm_w = None
    return TargetHeads(embed, head_w, getattr(config, "final_logit_softcapping", None), config,
                       _plain_norm_scale(norm_w, config) if norm_w is not None else None)
