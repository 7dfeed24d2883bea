"""Tile plans for adaptive rank from estimated block errors, one program per (batch, query head,
query block): the Triton version of adaptive/blocks.make_plan (the torch reference).

Per query block, the candidate key blocks (listable, not always exact) are kept exact in
descending value until the values left over sum to at most the head's threshold. Instead of a
sort, the cut is found by bisection over the bit patterns of non-negative float32 values (which
order as the values do): the largest c with sum(v <= c) <= threshold; blocks with v > c are kept.
That is the sort's choice except among equal values, where ties are all kept.
"""

import triton
import triton.language as tl


@triton.jit
def _layout(kb, qb, n_kb, seq_len, QUERY_BLOCK: tl.constexpr, KEY_BLOCK: tl.constexpr, LOCAL: tl.constexpr,
            CAUSAL: tl.constexpr):
    """(listable, forced, tail) for key blocks kb of query block qb, as blocks.block_layout."""
    if CAUSAL:
        lo = qb * (QUERY_BLOCK // KEY_BLOCK)
        listable = kb < lo
        tail = (kb >= lo) & (kb * KEY_BLOCK < tl.minimum((qb + 1) * QUERY_BLOCK, seq_len))
        forced = listable & ((kb == 0) | (kb >= lo - LOCAL))
    else:
        full = seq_len // KEY_BLOCK
        listable = kb < full
        tail = (kb >= full) & (kb < n_kb)
        own_lo = qb * QUERY_BLOCK // KEY_BLOCK
        own_hi = ((qb + 1) * QUERY_BLOCK + KEY_BLOCK - 1) // KEY_BLOCK
        forced = listable & ((kb == 0) | ((kb >= own_lo) & (kb < own_hi)))
    return listable, forced, tail


@triton.jit
def _candidates(val_row, c0, offs, qb, n_kb, seq_len, QUERY_BLOCK: tl.constexpr, KEY_BLOCK: tl.constexpr,
                LOCAL: tl.constexpr, CAUSAL: tl.constexpr):
    kb = c0 + offs
    listable, forced, tail = _layout(kb, qb, n_kb, seq_len, QUERY_BLOCK, KEY_BLOCK, LOCAL, CAUSAL)
    cand = listable & ~forced
    v = tl.load(val_row + kb, mask=cand, other=0.0)
    v = tl.where(cand & (v > 0.0), v, 0.0)  # NaN and negatives count as nothing
    return kb, v, cand, forced, tail


@triton.jit
def plan_kernel(
    Val, Thr, State, Eidx, Ecnt, Scnt, q_heads, n_kb, seq_len,
    QUERY_BLOCK: tl.constexpr, KEY_BLOCK: tl.constexpr, LOCAL: tl.constexpr, CHUNK: tl.constexpr,
    CAUSAL: tl.constexpr, SUMMARIES: tl.constexpr,
):
    """Grid (n_qb, batch * q_heads). Val (B, Hq, n_qb, n_kb) float32 contiguous (estimated error
    of leaving each block out); Thr (Hq,) float32; writes State int8 (B, Hq, n_qb, n_kb), Eidx
    int32 (B, Hq, n_qb, n_kb + 1) (the listed exact blocks, ascending, first Ecnt entries),
    Ecnt and Scnt int32 (B, Hq, n_qb): listed exact and summarised blocks."""
    qb = tl.program_id(0)
    pid_bh = tl.program_id(1)
    n_qb = tl.num_programs(0)
    head = pid_bh % q_heads
    row = pid_bh.to(tl.int64) * n_qb + qb
    val_row = Val + row * n_kb
    thr = tl.load(Thr + head)
    offs = tl.arange(0, CHUNK)

    # Bisection on the bits of the cut: T(c) = sum of candidate values <= c; want the largest
    # c with T(c) <= thr. T(+0) = 0, so a negative threshold keeps every positive value.
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.full([], 0x7F800000, dtype=tl.int32)  # +inf
    if CHUNK >= n_kb:
        kb, v, cand, forced, tail = _candidates(val_row, 0, offs, qb, n_kb, seq_len, QUERY_BLOCK, KEY_BLOCK,
                                                LOCAL, CAUSAL)
        if tl.sum(v, 0) <= thr:
            lo = hi
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            t = tl.sum(tl.where(v <= mid.to(tl.float32, bitcast=True), v, 0.0), 0)
            go_up = t <= thr
            lo, hi = tl.where(go_up, mid, lo), tl.where(go_up, hi, mid)
    else:
        total = tl.zeros([], dtype=tl.float32)
        for c0 in range(0, n_kb, CHUNK):
            kb, v, cand, forced, tail = _candidates(val_row, c0, offs, qb, n_kb, seq_len, QUERY_BLOCK, KEY_BLOCK,
                                                    LOCAL, CAUSAL)
            total += tl.sum(v, 0)
        if total <= thr:
            lo = hi
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            cut = mid.to(tl.float32, bitcast=True)
            t = tl.zeros([], dtype=tl.float32)
            for c0 in range(0, n_kb, CHUNK):
                kb, v, cand, forced, tail = _candidates(val_row, c0, offs, qb, n_kb, seq_len, QUERY_BLOCK,
                                                        KEY_BLOCK, LOCAL, CAUSAL)
                t += tl.sum(tl.where(v <= cut, v, 0.0), 0)
            go_up = t <= thr
            lo, hi = tl.where(go_up, mid, lo), tl.where(go_up, hi, mid)
    negative = thr < 0.0
    cut = tl.where(negative, 0.0, lo.to(tl.float32, bitcast=True))

    n_exact = tl.zeros([], dtype=tl.int32)
    n_summ = tl.zeros([], dtype=tl.int32)
    state_row = State + row * n_kb
    eidx_row = Eidx + row * (n_kb + 1)
    for c0 in range(0, n_kb, CHUNK):
        kb, v, cand, forced, tail = _candidates(val_row, c0, offs, qb, n_kb, seq_len, QUERY_BLOCK, KEY_BLOCK,
                                                LOCAL, CAUSAL)
        keep = cand & (v > cut) & (v > 0.0)
        exact = keep | forced
        summ = cand & ~keep
        if SUMMARIES:
            st = tl.where(exact | tail, 2, tl.where(summ, 1, 0))
            n_summ += tl.sum(summ.to(tl.int32), 0)
        else:
            st = tl.where(exact | tail, 2, 0)
        inside = kb < n_kb
        tl.store(state_row + kb, st.to(tl.int8), mask=inside)
        e = (exact & inside).to(tl.int32)
        pos = n_exact + tl.cumsum(e, 0) - e
        tl.store(eidx_row + pos, kb, mask=exact & inside)
        n_exact += tl.sum(e, 0)
    tl.store(Ecnt + row, n_exact)
    tl.store(Scnt + row, n_summ)
