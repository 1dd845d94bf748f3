"""The package's floors: no import cycle, no upward import (function-level ones included), no huge module.

Floors, lowest first: core, model, data, stages, app. `integrations` (code that runs inside vLLM) may
import core only; `testing` (tiny models for tests) is imported by nothing in the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
FLOORS = {"core": 0, "model": 1, "data": 2, "stages": 3, "app": 4}
MAX_LINES = 600


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `root`/draftsmith."""
    out = {}
    for path in sorted((root / "draftsmith").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Every draftsmith module `path` imports, wherever the import statement stands."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import draftsmith.a.b` of a name inside a module
                t = t.rpartition(".")[0]
            if t.startswith("draftsmith") and t != name:
                found.add(t)
    return found


def floor(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if len(parts) == 1:
        return "root", -1  # draftsmith/__init__: the version only
    top = parts[1]
    if top == "cli":
        return "app", FLOORS["app"]  # the console-script shim over draftsmith.app.cli
    return top, FLOORS.get(top)


def violations(root: Path) -> list[str]:
    known = modules(root)
    graph = {m: imports_of(p, m, known) for m, p in known.items()}
    bad = []
    for m, deps in graph.items():
        top, rank = floor(m)
        for d in sorted(deps):
            dtop, drank = floor(d)
            if dtop == "testing" and top != "testing":
                bad.append(f"{m} imports {d}: nothing in the package may import testing")
            elif top == "integrations" and dtop not in ("core", "integrations", "root"):
                bad.append(f"{m} imports {d}: the in-engine plugin may import core only")
            elif rank is not None and drank is not None and drank > rank:
                bad.append(f"{m} imports {d}: {top} (floor {rank}) must not import {dtop} (floor {drank})")
    bad += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    bad += [f"{m}: {n} lines (more than {MAX_LINES})" for m, p in known.items()
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp) + [sorted(comp)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_package_has_floors_and_no_cycles():
    assert violations(SRC) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"draftsmith/__init__.py": "", **files}.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, expect", [
    # A function-level upward import: core reaching up into stages.
    ({"draftsmith/core/__init__.py": "", "draftsmith/core/io.py": "def f():\n    from draftsmith.stages import x\n",
      "draftsmith/stages/__init__.py": "", "draftsmith/stages/x.py": ""}, "core (floor 0) must not import stages"),
    # A cycle between two stages, one side hidden in a function.
    ({"draftsmith/stages/__init__.py": "", "draftsmith/stages/a.py": "from draftsmith.stages import b\n",
      "draftsmith/stages/b.py": "def g():\n    from draftsmith.stages.a import y\n"}, "import cycle"),
    # A relative import of the test fixtures.
    ({"draftsmith/app/__init__.py": "", "draftsmith/app/demo.py": "from ..testing import models\n",
      "draftsmith/testing/__init__.py": "", "draftsmith/testing/models.py": ""}, "may import testing"),
    # The plugin reaching beyond core.
    ({"draftsmith/integrations/__init__.py": "", "draftsmith/integrations/vllm.py": "import draftsmith.model.target\n",
      "draftsmith/model/__init__.py": "", "draftsmith/model/target.py": ""}, "may import core only"),
    ({"draftsmith/core/__init__.py": "", "draftsmith/core/big.py": "x = 1\n" * (MAX_LINES + 1)}, "lines"),
])
def test_checker_catches(tmp_path, files, expect):
    found = violations(_tree(tmp_path, files))
    assert any(expect in v for v in found), found
