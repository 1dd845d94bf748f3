"""The target's decoding state behind one interface: attention KV, convolution windows and SSM/delta-net states.

Speculative decoding advances the target by a block (the pending token and its drafts, a chain or a tree), then
keeps the prefix and the accepted nodes. Attention drops rejected tokens by cropping (a chain) or compacting (a
tree path) its keys and values. A recurrent state cannot be cut back: it has folded every token in. So during a
block pass each recurrent mixer (a module of the target that owns a causal ``Conv1d``: gated delta-net, Kimi Delta
Attention, Mamba, Mamba-2, short convolutions) keeps its state after every node: a chain in one call with
transformers' past recording (the projections batched, the recurrence per token), a tree one node at a time, each
from its parent's state, with the single-token kernel plain decoding runs. ``keep`` then puts back the last
accepted node's state. No accepted token passes a recurrent layer twice, and no rejected token leaves a trace.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from draftsmith.core.errors import DraftsmithError

#: A transformers release whose recurrent caches keep a state per token (checked: 5.25 has them, 5.17 does not).
MIN_TRANSFORMERS_FOR_RECURRENT = "5.25"


class RecurrentTargetError(DraftsmithError, ValueError):
    """A target with recurrent layers that draftsmith cannot step exactly (an unknown mixer, an old transformers)."""


def recurrent_cache_class():
    """transformers' base class of recurrent cache layers, or None on releases whose recurrent caches cannot keep a
    state per token (5.17 has the class without it)."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:
        return None
    record = getattr(LinearAttentionCacheLayerMixin, "activate_past_recording", None)
    if record is None or "recurrent_states_to_keep" not in inspect.signature(record).parameters:
        return None
    return LinearAttentionCacheLayerMixin


def recurrent_layer_ids(config) -> tuple[int, ...]:
    """The decoder layers that keep a recurrent state, read from the config as transformers builds its cache."""
    from transformers import DynamicCache

    mixin = recurrent_cache_class()
    types = getattr(config, "layer_types", None) or ()
    pattern = getattr(config, "hybrid_override_pattern", None)
    if mixin is None:  # no per-layer recurrent caches: say which layers recur from the config alone
        recurrent = {"linear_attention", "conv", "mamba", "mamba2", "hybrid"}
        ids = [i for i, t in enumerate(types) if t in recurrent]
        if pattern:
            ids = [i for i, c in enumerate(pattern) if c == "M"]
        return tuple(ids)
    try:
        cache = DynamicCache(config=config)
    except Exception:  # a config transformers cannot build a cache for has no layer types to read
        return ()
    return tuple(i for i, layer in enumerate(cache.layers) if isinstance(layer, mixin))


def find_recurrent_mixers(layers: nn.ModuleList, layer_ids: Sequence[int]) -> dict[int, nn.Module]:
    """The module that owns each recurrent layer's state: the one holding a causal ``Conv1d`` and a ``layer_idx``."""
    mixers: dict[int, nn.Module] = {}
    for i in layer_ids:
        found = [m for m in layers[i].modules()
                 if getattr(m, "layer_idx", None) == i and any(isinstance(c, nn.Conv1d) for c in m.children())]
        if len(found) != 1:
            raise RecurrentTargetError(
                f"decoder layer {i} ({type(layers[i]).__name__}) keeps a recurrent state, but draftsmith finds "
                f"{len(found)} modules holding it (expected one with a Conv1d and layer_idx {i}); its state could not "
                "be rolled back after rejected drafts, so speculative decoding of this target is refused")
        mixers[i] = found[0]
    return mixers


# --- one recurrent layer's state -------------------------------------------------------------------------
@dataclass
class _LayerState:
    """A copy of one recurrent cache layer: its conv windows, recurrent states and token count."""

    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]
    length: torch.Tensor


def _snapshot(layer) -> _LayerState:
    conv = {i: t.clone() for i, t in layer.conv_states.items() if t is not None and layer.is_conv_states_initialized[i]}
    rec = {i: t.clone() for i, t in layer.recurrent_states.items()
           if t is not None and layer.is_recurrent_states_initialized[i]}
    return _LayerState(conv, rec, layer.cumulative_length_linear.clone())


def _restore(layer, state: _LayerState) -> None:
    """In place: the kernels update these tensors in place and some are marked as static addresses."""
    for i, t in state.conv.items():
        layer.conv_states[i].copy_(t)
    for i, t in state.recurrent.items():
        layer.recurrent_states[i].copy_(t)
    layer.cumulative_length_linear.copy_(state.length)


