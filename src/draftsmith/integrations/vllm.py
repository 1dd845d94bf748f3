"""draftsmith's vLLM plugin: makes more target classes EAGLE-3-capable inside vLLM.

vLLM's runner raises "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested" for a
target class without ``SupportsEagle3``. For a class whose decoder loop is Llama's pre-EAGLE residual-stream loop
(checked on its source, not assumed; ``pysource.residual_loop`` allows layers called by keyword and a final norm
of another name, as LFM2's hybrid loop has them), the plugin (entry point group ``vllm.general_plugins``,
``register``) registers a subclass that captures the residual stream entering the requested layers
(``hidden_states + residual`` of the previous layer, as vLLM's Llama does) and returns ``(hidden, aux_list)``.
Set ``DRAFTSMITH_VLLM_PLUGIN=0`` to turn it off.

vLLM loads this module in every process, so it imports vLLM only inside functions and imports nothing of
draftsmith beyond ``draftsmith.core``. What each vLLM version does with a pair lives in
``draftsmith.core.vllm_facts``, the source reading in ``draftsmith.core.pysource``, and ``draftsmith serve`` in
``draftsmith.app.serve``.

Capture mode (``install_capture``/``drain_capture``, run through ``LLM.apply_model`` by
``vllm_capture_worker.py``): forward hooks copy the aux states and the post-norm final state of whole prefills to
per-request spool files for ``draftsmith capture --backend vllm``. It needs no SupportsEagle3, so it serves any
decoder with ``embed_tokens``, ``layers`` and ``norm``; the registered classes are untouched by it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import logging
import os
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

from draftsmith.core.pysource import inner_model_name, passthrough_forward, residual_loop
from draftsmith.core.vllm_facts import EXTRA_ARCHS_ENV, PLUGIN_ENV, PLUGIN_OFF, plugin_candidates

logger = logging.getLogger(__name__)

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
        loop = residual_loop(_func_ast(inner.forward))
        inner_eagle = type(inner.__name__, (inner, EagleModelMixin), {
            "forward": _forward_with_aux, "__module__": __name__,
            "_draftsmith_layer_keywords": loop.layer_keywords, "_draftsmith_norm": loop.norm,
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
        loop = residual_loop(_func_ast(inner.forward))
    except (OSError, TypeError, SyntaxError) as e:
        return f"decoder source unavailable ({e})"
    return None if loop is not None else f"{inner_name}.forward is not the residual-stream loop the plugin repeats"


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
    """The decoder's own residual-stream loop plus aux capture, as vLLM's LlamaModel.forward does it.

    Aux state L = the residual stream entering layer L = ``hidden_states + residual`` after layer L-1 (L = 0:
    the embeddings). Layers are called as the class calls them (by keyword where it does: LFM2's convolution
    layers take no positions argument) and the final norm is the class's own (``_draftsmith_norm``). Parameter
    names match the decorated class's, which torch.compile's dynamic dims are keyed on.
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
        if self._draftsmith_layer_keywords:
            hidden_states, residual = layer(positions=positions, hidden_states=hidden_states, residual=residual,
                                            **kwargs)
        else:
            hidden_states, residual = layer(positions, hidden_states, residual, **kwargs)
        self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({"hidden_states": hidden_states, "residual": residual,
                                    **self.pack_local_aux_hidden_states(aux_hidden_states)})
    hidden_states, _ = getattr(self, self._draftsmith_norm)(hidden_states, residual)
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


# --- capture mode: copy the aux and final states of whole prefills out of the forward ---------------------
def spool_key(ids) -> str:
    """The spool file name of one prefill: a hash of its token ids, so any process holding the model can name it."""
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode()).hexdigest()[:40]


