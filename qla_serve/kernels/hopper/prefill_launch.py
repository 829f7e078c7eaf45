"""GDN chunked prefill on Hopper (sm_90a): the call path.

prefill_api.py says what the kernels are (the variants, their names, the module switches, the
rules that pick a variant for a plan, build); this module runs them. A plan's first call
resolves its launches (_Launches: kernels, stage 1's buffers, a CP plan's segment tables and
workspaces, uploaded once) and keeps them in the plan's kernel cache, so every later call of the
step (every GDN layer) costs two launches (four or five with CP) through the kernels' raw host
functions (raw_launch.py) and a few attribute reads. The switches are read from prefill_api at
resolve time (prefill_api.X, so that setting them there takes effect on the next plan). Nothing
here synchronises with the GPU.
"""

import collections
import functools

import torch

from qla_serve.launch_record import recordable

from . import prefill_api as api
from .common import _TORCH_TO_TL, check_pool_alignment, sm_count
from .raw_launch import raw_function

_fns: dict = {}  # (variant name, target) -> the compiled kernel's raw launch function (raw_launch.py)
_dummies: dict = {}


def _plan_scratch(plan, hv: int, form: str, packed: bool, device):
    """(number of chunks NC, stage 1's outputs in prep_func's argument order: gate factors
    [NC, Hv, 2, 64] fp32, P [NC, Hv, 64, 64] fp16 (not when packed), M or the packed P^T / M
    tile [NC, Hv, 64, 64] fp16 (form "m"), U0 and -Wk [NC, Hv, 64, 128] fp16 (form "uw"), M's
    diagonal [NC, Hv, 64] fp16 (packed)), the outputs not written as 1-row stand-ins; allocated
    once per plan, head count and form (plan.scratch): every GDN layer of a step reuses them
    (stage 1 rewrites them in full before stage 2 reads)."""
    def make():
        nchunks = api.plan_chunks(plan)
        rows = max(nchunks, 1)  # stage 2 never reads row 0 when there are no chunks
        m_rows, uw_rows = (1, rows) if form == "uw" else (rows, 1)
        p_rows, d_rows = (1, rows) if packed else (rows, 1)
        return nchunks, (
            torch.empty((rows, hv, 2, api.CHUNK), dtype=torch.float32, device=device),
            torch.empty((p_rows, hv, api.CHUNK, api.CHUNK), dtype=torch.float16, device=device),
            torch.empty((m_rows, hv, api.CHUNK, api.CHUNK), dtype=torch.float16, device=device),
            torch.empty((uw_rows, hv, api.CHUNK, 128), dtype=torch.float16, device=device),
            torch.empty((uw_rows, hv, api.CHUNK, 128), dtype=torch.float16, device=device),
            torch.empty((d_rows, hv, api.CHUNK), dtype=torch.float16, device=device),
        )
    return plan.scratch(("hopper_prefill_ws", hv, form, packed), make)


def _half_qk(plan, ntok: int, hk: int, device):
    """fp16 copies of bf16 q and k ([T, Hk, 128] each) that stage 1 writes and stage 2 reads, made
    once per plan like the other stage-1 outputs."""
    return plan.scratch(("hopper_prefill_qk16", ntok, hk), lambda: tuple(
        torch.empty((ntok, hk, 128), dtype=torch.float16, device=device) for _ in range(2)))


def _check_tma_strides(**tensors) -> None:
    """TMA tile loads need 16-byte aligned bases and strides (true for engine layouts). The
    tensors are [T, H, 128] (the last stride is 1, checked by the kernel); written out, not as a
    generator, because it runs on every call (~1 µs less)."""
    for name, t in tensors.items():
        st, size = t.stride(), t.element_size()
        if t.data_ptr() % 16 or (st[0] * size) % 16 or (st[1] * size) % 16:
            raise ValueError(
                f"{name}: expected a 16-byte aligned base and token/head strides that are multiples of "
                f"16 bytes, got strides {tuple(t.stride())} for dtype {t.dtype}"
            )


def _fn(variant: dict, target: str):
    fn = recordable(raw_function(api.build(variant, target), variant["name"]))
    _fns[variant["name"], target] = fn
    return fn


