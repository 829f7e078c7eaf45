"""What a compiled kernel variant costs, read offline (no GPU): registers and spills (ptxas),
the dynamic shared memory its launch asks for, and, when a cuobjdump is at hand, the SASS
instruction mix of each backward-branch span (a loop body, or a stretch the compiler laid out
around one) that holds tensor-core instructions or global stores, smallest first: the first
is usually the innermost loop, e.g. stage 2's chunk walk.

    python benchmarks/kernel_report.py prep 2/8 bfloat16            # form uw; add "m" for form m
    python benchmarks/kernel_report.py prep 2/8 bfloat16 m float16  # fp16 q/k beside bf16 v
    python benchmarks/kernel_report.py main 2/8 bfloat16 float32 1 output vfirst
    python benchmarks/kernel_report.py decode 2/8 float32 bv16l32     # decode: pool dtype, tile
    python benchmarks/kernel_report.py ... --json            # one JSON object instead of text

The sixth session's offline findings came from these numbers: prep's 146 -> 119 registers and
65 -> 49 KB (4 CTAs per SM), and V-first's consumer loop, 70% O-store bounds checks
(benchmarks/prefill.md, v11-v13). They say what the code asks of the SM, not how fast it runs:
only the H200 says that.

cuobjdump is not in the CUDA toolkit this machine has; it ships with Triton (found in the
engine virtualenvs) and as the `nvidia-cuda-cuobjdump` wheel. Set CUOBJDUMP to point at one.
"""

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_variant(argv: list[str], target: str):
    """argv: "prep HK/HV IO [FORM [QK]]", "main HK/HV IO POOL V_SPLIT MODE [IMPL]", "scan HV [ROWS]",
    "warmup HV" or "decode HK/HV POOL [TILE]" (the layers' decode: bf16 q/k/v, raw gates, l2norm);
    the compiled kernel."""
    from qla_serve.kernels.hopper import prefill_api as P

    kind, heads, rest = argv[0], argv[1], argv[2:]
    if kind == "decode" and len(rest) in (1, 2):
        import importlib
        D = importlib.import_module("qla_serve.kernels.hopper.decode")
        hk, hv = (int(x) for x in heads.split("/"))
        variant = D._variant("decode", hv, hk, "bfloat16", rest[0], "ab", "bfloat16", "float32", True,
                             *rest[1:])
        return variant["name"], D.build(variant, target)
    if kind in ("scan", "warmup"):
        hv = int(heads)
        variant = P.scan_variant(hv, *map(int, rest)) if kind == "scan" else P.warmup_variant(hv)
        return variant["name"], P.build(variant, target)
    hk, hv = (int(x) for x in heads.split("/"))
    if kind == "prep" and len(rest) in (1, 2, 3):
        variant = P.prep_variant(hv, hk, *rest)
    elif kind == "main" and len(rest) in (4, 5):
        variant = P.main_variant(hv, hk, rest[0], rest[1], int(rest[2]), rest[3], *rest[4:])
    else:
        raise SystemExit("variant: expected 'prep HK/HV IO [FORM [QK]]', 'main HK/HV IO POOL V_SPLIT MODE [IMPL]', "
                         "'scan HV [ROWS]' or 'warmup HV', "
                         f"got {' '.join(argv)!r}")
    return variant["name"], P.build(variant, target)


def launch_dynamic_smem(host_src: str, threads: int) -> int | None:
    """The dynamic shared memory the TileLang host stub passes to the launch: the integer
    literal after the block dims (threads, 1, 1) among the packed launch arguments."""
    ints = [int(x) for x in re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\)", host_src)]
    for i in range(len(ints) - 3):
        if ints[i:i + 3] == [threads, 1, 1]:
            return ints[i + 3]
    return None


