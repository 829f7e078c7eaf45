"""The repository's Python sources that the source checks read (test_undefined_names.py,
test_module_attributes.py): the package, the benchmarks, the scripts, the tests, docker."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
TREES = ("qla_serve", "benchmarks", "scripts", "tests", "docker")


def python_files() -> list[pathlib.Path]:
    files = sorted(p for tree in TREES if (ROOT / tree).is_dir() for p in (ROOT / tree).rglob("*.py"))
    assert len(files) > 50, f"only {len(files)} Python files under {ROOT}: the wrong root?"
    return files
