"""Installed Python packages read with ``ast`` instead of imported: where a class is defined, what it inherits,
and (``VllmSource``) vLLM's registry and which of its target classes implement ``SupportsEagle3``.

Importing vLLM takes 5-15 s (a transformers model, seconds); parsing the few files a question needs takes
milliseconds. ``llama_like_decoder`` and ``passthrough_forward`` decide on a function's syntax tree whether
draftsmith's vLLM plugin can add ``SupportsEagle3`` to a class: doctor asks them of vLLM's files, the plugin of
the live classes' source.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from draftsmith.core import vllm_facts


# --- reading installed source without importing it ------------------------------------------------------------
class PySource:
    """An installed package's source read with ``ast``: where a class is defined and what it inherits.

    Importing vLLM (or a transformers model) takes seconds to tens of seconds; parsing the few files a question
    needs takes milliseconds. Answers are None where static reading cannot tell (classes built by calls).
    """

    package = ""

    def __init__(self, root: str | Path, version: str | None = None):
        self.root = Path(root)
        self.version = version
        self._trees: dict[str, tuple[ast.Module, bool] | None] = {}

    @classmethod
    def locate(cls, package: str) -> Path | None:
        """The package's directory, found without importing it."""
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(next(iter(spec.submodule_search_locations)))

    def _module_file(self, module: str) -> Path | None:
        parts = module.split(".")
        if parts[0] != self.package:
            return None
        base = self.root.joinpath(*parts[1:])
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py")
        if (base / "__init__.py").is_file():
            return base / "__init__.py"
        return None

    def _tree(self, module: str) -> tuple[ast.Module, bool] | None:
        if module not in self._trees:
            path = self._module_file(module)
            self._trees[module] = None if path is None else (
                ast.parse(path.read_text(encoding="utf-8")), path.name == "__init__.py")
        return self._trees[module]

    def assignment(self, module: str, name: str) -> ast.expr | None:
        """The value expression of a top-level ``name = ...`` in ``module``."""
        parsed = self._tree(module)
        if parsed is None:
            return None
        for node in _top_level(parsed[0]):
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(
                node, "target", None)
            if isinstance(target, ast.Name) and target.id == name and getattr(node, "value", None) is not None:
                return node.value
        return None

    def find_class(self, module: str, name: str, _depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """Where ``name`` as seen from ``module`` is defined: follows ``from x import y`` and ``A = B`` aliases."""
        parsed = self._tree(module)
        if parsed is None or _depth > 12:
            return None
        tree, is_package = parsed
        stmts = list(_top_level(tree))
        for node in stmts:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        for node in stmts:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.find_class(_absolute(module, is_package, node), alias.name, _depth + 1)
            elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                  and node.targets[0].id == name and isinstance(node.value, ast.Name)):
                return self.find_class(module, node.value.id, _depth + 1)
        return None

    def ancestry(self, module: str, node: ast.ClassDef, seen: set[str] | None = None) -> tuple[set[str], bool]:
        """(names of this class and every resolvable ancestor, complete?)."""
        seen = set() if seen is None else seen
        names, complete = {node.name}, True
        for base in node.bases:
            if isinstance(base, ast.Name):
                found = self.find_class(module, base.id)
                if found is None:
                    names.add(base.id)  # external (torch, typing): nothing more to learn there
                    continue
                key = f"{found[0]}:{found[1].name}"
                if key in seen:
                    continue
                seen.add(key)
                sub, ok = self.ancestry(found[0], found[1], seen)
                names |= sub
                complete &= ok
            elif isinstance(base, ast.Attribute):
                names.add(base.attr)
            elif isinstance(base, ast.Subscript):
                continue
            else:  # a class built by a call (as_seq_cls_model(...)): cannot tell statically
                complete = False
        return names, complete

    def find_method(self, module: str, cls: ast.ClassDef, name: str, _depth: int = 0
                    ) -> tuple[str, ast.FunctionDef] | None:
        """(defining module, def) of ``cls.name``, looking through base classes depth-first (Python's MRO for
        the single-inheritance chains this is used on)."""
        own = _method(cls, name)
        if own is not None:
            return module, own
        if _depth > 12:
            return None
        for base in cls.bases:
            if isinstance(base, ast.Name):
                found = self.find_class(module, base.id)
                if found is not None:
                    hit = self.find_method(*found, name, _depth + 1)
                    if hit is not None:
                        return hit
        return None


