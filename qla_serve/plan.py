"""Host-side prefill planner: CPU sequence lengths + TP-local heads + arch -> PrefillPlan.

Built once per batch (per engine step) and shared by every GDN layer of that step, like
FlashInfer's plan()/run() split. Pure host code: it never reads GPU memory; the small int32
index tensors a kernel needs are packed into one buffer and uploaded with one non-blocking copy.

Strategies (see DESIGN.md, "Prefill numerics"):

* ``plain``  — one block per (sequence, value head) walks all of its chunks.
* ``vsplit`` — the value dimension is split in 2 or 4 blocks per head (exact, cheap).
* ``cp``     — intra-card context parallelism: sequences are cut into segments of L chunks that
  run in parallel; a segment's initial state is recomputed on the device: by the exact
  correction path (per-segment transition maps, a scan) or, under cp="auto" for heads whose
  gates decay, by gate warmup (a short walk from a zero state); see kernels/hopper/prefill_api.

``cp`` modes: ``auto`` picks the cheapest strategy by the arch's cost model (configs/costmodel);
``off`` is bit-stable — for a given sequence the result does not depend on the rest of the
batch — so it never cuts sequences and never splits V (beyond the fixed narrowest split of
kernels that have no ``plain``); ``exact`` may cut sequences but never truncates history (the
exact correction path for every segment). Under ``auto`` a cut segment may use gate warmup
for heads whose gates decay (history scaled by <= e^-10 dropped; decided per head on the
device; on Hopper on by default, QLA_SERVE_GATE_WARMUP=0 turns it off, see
kernels/hopper/prefill_api.GATE_WARMUP).
The cost model scores a cut by the exact path (a warmup, at most L/2 chunks, costs about as
much or less, and which heads take it is only known on the device), so ``auto`` and ``exact``
choose the same strategy, split and segment length. They may differ in the CP maps pass's split
(plan.maps_v_split, _maps_v_split), which depends on how many heads are expected to need maps.
Strategies the arch's kernels do not implement are never chosen.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from itertools import accumulate, chain
from typing import Iterable, Sequence

import torch

from qla_serve._validate import (ALL_STRATEGIES, CP_MODES, check_device_arg, check_int, check_plan_args,
                                 check_strategies)
from qla_serve.costmodel import CostModel, load_cost_model
from qla_serve.paths import supported_prefill_strategies

CHUNK = 64
ENV_CP = "QLA_SERVE_CP"
V_SPLITS = (1, 2, 4)
__all__ = ["ALL_STRATEGIES", "CHUNK", "CP_MODES", "ENV_CP", "PrefillPlan", "V_SPLITS", "cp_from_env", "force_plan",
           "plan_prefill"]


def seq_chunks(seq_lens: Iterable[int]) -> list[int]:
    """Each sequence's CHUNK-token chunks, ceil(len / CHUNK) (0 for an empty sequence)."""
    return [-(-int(n) // CHUNK) for n in seq_lens]


# Segment table columns.
SEG_SEQ, SEG_FIRST_CHUNK, SEG_NUM_CHUNKS, SEG_CARRIED = range(4)


def cp_from_env(environ=None) -> str:
    """The cp mode a deployment hands the engine backends: ``$QLA_SERVE_CP``, default "auto".

    The backends read it once per process (``plan_prefill(..., cp=cp_from_env())``); an
    unknown value is a ValueError naming the variable, never a silent "auto".
    """
    import os
    value = (os.environ if environ is None else environ).get(ENV_CP, "auto").strip().lower()
    if value not in CP_MODES:
        raise ValueError(f"{ENV_CP}: expected auto, off or exact, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class PrefillPlan:
    """What a prefill kernel needs besides the tensors. Host fields are plain Python.

    Device tensors (int32, on ``device``; views into one uploaded buffer):
        cu_seqlens     [N+1]  token offsets
        chunk_offsets  [N+1]  cumulative ceil(len / 64): where each sequence's chunks start
        segments       [G, 4] rows (seq, first_chunk, num_chunks, carried); carried=1 means the
                              segment starts from the sequence's initial state (pool slot),
                              0 means its initial state is recomputed on the device (CP)
    """

    seq_lens: tuple[int, ...]
    num_v_heads: int
    num_k_heads: int
    strategy: str
    v_split: int
    segment_chunks: int          # L; 0 unless strategy == "cp"
    maps_v_split: int            # the CP maps pass's value split; 0 unless strategy == "cp"
    cp: str
    arch: str
    sm_count: int
    estimated_us: float
    device: torch.device
    cu_seqlens: torch.Tensor
    chunk_offsets: torch.Tensor
    segments: torch.Tensor
    host_buffer: torch.Tensor = dataclasses.field(repr=False)  # CPU copy of the three tensors
    # Per-plan scratch for kernel modules (e.g. workspaces sized from the plan). Not an input.
    kernel_cache: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def scratch(self, key, make):
        """``kernel_cache[key]``, made by ``make()`` on the first call: per-plan workspaces and
        index tensors that every GDN layer of a step reuses."""
        hit = self.kernel_cache.get(key)
        if hit is None:
            hit = self.kernel_cache[key] = make()
        return hit

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_segments(self) -> int:
        return self.segments.shape[0]

    @property
    def segment_rows(self) -> list[tuple[int, int, int, int]]:
        """The segment table on the host (from the CPU copy; no device read)."""
        n1 = self.num_seqs + 1
        return [tuple(r) for r in self.host_buffer[2 * n1:].view(-1, 4).tolist()]

    @functools.cached_property
    def total_tokens(self) -> int:
        # Cached: every GDN layer's call checks it (a list of N + 1 ints each time cost ~5 us
        # at 256 sequences). cached_property writes the instance __dict__, so frozen is fine.
        return sum(self.seq_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)

    @property
    def cu_seqlens_cpu(self) -> list[int]:
        return self.host_buffer[: self.num_seqs + 1].tolist()

    def describe(self) -> dict:
        """JSON-friendly summary (the CLI prints it)."""
        return {
            "strategy": self.strategy, "v_split": self.v_split,
            "segment_chunks": self.segment_chunks, "maps_v_split": self.maps_v_split,
            "cp": self.cp, "arch": self.arch,
            "sm_count": self.sm_count, "num_seqs": self.num_seqs,
            "num_v_heads": self.num_v_heads, "num_k_heads": self.num_k_heads,
            "total_tokens": self.total_tokens, "num_segments": self.num_segments,
            "blocks": self.num_segments * self.num_v_heads * self.v_split,
            "estimated_us": round(self.estimated_us, 2),
            "segments": [list(r) for r in self.segment_rows],
        }


@dataclasses.dataclass(frozen=True)
class _Choice:
    strategy: str
    v_split: int
    segment_chunks: int
    estimated_us: float


def _score(model: CostModel, chunks: list[int], hv: int, sm: int, v_split: int, L: int) -> float:
    """Modelled time for V split ``v_split`` and segment length ``L`` (0 = no cut).

    Cut sequences are scored by the exact CP path (the gate warmup that cp="auto" may take for
    some heads is decided on the device): a "maps" pass over every segment but the last (the
    first segment's end state; for the others also the transition Phi, a second block per
    split), a scan (segments - 2 steps: cp_level_us each), then the output pass over all
    segments at once (kernels/hopper/prefill_api).
    """
    return _Scorer(model, chunks, hv, sm)(v_split, L)


class _Scorer:
    """One batch's candidates scored by the cost model (CostModel.estimate_us, plus the CP maps
    pass and scan for a cut). The planner scores ~21 (split, L) pairs per step and that search
    was most of its host time, so the batch's aggregates (per segment length) and each split's
    coefficients are computed once and a candidate is arithmetic on them alone: the same figures
    as estimate_us term for term (tests/test_plan.py checks them against it)."""

    __slots__ = ("model", "chunks", "hv", "sm", "chunk_heads", "longest", "num_live", "num_longest",
                 "_cuts", "_splits")

    def __init__(self, model: CostModel, chunks: list[int], hv: int, sm: int):
        self.model, self.chunks, self.hv, self.sm = model, chunks, hv, sm
        self.chunk_heads = sum(chunks) * hv
        self.longest = max(chunks, default=0)
        self.num_live = len(chunks) - chunks.count(0)
        self.num_longest = chunks.count(self.longest)
        self._cuts: dict[int, tuple[int, int, int, int]] = {}
        self._splits: dict[int, tuple[float, ...]] = {}

    def cut(self, L: int) -> tuple[int, int, int, int]:
        """(most segments of a sequence, all segments, all full segments, maps block-chunks per
        head and split) when sequences are cut into segments of L chunks."""
        hit = self._cuts.get(L)
        if hit is None:
            segs = [-(-c // L) for c in self.chunks]
            hit = self._cuts[L] = (max(segs, default=0), sum(segs), sum(c // L for c in self.chunks),
                                   sum(L * (2 * s - 3) for s in segs if s > 1))
        return hit

    def _split(self, v_split: int) -> tuple[float, ...]:
        """(chunk_us, item_us, the stage-1 term, the stage-2 spread's chunk term, maps us per
        chunk) at v_split."""
        hit = self._splits.get(v_split)
        if hit is None:
            m, sm = self.model, self.sm
            chunk = m.chunk_us[v_split]
            hit = self._splits[v_split] = (chunk, m.item_us.get(v_split, 0.0),
                                           m.stage1_for(v_split) * self.chunk_heads / sm,
                                           chunk * -(-(self.chunk_heads * v_split) // sm), m.cp_maps_ratio * chunk)
        return hit

    def __call__(self, v_split: int, L: int) -> float:
        chunk, item, stage1, spread_chunks, maps_chunk_us = self._split(v_split)
        m, sm, blocks_per_seq = self.model, self.sm, self.hv * v_split
        most, segments, full, maps_chunks = self.cut(L) if L else (0, 0, 0, 0)
        if most < 2:   # one segment per sequence; blocks > 0 (the planner skips empty batches)
            blocks, chain_blocks, chain = self.num_live * blocks_per_seq, self.num_longest * blocks_per_seq, self.longest
        else:
            blocks, chain_blocks, chain = segments * blocks_per_seq, full * blocks_per_seq, L
        # estimate_us: the longest blocks (a wave at a time) or all blocks spread over the SMs
        stage2 = max(-(-chain_blocks // sm) * (chunk * chain + item), spread_chunks + item * -(-blocks // sm))
        if most < 2:
            return stage2 + stage1 + m.launch_us
        out_us = stage2 + stage1 + m.launch_us + m.cp_fixed_us
        maps_us = maps_chunk_us * max(L, -(-(blocks_per_seq * maps_chunks) // sm))
        return out_us + maps_us + m.cp_level_us * (most - 2)

    def cut_floor(self, v_split: int, L: int) -> float:
        """A lower bound of self(v_split, L) for a cut (L < longest), rising with L: the same
        sums in the same order with the stage-2 term at its spread's chunk term, the maps pass at
        L chunks and no scan (IEEE sums and products are monotone, so the computed figure is
        also a bound of the computed score)."""
        chunk, item, stage1, spread_chunks, maps_chunk_us = self._split(v_split)
        m = self.model
        return spread_chunks + stage1 + m.launch_us + m.cp_fixed_us + maps_chunk_us * L


def _choose(model: CostModel, chunks: list[int], hv: int, sm: int, cp: str,
            supported: frozenset[str]) -> _Choice:
    num_live = len(chunks) - chunks.count(0)
    splits = [s for s in V_SPLITS if s > 1 and s in model.chunk_us]
    # The baseline is one block per (sequence, head), or, for kernels without "plain" (a
    # 128-wide value block that does not fit them), their narrowest-split block.
    base = ("plain", 1) if "plain" in supported or not splits else ("vsplit", min(splits))
    if not num_live:
        return _Choice(*base, 0, model.launch_us)
    # Empty sequences change neither the max nor the sum that the score reads.
    score = _Scorer(model, [c for c in chunks if c > 0] if num_live < len(chunks) else chunks, hv, sm)
    best = _Choice(*base, 0, score(base[1], 0))
    # Bit-stable mode, or the baseline is already throughput-bound (its waves of blocks take
    # longer than the longest sequence's chain): splitting only multiplies the waves (the fitted
    # models have chunk_us[v] * v > chunk_us[1]). A mixed batch with one long sequence is
    # chain-bound and goes on to the model.
    if cp == "off" or score.longest * sm <= score.chunk_heads * base[1]:
        return best
    if "vsplit" in supported:
        for s in splits:
            t = score(s, 0)
            if t < best.estimated_us:
                best = _Choice("vsplit", s, 0, t)
    if "cp" in supported:
        for s in [1] + (splits if "vsplit" in supported else []):
            for L in model.cp_segment_chunks:
                if L >= score.longest or score.cut_floor(s, L) >= best.estimated_us:
                    break  # no sequence would be cut, or no longer L can score lower
                t = score(s, L)
                if t < best.estimated_us:
                    best = _Choice("cp", s, L, t)
    return best


def _maps_v_split(model: CostModel, chunks: list[int], hv: int, sm: int, cp: str, v_split: int,
                  L: int) -> int:
    """The CP maps pass's value split (0 without a cut): the cost model's narrower alternative
    for ``v_split`` (cp_maps_v_splits) where the maps blocks expected to do work fit on the SMs in
    one wave at it, else ``v_split``. The maps grid has 2 blocks (end state, transition) per split,
    v-head and segment but a sequence's last; a block does work where its head takes the exact
    path: every head under cp="exact", a cp_exact_fraction share under "auto" (which heads is
    decided on the device by the warmup finder, so this is an expectation). Narrower blocks
    finish sooner but, past one wave, the extra waves cost more than they save (H200: 2/8
    1x32768 maps pass 47.7 -> 38.8 us at split 2; 8/24, two waves, 84.6 -> 118 us)."""
    if L == 0:
        return 0
    narrow = model.cp_maps_v_splits.get(v_split)
    if narrow is None:
        return v_split
    heads = hv if cp == "exact" else math.ceil(model.cp_exact_fraction * hv)
    maps_per_head = sum(-(-c // L) - 1 for c in chunks if c > L)
    return narrow if 2 * narrow * heads * maps_per_head <= sm else v_split


def _segment_rows(chunks: list[int], L: int) -> Iterable[int]:
    """Flattened rows (seq, first_chunk, num_chunks, carried): each non-empty sequence cut into
    segments of L chunks (L = 0: one segment per sequence)."""
    if L == 0:  # the common, large-batch case: column-wise slice assignment runs at C speed
        has_empty = 0 in chunks
        seqs = [seq for seq, c in enumerate(chunks) if c] if has_empty else range(len(chunks))
        flat = [0] * (4 * len(seqs))
        flat[0::4] = seqs
        flat[2::4] = [chunks[s] for s in seqs] if has_empty else chunks
        flat[3::4] = [1] * len(seqs)
        return flat
    return chain.from_iterable((seq, first, min(L, c - first), int(first == 0))
                               for seq, c in enumerate(chunks) for first in range(0, c, L))


def _upload(lens: list[int], chunks: list[int], rows: Iterable[int], device: torch.device):
    """One host buffer [cu_seqlens | chunk_offsets | segments], one non-blocking copy.

    Built as one Python list packed by struct rather than with torch ops or array.extend: both
    cost several times more host time than the whole plan (target: <= 100 us, 256 sequences)."""
    flat = [0, *accumulate(lens), 0, *accumulate(chunks), *rows]
    data = bytearray(struct.pack(f"{len(flat)}i", *flat))
    host = torch.frombuffer(data, dtype=torch.int32) if flat else torch.empty(0, dtype=torch.int32)
    buf = host
    if device.type == "cuda":
        host = torch.empty(len(flat), dtype=torch.int32, pin_memory=True).copy_(host)
        buf = host.to(device, non_blocking=True)
    elif device.type != "cpu":  # the plan's tensors live on its device, whatever that is
        try:
            buf = host.to(device)
        except (RuntimeError, AssertionError) as exc:
            raise ValueError(f"device: cannot put the plan's index tensors on {device}: {exc}") from None
    n1 = len(lens) + 1
    return host, buf[:n1], buf[n1:2 * n1], buf[2 * n1:].view(-1, 4)


def _resolve_arch(device: torch.device, arch: str | None, sm_count: int | None):
    """Arch and SM count: given, else read once from the device properties (no sync)."""
    if device.type == "cuda" and (arch is None or sm_count is None):
        props = torch.cuda.get_device_properties(device)
        arch = arch or ("sm100" if props.major >= 10 else "sm90")
        sm_count = sm_count or props.multi_processor_count
    arch = arch or "sm90"
    return arch, sm_count


def plan_prefill(seq_lens: Sequence[int], num_v_heads: int, num_k_heads: int, *,
                 device=None, cp: str = "auto", sm_count: int | None = None,
                 arch: str | None = None, supported_strategies=None) -> PrefillPlan:
    """Plan one prefill batch.

    Args:
        seq_lens: CPU ints (list/tuple, or a 1-D integer CPU tensor), one per sequence; 0 is
            allowed; at most 2**31 - 1 tokens in all (the index tensors are int32). Floats are
            refused, never truncated.
        num_v_heads, num_k_heads: TP-local head counts (Hv % Hk == 0).
        device: where the index tensors go, and the device the plan serves (gdn_prefill refuses
            tensors elsewhere); default the current CUDA device, else CPU. A device this process
            cannot use (e.g. "cuda" without CUDA) is refused by name.
        cp: "auto" | "off" | "exact" (see the module docstring).
        sm_count: SMs to plan for; default read once from the device, else the cost model's.
        arch: "sm90" | "sm100" cost model; default from the device, else sm90.
        supported_strategies: strategies the kernels implement; default asks the dispatcher.
    Bad arguments raise TypeError / ValueError naming the argument, before anything is allocated.
    """
    lens = check_plan_args(seq_lens, num_v_heads, num_k_heads, cp, sm_count)
    num_v_heads, num_k_heads = int(num_v_heads), int(num_k_heads)
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = check_device_arg(device)   # cuda -> cuda:N (tensors report it; compare equal)
    arch, sm_count = _resolve_arch(device, arch, None if sm_count is None else int(sm_count))
    model = load_cost_model(arch)
    sm = sm_count or model.sm_count
    if supported_strategies is None:
        supported_strategies = supported_prefill_strategies(device)
    supported_strategies = check_strategies(supported_strategies)
    chunks = seq_chunks(lens)
    choice = _choose(model, chunks, num_v_heads, sm, cp, supported_strategies)
    rows = _segment_rows(chunks, choice.segment_chunks)
    maps_vs = _maps_v_split(model, chunks, num_v_heads, sm, cp, choice.v_split, choice.segment_chunks)
    host, cu_t, off_t, seg_t = _upload(lens, chunks, rows, device)
    return PrefillPlan(
        seq_lens=tuple(lens), num_v_heads=num_v_heads, num_k_heads=num_k_heads,
        strategy=choice.strategy, v_split=choice.v_split, segment_chunks=choice.segment_chunks,
        maps_v_split=maps_vs, cp=cp, arch=arch, sm_count=sm, estimated_us=choice.estimated_us, device=device,
        cu_seqlens=cu_t, chunk_offsets=off_t, segments=seg_t, host_buffer=host)


def force_plan(plan: PrefillPlan, strategy: str, v_split: int, segment_chunks: int = 0,
               cp: str | None = None, maps_v_split: int | None = None) -> PrefillPlan:
    """``plan``'s batch with a fixed strategy instead of the cost model's choice (sweeps, tests):
    the index tensors and the segment table rebuilt for it, a fresh kernel_cache, and
    estimated_us the model's figure for it. ``segment_chunks`` (>= 1) only with "cp".
    ``cp``: the mode the kernels see (default the plan's; "auto" lets a cut use gate warmup,
    "exact" never truncates). A cut forced on an "off" plan gets "exact": "off" cannot cut.
    ``maps_v_split``: the CP maps pass's split (default the planner's rule, _maps_v_split)."""
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan: expected a PrefillPlan, got {type(plan).__name__}")
    if strategy not in ALL_STRATEGIES:
        raise ValueError(f"strategy: expected one of {sorted(ALL_STRATEGIES)}, got {strategy!r}")
    v_split = check_int("v_split", v_split)
    segment_chunks = check_int("segment_chunks", segment_chunks)
    if maps_v_split is not None:
        maps_v_split = check_int("maps_v_split", maps_v_split)
    if v_split not in V_SPLITS or (strategy != "cp" and (strategy == "plain") != (v_split == 1)):
        raise ValueError(f"v_split: expected 1 for plain, 2 or 4 for vsplit, one of {V_SPLITS} for cp; "
                         f"got {v_split} for {strategy!r}")
    if (strategy == "cp") != (segment_chunks >= 1):
        raise ValueError(f"segment_chunks: expected >= 1 with cp and 0 otherwise, got {segment_chunks} for {strategy!r}")
    if cp is None:
        cp = "exact" if strategy == "cp" and plan.cp == "off" else plan.cp
    if cp not in CP_MODES or (strategy == "cp" and cp == "off"):
        raise ValueError(f"cp: expected one of {CP_MODES} (not 'off' with a cut), got {cp!r} for {strategy!r}")
    lens = list(plan.seq_lens)
    chunks = seq_chunks(lens)
    model = load_cost_model(plan.arch)
    if maps_v_split is None:
        maps_v_split = _maps_v_split(model, chunks, plan.num_v_heads, plan.sm_count, cp, v_split, segment_chunks)
    elif strategy != "cp" or maps_v_split not in V_SPLITS:
        raise ValueError(f"maps_v_split: one of {V_SPLITS} with a cut (cp), got {maps_v_split} for {strategy!r}")
    host, cu_t, off_t, seg_t = _upload(lens, chunks, _segment_rows(chunks, segment_chunks), plan.device)
    est = _score(model, chunks, plan.num_v_heads, plan.sm_count, v_split, segment_chunks) if any(chunks) else 0.0
    return dataclasses.replace(plan, strategy=strategy, v_split=v_split, segment_chunks=segment_chunks,
                               maps_v_split=maps_v_split, cp=cp, estimated_us=est, cu_seqlens=cu_t,
                               chunk_offsets=off_t, segments=seg_t, host_buffer=host, kernel_cache={})
