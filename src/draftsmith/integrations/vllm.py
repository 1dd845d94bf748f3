"""draftsmith's vLLM plugin: makes more target classes EAGLE-3-capable inside vLLM.

vLLM's runner raises "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested" for a
target class without ``SupportsEagle3``. For a class whose decoder loop is exactly Llama's pre-EAGLE loop (checked
on its source, not assumed), the plugin (entry point group ``vllm.general_plugins``, ``register``) registers a
subclass that captures the residual stream entering the requested layers (``hidden_states + residual`` of the
previous layer, as vLLM's Llama does) and returns ``(hidden, aux_list)``. Set ``DRAFTSMITH_VLLM_PLUGIN=0`` to
turn it off.

vLLM loads this module in every process, so it imports vLLM only inside functions and imports nothing of
draftsmith beyond ``draftsmith.core``. What each vLLM version does with a pair lives in
``draftsmith.core.vllm_facts``, the source reading in ``draftsmith.core.pysource``, and ``draftsmith serve`` in
``draftsmith.app.serve``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import logging
import os
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

from draftsmith.core.pysource import inner_model_name, llama_like_decoder, passthrough_forward
from draftsmith.core.vllm_facts import PLUGIN_ENV, PLUGIN_OFF, VLLM_PROFILES

logger = logging.getLogger(__name__)

EXTRA_ARCHS_ENV = "DRAFTSMITH_VLLM_EAGLE3_ARCHS"  # comma-separated extra architectures for the plugin to try
_CLASS_PREFIX = "Eagle3Plugin_"


def register() -> None:
    """vLLM general-plugin entry point: route candidate architectures through ``eagle3_class`` (lazily).

    Cheap by design (vLLM calls it in every process): nothing is imported until vLLM resolves the architecture,
    and ``eagle3_class`` then returns vLLM's own class unchanged unless it lacks SupportsEagle3 and its decoder
    loop is Llama's.
    """
    if os.environ.get(PLUGIN_ENV, "1").strip().lower() in PLUGIN_OFF:
        return
    from vllm import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    for arch in plugin_candidates():
        if arch in supported:
            ModelRegistry.register_model(arch, f"{__name__}:{_CLASS_PREFIX}{arch}")


def plugin_candidates() -> list[str]:
    """Architectures the plugin offers to patch: 0.32's verified set plus ``DRAFTSMITH_VLLM_EAGLE3_ARCHS``."""
    extra = [a.strip() for a in os.environ.get(EXTRA_ARCHS_ENV, "").split(",") if a.strip()]
    return sorted(VLLM_PROFILES["0.32"].plugin_patchable | set(extra))


def __getattr__(name: str):
    """``draftsmith.integrations.vllm:Eagle3Plugin_<Arch>``: what ``register`` points vLLM's registry at."""
    if name.startswith(_CLASS_PREFIX):
        return eagle3_class(name.removeprefix(_CLASS_PREFIX))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def eagle3_class(arch: str) -> type:
    """vLLM's class for ``arch``, with ``SupportsEagle3`` added when it lacks it and its decoder loop is Llama's.

    Anything else comes back unchanged (vLLM then behaves exactly as without the plugin).
    """
    from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3, supports_eagle3
    from vllm.model_executor.models.registry import _VLLM_MODELS

    if arch not in _VLLM_MODELS:
        raise AttributeError(f"draftsmith plugin: vLLM has no architecture {arch!r}")
    mod_name, cls_name = _VLLM_MODELS[arch]
    module = importlib.import_module(mod_name if mod_name.startswith("vllm.") else
                                     f"vllm.model_executor.models.{mod_name}")
    outer = getattr(module, cls_name)
    if supports_eagle3(outer):
        return outer
    reason = _unpatchable_reason(outer)
    if reason:
        logger.warning("draftsmith plugin: not adding EAGLE-3 support to %s: %s", arch, reason)
        return outer
    inner_name = inner_model_name(_func_ast(outer.__init__))
    # The decoder class is looked up by name in the globals of the module that defines __init__.
    scope = outer.__init__.__globals__
    inner = scope[inner_name]
    if issubclass(inner, EagleModelMixin):
        inner_eagle = inner
    else:
        inner_eagle = type(inner.__name__, (inner, EagleModelMixin), {
            "forward": _forward_with_aux, "__module__": __name__,
            "__qualname__": f"{_CLASS_PREFIX}{inner.__qualname__}",
            "__doc__": f"{inner.__qualname__} that also returns EAGLE-3 aux hidden states (draftsmith plugin).",
        })

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        with _swapped(scope, inner_name, inner_eagle):
            outer.__init__(self, vllm_config=vllm_config, prefix=prefix)

    cls = type(outer.__name__, (outer, SupportsEagle3), {
        "__init__": __init__, "__module__": __name__, "__qualname__": f"{_CLASS_PREFIX}{arch}",
        "__doc__": f"vLLM's {outer.__qualname__} with SupportsEagle3 (draftsmith plugin).",
    })
    logger.info("draftsmith plugin: %s gains SupportsEagle3 (aux hidden states from its %s loop)", arch,
                inner.__name__)
    return cls


