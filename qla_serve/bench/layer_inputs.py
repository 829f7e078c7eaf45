"""The bench layer's inputs: its rows (one engine step each) and one row's tensors and caches.

:class:`Row` is one engine step (spec decodes, decodes, prefills) and :func:`parse_row` its text
form (``1x32768``, ``d32+4x512``, ``s8x3+4x512``, ``mixed``); :class:`LayerCase` draws a row's
inputs, weights and caches (:func:`make_caches`: vLLM's paged layout, a compact one, SGLang's
mamba pool) with disjoint random slot sets, and :func:`slot_sets_for` says how many sets a row's
timing cycles through. ``qla-serve bench layer`` (bench/layer.py) times the layer on them; its
module docstring says how the inputs are drawn.
"""

from __future__ import annotations

import dataclasses
import math

from .composed_common import HD

CONV_WIDTH = 4
NULL_SLOT = 0
NAMED_ROWS = {"mixed": (2048, 1024, 4096, 512, 512)}   # a chunked-prefill step of mixed lengths
DECAYS = ("weak", "init")        # LayerCase's A_log draws (--decay)
MAX_SLOT_SETS = 256             # decode graphs: at most this many calls (disjoint slot sets)


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Row:
    """One engine step: ``spec`` speculative (MTP) decodes of ``spec_len`` tokens each (1 +
    drafts) first, as vLLM orders a step's requests, then ``decodes`` one-token sequences, then
    prefills of ``prefill_lens``. A spec decode's states go to ``spec_len`` slots (one per draft
    position, vLLM's layout); vLLM counts a step's non-spec decodes as prefills beside spec
    decodes (gdn_attn.py), so a row has spec decodes or plain decodes, not both."""

    name: str
    decodes: int
    prefill_lens: tuple[int, ...]
    spec: int = 0
    spec_len: int = 0

    @property
    def spec_tokens(self) -> int:
        return self.spec * self.spec_len

    @property
    def tokens(self) -> int:
        return self.spec_tokens + self.decodes + sum(self.prefill_lens)

    @property
    def seqs(self) -> int:
        return self.spec + self.decodes + len(self.prefill_lens)

    @property
    def slots_per_set(self) -> int:
        """SSM slots one step's batch holds: one per sequence, a spec decode's per token."""
        return self.spec_tokens + self.decodes + len(self.prefill_lens)

    @property
    def decode_only(self) -> bool:
        return not self.prefill_lens


def parse_row(text: str) -> Row:
    """A row from its text: items joined by '+', each ``dB`` (B decodes, at most one such item),
    ``sNxD`` (N spec decodes of D = 1 + drafts tokens, D >= 2; not beside ``dB``), ``NxL`` (N
    prefills of L tokens) or ``L`` (one prefill); or a name in NAMED_ROWS.
    E.g. ``1x32768``, ``mixed``, ``2048+1024+512``, ``d32``, ``d32+4x512``, ``s8x3+4x512``."""
    text = text.strip()
    if text in NAMED_ROWS:
        return Row(text, 0, NAMED_ROWS[text])
    decodes, spec, lens = None, None, []
    for item in text.split("+"):
        try:
            if item.startswith("d"):
                if decodes is not None:
                    raise ValueError("more than one decode item")
                decodes = positive_int(item[1:])
            elif item.startswith("s"):
                if spec is not None:
                    raise ValueError("more than one spec item")
                n, length = item[1:].split("x")
                spec = (positive_int(n), positive_int(length))
                if spec[1] < 2:
                    raise ValueError("a spec decode has 1 + drafts >= 2 tokens")
            elif "x" in item:
                n, length = item.split("x")
                lens += [positive_int(length)] * positive_int(n)
            else:
                lens.append(positive_int(item))
        except ValueError as exc:
            raise ValueError(f"row {text!r}: bad item {item!r} ({exc}); expected dB, sNxD, NxL or L "
                             f"joined by '+', or one of {sorted(NAMED_ROWS)}") from None
    if spec and decodes:
        raise ValueError(f"row {text!r}: spec decodes beside plain decodes (vLLM counts a step's non-spec "
                         "decodes as prefills beside spec decodes: write them as prefills of 1 token)")
    return Row(text, decodes or 0, tuple(lens), *(spec or (0, 0)))


