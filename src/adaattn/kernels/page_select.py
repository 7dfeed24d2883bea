"""Query-aware page selection for sparse decode: which pages of each (sequence, KV head) a decode
step reads.

Two launches, reading only the pages' key sums (kv/cache.py, summaries). page_estimate_kernel, one
program per (sequence, KV head, block of BLOCK_P pages), does step 1; page_cut_kernel, one program
per (sequence, KV head), steps 2 to 4. (One program per (sequence, KV head) walking its pages in
turn took 60 us of a 430 us step at B=16, Hkv=8, 32k on an H100: benchmarks/NOTES.md, sparse decode.)

1. Each query row r of the GQA group (G heads x T rows) scores each page p by its centroid,
   e[r, p] = q_r . (sum_p / n_p) * scale + ln n_p (log2 units here): a lower bound of the page's
   softmax mass (Jensen), which ranks pages better than the min/max bound on trained models
   (benchmarks/NOTES.md, sparse decode). The rows' estimates go to a scratch buffer ROWS, and
   each block's per-row max and sum of exponentials to PART_M / PART_L; page_cut_kernel
   combines those into each row's log-sum-exp over pages.
2. Each page's share is the largest over the rows of its estimated fraction of the row's mass:
   f[p] = max_r 2^(e[r, p] - lse_r).
3. The pages dropped are those with the smallest shares whose shares sum to at most the head's
   threshold THETA[seq, h]: a bisection on the cut c (the largest c whose pages below it sum to at
   most THETA), so no row loses more than THETA of its estimated mass. The shares of all the
   sequence's pages sit in registers for it (a bisection over blocks re-read from memory took
   most of a 32k step's time on an H100: benchmarks/NOTES.md, sparse decode). The first SINK pages and
   the newest RECENT pages are always kept.
4. The kept pages' indices (within the sequence, ascending) are written to SEL[pid, :], their
   number to COUNT[pid].

Nothing is read back to the host: lengths, thresholds and pages stay on the device, so a decode
step with selection is capturable in a CUDA graph.
"""

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _program_sequence(pid, SEQS, LENS, HKV, PAGE: tl.constexpr):
    """Program pid's (sequence in the plan, KV head, sequence id, its length, its pages)."""
    s = pid // HKV
    h = pid % HKV
    seq = tl.load(SEQS + s)
    length = tl.load(LENS + seq)
    return s, h, seq, length, tl.cdiv(length, PAGE)


