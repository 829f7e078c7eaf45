"""SGLang 0.5.23 linear-attention kernel backed by qla_serve's ops.

:class:`FlashQLAGDNKernel` implements SGLang's ``LinearAttnKernelBase``
(``sglang/srt/layers/attention/linear/kernels/kernel_backend.py``) for Gated DeltaNet. The
GDN backend (``GDNAttnBackend``) has already run the causal conv and split the projection; it
hands the kernel q/k/v, the gates and the layer's slice of the state pool.

What SGLang passes (checked against the installed wheel by tests/backends/sglang):

* ``ssm_states``: this layer's pool ``[size+1, Hv, V=128, K=128]`` fp32 (default) or bf16
  (``--mamba-ssm-dtype bfloat16``), V-first like qla_serve's pool. Slot 0 is SGLang's
  reserved padding slot: eager padded rows carry it, and it never holds a request
  (``HybridReqToTokenPool.free_slots`` starts at 1). CUDA-graph padded rows carry -1.
* ``cache_indices``: ``[B]`` int32 slot per request. Here both 0 and -1 become qla_serve's
  padding id -1 (:func:`_slots`): zero output, slot neither read nor written. This keeps two
  padded rows from racing on slot 0 and keeps the duplicate-slot check meaningful.
* decode: ``q, k [1, B, Hk, 128]``, ``v [1, B, Hv, 128]`` — strided views of the conv output,
  not L2-normalised — and raw gates ``a, b [B, Hv]`` with the layer's ``A_log, dt_bias [Hv]``.
  Returns ``[1, B, Hv, 128]``. Runs under CUDA-graph capture: no host sync, fixed shapes.
* extend: ``q, k [1, T, Hk, 128]``, ``v [1, T, Hv, 128]`` (not normalised), ``g, beta [1, T, Hv]``
  fp32 (log-space decay, SGLang's ``fused_gdn_gating``), ``query_start_loc [N+1]`` int32 device.
  Every live slot is read as the initial state (SGLang zeroes a new request's slot before its
  first extend) and overwritten with the final state. Returns ``(o [1, T, Hv, 128], None, None)``.
  SGLang's Triton kernel also returns ``h`` (the state before every 64-token chunk), which only
  the extra_buffer radix cache reads, and only at one chunk boundary per tracked request; this
  kernel declares ``supports_track_state_snapshot`` instead and fills SGLang's fp32
  ``track_state [N, Hv, V, K]`` at ``track_chunk_idx`` (see :class:`TrackSplit`).
* target_verify: q/k/v ``[1, T, *, 128]`` packed by ``query_start_loc`` (draft_token_num per
  request), raw a/b, ``intermediate_states_buffer [S', D, Hv, 128, 128]`` with
  ``intermediate_state_indices [N]``; the state after draft token j of request i goes to
  ``buffer[ids[i], j]`` and the main slot is left for SGLang to commit. Linear chains only:
  SGLang routes tree drafts (``retrieve_parent_token``) to its Triton kernel, and the plugin
  refuses ``--speculative-eagle-topk > 1`` with a flashqla verify backend at start-up.

The prefill plan (:func:`qla_serve.plan_prefill`) is built once per forward batch from host
lengths where SGLang builds its metadata (see :mod:`.plugin`), attached to the metadata object
and handed to this kernel with :meth:`bind_batch`; every GDN layer of the step reuses it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

import qla_serve
from qla_serve import layer_ops
from qla_serve.plan import cp_from_env

log = logging.getLogger("qla_serve.sglang")

try:  # SGLang's base class when SGLang is installed (always so under the plugin)
    from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase
    HAVE_SGLANG = True
except ImportError:
    # Without SGLang the class still works on SGLang-shaped tensors: the GPU tests run it on a
    # machine that has qla_serve's kernels but no SGLang. The plugin never gets here.
    LinearAttnKernelBase = object
    HAVE_SGLANG = False

HEAD_DIM = 128


def _slots(cache_indices: torch.Tensor) -> torch.Tensor:
    """SGLang slot ids -> qla_serve slot ids (int32): the padding slot 0 and -1 both become -1.

    layer_ops.slot_ids with null slot 0: one launch on the TileLang path (torch.where and a fill
    were three), no sync, capturable in a CUDA graph.
    """
    return layer_ops.slot_ids(cache_indices, 0)


def _tokens(x: torch.Tensor, name: str) -> torch.Tensor:
    """[1, T, H, D] or [T, H, D] -> a [T, H, D] view (no copy; strides kept)."""
    if x.dim() == 4:
        if x.shape[0] != 1:
            raise ValueError(f"{name}: expected a leading batch dim of 1 ([1, T, H, {HEAD_DIM}]), "
                             f"got shape {list(x.shape)}")
        return x[0]
    if x.dim() == 3:
        return x
    raise ValueError(f"{name}: expected [1, T, H, {HEAD_DIM}] or [T, H, {HEAD_DIM}], got shape {list(x.shape)}")


def _gate2d(x: torch.Tensor, name: str, T: int) -> torch.Tensor:
    """[1, T, Hv] or [T, Hv] -> [T, Hv]."""
    if x.dim() == 3 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 2 or x.shape[0] != T:
        raise ValueError(f"{name}: expected [{T}, Hv] or [1, {T}, Hv], got shape {list(x.shape)}")
    return x


@dataclass(eq=False)
class ExtendBatch:
    """What one extend forward batch shares across its GDN layers (built on the host).

    query_start_loc: SGLang's device tensor this batch was planned for (identity-matched).
    seq_lens: host lengths, one per request (``extend_seq_lens_cpu``).
    num_tokens: sum of the lengths (tokens past it are SGLang's physical padding).
    cp: the cp mode for the planner.
    plan: the PrefillPlan, built by the first layer that runs (it needs the TP-local heads).
    track_chunks: extra_buffer prefix tracking, per request: snapshot the state after this many
        ``chunk_size``-token chunks of the extend (-1: no snapshot); None when not tracking.
    split: the two-pass layout for tracked batches (:class:`TrackSplit`), built on first use.
    step: the StepPlan of the extend step with its conv taken over (extend_layer.py), built by
        the first GDN layer that runs it.
    """

    query_start_loc: torch.Tensor
    seq_lens: tuple
    num_tokens: int
    cp: str = "auto"
    plan: "qla_serve.plan.PrefillPlan | None" = None
    track_chunks: tuple | None = None
    chunk_size: int = 64
    split: "TrackSplit | None" = None
    step: object = None

    def split_for(self, num_v_heads: int, num_k_heads: int) -> "TrackSplit":
        sp = self.split
        if sp is None or (sp.head_plan.num_v_heads, sp.head_plan.num_k_heads) != (num_v_heads, num_k_heads):
            sp = self.split = TrackSplit.build(self, num_v_heads, num_k_heads)
        return sp

    def plan_for(self, num_v_heads: int, num_k_heads: int):
        p = self.plan
        if p is None or (p.num_v_heads, p.num_k_heads) != (num_v_heads, num_k_heads):
            p = self.plan = qla_serve.plan_prefill(list(self.seq_lens), num_v_heads, num_k_heads,
                                                   device=self.query_start_loc.device, cp=self.cp)
        return p


@dataclass(eq=False)
class TrackSplit:
    """Two prefill passes that stop each tracked request at its snapshot boundary.

    Request i is cut at b_i = track_chunks[i] * chunk_size tokens (its length when untracked):
    the head pass runs tokens [0, b_i) of every request and leaves each slot at its boundary
    state, where the snapshot is copied; the tail pass continues from the slot over the rest.
    Tokens are gathered per pass (head_idx / tail_idx into the packed batch), so no token is
    computed twice. All of it is built on the host from lengths, once per batch.
    """

    head_idx: torch.Tensor        # [sum b_i] int64 token positions
    tail_idx: torch.Tensor        # [n - sum b_i]
    head_plan: "qla_serve.plan.PrefillPlan"
    tail_plan: "qla_serve.plan.PrefillPlan"
    tail_live: torch.Tensor       # [N] bool: the request has tokens after its boundary
    snap_rows: torch.Tensor       # [R] int64 rows that take a snapshot
    num_head: int = 0             # host token counts: an empty pass is skipped
    num_tail: int = 0

    @staticmethod
    def build(batch: "ExtendBatch", num_v_heads: int, num_k_heads: int) -> "TrackSplit":
        lens, chunks, cs = batch.seq_lens, batch.track_chunks, batch.chunk_size
        if len(chunks) != len(lens):
            raise ValueError(f"track_chunk_idx: expected one entry per request ({len(lens)}), got {len(chunks)}")
        heads, tails, head_idx, tail_idx, rows = [], [], [], [], []
        start = 0
        for i, (n, c) in enumerate(zip(lens, chunks)):
            b = n if c < 0 else c * cs
            if b > n:
                raise ValueError(f"track_chunk_idx: request {i} snapshots after {b} tokens, but its "
                                 f"extend has {n}")
            if c >= 0:
                rows.append(i)
            heads.append(b)
            tails.append(n - b)
            head_idx.extend(range(start, start + b))
            tail_idx.extend(range(start + b, start + n))
            start += n
        dev = batch.query_start_loc.device

        def up(x, dtype=torch.int64):
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        plan = lambda ls: qla_serve.plan_prefill(ls, num_v_heads, num_k_heads, device=dev, cp=batch.cp)  # noqa: E731
        return TrackSplit(head_idx=up(head_idx), tail_idx=up(tail_idx), head_plan=plan(heads),
                          tail_plan=plan(tails), tail_live=up([t > 0 for t in tails], torch.bool),
                          snap_rows=up(rows), num_head=len(head_idx), num_tail=len(tail_idx))


class FlashQLAGDNKernel(LinearAttnKernelBase):
    """GDN decode / extend / target_verify on qla_serve's ops (TileLang kernels on SM90/SM100).

    One instance per ``GDNKernelDispatcher`` (one per runner; a draft runner has its own).
    ``phases`` names the phases SGLang routes here, for logs and tests.
    """

    # SGLang reads these class flags (kernel_backend.py / gdn_backend.py):
    supports_packed_decode = False          # no fused-projection decode entry; q/k/v views instead
    supports_track_state_snapshot = True   # extend fills track_state (extra_buffer radix cache)
    uses_state_checkpoints = False
    supports_strided_target_verify_qkv = True  # gdn_verify takes token/head-strided views
    supports_fused_chain_verify = False

    def __init__(self, phases: tuple[str, ...] = ()):
        self.phases = tuple(phases)
        self._batch: ExtendBatch | None = None
        self._warned_unplanned = False
        self._decode_ids: tuple | None = None     # (SGLang's cache_indices, the ops' ids of them)

    # ------------------------------------------------------------------ per-batch plan
    def bind_batch(self, batch: ExtendBatch | None) -> None:
        """Hand this step's prefill plan over (called once per forward batch by the plugin)."""
        self._batch = batch

    def _plan_for(self, query_start_loc: torch.Tensor, T: int, Hv: int, Hk: int) -> ExtendBatch:
        b = self._batch
        if b is not None and b.query_start_loc is query_start_loc:
            return b
        # A batch whose metadata the plugin did not see (a path SGLang added later): plan it
        # from the lengths, which costs one device->host read. Loud, once per process.
        if not self._warned_unplanned:
            self._warned_unplanned = True
            log.warning("qla_serve: SGLang extend without a plan from init_forward_metadata; "
                        "reading query_start_loc on the host (one sync per call)")
        cu = query_start_loc.tolist()
        lens = tuple(b2 - a2 for a2, b2 in zip(cu, cu[1:]))
        self._batch = ExtendBatch(query_start_loc=query_start_loc, seq_lens=lens, num_tokens=cu[-1],
                                  cp=cp_from_env())
        return self._batch

    # ------------------------------------------------------------------ decode
    def bind_decode_ids(self, cache_indices: torch.Tensor, ids: torch.Tensor) -> None:
        """The forward batch's slot ids for ``cache_indices``, derived once per batch by the
        plugin's forward_decode hook (decode_layer.step_ids): :meth:`decode` takes them when SGLang
        hands it that same tensor, instead of mapping the ids again in every GDN layer."""
        self._decode_ids = (cache_indices, ids)

    def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc,
               **kwargs):
        """One token per request; returns [1, B, Hv, 128] in q's dtype. Graph-capturable."""
        q3, k3, v3 = _tokens(q, "q"), _tokens(k, "k"), _tokens(v, "v")
        B, Hv = v3.shape[0], v3.shape[1]
        out = torch.empty(1, B, Hv, HEAD_DIM, dtype=q3.dtype, device=q3.device)
        bound = self._decode_ids
        slots = bound[1] if bound is not None and bound[0] is cache_indices else _slots(cache_indices)
        qla_serve.gdn_decode(q3, k3, v3, ssm_states, slots,
                             a=_gate2d(a, "a", B), b=_gate2d(b, "b", B), A_log=A_log, dt_bias=dt_bias,
                             use_qk_l2norm=True, out=out[0])
        return out

    # ------------------------------------------------------------------ extend
    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc,
               inplace_update: bool = True, output=None, track_state=None, **kwargs):
        """Chunked prefill of the packed batch; returns (o [1, T, Hv, 128], None, None)."""
        if not inplace_update:
            # Only GDN multi-item scoring asks for this, and SGLang refuses MIS unless the
            # prefill backend is triton (validate_gdn_mis_backend): unreachable, kept loud.
            raise NotImplementedError("qla_serve flashqla extend always writes the final state "
                                      "back (inplace_update=False is multi-item scoring: use "
                                      "--linear-attn-prefill-backend triton)")
        q3, k3, v3 = _tokens(q, "q"), _tokens(k, "k"), _tokens(v, "v")
        T, Hk, Hv = q3.shape[0], q3.shape[1], v3.shape[1]
        g2, beta2 = _gate2d(g, "g", T), _gate2d(beta, "beta", T)
        batch = self._plan_for(query_start_loc, T, Hv, Hk)
        n = batch.num_tokens
        if n > T:
            raise ValueError(f"query_start_loc: expected at most q's {T} tokens, the plan has {n}")
        if output is not None and tuple(output.shape) == (1, T, Hv, HEAD_DIM) \
                and output.dtype == q3.dtype and output.is_contiguous():
            o = output
        else:
            o = torch.empty(1, T, Hv, HEAD_DIM, dtype=q3.dtype, device=q3.device)
        if n < T:  # physical padding past the logical tokens: keep it finite and defined
            o[0, n:].zero_()
        # SGLang's Triton path normalises q and k inside its kernel; gdn_prefill takes them
        # normalised: one launch (gdn_prefill_inputs without gates: SGLang brings g and beta),
        # in fp16 where prefill runs the TileLang kernels (they read it without converting).
        qn, kn, _, _ = qla_serve.gdn_prefill_inputs(q3[:n], k3[:n], qk_dtype=qla_serve.prefill_qk_dtype(q3))
        slots = _slots(cache_indices)
        if track_state is None:
            qla_serve.gdn_prefill(qn, kn, v3[:n], g2[:n].float(), beta2[:n].float(), ssm_states,
                                  slots, batch.plan_for(Hv, Hk), out=o[0, :n])
        else:
            self._extend_tracked(batch, qn, kn, v3[:n], g2[:n].float(), beta2[:n].float(), ssm_states,
                                 slots, o[0, :n], track_state, kwargs.get("track_chunk_idx"), Hv, Hk)
        return o, None, None

    def _extend_tracked(self, batch, q, k, v, g, beta, pool, slots, out, track_state, track_chunk_idx,
                        Hv, Hk):
        """Extend with extra_buffer's snapshot: ``track_state[i]`` (fp32 [N, Hv, V, K]) gets the
        state after ``track_chunk_idx[i]`` chunks of request i (rows with -1 are not written)."""
        if batch.track_chunks is None:
            if track_chunk_idx is None:
                raise ValueError("track_chunk_idx: expected the per-request snapshot chunk with "
                                 "track_state, got None")
            if not self._warned_unplanned:
                self._warned_unplanned = True
                log.warning("qla_serve: SGLang extend with a track snapshot but no host track plan; "
                            "reading track_chunk_idx on the host (one sync per call)")
            batch.track_chunks = tuple(int(c) for c in track_chunk_idx.tolist())
        sp = batch.split_for(Hv, Hk)
        hi, ti = sp.head_idx, sp.tail_idx
        if sp.num_head:  # else every cut is at 0: the slots already hold the boundary states
            o_head = qla_serve.gdn_prefill(q[hi], k[hi], v[hi], g[hi], beta[hi], pool, slots, sp.head_plan)
            out.index_copy_(0, hi, o_head)
        rows = sp.snap_rows
        track_state[rows] = pool.index_select(0, slots.long()[rows]).to(track_state.dtype)
        if sp.num_tail:
            tail_slots = torch.where(sp.tail_live, slots, torch.full_like(slots, -1))
            o_tail = qla_serve.gdn_prefill(q[ti], k[ti], v[ti], g[ti], beta[ti], pool, tail_slots, sp.tail_plan)
            out.index_copy_(0, ti, o_tail)

    # ------------------------------------------------------------------ target_verify
    def target_verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices,
                      query_start_loc, intermediate_states_buffer=None, intermediate_state_indices=None,
                      cache_steps=None, retrieve_parent_token=None, **kwargs):
        """Speculative verify of linear draft chains; returns o shaped like v."""
        if retrieve_parent_token is not None:
            raise NotImplementedError("qla_serve flashqla verify handles linear draft chains only "
                                      "(SGLang routes tree drafts to its Triton kernel)")
        if intermediate_states_buffer is None or intermediate_state_indices is None:
            raise ValueError("intermediate_states_buffer / intermediate_state_indices: expected the "
                             "per-draft state buffer SGLang allocates for target verify, got None")
        q3, k3, v3 = _tokens(q, "q"), _tokens(k, "k"), _tokens(v, "v")
        T, Hv = v3.shape[0], v3.shape[1]
        N = query_start_loc.shape[0] - 1
        out = torch.empty(T, Hv, HEAD_DIM, dtype=q3.dtype, device=q3.device)
        ids = intermediate_state_indices[:N].to(torch.int32)
        qla_serve.gdn_verify(q3, k3, v3, ssm_states, _slots(cache_indices[:N]),
                             query_start_loc.to(torch.int32), intermediate_states_buffer, ids,
                             a=_gate2d(a, "a", T), b=_gate2d(b, "b", T), A_log=A_log, dt_bias=dt_bias,
                             use_qk_l2norm=True, out=out)
        return out.view(v.shape)
