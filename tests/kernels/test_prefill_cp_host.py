"""Host side of the Hopper prefill's exact context parallelism (kernels/hopper/prefill_launch.py):
the segment work tables and the map-index contract the three CP kernels share. CPU only; the
kernels themselves run in tests/kernels/test_prefill_gpu.py (test_cp_exact*) on the H200.

Here the "maps" pass and the scan kernel are replaced by the float64 algebra their docstrings
state (each segment's end state from zero and its transition Phi, from
reference._chunk_products; then X_k = X_{k-1} @ maps[m, 1] + maps[m, 0] for k < cut_levels[j]),
written to and read from the tables' map indices: the scanned entries must be the
recurrence's state at every segment end, exactly where the output items look for them.
"""

import math

import torch

import qla_serve
from qla_serve.kernels import reference
from qla_serve.kernels.hopper import prefill_api as P
from qla_serve.kernels.hopper import prefill_launch as PL
from qla_serve.plan import force_plan


def _plan(lens, L, hv=4, hk=2):
    plan = qla_serve.plan_prefill(lens, hv, hk, device="cpu", cp="off", arch="sm90",
                                  supported_strategies={"plain", "vsplit"})
    return force_plan(plan, "cp", 1, L)


def test_tables_tile_every_sequence_once():
    lens = [64 * 9 + 5, 0, 64 * 3, 64 * 4 + 1, 1]
    L = 3
    cp = PL._CPTables(_plan(lens, L), torch.device("cpu"))
    chunks = [math.ceil(n / 64) for n in lens]
    cut = [s for s, c in enumerate(chunks) if c > L]  # 0 (10 chunks) and 3 (5 chunks)
    assert cp.num_cut == len(cut) == 2 and cp.levels == 3 and cp.cut_levels.tolist() == [3, 1]
    covered = {s: [] for s in range(len(lens))}
    for s, first, n, m in cp.out_items.tolist():
        covered[s].extend(range(first, first + n))
        if first:  # starts from the end state of its previous segment, stored by the maps pass
            j = cut.index(s)
            assert m == (first // L - 1) * cp.num_cut + j
        elif s in cut:  # from the maps pass's copy of the pool state (maps[j, h, 1])
            assert m == cut.index(s)
        else:  # uncut: reads its own pool slot, which no other item writes
            assert m == -1
    assert all(covered[s] == list(range(c)) for s, c in enumerate(chunks))
    # every 0-length sequence still has its (empty) item: its slot gets final = initial state
    assert [1, 0, 0, -1] in cp.out_items.tolist()
    stored = {}
    for s, first, n, m in cp.maps_items.tolist():
        assert s in cut and first + n < chunks[s], "the last segment of a sequence has no map"
        stored[m] = (s, first)
    reads = {m for s, first, n, m in cp.out_items.tolist() if m >= 0}
    assert reads == set(stored), "every map the output pass reads is stored by the maps pass"
    # the pool slot of a cut sequence is read only by the maps pass (its segment 0), never by
    # the output pass, whose last segment writes it
    assert all(m >= 0 for s, first, n, m in cp.out_items.tolist() if s in cut)


def test_warmup_tables_index_what_the_passes_read():
    """The gate-warmup contract (prefill_warmup.py writes, prefill_main / prefill_scan read):
    the finder writes warm_start[cuts[j].out_base + k] for segments k >= 1 of cut sequence j,
    which must be exactly the output items that carry a map (the ones that read warm_start);
    the maps pass reads need_maps[map % num_cut] and the scan need_maps[j]: both must be j."""
    lens = [64 * 9 + 5, 0, 64 * 3, 64 * 4 + 1, 1, 64 * 12]
    L = 3
    plan = _plan(lens, L)
    cp = PL._CPTables(plan, torch.device("cpu"))
    cut = [s for s, n in enumerate(lens) if math.ceil(n / 64) > L]
    out = cp.out_items.tolist()
    written = set()
    for j, (seq, nseg, base) in enumerate(cp.cuts.tolist()):
        assert seq == cut[j] and nseg == math.ceil(math.ceil(lens[seq] / 64) / L)
        assert nseg - 1 == cp.cut_levels[j]
        for kseg in range(nseg):
            assert out[base + kseg][:2] == [seq, kseg * L], "segment k of sequence j is item out_base + k"
        written |= {base + kseg for kseg in range(1, nseg)}
    assert written == {i for i, (_, first, _, m) in enumerate(out) if m >= 0 and first > 0}
    for seq, first, n, m in cp.maps_items.tolist():
        assert cp.cuts[m % cp.num_cut, 0] == seq
    # a warmup stays inside the segment before it: it never reaches chunk 0 (the pool state)
    assert [P.max_warmup_chunks(n) for n in (1, 2, 3, 16, 64)] == [0, 1, 1, 8, 32]


def test_scan_gives_the_true_segment_end_states():
    torch.manual_seed(0)
    hv, hk, L = 4, 2, 2
    lens = [64 * 7 + 13, 64 * 2, 64 * 5]
    T = sum(lens)
    q = reference.l2norm(torch.randn(T, hk, 128, dtype=torch.float64))
    k = reference.l2norm(torch.randn(T, hk, 128, dtype=torch.float64))
    v = torch.randn(T, hv, 128, dtype=torch.float64)
    g = -torch.rand(T, hv, dtype=torch.float64) * 0.05
    g[:, 0] = 0.0
    beta = torch.rand(T, hv, dtype=torch.float64)
    init = torch.randn(len(lens), hv, 128, 128, dtype=torch.float64) * 0.1
    plan = _plan(lens, L, hv, hk)
    cp = PL._CPTables(plan, torch.device("cpu"))
    maps = cp.maps(hv, torch.device("cpu")).double().fill_(float("nan"))
    cu = plan.cu_seqlens_cpu
    qe, ke, ve = reference._expand_heads(q, hv), reference._expand_heads(k, hv), v
    for s, first, n, m in cp.maps_items.tolist():
        # What the "maps" pass computes for this item (V-first, like the pool).
        S = init[s].transpose(-1, -2).clone() if first == 0 else torch.zeros(hv, 128, 128, dtype=torch.float64)
        Phi = torch.eye(128, dtype=torch.float64).expand(hv, 128, 128).clone()
        for c in range(first, first + n):
            t0, t1 = cu[s] + 64 * c, min(cu[s] + 64 * c + 64, cu[s + 1])
            hm = lambda x: x[t0:t1].transpose(0, 1)  # noqa: E731
            U0, Wk, _, gamma, dec = reference._chunk_products(hm(qe), hm(ke), hm(ve), g[t0:t1].T, beta[t0:t1].T,
                                                               1.0)
            KtD = hm(ke).transpose(-1, -2) * dec[..., None, :]
            Tm = gamma[..., -1:, None] * torch.eye(128, dtype=torch.float64) - KtD @ Wk
            S, Phi = Tm @ S + KtD @ U0, Tm @ Phi
        maps[m, :, 0] = S.transpose(-1, -2)
        # a first segment's Phi blocks store its initial state instead (for the output pass)
        maps[m, :, 1] = init[s] if first == 0 else Phi.transpose(-1, -2)
    reference.scan_segment_maps(maps, cp.cut_levels.tolist())  # prefill_scan.py's recurrence
    # The true states at every chunk boundary, from the per-token recurrence.
    for s, first, n, m in cp.out_items.tolist():
        if first == 0:
            if m >= 0:  # a cut sequence's first segment starts from maps[m, :, 1]
                assert torch.equal(maps[m, :, 1], init[s])
            continue
        stop = cu[s] + 64 * first
        _, truth = reference.recurrent_gdn(q[cu[s]:stop], k[cu[s]:stop], v[cu[s]:stop], g[cu[s]:stop],
                                           beta[cu[s]:stop], [0, stop - cu[s]], init[s:s + 1])
        err = (maps[m, :, 0] - truth[0]).norm() / truth[0].norm()
        assert err < 1e-10, f"seq {s} chunk {first}: scanned state rel err {err:.2e}"
