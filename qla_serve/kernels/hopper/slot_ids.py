"""The step's slot ids in one launch: an engine's slot tensors -> the ops' int32 ids (-1 = padding).

Once per engine step (backends/gdn_layer.StepPlan.ids) the engine's state-slot tensors become
what every GDN layer's kernels take. Three kinds, the math of kernels/reference_conv.slot_ids:

* ``rows``  (decode slots, prefill checkpoint slots) [N]:  out[i] = -1 if slots[i] == null
  else slots[i];
* ``seqs``  (prefill slots) [N] with cu_seqlens [N+1]: also -1 where sequence i is empty
  (cu_seqlens[i+1] == cu_seqlens[i]: vLLM keeps trailing padded requests in the prefill slice);
* ``spec``  (spec-decode slots) [Ns, D]: also -1 for the whole row where slots[i, 0] == null
  (a padded spec row).

int64 engine ids narrow to int32 as ``Tensor.to(torch.int32)`` does (engine slot counts are far
below 2**31). One thread per output id, 256 per block; any slot strides (the engine's tensors
may be views of persistent buffers). The torch form took 2-5 small launches and ~20 us of host
time each on the H200's host; this is one launch through the raw tvm-ffi function.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
from .common import compile_for, launch_function

KINDS = ("rows", "seqs", "spec")
SLOT_DTYPES = ("int32", "int64")
THREADS = 256


def variant(kind: str, slot_dtype: str) -> dict:
    """A JSON-serialisable variant description; ``name`` identifies it."""
    if kind not in KINDS:
        raise ValueError(f"slot ids kind: expected one of {KINDS}, got {kind!r}")
    if slot_dtype not in SLOT_DTYPES:
        raise ValueError(f"slot ids dtype: expected one of {SLOT_DTYPES}, got {slot_dtype!r}")
    return {"op": "slot_ids", "kind": kind, "slot_dtype": slot_dtype, "name": f"gdn_slot_ids_{kind}_{slot_dtype}"}


def kernel_variants(num_v_heads: int, num_k_heads: int) -> list[dict]:
    """Every kind for int32 and int64 engine ids (head counts do not enter: 6 variants)."""
    return [variant(k, d) for k in KINDS for d in SLOT_DTYPES]


def _program(v: dict):
    import tilelang.language as T

    kind, sdt = v["kind"], v["slot_dtype"]
    N, D, s0, s1 = T.dynamic("N D s0 s1")
    null_t = T.int64 if sdt == "int64" else T.int32

    if kind == "spec":
        @T.prim_func
        def gdn_slot_ids(Slots: T.StridedTensor((N, D), (s0, s1), sdt), Out: T.Tensor((N, D), "int32"),
                         null: null_t):
            with T.Kernel(T.ceildiv(N * D, THREADS), threads=THREADS) as bx:
                e = bx * THREADS + T.get_thread_binding()
                if e < N * D:
                    i, j = e // D, e % D
                    if Slots[i, j] == null or Slots[i, 0] == null:
                        Out[i, j] = -1
                    else:
                        Out[i, j] = T.cast(Slots[i, j], "int32")
        return gdn_slot_ids

    if kind == "seqs":
        @T.prim_func
        def gdn_slot_ids(Slots: T.StridedTensor((N,), (s0,), sdt), Cu: T.Tensor((N + 1,), "int32"),
                         Out: T.Tensor((N,), "int32"), null: null_t):
            with T.Kernel(T.ceildiv(N, THREADS), threads=THREADS) as bx:
                i = bx * THREADS + T.get_thread_binding()
                if i < N:
                    if Slots[i] == null or Cu[i + 1] <= Cu[i]:
                        Out[i] = -1
                    else:
                        Out[i] = T.cast(Slots[i], "int32")
        return gdn_slot_ids

    @T.prim_func
    def gdn_slot_ids(Slots: T.StridedTensor((N,), (s0,), sdt), Out: T.Tensor((N,), "int32"), null: null_t):
        with T.Kernel(T.ceildiv(N, THREADS), threads=THREADS) as bx:
            i = bx * THREADS + T.get_thread_binding()
            if i < N:
                if Slots[i] == null:
                    Out[i] = -1
                else:
                    Out[i] = T.cast(Slots[i], "int32")
    return gdn_slot_ids


def build(v: dict, target: str):
    """Compile variant ``v`` for ``target`` ("sm_90a" or "sm_100a") through TileLang's cache."""
    if v.get("op") != "slot_ids":
        raise ValueError(f"variant op: expected 'slot_ids', got {v.get('op')!r}")
    variant(v["kind"], v["slot_dtype"])
    return compile_for(_program, v, target)


_FAST: dict[tuple, object] = {}


def slot_ids(slots, null_slot: int, cu_seqlens=None):
    """slots [N] (with cu_seqlens [N+1] int32: the "seqs" kind) or [Ns, D], int32/int64 on one
    CUDA device -> a new int32 tensor of their shape (layer_ops.slot_ids checked the arguments)."""
    import torch

    kind = "spec" if slots.dim() == 2 else ("seqs" if cu_seqlens is not None else "rows")
    out = torch.empty(slots.shape, dtype=torch.int32, device=slots.device)
    if slots.numel() == 0:
        return out
    key = (kind, slots.dtype, slots.device)
    fn = _FAST.get(key)
    if fn is None:
        dt = "int64" if slots.dtype == torch.int64 else "int32"
        fn = _FAST[key] = launch_function(variant(kind, dt), slots.device, build)
    if kind == "seqs":
        fn(slots, cu_seqlens, out, int(null_slot))
    else:
        fn(slots, out, int(null_slot))
    return out
