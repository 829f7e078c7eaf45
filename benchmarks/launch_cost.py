"""The floor of a launch's host time: a tvm-ffi no-op call with N CUDA torch tensors (the
argument conversion every TileLang launch pays), torch's own smallest launch, and a 3-argument
TileLang kernel (slot_ids "rows") through its raw host function.

    python benchmarks/launch_cost.py     # on a GPU, with the slot_ids kernels cached

Enqueue time only (the queue is drained between rounds); median over rounds (ops_host.py's). A benchmark, not a
test. Figures: data/launch_cost_h200.txt, benchmarks/layer.md ("Host time of one layer call";
full write-up: `git show af9803e:benchmarks/layer.md`).
"""
import importlib

import torch
import tvm_ffi
import tvm_ffi.testing  # noqa: F401  (registers testing.nop)

from ops_host import _per_call_us   # (this script's directory is on sys.path)

S = importlib.import_module("qla_serve.kernels.hopper.slot_ids")   # the package exports a function of that name

nop = tvm_ffi.get_global_func("testing.nop")
dev = "cuda"
ts = [torch.empty(64, 8, 128, device=dev) for _ in range(14)]


def bench(f, calls=20000):
    """Enqueue time per call, us: ops_host.py's median over rounds of calls // 7 calls, the queue
    drained between rounds."""
    return _per_call_us(f, n=calls, drain=calls // 7)


print(f"nop()                 {bench(lambda: nop()):.2f} us")
print(f"nop(3 ints)           {bench(lambda: nop(1, 2, 3)):.2f} us")
for k in (1, 3, 10, 14):
    print(f"nop({k} cuda tensors)  {bench(lambda: nop(*ts[:k])):.2f} us")
x = torch.zeros(1, device=dev)
print(f"torch x.zero_() (1 launch)  {bench(lambda: x.zero_(), 5000):.2f} us")
print(f"torch.empty(1) cuda         {bench(lambda: torch.empty(1, device=dev), 5000):.2f} us")
slots = torch.arange(8, dtype=torch.int32, device=dev)
out = torch.empty_like(slots)
S.slot_ids(slots, 0)
fn = S._FAST[("rows", torch.int32, slots.device)]
print(f"TileLang slot_ids rows raw launch (2 tensors, 1 int)  {bench(lambda: fn(slots, out, 0), 5000):.2f} us")
print(f"same through slot_ids() (+ torch.empty)             {bench(lambda: S.slot_ids(slots, 0), 5000):.2f} us")
