"""Block mass estimate for adaptive rank: sampled query rows of each query block against every
key block's summary and the keys the block always keeps exact, in one program per (batch,
query head, query block). The float32 torch version (adaptive/blocks.estimate, device="torch")
is the reference; see it for what is estimated.

Per sampled row, every key block that is neither always exact nor invisible scores through its
summary: the mean key with log(the block's key count) added (a row sees every summarised block
whole), plus half the variance of the row's logits over the block's keys (diagonal covariance). The always-exact keys (the first block,
and the local and own blocks) score exactly. A first pass finds each row's softmax maximum and
sum over both; a second pass turns scores into probabilities and writes, per key block, their
mean over the valid sampled rows (mass), the same weighted by min(1, logit spread) (cost), and
the rows' mean entropy in bits. Scores are in the log2 domain.
"""

import triton
import triton.language as tl


@triton.jit
def _summary_scores(q, q2, ks_base, var_base, j0, offs_s, offs_d, rows, seq_len, n_kb, lo_cov, hi_cov,
                    spread_log2, HEAD_DIM: tl.constexpr, KEY_BLOCK: tl.constexpr, CAUSAL: tl.constexpr,
                    SPREAD: tl.constexpr, WANT_SPREAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Scores (log2, -inf where the block is not summarised for the row), the logit spread
    (natural units; zeros unless WANT_SPREAD) and log2 of each block's key count (BLOCK_S,), for
    key blocks j0 .. j0 + BLOCK_S; and which of them exist. A block summarised for a row is
    one the row sees whole (the blocks it sees in part are its own, always exact), so the
    log-count bias is the block's."""
    idx = j0 + offs_s
    valid = idx < n_kb
    kmask = valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    ks = tl.load(ks_base + idx[:, None] * HEAD_DIM + offs_d[None, :], mask=kmask, other=0.0).to(tl.float32)
    logit = tl.dot(q, tl.trans(ks), input_precision=DOT_PRECISION)  # q holds the scale
    if SPREAD or WANT_SPREAD:
        var = tl.load(var_base + idx[:, None] * HEAD_DIM + offs_d[None, :], mask=kmask, other=0.0)
        spread = tl.dot(q2, tl.trans(var), input_precision=DOT_PRECISION)  # scale^2 q^2 . var
    else:
        spread = tl.zeros_like(logit)
    start = idx * KEY_BLOCK
    log2_count = tl.math.log2(tl.maximum(tl.minimum(seq_len - start, KEY_BLOCK), 1).to(tl.float32))
    covered = (idx[None, :] == 0) | ((idx[None, :] >= lo_cov[:, None]) & (idx[None, :] < hi_cov[:, None]))
    ok = valid[None, :] & ~covered
    if CAUSAL:
        ok = ok & (start[None, :] <= rows[:, None])
    s = logit * 1.4426950408889634 + log2_count[None, :]
    if SPREAD:
        s += spread * spread_log2
    return tl.where(ok, s, float("-inf")), spread, log2_count, valid


@triton.jit
def _exact_scores(q, k_base, stride_kn, start, offs_k, offs_d, rows, seq_len, lo, hi,
                  HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Scores (log2, -inf where not scored) of keys start .. start + KEY_BLOCK: each row scores
    those in its own [lo, hi) (and, causal, at most its own position)."""
    kidx = start + offs_k
    kvalid = kidx < seq_len
    k = tl.load(k_base + kidx[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                mask=kvalid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * 1.4426950408889634
    ok = kvalid[None, :] & (kidx[None, :] >= lo[:, None]) & (kidx[None, :] < hi[:, None])
    if CAUSAL:
        ok = ok & (kidx[None, :] <= rows[:, None])
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _near(qb, seq_len, QUERY_BLOCK: tl.constexpr, KEY_BLOCK: tl.constexpr, LOCAL: tl.constexpr,
          CAUSAL: tl.constexpr):
    """For query blocks qb: the keys [near_lo, near_hi) scored exactly besides the first block
    (the local and own blocks, whole key blocks), and the key blocks [lo_cov, hi_cov) they cover."""
    if CAUSAL:
        near_lo = tl.maximum(qb * QUERY_BLOCK - LOCAL * KEY_BLOCK, KEY_BLOCK)
    else:
        near_lo = tl.maximum(qb * QUERY_BLOCK, KEY_BLOCK)
    near_hi = tl.minimum((qb + 1) * QUERY_BLOCK, seq_len)
    lo_cov = near_lo // KEY_BLOCK
    hi_cov = tl.where(near_hi > near_lo, (near_hi + KEY_BLOCK - 1) // KEY_BLOCK, lo_cov)
    return near_lo, near_hi, lo_cov, hi_cov


@triton.jit
def _online(m, l, s):
    m_new = tl.maximum(m, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    l = l * tl.math.exp2(m - shift) + tl.sum(tl.math.exp2(s - shift[:, None]), 1)
    return m_new, l


@triton.jit
def _plogp(p, s, shift, log2_l):
    """p * log2(p) of p = exp2(s - shift) / l, from the scores (no logarithm per element)."""
    return tl.where(p > 0.0, p * (s - shift[:, None] - log2_l[:, None]), 0.0)


@triton.jit
def _per_block(x, GROUP: tl.constexpr, ROWS_P: tl.constexpr, N: tl.constexpr):
    """(GROUP * ROWS_P, N) -> (GROUP, N): the sum over each query block's rows."""
    return tl.sum(tl.reshape(x, (GROUP, ROWS_P, N)), 1)


@triton.jit
def estimate_kernel(
    Q, K, KS, KVar, Mass, Cost, Ent,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    q_heads, kv_group, seq_len, n_qb, n_kb, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, QUERY_BLOCK: tl.constexpr, KEY_BLOCK: tl.constexpr,
    ROWS: tl.constexpr, ROWS_P: tl.constexpr, GROUP: tl.constexpr, BLOCK_S: tl.constexpr,
    LOCAL: tl.constexpr, CAUSAL: tl.constexpr, SPREAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (cdiv(n_qb, GROUP), batch * q_heads): GROUP query blocks per program, so that
    the summaries are read once for all of them. Q (B, Hq, N, D), K (B, Hkv, N, D), unit last
    strides; KS (B, Hkv, n_kb, D) mean keys and KVar (B, Hkv, n_kb, D) float32 variances,
    contiguous; Mass and Cost (B, Hq, n_qb, n_kb) float32 contiguous and zero-filled (blocks a
    query block cannot see are not written); Ent (B, Hq, n_qb) float32. ROWS sampled rows per
    query block (the last row of each of ROWS equal parts, clamped to the sequence), in ROWS_P
    (a power of two) lanes each."""
    pid_g = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) query blocks first
    pid_bh = tl.program_id(1)
    batch = pid_bh // q_heads
    head = pid_bh % q_heads
    kv_head = head // kv_group
    b64 = batch.to(tl.int64)
    q_base = Q + b64 * stride_qb + head.to(tl.int64) * stride_qh
    k_base = K + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    bkv = (b64 * (q_heads // kv_group) + kv_head) * n_kb
    ks_base = KS + bkv * HEAD_DIM
    var_base = KVar + bkv * HEAD_DIM

    # Lanes: GROUP query blocks x ROWS_P rows.
    step: tl.constexpr = QUERY_BLOCK // ROWS
    lane = tl.arange(0, GROUP * ROWS_P)
    i = lane % ROWS_P
    qb = pid_g * GROUP + lane // ROWS_P
    lane_ok = (i < ROWS) & (qb < n_qb)
    within = tl.where(i == ROWS - 1, QUERY_BLOCK - 1, i * step + (step - 1))
    rows = tl.minimum(qb * QUERY_BLOCK + within, seq_len - 1)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_base + rows[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
                mask=lane_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
    q2 = q * q * (scale * scale)
    q = q * scale
    spread_log2 = 0.5 * 1.4426950408889634

    # Each lane's always-exact keys: the first block, and [near_lo, near_hi) (whole key blocks).
    near_lo, near_hi, lo_cov, hi_cov = _near(qb, seq_len, QUERY_BLOCK, KEY_BLOCK, LOCAL, CAUSAL)
    last_qb = tl.minimum(pid_g * GROUP + GROUP, n_qb) - 1
    span_lo, _, _, _ = _near(pid_g * GROUP, seq_len, QUERY_BLOCK, KEY_BLOCK, LOCAL, CAUSAL)
    _, span_hi, _, _ = _near(last_qb, seq_len, QUERY_BLOCK, KEY_BLOCK, LOCAL, CAUSAL)
    # key blocks any row of the group sees
    vis_kb = (span_hi + KEY_BLOCK - 1) // KEY_BLOCK if CAUSAL else n_kb
    zero = tl.zeros_like(near_lo)
    first_hi = zero + tl.minimum(KEY_BLOCK, seq_len)
    offs_s = tl.arange(0, BLOCK_S)
    offs_k = tl.arange(0, KEY_BLOCK)

    # Pass 1: each lane's maximum and sum.
    m = tl.full([GROUP * ROWS_P], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP * ROWS_P], dtype=tl.float32)
    for j0 in range(0, vis_kb, BLOCK_S):
        s, spread, log2_count, valid = _summary_scores(q, q2, ks_base, var_base, j0, offs_s, offs_d, rows, seq_len,
                                                      n_kb, lo_cov, hi_cov, spread_log2, HEAD_DIM, KEY_BLOCK,
                                                      CAUSAL, SPREAD, SPREAD, DOT_PRECISION)
        m, l = _online(m, l, s)
    s = _exact_scores(q, k_base, stride_kn, 0, offs_k, offs_d, rows, seq_len, zero, first_hi, HEAD_DIM, CAUSAL,
                      DOT_PRECISION)
    m, l = _online(m, l, s)
    for start in range(span_lo, span_hi, KEY_BLOCK):
        s = _exact_scores(q, k_base, stride_kn, start, offs_k, offs_d, rows, seq_len, near_lo, near_hi, HEAD_DIM,
                          CAUSAL, DOT_PRECISION)
        m, l = _online(m, l, s)
    shift = tl.where(m == float("-inf"), 0.0, m)
    inv = tl.where(lane_ok & (l > 0.0), 1.0 / tl.where(l > 0.0, l, 1.0), 0.0)
    log2_l = tl.math.log2(tl.where(l > 0.0, l, 1.0))

    # Pass 2: probabilities, their means over each query block's rows, and the entropy.
    g = tl.arange(0, GROUP)
    qb_g = pid_g * GROUP + g
    g_ok = qb_g < n_qb
    _, _, lo_g, hi_g = _near(qb_g, seq_len, QUERY_BLOCK, KEY_BLOCK, LOCAL, CAUSAL)
    out_rows = ((b64 * q_heads + head) * n_qb + qb_g) * n_kb
    ent = tl.zeros([GROUP * ROWS_P], dtype=tl.float32)
    for j0 in range(0, vis_kb, BLOCK_S):
        s, spread, log2_count, valid = _summary_scores(q, q2, ks_base, var_base, j0, offs_s, offs_d, rows,
                                                       seq_len, n_kb, lo_cov, hi_cov, spread_log2, HEAD_DIM,
                                                       KEY_BLOCK, CAUSAL, SPREAD, True, DOT_PRECISION)
        p = tl.math.exp2(s - shift[:, None]) * inv[:, None]
        ent += -tl.sum(_plogp(p, s, shift, log2_l), 1) + tl.sum(p * log2_count[None, :], 1)
        idx = j0 + offs_s
        cov = (idx[None, :] == 0) | ((idx[None, :] >= lo_g[:, None]) & (idx[None, :] < hi_g[:, None]))
        keep = valid[None, :] & g_ok[:, None] & ~cov
        ptr = out_rows[:, None] + idx[None, :]
        tl.store(Mass + ptr, _per_block(p, GROUP, ROWS_P, BLOCK_S) / ROWS, mask=keep)
        w = tl.minimum(tl.sqrt(tl.maximum(spread, 0.0)), 1.0)
        tl.store(Cost + ptr, _per_block(p * w, GROUP, ROWS_P, BLOCK_S) / ROWS, mask=keep)
    s = _exact_scores(q, k_base, stride_kn, 0, offs_k, offs_d, rows, seq_len, zero, first_hi, HEAD_DIM, CAUSAL,
                      DOT_PRECISION)
    p = tl.math.exp2(s - shift[:, None]) * inv[:, None]
    ent -= tl.sum(_plogp(p, s, shift, log2_l), 1)
    tl.store(Mass + out_rows, tl.sum(_per_block(p, GROUP, ROWS_P, KEY_BLOCK), 1) / ROWS, mask=g_ok)
    for start in range(span_lo, span_hi, KEY_BLOCK):
        s = _exact_scores(q, k_base, stride_kn, start, offs_k, offs_d, rows, seq_len, near_lo, near_hi, HEAD_DIM,
                          CAUSAL, DOT_PRECISION)
        p = tl.math.exp2(s - shift[:, None]) * inv[:, None]
        ent -= tl.sum(_plogp(p, s, shift, log2_l), 1)
        jb = start // KEY_BLOCK
        mine = g_ok & (jb >= lo_g) & (jb < hi_g)
        tl.store(Mass + out_rows + jb, tl.sum(_per_block(p, GROUP, ROWS_P, KEY_BLOCK), 1) / ROWS, mask=mine)
    ent_g = tl.sum(tl.reshape(ent, (GROUP, ROWS_P)), 1) / ROWS
    tl.store(Ent + (b64 * q_heads + head) * n_qb + qb_g, ent_g, mask=g_ok)
