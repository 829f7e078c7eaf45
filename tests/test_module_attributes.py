"""No attribute of a qla_serve module is read, or set by name (`monkeypatch.setattr(P, "FUSED",
...)`), that the module does not have, anywhere in the package, the benchmarks, the scripts or
the tests (read from the source, on the CPU).

test_undefined_names.py's reason, one level down: most launch code, GPU tests and benchmarks
run only on a GPU, so an attribute lost in a refactor would first fail there. The split of
prefill_api.py (prefill_launch.py took `prefill`) left tests/kernels/test_prefill_gpu.py calling
`_mod().prefill(...)` and `mod.prefill(...)`: every CPU test passed, 16 GPU tests failed on an
H100 with AttributeError.

What counts as a module here: a name an import binds to a qla_serve module (`from
qla_serve.kernels.hopper import prefill_api as P`, `import qla_serve.ops as ops`, relative
imports inside the package); a function whose body imports a qla_serve module and returns it
(`def _mod(): from ... import prefill_api as mod; return mod`), called directly (`_mod().X`) or
bound once (`mod = _mod()`). A name the file also binds any other way is left alone (it may hold
something else there). Modules that do not import on this machine (the engine backends without
their engine) are skipped."""

import ast
import importlib
import pathlib
import pkgutil
import sys

import qla_serve

from source_tree import ROOT, python_files
MODULES = {m.name for m in pkgutil.walk_packages(qla_serve.__path__, "qla_serve.")} | {"qla_serve"}


def _imported_module(node: ast.AST, path: pathlib.Path) -> dict[str, str]:
    """The names an import statement binds to qla_serve modules: {name: module}."""
    out = {}
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name in MODULES and a.asname:
                out[a.asname] = a.name
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            parts = path.relative_to(ROOT).with_suffix("").parts
            package = ".".join(parts[:len(parts) - node.level] + ((node.module,) if node.module else ()))
        else:
            package = node.module or ""
        for a in node.names:
            if f"{package}.{a.name}" in MODULES:
                out[a.asname or a.name] = f"{package}.{a.name}"
    return out


def _bound_names(tree: ast.AST) -> dict[str, int]:
    """How many times each name is bound by anything but an import (assignments, loops, withs,
    arguments, defs)."""
    counts: dict[str, int] = {}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names = [node.id]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        for n in names:
            counts[n] = counts.get(n, 0) + 1
    return counts


def _module_names(tree: ast.AST, path: pathlib.Path) -> tuple[dict[str, str], dict[str, str]]:
    """({name: module} for names that hold a module, {function: module} for module helpers)."""
    imported: dict[str, str] = {}
    helpers: dict[str, str] = {}
    for node in ast.walk(tree):
        imported.update(_imported_module(node, path))
        if isinstance(node, ast.FunctionDef):
            local = {}
            for inner in ast.walk(node):
                local.update(_imported_module(inner, path))
            last = node.body[-1] if node.body else None
            if isinstance(last, ast.Return) and isinstance(last.value, ast.Name) and last.value.id in local:
                helpers[node.name] = local[last.value.id]
    bound = _bound_names(tree)
    names = {n: m for n, m in imported.items() if bound.get(n, 0) == 0}
    from_helpers: dict[str, list] = {}   # mod = _mod(): every binding of the name a helper's module
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                and node.value.func.id in helpers):
            from_helpers.setdefault(node.targets[0].id, []).append(helpers[node.value.func.id])
    for name, modules in from_helpers.items():
        if len(set(modules)) == 1 and bound.get(name) == len(modules):
            names[name] = modules[0]
    return names, helpers


def _load(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:   # an engine backend without its engine here
        return None


def _module_of(v: ast.AST, names: dict[str, str], helpers: dict[str, str]) -> tuple[str, str] | None:
    """(module, how the source writes it) where expression ``v`` is a module name or helper call."""
    if isinstance(v, ast.Name) and v.id in names:
        return names[v.id], v.id
    if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in helpers and not v.args:
        return helpers[v.func.id], f"{v.func.id}()"
    return None


def _patched_attribute(node: ast.AST) -> tuple[ast.AST, str] | None:
    """(target, name) of ``setattr(target, "name", ...)`` or ``<monkeypatch>.setattr(target,
    "name", ...)`` (a switch a test or benchmark sets by name: monkeypatch raises only when it
    runs, which for the GPU tests is on the device); None for raising=False or a computed name."""
    if not (isinstance(node, ast.Call) and len(node.args) >= 2):
        return None
    f = node.func
    if not ((isinstance(f, ast.Name) and f.id == "setattr") or (isinstance(f, ast.Attribute) and f.attr == "setattr")):
        return None
    if any(k.arg == "raising" for k in node.keywords):
        return None
    name = node.args[1]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        return None
    return node.args[0], name.value


def missing_attributes(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names, helpers = _module_names(tree, path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            target, attr = node.value, node.attr
        elif (patched := _patched_attribute(node)) is not None:
            target, attr = patched
        else:
            continue
        where = _module_of(target, names, helpers)
        if where is None:
            continue
        module, shown = where
        mod = _load(module)
        if mod is not None and not hasattr(mod, attr) and f"{module}.{attr}" not in MODULES:
            found.append((node.lineno, f"{path.relative_to(ROOT)}:{node.lineno}: {shown}.{attr} ({module} has no {attr})"))
    return [line for _, line in sorted(found)]   # (ast.walk goes breadth first)


def test_no_missing_module_attributes():
    problems = [line for f in python_files() for line in missing_attributes(f)]
    assert problems == []


def test_the_check_sees_a_missing_attribute(tmp_path, monkeypatch):
    """The three forms that the prefill_api split broke, a rebound name left alone, and a switch
    set by name (monkeypatch.setattr or setattr) that the module does not have; raising=False
    (a name the caller means to add) left alone."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from qla_serve.kernels.hopper import prefill_api as P\n"
        "from qla_serve import ops\n"
        "def _mod():\n"
        "    from qla_serve.kernels.hopper import prefill_api as mod\n"
        "    return mod\n"
        "def f():\n"
        "    mod = _mod()\n"
        "    mod.PREP_PAIR\n"
        "def g():\n"
        "    mod = _mod()\n"
        "    mod.prefill()\n"
        "    _mod().prefill()\n"
        "    P.prefill()\n"
        "    P.PREP_PAIR\n"
        "    ops = object()\n"
        "    ops.not_there\n"
        "def h(monkeypatch):\n"
        "    monkeypatch.setattr(_mod(), 'FUSED', True)\n"
        "    monkeypatch.setattr(P, 'NO_SUCH_SWITCH', 1)\n"
        "    setattr(P, 'NO_SUCH_SWITCH', 1)\n"
        "    monkeypatch.setattr(P, 'NEW_NAME', 1, raising=False)\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [line.split(": ", 1)[1] for line in missing_attributes(bad)] == [
        "mod.prefill (qla_serve.kernels.hopper.prefill_api has no prefill)",
        "_mod().prefill (qla_serve.kernels.hopper.prefill_api has no prefill)",
        "P.prefill (qla_serve.kernels.hopper.prefill_api has no prefill)",
        "P.NO_SUCH_SWITCH (qla_serve.kernels.hopper.prefill_api has no NO_SUCH_SWITCH)",
        "P.NO_SUCH_SWITCH (qla_serve.kernels.hopper.prefill_api has no NO_SUCH_SWITCH)",
    ]
