"""The engine-agnostic GDN layer: causal conv1d, gating and qla_serve's GDN ops on an engine's own
state caches, in place. No engine import here: adapters (vLLM, SGLang) turn their metadata into a
:class:`StepPlan` once per step and call :func:`gdn_layer_forward` per layer.

What one call does (the work behind vLLM's ``qwen_gdn_attention_core``), for a batch laid out as
``[decode tokens | prefill tokens]`` or, with speculative decoding, ``[spec tokens | decode
tokens | prefill tokens]`` (row views, no copies) or with spec tokens at ``spec_token_idx`` and
the rest at ``non_spec_token_idx`` (gathered); launches on the TileLang path:

* decodes (2): :func:`qla_serve.layer_ops.causal_conv_decode` (conv, window shift), then
  :func:`qla_serve.gdn_decode` on its q | k | v with the raw gates and the in-kernel L2 norm (in a
  mixed call with prefills, 1: their conv runs in the prefill conv's launch, ``MIXED_CONV``);
* prefills (1 + the core's): :func:`qla_serve.layer_ops.gdn_layer_prefill_inputs` (conv over
  the conv state, split, L2 norm, gates and the conv-state write-back, one kernel), then
  :func:`qla_serve.gdn_prefill` with the step's shared :class:`qla_serve.PrefillPlan`; with
  vLLM's align-mode checkpoints also :func:`qla_serve.layer_ops.causal_conv_checkpoints` and
  gdn_prefill's ``checkpoints`` (each prefill's state and conv window part-way, in another slot);
* spec decodes (2): :func:`qla_serve.layer_ops.causal_conv_spec` (vLLM's sliding window), then
  :func:`qla_serve.layer_ops.gdn_verify_slots`, which writes each draft token's state straight
  into its slot ``spec_slots[i, j]`` (no scratch, no scatter).

State caches (engine-owned, never copied as a whole):

* ``ssm_state`` [S, Hv, 128(V), 128(K)], fp32 or bf16; ``stride(0)`` may exceed one slot (pages).
* ``conv_state`` [S, dim, state_len] (a transposed view is fine), ``state_len >= width - 1``.
  Non-spec steps use its first ``width - 1`` columns; spec steps use it as vLLM's sliding window:
  the state before the step starts at column ``num_accepted - 1``, and after the step columns
  ``[0, width - 2 + len)`` hold the last ``width - 2`` inputs before the step and the step's
  tokens, so that the next step resumes from the last accepted token.

Slot ids equal to ``null_slot`` (vLLM's null block 0) are padding: no state (SSM or conv) of
theirs is read or written: :meth:`StepPlan.ids` maps them to -1 (the ops' padding id) on the
device, once per step. Padded spec batches (vLLM pads a spec batch to a captured graph size:
0-length rows, ``num_actual_tokens`` past the spec cu_seqlens' end) are handled in the kernels:
0-length rows do nothing, tokens past ``cu_seqlens[-1]`` are not read and their ``out`` rows are
left as they are (the adapters hand a zeroed ``out``).

Host work: :func:`make_step_plan` runs once per step with no per-token Python (the prefill plan
from the CPU lengths); :func:`gdn_layer_forward` syncs nothing and, past the first layer of a
step, neither re-derives slot ids nor re-checks argument metadata. Where it checks, it runs
every op's checks before its first launch: a refused argument writes no slot.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import NamedTuple, Sequence

import torch

import qla_serve
from qla_serve import layer_ops
from qla_serve.backends.launch_replay import LaunchReplays, launch_parts
from qla_serve.ops import _checked_key, check_decode_args, check_prefill_args
from qla_serve.plan import PrefillPlan

log = logging.getLogger("qla_serve")

HEAD_DIM = 128


# The decode step's gdn_decode launches as the programmatic dependent of its conv_decode launch
# (kernels/hopper/decode.decode's after_conv) where decodes x v-heads <= this: with few blocks
# the dependent grid's state loads overlap the conv (H200, one process: 2/8 B = 1..32 and 16/32
# B = 1 4-10% faster per layer call); with many, its early blocks sit resident at the grid sync
# (16/32 B = 256 bf16 pool 179 -> 188 us, B = 32 26.4 -> 27.5; fp32 pools level). 0: never.
# benchmarks/layer_ab.py --switch gdn_layer.DECODE_AFTER_CONV_MAX_ROWS=0,1073741824; benchmarks/layer.md.
DECODE_AFTER_CONV_MAX_ROWS = 256
# The spec step's gdn_verify_slots launches as its conv_spec launch's programmatic dependent where
# spec sequences x v-heads <= this (decode.verify_slots' after_conv), as SGLang's verify step does
# (backends/sglang/verify_layer.AFTER_CONV_MAX_ROWS, measured there). 0: never. Precompile lists
# the after_conv variants up to kernels/hopper/decode_tiles.AFTER_CONV_MAX_ROWS (both bounds here
# stay within it: tests/kernels/test_decode_compile.py).
SPEC_AFTER_CONV_MAX_ROWS = 64
# A mixed step's (decodes and prefills in one call) decode conv runs in the prefill conv's launch
# (kernels/hopper/conv.py's conv_prefill with decode CTAs: one launch fewer per mixed layer call,
# the decode's gdn_decode then a plain launch after the prefill's); False: conv_decode apart, the
# decode launched as its programmatic dependent as in decode-only steps (benchmarks/layer.md).
MIXED_CONV = True
# A step's later layers replay the launches its earlier layers recorded (backends/launch_replay.py):
# the ops' host code runs on the step's first two layers only (2/8 heads, a later layer call down
# to its launches on the CPU machine: 35 -> 19 us with one decode, 78 -> 32 with 32 decodes and
# 4 x 512; benchmarks/layer.md). False (QLA_SERVE_LAUNCH_REPLAY=0 at start-up): every layer runs it.
LAUNCH_REPLAY = os.environ.get("QLA_SERVE_LAUNCH_REPLAY", "1") != "0"


@dataclasses.dataclass(eq=False)
class StepPlan:
    """What every GDN layer of one engine step shares. Built once per step (host code).

    Token layout of the step's batch (``num_actual_tokens`` rows of the layer inputs):
      without spec decodes: [num_decode_tokens decode tokens | num_prefill_tokens prefill tokens];
      with spec decodes, both indices None: [Ts = num_spec_tokens spec tokens | Td | Tp], the
      spec tokens leading as vLLM orders a step whose spec requests come first (its batch
      reorder puts decodes first; the vLLM adapter checks its host mask); with only spec tokens
      rows past ``spec_cu_seqlens[-1]`` are padding;
      with spec decodes interleaved with the others: spec tokens at ``spec_token_idx`` ([Ts]
      device int), the others at ``non_spec_token_idx`` ([Td + Tp], decodes then prefills),
      gathered into step buffers and the outputs scattered back (4 torch ops a layer call).

    Device tensors as the engine holds them (engine slot ids, ``null_slot`` = padding):
      decode_slots [num_decodes]; prefill_slots [Np]; prefill_has_initial_state [Np] bool;
      spec_slots [Ns, D]; spec_cu_seqlens [Ns+1]; num_accepted [Ns].
    The ops take int32 ids with -1 for padding: :meth:`ids` derives them on the device the first
    time a layer of the step asks, and every later layer reuses them. Under a captured CUDA
    graph (vLLM's FULL decode graphs) that derivation is part of the graph and re-reads the
    engine's persistent buffers at each replay, which a conversion at plan time would not.
    """

    num_actual_tokens: int
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None
    prefill_plan: PrefillPlan | None = None
    prefill_slots: torch.Tensor | None = None
    prefill_has_initial_state: torch.Tensor | None = None
    num_spec_decodes: int = 0
    num_spec_tokens: int = 0
    spec_slots: torch.Tensor | None = None
    spec_cu_seqlens: torch.Tensor | None = None
    num_accepted: torch.Tensor | None = None
    spec_token_idx: torch.Tensor | None = None
    non_spec_token_idx: torch.Tensor | None = None
    prefill_checkpoint_chunks: torch.Tensor | None = None   # [Np] int32: 64-token chunks (0: none)
    prefill_checkpoint_slots: torch.Tensor | None = None    # [Np] engine ids (null_slot: none)
    null_slot: int = 0
    info: dict = dataclasses.field(default_factory=dict)   # adapter notes (logs, counters)
    _ids: dict = dataclasses.field(default_factory=dict, repr=False)
    # layer-call metadata keys (_layer_key) whose ops passed their checks in this step
    _checked: set = dataclasses.field(default_factory=set, repr=False)
    _scratch: dict = dataclasses.field(default_factory=dict, repr=False)
    _replays: LaunchReplays = dataclasses.field(default_factory=LaunchReplays, repr=False)

    @property
    def num_prefills(self) -> int:
        return 0 if self.prefill_plan is None else self.prefill_plan.num_seqs

    @property
    def num_prefill_tokens(self) -> int:
        return 0 if self.prefill_plan is None else self.prefill_plan.total_tokens

    def kinds(self) -> dict:
        """Counts for logs and tests: decodes, prefills, spec decodes (host-known only)."""
        return {"decode": self.num_decodes, "prefill": self.num_prefills, "spec": self.num_spec_decodes}

    def ids(self, kind: str) -> torch.Tensor:
        """The ops' int32 slot ids (-1 = padding) for ``kind``: "decode" [Td]; "prefill" [Np]
        (0-length rows are padding too: vLLM keeps trailing padded requests in the prefill
        slice); "spec" [Ns, D] (a row whose first slot is null is padding as a whole); "spec_conv"
        [Ns] (the conv state's slot of each spec row: its first); "prefill_checkpoint" [Np] (each
        prefill's checkpoint slot). Also "num_accepted" [Ns] and "spec_cu_seqlens" [Ns+1] as int32. Derived on the device once per step (class doc)."""
        hit = self._ids.get(kind)
        if hit is None:
            hit = self._ids[kind] = self._derive(kind)
        return hit

    def scratch(self, key, make):
        """``make()``'s result, made at the step's first GDN layer that asks for ``key`` and
        handed to every later one: intermediate buffers of a layer call (the decode and spec
        convs' outputs, the spec rows' outputs). Sharing them is safe because every layer call
        runs on one stream and consumes them before it returns control to the engine (the next
        layer's kernels that write them queue behind the ones that read them); it saves each
        later layer an allocation and the q | k | v split (~4 torch ops of host time each)."""
        hit = self._scratch.get(key)
        if hit is None:
            hit = self._scratch[key] = make()
        return hit

    def checkpoint_conv_table(self) -> tuple:
        """layer_ops.checkpoint_conv_table of the step's prefill checkpoints, derived once per
        step (every GDN layer's causal_conv_checkpoints launches over it)."""
        hit = self._ids.get("prefill_checkpoint_conv")
        if hit is None:
            hit = self._ids["prefill_checkpoint_conv"] = layer_ops.checkpoint_conv_table(
                self.ids("prefill_checkpoint"), self.prefill_checkpoint_chunks, self.prefill_plan.cu_seqlens)
        return hit

    def _derive(self, kind: str) -> torch.Tensor:
        if kind == "decode":
            return layer_ops.slot_ids(self.decode_slots, self.null_slot)
        if kind == "prefill":
            return layer_ops.slot_ids(self.prefill_slots, self.null_slot, cu_seqlens=self.prefill_plan.cu_seqlens)
        if kind == "spec":
            return layer_ops.slot_ids(self.spec_slots, self.null_slot)
        if kind == "spec_conv":
            return self.ids("spec")[:, 0].contiguous()
        if kind == "prefill_checkpoint":
            return layer_ops.slot_ids(self.prefill_checkpoint_slots, self.null_slot)
        if kind == "num_accepted":
            return self.num_accepted.to(torch.int32)
        if kind == "spec_cu_seqlens":
            return self.spec_cu_seqlens.to(torch.int32)
        raise ValueError(f"kind: expected decode, prefill, spec, spec_conv, prefill_checkpoint, "
                         f"num_accepted or spec_cu_seqlens, got {kind!r}")


def make_step_plan(*, num_actual_tokens: int, num_v_heads: int, num_k_heads: int, conv_width: int,
                   device, decode_slots=None, prefill_lens: Sequence[int] = (), prefill_slots=None,
                   prefill_has_initial_state=None, spec_slots=None, spec_cu_seqlens=None,
                   num_accepted=None, num_spec_tokens: int = 0, spec_token_idx=None,
                   non_spec_token_idx=None, null_slot: int = 0, cp: str = "auto",
                   reuse: StepPlan | None = None, prefill_checkpoint_chunks: Sequence[int] | None = None,
                   prefill_checkpoint_slots=None, prefill_plan: PrefillPlan | None = None) -> StepPlan:
    """Build the step's plan: the prefill plan from CPU ``prefill_lens``; nothing per token.

    ``num_v_heads``/``num_k_heads`` are the TP-local GDN heads. Every tensor argument is the
    engine's device tensor as described in :class:`StepPlan`; ``prefill_lens`` are host ints, one
    per row of ``prefill_slots`` (0 for padding rows). ``reuse``: a previous step's plan; its
    PrefillPlan is taken when the prefill lengths are the same. ``conv_width`` is kept for the
    adapters' signature (the conv kernels take the width from the weight).
    ``prefill_checkpoint_chunks`` (host ints, one per prefill row; 0: none) and
    ``prefill_checkpoint_slots`` (device engine ids): each prefill's state and conv window after
    64 * chunks tokens also go to that slot (gdn_prefill's checkpoints; vLLM's align-mode prefix
    caching). One small upload per step that has them.
    ``prefill_plan``: a PrefillPlan the adapter already holds for exactly these lengths and heads
    (SGLang's, made once per forward batch: backends/sglang/kernel.ExtendBatch), taken as it is.
    """
    device = torch.device(device)
    plan = None
    if prefill_slots is not None and len(prefill_lens):
        if prefill_slots.shape[0] != len(prefill_lens):
            raise ValueError(f"prefill_lens: expected one length per prefill slot "
                             f"({prefill_slots.shape[0]}), got {len(prefill_lens)}")
        if prefill_plan is not None:
            if (prefill_plan.seq_lens, prefill_plan.num_v_heads, prefill_plan.num_k_heads) \
                    != (tuple(prefill_lens), num_v_heads, num_k_heads):
                raise ValueError(f"prefill_plan: planned for lengths {prefill_plan.seq_lens[:8]} at "
                                 f"{prefill_plan.num_k_heads}/{prefill_plan.num_v_heads} heads, the step has "
                                 f"{tuple(prefill_lens)[:8]} at {num_k_heads}/{num_v_heads}")
            plan = prefill_plan
        elif reuse is not None and reuse.prefill_plan is not None \
                and reuse.prefill_plan.seq_lens == tuple(prefill_lens):
            plan = reuse.prefill_plan
        else:
            plan = qla_serve.plan_prefill(list(prefill_lens), num_v_heads, num_k_heads, device=device, cp=cp)
    num_spec = 0
    if spec_slots is not None:
        if spec_slots.dim() != 2:
            raise ValueError(f"spec_slots: expected [Ns, D] slot ids, got shape {list(spec_slots.shape)}")
        num_spec = int(spec_slots.shape[0])
        if (spec_token_idx is None) != (non_spec_token_idx is None):
            raise ValueError("spec_token_idx, non_spec_token_idx: expected both (spec decodes interleaved with "
                             "other tokens) or neither (spec tokens first, or spec tokens only), got "
                             + ("spec_token_idx alone" if non_spec_token_idx is None else "non_spec_token_idx alone"))
    ck_chunks = ck_slots = None
    if plan is not None and prefill_checkpoint_chunks is not None and any(prefill_checkpoint_chunks):
        if len(prefill_checkpoint_chunks) != plan.num_seqs or prefill_checkpoint_slots is None \
                or prefill_checkpoint_slots.shape[0] != plan.num_seqs:
            raise ValueError(f"prefill_checkpoint_chunks/slots: expected one per prefill row ({plan.num_seqs})")
        ck_chunks = torch.tensor(list(prefill_checkpoint_chunks), dtype=torch.int32).to(device, non_blocking=True)
        ck_slots = prefill_checkpoint_slots
    num_decodes = 0 if decode_slots is None else int(decode_slots.shape[0])
    others = num_decodes + (0 if plan is None else plan.total_tokens)
    if num_spec and non_spec_token_idx is not None and non_spec_token_idx.shape[0] != others:
        raise ValueError(f"non_spec_token_idx: expected one index per decode and prefill token ({others}), "
                         f"got {non_spec_token_idx.shape[0]}")
    if num_spec and others and non_spec_token_idx is None \
            and not 0 < num_spec_tokens <= num_actual_tokens - others:
        raise ValueError(f"num_spec_tokens: the spec tokens lead the step's {num_actual_tokens} tokens (no "
                         f"spec_token_idx) before its {others} decode and prefill tokens: expected 1.."
                         f"{num_actual_tokens - others}, got {num_spec_tokens}")
    return StepPlan(
        prefill_checkpoint_chunks=ck_chunks, prefill_checkpoint_slots=ck_slots,
        num_actual_tokens=num_actual_tokens,
        num_decodes=num_decodes, decode_slots=decode_slots,
        prefill_plan=plan, prefill_slots=prefill_slots if plan is not None else None,
        prefill_has_initial_state=prefill_has_initial_state if plan is not None else None,
        num_spec_decodes=num_spec, num_spec_tokens=num_spec_tokens,
        spec_slots=spec_slots if num_spec else None,
        spec_cu_seqlens=spec_cu_seqlens[: num_spec + 1] if num_spec else None,
        num_accepted=num_accepted[:num_spec] if num_spec else None,
        spec_token_idx=spec_token_idx, non_spec_token_idx=non_spec_token_idx, null_slot=null_slot)


def ensure_kernels(device, num_v_heads: int, num_k_heads: int, io_dtype: torch.dtype,
                   state_dtype: torch.dtype) -> str | None:
    """Start-up: build every TileLang kernel this layer's ops can run on ``device`` (TP-local
    heads, the model's and the SSM state's dtypes) before the first request
    (qla_serve.deploy.startup; once per process). None where no op takes the TileLang path
    (CPU, or a path forced elsewhere). Adapters call it when flashqla takes a GPU's layers."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if all(qla_serve.explain_path(op, device, io_dtype)[0] != "tilelang" for op in ("prefill", "decode", "verify")):
        return None
    from qla_serve.deploy import startup
    from qla_serve.paths import device_arch, kernel_module, unvalidated_note
    note = unvalidated_note(device)
    if note:
        log.warning(note)
    module = kernel_module(device_arch(device))
    return startup.ensure_kernels(num_v_heads, num_k_heads, target=module.ARCH,
                                  io_dtype=str(io_dtype).removeprefix("torch."),
                                  state_dtype=str(state_dtype).removeprefix("torch."))


def _split_qkv(x: torch.Tensor, num_k_heads: int, num_v_heads: int):
    """[T, 2*Hk*128 + Hv*128] (unit channel stride) -> strided views q, k [T, Hk, 128],
    v [T, Hv, 128]: one view into heads, three slices of it (4 torch ops, not 6: host time)."""
    heads = x.view(x.shape[0], 2 * num_k_heads + num_v_heads, HEAD_DIM)
    return heads[:, :num_k_heads], heads[:, num_k_heads:2 * num_k_heads], heads[:, 2 * num_k_heads:]


def _conv_out(step: StepPlan, kind: str, x: torch.Tensor, num_k_heads: int, num_v_heads: int):
    """The step's buffer for a conv's output over rows like ``x`` and its q, k, v views
    (StepPlan.scratch: one per step and kind)."""
    def make():
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return (y, *_split_qkv(y, num_k_heads, num_v_heads))
    return step.scratch((kind, tuple(x.shape), x.dtype, x.device, num_k_heads, num_v_heads), make)


def _out_rows(step: StepPlan, kind: str, rows: int, out: torch.Tensor) -> torch.Tensor:
    """The step's [rows, Hv, 128] buffer in ``out``'s dtype for outputs scattered into ``out``
    afterwards (StepPlan.scratch)."""
    shape = (rows, *out.shape[1:])
    return step.scratch((kind, shape, out.dtype, out.device),
                        lambda: torch.empty(shape, dtype=out.dtype, device=out.device))


def _gather(step: StepPlan, what: tuple, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[idx] into the step's buffer for ``what`` (rows and input: a and b have one shape), in
    StepPlan.scratch as the conv outputs: no allocation per layer call, and the same buffer for
    the launch replay."""
    shape = (idx.shape[0], *x.shape[1:])
    buf = step.scratch((*what, shape, x.dtype, x.device), lambda: torch.empty(shape, dtype=x.dtype, device=x.device))
    return torch.index_select(x, 0, idx, out=buf)


def _row_blocks(x: torch.Tensor, sizes: list) -> tuple:
    """x's consecutive row blocks of ``sizes`` rows from row 0 (rows past them dropped), as one
    torch op (split_with_sizes: a slice per block costs ~1.5x its host time)."""
    rest = x.shape[0] - sum(sizes)
    return x.split_with_sizes(sizes + [rest] if rest else sizes)[:len(sizes)]


def _rows(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """x[start:stop], or x itself where that is all of it (a slice is a torch op: ~3 us of host
    time, many per layer call of a mixed step)."""
    return x if start == 0 and stop == x.shape[0] else x[start:stop]


def _layer_key(step: StepPlan, tensors, scalars) -> tuple | None:
    """The metadata key of one layer call (every tensor's dtype, shape, strides, device and
    address modulo 16, and the non-tensor arguments): a later layer of the step with the same key hands its ops
    arguments of the same metadata as one whose ops passed their checks, so its ops skip them
    (``_trusted``: 10 tensors' metadata per call instead of the ops' 37 on a mixed step;
    benchmarks/layer.md, "Host time of one layer call"
    (full write-up: ``git show af9803e:benchmarks/layer.md``)). None (checks on
    every call) where the step's slot ids are on the CPU or QLA_SERVE_DEBUG=1 (ops._checked_key)."""
    index = [x for x in (step.decode_slots, step.prefill_slots, step.spec_slots) if x is not None]
    key = _checked_key(("gdn_layer", *scalars), tensors, index)
    return key if key is not None and index else None


class _Layer(NamedTuple):
    """One layer call's arguments that every op of the call shares."""
    conv_state: torch.Tensor
    ssm_state: torch.Tensor
    num_k_heads: int
    num_v_heads: int
    scale: float | None
    conv: dict      # conv_weight, conv_bias, activation
    gates: dict     # A_log, dt_bias


class _Rows(NamedTuple):
    """One layer call's rows per kind, (x, a, b, out) each (views, or gathers where spec and
    other tokens interleave), None where the step has none; and the buffer whose rows go back
    into ``out`` at the end with the step's index for them (``scatter``: (rows, int64 index)), or
    None."""
    spec: tuple | None
    decode: tuple | None
    prefill: tuple | None
    scatter: tuple | None

    def flat(self) -> tuple:
        """Every row tensor in a fixed order (the launch replay's sources past the inputs)."""
        return (*(self.spec or (None,) * 4), *(self.decode or (None,) * 4), *(self.prefill or (None,) * 4),
                self.scatter[0] if self.scatter else None)


# A gathered row block of a and b ([rows, Hv]) starts at a multiple of this many rows of its
# buffer: 16-byte aligned for any Hv and dtype, as a buffer of its own is.
_GATE_ROWS_ALIGN = 8


def _interleaved_rows(step: StepPlan, x, a, b, out):
    """The rows of a step whose spec tokens (``spec_token_idx``) and other tokens
    (``non_spec_token_idx``) interleave: ((x, a, b, out) of the spec tokens, the same of the
    others, the scatter). One gather per input over both indices into a step buffer whose two
    row blocks are the two kinds' rows (views made once per step), and one scatter of both
    kinds' outputs: 4 torch ops a layer call instead of 8. vLLM 0.33 makes the two indices from
    one argsort of its spec-token mask (gdn_attn.py), so they are disjoint and together a
    permutation of the step's tokens, and the one scatter writes each row once."""
    spec_idx, other_idx = step.spec_token_idx, step.non_spec_token_idx
    Ts, To = spec_idx.shape[0], other_idx.shape[0]
    pad = -Ts % _GATE_ROWS_ALIGN

    def make_index():
        both = torch.cat([spec_idx, other_idx])
        # a and b: the other rows' block starts at an aligned row; the rows between repeat a
        # spec token (read, never used)
        gates = torch.cat([spec_idx, spec_idx[-1:].expand(pad), other_idx]) if pad else both
        return both, gates, both.long()
    both, gates, scatter_idx = step.scratch(("interleaved", "index"), make_index)
    blocks = []
    for name, t, idx, skip in (("x", x, both, 0), ("a", a, gates, pad), ("b", b, gates, pad)):
        buf = _gather(step, ("interleaved_rows", name), t, idx)
        blocks.append(step.scratch(("interleaved_blocks", name, buf.shape, buf.dtype),
                                   lambda: buf.split_with_sizes([Ts, skip, To])[::2]))
    out_rows = _out_rows(step, "interleaved_out", Ts + To, out)
    out_spec, out_other = step.scratch(("interleaved_blocks", "out", out_rows.shape, out_rows.dtype),
                                       lambda: out_rows.split_with_sizes([Ts, To]))
    (xs, xo), (as_, ao), (bs, bo) = blocks
    return (xs, as_, bs, out_spec), (xo, ao, bo, out_other), (out_rows, scatter_idx)


def _leading_spec_rows(step: StepPlan, x, a, b, out):
    """The rows of a step whose spec tokens lead ([Ts | Td | Tp], StepPlan's doc): ((x, a, b,
    out) of the spec tokens, the same of the decode, of the prefill tokens (None where none)),
    row views made by one split per tensor: no gather, no scatter."""
    Td, Tp = step.num_decodes, step.num_prefill_tokens
    sizes = [n for n in (step.num_spec_tokens, Td, Tp) if n]
    blocks = iter(zip(*(_row_blocks(t, sizes) for t in (x, a, b, out))))
    return next(blocks), (next(blocks) if Td else None), (next(blocks) if Tp else None)


def _call_rows(step: StepPlan, mixed_qkv, a, b, out) -> _Rows:
    """The call's rows: [decodes | prefills], or with spec decodes [spec | decodes | prefills]
    views, or the spec tokens and the others gathered by ``spec_token_idx`` /
    ``non_spec_token_idx`` (StepPlan's doc)."""
    T, Td, Tp = step.num_actual_tokens, step.num_decodes, step.num_prefill_tokens
    others = Td + Tp > 0
    if step.num_spec_decodes and others and step.spec_token_idx is None:
        return _Rows(*_leading_spec_rows(step, mixed_qkv, a, b, out), None)
    spec = scatter = None
    xn, an, bn, out_n = mixed_qkv, a, b, out
    if step.num_spec_decodes:
        x, a, b = _rows(mixed_qkv, 0, T), _rows(a, 0, T), _rows(b, 0, T)
        idx = step.spec_token_idx
        if idx is None:
            spec = (x, a, b, _rows(out, 0, T))
        elif others:
            spec, (xn, an, bn, out_n), scatter = _interleaved_rows(step, x, a, b, out)
        else:
            spec_out = _out_rows(step, "spec_out", idx.shape[0], out)
            spec = (*(_gather(step, ("spec_rows", name), t, idx) for name, t in zip("xab", (x, a, b))), spec_out)
            scatter = (spec_out, _int64(step, "spec_token_idx"))
        if not others:
            Td = Tp = 0
    if Td and Tp:
        (xd, xp), (ad, ap), (bd, bp), (od, op) = (_row_blocks(t, [Td, Tp]) for t in (xn, an, bn, out_n))
        decode, prefill = (xd, ad, bd, od), (xp, ap, bp, op)
    else:
        decode = tuple(_rows(t, 0, Td) for t in (xn, an, bn, out_n)) if Td else None
        prefill = tuple(_rows(t, 0, Tp) for t in (xn, an, bn, out_n)) if Tp else None
    return _Rows(spec, decode, prefill, scatter)


def gdn_layer_forward(step: StepPlan, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                      conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, activation,
                      conv_state: torch.Tensor, ssm_state: torch.Tensor, A_log: torch.Tensor,
                      dt_bias: torch.Tensor, num_k_heads: int, out: torch.Tensor,
                      scale: float | None = None, on_call=None) -> None:
    """Run one GDN layer's core for the step, writing ``out`` rows of every live token.

    Args:
        step: this step's :class:`StepPlan` (shared by every GDN layer).
        mixed_qkv: [>= T, 2*Hk*128 + Hv*128] projected q|k|v before the conv (rows past T: padding).
        a, b: [>= T, Hv] raw gating inputs (decay and write-strength logits).
        conv_weight: [dim, W]; conv_bias: [dim] or None; activation: "silu" or None.
        conv_state: [S, dim, state_len] view of the engine's conv cache (written in place).
        ssm_state: [S, Hv, 128, 128] fp32/bf16 view of the engine's state cache (written in place).
        A_log, dt_bias: [Hv]. num_k_heads: TP-local Hk.
        out: [>= T, Hv, 128] in mixed_qkv's dtype; rows of padding tokens are left as they are.
        on_call: optional callback(kind, count) for instrumentation ("decode", "prefill", "spec").

    Every op's arguments are checked before the call's first launch (on the step's first layer,
    and on a later one whose metadata differs), so an argument refused by any op leaves every
    conv and SSM state slot as it was. Later layers whose metadata passed replay the launches
    the step's earlier layers recorded (launch_replay.py; ``LAUNCH_REPLAY``).
    """
    if step.num_actual_tokens == 0:
        return
    tensors = (mixed_qkv, a, b, conv_weight, conv_bias, conv_state, ssm_state, A_log, dt_bias, out)
    key = _layer_key(step, tensors, (activation, scale, num_k_heads))
    rows = _call_rows(step, mixed_qkv, a, b, out)
    checks = key not in step._checked

    def build():
        layer = _Layer(conv_state, ssm_state, num_k_heads, ssm_state.shape[1], scale,
                       dict(conv_weight=conv_weight, conv_bias=conv_bias, activation=activation),
                       dict(A_log=A_log, dt_bias=dt_bias))
        return _parts(step, layer, rows, checks)

    if key is None or not LAUNCH_REPLAY:
        launch_parts(build(), on_call)
    elif checks:
        # The checks, and the step's slot ids and buffers made for its first layer, run outside
        # the record: the launches that follow are the key's first recording.
        parts = build()
        step._replays.run(key, tensors, tensors + rows.flat(), lambda: parts, on_call)
    else:
        step._replays.run(key, tensors, tensors + rows.flat(), build, on_call)
    if checks and key is not None:
        step._checked.add(key)
    if rows.scatter is not None:
        out.index_copy_(0, rows.scatter[1], rows.scatter[0])


def _int64(step: StepPlan, name: str) -> torch.Tensor:
    """The step's token index ``name`` as int64 (what index_copy_ takes), converted once per step
    (StepPlan.scratch) instead of once per layer call."""
    return step.scratch(("int64", name), lambda: getattr(step, name).long())


def _parts(step: StepPlan, layer: _Layer, rows: _Rows, checks: bool) -> list:
    """The call's (kind, count, launch) in launch order; every op's checks (``checks``) ran
    while they were built. A mixed call's decode conv runs in the prefill conv's launch
    (MIXED_CONV): the prefills first, then the decodes' gdn_decode on that conv's output."""
    parts = []
    if rows.spec:
        parts.append(("spec", step.num_spec_decodes, _spec_ops(step, layer, *rows.spec, checks)))
    one_conv = bool(rows.decode and rows.prefill and MIXED_CONV)
    decode = prefill = ()
    if rows.decode:
        launch, conv_rows = _decode_ops(step, layer, *rows.decode, checks, conv_apart=not one_conv)
        decode = (("decode", step.num_decodes, launch),)
    if rows.prefill:
        prefill = (("prefill", step.num_prefills,
                    _prefill_ops(step, layer, *rows.prefill, checks, decodes=conv_rows if one_conv else None)),)
    return parts + list(prefill + decode if one_conv else decode + prefill)


def _spec_ops(step: StepPlan, layer: _Layer, x, a, b, out, checks: bool):
    """The launch of the step's spec decodes (x, a, b, out: their rows, :func:`_call_rows`):
    their conv over vLLM's sliding window, then the verify into per-token slots. ``checks``:
    their ops' checks run here, before any launch, on the arguments the launch takes."""
    conv_state, ssm_state, Hk, Hv, scale, conv, gates = layer
    ids, acc, cu, conv_ids = step.ids("spec"), step.ids("num_accepted"), step.ids("spec_cu_seqlens"), step.ids("spec_conv")
    draft = ids.shape[1]
    y, q, k, v = _conv_out(step, "spec_conv_out", x, Hk, Hv)
    if checks:
        layer_ops.check_conv_spec_args(x, conv_state, conv_ids, acc, cu, num_v_heads=Hv, draft=draft, out=y, **conv)
        layer_ops.check_verify_slots_args(q, k, v, ssm_state, ids, acc, cu, a=a, b=b, use_qk_l2norm=True,
                                          scale=scale, out=out, **gates)

    def launch():
        layer_ops.causal_conv_spec(x, conv_state, conv_ids, acc, cu, num_v_heads=Hv, draft=draft, out=y,
                                   _trusted=True, **conv)
        layer_ops.gdn_verify_slots(q, k, v, ssm_state, ids, acc, cu, a=a, b=b, use_qk_l2norm=True, scale=scale,
                                   out=out, _trusted=True, _after_conv=ids.shape[0] * Hv <= SPEC_AFTER_CONV_MAX_ROWS,
                                   **gates)
    return launch


def _decode_ops(step: StepPlan, layer: _Layer, x, a, b, out, checks: bool, conv_apart: bool = True):
    """The launch of the step's decodes (x, a, b, out: their rows): the conv with its window
    shift, then gdn_decode on its q | k | v with the raw gates and the in-kernel L2 norm; and the
    conv's rows (x, ids, y). ``conv_apart`` False: the launch is gdn_decode alone, the conv
    running in the prefill conv's launch before it (MIXED_CONV). ``checks``: as
    :func:`_spec_ops`'."""
    conv_state, ssm_state, Hk, Hv, scale, conv, gates = layer
    ids = step.ids("decode")
    y, q, k, v = _conv_out(step, "decode_conv_out", x, Hk, Hv)
    if checks:
        layer_ops.check_conv_decode_args(x, conv_state, ids, num_v_heads=Hv, out=y, **conv)
        check_decode_args(q, k, v, ssm_state, ids, a=a, b=b, use_qk_l2norm=True, scale=scale, out=out, **gates)

    def launch():
        if conv_apart:
            layer_ops.causal_conv_decode(x, conv_state, ids, num_v_heads=Hv, out=y, _trusted=True, **conv)
        after_conv = conv_apart and x.shape[0] * Hv <= DECODE_AFTER_CONV_MAX_ROWS
        qla_serve.gdn_decode(q, k, v, ssm_state, ids, a=a, b=b, use_qk_l2norm=True, scale=scale, out=out,
                             _trusted=True, _after_conv=after_conv, **gates)
    return launch, (x, ids, y)


def _prefill_ops(step: StepPlan, layer: _Layer, x, a, b, out, checks: bool, decodes=None):
    """The launch of the step's prefills (x, a, b, out: their rows): with checkpoints their
    conv windows, then the conv with the conv-state write-back, split, L2 norm and gates into the
    step's buffers (with ``decodes``, the decode conv's rows from :func:`_decode_ops`, in the
    same launch), then gdn_prefill with the step's plan. ``checks``: as :func:`_spec_ops`'."""
    conv_state, ssm_state, Hk, Hv, scale, conv, gates = layer
    plan, ids, has_init = step.prefill_plan, step.ids("prefill"), step.prefill_has_initial_state
    buffers = layer_ops.prefill_step_buffers(x, plan, num_k_heads=Hk)
    q, k, v, g, beta = buffers
    ck = None
    if step.prefill_checkpoint_chunks is not None:
        ck = (step.prefill_checkpoint_chunks, step.ids("prefill_checkpoint"))
        width = conv["conv_weight"].shape[1]
        table = step.checkpoint_conv_table()
    if checks:
        if ck is not None:
            layer_ops.check_conv_checkpoints_args(x, conv_state, ck[1], ck[0], plan.cu_seqlens, width=width)
        layer_ops.check_layer_prefill_args(x, a, b, conv_state, ids, plan, has_initial_state=has_init,
                                           num_k_heads=Hk, qk_dtype=q.dtype, **conv, **gates)
        check_prefill_args(q, k, v, g, beta, ssm_state, ids, plan, has_initial_state=has_init, scale=scale, out=out,
                           checkpoints=ck)

    def launch():
        if ck is not None:
            layer_ops.causal_conv_checkpoints(x, conv_state, ck[1], ck[0], plan.cu_seqlens, width=width,
                                              num_v_heads=Hv, table=table, _trusted=True)
        layer_ops.gdn_layer_prefill_inputs(x, a, b, conv_state, ids, plan, has_initial_state=has_init, num_k_heads=Hk,
                                           qk_dtype=q.dtype, _trusted=True, _outputs=buffers, _decodes=decodes,
                                           **conv, **gates)
        qla_serve.gdn_prefill(q, k, v, g, beta, ssm_state, ids, plan, has_initial_state=has_init, scale=scale,
                              out=out, checkpoints=ck, _trusted=True)
    return launch