@dataclass
class _Block:
    """One block pass: node i's parent (-1: the prefix), and each recurrent layer's state before and after each node."""

    parents: list[int]
    before: dict[int, _LayerState] = field(default_factory=dict)
    after: dict[int, list[_LayerState]] = field(default_factory=dict)


# --- the cache -----------------------------------------------------------------------------------------
class TargetCache:
    """The target's state for one request: what decode advances by blocks and cuts back to the accepted tokens."""

    def __init__(self, hf_cache, recurrent: Sequence[int] = ()):
        self.hf = hf_cache  # what the Hugging Face model reads and writes
        self.recurrent = tuple(recurrent)
        self.block: _Block | None = None

    def begin_block(self, parents: Sequence[int]) -> None:
        """Announce the next pass as a block: ``parents[i]`` is node i's parent in the block, -1 for the prefix."""
        parents = [int(p) for p in parents]
        if any(not -1 <= p < i for i, p in enumerate(parents)):
            raise ValueError(f"block parents must come before their children, got {parents}")
        self.block = _Block(parents)

    def keep(self, prefix: int, nodes: Sequence[int] = ()) -> None:
        """Keep the first ``prefix`` positions, then the last block's ``nodes`` (ascending block indices, a path).

        Nodes 0..m-1 are a crop; any other path is compacted behind the prefix. Recurrent layers take the state
        after the last kept node, or the state before the block when none is kept.
        """
        nodes = [int(n) for n in nodes]
        contiguous = nodes == list(range(len(nodes)))
        extra = None if contiguous else prefix + torch.tensor(nodes, dtype=torch.long)
        _keep_attention(self.hf, prefix + len(nodes) if contiguous else prefix, extra)
        if self.recurrent:
            block = self.block
            if block is None or any(i not in block.after for i in self.recurrent):
                raise RuntimeError("keep() on a target with recurrent layers cuts back a block pass (begin_block)")
            for i in self.recurrent:
                _restore(self.hf.layers[i], block.after[i][nodes[-1]] if nodes else block.before[i])
        self.block = None

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep these batch rows (batched generation drops finished requests), in every kind of layer."""
        mixin = recurrent_cache_class()
        for layer in self.hf.layers:
            if mixin is not None and isinstance(layer, mixin):
                for states in (layer.conv_states, layer.recurrent_states):
                    for i, t in states.items():
                        if t is not None:
                            states[i] = t.index_select(0, rows.to(t.device))
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
                layer.values = layer.values.index_select(0, rows.to(layer.values.device))


def _keep_attention(hf_cache, keep: int, extra: torch.Tensor | None) -> None:
    """Attention layers: keep the first ``keep`` positions, then the positions in ``extra`` (ascending)."""
    for layer in hf_cache.layers:
        keys = getattr(layer, "keys", None)
        if not getattr(layer, "is_initialized", True) or keys is None or keys.numel() == 0:
            continue
        n = 0 if extra is None else extra.numel()
        if n:
            # Move only the kept tree entries down to keep..keep+n (the gather copies them first, so sources
            # and destinations may overlap); the prefix is not copied.
            idx = extra.to(keys.device)
            layer.keys[..., keep:keep + n, :] = layer.keys.index_select(-2, idx)
            layer.values[..., keep:keep + n, :] = layer.values.index_select(-2, idx)
        layer.keys = layer.keys[..., :keep + n, :]
        layer.values = layer.values[..., :keep + n, :]


def new_target_cache(config, recurrent: Sequence[int]) -> TargetCache:
    """A growing attention cache, with transformers' recurrent layers where the target keeps a state."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if not recurrent:
        # No config: every layer is a plain growing layer that can be cropped and index-selected.
        return TargetCache(DynamicCache())
    hf = DynamicCache(config=config)
    mixin = recurrent_cache_class()
    for i, layer in enumerate(hf.layers):
        # Sliding or chunked attention as plain growing layers (the window is the mask's business), so that keep()
        # can compact them; layers without a cache (MLP-only blocks) stay as they are.
        if isinstance(layer, DynamicLayer) and type(layer) is not DynamicLayer and not isinstance(layer, mixin):
            hf.layers[i] = DynamicLayer()
    return TargetCache(hf, recurrent)


