"""Exact fused attention, backward: dq, dk, dv from the saved log-sum-exp.

Three kernels:
  attention_bwd_delta_kernel  delta = rowsum(P * dP) per query row, fp32: recomputed from q, k, v
                              and the lse (EXACT_KEYS) where a query tile sees few keys, else
                              rowsum(dO * O) from the saved output (see "delta" below).
  attention_bwd_dkdv_kernel   one program owns BLOCK_N keys of one kv head; it walks every
                              query head of the GQA group and the query tiles that can see
                              those keys, accumulating dk and dv in registers, then writes
                              them once (the GQA sum happens in a fixed order).
  attention_bwd_dq_kernel     one program owns BLOCK_M query rows; it walks the same key tiles
                              as the forward and writes dq once.
Every output element is written by exactly one program in a fixed order, so gradients are
bitwise reproducible.

Atomic dq (ATOMIC_DQ, not deterministic): the dk/dv pass also computes each query tile's dq
contribution, ds^T k, and adds it with fp32 atomics into a buffer the delta kernel zeroed;
the dq kernel does not run. Five matrix products per tile pair instead of seven; the sum
order of dq over key blocks then depends on timing, so its bits can differ between runs.

Recomputed probabilities: p = exp2(s - lse * log2(e)) with s in the log2 domain; a row with
lse = -inf (it saw no key) is given lse = +inf so p = 0. Under an additive mask (SPLIT_STATS)
the forward also saves the row max m and log2(sum) apart, and query tiles holding a row with
|m| >= SPLIT_ABOVE recompute p = exp2((s - m) - log2(sum)): with a -1e4 bias an fp32 lse keeps
only ~1e-3 of log2(sum), which would scale every p of the row, and with finfo(fp32).min it
keeps none of it (a fully masked row would get p = 1, not 1/N).

delta: ds = p * (dp - delta) needs delta = sum_j p_j dp_j with the p and dp the tiles use, so
that each row of ds sums to 0 (which cancels the part of dq common to the keys). FA2 and Triton's
tutorial take rowsum(dO * O) from the saved O; ours is rounded to the input dtype (and the
forward's P was rounded before its PV product), so that delta is off by ~u |dO| |O|, u the
dtype's rounding unit. Many keys under a flat softmax make that small beside ds; few keys
(|O| ~ |v|) or a peaked softmax (dp_j - delta small) do not: on the CPU, against SDPA's math
kernel (fp32 inside), fp16/bf16 dq and dk came out at 2-5x its error (a fuzzer: Nk 2-7; q scaled
4x: at any Nk). The delta kernels therefore recompute delta = rowsum(p * dp) in fp32 (two products
per key tile, p and dp as the dq kernel makes them) for query tiles none of whose rows sees more
than EXACT_KEYS keys, and keep rowsum(dO * O), as FA2 and cuDNN do, elsewhere. The launch sets
EXACT_KEYS (backends/triton/backward.py, exact_delta_keys) only where out and lse are these keys' own (not a ring
step's global ones) and enough rows see few keys. Cost on an H200 (bf16, B2 H16, Nq 4096, 64 keys):
the backward 4-7% slower (16k with a 31-key causal window 9%; a 512 causal backward 3 us of 43 in
a CUDA graph); none where the exact pass is not compiled in.

Masking and tile ranges are the forward's (attention_fwd), seen from the key side here.

Head dims: Q, K, dQ, dK tiles span HEAD_DIM padded to BLOCK_D; V, O, dO, dV tiles span the value
head dim HEAD_DIM_V padded to BLOCK_DV (BLOCK_DV == BLOCK_D where the two are equal).
"""

import triton
import triton.language as tl

from .attention_fwd import (
    LOG2E_K,
    apply_masks_lo,
    dot,
    key_tile_range,
    load_rows,
    round_to,
    sequence_bounds,
    store_rows,
    soft_cap,
    alibi_bias,
    head_slope,
)


# Split row statistics (SPLIT_STATS): the two-subtraction form p = exp2((s - m) - l2) runs only for
# a (batch, head) holding a row whose max is at least this large in magnitude: below it, m +
# log2(sum) in one fp32 is off by at most 2^-17 (p relative 5e-6, under the rounding of the scores
# themselves). The delta kernel raises the head's flag; each program reads it once and runs one of
# two copies of its tile loops. (A branch per tile inside the loop, or the split form everywhere,
# slowed the masked backward 7-46% on the H100: benchmarks/NOTES.md.)
SPLIT_ABOVE: tl.constexpr = tl.constexpr(128.0)


@triton.jit
def load_row_stats(lse_base, delta_base, rows, q_len, stride_lm, CHECK_ROWS: tl.constexpr):
    """lse (log2 domain, +inf for rows that saw nothing or lie past the end) and delta."""
    if CHECK_ROWS:
        lse = tl.load(lse_base + rows * stride_lm, mask=rows < q_len, other=float("inf"))
        delta = tl.load(delta_base + rows * stride_lm, mask=rows < q_len, other=0.0)
    else:
        lse = tl.load(lse_base + rows * stride_lm)
        delta = tl.load(delta_base + rows * stride_lm)
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E_K
    return lse, delta


@triton.jit
def recompute_p(s, lo, row_a, row_b, SPLIT_STATS: tl.constexpr, HAS_LO: tl.constexpr):
    """p = exp2(s - row_a), or exp2((s - row_a) - row_b) with SPLIT_STATS (row_a the row max, row_b
    log2 of the row sum), from recomputed scores s; HAS_LO adds their residual lo after the shift
    (apply_masks_lo), as the forward did."""
    x = s - row_a
    if HAS_LO:
        x = x + lo
    if SPLIT_STATS:
        x = x - row_b
    return tl.math.exp2(x)