def positive_int(s: str) -> int:
    """int(s), which must be > 0 (ValueError otherwise)."""
    n = int(s)
    if n <= 0:
        raise ValueError(f"{n} is not positive")
    return n


# ---------------------------------------------------------------------------------------------
# Inputs and caches
# ---------------------------------------------------------------------------------------------

def slot_sets_for(row: Row, hv: int, state_dtype, l2_bytes: int) -> int:
    """How many disjoint slot sets a row's timing cycles through: decode-only rows enough that their
    SSM states (read and written once per call) exceed ``l2_bytes`` between reuses (at most
    MAX_SLOT_SETS); rows with prefills one (their activations dwarf the states)."""
    if not row.decode_only:
        return 1
    set_bytes = row.slots_per_set * hv * HD * HD * state_dtype.itemsize
    return max(2, min(MAX_SLOT_SETS, math.ceil(l2_bytes / set_bytes)))


def make_caches(num_slots, dim, hv, state_dtype, conv_dtype, device, layout="paged", extra_cols=0):
    """(conv_state [S, dim, W-1 + extra_cols], ssm_state [S, Hv, 128, 128], backing buffers).
    ``extra_cols``: vLLM's conv state under speculative decoding, W - 1 + drafts columns (its
    sliding window, gdn_layer's module doc). ``paged``: vLLM's
    layout, one uint8 page per slot holding the conv state (stored [W-1, dim], seen transposed) and,
    256-byte aligned after it, the SSM state; the page stride exceeds both. ``compact``: a
    transposed contiguous conv tensor and a contiguous SSM tensor. ``sglang``: SGLang 0.5.23's
    mamba pool (srt/mem_cache/memory_pool.py:722-729): a contiguous conv tensor, the window axis
    innermost, and a contiguous SSM tensor."""
    import torch

    h = CONV_WIDTH - 1 + extra_cols
    if layout == "sglang":
        conv = torch.zeros(num_slots, dim, h, dtype=conv_dtype, device=device)
        ssm = torch.zeros(num_slots, hv, HD, HD, dtype=state_dtype, device=device)
        return conv, ssm, [conv, ssm]
    if layout == "compact":
        conv_raw = torch.zeros(num_slots, h, dim, dtype=conv_dtype, device=device)
        ssm = torch.zeros(num_slots, hv, HD, HD, dtype=state_dtype, device=device)
        return conv_raw.transpose(1, 2), ssm, [conv_raw, ssm]
    conv_bytes = dim * h * conv_dtype.itemsize
    ssm_bytes = hv * HD * HD * state_dtype.itemsize
    off = -(-conv_bytes // 256) * 256
    raw = torch.zeros(num_slots, off + ssm_bytes + 256, dtype=torch.uint8, device=device)
    conv = raw[:, :conv_bytes].view(conv_dtype).view(num_slots, h, dim).transpose(1, 2)
    ssm = raw[:, off:off + ssm_bytes].view(state_dtype).view(num_slots, hv, HD, HD)
    return conv, ssm, [raw]


class LayerCase:
    """One row's inputs, weights and caches on ``device``, with ``nsets`` disjoint random slot sets.

    Attributes: hk, hv, row, dim, mixed_qkv [T, dim], a, b [T, Hv] (io_dtype), conv_weight [dim, W],
    conv_bias [dim] (io_dtype), A_log, dt_bias [Hv] fp32, conv_state, ssm_state (see make_caches;
    a spec row's conv state has spec_len - 1 more columns), out [T, Hv, 128], has_initial_state
    (host list, one per prefill), num_accepted (host list, one per spec decode: 1..spec_len, the
    previous step's accepted tokens), slot_sets (host lists of slot ids: each spec decode's
    spec_len slots, then the decodes', then the prefills').
    """

    def __init__(self, hk, hv, row: Row, state_dtype, device, *, nsets=1, seed=0, io_dtype=None,
                 layout="paged", decay="weak"):
        import torch

        self.hk, self.hv, self.row, self.device, self.layout = hk, hv, row, torch.device(device), layout
        io = io_dtype or torch.bfloat16
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.dim = (2 * hk + hv) * HD
        T, N = row.tokens, row.seqs

        def rnd(*shape, scale=1.0):
            return torch.randn(*shape, generator=gen, device=self.device) * scale

        def uni(n, lo, hi):
            return torch.rand(n, generator=gen, device=self.device) * (hi - lo) + lo

        self.mixed_qkv, self.a, self.b = rnd(T, self.dim).to(io), rnd(T, hv).to(io), rnd(T, hv).to(io)
        self.conv_weight = rnd(self.dim, CONV_WIDTH, scale=0.5).to(io)
        self.conv_bias = rnd(self.dim, scale=0.1).to(io)
        if decay not in DECAYS:
            raise ValueError(f"decay: expected one of {DECAYS}, got {decay!r}")
        self.A_log = uni(hv, -1.0, 0.5) if decay == "weak" else torch.log(uni(hv, 1.0, 16.0))
        self.A_log[: max(1, hv // 4)] = -12.0                     # g ~ 0: heads that barely decay
        self.dt_bias = torch.log(torch.expm1(uni(hv, 0.001, 0.1)))
        per_set = row.slots_per_set
        num_slots = 1 + nsets * per_set + max(2, N // 4)          # null slot 0, spare slots
        self.conv_state, self.ssm_state, self.buffers = make_caches(
            num_slots, self.dim, hv, state_dtype, io, self.device, layout, extra_cols=max(0, row.spec_len - 1))
        self.conv_state.copy_(rnd(*self.conv_state.shape).to(io))
        self.ssm_state.copy_(rnd(*self.ssm_state.shape, scale=0.1).to(state_dtype))
        self.out = torch.zeros(T, hv, HD, dtype=io, device=self.device)
        perm = (torch.randperm(num_slots - 1, generator=gen, device=self.device) + 1).tolist()
        self.slot_sets = [perm[i * per_set:(i + 1) * per_set] for i in range(nsets)]
        self.has_initial_state = [i % 2 == 0 for i in range(len(row.prefill_lens))]
        self.num_accepted = torch.randint(1, row.spec_len + 1, (row.spec,), generator=gen,
                                          device=self.device).tolist() if row.spec else []
        self._device_sets = {}

    def slots(self, i: int):
        """(decode slots, prefill slots, prefill has_initial_state) of set i as device tensors
        (int32 ids, bool flags; None where empty), uploaded once: an engine's metadata builder
        hands the step plan device tensors, so the plan's host time leaves their upload out."""
        import torch

        hit = self._device_sets.get(i)
        if hit is None:
            ids, D = self.slot_sets[i][self.row.spec_tokens:], self.row.decodes
            up = lambda xs, dt=torch.int32: torch.tensor(xs, dtype=dt).to(self.device) if xs else None  # noqa: E731
            hit = self._device_sets[i] = (up(ids[:D]), up(ids[D:]), up(self.has_initial_state, torch.bool))
        return hit

    def spec_slots(self, i: int):
        """(spec slots [N, spec_len], spec cu_seqlens [N + 1], num_accepted [N]) of set i as int32
        device tensors, as vLLM's metadata holds them (None where the row has no spec decodes)."""
        import torch

        row = self.row
        if not row.spec:
            return None
        key = ("spec", i)
        hit = self._device_sets.get(key)
        if hit is None:
            up = lambda xs: torch.tensor(xs, dtype=torch.int32).to(self.device)  # noqa: E731
            ids = self.slot_sets[i][:row.spec_tokens]
            hit = self._device_sets[key] = (up(ids).view(row.spec, row.spec_len),
                                            up(list(range(0, row.spec_tokens + 1, row.spec_len))),
                                            up(self.num_accepted))
        return hit

    def snapshot(self):
        """Copies of the caches' backing buffers (every byte, padding included)."""
        return [b.clone() for b in self.buffers]

    def restore(self, snap) -> None:
        """Put a :meth:`snapshot` back, in place (the cache views stay valid)."""
        for b, s in zip(self.buffers, snap):
            b.copy_(s)

    def layer_kwargs(self) -> dict:
        """The keyword arguments every impl's layer function takes."""
        return dict(conv_weight=self.conv_weight, conv_bias=self.conv_bias, conv_state=self.conv_state,
                    ssm_state=self.ssm_state, A_log=self.A_log, dt_bias=self.dt_bias,
                    num_k_heads=self.hk, out=self.out)
