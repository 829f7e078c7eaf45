"""What the Hopper kernel modules share (decode.py, conv.py, prefill_inputs.py, prefill_api.py,
slot_ids.py): the head dim and dtype names of the kernel-module contract, the gate formulas as TIR
expressions, the fast-math device helpers (conv_prefill.py, prefill_prep.py), and the one compile
and launch path (TileLang's disk cache with an explicit target, then the raw tvm-ffi function:
raw_launch.py).
"""

import functools
import threading

import torch

from qla_serve.launch_record import recordable

from .raw_launch import raw_function

HEAD_DIM = 128

_TORCH_TO_TL = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_IO_DTYPES = ("bfloat16", "float16")
_GATE_DTYPES = ("float32", "bfloat16", "float16")
_TARGETS = ("sm_90a", "sm_100a")

# Device helpers for kernels that T.import_source them (conv_prefill.py's SiLU, prefill_prep.py's
# mma solve, csrc/block_solve.cuh): ex2 and tanh as single approximate instructions.
FAST_MATH_SOURCE = r"""
__device__ __forceinline__ float qla_ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float qla_tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""

# Pass configs: the safe-memory pass would guard every pool access with `slot < S` (slot ids
# are data), which both costs a compare per load and defeats vectorisation; ops.py validated
# the ids (host-side metadata only) and the contract makes ids < S the caller's duty.
_PASS_CONFIGS = {"tl.disable_safe_memory_legalize": True}


def log_decay(T, a, A_log, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias) as a TIR expression in fp32 (torch's softplus:
    x itself above 20); shared by prefill_inputs.py and the layer's conv prefill (conv.py)."""
    x = T.cast(a, "float32") + T.cast(dt_bias, "float32")
    return -T.exp(T.cast(A_log, "float32")) * T.if_then_else(x > 20.0, x, T.log1p(T.exp(x)))


def sigmoid(T, b):
    """beta = sigmoid(b) as a TIR expression in fp32."""
    return 1.0 / (1.0 + T.exp(-T.cast(b, "float32")))


def _check_heads(hv: int, hk: int) -> None:
    if not (isinstance(hv, int) and isinstance(hk, int) and hk > 0 and hv > 0 and hv % hk == 0):
        raise ValueError(f"num_v_heads/num_k_heads: expected positive ints with num_v_heads % "
                         f"num_k_heads == 0, got {hv}/{hk}")


def compile_for(make_program, variant: dict, target: str, pass_configs: dict | None = None):
    """Compile ``make_program(variant)`` for ``target`` ("sm_90a" or "sm_100a") through
    TileLang's cache: the build() of decode.py, prefill_inputs.py, conv.py and slot_ids.py. The
    target is checked before the program is built (a bad target fails fast); the explicit target
    (never "auto") makes a cache filled on a GPU-less machine (TILELANG_CACHE_DIR) a hit on the GPU.
    ``pass_configs``: TileLang pass settings on top of the package's. Returns the JITKernel."""
    import tilelang

    if target not in _TARGETS:
        raise ValueError(f"target: expected one of {_TARGETS}, got {target!r}")
    return tilelang.compile(make_program(variant), target={"kind": "cuda", "arch": target}, execution_backend="tvm_ffi",
                            pass_configs={**_PASS_CONFIGS, **(pass_configs or {})})


_ARCH: dict[int, str] = {}
_BUILD_LOCK = threading.Lock()


def _device_target(idx: int) -> str:
    arch = _ARCH.get(idx)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(idx)
        if major == 9:
            arch = "sm_90a"
        elif major == 10:
            arch = "sm_100a"
        else:
            raise ValueError(f"device: qla_serve decode kernels target sm_90a / sm_100a, got "
                             f"compute capability {major}.{minor} on cuda:{idx}")
        _ARCH[idx] = arch
    return arch


def _dtype_name(dt: torch.dtype, what: str, allowed: tuple[str, ...]) -> str:
    name = _TORCH_TO_TL.get(dt)
    if name not in allowed:
        raise TypeError(f"{what}: expected dtype in {allowed}, got {dt}")
    return name


def gate_dtype_names(a, b, A_log, dt_bias) -> tuple[str, str, str]:
    """The dtype names of raw gates (a/b, A_log, dt_bias: each in its own dtype, b in a's),
    checked against what the kernels take; shared with prefill_inputs.py."""
    ab = _dtype_name(a.dtype, "a", _GATE_DTYPES)
    param = _dtype_name(A_log.dtype, "A_log", _GATE_DTYPES)
    bias = _dtype_name(dt_bias.dtype, "dt_bias", _GATE_DTYPES)
    if b.dtype != a.dtype:
        raise TypeError(f"b: expected the dtype of a ({a.dtype}), got {b.dtype}")
    return ab, param, bias


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The device's SM count (launch sizing in prefill_api's CP scan and conv_prefill), looked up
    once per device; 132 (the H200's) for a non-CUDA device (the launch-recording tests)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def launch_function(variant: dict, device: torch.device, build_fn, name: str | None = None):
    """Compile or load ``variant`` with ``build_fn`` (TileLang disk cache, the explicit target of
    ``device``) under the build lock; its raw tvm-ffi launch function (raw_launch.py)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _BUILD_LOCK:
        kernel = build_fn(variant, _device_target(idx))
    return recordable(raw_function(kernel, name or variant["name"]))


def check_pool_alignment(pool) -> None:
    """A pool slot's state moves in 16-byte vectors here (8-byte pairs in prefill's V-first stage
    2): a 16-byte aligned base and a slot stride of whole vectors, true for every engine pool.
    Host metadata only; prefill_api checks the same rule."""
    vec = 16 // pool.element_size()
    if pool.stride(0) % vec or pool.data_ptr() % 16:
        raise ValueError(f"pool: expected a 16-byte aligned base and a slot stride (stride(0)) that is a "
                         f"multiple of {vec} elements, got stride(0) {pool.stride(0)}")
