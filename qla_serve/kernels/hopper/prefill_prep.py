"""Prefill stage 1 (state-free, fully parallel): per (chunk, v-head) everything of the chunked
algorithm that does not need the state, so stage 2's sequential chain is two GEMMs per chunk
(form "uw") or three (form "m", which writes a quarter of the bytes).

Grid: one CTA of 128 threads per (group of heads_per_cta v-heads, chunk c), v-heads fastest;
chunks are numbered through the plan's ``chunk_offsets`` (chunk c belongs to the sequence s with
chunk_offsets[s] <= c < chunk_offsets[s+1], found by a binary search in the kernel, so no
per-chunk index tensor is needed). A CTA's heads share one qk-head: it loads q/k and computes
Q K^T and K K^T once (v27, v28), then runs each head's gates, P, solve and M in turn; with
pair_solve (v35, two or four heads on the "mma" solve) two heads' solves at once: their Dinv
substitutions on threads 0-63 / 64-127, their block substitutions on warps 0-1 / 2-3
(csrc/block_solve_pair.cuh), the same operations per head as one after the other.

For a chunk of n <= 64 tokens t0..t0+n-1 of head h (qk-head h // (Hv // Hk)):
  gc[i]   = sum_{j<=i} g[t0+j, h]                           (chunk-local cumsum, fp32)
  L       = StrictLower(diag(beta) K K^T)                    (gate-free)
  A       = (I + L)^-1
  M[i, j] = A[i, j] * beta[j] * exp(gc[i] - gc[j])  (i >= j), 0 above the diagonal
which is the gated inverse by a similarity transform (Gamma o A = D A D^-1, D = diag(exp(gc))),
so the C^2 exponentials are paid once here, off the sequential chain of stage 2. Then
  P       = scale * Lower(Gamma) o (Q K^T)           (the intra-chunk attention)
and, by the form (prep_func's argument), what stage 2 needs for V' = M (V - diag(exp(gc)) K S):
  "m"  (for prefill_main_vfirst.py, V-first): M itself [64, 64]; stage 2 reads v and forms
       V' on its chain (two GEMMs where "uw" needs one, for 16 KB of HBM traffic per chunk
       and head instead of 64: U0 and Wk written here and read back there);
  "uw" (for prefill_main.py, v8):
       U0 = M V                                      [64, 128]
       Wk = M diag(exp(gc)) K  (= diag(exp(gc)) A diag(beta) K)   [64, 128]
       so that stage 2 computes V' = U0 - Wk S.
Stage 2 then computes O = scale exp(gc) Q S + P V'.

The inverse is blocked, and only A diag(beta) is formed (all that M needs): the four 16x16
diagonal blocks of I + L are inverted by forward substitution in fp32 on the CUDA cores (Dinv),
then, with Db = Dinv diag(beta), by one of two solves (prep_func's solve):
  "mma" (form "m"'s default, v31): the block forward substitution W_jj = Db_j,
       W_ij = -Db_i sum_{k=j}^{i-1} KK_ik W_kj (W = A diag(beta)), one block column per warp on
       mma.sync with its operands in registers, M gated and stored by the same helper
       (csrc/block_solve.cuh; reference.block_substitution_solve);
  "wgmma" (form "uw"'s only; v29): with N = Dinv L_off = Db (K K^T)_off (strictly block-lower,
       N^4 = 0), A diag(beta) = (I - N + N^2 - N^3) Db = (I + N^2)(I - N) Db, four 64x64x64 fp16
       tensor-core GEMMs with fp32 accumulation in three round trips through shared memory (N;
       N^2 and (I - N) Db; the last product) (reference.blocked_solve).
Both take fp16 operands and accumulate in fp32. K K^T is beta-free, so it is computed once per
CTA. fp16 (11-bit mantissa) rather than bf16 for these operands and the outputs: the bf16
variant misses the 2e-3 relative-L2 budget against the float64 recurrence (see
benchmarks/prefill.md, "Numerics"; full text: `git show 99e7d48:benchmarks/prefill.md`). q, k and v are used as
loaded (their dtypes): Q K^T and K K^T are exact products with fp32 sums, and in form "uw" M
meets V and K each as hi + lo in that tile's dtype (M = hi + lo to ~2^-16 relative), two GEMMs
each, so no tile is converted in shared memory. Form "m" stores M rounded once to fp16 (as v10
did before its U0 = M V).

Outputs (workspace, chunk-major so stage 2 loads each tile with one TMA copy; all 64 rows, rows
>= n finite and only ever meeting zero weights in stage 2):
  fbuf [NC, Hv, 2, 64] fp32: exp(gc[i]) and dec[i] = exp(gc[63] - gc[i]) (0 for rows >= n; rows
       >= n have g = 0, so gc[63] = gc[n-1] and exp(gc[63]) is the chunk's total decay);
  pbuf [NC, Hv, 64, 64] fp16 (P; not written when packed);
  form "m": mbuf [NC, Hv, 64, 64] fp16 (M, zero above the diagonal and in columns >= n);
  packed (form "m"): mbuf [NC, Hv, 64, 64] fp16, P and M packed into one tile, both being lower
       triangular: P^T on and above the diagonal, M's strict lower triangle below it; dbuf
       [NC, Hv, 64] fp16, M's diagonal. P^T comes from K Q^T and leaves first, by a TMA store
       (zeros below the diagonal); M's part is added into the same tile by a TMA reduce (x + 0
       is exact), so a chunk and head cross HBM as 8 KB where P and M apart took 16 (stage 2
       unpacks the tile in shared memory, csrc/unpack_pm.cuh);
  form "uw": ubuf (U0) and wbuf (-Wk, negated so stage 2 accumulates onto U0) [NC, Hv, 64, 128],
       fp16;
  for bf16 q/k also qh, kh [T, Hk, 128]: fp16 copies of q and k (exact for unit-norm rows down to
  6e-5), so stage 2's tensor-core operands are fp16 without converting on its sequential chain
  (fp16 q/k, also beside bf16 v, go to stage 2 as they are: no copies).
Every output tile leaves through a swizzled shared-memory tile and a TMA store: written from the
fragment by stmatrix (conflict-free only because the tile is swizzled: v12), not by scalar 2- and
4-byte global stores (v9's prep: those stores and their address arithmetic were a fifth of its
warp stall samples; benchmarks/prefill.md v10). The fp16 q/k copies go straight from the loaded
tiles to global memory in 16-byte stores.

Occupancy (v11): 49 KB of shared memory and <= 128 registers, so 4 CTAs (16 warps) per SM
share the latency of each CTA's serial phases (v10: 65 KB, 3 CTAs); form "m" takes 34 KB and
<= 102 registers, 5 CTAs (v15); with two or four heads per CTA 4 CTAs (v29: 96, 109 and 121
registers at one, two and four heads, no spills; v27 spilled 24-148 bytes). v31's mma solve
takes 87, 93 and 107 registers at one, two and four heads (91, 94 and 111 with the packed P^T / M
tile): five, five and four CTAs per SM by their registers (the launch bounds ask for five, four
and four); v35's pair solve 93 and 126 at two and four heads (five and four CTAs). Which heads
per CTA a call takes (prefill_api.prep_heads_per_cta) is fit on v35 on an H100: four heads from
~7 chunk-heads per SM, else the fewest whose CTAs fit one wave (benchmarks/prefill.md "Stage 1's
pair solve").
Where the time goes (ncu, v32, 2/8 64x512, four heads per CTA): latency, not issue: 1.3
instructions per SM cycle, 0.48 eligible warps per scheduler; a third of the stall samples wait
on the CTA's first loads (the q/k TMA 16%, g and beta 8%, the chunk's binary search 6%) and a
quarter at barriers. Earlier (v17), fewer instructions was time saved: every masked elementwise
product is computed for all elements and masked afterwards (a conditional product compiled to a
branch per element), each gate factor is one ex2 of base-2 exponents kept in shared memory
(scale folded in), and the solve's tiles leave their fragments by stmatrix: 2307 -> 1481 SASS
instructions in form m's main span
(ptxas), 19-27% less GPU time (v29: 1374-1433, `benchmarks/kernel_report.py prep 2/8 bfloat16 m
float16`).
Figures of every version: benchmarks/prefill.md ("v11-v13", "v14" for form "m", "v17"), and
benchmarks/HISTORY.md (v28, v29: the shared K K^T and the three-trip solve; v31: the mma solve,
benchmarks/prefill.md "Stage 1's solve on mma.sync").
"""