def _kernel(variant: dict, target: str):
    """The variant's raw launch function (raw_launch.py), compiled or loaded on first use and
    kept process-wide by (name, target), as prefill_api.build keeps the compiled kernels."""
    return _fns.get((variant["name"], target)) or _fn(variant, target)


def _dummy(key, make):
    """Process-wide stand-ins for kernel arguments a call does not read (per device/heads)."""
    t = _dummies.get(key)
    if t is None:
        t = _dummies[key] = make()
    return t


def _unread_maps(hv: int, device) -> torch.Tensor:
    """The maps argument of a call without CP (never read: every item starts at chunk 0)."""
    return _dummy(("maps", hv, device), lambda: torch.empty((1, hv, 2, 128, 128), dtype=torch.float32,
                                                             device=device))


def _unread_warmup(hv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """warm_start and need_maps of a call without gate warmup (use_warmup = 0: never read)."""
    t = _dummy(("warm", hv, device), lambda: torch.empty((1, hv), dtype=torch.int32, device=device))
    return t, t


def _persistent_grid(plan, hv: int, vs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The persistent stage 2's work order and grid, once per plan: the sequences longest first
    (int32 [N]; ties in batch order) and an unread int32 tensor whose length is the grid, one CTA
    per SM (the plan's SM count) or one per unit where there are fewer."""
    def make():
        lens = [int(n) for n in plan.seq_lens]
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        ncta = max(1, min(len(lens) * hv * vs, plan.sm_count))
        flat = torch.tensor(order + [0] * ncta, dtype=torch.int32)
        if device.type == "cuda":  # one upload, no sync
            flat = flat.pin_memory().to(device, non_blocking=True)
        return flat[:len(lens)], flat[len(lens):]
    return plan.scratch(("hopper_prefill_persistent", hv, vs, device), make)


def _whole_sequence_items(plan, device) -> torch.Tensor:
    """The items argument of a call without CP: [N, 4], never read (use_items = 0: item i is
    sequence i, whole); its shape gives the grid."""
    return plan.scratch(("hopper_prefill_items", device),
                        lambda: torch.empty((plan.num_seqs, 4), dtype=torch.int32, device=device))


class _CPTables:
    """The segment work of a "cp" plan (host, built once per plan; see the module docstring).

    maps_items [G1, 4]  (seq, first_chunk, num_chunks, map) for every segment but a sequence's
                        last: the "maps" pass stores segment k of cut sequence j to map
                        k * num_cut + j
    out_items  [G, 4]   (seq, first_chunk, num_chunks, map) for every segment (and one empty item
                        per 0-length sequence, so its slot still gets final = initial state);
                        map = where the segment's true initial state is: k > 0 the previous
                        segment's map (maps[map, h, 0]); k = 0 of a cut sequence its own
                        (maps[map, h, 1]: the maps pass's copy of the pool state, so the
                        output pass never reads a slot its last segment writes); -1 for uncut
                        sequences (they read their pool slot)
    cut_levels [num_cut] maps per cut sequence (its segments minus one), for the scan kernel
    cuts    [num_cut, 3] (seq, num_segments, out_base) per cut sequence: its segments are
                        out_items[out_base + k], k in order (the warmup finder's table)
    levels              the largest of them (map levels allocated)
    """

    def __init__(self, plan, device):
        rows = plan.segment_rows  # (seq, first_chunk, num_chunks, carried): the planner's cut
        nseg = collections.Counter(seq for seq, *_ in rows)
        cut = sorted(seq for seq, n in nseg.items() if n > 1)
        index = {s: j for j, s in enumerate(cut)}
        self.num_cut = len(cut)
        levels = [nseg[s] - 1 for s in cut]
        self.levels = max(levels, default=0)
        # 0-length sequences have no segment: an empty item still writes their final state.
        out_rows = [(s, 0, 0, -1) for s in range(plan.num_seqs) if s not in nseg]
        maps_rows = []
        cuts = [None] * self.num_cut
        for seq, first, n, _ in rows:
            if seq not in index:
                out_rows.append((seq, 0, n, -1))
                continue
            j, kseg = index[seq], first // plan.segment_chunks
            if kseg == 0:
                cuts[j] = (seq, nseg[seq], len(out_rows))
            elif out_rows[-1][:2] != (seq, first - plan.segment_chunks):
                raise AssertionError(f"plan.segment_rows: segments of sequence {seq} are not consecutive")
            out_rows.append((seq, first, n, (kseg - 1 if kseg else 0) * self.num_cut + j))
            if kseg < nseg[seq] - 1:
                maps_rows.append((seq, first, n, kseg * self.num_cut + j))
        flat = torch.tensor([x for row in maps_rows + out_rows + cuts for x in row] + levels, dtype=torch.int32)
        if device.type == "cuda":  # one upload, no sync
            flat = flat.pin_memory().to(device, non_blocking=True)
        n1, n2 = 4 * len(maps_rows), 4 * (len(maps_rows) + len(out_rows))
        n3 = n2 + 3 * self.num_cut
        self.maps_items, self.out_items = flat[:n1].view(-1, 4), flat[n1:n2].view(-1, 4)
        self.cuts, self.cut_levels = flat[n2:n3].view(-1, 3), flat[n3:]

    def maps(self, hv: int, device) -> torch.Tensor:
        return torch.empty((max(self.levels * self.num_cut, 1), hv, 2, 128, 128), dtype=torch.float32,
                           device=device)

    def warmup(self, hv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The finder's outputs: warm_start [len(out_items), Hv], need_maps [num_cut, Hv] (int32;
        rewritten by every call before the passes read them)."""
        return (torch.empty((self.out_items.shape[0], hv), dtype=torch.int32, device=device),
                torch.empty((max(self.num_cut, 1), hv), dtype=torch.int32, device=device))


def prefill(q, k, v, g, beta, pool, slot_ids, plan, *, has_initial_state, scale, out, checkpoints=None,
            _stages="prep,main", _target=api.ARCH) -> None:
    """Chunked GDN prefill, in place on the pool (contract: qla_serve/kernels/__init__ and DESIGN.md).

    q, k [T, Hk, 128], v [T, Hv, 128] bf16/fp16 (last dim contiguous; q/k in v's dtype, or fp16
    beside bf16 v: QK_V_DTYPES), g, beta [T, Hv] fp32
    contiguous, pool [S, Hv, 128(V), 128(K)] fp32/bf16 (inner dims contiguous), slot_ids [N] int32,
    has_initial_state [N] bool or None, plan: PrefillPlan (cu_seqlens, chunk_offsets on device;
    strategy "plain"/"vsplit"/"cp" with v_split and segment_chunks), out [T, Hv, 128] v's dtype,
    fully written. Sequences with slot < 0 run from a zero state: their rows of `out` are
    computed, the pool is neither read nor written for them. ``_stages`` (benchmarks only) runs
    "prep" or "main" alone; ``_target`` is the compile target ("sm_100a" from
    qla_serve.kernels.blackwell). ``checkpoints``: None, or (chunks [N] int32, slots [N] int32)
    on the device: the state after ``chunks[s] * 64`` tokens of sequence s (0: none; a boundary
    inside the sequence) is also written to pool slot ``slots[s]`` (< 0: none), in the pool's
    dtype, by the pass that walks that chunk (exact, or gate-warmed under cp="auto").

    The launches are resolved once per plan and call shape (:class:`_Launches`, kept in
    plan.scratch): every GDN layer of a step then only binds its own tensors.
    """
    key = ("hopper_prefill_launches", q.shape[0], k.shape[1], v.shape[1], q.dtype, v.dtype, pool.dtype,
           has_initial_state is None, q.device, _stages, _target, api.GATE_WARMUP, api.MAIN_IMPL, api.PREP_HEADS,
           api.PREP_SOLVE, api.CP_PDL, api.PERSISTENT, api.PERSISTENT_MAX_MEAN_CHUNKS, api.PREP_PAIR,
           api.FUSED, api.FUSED_PINGPONG)
    launches = plan.kernel_cache.get(key)
    if launches is None:
        launches = plan.kernel_cache[key] = _Launches(plan, q, k, v, pool, has_initial_state is None, _stages,
                                                      _target)
    launches(q, k, v, g, beta, pool, slot_ids, has_initial_state, scale, out, checkpoints)


class _Launches:
    """One prefill call's launches for a plan and call shape (token count, heads, dtypes, device,
    the module switches GATE_WARMUP, MAIN_IMPL, PREP_HEADS and PERSISTENT): the kernels' raw
    launch functions, stage 1's buffers, the CP tables and workspaces, resolved once (FlashInfer's
    plan/run split). A call binds q, k, v, g, beta, the pool, the slots, the flags, the scale and
    out, and launches (finder, maps and scan as programmatic dependents where CP_PDL is on):

      fused                                                      (plain where fused_applies)
      prep -> main output                                        (plain, vsplit; persistent grid
                                                                  where persistent_applies)
      prep -> [finder] -> maps -> [scan] -> main output          (cp; module docstring)
    """

    def __init__(self, plan, q, k, v, pool, all_init: bool, stages: str, target: str):
        strategy = getattr(plan, "strategy", "plain")
        if strategy not in api.SUPPORTED_STRATEGIES:
            raise ValueError(f"plan.strategy must be one of {sorted(api.SUPPORTED_STRATEGIES)} on {api.ARCH}, "
                             f"got {strategy!r}")
        vs = int(getattr(plan, "v_split", 1))
        if vs not in api.V_SPLITS:
            raise ValueError(f"plan.v_split must be one of {api.V_SPLITS}, got {vs}")
        hk, hv, dev = k.shape[1], v.shape[1], q.device
        # io: v's and the output's dtype (stage 2's variant); q/k may be fp16 beside bf16 v
        io, qk, pool_dt = _TORCH_TO_TL[v.dtype], _TORCH_TO_TL[q.dtype], _TORCH_TO_TL[pool.dtype]
        impl = api.main_impl_for(vs, target)
        self.vfirst = impl == "vfirst"
        form = api.PREP_FORM[impl]
        self.packed = packed = api.packed_tiles(strategy, impl, vs)
        self.ntok = q.shape[0]
        self.all_init = int(all_init)
        self.flags = _dummy(("flags", dev), lambda: torch.ones(1, dtype=torch.uint8, device=dev))
        self.cu_seqlens, self.chunk_offsets = plan.cu_seqlens, plan.chunk_offsets
        self.fused = None
        if "prep" in stages and "main" in stages and api.fused_applies(strategy, vs, qk, target):
            # one launch: no stage-1 buffers, no fp16 copies (fp16 q / k only)
            self.fused = _kernel(api.fused_variant(hv, hk, io, pool_dt), target)
            return
        nchunks, self.stage1 = _plan_scratch(plan, hv, form, packed, dev)
        # Stage 2's tensor-core operands are fp16: bf16 q/k are converted once, by stage 1.
        self.half_qk = _half_qk(plan, max(self.ntok, 1), hk, dev) if qk == "bfloat16" else None
        kp = _kernel(api.plan_prep_variant(plan, hv, hk, io, form, qk, packed), target)
        self.prep = kp if nchunks > 0 and "prep" in stages else None  # stages: benchmarks time them apart
        self.output = self.persistent = None
        if "main" not in stages:
            return
        self.finder = self.maps_pass = self.scan = None
        if api.persistent_applies(strategy, impl, plan.seq_lens, hv * vs, plan.sm_count):
            self.persistent = _kernel(api.persistent_variant(hv, hk, io, pool_dt, vs, packed), target)
            self.items, self.ctas = _persistent_grid(plan, hv, vs, dev)
            return
        self.output = _kernel(api.main_variant(hv, hk, io, pool_dt, vs, "output", impl, False, packed), target)
        if strategy != "cp":
            self.items, self.maps = _whole_sequence_items(plan, dev), _unread_maps(hv, dev)
            self.warm, self.use_items, self.warmup = _unread_warmup(hv, dev), 0, 0
            return
        cp = plan.scratch(("hopper_prefill_cp", dev), lambda: _CPTables(plan, dev))
        self.items, self.use_items = cp.out_items, 1
        self.maps = plan.scratch(("hopper_prefill_maps", hv, dev), lambda: cp.maps(hv, dev))
        # Gate warmup only where truncating at e^-10 is allowed ("auto"; never for cp="exact").
        max_warmup = api.max_warmup_chunks(plan.segment_chunks)
        self.warmup = int(api.GATE_WARMUP and plan.cp == "auto" and cp.num_cut > 0 and max_warmup > 0)
        self.warm = _unread_warmup(hv, dev)
        pdl = api.CP_PDL  # the finder, the maps pass and the scan
        if self.warmup:
            self.warm = plan.scratch(("hopper_prefill_warm", hv, dev), lambda: cp.warmup(hv, dev))
            self.finder = functools.partial(_kernel(api.warmup_variant(hv, pdl), target),
                                            self.stage1[0],
                                            plan.chunk_offsets, cp.cuts, *self.warm, plan.segment_chunks,
                                            max_warmup)
        if cp.maps_items.shape[0]:
            mvs = _maps_pass_split(plan, vs, impl, target)
            self.maps_items = cp.maps_items
            self.maps_pass = _kernel(api.main_variant(hv, hk, io, pool_dt, mvs, "maps", impl, pdl), target)
            if cp.levels > 1:
                self.scan = functools.partial(_kernel(api.scan_variant(hv, pdl=pdl), target), self.maps,
                                              cp.cut_levels, self.warm[1], self.warmup, sm_count(dev))

    def __call__(self, q, k, v, g, beta, pool, slot_ids, has_initial_state, scale, out, checkpoints=None) -> None:
        if slot_ids.shape[0] == 0:
            return
        if self.ntok == 0:  # only empty sequences: nothing to compute, final state = initial state
            q, k, v, out, g, beta = (_one_row(x) for x in (q, k, v, out, g, beta))
        else:
            _check_tma_strides(q=q, k=k, v=v)
        # stage 2 moves a slot's state in 8-byte pairs and assumes 16-byte slot strides and
        # base (prefill_main_vfirst.py): decode's rule
        check_pool_alignment(pool)
        flags = self.flags if has_initial_state is None else has_initial_state.view(torch.uint8)
        scale = 128**-0.5 if scale is None else float(scale)
        # (without checkpoints the kernels never read these: slot_ids stands in for both)
        ckpt = (slot_ids, slot_ids, 0) if checkpoints is None else (*checkpoints, 1)
        if self.fused is not None:
            self.fused(q, k, v, g, beta, pool, slot_ids, flags, self.cu_seqlens, *ckpt[:2], out, scale, self.all_init,
                       ckpt[2])
            return
        qh, kh = self.half_qk or (q, k)
        if self.prep is not None:
            self.prep(q, k, v, g, beta, self.cu_seqlens, self.chunk_offsets, *self.stage1, qh, kh, scale)
        if self.output is None and self.persistent is None:
            return
        fbuf, pbuf, mbuf, ubuf, wbuf, dbuf = self.stage1
        # Stage 2's inputs: V-first reads v, M's diagonal and the packed P^T / M (packed) or P and
        # M, v8 P, U0 and -Wk.
        tiles = (v, fbuf, dbuf if self.packed else pbuf, mbuf) if self.vfirst else (fbuf, pbuf, ubuf, wbuf)
        head = (qh, kh, *tiles, pool, slot_ids, flags, self.cu_seqlens, self.chunk_offsets)
        if self.persistent is not None:
            self.persistent(*head, self.items, self.ctas, *ckpt[:2], out, scale, self.all_init, ckpt[2])
            return
        if self.finder is not None:
            self.finder()
        if self.maps_pass is not None:
            self.maps_pass(*head, self.maps_items, self.maps, *self.warm, *ckpt[:2], out, scale, self.all_init, 1,
                           self.warmup, 0)
        if self.scan is not None:
            self.scan()
        self.output(*head, self.items, self.maps, *self.warm, *ckpt[:2], out, scale, self.all_init, self.use_items,
                    self.warmup, ckpt[2])


def _maps_pass_split(plan, vs: int, impl: str, target: str) -> int:
    """The maps pass's value split (plan.maps_v_split; the plan's v_split where unset). The maps
    are whole 128-row tensors whatever the split, so the scan and the output pass do not care;
    but the maps pass reads stage 1's output, which must be in the form the plan's stage 2 reads."""
    mvs = getattr(plan, "maps_v_split", 0) or vs
    if mvs not in api.V_SPLITS or api.main_impl_for(mvs, target) != impl:
        runs = api.main_impl_for(mvs, target) if mvs in api.V_SPLITS else "no kernel"
        raise ValueError(f"plan.maps_v_split: {mvs} runs {runs}, but this plan's stage 2 is {impl} (v_split {vs}): "
                         "the maps pass must read the same stage-1 form")
    return mvs


def _one_row(x):
    """A 1-row stand-in for a 0-row tensor (kernels index no row of it when every length is 0)."""
    return torch.zeros((1,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