class VllmSource(PySource):
    """vLLM's installed source: registry entries, SupportsEagle3 on target classes, what the plugin can patch."""

    package = "vllm"

    def __init__(self, root: str | Path, version: str | None = None):
        super().__init__(root, version)
        if not (self.root / "model_executor" / "models" / "registry.py").is_file():
            raise FileNotFoundError(f"{root}: not a vLLM package directory (no model_executor/models/registry.py)")

    @classmethod
    def installed(cls) -> VllmSource | None:
        version = vllm_facts.installed_vllm_version()
        root = cls.locate("vllm") if version is not None else None
        if root is None:
            return None
        try:
            return cls(root, version)
        except FileNotFoundError:
            return None

    @functools.cached_property
    def _registry_tables(self) -> dict[str, dict[str, tuple[str, str]]]:
        tree = self._tree("vllm.model_executor.models.registry")[0]
        tables: dict[str, dict[str, tuple[str, str]]] = {}
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(
                node, "target", None)
            if not (isinstance(target, ast.Name) and target.id.endswith("_MODELS")
                    and isinstance(node.value, ast.Dict)):
                continue
            table: dict[str, tuple[str, str]] = {}
            for k, v in zip(node.value.keys, node.value.values, strict=True):
                if k is None and isinstance(v, ast.Name):  # **_OTHER_MODELS
                    table.update(tables.get(v.id, {}))
                elif (isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) == 2
                      and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in v.elts)):
                    mod, cls = v.elts[0].value, v.elts[1].value
                    table[k.value] = (mod if mod.startswith("vllm.") else f"vllm.model_executor.models.{mod}", cls)
            tables[target.id] = table
        return tables

    @property
    def registry(self) -> dict[str, tuple[str, str]]:
        """Architecture -> (module, class) as ``ModelRegistry`` starts out."""
        return self._registry_tables.get("_VLLM_MODELS", {})

    @property
    def multimodal_archs(self) -> frozenset[str]:
        return frozenset(self._registry_tables.get("_MULTIMODAL_MODELS", {}))

    @property
    def transformers_backend_archs(self) -> frozenset[str]:
        t = self._registry_tables
        return frozenset(t.get("_TRANSFORMERS_SUPPORTED_MODELS", {})) | frozenset(
            t.get("_TRANSFORMERS_BACKEND_MODELS", {}))

    def supports_eagle3(self, arch: str) -> bool | None:
        """Does the registry class for ``arch`` inherit ``SupportsEagle3``? None: not registered / cannot tell."""
        entry = self.registry.get(arch)
        if entry is None:
            return None
        found = self.find_class(*entry)
        if found is None:
            return None
        names, complete = self.ancestry(found[0], found[1])
        if "SupportsEagle3" in names:
            return True
        return False if complete else None

    def plugin_patchable(self, arch: str) -> bool:
        """Would draftsmith's plugin add SupportsEagle3 to ``arch`` (residual-stream loop, pass-through forward)?"""
        return self.plugin_refusal(arch) is None

    def plugin_refusal(self, arch: str) -> str | None:
        """Why the plugin leaves ``arch`` alone (as ``integrations.vllm`` decides on the live class), or None."""
        entry = self.registry.get(arch)
        found = self.find_class(*entry) if entry else None
        if found is None:
            return f"{arch} is not a class in vLLM's registry"
        if self.supports_eagle3(arch):
            return f"{arch} implements SupportsEagle3 already"
        init, fwd = self.find_method(*found, "__init__"), self.find_method(*found, "forward")
        if init is None or fwd is None or not passthrough_forward(fwd[1]):
            return f"{found[1].name}.forward does not return self.model(...) unchanged"
        inner_name = inner_model_name(init[1])
        inner = self.find_class(init[0], inner_name) if inner_name else None
        if inner is None:
            return f"{found[1].name}.__init__ does not build its decoder as `self.model = <Class>(...)`"
        names, _ = self.ancestry(inner[0], inner[1])
        if "EagleModelMixin" in names:
            return None
        inner_fwd = self.find_method(*inner, "forward")
        if inner_fwd is None or residual_loop(inner_fwd[1]) is None:
            return f"{inner_name}.forward is not the residual-stream loop the plugin repeats"
        return None


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module statements, including those inside top-level if/else and try blocks (TYPE_CHECKING, optional deps)."""
    for node in tree.body:
        yield node
        if isinstance(node, ast.If):
            yield from node.body
            yield from node.orelse
        elif isinstance(node, ast.Try):
            yield from node.body
            for h in node.handlers:
                yield from h.body


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def inner_model_name(init: ast.FunctionDef) -> str | None:
    """``X`` in ``self.model = X(...)`` inside an ``__init__``."""
    for node in ast.walk(init):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute)
                and node.targets[0].attr == "model" and isinstance(node.targets[0].value, ast.Name)
                and node.targets[0].value.id == "self" and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)):
            return node.value.func.id
    return None


# --- is a decoder loop exactly Llama's? ----------------------------------------------------------------------
# The body every Llama-like vLLM decoder had before EAGLE-3 (0.32's MixtralModel, Gemma2Model, Qwen2MoeModel,
# ... verbatim up to formatting). A class whose forward differs in any statement is not patched.
_LLAMA_LOOP = '''
def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
    if get_pp_group().is_first_rank:
        if inputs_embeds is not None:
            hidden_states = inputs_embeds
        else:
            hidden_states = self.embed_input_ids(input_ids)
        residual = None
    else:
        assert intermediate_tensors is not None
        hidden_states = intermediate_tensors["hidden_states"]
        residual = intermediate_tensors["residual"]
    for layer in islice(self.layers, self.start_layer, self.end_layer):
        hidden_states, residual = layer(positions, hidden_states, residual)
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
    hidden_states, _ = self.norm(hidden_states, residual)
    return hidden_states
'''


def _statements(func: ast.FunctionDef) -> list[ast.stmt]:
    """Body statements without the docstring and without ``**kwargs`` pass-through (copies)."""
    kw = func.args.kwarg.arg if func.args.kwarg else None
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
            body[0].value.value, str):
        body = body[1:]
    return [_strip_kwargs(s, kw) for s in body]


def _body_dump(func: ast.FunctionDef) -> list[str]:
    """Formatting-independent form of a function body (``ast.dump`` ignores line numbers)."""
    return [ast.dump(s) for s in _statements(func)]


def _strip_kwargs(stmt: ast.stmt, kw: str | None) -> ast.stmt:
    stmt = ast.parse(ast.unparse(stmt)).body[0]  # a copy
    if kw:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call):
                node.keywords = [k for k in node.keywords if not (k.arg is None and isinstance(k.value, ast.Name)
                                                                  and k.value.id == kw)]
    return stmt


_LLAMA_LOOP_DUMP = _body_dump(ast.parse(_LLAMA_LOOP).body[0])


@dataclass(frozen=True)
class ResidualLoop:
    """How a decoder runs Llama's residual-stream loop: the plugin's forward repeats it with these two choices."""

    layer_keywords: bool  # layers called as ``layer(positions=..., hidden_states=..., residual=...)``
    norm: str  # the final norm's attribute: ``self.<norm>(hidden_states, residual)``


_LOOP_ARGS = ("positions", "hidden_states", "residual")


class _Canonical(ast.NodeTransformer):
    """Rewrites the two spellings a residual-stream loop may vary in to Llama's, noting which it met."""

    def __init__(self) -> None:
        self.keywords = False
        self.norms: set[str] = set()

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if (isinstance(f, ast.Name) and f.id == "layer" and not node.args
                and sorted(k.arg or "" for k in node.keywords) == sorted(_LOOP_ARGS)
                and all(isinstance(k.value, ast.Name) and k.value.id == k.arg for k in node.keywords)):
            self.keywords = True
            return ast.Call(func=f, args=[ast.Name(id=a, ctx=ast.Load()) for a in _LOOP_ARGS], keywords=[])
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"
                and not node.keywords and [ast.unparse(a) for a in node.args] == ["hidden_states", "residual"]):
            self.norms.add(f.attr)
            return ast.Call(func=ast.Attribute(value=f.value, attr="norm", ctx=ast.Load()), args=node.args,
                            keywords=[])
        return node


