"""Exact attention backward for Hopper with warp specialisation: the dense and packed fast path.

The math of attention_bwd.py (probabilities recomputed from the saved log-sum-exp, fp32
accumulation), written in the shape Triton's automatic warp specialisation on Hopper accepts
(`tl.range(..., warp_specialize=True)`, triton >= 3.6), as attention_fwd_ws.py is for the forward:
one branch-free loop per program whose loads are tensor-descriptor (TMA) loads, masks applied
as selects, tiles loaded before the loop and results stored through descriptors made in the
kernel. The compiler then runs a producer warp group issuing the loads and two consumer groups,
each owning half of the program's rows (the M dimension of every product in the loop).

Three kernels, no atomics (every gradient element is written by one program in a fixed order,
so the bits do not depend on timing):
  attention_bwd_ws_prep_kernel   delta and the log-sum-exp in the log2 domain (+inf for rows
                                 that saw no key or lie past the end), into two planes padded to
                                 whole 128-row tiles per head. delta = rowsum(P * dP) recomputed in
                                 fp32 where a query tile sees at most EXACT_KEYS keys, else
                                 rowsum(dO * O) (attention_bwd.py, "delta", says why).
  attention_bwd_dkdv_ws_kernel   one program owns BLOCK_N keys of one KV head and walks, in one
                                 flat loop, every query head of its GQA group and the query tiles
                                 that can see those keys; dk and dv stay in registers.
  attention_bwd_dq_ws_kernel     one program owns BLOCK_M query rows and walks the key tiles
                                 they can see (the forward's loop).

Scope: dense or packed varlen (cu_seqlens; each sequence's rows through descriptors made in the
kernel, so no tile crosses into the next sequence), no attn_mask, causal (top-left or
bottom-right) or not, a causal sliding window (window_left), GQA, HEAD_DIM == HEAD_DIM_V in
{64, 128}, 16-bit inputs, positive scale. Everything else runs attention_bwd.py.
"""

import triton
import triton.language as tl

from .attention_bwd import delta_from_out
from .attention_bwd import ds_low
from .attention_fwd import LOG2E_K, dense_program, dot, load_rows, position_keep, round_to, sequence_bounds


