"""The engines' prefill preamble: torch's L2 norm of q and k and gating (what the layers ran
before) against qla_serve.gdn_prefill_inputs (one TileLang launch), GPU and host time per call.

    python benchmarks/prefill_inputs.py        # on a CUDA machine with the TileLang kernels

Inputs as the engines pass them: q/k strided views of one fused projection (bf16), raw a, b
(bf16) and A_log fp32 beside a bf16 dt_bias (SGLang; vLLM has both in bf16). GPU time: median
over replays of a CUDA graph of 20 calls (qla_serve.bench.prefill's timer); host time: median
CPU time of an eager call (enqueue only, the queue drained every 200 calls: ops_host.py's
timer). A benchmark, not a test.
"""

import torch
from ops_host import _per_call_us  # benchmarks/ is the script's directory

import qla_serve
from qla_serve.bench.prefill import _gpu_time_ms
from qla_serve.kernels import reference

ROWS = [(2, 8, 8192), (2, 8, 32768), (4, 16, 8192), (16, 64, 8192)]


def _gpu_us(fn):
    ms, how, _ = _gpu_time_ms(fn, reps=30, graph_calls=20)
    if how != "graph":
        raise RuntimeError(f"expected a CUDA-graph timing, got {how}")
    return ms * 1e3


def _host_us(fn):
    return _per_call_us(fn, n=1000)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'heads':>6} {'tokens':>6}  {'torch GPU us':>12} {'qla GPU us':>10}  {'torch host us':>13} {'qla host us':>11}")
    for hk, hv, T in ROWS:
        fused = torch.randn(T, (2 * hk + hv) * 128, generator=gen, device="cuda").bfloat16()
        q, k = fused[:, : hk * 128].view(T, hk, 128), fused[:, hk * 128: 2 * hk * 128].view(T, hk, 128)
        ab = torch.randn(T, 2 * hv, generator=gen, device="cuda").bfloat16()
        a, b = ab[:, :hv], ab[:, hv:]
        A_log = torch.rand(hv, generator=gen, device="cuda")
        dt_bias = torch.rand(hv, generator=gen, device="cuda").bfloat16()

        def torch_way():
            reference.l2norm(q), reference.l2norm(k), reference.fused_gating(a, b, A_log, dt_bias)

        def qla_way():
            qla_serve.gdn_prefill_inputs(q, k, a, b, A_log, dt_bias)

        print(f"{hk}/{hv:<4} {T:>6}  {_gpu_us(torch_way):12.1f} {_gpu_us(qla_way):10.1f}  "
              f"{_host_us(torch_way):13.1f} {_host_us(qla_way):11.1f}", flush=True)


if __name__ == "__main__":
    main()