class _Capturer:
    """Forward hooks on one vLLM model that write each whole prefill's states to ``<spool>/<key>.safetensors``.

    Per forward: the embedding's input gives the token ids, layer 0's input the positions, each aux layer's
    input the residual stream entering it (``hidden_states + residual``, as vLLM's own EAGLE-3 aux capture), and
    the final norm's output the post-norm final state (what HF capture stores). Requests lie contiguously in the
    flattened batch, and a prefill starts at position 0; a segment that does not run 0..T-1 (a cached prefix, a
    chunk, a decode step) is not written, and the driver reports it missing. Only tensor-parallel rank 0 writes;
    every rank gathers, so a sequence-parallel state is gathered by all of them.
    """

    def __init__(self, model, aux_layers, spool: str) -> None:
        import threading
        from queue import Queue

        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        if get_pp_group().world_size > 1:
            raise RuntimeError("draftsmith capture: pipeline parallelism is not supported (use tensor parallelism)")
        self.decoder = _find_decoder(model)
        n = len(self.decoder.layers)
        if not all(0 <= int(a) < n for a in aux_layers):
            raise RuntimeError(f"draftsmith capture: aux layers {list(aux_layers)} outside 0..{n - 1}")
        self.aux_layers, self.spool, self.writes = [int(a) for a in aux_layers], spool, 0
        self.rank0 = get_tensor_model_parallel_rank() == 0
        self.ids = self.positions = None
        self.aux: dict[int, object] = {}
        self.queue: Queue = Queue(maxsize=4)
        self.errors: list[str] = []
        self.hooks = [self.decoder.embed_tokens.register_forward_pre_hook(self._on_embed),
                      self.decoder.layers[0].register_forward_pre_hook(self._on_first_layer, with_kwargs=True)]
        self.hooks += [self.decoder.layers[a].register_forward_pre_hook(self._aux_hook(a), with_kwargs=True)
                       for a in self.aux_layers]
        self.hooks.append(self.decoder.norm.register_forward_hook(self._on_norm))
        threading.Thread(target=self._write_loop, daemon=True).start()

    def _on_embed(self, module, args) -> None:
        self.ids, self.aux = args[0].detach().to("cpu", copy=True).long(), {}

    def _on_first_layer(self, module, args, kwargs) -> None:
        pos = args[0] if args else kwargs["positions"]
        self.positions = (pos[0] if pos.dim() == 2 else pos).detach().to("cpu", copy=True).long()  # M-RoPE: row 0

    def _aux_hook(self, layer: int):
        def hook(module, args, kwargs) -> None:
            names = ("positions", "hidden_states", "residual")
            got = list(args) + [kwargs.get(k) for k in names[len(args):]]
            hidden, residual = got[1], got[2]
            x = hidden if residual is None else hidden + residual
            self.aux[layer] = self._gathered(x).detach().to("cpu", copy=True)
        return hook

    def _gathered(self, x):
        if self.positions is not None and x.shape[0] != self.positions.shape[0]:
            from vllm.distributed import tensor_model_parallel_all_gather

            x = tensor_model_parallel_all_gather(x, 0)[: self.positions.shape[0]]
        return x

    def _on_norm(self, module, args, output) -> None:
        final = output[0] if isinstance(output, tuple) else output
        ids, pos, aux = self.ids, self.positions, self.aux
        self.ids = self.positions = None
        self.aux = {}
        if not self.rank0 or ids is None or pos is None or len(aux) != len(self.aux_layers):
            return
        final = final.detach().to("cpu", copy=True)
        if not (ids.shape[0] == pos.shape[0] == final.shape[0]):
            return
        self.queue.put((ids, pos, [aux[a] for a in self.aux_layers], final))

    def _write_loop(self) -> None:
        import torch
        from safetensors.torch import save_file

        while True:
            ids, pos, aux, final = self.queue.get()
            try:
                stacked = torch.stack(aux, dim=1)  # [N, n, H]
                starts = (pos == 0).nonzero().flatten().tolist() + [pos.shape[0]]
                for a, b in zip(starts, starts[1:], strict=False):
                    if not torch.equal(pos[a:b], torch.arange(b - a)):
                        continue
                    seg = ids[a:b]
                    path = os.path.join(self.spool, spool_key(seg.tolist()) + ".safetensors")
                    tmp = f"{path}.{os.getpid()}.tmp"
                    save_file({"input_ids": seg.to(torch.int32).contiguous(), "aux": stacked[a:b].contiguous(),
                               "hidden": final[a:b].contiguous()}, tmp,
                              metadata={"aux_layers": ",".join(map(str, self.aux_layers))})
                    with open(tmp, "rb") as f:
                        os.fsync(f.fileno())
                    os.replace(tmp, path)  # atomic: the driver never sees a half-written file
                    self.writes += 1
            except Exception as e:  # reported by drain(), never swallowed
                self.errors.append(f"{type(e).__name__}: {e}")
            finally:
                self.queue.task_done()

    def drain(self) -> dict:
        """Wait until every queued prefill is on disk; the counts and errors so far."""
        self.queue.join()
        return {"rank0": self.rank0, "writes": self.writes, "errors": list(self.errors)}


def _find_decoder(model):
    """The module holding ``embed_tokens``, ``layers`` and the final ``norm`` (a wrapper's language model too)."""
    for _, module in model.named_modules():
        if all(hasattr(module, a) for a in ("embed_tokens", "layers", "norm")):
            return module
    raise RuntimeError(f"draftsmith capture: no decoder with embed_tokens, layers and norm in {type(model).__name__}")


def install_capture(model, aux_layers, spool: str) -> int:
    """``LLM.apply_model`` target: hook ``model`` for capture (once); returns its number of decoder layers."""
    if getattr(model, "_draftsmith_capture", None) is None:
        model._draftsmith_capture = _Capturer(model, aux_layers, spool)
    return len(model._draftsmith_capture.decoder.layers)


def drain_capture(model) -> dict:
    """``LLM.apply_model`` target: wait for the spool writes of everything run so far."""
    return model._draftsmith_capture.drain()


__all__ = ["EXTRA_ARCHS_ENV", "PLUGIN_ENV", "drain_capture", "eagle3_class", "install_capture", "plugin_candidates",
           "register", "spool_key", "supports_eagle3_by_import"]