@triton.jit(do_not_specialize=["k_len", "window_left"])
def attention_bwd_ws_prep_kernel(
    Out, DOut, LSE, Stat, CuQ,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    q_heads, q_len, q_pitch, stat_plane,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
    Q=None, K=None, V=None, CuK=None,
    stride_qb=0, stride_qh=0, stride_qm=0,
    stride_kb=0, stride_kh=0, stride_kn=0,
    stride_vb=0, stride_vh=0, stride_vn=0,
    kv_group=1, k_len=0, scale_log2=1.0, window_left=0,
    BLOCK_N: tl.constexpr = 64, CAUSAL: tl.constexpr = False, BOTTOM_RIGHT: tl.constexpr = False,
    HAS_LEFT: tl.constexpr = False, DOT_PRECISION: tl.constexpr = "ieee", EXACT_KEYS: tl.constexpr = 0,
    ROW_NORM: tl.constexpr = True,
):
    """Grid (q_pitch // BLOCK_M, batch * q_heads). Stat[pid_bh * q_pitch + row] = lse * log2(e)
    (+inf where the row saw no key or lies past its sequence's end); Stat[stat_plane + ...] =
    delta (0 there). Under IS_VARLEN rows are counted from the sequence's start (CuQ, CuK).
    delta = rowsum(dO * O), or with EXACT_KEYS > 0, for a query tile none of whose rows sees more
    than EXACT_KEYS keys (the dq kernel's range), rowsum(p * dp) recomputed in fp32 from
    Q, K, V (head dim HEAD_DIM_V for all three) as the dq kernel makes p and dp."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // q_heads
    head = pid_bh % q_heads
    q_start, q_len = sequence_bounds(CuQ, batch, q_len, IS_VARLEN)
    do_base = seq_base(DOut, batch, q_start, head, stride_dob, stride_doh, stride_dom, IS_VARLEN)
    l_base = seq_base(LSE, batch, q_start, head, stride_lb, stride_lh, stride_lm, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    live = offs_m < q_len
    do = load_rows(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :], offs_m, q_len, offs_dv,
                   HEAD_DIM_V, BLOCK_DV, True)
    lse = tl.load(l_base + offs_m * stride_lm, mask=live, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_K)
    o_base = seq_base(Out, batch, q_start, head, stride_ob, stride_oh, stride_om, IS_VARLEN)
    if EXACT_KEYS > 0:
        # (Names made inside a compile-time branch stay in it: triton 3.6 forgets them after it.)
        k_start, k_len = sequence_bounds(CuK, batch, k_len, IS_VARLEN)
        diag = 0
        if BOTTOM_RIGHT:
            diag = k_len - q_len
        # The dq kernel's key range (attention_bwd_dq_ws_kernel); none for tiles past the sequence.
        lo = 0
        hi = k_len
        if CAUSAL:
            hi = tl.minimum(k_len, tl.maximum(start_m + BLOCK_M + diag, 0))
        if HAS_LEFT:
            lo = (tl.minimum(tl.maximum(start_m + diag - window_left, 0), hi) // BLOCK_N) * BLOCK_N
        hi = tl.where(start_m < q_len, hi, lo)
        # The most keys a row of the tile sees: the tile's key range, or a causal window's width.
        seen = hi - lo
        if CAUSAL and HAS_LEFT:
            seen = tl.minimum(seen, window_left + 1)
        if seen <= EXACT_KEYS:
            kv_head = head // kv_group
            q_base = seq_base(Q, batch, q_start, head, stride_qb, stride_qh, stride_qm, IS_VARLEN)
            k_base = seq_base(K, batch, k_start, kv_head, stride_kb, stride_kh, stride_kn, IS_VARLEN)
            v_base = seq_base(V, batch, k_start, kv_head, stride_vb, stride_vh, stride_vn, IS_VARLEN)
            q = load_rows(q_base + offs_m[:, None] * stride_qm + offs_dv[None, :], offs_m, q_len, offs_dv,
                          HEAD_DIM_V, BLOCK_DV, True)
            offs_n = tl.arange(0, BLOCK_N)
            delta = tl.zeros([BLOCK_M], dtype=tl.float32)
            total = tl.zeros([BLOCK_M], dtype=tl.float32)
            for start_n in range(lo, hi, BLOCK_N):
                cols = start_n + offs_n
                k = load_rows(k_base + cols[:, None] * stride_kn + offs_dv[None, :], cols, k_len, offs_dv,
                              HEAD_DIM_V, BLOCK_DV, True)
                v = load_rows(v_base + cols[:, None] * stride_vn + offs_dv[None, :], cols, k_len, offs_dv,
                              HEAD_DIM_V, BLOCK_DV, True)
                s = dot(q, tl.trans(k), None, DOT_PRECISION) * scale_log2
                # Rows past q_len have lse2 = +inf, so p = 0 there.
                keep = position_keep(offs_m[:, None], cols[None, :], q_len, k_len, diag, window_left, 0,
                                     HAS_LEFT, CAUSAL, False)
                p = tl.math.exp2(tl.where(keep, s, float("-inf")) - lse2[:, None])
                dp = dot(do, tl.trans(v), None, DOT_PRECISION)
                delta += tl.sum(p * dp, 1)
                total += tl.sum(p, 1)
            if ROW_NORM:  # divided by rowsum(p): attention_bwd.exact_delta says why (not with sinks)
                delta = delta / tl.where(total > 0.0, total, 1.0)  # (no key: total = delta = 0)
        else:
            delta = delta_from_out(o_base, do, offs_m, offs_dv, q_len, stride_om, HEAD_DIM_V, BLOCK_DV)
    else:
        delta = delta_from_out(o_base, do, offs_m, offs_dv, q_len, stride_om, HEAD_DIM_V, BLOCK_DV)
    base = Stat + pid_bh.to(tl.int64) * q_pitch + offs_m
    tl.store(base, lse2)
    tl.store(base + stat_plane, tl.where(live, delta, 0.0))


@triton.jit
def seq_base(base, batch, start, head, stride_b, stride_h, stride_n, IS_VARLEN: tl.constexpr):
    """Where one (sequence, head)'s rows begin: batch * stride_b of a dense (B, H, N, D) tensor, or
    the sequence's first row (start) of a packed (T, H, D) one."""
    if IS_VARLEN:
        return base + start.to(tl.int64) * stride_n + head.to(tl.int64) * stride_h
    else:
        return base + batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h