from pathlib import Path

import tilelang
import tilelang.language as T

from .common import FAST_MATH_SOURCE

C = 64  # chunk length
DK = 128
DV = 128

PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
_LOG2E = 1.4426950408889634
MM_DTYPE = "float16"  # the tensor-core operands' dtype (module docstring)
ACC = "float32"


FORMS = ("uw", "m")
# How form "m" solves for A diag(beta) after the diagonal blocks' substitution: "mma" (its
# default), the block forward substitution on mma.sync with its operands in registers
# (csrc/block_solve.cuh); "wgmma" (form "uw"'s only), three 64x64 products through shared memory
# ((I + N^2)(I - N) Db, _solve).
SOLVES = ("wgmma", "mma")
DEFAULT_SOLVE = {"m": "mma", "uw": "wgmma"}
SOLVE_SOURCE = FAST_MATH_SOURCE + (Path(__file__).with_name("csrc") / "block_solve.cuh").read_text()
PAIR_SOLVE_SOURCE = SOLVE_SOURCE + (Path(__file__).with_name("csrc") / "block_solve_pair.cuh").read_text()


def staging_tile():
    """A [64, 64] fp16 tile in shared memory, swizzled: stmatrix from a fragment into a plain
    row-major tile puts the 8 rows of each 8x8 matrix in the same banks (8-way conflicts;
    ncu on v11: 31% of prep's shared-memory wavefronts, with L1 82% busy). Swizzled, a TMA
    store from it goes through a tensor map in 64-column boxes."""
    tile = T.alloc_shared((C, C), MM_DTYPE)
    T.annotate_layout({tile: tilelang.layout.make_swizzled_layout(tile)})
    return tile