# --- stepping the recurrent mixers through a block ---------------------------------------------------------
class BlockStepper:
    """Wraps each recurrent mixer's forward; while a block pass runs, it steps the block token by token."""

    def __init__(self, mixers: dict[int, nn.Module]):
        self.active: _Block | None = None
        self.hf_cache = None
        for layer_id, module in mixers.items():
            self._wrap(layer_id, module)

    def _wrap(self, layer_id: int, module: nn.Module) -> None:
        original = module.forward
        signature = inspect.signature(original)

        def forward(*args, **kwargs):
            block = self.active
            if block is None:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            return self._step(layer_id, original, bound, block)

        module.forward = forward

    def _step(self, layer_id: int, original, bound: inspect.BoundArguments, block: _Block) -> torch.Tensor:
        arguments = dict(bound.arguments)
        var_kw = next((n for n, p in bound.signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
        extra = arguments.pop(var_kw, {}) if var_kw else {}
        hidden = arguments.pop("hidden_states") if "hidden_states" in arguments else arguments.pop(
            next(iter(arguments)))
        n = hidden.shape[1]
        if len(block.parents) != n:
            raise RuntimeError(f"a block of {len(block.parents)} nodes, but the pass has {n} tokens")
        layer = self.hf_cache.layers[layer_id]
        before = _snapshot(layer)
        kwargs = {**arguments, **extra}
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None  # batch 1 has no padding; a tree mask means nothing to a recurrence
        if n > 1 and block.parents == list(range(-1, n - 1)):
            chained = _chain_pass(layer, original, hidden, kwargs, before)
            if chained is not None:
                block.before[layer_id], block.after[layer_id] = before, chained[1]
                return chained[0]
        after: list[_LayerState] = []
        outputs = []
        for i, parent in enumerate(block.parents):
            if parent != i - 1:  # a chain continues from the state it left; a branch starts at its parent's
                _restore(layer, before if parent < 0 else after[parent])
            outputs.append(original(hidden[:, i:i + 1], **{k: _token(v, i, n) for k, v in kwargs.items()}))
            after.append(_snapshot(layer))
        block.before[layer_id], block.after[layer_id] = before, after
        return torch.cat(outputs, dim=1)


def _chain_pass(layer, original, hidden: torch.Tensor, kwargs: dict, before: _LayerState):
    """A chain block in one call of the mixer, with transformers' past recording: the projections see the whole
    block at once and the recurrence keeps its state after every token. (output, state after each node), or
    None (the layer's state untouched) where the mixer does not record a state per token."""
    n = hidden.shape[1]
    if getattr(layer, "number_of_states", 1) != 1 or not hasattr(layer, "activate_past_recording"):
        return None
    layer.activate_past_recording(recurrent_states_to_keep=n)
    layer.recurrent_states_history = {0: []}  # transformers' fromkeys default shares one list between states
    try:
        out = original(hidden, **kwargs)
        history = layer.recurrent_states_history[0]
        recurrent = layer.is_recurrent_states_initialized[0]
        window = layer.conv_states[0] if layer.is_conv_states_initialized[0] else None
        width = layer.conv_kernel_size[0]
        if (recurrent and len(history) != n) or (window is not None and window.shape[-1] != width + n):
            out = None
    finally:
        layer.record_past = False
        layer.recurrent_states_history = {0: []}
    if out is None:
        if window is not None:
            layer.conv_states[0] = window[..., -width:].clone()
        _restore(layer, before)
        return None
    after = []
    for j in range(n):
        conv = {0: window[..., j + 1: j + 1 + width].clone()} if window is not None else {}
        rec = {0: (history[j + 1] if j + 1 < n else layer.recurrent_states[0]).clone()} if recurrent else {}
        after.append(_LayerState(conv, rec, before.length + j + 1))
    if window is not None:  # the window back to its working size, as a tensor of its own
        layer.conv_states[0] = after[-1].conv[0].clone()
    return out, after


def _token(value, i: int, n: int):
    """Argument ``value`` for block token i alone: per-token tensors (sequence dim of size n) are sliced."""
    if isinstance(value, tuple):
        return tuple(_token(v, i, n) for v in value)
    if not torch.is_tensor(value) or n == 1:
        return value
    if value.ndim == 1 and value.shape[0] == n:
        return value[i:i + 1]
    if value.ndim >= 2 and value.shape[1] == n:
        return value[:, i:i + 1]
    return value
