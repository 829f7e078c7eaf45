"""No Python name is used undefined in the package, the benchmarks, the scripts or the tests
(pyflakes, on the CPU). Most of qla_serve's launch code runs only on a GPU, so a name lost in a
refactor (decode.py's HEAD_DIM after its split, a04dea2: every decode/verify call with
``scale=None`` raised NameError on the H200) would otherwise first fail there.

TileLang's prim_func annotations spell dtypes as strings ("float32", v["weight_dtype"]), which
pyflakes reads as forward references: a reported name that stands quoted on its own line is one
of those and is not counted."""

import ast
import pathlib
import sys

from pyflakes import checker as pyflakes_checker   # the dev extra
from pyflakes import messages

from source_tree import ROOT, python_files


def _undefined(path: pathlib.Path) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    checker = pyflakes_checker.Checker(ast.parse(text, str(path)), str(path))
    found = []
    for m in checker.messages:
        if not isinstance(m, messages.UndefinedName):
            continue
        name, line = m.message_args[0], lines[m.lineno - 1]
        if f'"{name}"' in line or f"'{name}'" in line:   # a TileLang string annotation
            continue
        found.append(f"{path.relative_to(ROOT)}:{m.lineno}: undefined name {name!r}")
    return found


def test_no_undefined_names():
    problems = [line for f in python_files() for line in _undefined(f)]
    assert problems == []


def test_the_check_sees_an_undefined_name(tmp_path, monkeypatch):
    """The filter keeps a real undefined name and drops a quoted dtype."""
    bad = tmp_path / "bad.py"
    bad.write_text('def f(T):\n    x: T.Tensor((4,), "float32")\n    return HEAD_DIM ** -0.5\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _undefined(bad) == ["bad.py:3: undefined name 'HEAD_DIM'"]
