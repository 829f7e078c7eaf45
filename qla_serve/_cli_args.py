"""argparse value types shared by the `qla-serve` commands (cli.py and deploy/cli.py): below
both in the import graph, so that neither imports the other for them.

Each raises argparse.ArgumentTypeError with what was expected, which argparse prints after the
option's name ("argument --seqlens: expected ...") with exit code 2.
"""

from __future__ import annotations

import argparse
import re


def parse_heads(text: str) -> tuple[int, int]:
    """``"Hk/Hv"`` (TP-local q/k heads / v heads, e.g. 2/8) -> (Hk, Hv); an argparse type."""
    try:
        hk, hv = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TP-local QK/V head counts like 2/8, got {text!r}")
    if hk <= 0 or hv <= 0 or hv % hk:
        raise argparse.ArgumentTypeError(f"expected positive counts with V a multiple of QK, got {text!r}")
    return hk, hv


def parse_seqlens(text: str) -> list[int]:
    """``"32768,8192"`` -> [32768, 8192]: the planner's rule for lengths (>= 0, at most 2**31 - 1
    tokens in all), checked here so that the message names the option."""
    from qla_serve._validate import seq_lens_problem

    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}")
    if not lens:
        raise argparse.ArgumentTypeError(f"expected one or more lengths >= 0, got {text!r}")
    problem = seq_lens_problem(lens)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return lens


def _int(text: str, minimum: int, what: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = minimum - 1
    if n < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return n


def positive_int(text: str) -> int:
    return _int(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _int(text, 0, "an integer >= 0")


def parse_strategies(text: str) -> frozenset[str]:
    """``"plain,cp"`` -> the strategies the kernels implement (plan_prefill's supported_strategies)."""
    from qla_serve._validate import ALL_STRATEGIES

    names = frozenset(s.strip() for s in text.split(",") if s.strip())
    if not names or not names <= ALL_STRATEGIES:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(sorted(ALL_STRATEGIES))}, got {text!r}")
    return names


def parse_device(text: str):
    """A device this process can use ("cpu", "cuda", "cuda:1"): torch.device."""
    from qla_serve._validate import check_device_arg

    try:
        return check_device_arg(text, name="device")
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("device: "))


_NEGATIVE_LOOKING = re.compile(r"-\d")


def join_negative_values(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``--seqlens -5,100`` -> ``--seqlens=-5,100`` for the given options: argparse takes a
    value that starts with "-" and is not a plain negative number for an option of its own and
    says "expected one argument"; joined, the value reaches the option's type, which reports
    what is actually wrong with it. Stops at "--"."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return out + argv[i:]
        if tok in options and i + 1 < len(argv) and _NEGATIVE_LOOKING.match(argv[i + 1]):
            out.append(f"{tok}={argv[i + 1]}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out