def ptxas(src: str, arch: str, workdir: Path) -> tuple[dict, Path]:
    """Compile the kernel source to a cubin; registers and spill bytes from ptxas -v, and whether
    ptxas serialized the kernel's wgmma (its C7515 "Potential Performance Loss" remark: e.g. an
    instruction writing a wgmma accumulator while another wgmma is in flight; prefill v30's
    first form ran its chunk walk ~1.8x slower so, on the H200)."""
    import tilelang

    tl = Path(tilelang.__file__).parent
    cu, cubin = workdir / "kernel.cu", workdir / "kernel.cubin"
    cu.write_text(src)
    cmd = ["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-O3", "--use_fast_math", "-Xptxas", "-v",
           f"-I{tl / 'src'}", f"-I{tl / '3rdparty' / 'cutlass' / 'include'}", "-DENABLE_BF16",
           "-o", str(cubin), str(cu)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stderr
    if proc.returncode != 0:
        raise RuntimeError("nvcc failed: " + " | ".join(l for l in log.splitlines() if "error" in l or "fatal" in l))
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill stores", log)
    return {"registers": int(regs[-1]), "spill_store_bytes": int(spill[-1]) if spill else 0,
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in log}, cubin


def find_cuobjdump() -> str | None:
    """$CUOBJDUMP, PATH, or the copy Triton ships in this checkout's engine virtualenvs."""
    if os.environ.get("CUOBJDUMP"):
        path = os.environ["CUOBJDUMP"]
        if not os.access(path, os.X_OK):
            raise SystemExit(f"CUOBJDUMP: expected an executable cuobjdump, got {path!r}")
        return path
    found = shutil.which("cuobjdump")
    if found:
        return found
    hits = glob.glob(str(ROOT / ".venv-*" / "lib" / "python*" / "site-packages" / "triton" / "backends" /
                         "nvidia" / "bin" / "cuobjdump"))
    return hits[0] if hits else None


def sass_loops(cubin: Path, cuobjdump: str) -> list[dict]:
    """Each backward branch's span (target .. branch) that holds HGMMA or STG: its length and
    opcode mix, smallest first."""
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    loops = []
    for i, (addr, text) in enumerate(ins):
        target = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if not target or int(target.group(1), 16) >= addr or int(target.group(1), 16) not in index:
            continue
        body = [t for _, t in ins[index[int(target.group(1), 16)]:i + 1]]
        ops = collections.Counter((t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0] for t in body)
        if ops["HGMMA"] or ops["STG"]:
            loops.append({"start": hex(int(target.group(1), 16)), "instructions": len(body),
                          "top": dict(ops.most_common(8))})
    return sorted(loops, key=lambda loop: loop["instructions"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variant", nargs="+",
                    help="prep HK/HV IO | main HK/HV IO POOL V_SPLIT MODE [IMPL] | scan HV [ROWS] | warmup HV "
                         "| decode HK/HV POOL [TILE]")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    name, kern = build_variant(args.variant, args.arch)
    src = kern.get_kernel_source()
    threads = int(re.search(r"__launch_bounds__\((\d+)", src).group(1))
    report = {"variant": name, "arch": args.arch, "threads": threads,
              "dynamic_smem_bytes": launch_dynamic_smem(kern.get_host_source(), threads)}
    with tempfile.TemporaryDirectory() as tmp:
        usage, cubin = ptxas(src, args.arch, Path(tmp))
        report.update(usage)
        tool = find_cuobjdump()
        report["loops"] = sass_loops(cubin, tool) if tool else None
    if args.json:
        print(json.dumps(report))
        return
    print(f"{name} ({args.arch}): {threads} threads, {report['registers']} registers, "
          f"{report['spill_store_bytes']} bytes spilled, {report['dynamic_smem_bytes']} bytes dynamic smem"
          + (", WGMMA SERIALIZED by ptxas (C7515)" if report["wgmma_serialized"] else ""))
    if report["loops"] is None:
        print("SASS: no cuobjdump (set CUOBJDUMP; see the module docstring)")
    for loop in report["loops"] or []:
        print(f"  span from {loop['start']}: {loop['instructions']} instructions, {loop['top']}")


if __name__ == "__main__":
    main()