@triton.jit
def load_split_stats(stats_base, rows, q_len, stride_lm, stride_ls, CHECK_ROWS: tl.constexpr):
    """The forward's split statistics (planes at stats_base and stats_base + stride_ls): the row
    max m (log2 domain; +inf for rows that saw nothing or lie past the end, so p = 0 there) and
    l2 = log2 of the row sum."""
    if CHECK_ROWS:
        m = tl.load(stats_base + rows * stride_lm, mask=rows < q_len, other=float("inf"))
        l2 = tl.load(stats_base + stride_ls + rows * stride_lm, mask=rows < q_len, other=0.0)
    else:
        m = tl.load(stats_base + rows * stride_lm)
        l2 = tl.load(stats_base + stride_ls + rows * stride_lm)
    return tl.where(m == float("-inf"), float("inf"), m), l2


@triton.jit
def query_tile_range(start_n, q_len, k_len, diag, window_left, window_right,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query tiles that can see keys [start_n, start_n + BLOCK_N), in three runs as
    key_tile_range: [lo, full_lo) edge, [full_lo, full_hi) fully visible, [full_hi, hi) edge.

    Key j is visible to row i iff j - right <= i + diag (HAS_RIGHT) and i + diag <= j + left
    (HAS_LEFT).
    """
    first_key = start_n
    last_key = tl.minimum(start_n + BLOCK_N, k_len) - 1
    lo = 0
    hi = q_len
    full_lo = 0
    full_hi = (q_len // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:
        lo = (tl.maximum(first_key - window_right - diag, 0) // BLOCK_M) * BLOCK_M
        full_lo = ((tl.maximum(last_key - window_right - diag, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(q_len, tl.maximum(last_key + window_left - diag + 1, 0))
        full_hi = (tl.minimum(q_len, tl.maximum(first_key + window_left - diag + 1, 0)) // BLOCK_M) * BLOCK_M
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    # A key block running past k_len has no fully visible query tile: its rows past the end
    # (loaded as zeros) must be masked, or p = exp2(0 - lse) can overflow for rows whose scores
    # are all very negative and the atomic dq (k^T ds) would read 0 * inf.
    full_hi = tl.where(start_n + BLOCK_N > k_len, full_lo, full_hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def exact_delta(q, do, row_a, row_b, k_base, v_base, mask_base, lo, hi, offs_m, offs_n, offs_d, offs_dv,
                q_len, k_len, diag, window_left, window_right, stride_kn, stride_vn, stride_mm, stride_mn,
                scale_log2, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
                HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr,
                SPLIT_STATS: tl.constexpr, SOFTCAP: tl.constexpr = 0.0, HAS_ALIBI: tl.constexpr = False,
                alibi2=0.0, ROW_NORM: tl.constexpr = True):
    """delta = rowsum(p * dp) / rowsum(p) in fp32 over key tiles [lo, hi), p and dp as dq_tile makes
    them (row statistics as there: row_a = lse, or with SPLIT_STATS the row max and row_b = log2 row
    sum). The division takes out the part of delta that a recomputed row sum off 1 adds: at scores
    in the hundreds p is recomputed to ~1e-4 (the scores' own fp32 spacing), and a peaked row's
    dp_1 - delta, the size of its true ds, would carry dp_1 (1 - rowsum(p)) (float16 dk 0.12 relative
    against torch's math 2.8e-4, interpreter fuzz seed 5832 #382). Not with sinks (ROW_NORM off):
    there the keys' p sum to 1 less the sink's weight."""
    delta = tl.zeros([BLOCK_M], dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = load_rows(k_base + cols[:, None] * stride_kn + offs_d[None, :], cols, k_len, offs_d,
                      HEAD_DIM, BLOCK_D, True)
        v = load_rows(v_base + cols[:, None] * stride_vn + offs_dv[None, :], cols, k_len, offs_dv,
                      HEAD_DIM_V, BLOCK_DV, True)
        s = dot(q, tl.trans(k), None, DOT_PRECISION) * scale_log2
        if SOFTCAP != 0.0:
            s, _ = soft_cap(s, SOFTCAP, DOT_PRECISION)
        if HAS_ALIBI:
            s = alibi_bias(s, offs_m[:, None], cols[None, :], diag, alibi2)
        LO: tl.constexpr = (MASK_KIND == 2) and (q.dtype == tl.float32)  # apply_masks_lo
        s, s_lo = apply_masks_lo(s, offs_m[:, None], cols[None, :], q_len, k_len, diag, window_left,
                                 window_right, mask_base, stride_mm, stride_mn, True, HAS_LEFT, HAS_RIGHT,
                                 MASK_KIND, LO)
        if SPLIT_STATS:
            p = recompute_p(s, s_lo, row_a[:, None], row_b[:, None], True, LO)
        else:
            p = recompute_p(s, s_lo, row_a[:, None], 0.0, False, LO)
        dp = dot(do, tl.trans(v), None, DOT_PRECISION)
        delta += tl.sum(p * dp, 1)
        total += tl.sum(p, 1)
    if ROW_NORM:
        delta = delta / tl.where(total > 0.0, total, 1.0)  # (no key: total = delta = 0)
    return delta


@triton.jit
def delta_from_out(o_base, do, offs_m, offs_dv, q_len, stride_om, HEAD_DIM_V: tl.constexpr,
                   BLOCK_DV: tl.constexpr):
    """delta = rowsum(dO * O) in fp32 from the saved output (FA2's)."""
    o = load_rows(o_base + offs_m[:, None] * stride_om + offs_dv[None, :], offs_m, q_len, offs_dv,
                  HEAD_DIM_V, BLOCK_DV, True).to(tl.float32)
    return tl.sum(o * do.to(tl.float32), 1)


@triton.jit(do_not_specialize=["q_len_dense", "k_len_dense", "window_left", "window_right"])
def attention_bwd_delta_kernel(
    Out, DOut, Delta, DQAcc, CuSeqlensQ,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    stride_dqb, stride_dqh, stride_dqm,
    q_heads, q_len_dense,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    IS_VARLEN: tl.constexpr, ZERO_DQ: tl.constexpr,
    Stats=None, Flags=None, SPLIT_STATS: tl.constexpr = False,
    Q=None, K=None, V=None, LSE=None, Mask=None, CuSeqlensK=None,
    stride_qb=0, stride_qh=0, stride_qm=0,
    stride_kb=0, stride_kh=0, stride_kn=0,
    stride_vb=0, stride_vh=0, stride_vn=0,
    stride_mb=0, stride_mh=0, stride_mm=0, stride_mn=0, stride_ls=0,
    kv_group=1, k_len_dense=0, scale_log2=1.0, window_left=0, window_right=0,
    BLOCK_N: tl.constexpr = 16, BOTTOM_RIGHT: tl.constexpr = False,
    HAS_LEFT: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False,
    MASK_KIND: tl.constexpr = 0, DOT_PRECISION: tl.constexpr = "ieee", EXACT_KEYS: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0, Slopes=None, stride_sb=0, HAS_ALIBI: tl.constexpr = False,
    ROW_NORM: tl.constexpr = True,
):
    """Grid: (query blocks, batch * q_heads). Delta has the layout of the saved lse: the sum
    over the HEAD_DIM_V value columns of o * do, or with EXACT_KEYS > 0, for a query block none of
    whose rows sees more than EXACT_KEYS keys (key_tile_range's span, or a window's width), rowsum(p * dp) recomputed
    from Q, K, V, the lse (Stats under SPLIT_STATS), Mask and the position masks as the dq kernel
    takes them (module docstring, "delta"). With ZERO_DQ it also zeroes the same rows
    (HEAD_DIM columns) of the fp32 dq accumulator (atomic dq mode). With SPLIT_STATS it raises
    Flags[batch * q_heads + head] (int32, zeroed) where a row's max (Stats' first plane) is at or
    above SPLIT_ABOVE in magnitude."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // q_heads
    head = pid_bh % q_heads
    q_start, q_len = sequence_bounds(CuSeqlensQ, batch, q_len_dense, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    b64 = batch.to(tl.int64)
    o_base = Out + b64 * stride_ob + head.to(tl.int64) * stride_oh
    do_base = DOut + b64 * stride_dob + head.to(tl.int64) * stride_doh
    d_base = Delta + b64 * stride_lb + head.to(tl.int64) * stride_lh
    if IS_VARLEN:
        o_base += q_start.to(tl.int64) * stride_om
        do_base += q_start.to(tl.int64) * stride_dom
        d_base += q_start.to(tl.int64) * stride_lm
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    do = load_rows(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :], offs_m, q_len, offs_dv,
                   HEAD_DIM_V, BLOCK_DV, True)
    if EXACT_KEYS > 0:
        # (Names made inside a compile-time branch stay in it: triton 3.6 forgets them after it.)
        k_start, k_len = sequence_bounds(CuSeqlensK, batch, k_len_dense, IS_VARLEN)
        diag = 0
        if BOTTOM_RIGHT:
            diag = k_len - q_len
        lo, full_lo, full_hi, hi = key_tile_range(start_m, q_len, k_len, diag, window_left, window_right,
                                                  BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        # The most keys a row of the tile sees: the tile's key range, or a two-sided window's width.
        seen = hi - lo
        if HAS_LEFT and HAS_RIGHT:
            seen = tl.minimum(seen, window_left + window_right + 1)
        if seen <= EXACT_KEYS:
            alibi2 = head_slope(Slopes, b64, stride_sb, head, HAS_ALIBI)
            kv_head = head // kv_group
            q_base = Q + b64 * stride_qb + head.to(tl.int64) * stride_qh
            l_base = LSE + b64 * stride_lb + head.to(tl.int64) * stride_lh
            k_base = K + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh
            v_base = V + b64 * stride_vb + kv_head.to(tl.int64) * stride_vh
            mask_base = Mask + b64 * stride_mb + head.to(tl.int64) * stride_mh
            if IS_VARLEN:
                q_base += q_start.to(tl.int64) * stride_qm
                l_base += q_start.to(tl.int64) * stride_lm
                k_base += k_start.to(tl.int64) * stride_kn
                v_base += k_start.to(tl.int64) * stride_vn
            offs_d = tl.arange(0, BLOCK_D)
            q = load_rows(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], offs_m, q_len, offs_d,
                          HEAD_DIM, BLOCK_D, True)
            if SPLIT_STATS:
                st_base = Stats + b64 * stride_lb + head.to(tl.int64) * stride_lh
                if IS_VARLEN:
                    st_base += q_start.to(tl.int64) * stride_lm
                row_a, row_b = load_split_stats(st_base, offs_m, q_len, stride_lm, stride_ls, True)
                delta = exact_delta(q, do, row_a, row_b, k_base, v_base, mask_base, lo, hi, offs_m,
                                    tl.arange(0, BLOCK_N), offs_d, offs_dv, q_len, k_len, diag, window_left,
                                    window_right, stride_kn, stride_vn, stride_mm, stride_mn, scale_log2, HEAD_DIM,
                                    BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, MASK_KIND,
                                    DOT_PRECISION, True, SOFTCAP, HAS_ALIBI, alibi2, ROW_NORM)
            else:
                lse = tl.load(l_base + offs_m * stride_lm, mask=offs_m < q_len, other=float("inf"))
                lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E_K
                delta = exact_delta(q, do, lse, lse, k_base, v_base, mask_base, lo, hi, offs_m,
                                    tl.arange(0, BLOCK_N), offs_d, offs_dv, q_len, k_len, diag, window_left,
                                    window_right, stride_kn, stride_vn, stride_mm, stride_mn, scale_log2, HEAD_DIM,
                                    BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, MASK_KIND,
                                    DOT_PRECISION, False, SOFTCAP, HAS_ALIBI, alibi2, ROW_NORM)
        else:
            delta = delta_from_out(o_base, do, offs_m, offs_dv, q_len, stride_om, HEAD_DIM_V, BLOCK_DV)
    else:
        delta = delta_from_out(o_base, do, offs_m, offs_dv, q_len, stride_om, HEAD_DIM_V, BLOCK_DV)
    tl.store(d_base + offs_m * stride_lm, delta, mask=offs_m < q_len)
    if SPLIT_STATS:
        s_base = Stats + b64 * stride_lb + head.to(tl.int64) * stride_lh
        if IS_VARLEN:
            s_base += q_start.to(tl.int64) * stride_lm
        m = tl.load(s_base + offs_m * stride_lm, mask=offs_m < q_len, other=0.0)
        big = tl.max(((tl.abs(m) >= SPLIT_ABOVE) & (m != float("-inf"))).to(tl.int32), 0)
        if big != 0:
            tl.atomic_max(Flags + pid_bh, big, sem="relaxed")
    if ZERO_DQ:
        dqa_base = DQAcc + b64 * stride_dqb + head.to(tl.int64) * stride_dqh
        if IS_VARLEN:
            dqa_base += q_start.to(tl.int64) * stride_dqm
        offs_d = tl.arange(0, BLOCK_D)
        store_rows(dqa_base + offs_m[:, None] * stride_dqm + offs_d[None, :],
                   tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), offs_m, q_len, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def atomic_add_rows(ptrs, value, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    CHECK_ROWS: tl.constexpr):
    """Relaxed fp32 atomic add of a (rows, BLOCK_D) tile; rows past n_rows and columns past
    HEAD_DIM are left alone. No ordering is needed: the kernel's end orders it before dq is read."""
    if CHECK_ROWS:
        if BLOCK_D != HEAD_DIM:
            tl.atomic_add(ptrs, value, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
        else:
            tl.atomic_add(ptrs, value, mask=rows[:, None] < n_rows, sem="relaxed")
    else:
        if BLOCK_D != HEAD_DIM:
            tl.atomic_add(ptrs, value, mask=offs_d[None, :] < HEAD_DIM, sem="relaxed")
        else:
            tl.atomic_add(ptrs, value, sem="relaxed")


@triton.jit
def ds_low(ds, ds_c, DOT_PRECISION: tl.constexpr):
    """The part of fp32 ds that its rounding to the operand dtype (ds_c) lost, itself rounded: a
    second product with it gives dk and dq from ds to about twice the dtype's bits. FA2 and cuDNN
    round ds once; torch's math kernel keeps it in fp32, and where math is what torch runs (no
    fused kernel takes the call) our float16 gradients were 2.2-2.3x its error (fuzzer #528, #7381).
    The same split of p gives dv (math keeps p in fp32 too: fuzzer #170, dv 2.6x)."""
    return round_to(ds - ds_c.to(tl.float32), ds_c.dtype, DOT_PRECISION)


@triton.jit
def dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, stats_base, delta_base, mask_base, dq_base, start_m,
              offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
              stride_qm, stride_dom, stride_lm, stride_ls, stride_mm, stride_mn, stride_dqm, scale, scale_log2,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_DV: tl.constexpr, EDGE: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
              DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, SPLIT_STATS: tl.constexpr,
              SOFTCAP: tl.constexpr = 0.0, HAS_ALIBI: tl.constexpr = False, alibi2=0.0, DS_SPLIT: tl.constexpr = False):
    """Add one query tile's contribution to dk and dv, in (key, query) orientation; with
    ATOMIC_DQ also add its dq contribution (ds^T k) to the fp32 accumulator at dq_base."""
    rows = start_m + offs_m
    q = load_rows(q_base + rows[:, None] * stride_qm + offs_d[None, :], rows, q_len, offs_d,
                  HEAD_DIM, BLOCK_D, EDGE)
    do = load_rows(do_base + rows[:, None] * stride_dom + offs_dv[None, :], rows, q_len, offs_dv,
                   HEAD_DIM_V, BLOCK_DV, EDGE)
    lse, delta = load_row_stats(lse_base, delta_base, rows, q_len, stride_lm, EDGE)
    s_t = dot(k, tl.trans(q), None, DOT_PRECISION) * scale_log2
    if SOFTCAP != 0.0:
        s_t, cap_t = soft_cap(s_t, SOFTCAP, DOT_PRECISION)
    if HAS_ALIBI:
        s_t = alibi_bias(s_t, rows[None, :], offs_n[:, None], diag, alibi2)
    LO: tl.constexpr = (MASK_KIND == 2) and (q.dtype == tl.float32)  # apply_masks_lo
    s_t, lo_t = apply_masks_lo(s_t, rows[None, :], offs_n[:, None], q_len, k_len, diag, window_left,
                               window_right, mask_base, stride_mm, stride_mn, EDGE, HAS_LEFT, HAS_RIGHT,
                               MASK_KIND, LO)
    if SPLIT_STATS:
        m, l2 = load_split_stats(stats_base, rows, q_len, stride_lm, stride_ls, EDGE)
        p_t = recompute_p(s_t, lo_t, m[None, :], l2[None, :], True, LO)
    else:
        p_t = recompute_p(s_t, lo_t, lse[None, :], 0.0, False, LO)
    p_c = round_to(p_t, do.dtype, DOT_PRECISION)
    dv = dot(p_c, do, dv, DOT_PRECISION)
    if DS_SPLIT:  # p in two roundings as well: math keeps p in fp32 for dv (fuzzer #170)
        dv = dot(ds_low(p_t, p_c, DOT_PRECISION), do, dv, DOT_PRECISION)
    dp_t = dot(v, tl.trans(do), None, DOT_PRECISION)
    # ds goes to the products times `scale`, the launch's ds scale: the softmax scale, kept at
    # 2^-6 or more in magnitude, with the rest (post_scale) applied to dk and dq in fp32. The
    # softmax scale keeps ds in half precision's range for near-overflow inputs; a tiny one (1e-4)
    # made it subnormal (a fuzzer: fp16 dq and dk 10x SDPA's error).
    ds_t = p_t * (dp_t - delta[None, :]) * scale
    if SOFTCAP != 0.0:  # through the cap: d(c tanh(s / c)) / ds = 1 - tanh^2
        ds_t = ds_t * (1.0 - cap_t * cap_t)
    ds_c = round_to(ds_t, q.dtype, DOT_PRECISION)
    dk = dot(ds_c, q, dk, DOT_PRECISION)
    if DS_SPLIT:  # what the rounding of ds lost, as a second product (ds_low's docstring)
        dk = dot(ds_low(ds_t, ds_c, DOT_PRECISION), q, dk, DOT_PRECISION)
    if ATOMIC_DQ:
        # dq^T = k^T ds: (BLOCK_D, BLOCK_M), so the long side fills the tensor-core M dimension.
        dq_t = dot(tl.trans(k), ds_c, None, DOT_PRECISION)
        if DS_SPLIT:  # (made again: names made in a compile-time branch stay in it, triton 3.6)
            dq_t = dot(tl.trans(k), ds_low(ds_t, ds_c, DOT_PRECISION), dq_t, DOT_PRECISION)
        atomic_add_rows(dq_base + rows[:, None] * stride_dqm + offs_d[None, :], tl.trans(dq_t), rows, q_len,
                        offs_d, HEAD_DIM, BLOCK_D, EDGE)
    return dk, dv


@triton.jit
def dkdv_tile_run(dk, dv, k, v, q_base, do_base, lse_base, stats_base, delta_base, mask_base, dq_base,
                  tile_start, tile_end,
                  offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                  stride_qm, stride_dom, stride_lm, stride_ls, stride_mm, stride_mn, stride_dqm, scale, scale_log2, rotate,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                  EDGE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                  MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                  ROTATE: tl.constexpr, SPLIT_STATS: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
                  HAS_ALIBI: tl.constexpr = False, alibi2=0.0, DS_SPLIT: tl.constexpr = False):
    """The tile loop over query rows [tile_start, tile_end), in steps of BLOCK_M. With ROTATE
    (whole tiles only: tile_start and tile_end multiples of BLOCK_M) it starts at tile
    `rotate` modulo the count and wraps around, so programs of one head that run together
    add into different dq rows instead of queueing on the same addresses."""
    if ROTATE:
        n_tiles = (tile_end - tile_start) // BLOCK_M
        first = rotate % tl.maximum(n_tiles, 1)
        for i in range(0, n_tiles):
            j = i + first
            j = tl.where(j >= n_tiles, j - n_tiles, j)
            start_m = tl.multiple_of(tile_start + j * BLOCK_M, BLOCK_M)
            dk, dv = dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, stats_base, delta_base, mask_base,
                               dq_base, start_m,
                               offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                               stride_qm, stride_dom, stride_lm, stride_ls, stride_mm, stride_mn, stride_dqm, scale,
                               scale_log2, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, EDGE, HAS_LEFT, HAS_RIGHT, MASK_KIND,
                               DOT_PRECISION, ATOMIC_DQ, SPLIT_STATS, SOFTCAP, HAS_ALIBI, alibi2, DS_SPLIT)
    else:
        for start_m in range(tile_start, tile_end, BLOCK_M):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            dk, dv = dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, stats_base, delta_base, mask_base,
                               dq_base, start_m,
                               offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                               stride_qm, stride_dom, stride_lm, stride_ls, stride_mm, stride_mn, stride_dqm, scale,
                               scale_log2, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, EDGE, HAS_LEFT, HAS_RIGHT, MASK_KIND,
                               DOT_PRECISION, ATOMIC_DQ, SPLIT_STATS, SOFTCAP, HAS_ALIBI, alibi2, DS_SPLIT)
    return dk, dv


@triton.jit
def dkdv_runs(dk, dv, k, v, q_base, do_base, lse_base, stats_base, delta_base, mask_base, dq_base,
              lo, full_lo, full_hi, hi, offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left,
              window_right, stride_qm, stride_dom, stride_lm, stride_ls, stride_mm, stride_mn, stride_dqm, scale,
              scale_log2, pid_n, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, ROTATE: tl.constexpr,
              SPLIT_STATS: tl.constexpr, SOFTCAP: tl.constexpr = 0.0, HAS_ALIBI: tl.constexpr = False,
              alibi2=0.0, DS_SPLIT: tl.constexpr = False):
    """One query head's three runs of query tiles against this program's keys: [lo, full_lo) edge,
    [full_lo, full_hi) fully visible (rotated with ROTATE), [full_hi, hi) edge."""
    dk, dv = dkdv_tile_run(dk, dv, k, v, q_base, do_base, lse_base, stats_base, delta_base, mask_base, dq_base, lo,
                           full_lo, offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                           stride_qm, stride_dom, stride_lm, stride_ls, stride_mm, stride_mn, stride_dqm, scale,
                           scale_log2, pid_n, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, True,
                           HAS_LEFT, HAS_RIGHT, MASK_KIND, DOT_PRECISION, ATOMIC_DQ, False, SPLIT_STATS, SOFTCAP, HAS_ALIBI, alibi2, DS_SPLIT)
    dk, dv = dkdv_tile_run(dk, dv, k, v, q_base, do_base, lse_base, stats_base, delta_base, mask_base, dq_base,
                           full_lo, full_hi, offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left,
                           window_right, stride_qm, stride_dom, stride_lm, stride_ls, stride_mm, stride_mn, stride_dqm,
                           scale, scale_log2, pid_n, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, False,
                           HAS_LEFT, HAS_RIGHT, MASK_KIND, DOT_PRECISION, ATOMIC_DQ, ROTATE, SPLIT_STATS, SOFTCAP, HAS_ALIBI, alibi2, DS_SPLIT)
    dk, dv = dkdv_tile_run(dk, dv, k, v, q_base, do_base, lse_base, stats_base, delta_base, mask_base, dq_base,
                           full_hi, hi, offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                           stride_qm, stride_dom, stride_lm, stride_ls, stride_mm, stride_mn, stride_dqm, scale,
                           scale_log2, pid_n, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, True,
                           HAS_LEFT, HAS_RIGHT, MASK_KIND, DOT_PRECISION, ATOMIC_DQ, False, SPLIT_STATS, SOFTCAP, HAS_ALIBI, alibi2, DS_SPLIT)
    return dk, dv


@triton.jit(do_not_specialize=["q_len_dense", "k_len_dense", "window_left", "window_right"])
def attention_bwd_dkdv_kernel(
    Q, K, V, DOut, LSE, Delta, DK, DV, DQAcc, Mask, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqm,
    stride_mb, stride_mh, stride_mm, stride_mn,
    kv_heads, kv_group, q_len_dense, k_len_dense,
    scale, scale_log2, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr = False, ROTATE: tl.constexpr = False,
    Stats=None, Flags=None, stride_ls=0, SPLIT_STATS: tl.constexpr = False, post_scale=1.0,
    SOFTCAP: tl.constexpr = 0.0, Slopes=None, stride_sb=0, HAS_ALIBI: tl.constexpr = False,
    DS_SPLIT: tl.constexpr = False,
):
    """Grid: (key blocks, batch * kv_heads). dk (B, Hkv, Nk, D) and dv (B, Hkv, Nk, Dv), summed
    over the group.
    ATOMIC_DQ: also add dq (B, Hq, Nq, D) into the zeroed fp32 DQAcc; ROTATE: each program
    starts its fully visible query tiles at its own offset (see dkdv_tile_run)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // kv_heads
    kv_head = pid_bh % kv_heads
    q_start, q_len = sequence_bounds(CuSeqlensQ, batch, q_len_dense, IS_VARLEN)
    k_start, k_len = sequence_bounds(CuSeqlensK, batch, k_len_dense, IS_VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= k_len:
        return
    diag = 0
    if BOTTOM_RIGHT:
        diag = k_len - q_len

    b64 = batch.to(tl.int64)
    k_base = K + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + kv_head.to(tl.int64) * stride_vh
    dk_base = DK + b64 * stride_dkb + kv_head.to(tl.int64) * stride_dkh
    dv_base = DV + b64 * stride_dvb + kv_head.to(tl.int64) * stride_dvh
    if IS_VARLEN:
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn
        dk_base += k_start.to(tl.int64) * stride_dkn
        dv_base += k_start.to(tl.int64) * stride_dvn

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = load_rows(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], offs_n, k_len, offs_d,
                  HEAD_DIM, BLOCK_D, True)
    v = load_rows(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :], offs_n, k_len, offs_dv,
                  HEAD_DIM_V, BLOCK_DV, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    lo, full_lo, full_hi, hi = query_tile_range(start_n, q_len, k_len, diag, window_left, window_right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for g in range(0, kv_group):
        head = (kv_head * kv_group + g).to(tl.int64)
        alibi2 = head_slope(Slopes, b64, stride_sb, head, HAS_ALIBI)
        q_base = Q + b64 * stride_qb + head * stride_qh
        do_base = DOut + b64 * stride_dob + head * stride_doh
        lse_base = LSE + b64 * stride_lb + head * stride_lh
        stats_base = lse_base
        split = False
        if SPLIT_STATS:
            stats_base = Stats + b64 * stride_lb + head * stride_lh
            split = tl.load(Flags + batch * kv_heads * kv_group + head) != 0
        delta_base = Delta + b64 * stride_lb + head * stride_lh
        mask_base = Mask + b64 * stride_mb + head * stride_mh
        dq_base = DQAcc + b64 * stride_dqb + head * stride_dqh
        if IS_VARLEN:
            q_base += q_start.to(tl.int64) * stride_qm
            do_base += q_start.to(tl.int64) * stride_dom
            lse_base += q_start.to(tl.int64) * stride_lm
            stats_base += q_start.to(tl.int64) * stride_lm
            delta_base += q_start.to(tl.int64) * stride_lm
            dq_base += q_start.to(tl.int64) * stride_dqm
        if split:
            dk, dv = dkdv_runs(dk, dv, k, v, q_base, do_base, lse_base, stats_base, delta_base, mask_base, dq_base,
                               lo, full_lo, full_hi, hi, offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag,
                               window_left, window_right, stride_qm, stride_dom, stride_lm, stride_ls, stride_mm,
                               stride_mn, stride_dqm, scale, scale_log2, pid_n, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
                               BLOCK_DV, BLOCK_M, HAS_LEFT, HAS_RIGHT, MASK_KIND, DOT_PRECISION, ATOMIC_DQ, ROTATE,
                               True, SOFTCAP, HAS_ALIBI, alibi2, DS_SPLIT)
        else:
            dk, dv = dkdv_runs(dk, dv, k, v, q_base, do_base, lse_base, stats_base, delta_base, mask_base, dq_base,
                               lo, full_lo, full_hi, hi, offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag,
                               window_left, window_right, stride_qm, stride_dom, stride_lm, stride_ls, stride_mm,
                               stride_mn, stride_dqm, scale, scale_log2, pid_n, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
                               BLOCK_DV, BLOCK_M, HAS_LEFT, HAS_RIGHT, MASK_KIND, DOT_PRECISION, ATOMIC_DQ, ROTATE,
                               False, SOFTCAP, HAS_ALIBI, alibi2, DS_SPLIT)

    store_rows(dk_base + offs_n[:, None] * stride_dkn + offs_d[None, :],
               round_to(dk * post_scale, DK.dtype.element_ty, DOT_PRECISION), offs_n, k_len, offs_d, HEAD_DIM,
               BLOCK_D)
    store_rows(dv_base + offs_n[:, None] * stride_dvn + offs_dv[None, :],
               round_to(dv, DV.dtype.element_ty, DOT_PRECISION), offs_n, k_len, offs_dv, HEAD_DIM_V, BLOCK_DV)


@triton.jit
def dq_tile(dq, q, do, row_a, row_b, delta, k_base, v_base, mask_base, start_n,
            offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
            stride_kn, stride_vn, stride_mm, stride_mn, scale, scale_log2,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
            BLOCK_DV: tl.constexpr, EDGE: tl.constexpr,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
            DOT_PRECISION: tl.constexpr, SPLIT_STATS: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
            HAS_ALIBI: tl.constexpr = False, alibi2=0.0, DS_SPLIT: tl.constexpr = False):
    """Add one key tile's contribution to dq. Row statistics: row_a = lse (log2 domain), or with
    SPLIT_STATS row_a = the row max and row_b = log2 of the row sum (load_split_stats)."""
    cols = start_n + offs_n
    k = load_rows(k_base + cols[:, None] * stride_kn + offs_d[None, :], cols, k_len, offs_d,
                  HEAD_DIM, BLOCK_D, EDGE)
    v = load_rows(v_base + cols[:, None] * stride_vn + offs_dv[None, :], cols, k_len, offs_dv,
                  HEAD_DIM_V, BLOCK_DV, EDGE)
    s = dot(q, tl.trans(k), None, DOT_PRECISION) * scale_log2
    if SOFTCAP != 0.0:
        s, cap = soft_cap(s, SOFTCAP, DOT_PRECISION)
    if HAS_ALIBI:
        s = alibi_bias(s, offs_m[:, None], cols[None, :], diag, alibi2)
    LO: tl.constexpr = (MASK_KIND == 2) and (k.dtype == tl.float32)  # apply_masks_lo
    s, s_lo = apply_masks_lo(s, offs_m[:, None], cols[None, :], q_len, k_len, diag, window_left, window_right,
                             mask_base, stride_mm, stride_mn, EDGE, HAS_LEFT, HAS_RIGHT, MASK_KIND, LO)
    if SPLIT_STATS:
        p = recompute_p(s, s_lo, row_a[:, None], row_b[:, None], True, LO)
    else:
        p = recompute_p(s, s_lo, row_a[:, None], 0.0, False, LO)
    dp = dot(do, tl.trans(v), None, DOT_PRECISION)
    ds = p * (dp - delta[:, None]) * scale  # the ds scale (dkdv_tile says why)
    if SOFTCAP != 0.0:
        ds = ds * (1.0 - cap * cap)
    ds_c = round_to(ds, k.dtype, DOT_PRECISION)
    dq = dot(ds_c, k, dq, DOT_PRECISION)
    if DS_SPLIT:
        dq = dot(ds_low(ds, ds_c, DOT_PRECISION), k, dq, DOT_PRECISION)
    return dq


@triton.jit
def dq_tile_run(dq, q, do, row_a, row_b, delta, k_base, v_base, mask_base, tile_start, tile_end,
                offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                stride_kn, stride_vn, stride_mm, stride_mn, scale, scale_log2,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                EDGE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT_STATS: tl.constexpr,
                SOFTCAP: tl.constexpr = 0.0,
                HAS_ALIBI: tl.constexpr = False, alibi2=0.0, DS_SPLIT: tl.constexpr = False):
    """The tile loop over keys [tile_start, tile_end), in steps of BLOCK_N."""
    for start_n in range(tile_start, tile_end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        dq = dq_tile(dq, q, do, row_a, row_b, delta, k_base, v_base, mask_base, start_n,
                     offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                     stride_kn, stride_vn, stride_mm, stride_mn, scale, scale_log2,
                     HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, EDGE, HAS_LEFT, HAS_RIGHT, MASK_KIND, DOT_PRECISION,
                     SPLIT_STATS, SOFTCAP, HAS_ALIBI, alibi2, DS_SPLIT)
    return dq


@triton.jit
def dq_runs(dq, q, do, row_a, row_b, delta, k_base, v_base, mask_base, lo, full_lo, full_hi, hi,
            offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
            stride_kn, stride_vn, stride_mm, stride_mn, scale, scale_log2,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
            BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
            DOT_PRECISION: tl.constexpr, SPLIT_STATS: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
                HAS_ALIBI: tl.constexpr = False, alibi2=0.0, DS_SPLIT: tl.constexpr = False):
    """The three runs of key tiles of one query tile: [lo, full_lo) edge, [full_lo, full_hi) fully
    visible, [full_hi, hi) edge."""
    dq = dq_tile_run(dq, q, do, row_a, row_b, delta, k_base, v_base, mask_base, lo, full_lo,
                     offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                     stride_kn, stride_vn, stride_mm, stride_mn, scale, scale_log2,
                     HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, MASK_KIND,
                     DOT_PRECISION, SPLIT_STATS, SOFTCAP, HAS_ALIBI, alibi2, DS_SPLIT)
    dq = dq_tile_run(dq, q, do, row_a, row_b, delta, k_base, v_base, mask_base, full_lo, full_hi,
                     offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                     stride_kn, stride_vn, stride_mm, stride_mn, scale, scale_log2,
                     HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, MASK_KIND,
                     DOT_PRECISION, SPLIT_STATS, SOFTCAP, HAS_ALIBI, alibi2, DS_SPLIT)
    dq = dq_tile_run(dq, q, do, row_a, row_b, delta, k_base, v_base, mask_base, full_hi, hi,
                     offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                     stride_kn, stride_vn, stride_mm, stride_mn, scale, scale_log2,
                     HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, MASK_KIND,
                     DOT_PRECISION, SPLIT_STATS, SOFTCAP, HAS_ALIBI, alibi2, DS_SPLIT)
    return dq


@triton.jit(do_not_specialize=["q_len_dense", "k_len_dense", "window_left", "window_right"])
def attention_bwd_dq_kernel(
    Q, K, V, DOut, LSE, Delta, DQ, Mask, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    stride_dqb, stride_dqh, stride_dqm,
    stride_mb, stride_mh, stride_mm, stride_mn,
    q_heads, kv_group, q_len_dense, k_len_dense,
    scale, scale_log2, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr,
    Stats=None, Flags=None, stride_ls=0, SPLIT_STATS: tl.constexpr = False, post_scale=1.0,
    SOFTCAP: tl.constexpr = 0.0, Slopes=None, stride_sb=0, HAS_ALIBI: tl.constexpr = False,
    DS_SPLIT: tl.constexpr = False,
):
    """Grid: (query blocks, batch * q_heads). dq is (B, Hq, Nq, D); dO (B, Hq, Nq, Dv)."""
    # Query blocks run last-first: under causal masks the last blocks do the most work, and
    # starting them first shortens the tail of the grid.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // q_heads
    head = pid_bh % q_heads
    kv_head = head // kv_group
    q_start, q_len = sequence_bounds(CuSeqlensQ, batch, q_len_dense, IS_VARLEN)
    k_start, k_len = sequence_bounds(CuSeqlensK, batch, k_len_dense, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    diag = 0
    if BOTTOM_RIGHT:
        diag = k_len - q_len

    b64 = batch.to(tl.int64)
    q_base = Q + b64 * stride_qb + head.to(tl.int64) * stride_qh
    do_base = DOut + b64 * stride_dob + head.to(tl.int64) * stride_doh
    dq_base = DQ + b64 * stride_dqb + head.to(tl.int64) * stride_dqh
    lse_base = LSE + b64 * stride_lb + head.to(tl.int64) * stride_lh
    stats_base = lse_base
    if SPLIT_STATS:
        stats_base = Stats + b64 * stride_lb + head.to(tl.int64) * stride_lh
    delta_base = Delta + b64 * stride_lb + head.to(tl.int64) * stride_lh
    k_base = K + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + kv_head.to(tl.int64) * stride_vh
    mask_base = Mask + b64 * stride_mb + head.to(tl.int64) * stride_mh
    alibi2 = head_slope(Slopes, b64, stride_sb, head, HAS_ALIBI)
    if IS_VARLEN:
        q_base += q_start.to(tl.int64) * stride_qm
        do_base += q_start.to(tl.int64) * stride_dom
        dq_base += q_start.to(tl.int64) * stride_dqm
        lse_base += q_start.to(tl.int64) * stride_lm
        stats_base += q_start.to(tl.int64) * stride_lm
        delta_base += q_start.to(tl.int64) * stride_lm
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_rows(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], offs_m, q_len, offs_d,
                  HEAD_DIM, BLOCK_D, True)
    do = load_rows(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :], offs_m, q_len, offs_dv,
                   HEAD_DIM_V, BLOCK_DV, True)
    lse, delta = load_row_stats(lse_base, delta_base, offs_m, q_len, stride_lm, True)
    split = False
    if SPLIT_STATS:
        split = tl.load(Flags + pid_bh) != 0
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = key_tile_range(start_m, q_len, k_len, diag, window_left, window_right,
                                              BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if split:
        m, l2 = load_split_stats(stats_base, offs_m, q_len, stride_lm, stride_ls, True)
        dq = dq_runs(dq, q, do, m, l2, delta, k_base, v_base, mask_base, lo, full_lo, full_hi, hi, offs_m, offs_n,
                     offs_d, offs_dv, q_len, k_len, diag, window_left, window_right, stride_kn, stride_vn, stride_mm,
                     stride_mn, scale, scale_log2, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, HAS_LEFT,
                     HAS_RIGHT, MASK_KIND, DOT_PRECISION, True, SOFTCAP, HAS_ALIBI, alibi2, DS_SPLIT)
    else:
        dq = dq_runs(dq, q, do, lse, lse, delta, k_base, v_base, mask_base, lo, full_lo, full_hi, hi, offs_m, offs_n,
                     offs_d, offs_dv, q_len, k_len, diag, window_left, window_right, stride_kn, stride_vn, stride_mm,
                     stride_mn, scale, scale_log2, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, HAS_LEFT,
                     HAS_RIGHT, MASK_KIND, DOT_PRECISION, False, SOFTCAP, HAS_ALIBI, alibi2, DS_SPLIT)
    store_rows(dq_base + offs_m[:, None] * stride_dqm + offs_d[None, :],
               round_to(dq * post_scale, DQ.dtype.element_ty, DOT_PRECISION), offs_m, q_len, offs_d, HEAD_DIM,
               BLOCK_D)