@triton.jit
def seq_rows_desc(base, batch, start, head, stride_b, stride_h, stride_n, n_rows, HEAD_DIM: tl.constexpr,
                  BLOCK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A descriptor made in the kernel over one (sequence, head)'s (n_rows, HEAD_DIM) rows (seq_base),
    with (BLOCK, HEAD_DIM) boxes: rows past n_rows read as zeros and are not written. A descriptor
    cannot have 0 rows: an empty sequence gets 1 (the next sequence's first row), which its
    kernel neither uses nor writes."""
    return tl.make_tensor_descriptor(seq_base(base, batch, start, head, stride_b, stride_h, stride_n, IS_VARLEN),
                                     shape=[tl.maximum(n_rows, 1), HEAD_DIM], strides=[stride_n, 1],
                                     block_shape=[BLOCK, HEAD_DIM])


@triton.jit
def heads_source(src, start, n_rows, n_heads, stride_h, stride_n, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                 IS_VARLEN: tl.constexpr):
    """What the loops load (BLOCK, HEAD_DIM) tiles of any head from: src itself (a host descriptor
    over a dense (B, H, N, D) tensor, boxes (1, 1, BLOCK, HEAD_DIM)), or under IS_VARLEN a
    descriptor made here over one sequence of the packed tensor src, as (heads, rows, HEAD_DIM)
    with boxes (1, BLOCK, HEAD_DIM): rows past the sequence read as zeros."""
    if IS_VARLEN:
        # (heads, rows, HEAD_DIM), not (rows, heads, HEAD_DIM): the box's last two dims must be the
        # tile's, or its shared-memory swizzle is not the (BLOCK, HEAD_DIM) tile's after the reshape.
        return tl.make_tensor_descriptor(src + start.to(tl.int64) * stride_n,
                                         shape=[n_heads, tl.maximum(n_rows, 1), HEAD_DIM],
                                         strides=[stride_h, stride_n, 1], block_shape=[1, BLOCK, HEAD_DIM])
    else:
        return src


@triton.jit
def load_head_tile(src, batch, head, start, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A (BLOCK, HEAD_DIM) tile of rows [start, start + BLOCK) of one head from heads_source."""
    if IS_VARLEN:
        return src.load([head, start, 0]).reshape(BLOCK, HEAD_DIM)
    else:
        return src.load([batch, head, start, 0]).reshape(BLOCK, HEAD_DIM)


@triton.jit(do_not_specialize=["q_len", "k_len", "window_left"])
def attention_bwd_dkdv_ws_kernel(
    QDesc, DODesc, StatDesc, K, V, DK, DV, CuQ, CuK,
    stride_qh, stride_qm, stride_doh, stride_dom,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    kv_heads, kv_group, q_len, k_len, q_pitch, stat_plane, scale, scale_log2, window_left,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WARP_SPEC: tl.constexpr, post_scale=1.0, DS_SPLIT: tl.constexpr = False,
):
    """Grid (key blocks, batch * kv_heads). QDesc/DODesc: host descriptors over Q/dO (B, Hq, Nq, D),
    boxes (1, 1, BLOCK_M, HEAD_DIM), or under IS_VARLEN the packed (T, Hq, D) tensors themselves
    (heads_source; q_len/k_len are then the longest sequences, and each sequence's bounds come
    from CuQ/CuK); the stride_q*/stride_do* arguments serve that case only. StatDesc: a host
    descriptor over the prep kernel's flat planes, box (BLOCK_M,). dk and dv are summed over the
    group."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // kv_heads
    kv_head = pid_bh % kv_heads
    q_heads = kv_heads * kv_group
    start_n = pid_n * BLOCK_N
    q_start, q_len = sequence_bounds(CuQ, batch, q_len, IS_VARLEN)
    k_start, k_len = sequence_bounds(CuK, batch, k_len, IS_VARLEN)
    diag = 0
    if BOTTOM_RIGHT:
        diag = k_len - q_len
    k_desc = seq_rows_desc(K, batch, k_start, kv_head, stride_kb, stride_kh, stride_kn, k_len, HEAD_DIM, BLOCK_N,
                           IS_VARLEN)
    v_desc = seq_rows_desc(V, batch, k_start, kv_head, stride_vb, stride_vh, stride_vn, k_len, HEAD_DIM, BLOCK_N,
                           IS_VARLEN)
    dk_desc = seq_rows_desc(DK, batch, k_start, kv_head, stride_dkb, stride_dkh, stride_dkn, k_len, HEAD_DIM,
                            BLOCK_N, IS_VARLEN)
    dv_desc = seq_rows_desc(DV, batch, k_start, kv_head, stride_dvb, stride_dvh, stride_dvn, k_len, HEAD_DIM,
                            BLOCK_N, IS_VARLEN)
    q_src = heads_source(QDesc, q_start, q_len, q_heads, stride_qh, stride_qm, HEAD_DIM, BLOCK_M, IS_VARLEN)
    do_src = heads_source(DODesc, q_start, q_len, q_heads, stride_doh, stride_dom, HEAD_DIM, BLOCK_M, IS_VARLEN)
    k = k_desc.load([start_n, 0])
    v = v_desc.load([start_n, 0])
    # start_n is a multiple of BLOCK_N: OR adds (see attention_fwd_ws.ws_row_state on "+").
    offs_n = start_n | tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)

    # The query rows that can see keys [start_n, start_n + BLOCK_N): [lo, hi), lo a tile start.
    lo = 0
    hi = q_len
    if CAUSAL:
        lo = (tl.minimum(tl.maximum(start_n - diag, 0), q_len) // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(q_len, tl.maximum(start_n + BLOCK_N + window_left - diag, 0))
    hi = tl.maximum(hi, lo)
    if IS_VARLEN:
        # Blocks past this sequence's keys run no tile and store nothing (the descriptors end at
        # k_len). An early return would be a branch, which the specialisation pass rejects.
        hi = tl.where(start_n < k_len, hi, lo)
    n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for t in tl.range(0, kv_group * n_tiles, warp_specialize=WARP_SPEC):
        g = t // n_tiles
        start_m = lo + (t - g * n_tiles) * BLOCK_M
        head = kv_head * kv_group + g
        q = load_head_tile(q_src, batch, head, start_m, HEAD_DIM, BLOCK_M, IS_VARLEN)
        do = load_head_tile(do_src, batch, head, start_m, HEAD_DIM, BLOCK_M, IS_VARLEN)
        row = (batch * q_heads + head) * q_pitch + start_m
        lse2 = StatDesc.load([row])
        delta = StatDesc.load([stat_plane + row])
        s_t = dot(k, tl.trans(q), None, DOT_PRECISION) * scale_log2
        if CAUSAL or HAS_LEFT:
            # Rows past q_len need no check: their lse is +inf in the planes, so p = 0.
            keep = position_keep((start_m + offs_m)[None, :], offs_n[:, None], q_len, k_len, diag, window_left, 0,
                                 HAS_LEFT, CAUSAL, False)
            s_t = tl.where(keep, s_t, float("-inf"))
        p_t = tl.math.exp2(s_t - lse2[None, :])
        p_c = round_to(p_t, q.dtype, DOT_PRECISION)
        dv = dot(p_c, do, dv, DOT_PRECISION)
        if DS_SPLIT:  # p in two roundings as well (attention_bwd.dkdv_tile)
            dv = dot(ds_low(p_t, p_c, DOT_PRECISION), do, dv, DOT_PRECISION)
        dp_t = dot(v, tl.trans(do), None, DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :]) * scale  # the ds scale (attention_bwd.dkdv_tile says why)
        ds_c = round_to(ds_t, q.dtype, DOT_PRECISION)
        dk = dot(ds_c, q, dk, DOT_PRECISION)
        if DS_SPLIT:  # ds in two roundings (attention_bwd.ds_low)
            dk = dot(ds_low(ds_t, ds_c, DOT_PRECISION), q, dk, DOT_PRECISION)

    if k_len > 0:  # an empty sequence's descriptors have one row: the next sequence's
        dk_desc.store([start_n, 0], round_to(dk * post_scale, DK.dtype.element_ty, DOT_PRECISION))
        dv_desc.store([start_n, 0], round_to(dv, DV.dtype.element_ty, DOT_PRECISION))


@triton.jit(do_not_specialize=["q_len", "k_len", "window_left"])
def attention_bwd_dq_ws_kernel(
    Q, DOut, KDesc, VDesc, Stat, DQ, CuQ, CuK,
    stride_qb, stride_qh, stride_qm,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_kh, stride_kn, stride_vh, stride_vn,
    q_heads, kv_group, q_len, k_len, q_pitch, stat_plane, scale, scale_log2, window_left,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, K_TAIL: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, WARP_SPEC: tl.constexpr, post_scale=1.0,
    DS_SPLIT: tl.constexpr = False,
):
    """Grid (query blocks, batch * q_heads), last query block first. KDesc/VDesc: host descriptors
    over K/V (B, Hkv, Nk, D), boxes (1, 1, BLOCK_N, HEAD_DIM), or under IS_VARLEN the packed
    (T, Hkv, D) tensors (heads_source; the stride_k*/stride_v* arguments serve that case only).
    K_TAIL: some sequence's k_len is not a multiple of BLOCK_N."""
    pid_bh, batch, head, kv_head, start_m, diag = dense_program(q_heads, kv_group, q_len, k_len, BLOCK_M,
                                                                BOTTOM_RIGHT)
    q_start, q_len = sequence_bounds(CuQ, batch, q_len, IS_VARLEN)
    k_start, k_len = sequence_bounds(CuK, batch, k_len, IS_VARLEN)
    if IS_VARLEN and BOTTOM_RIGHT:
        diag = k_len - q_len
    q_desc = seq_rows_desc(Q, batch, q_start, head, stride_qb, stride_qh, stride_qm, q_len, HEAD_DIM, BLOCK_M,
                           IS_VARLEN)
    do_desc = seq_rows_desc(DOut, batch, q_start, head, stride_dob, stride_doh, stride_dom, q_len, HEAD_DIM,
                            BLOCK_M, IS_VARLEN)
    dq_desc = seq_rows_desc(DQ, batch, q_start, head, stride_dqb, stride_dqh, stride_dqm, q_len, HEAD_DIM,
                            BLOCK_M, IS_VARLEN)
    k_src = heads_source(KDesc, k_start, k_len, q_heads // kv_group, stride_kh, stride_kn, HEAD_DIM, BLOCK_N,
                         IS_VARLEN)
    v_src = heads_source(VDesc, k_start, k_len, q_heads // kv_group, stride_vh, stride_vn, HEAD_DIM, BLOCK_N,
                         IS_VARLEN)
    q = q_desc.load([start_m, 0])
    do = do_desc.load([start_m, 0])
    offs_m = start_m | tl.arange(0, BLOCK_M)
    # Row statistics through descriptors made here (a host descriptor's (BLOCK_M,) box, or pointer
    # loads, fail triton's warp specialisation pass: the consumer groups each take half the rows).
    l_desc = tl.make_tensor_descriptor(Stat + pid_bh.to(tl.int64) * q_pitch, shape=[q_pitch], strides=[1],
                                       block_shape=[BLOCK_M])
    d_desc = tl.make_tensor_descriptor(Stat + stat_plane + pid_bh.to(tl.int64) * q_pitch, shape=[q_pitch],
                                       strides=[1], block_shape=[BLOCK_M])
    lse2 = l_desc.load([start_m])
    delta = d_desc.load([start_m])
    offs_n = tl.arange(0, BLOCK_N)

    lo = 0
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(k_len, tl.maximum(start_m + BLOCK_M + diag, 0))
    if HAS_LEFT:
        lo = (tl.minimum(tl.maximum(start_m + diag - window_left, 0), hi) // BLOCK_N) * BLOCK_N
    if IS_VARLEN:
        # As in the dk/dv kernel: blocks past this sequence's rows run no tile, store nothing.
        hi = tl.where(start_m < q_len, hi, lo)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        k = load_head_tile(k_src, batch, kv_head, start_n, HEAD_DIM, BLOCK_N, IS_VARLEN)
        v = load_head_tile(v_src, batch, kv_head, start_n, HEAD_DIM, BLOCK_N, IS_VARLEN)
        s = dot(q, tl.trans(k), None, DOT_PRECISION) * scale_log2
        if CAUSAL or HAS_LEFT or K_TAIL:
            keep = position_keep(offs_m[:, None], (start_n + offs_n)[None, :], q_len, k_len, diag, window_left, 0,
                                 HAS_LEFT, CAUSAL, False)
            s = tl.where(keep, s, float("-inf"))
        p = tl.math.exp2(s - lse2[:, None])
        dp = dot(do, tl.trans(v), None, DOT_PRECISION)
        ds = p * (dp - delta[:, None]) * scale
        ds_c = round_to(ds, k.dtype, DOT_PRECISION)
        dq = dot(ds_c, k, dq, DOT_PRECISION)
        if DS_SPLIT:
            dq = dot(ds_low(ds, ds_c, DOT_PRECISION), k, dq, DOT_PRECISION)

    if q_len > 0:  # as in the dk/dv kernel
        dq_desc.store([start_m, 0], round_to(dq * post_scale, DQ.dtype.element_ty, DOT_PRECISION))