def residual_loop(func: ast.FunctionDef) -> ResidualLoop | None:
    """Is this decoder ``forward`` Llama's pre-EAGLE loop, up to calling its layers by keyword and naming its final
    norm otherwise (LFM2: ``layer(positions=..., ...)`` and ``self.embedding_norm``)? Each layer returns
    ``(hidden_states, residual)`` and the stream entering layer L is their sum, so the plugin captures it as for
    Llama. A loop that differs in anything else (scaled embeddings, a layer that returns the whole stream, an
    unfused final norm) is not one: its aux states would be other tensors."""
    canon = _Canonical()
    body = [ast.dump(canon.visit(s)) for s in _statements(func)]
    if body != _LLAMA_LOOP_DUMP or len(canon.norms) != 1:
        return None
    return ResidualLoop(canon.keywords, next(iter(canon.norms)))


def llama_like_decoder(func: ast.FunctionDef) -> bool:
    """Is this decoder ``forward`` a residual-stream loop the plugin can repeat (``residual_loop``)?"""
    return residual_loop(func) is not None


def passthrough_forward(func: ast.FunctionDef) -> bool:
    """Does a ``*ForCausalLM.forward`` return ``self.model(input_ids, positions, intermediate_tensors,
    inputs_embeds)`` unchanged (so the inner model's ``(hidden, aux)`` tuple reaches vLLM's runner)?"""
    body = _statements(func)

    def is_model_call(node: ast.expr) -> bool:
        return (isinstance(node, ast.Call) and ast.unparse(node.func) == "self.model" and not node.keywords
                and [ast.unparse(a) for a in node.args] == ["input_ids", "positions", "intermediate_tensors",
                                                            "inputs_embeds"])

    if len(body) == 1:
        return isinstance(body[0], ast.Return) and body[0].value is not None and is_model_call(body[0].value)
    if len(body) == 2:
        first, second = body
        return (isinstance(first, ast.Assign) and len(first.targets) == 1 and isinstance(first.targets[0], ast.Name)
                and is_model_call(first.value) and isinstance(second, ast.Return)
                and isinstance(second.value, ast.Name) and second.value.id == first.targets[0].id)
    return False


__all__ = ["PySource", "ResidualLoop", "VllmSource", "inner_model_name", "llama_like_decoder", "passthrough_forward",
           "residual_loop"]