@triton.jit
def page_estimate_kernel(
    Q, SUMS, TABLE, LENS, SEQS, ROWS, PART_M, PART_L,
    sm_scale,
    stride_qs, stride_qh, stride_qt, stride_qd,
    stride_bp, stride_bh,
    stride_ts, stride_tp,
    stride_rp, stride_rm,
    stride_pp, stride_pb,
    HKV,
    G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, PAGE: tl.constexpr,
):
    """Step 1 for one block of pages. ROWS (S*HKV, BLOCK_M, max pages) fp32; PART_M, PART_L
    (S*HKV, blocks, BLOCK_M) fp32: the block's max estimate per row and sum of 2^(est - max) (a
    block past the sequence's end writes -inf and 0). SUMS (num_pages, HKV, D) fp32, unit stride
    along D."""
    pid = tl.program_id(0)
    blk = tl.program_id(1)
    s, h, seq, length, npages = _program_sequence(pid, SEQS, LENS, HKV, PAGE)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < G * T
    dd = tl.arange(0, BLOCK_D)
    q = tl.load(Q + s * stride_qs + (h * G + rows // T)[:, None] * stride_qh + (rows % T)[:, None] * stride_qt
                + dd[None, :] * stride_qd, mask=row_ok[:, None] & (dd[None, :] < D), other=0.0).to(tl.float32)
    q = q * (sm_scale * LOG2E)
    pg = blk * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = pg < npages
    phys = tl.load(TABLE + seq * stride_ts + pg * stride_tp, mask=ok, other=0).to(tl.int64)
    cnt = tl.minimum(length - pg * PAGE, PAGE).to(tl.float32)
    cnt = tl.where(ok, cnt, 1.0)
    sums = tl.load(SUMS + phys[:, None] * stride_bp + h * stride_bh + dd[None, :],
                   mask=ok[:, None] & (dd[None, :] < D), other=0.0)
    cen = sums / cnt[:, None]
    # tf32: an fp32 "ieee" dot took 4x as long here (99-160 us against 38-43 at 128k, H100) for an
    # estimate that ranks pages, where tf32's 2^-11 relative rounding moves no share materially
    est = tl.dot(q, tl.trans(cen), input_precision="tf32") + tl.log2(cnt)[None, :]
    est = tl.where(ok[None, :] & row_ok[:, None], est, float("-inf"))
    tl.store(ROWS + pid * stride_rp + rows[:, None] * stride_rm + pg[None, :], est, mask=row_ok[:, None] & ok[None, :])
    m = tl.max(est, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.sum(tl.exp2(est - m_safe[:, None]), 1)
    tl.store(PART_M + pid * stride_pp + blk * stride_pb + rows, m)
    tl.store(PART_L + pid * stride_pp + blk * stride_pb + rows, l_sum)


@triton.jit
def page_cut_kernel(
    LENS, SEQS, THETA, ROWS, PART_M, PART_L, SEL, COUNT,
    stride_rp, stride_rm,
    stride_pp, stride_pb,
    stride_sp,
    HKV, SINK, RECENT,
    G: tl.constexpr, T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, ALL_B: tl.constexpr,
    ALL_P: tl.constexpr, PAGE: tl.constexpr, ITERS: tl.constexpr,
):
    """Steps 2 to 4 for one (sequence, KV head). THETA (sequence slots, HKV) fp32; SEL (S*HKV,
    max pages) and COUNT (S*HKV,) int32 out. ALL_B >= every sequence's blocks of BLOCK_P pages,
    ALL_P >= its pages (held in registers)."""
    pid = tl.program_id(0)
    s, h, seq, length, npages = _program_sequence(pid, SEQS, LENS, HKV, PAGE)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < G * T

    # each row's log-sum-exp over pages, from the blocks' parts (log2)
    bb = tl.arange(0, ALL_B)
    b_ok = bb < tl.cdiv(npages, BLOCK_P)
    part = pid * stride_pp + bb[:, None] * stride_pb + rows[None, :]
    pm = tl.load(PART_M + part, mask=b_ok[:, None], other=float("-inf"))
    pl = tl.load(PART_L + part, mask=b_ok[:, None], other=0.0)
    m_r = tl.max(pm, 0)
    m_safe = tl.where(m_r == float("-inf"), 0.0, m_r)
    l_r = tl.sum(pl * tl.exp2(pm - m_safe[None, :]), 0)
    lse = tl.where(row_ok, m_safe + tl.log2(tl.where(l_r > 0, l_r, 1.0)), float("inf"))

    # 2. each page's share: the largest fraction of a row's estimated mass it holds (<= 1); all
    # the pages at once (ALL_P >= the sequence's pages), kept in registers through steps 3 and 4
    row_base = ROWS + pid * stride_rp
    pg = tl.arange(0, ALL_P)
    ok = pg < npages
    share = tl.zeros([ALL_P], tl.float32)
    for r in range(G * T):
        lse_r = tl.sum(tl.where(rows == r, lse, 0.0), 0)
        est = tl.load(row_base + r * stride_rm + pg, mask=ok, other=float("-inf"))
        share = tl.maximum(share, tl.exp2(est - lse_r))
    forced = (pg < SINK) | (pg >= npages - RECENT) | (pg >= npages)
    share = tl.where(forced, 2.0, share)  # 2: never dropped

    # 3. the cut: the largest c in [0, 1.5) such that the shares below c sum to at most theta
    theta = tl.load(THETA + seq * HKV + h)
    lo = 0.0
    hi = 1.5
    for _ in range(ITERS):
        mid = 0.5 * (lo + hi)
        below = tl.sum(tl.where(share < mid, share, 0.0), 0)
        if below <= theta:
            lo = mid
        else:
            hi = mid

    # 4. the kept pages, ascending
    keep = ok & (share >= lo)
    at = tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(SEL + pid * stride_sp + at, pg.to(tl.int32), mask=keep)
    kept = tl.sum(keep.to(tl.int32), 0)
    tl.store(COUNT + pid, kept)
