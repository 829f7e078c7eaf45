"""GPU time per prefill call under sustained load, with the SM clock and power the GPU ran at.

    python benchmarks/sustained.py [--rows 16/64:64x512,16/64:4x8192,2/8:64x512] [--secs 3]

For each (heads, row): qla_serve, FlashQLA 0.1.3, then qla_serve again, each as a CUDA graph of
5 calls replayed back to back for --secs seconds while nvidia-smi samples every 100 ms. Prints
the median time per call over the first and the last tenth of the replays, and three samples
(start, middle, end) of SM clock (MHz), memory clock, power (W), temperature and the throttle
reasons (0x4: the software power cap). Why: the bench's graph time (`qla-serve bench prefill`,
median of 15-20 replays of 5 calls) read the 16/64 rows 10-25% apart from run to run while
the kernels' own sums stayed put (benchmarks/prefill.md, "v22 cost model"). A benchmark, not
a test; needs a CUDA GPU, nvidia-smi and flash_qla.
"""

import argparse
import subprocess
import time

import torch

from qla_serve.bench import prefill as bench
from qla_serve.bench.prefill import _captured


def _smi() -> subprocess.Popen:
    query = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "100"],
                            stdout=subprocess.PIPE, text=True)


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def sustained(fn, secs: float) -> dict:
    """Replay a graph of 5 calls of fn for secs seconds; per-call ms at the start and the end."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = _captured(fn, 5)
    torch.cuda.synchronize()
    smi, times, end = _smi(), [], time.time() + secs
    while time.time() < end:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 5)
    smi.terminate()
    samples = smi.stdout.read().strip().splitlines()
    tenth = max(1, len(times) // 10)
    return {"first_ms": _median(times[:tenth]), "last_ms": _median(times[-tenth:]), "replays": len(times),
            "smi": [samples[1], samples[len(samples) // 2], samples[-1]] if len(samples) > 2 else samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16/64:64x512,16/64:4x8192,2/8:64x512", help="heads:row, comma-separated")
    parser.add_argument("--secs", type=float, default=3.0)
    args = parser.parse_args()
    print("sample columns: timestamp, SM MHz, memory MHz, power W, temperature C, throttle reasons")
    for item in args.rows.split(","):
        heads, row = item.split(":")
        hk, hv = (int(x) for x in heads.split("/"))
        lens = bench.ROWS[row]
        data = bench._inputs(lens, hk, hv)
        qla, *_ = bench._qla_fn(lens, hk, hv, data, "auto")
        flashqla, _ = bench._fla_fn(lens, data, "flashqla")
        for name, fn in (("qla", qla), ("flashqla", flashqla), ("qla again", qla)):
            r = sustained(fn, args.secs)
            print(f"{heads} {row} {name}: ms/call first {r['first_ms']:.4f} last {r['last_ms']:.4f} "
                  f"({r['replays']} replays) {r['smi']}", flush=True)
            time.sleep(2)  # let the clocks recover between implementations


if __name__ == "__main__":
    main()
