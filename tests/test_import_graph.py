"""No import circles in qla_serve/: the graph of qla_serve-internal imports is acyclic.

Every ``import`` / ``from ... import`` statement of every module counts, at module level or
inside a function (a function-level import is a circle that only waits for its first call),
and so does ``importlib.import_module("literal")``. Edges:

* ``import a.b.c``            -> the module a.b.c;
* ``from P import n``         -> P.n where that is a module, else P itself (a name defined in,
  or re-exported by, P's ``__init__``);
* relative imports resolve against the importing module's package.

What is not an edge: the implicit import of a module's parent packages (``import
qla_serve.plan`` runs qla_serve/__init__.py first). That is Python's package mechanics, not a
dependency one module chose; counting it would make every package that re-exports a
submodule's names a "circle". A helper that two modules share goes below both (DESIGN.md's
layers), not into either of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = "qla_serve"
ROOT = Path(__file__).resolve().parent.parent / PKG


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The qla_serve modules ``name`` (at ``path``) imports, anywhere in its source."""
    package = name if _is_package(path) else name.rpartition(".")[0]
    out: set[str] = set()

    def module_of(dotted: str) -> str | None:
        # the longest prefix of ``dotted`` that is a qla_serve module
        while dotted:
            if dotted in modules:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(module_of(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                out.add(sub if sub in modules else module_of(src))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.add(module_of(node.args[0].value))
    out.discard(None)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as a circle."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _circle(graph, comp) -> str:
    """One concrete circle inside a strongly connected component, for the failure message."""
    start, members = comp[0], set(comp)
    path, seen = [start], {start}
    while True:
        nxt = sorted(w for w in graph[path[-1]] if w in members)
        back = [w for w in nxt if w in seen]
        if back:
            return " -> ".join(path[path.index(back[0]):] + [back[0]])
        path.append(nxt[0])
        seen.add(nxt[0])


def test_the_graph_is_read():
    """The parser sees the imports it should (a guard against a test that passes on nothing)."""
    g = import_graph()
    assert "qla_serve.ops" in g["qla_serve"] and "qla_serve._validate" in g["qla_serve.ops"]
    assert "qla_serve.deploy.config" in g["qla_serve.deploy.cli"]          # relative import
    assert "qla_serve.bench" in g["qla_serve.cli"]                         # function-level import


def test_no_import_circles():
    g = import_graph()
    circles = [_circle(g, c) for c in _cycles(g)]
    assert not circles, "import circles in qla_serve/:\n  " + "\n  ".join(circles)


def test_a_circle_is_found(tmp_path):
    """The detector itself: a two-module circle through a function-level import fails."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [_circle(g, c) for c in _cycles(g)] == ["a -> b -> c -> a"]
