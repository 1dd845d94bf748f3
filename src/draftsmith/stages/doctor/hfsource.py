"""transformers' installed source read with ``ast``: which model types it knows, where a model keeps its decoder
layers, which config fields have defaults. Milliseconds, where importing the modeling code takes seconds.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

from draftsmith.core.pysource import PySource


def get_dotted(d: dict, dotted: str):
    """``d["a"]["b"]`` for ``"a.b"``; None where any step is missing (a config's nested field)."""
    node = d
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


class HFSource(PySource):
    """transformers' installed source: which model types it knows, and where a model keeps its decoder layers."""

    package = "transformers"
    _AUTO = ("transformers.models.auto.auto_mappings", "transformers.models.auto.configuration_auto",
             "transformers.models.auto.modeling_auto")
    _SKIP = ("vision", "visual", "audio", "encoder", "mm_projector")

    @classmethod
    def installed(cls) -> HFSource | None:
        root = cls.locate("transformers")
        if root is None:
            return None
        try:
            import importlib.metadata

            version = importlib.metadata.version("transformers")
        except Exception:  # noqa: BLE001
            version = None
        return cls(root, version)

    def mapping(self, name: str) -> dict[str, str]:
        """A ``*_MAPPING_NAMES`` table (model_type -> class name), read from the auto modules."""
        cache = self.__dict__.setdefault("_mappings", {})
        if name not in cache:
            table: dict[str, str] = {}
            for module in self._AUTO:
                value = self.assignment(module, name)
                table = _literal_mapping(value) if value is not None else {}
                if table:
                    break
            cache[name] = table
        return cache[name]

    def knows(self, model_type: str | None) -> bool | None:
        configs = self.mapping("CONFIG_MAPPING_NAMES")
        if not configs:
            return None
        return model_type in configs

    def _module(self, model_type: str, prefix: str) -> str:
        special = self.mapping("SPECIAL_MODEL_TYPE_TO_MODULE_NAME")
        name = special.get(model_type, model_type.replace("-", "_"))
        return f"transformers.models.{name}.{prefix}_{name}"

    def model_type_of(self, raw: dict) -> str | None:
        """The model type transformers will use for a (sub-)config: its own, else its architecture's."""
        mt = raw.get("model_type")
        if self.knows(mt):
            return mt
        for arch in raw.get("architectures") or []:
            for table in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES"):
                for key, cls in self.mapping(table).items():
                    if cls == arch:
                        return key
        return None

    def model_class(self, model_type: str | None, tables: Sequence[str]) -> tuple[str, ast.ClassDef] | None:
        if model_type is None:
            return None
        for table in tables:
            cls = self.mapping(table).get(model_type)
            if cls:
                found = self.find_class(self._module(model_type, "modeling"), cls)
                if found is not None:
                    return found
        return None

    def decoder_layers_path(self, raw: dict) -> str | None:
        """Attribute path of the decoder's layer list in the causal-LM class for this config, or None."""
        top = self.model_class(self.model_type_of(raw), ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
                                                         "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"))
        if top is None:
            return None
        paths = self._layers(*top, raw, "", 0)
        return min(paths, key=lambda p: p.count(".")) if paths else None

    def _layers(self, module: str, cls: ast.ClassDef, raw: dict, prefix: str, depth: int) -> list[str]:
        init = self.find_method(module, cls, "__init__")
        if init is None or depth > 4:
            return []
        mod, fn = init
        found: list[str] = []
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Attribute) and isinstance(node.targets[0].value, ast.Name)
                    and node.targets[0].value.id == "self" and isinstance(node.value, ast.Call)):
                continue
            attr, call = node.targets[0].attr, node.value
            if any(k in attr for k in self._SKIP):
                continue
            func = ast.unparse(call.func)
            if func.endswith("ModuleList"):
                if "num_hidden_layers" in ast.unparse(call):
                    found.append(prefix + attr)
                continue
            sub = raw
            if call.args and ast.unparse(call.args[0]).startswith("config."):
                sub = get_dotted(raw, ast.unparse(call.args[0]).removeprefix("config.")) or raw
                sub = sub if isinstance(sub, dict) else raw
            head = func.split(".")[0]
            if head.startswith("Auto") and func.endswith("from_config"):
                tables = ("MODEL_MAPPING_NAMES",) if head == "AutoModel" else ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",)
                target = self.model_class(self.model_type_of(sub), tables)
            else:
                target = self.find_class(mod, head) if head.isidentifier() else None
            if target is not None:
                found += self._layers(*target, sub, f"{prefix}{attr}.", depth + 1)
        return found

    def config_default(self, model_type: str | None, field_name: str) -> bool:
        """Does the config class for ``model_type`` declare ``field_name`` (so the attribute exists by default)?"""
        cls = self.mapping("CONFIG_MAPPING_NAMES").get(model_type or "")
        found = self.find_class(self._module(model_type, "configuration"), cls) if cls else None
        while found is not None:
            module, node = found
            for stmt in node.body:
                names = [stmt.target] if isinstance(stmt, ast.AnnAssign) else (
                    stmt.targets if isinstance(stmt, ast.Assign) else [])
                if any(isinstance(n, ast.Name) and n.id == field_name for n in names):
                    return True
            base = next((b.id for b in node.bases if isinstance(b, ast.Name)), None)
            found = self.find_class(module, base) if base else None
        return False


def _literal_mapping(value: ast.expr) -> dict[str, str]:
    """``OrderedDict([("a", "B"), ...])`` or ``{"a": "B"}`` -> dict (tuple values: their first name)."""
    def name(v: ast.expr) -> str | None:
        if isinstance(v, ast.Constant) and isinstance(v.value, str):
            return v.value
        if isinstance(v, ast.Tuple) and v.elts:
            return name(v.elts[0])
        return None

    out: dict[str, str] = {}
    if isinstance(value, ast.Call) and value.args and isinstance(value.args[0], (ast.List, ast.Tuple)):
        for item in value.args[0].elts:
            if isinstance(item, ast.Tuple) and len(item.elts) == 2 and isinstance(item.elts[0], ast.Constant):
                v = name(item.elts[1])
                if v is not None:
                    out[str(item.elts[0].value)] = v
    elif isinstance(value, ast.Dict):
        for k, v in zip(value.keys, value.values, strict=True):
            if isinstance(k, ast.Constant) and name(v) is not None:
                out[str(k.value)] = name(v)
    return out


__all__ = ["HFSource", "get_dotted"]
