"""benchmarks/program_digest.py: the program digests that show a kernel refactor is a no-op
without a GPU. Real TileLang programs (built, not compiled)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tilelang")
TOOL = Path(__file__).resolve().parent.parent / "benchmarks" / "program_digest.py"
LINE = re.compile(r"^sm_90a gdn_commit_hv\d+_\S+ [0-9a-f]{64}$")


def _digests(*args) -> list[str]:
    out = subprocess.run([sys.executable, str(TOOL), "--match", "gdn_commit", *args],
                         capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.splitlines()


def test_digests_are_stable_and_tell_programs_apart(tmp_path):
    first = _digests("--heads", "2/8", "--dump", str(tmp_path))
    assert first and all(LINE.match(line) for line in first), first
    assert _digests("--heads", "2/8") == first              # same tree, same programs
    other = _digests("--heads", "4/16")                      # other heads, other programs
    assert len(other) == len(first)
    assert not {line.split()[2] for line in first} & {line.split()[2] for line in other}
    assert len(list((tmp_path / "sm_90a").glob("*.tir"))) == len(first)
