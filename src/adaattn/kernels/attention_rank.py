"""Tile-plan attention, forward: each query block against its exact key tiles plus low-rank
summaries of other key blocks, in one online-softmax pass.

A plan (adaptive/blocks.py) gives every (batch, query head, query block) three kinds of key
block:
- exact: the tile is computed as the exact forward computes it (kernels/attention_fwd.fwd_tile).
  The blocks a query block always keeps exact without being listed are its "tail": under a
  causal mask the blocks that overlap its own rows (masked per element), otherwise the last,
  partial key block (if any). Every other exact block is listed in Eidx[:Ecnt], full tiles.
- summarised (State == 1): the block's n keys stand as one key, their mean k̄ with the log-count
  bias log n, and its value is their mean v̄: the block adds n * exp(q.k̄ * scale) to the row's sum,
  the first-order (mean) term of log sum_i exp(q.k_i * scale). (A second-order term for the
  keys' variance was measured and made outputs worse on real heads: benchmarks/NOTES.md.)
- skipped: anything else.

Scores are in the log2 domain, as in attention_fwd. Summaries are read in chunks of BLOCK_S
block entries (one (BLOCK_M, BLOCK_S) tensor-core product per chunk); a chunk with no summarised
entry is passed over.
"""

import triton
import triton.language as tl

from .attention_fwd import dot, fwd_tile, load_rows, masked_softmax_step, round_to, store_rows


@triton.jit
def summary_chunk(acc, l_i, m_i, q, ks_base, vs_base, st_base, s0, n_vis, k_len, offs_s, offs_d, offs_dv,
                  scale_log2, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold summaries s0 .. s0 + BLOCK_S (those with State == 1 below n_vis) into the running
    (acc, l_i, m_i)."""
    idx = s0 + offs_s
    valid = idx < n_vis
    state = tl.load(st_base + idx, mask=valid, other=0)
    use = valid & (state == 1)
    if tl.max(use.to(tl.int32), 0) > 0:
        ks = load_rows(ks_base + idx[:, None] * HEAD_DIM + offs_d[None, :], idx, n_vis, offs_d,
                       HEAD_DIM, BLOCK_D, True)
        s = dot(q, tl.trans(ks), None, DOT_PRECISION) * scale_log2
        count = tl.minimum(k_len - idx * BLOCK_N, BLOCK_N).to(tl.float32)
        s += tl.math.log2(tl.maximum(count, 1.0))[None, :]
        s = tl.where(use[None, :], s, float("-inf"))
        p, alpha, m_new = masked_softmax_step(s, m_i)
        l_i = l_i * alpha + tl.sum(p, 1)
        vs = load_rows(vs_base + idx[:, None] * HEAD_DIM_V + offs_dv[None, :], idx, n_vis, offs_dv,
                       HEAD_DIM_V, BLOCK_DV, True)
        acc = acc * alpha[:, None]
        acc = dot(round_to(p, vs.dtype, DOT_PRECISION), vs, acc, DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def rank_fwd_kernel(
    Q, K, V, KS, VS, State, Eidx, Ecnt, Out,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    q_heads, kv_group, seq_len, n_kb, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_SUMMARY: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (query blocks, batch * q_heads), last query blocks first. Q (B, Hq, N, D), K/V
    (B, Hkv, N, D) / (B, Hkv, N, Dv), query length = key length = seq_len.
    KS (B, Hkv, n_kb, D) and VS (B, Hkv, n_kb, Dv) contiguous, in the input dtype. State int8
    (B, Hq, n_qb, n_kb) contiguous; Eidx int32 (B, Hq, n_qb, n_kb + 1) contiguous; Ecnt int32
    (B, Hq, n_qb). BLOCK_M is a multiple of BLOCK_N."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // q_heads
    head = pid_bh % q_heads
    kv_head = head // kv_group
    start_m = pid_m * BLOCK_M
    n_qb = tl.num_programs(0)

    b64 = batch.to(tl.int64)
    q_base = Q + b64 * stride_qb + head.to(tl.int64) * stride_qh
    k_base = K + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + kv_head.to(tl.int64) * stride_vh
    o_base = Out + b64 * stride_ob + head.to(tl.int64) * stride_oh
    bkv = (b64 * (q_heads // kv_group) + kv_head) * n_kb
    plan_row = (b64 * q_heads + head) * n_qb + pid_m

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_rows(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], offs_m, seq_len, offs_d,
                  HEAD_DIM, BLOCK_D, True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # The tail: [tail_lo, tail_hi) in keys, masked per element.
    if CAUSAL:
        tail_lo = start_m
        tail_hi = tl.minimum(start_m + BLOCK_M, seq_len)
        n_vis = start_m // BLOCK_N  # key blocks every row of this query block sees whole
    else:
        tail_lo = (seq_len // BLOCK_N) * BLOCK_N
        tail_hi = seq_len
        n_vis = seq_len // BLOCK_N

    if HAS_SUMMARY:
        offs_s = tl.arange(0, BLOCK_S)
        st_base = State + plan_row * n_kb
        for s0 in range(0, n_vis, BLOCK_S):
            acc, l_i, m_i = summary_chunk(acc, l_i, m_i, q, KS + bkv * HEAD_DIM, VS + bkv * HEAD_DIM_V, st_base,
                                          s0, n_vis, seq_len, offs_s, offs_d, offs_dv, scale_log2,
                                          HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, DOT_PRECISION)

    # Listed exact blocks: whole tiles every row sees.
    e_base = Eidx + plan_row * (n_kb + 1)
    n_exact = tl.load(Ecnt + plan_row)
    for i in range(0, n_exact):
        start_n = tl.multiple_of(tl.load(e_base + i) * BLOCK_N, BLOCK_N)
        acc, l_i, m_i = fwd_tile(acc, l_i, m_i, q, k_base, v_base, k_base, start_n,
                                 offs_m, offs_n, offs_d, offs_dv, seq_len, seq_len, 0, 0, 0,
                                 stride_kn, stride_vn, 0, 0, scale_log2,
                                 HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, False, False, False, 0,
                                 DOT_PRECISION, True)
    for start_n in range(tail_lo, tail_hi, BLOCK_N):
        acc, l_i, m_i = fwd_tile(acc, l_i, m_i, q, k_base, v_base, k_base, start_n,
                                 offs_m, offs_n, offs_d, offs_dv, seq_len, seq_len, 0, 0, 0,
                                 stride_kn, stride_vn, 0, 0, scale_log2,
                                 HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, True, False, CAUSAL, 0,
                                 DOT_PRECISION, True)

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    store_rows(o_base + offs_m[:, None] * stride_om + offs_dv[None, :],
               round_to(out, Out.dtype.element_ty, DOT_PRECISION), offs_m, seq_len, offs_dv, HEAD_DIM_V, BLOCK_DV)