@T.macro
def kk_blocks(k_s, kk_f, kd_s, koff_s):
    """K K^T of the CTA's chunk, once for all its heads (it is gate- and beta-free): its
    diagonal 16x16 blocks to kd_s in fp32 for the substitution, the blocks below them to
    koff_s in fp16 for the tensor-core products (v28; until then K K^T was computed again
    for each head and scaled by its beta). The diagonal blocks go to kd_s unmasked: the
    substitution reads only their strict upper triangle (row m, columns r > m), which is the
    lower one by symmetry."""
    T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
    for i, c in T.Parallel(C, C):
        if i // 16 == c // 16:
            kd_s[i // 16, i % 16, c % 16] = kk_f[i, c]
    for i, c in T.Parallel(C, C):
        kk_f[i, c] = T.if_then_else(i // 16 > c // 16, kk_f[i, c], 0.0)
    T.copy(kk_f, koff_s)


def diag_blocks(first_thread: int = 0):
    """_diag_blocks below for a warpgroup whose first thread is first_thread (0: stage 1's
    CTA; prefill_fused.py's solve warpgroup: its own), as a macro."""

    @T.macro
    def _diag_blocks(j, kd_s, b_s, db_s, zero_off_diagonal):
        """Head j's Db = Dinv diag(beta) into the diagonal 16x16 blocks of db_s (fp16), Dinv the
        inverse of I + L's diagonal blocks, by forward substitution in registers, one thread per
        (block b, column c) holding column c of Dinv_b, x_r = Dinv_b[r, c] for rows r = 0..15:
          x_r = [c == r] - beta_r sum_{m<r} KK_b[r, m] x_m
        right-looking (v32): once x_m is final it is added into every later row's sum,
        s_r += KK_b[m, r] x_m for r > m (row m of the block: K K^T is symmetric, and a row is a
        broadcast, vectorizable read), so the dependent chain is two FMAs per row, 32 in all,
        where the row-by-row sums (v29-v31) chained 120. x_m times beta_c goes straight into
        db_s (v29: v28 went through an fp32 buffer and a fragment, 28 KB more shared-memory
        traffic per head). Threads 0-63 (warps 0-1) do it; with zero_off_diagonal, warps 2-3
        meanwhile zero the other blocks, one row each (the wgmma solve multiplies the whole tile;
        the mma solve reads the diagonal blocks only). (v11 kept the column in shared memory: a
        barrier and a dependent load per row.) Entries above the diagonal come out exactly 0, so
        every product keeps A's upper triangle exactly 0."""
        tx = T.get_thread_binding() if first_thread == 0 else T.get_thread_binding() - first_thread
        blk = (tx % 64) // 16
        col = tx % 16
        dcol = T.alloc_local((16,), ACC)  # row r: the running sum s_r, then x_r
        if tx < 64:
            for r in T.unroll(16):
                dcol[r] = 0.0
            for m in T.unroll(16):
                dcol[m] = T.if_then_else(col == m, 1.0, 0.0) - b_s[j, blk * 16 + m] * dcol[m]
                for r in T.unroll(m + 1, 16):
                    dcol[r] = dcol[r] + kd_s[blk, m, r] * dcol[m]
            beta_col = b_s[j, blk * 16 + col]
            for r in T.unroll(16):
                db_s[blk * 16 + r, blk * 16 + col] = T.cast(dcol[r] * beta_col, MM_DTYPE)
        elif zero_off_diagonal:
            row = tx - 64
            for cb in T.unroll(4):
                if cb != row // 16:
                    for c in T.vectorized(16):
                        db_s[row, cb * 16 + c] = T.cast(0.0, MM_DTYPE)

    return _diag_blocks


def resolve_solve(form: str, solve: str | None = None) -> str:
    """The solve a prep of this form runs: solve, or the form's DEFAULT_SOLVE; refused by name
    where the form has no such solve ("mma" is form "m"'s only)."""
    solve = solve or DEFAULT_SOLVE[form]
    if solve not in SOLVES or (solve != "wgmma" and form != "m"):
        raise ValueError(f"solve: expected one of {SOLVES} ('mma' with form 'm' only), got {solve!r} (form {form!r})")
    return solve


def pair_solve_fits(form: str, solve: str | None, heads_per_cta: int) -> bool:
    """Whether a prep of this form, solve (None: the form's default) and heads per CTA can solve
    its heads two at a time (pair_solve): form "m" on the mma solve with two or four heads."""
    return form == "m" and resolve_solve(form, solve) == "mma" and heads_per_cta >= 2


def ctas_per_sm(form: str, heads_per_cta: int = 1) -> int:
    """The CTAs per SM prep's launch bounds claim: five for form "m" with one head per CTA
    (<= 102 registers, 34 KB), else four (form "uw": <= 128 registers, 49 KB; several heads:
    113-128 registers, 43-45 KB). prefill_api's heads-per-CTA rule takes one head where one wave
    of one-head CTAs holds the call."""
    return 5 if form == "m" and heads_per_cta == 1 else 4


def resident_ctas_per_sm(form: str, heads_per_cta: int = 1, pair_solve: bool = False) -> int:
    """The CTAs per SM that prep's resources let run at once: ctas_per_sm's claim, but five for
    two heads solved as a pair, whose 93 registers and 43 KB (sm_90a) fit five where its launch
    bounds claim four (tests/kernels/test_prefill_compile.py::test_prep_pair_solve checks the
    five). prefill_api's heads-per-CTA rule counts its one wave with these."""
    return 5 if pair_solve and heads_per_cta == 2 else ctas_per_sm(form, heads_per_cta)


def prep_func(num_v_heads: int, num_k_heads: int, io_dtype: str, form: str = "uw",
              qk_dtype: str | None = None, heads_per_cta: int = 1, solve: str | None = None,
              packed: bool = False, pair_solve: bool = False):
    """Build the stage-1 PrimFunc for (Hv, Hk, io dtype, form, q/k dtype, solve); T (tokens), N
    (sequences) and the number of chunks are symbolic, so one compile serves every batch. solve
    (SOLVES): form "m"'s "mma" (its default) or "wgmma"; form "uw" takes "wgmma" only.

    io_dtype is v's (and the output's); q and k are qk_dtype (default io_dtype). fp16 q/k
    beside bf16 v is what gdn_prefill_inputs(..., qk_dtype=torch.float16) hands over: stage 2
    reads such q/k as they are, so this kernel writes no fp16 copies (v21's measurement: prep
    -10% without them).

    form "uw" (for prefill_main.py, v8) writes P, U0 and -Wk; form "m" (for
    prefill_main_vfirst.py) writes P and M itself, and the stage-2 kernel forms
    V' = M (V - diag(exp(gc)) K S) on its chain; packed (form "m" only): P^T and M packed into
    mbuf's one tile, M's diagonal into dbuf, instead of P into pbuf and M into mbuf (the
    whole-sequence plans' stage 2 at v_split 1 unpacks it; the context-parallel passes and
    V-split plans read the tiles apart, prefill_api.packed_tiles). All take the same arguments;
    the outputs a form does not write have their own symbolic row counts, so the host passes
    1-row stand-ins.

    heads_per_cta (form "m" only; a divisor of Hv / Hk): the v-heads one CTA computes, all of
    one qk-head. The q/k tiles and Q K^T depend on the qk-head alone, so the CTA loads q/k and
    computes Q K^T once for its heads, then each head's gates, P, L, inverse and M (grid
    Hv / heads_per_cta x chunks)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    mma_solve = resolve_solve(form, solve) == "mma"
    uw_form = form == "uw"
    if packed and uw_form:
        raise ValueError("packed: form 'm' only (form 'uw' writes U0 and -Wk, no M)")
    if pair_solve and not pair_solve_fits(form, solve, heads_per_cta):
        raise ValueError("pair_solve: form 'm' on the mma solve with two or four heads per CTA only")
    qk_dtype = qk_dtype or io_dtype
    Hv, Hk = num_v_heads, num_k_heads
    group = Hv // Hk
    hpc = heads_per_cta
    if hpc < 1 or group % hpc or (hpc > 1 and uw_form):
        raise ValueError(f"heads_per_cta must divide Hv / Hk = {group} (and be 1 for form 'uw'), got {hpc}")
    ntok = T.dynamic("ntok")
    nseq = T.dynamic("nseq")
    nchunk = T.dynamic("nchunk")
    sq0 = T.dynamic("sq0")
    sq1 = T.dynamic("sq1")
    sk0 = T.dynamic("sk0")
    sk1 = T.dynamic("sk1")
    sv0, sv1 = T.dynamic("sv0"), T.dynamic("sv1")
    # The outputs a form does not write: their own row counts, so 1-row stand-ins fit.
    nuw = nchunk if uw_form else T.dynamic("nuw")
    nm = T.dynamic("nm") if uw_form else nchunk
    np_ = T.dynamic("np") if packed else nchunk  # packed: P^T in mbuf's tile
    nd = nchunk if packed else T.dynamic("nd")  # M's diagonal, packed only
    mm_dtype = "float16"
    acc = "float32"
    copy_qk = qk_dtype != mm_dtype  # stage 2 wants fp16 q/k
    if copy_qk:
        # The fp16 copies this kernel writes: contiguous (prefill_api allocates them), so the
        # stores below vectorize to 16 bytes.
        # (two annotation objects: one shared object would bind both parameters to one buffer)
        qh_type = T.Tensor((ntok, Hk, DK), mm_dtype)
        kh_type = T.Tensor((ntok, Hk, DK), mm_dtype)
    else:  # q and k themselves, passed through unread
        qh_type = T.StridedTensor((ntok, Hk, DK), (T.dynamic("sqh0"), T.dynamic("sqh1"), 1), mm_dtype)
        kh_type = T.StridedTensor((ntok, Hk, DK), (T.dynamic("skh0"), T.dynamic("skh1"), 1), mm_dtype)

    # M meets V and K in the io dtype, as hi + lo (M = hi + lo to ~2^-16 relative in bf16, finer
    # than one fp16 rounding's 2^-11): two GEMMs on the tiles as loaded instead of converting
    # them to fp16 (v10). M rounded once to bf16 would miss the error budget (Numerics in
    # benchmarks/prefill.md; full text: `git show 99e7d48:benchmarks/prefill.md`).
    @T.macro
    def _store_split(f, hi_s, lo_s, dtype):
        """fp32 fragment f [64, 64] -> hi_s = dtype(f), lo_s = dtype(f - hi); leaves f - hi in f."""
        T.copy(f, hi_s)
        for i, j in T.Parallel(C, C):
            f[i, j] = f[i, j] - T.cast(T.cast(f[i, j], dtype), acc)
        T.copy(f, lo_s)

    @T.macro
    def _split_times(hi_s, lo_s, b_s, x_f):
        """x_f = (hi_s + lo_s) @ b_s, fp32 accumulation."""
        T.gemm(hi_s, b_s, x_f, clear_accum=True)
        T.gemm(lo_s, b_s, x_f)

    @T.macro
    def _gated_m(t_f, g2_s, j):
        """A diag(beta) in t_f (_solve) -> M = Gamma o (A diag(beta)) of the CTA's head j (row j
        of the gate arrays), lower triangle incl. the diagonal, zero above it: M[i, c] =
        (A diag(beta))[i, c] exp2(g2_i - g2_c), one exponential and one product per element
        (g2 = gc log2(e); the exponent is <= 0 on and below the diagonal since g <= 0: no
        overflow). Computed for every element, then masked: a conditional product compiles to
        a branch per element (above the diagonal the factor may be inf, and the select drops
        it)."""
        for i, c in T.Parallel(C, C):
            t_f[i, c] = t_f[i, c] * T.exp2(g2_s[j, i] - g2_s[j, c])
        for i, c in T.Parallel(C, C):
            t_f[i, c] = T.if_then_else(i >= c, t_f[i, c], 0.0)

    @T.macro
    def _write_u0_wk(v, ubuf, wbuf, t0, h, cid, k_s, g2_s, eg_s, t_f):
        """Form "uw": from A diag(beta) in t_f, U0 = M V and -Wk = (-Mg) K to ubuf / wbuf."""
        v_s = T.alloc_shared((C, DV), io_dtype)
        m_s = T.alloc_shared((C, C), io_dtype)
        ml_s = T.alloc_shared((C, C), io_dtype)
        x_s = T.alloc_shared((C, DV), mm_dtype)  # U0, then -Wk, on their way out
        x_f = T.alloc_fragment((C, DK), acc)
        v_bar = T.alloc_barrier(128)
        T.annotate_layout({x_s: tilelang.layout.make_swizzled_layout(x_s)})
        # v is loaded this late so that its tile shares shared memory with the solve's
        # (4 CTAs per SM); M's construction overlaps its latency.
        T.tma_copy(v[t0:t0 + C, h, 0:DV], v_s, barrier=v_bar)
        # M, and -Mg = -M diag(exp(gc)) = -diag(exp(gc)) A diag(beta) (negated so the GEMM below
        # yields -Wk directly; exp(gc) <= 1: no overflow). U0 = M V, then -Wk = (-Mg) K, all 64
        # rows (rows >= n are finite, never weighted).
        _gated_m(t_f, g2_s, 0)
        _store_split(t_f, m_s, ml_s, io_dtype)
        T.barrier_arrive(v_bar)
        T.barrier_wait(v_bar, 0)
        _split_times(m_s, ml_s, v_s, x_f)
        T.copy(x_f, x_s)
        T.copy(x_s, ubuf[cid, h, :, :])
        # -Mg from M's stored parts (M = hi + lo to ~2^-16): holding it in registers
        # beside U0's accumulator would take prep past 128 registers (4 CTAs per SM).
        for i, j in T.Parallel(C, C):
            t_f[i, j] = -(T.cast(m_s[i, j], acc) + T.cast(ml_s[i, j], acc)) * eg_s[0, j]
        if qk_dtype == io_dtype:
            _store_split(t_f, m_s, ml_s, io_dtype)
            _split_times(m_s, ml_s, k_s, x_f)
        else:
            # -Mg meets K as hi + lo in K's dtype (fp16 q/k beside bf16 v): tiles of its own,
            # 16 KB more shared memory in that variant only.
            mk_s = T.alloc_shared((C, C), qk_dtype)
            mkl_s = T.alloc_shared((C, C), qk_dtype)
            _store_split(t_f, mk_s, mkl_s, qk_dtype)
            _split_times(mk_s, mkl_s, k_s, x_f)
        T.copy(x_f, x_s)
        T.copy(x_s, wbuf[cid, h, :, :])

    _staging_tile, _kk_blocks, _diag_blocks = staging_tile, kk_blocks, diag_blocks(0)

    def _for_each_head(macro, *args):
        """macro(j, *args) for each of the CTA's heads j (unrolled as the kernel is traced)."""
        for j in range(hpc):
            macro(j, *args)

    def _for_each_pair(macro, *args):
        """macro(jp, *args) for each pair jp of the CTA's heads (2 jp, 2 jp + 1; unrolled)."""
        for jp in range(hpc // 2):
            macro(jp, *args)

    def _scratch(product_f, spare_f):
        """Where a head's P is built from Q K^T: in the product's own registers with one head per
        CTA, else in a spare fragment (the product serves the next head too)."""
        return product_f if hpc == 1 else spare_f

    @T.macro
    def _p_tile(j, qk_f, spare_f, prow_s, g2_s, pbuf, mbuf, cid, h0):
        """Head h0 + j's P = scale * Lower(Gamma) o (Q K^T), P[i, c] = (Q K^T)[i, c]
        exp2(g2_i + log2(scale) - g2_c) for i >= c (every element, then masked: see _gated_m).
        From Q K^T in qk_f, to pbuf; packed: P^T from K Q^T in qk_f, to mbuf's tile (its upper
        triangle with the diagonal; zeros below, where _m_tile adds M)."""
        p_s = _staging_tile()
        p_f = _scratch(qk_f, spare_f)
        for r, s in T.Parallel(C, C):  # (r, s) = (i, c) for P, (c, i) for P^T
            i, c = (s, r) if packed else (r, s)
            p_f[r, s] = qk_f[r, s] * T.exp2(prow_s[j, i] - g2_s[j, c])
        for r, s in T.Parallel(C, C):
            i, c = (s, r) if packed else (r, s)
            p_f[r, s] = T.if_then_else(i >= c, p_f[r, s], 0.0)
        T.copy(p_f, p_s)
        T.copy(p_s, (mbuf if packed else pbuf)[cid, h0 + j, :, :])

    @T.macro
    def _solve(j, kd_s, koff_s, kk_f, n_f, t_f, b_s):
        """Head j's A diag(beta) into t_f, A = (I + L)^-1, L = StrictLower(diag(beta) K K^T),
        from K K^T's blocks in kd_s / koff_s (_kk_blocks). With Dinv the inverse of I + L's
        diagonal 16x16 blocks and Db = Dinv diag(beta):
          N = Dinv L_off = Db (K K^T)_off     (strictly block-lower, N^4 = 0)
          A diag(beta) = (I - N + N^2 - N^3) Db = (I + N^2) B,  B = (I - N) Db
        N^2 and B = (I - N) Db from one N, so three round trips of a product through shared
        memory where v27's (I - N + N^2 - N^3) Dinv took four; and only A diag(beta) is formed,
        which is all M needs. The shared-memory tiles are allocated here, per head, so that one
        head's lifetimes end before the next head's begin and the allocator can overlap them
        (tiles allocated once for the CTA stay live from the first head's use to the last's:
        75 KB at two heads)."""
        db_s = _staging_tile()
        n_s = T.alloc_shared((C, C), mm_dtype)
        imn_s = _staging_tile()
        n2_s = T.alloc_shared((C, C), mm_dtype)
        b_mm_s = _staging_tile()
        _diag_blocks(j, kd_s, b_s, db_s, True)

        T.gemm(db_s, koff_s, n_f, clear_accum=True)  # N
        T.copy(n_f, n_s)
        for i, c in T.Parallel(C, C):  # I - N
            n_f[i, c] = T.if_then_else(i == c, 1.0, 0.0) - n_f[i, c]
        T.copy(n_f, imn_s)
        T.gemm(n_s, n_s, t_f, clear_accum=True)  # N^2
        T.gemm(imn_s, db_s, kk_f, clear_accum=True)  # B = (I - N) Db
        for i, c in T.Parallel(C, C):  # I + N^2
            t_f[i, c] = t_f[i, c] + T.if_then_else(i == c, 1.0, 0.0)
        T.copy(t_f, n2_s)
        T.copy(kk_f, b_mm_s)
        T.gemm(n2_s, b_mm_s, t_f, clear_accum=True)  # (I + N^2) B

    @T.macro
    def _store_m(mo_s, j, mbuf, dbuf, cid, h0, mo1_s=None):
        """Head h0 + j's M from mo_s to mbuf (and with mo1_s, head h0 + j + 1's from it). Packed:
        the diagonal to dbuf, the strict lower triangle added by a TMA reduce into mbuf's tile,
        where _p_tile stored P^T with zeros below the diagonal (x + 0 is exact in fp16), so the
        tile crosses HBM once."""
        if packed:
            for i in T.Parallel(C):
                dbuf[cid, h0 + j, i] = mo_s[i, i]
                mo_s[i, i] = T.cast(0.0, mm_dtype)
                if mo1_s is not None:
                    dbuf[cid, h0 + j + 1, i] = mo1_s[i, i]
                    mo1_s[i, i] = T.cast(0.0, mm_dtype)
            T.tma_store_wait(0, read=False)  # P^T's store into the tile has completed, not only been read
            T.atomic_add(mbuf[cid, h0 + j, :, :], mo_s, use_tma=True)
            if mo1_s is not None:
                T.atomic_add(mbuf[cid, h0 + j + 1, :, :], mo1_s, use_tma=True)
        else:
            T.copy(mo_s, mbuf[cid, h0 + j, :, :])
            if mo1_s is not None:
                T.copy(mo1_s, mbuf[cid, h0 + j + 1, :, :])

    @T.macro
    def _diag_blocks_pair(j0, kd_s, b_s, db0_s, db1_s):
        """_diag_blocks for heads j0 (threads 0-63, into db0_s) and j0 + 1 (threads 64-127, into
        db1_s) at once: the same operations per head. (Its substitution loop is _diag_blocks'
        written again: as one macro shared by both, TileLang placed an extra block barrier in
        this kernel.)"""
        tx = T.get_thread_binding()
        hj = tx // 64
        blk = (tx % 64) // 16
        col = tx % 16
        dcol = T.alloc_local((16,), acc)
        for r in T.unroll(16):
            dcol[r] = 0.0
        for m in T.unroll(16):
            dcol[m] = T.if_then_else(col == m, 1.0, 0.0) - b_s[j0 + hj, blk * 16 + m] * dcol[m]
            for r in T.unroll(m + 1, 16):
                dcol[r] = dcol[r] + kd_s[blk, m, r] * dcol[m]
        beta_col = b_s[j0 + hj, blk * 16 + col]
        if tx < 64:
            for r in T.unroll(16):
                db0_s[blk * 16 + r, blk * 16 + col] = T.cast(dcol[r] * beta_col, mm_dtype)
        else:
            for r in T.unroll(16):
                db1_s[blk * 16 + r, blk * 16 + col] = T.cast(dcol[r] * beta_col, mm_dtype)

    @T.macro
    def _m_tile_pair(jp, kd_s, koff_s, b_s, g2_s, mbuf, dbuf, cid, h0):
        """Heads 2 jp and 2 jp + 1 of the CTA at once (pair_solve, the mma solve): their diagonal
        blocks' substitutions side by side (_diag_blocks_pair; the first head's Db in koff_s's
        diagonal blocks, which the solve does not read of koff), then
        csrc/block_solve_pair.cuh's qla_block_solve_m_pair (warps 0-1 the first head, 2-3 the second),
        then each head's M out as _m_tile stores it: the same M, bit for bit."""
        j0 = 2 * jp
        mo0_s = _staging_tile()
        mo1_s = _staging_tile()
        db1_s = _staging_tile()
        _diag_blocks_pair(j0, kd_s, b_s, koff_s, db1_s)
        T.sync_threads()
        T.call_extern("handle", "qla_block_solve_m_pair", T.address_of(koff_s[0, 0]), T.address_of(koff_s[0, 0]),
                      T.address_of(g2_s[j0, 0]), T.address_of(mo0_s[0, 0]), T.address_of(db1_s[0, 0]),
                      T.address_of(g2_s[j0 + 1, 0]), T.address_of(mo1_s[0, 0]))
        T.sync_threads()
        _store_m(mo0_s, j0, mbuf, dbuf, cid, h0, mo1_s)

    @T.macro
    def _m_tile(j, kd_s, koff_s, kk_f, n_f, t_f, b_s, g2_s, mbuf, dbuf, cid, h0):
        """Form "m": head h0 + j's M in fp16 (stage 2 meets it with fp16 operands; v10 stored
        U0 = fp16(M) fp16(V) within the budget), to mbuf by _store_m (packed: its diagonal to
        dbuf, its strict lower triangle into P^T's tile)."""
        mo_s = _staging_tile()
        if mma_solve:
            # csrc/block_solve.cuh: the block forward substitution on mma.sync from Db's diagonal
            # blocks and koff_s, gated into mo_s by stmatrix; its ldmatrix reads and stores go
            # through raw pointers, which TileLang's barrier placement does not see: hence the
            # explicit barriers around it.
            db_s = _staging_tile()
            _diag_blocks(j, kd_s, b_s, db_s, False)
            T.sync_threads()
            T.call_extern("handle", "qla_block_solve_m", T.address_of(koff_s[0, 0]), T.address_of(db_s[0, 0]),
                          T.address_of(g2_s[j, 0]), T.address_of(mo_s[0, 0]))
            T.sync_threads()
        else:
            _solve(j, kd_s, koff_s, kk_f, n_f, t_f, b_s)
            _gated_m(t_f, g2_s, j)
            T.copy(t_f, mo_s)
        _store_m(mo_s, j, mbuf, dbuf, cid, h0)

    @T.prim_func
    def gdn_prefill_prep(
        q: T.StridedTensor((ntok, Hk, DK), (sq0, sq1, 1), qk_dtype),
        k: T.StridedTensor((ntok, Hk, DK), (sk0, sk1, 1), qk_dtype),
        v: T.StridedTensor((ntok, Hv, DV), (sv0, sv1, 1), io_dtype),
        g: T.Tensor((ntok, Hv), "float32"),
        beta: T.Tensor((ntok, Hv), "float32"),
        cu_seqlens: T.Tensor((nseq + 1,), "int32"),
        chunk_offsets: T.Tensor((nseq + 1,), "int32"),
        fbuf: T.Tensor((nchunk, Hv, 2, C), "float32"),
        pbuf: T.Tensor((np_, Hv, C, C), mm_dtype),
        mbuf: T.Tensor((nm, Hv, C, C), mm_dtype),
        ubuf: T.Tensor((nuw, Hv, C, DV), mm_dtype),
        wbuf: T.Tensor((nuw, Hv, C, DK), mm_dtype),
        dbuf: T.Tensor((nd, Hv, C), mm_dtype),
        qh: qh_type,
        kh: kh_type,
        scale: T.float32,
    ):
        # v-head fastest: the Hv / Hk v-heads that share a chunk's q/k tiles run back to back
        # (L2 hits), and consecutive CTAs write adjacent workspace rows.
        with T.Kernel(Hv // hpc, nchunk, threads=128) as (hb, cid):
            # Four CTAs per SM for "uw" (<= 128 registers, <= 56 KB smem), five for "m" (<= 102
            # registers; 34 KB): the phases of one CTA are latency-bound (loads, the 16-step
            # substitution), so other CTAs fill the gaps. Several heads per CTA: four.
            T.annotate_min_blocks_per_sm(ctas_per_sm(form, hpc))
            if mma_solve:
                T.import_source(PAIR_SOLVE_SOURCE if pair_solve else SOLVE_SOURCE)
            h0 = hb * hpc  # the CTA's first v-head; its heads h0 .. h0 + hpc - 1 share qk-head hk
            hk = h0 // group
            # q, k, v stay in their dtypes: Q K^T and K K^T take them as they are (exact
            # products, fp32 sums), and M meets V and K as two GEMMs each, hi + lo (below).
            k_s = T.alloc_shared((C, DK), qk_dtype)
            q_s = T.alloc_shared((C, DK), qk_dtype)
            # TMA tile loads (one elected thread issues them; every thread waits on the barrier):
            # a plain T.copy of these bounds-checked strided tiles lowers to per-element loads.
            qk_bar = T.alloc_barrier(128)
            p_f = T.alloc_fragment((C, C), acc)
            # Per head (row j: head h0 + j): g (then gc), beta, exp(gc), and the gate factors'
            # exponents in base 2, so that each factor is one ex2 (no multiply by log2(e) per
            # element): g2 = gc log2(e) and P's row term g2 + log2(scale) (beta enters M through
            # the solve, _solve).
            g_s = T.alloc_shared((hpc, C), acc)
            b_s = T.alloc_shared((hpc, C), acc)
            eg_s = T.alloc_shared((hpc, C), acc)
            g2_s = T.alloc_shared((hpc, C), acc)
            prow_s = T.alloc_shared((hpc, C), acc)
            kk_f = T.alloc_fragment((C, C), acc)
            t_f = T.alloc_fragment((C, C), acc)
            n_f = T.alloc_fragment((C, C), acc)

            # Which sequence owns chunk cid: largest s with chunk_offsets[s] <= cid.
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            lo = 0
            hi = nseq
            for _ in T.serial(32 - T.clz(nseq)):  # > log2(nseq) halvings (v9-v16: always 24)
                if hi - lo > 1:
                    mid = (lo + hi) // 2
                    if chunk_offsets[mid] <= cid:
                        lo = mid
                    else:
                        hi = mid
            t0 = cu_seqlens[lo] + (cid - chunk_offsets[lo]) * C
            n = T.min(cu_seqlens[lo + 1] - t0, C)

            # Tile loads; rows >= n belong to the next sequence (or are zero past T):
            # they only enter rows >= n of K K^T, which the solve and M never mix into rows < n.
            # Issued before the scalar g / beta loads, so that the two latencies overlap (v15's
            # ncu: g / beta loads first, then the TMA wait: 14% of prep's stall samples).
            T.tma_copy(k[t0:t0 + C, hk, 0:DK], k_s, barrier=qk_bar)
            T.tma_copy(q[t0:t0 + C, hk, 0:DK], q_s, barrier=qk_bar)
            T.barrier_arrive(qk_bar)
            for j, i in T.Parallel(hpc, C):
                g_s[j, i] = T.if_then_else(i < n, g[t0 + i, h0 + j], 0.0)
                b_s[j, i] = T.if_then_else(i < n, beta[t0 + i, h0 + j], 0.0)
            T.barrier_wait(qk_bar, 0)
            if copy_qk:
                # Stage 2 reads fp16 q/k: one converted copy per qk-head, written by its first
                # v-head as whole tiles (rows >= n are the next sequence's tokens, which that
                # sequence's CTA writes with the same values; tokens past the last sequence get
                # finite values, never NaN, since stage 2 loads them beside real rows), in
                # 16-byte stores straight from shared memory.
                if h0 % group == 0:
                    for i, d in T.Parallel(C, DK):
                        if t0 + i < ntok:
                            qh[t0 + i, hk, d] = T.cast(q_s[i, d], mm_dtype)
                            kh[t0 + i, hk, d] = T.cast(k_s[i, d], mm_dtype)
            # Rows >= n have g = 0, so they repeat gc[n-1]: gc[63] is the chunk's total.
            T.cumsum(src=g_s, dim=1)
            for j, i in T.Parallel(hpc, C):
                g2 = g_s[j, i] * _LOG2E
                g2_s[j, i] = g2
                prow_s[j, i] = g2 + T.log2(scale)
                eg_s[j, i] = T.exp2(g2)
                fbuf[cid, h0 + j, 0, i] = eg_s[j, i]
                fbuf[cid, h0 + j, 1, i] = T.if_then_else(i < n, T.exp2(g_s[j, C - 1] * _LOG2E - g2), 0.0)

            # P = scale * Lower(Gamma) o Q K^T (state-free, so off stage 2's sequential chain):
            # Q K^T (K Q^T when packed, which stores P^T) once, then each head's gates.
            if packed:
                T.gemm(k_s, q_s, p_f, transpose_B=True, clear_accum=True)
            else:
                T.gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
            _for_each_head(_p_tile, p_f, t_f, prow_s, g2_s, pbuf, mbuf, cid, h0)

            # K K^T once; then each head's A diag(beta) = (I + L)^-1 diag(beta) and M.
            kd_s = T.alloc_shared((4, 16, 16), acc)
            koff_s = _staging_tile()
            _kk_blocks(k_s, kk_f, kd_s, koff_s)
            if uw_form:
                _solve(0, kd_s, koff_s, kk_f, n_f, t_f, b_s)
                _write_u0_wk(v, ubuf, wbuf, t0, h0, cid, k_s, g2_s, eg_s, t_f)
            else:
                if pair_solve:
                    _for_each_pair(_m_tile_pair, kd_s, koff_s, b_s, g2_s, mbuf, dbuf, cid, h0)
                else:
                    _for_each_head(_m_tile, kd_s, koff_s, kk_f, n_f, t_f, b_s, g2_s, mbuf, dbuf, cid, h0)

    return gdn_prefill_prep