def _unpatchable_reason(outer: type) -> str | None:
    """Why the plugin leaves ``outer`` alone, or None when it can add SupportsEagle3 to it."""
    from vllm.model_executor.models.interfaces import EagleModelMixin

    try:
        init, fwd = _func_ast(outer.__init__), _func_ast(outer.forward)
    except (OSError, TypeError, SyntaxError) as e:
        return f"source unavailable ({e})"
    inner_name = inner_model_name(init)
    inner = getattr(outer.__init__, "__globals__", {}).get(inner_name) if inner_name else None
    if not isinstance(inner, type):
        return "its __init__ does not build the decoder as `self.model = <Class>(...)`"
    if not passthrough_forward(fwd):
        return "its forward does not return self.model(...) unchanged"
    if issubclass(inner, EagleModelMixin):
        return None
    try:
        ok = llama_like_decoder(_func_ast(inner.forward))
    except (OSError, TypeError, SyntaxError) as e:
        return f"decoder source unavailable ({e})"
    return None if ok else f"{inner_name}.forward is not Llama's decoder loop"


@contextmanager
def _swapped(scope: dict, name: str, value) -> Iterator[None]:
    """Let the outer class's ``__init__`` (which looks the decoder class up by name) build our subclass."""
    old = scope[name]
    scope[name] = value
    try:
        yield
    finally:
        scope[name] = old


def _forward_with_aux(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
    """Llama's decoder loop plus aux capture, as vLLM's own LlamaModel.forward does it.

    Aux state L = the residual stream entering layer L = ``hidden_states + residual`` after layer L-1 (L = 0:
    the embeddings). Parameter names match the decorated class's, which torch.compile's dynamic dims are keyed on.
    """
    from itertools import islice

    from vllm.distributed import get_pp_group
    from vllm.sequence import IntermediateTensors

    if get_pp_group().is_first_rank:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
    else:
        assert intermediate_tensors is not None
        hidden_states = intermediate_tensors["hidden_states"]
        residual = intermediate_tensors["residual"]
    remote_aux = self.collect_remote_aux_hidden_states(intermediate_tensors)
    aux_hidden_states: list = []
    if get_pp_group().is_first_rank:
        self._maybe_add_hidden_state(aux_hidden_states, self.start_layer, hidden_states, residual)
    for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):
        hidden_states, residual = layer(positions, hidden_states, residual, **kwargs)
        self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({"hidden_states": hidden_states, "residual": residual,
                                    **self.pack_local_aux_hidden_states(aux_hidden_states)})
    hidden_states, _ = self.norm(hidden_states, residual)
    aux_hidden_states = remote_aux + aux_hidden_states
    if aux_hidden_states:
        return hidden_states, aux_hidden_states
    return hidden_states


def supports_eagle3_by_import(arch: str) -> bool | None:
    """Ask the real class through vLLM's registry (slow: imports vLLM). None when vLLM or the arch is missing."""
    try:
        from vllm.model_executor.models.interfaces import supports_eagle3
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError:
        return None
    if arch not in ModelRegistry.get_supported_archs():
        return None
    cls = ModelRegistry._try_load_model_cls(arch)
    return None if cls is None else bool(supports_eagle3(cls))


def _func_ast(fn) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


__all__ = ["EXTRA_ARCHS_ENV", "PLUGIN_ENV", "eagle3_class", "plugin_candidates", "register",
           "supports_eagle3_by_import"]
