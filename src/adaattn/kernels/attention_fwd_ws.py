"""Exact attention forward for Hopper with warp specialisation: the dense fast path.

The same math as attention_fwd.py (online softmax in the log2 domain, fp32 accumulation,
log-sum-exp saved for backward), written in the one shape Triton's automatic warp
specialisation on Hopper accepts (`tl.range(..., warp_specialize=True)`, triton >= 3.6):

- a single key loop whose loads are tensor-descriptor (TMA) loads, and Q's load before the loop
  one too: Q's descriptor is made in the kernel over its (batch, head) slice (the pass splits
  its box between the consumer groups, which a host descriptor's fixed box does not allow), K's
  and V's come from the host over (B, Hkv, Nk, D); out-of-range rows read as zeros and strided
  inputs need no copy;
- structured control flow only (no early return, no branch in the loop).

The compiler then splits the program into a producer warp group that issues the TMA loads and
two consumer warp groups that each own half of the query rows: one group's softmax runs while
the other's matrix products do, which the single-group kernel cannot overlap.

Because the loop cannot branch, the causal, window and key-tail masks are applied to every tile
as a select (constexpr-gated: a call with none pays nothing). Scope: dense (no varlen), no
attn_mask, causal top-left or bottom-right or not, a left window (no right window beyond the
causal bound), GQA, HEAD_DIM 64 or 128
(== BLOCK_D), positive scale. Everything else runs the general kernel in attention_fwd.py.
"""

import triton
import triton.language as tl

from .attention_fwd import LN2_K, dense_program, dot, round_to


@triton.jit
def visible_scores(qk, start_n, offs_n, last_key, k_len, left, CAUSAL: tl.constexpr, K_TAIL: tl.constexpr,
                   HAS_LEFT: tl.constexpr = False):
    """The scores of key tile start_n with masked ones at -inf, as a select (the specialised
    loop cannot branch): keys past row r's last_key (causal), keys past k_len (K_TAIL), keys
    before last_key - left (HAS_LEFT: a left window)."""
    if CAUSAL or K_TAIL or HAS_LEFT:
        cols = start_n + offs_n
        if CAUSAL:
            keep = cols[None, :] <= last_key[:, None]
            if K_TAIL:
                keep = keep & (cols[None, :] < k_len)
        else:
            keep = (cols < k_len)[None, :]
        if HAS_LEFT:
            keep = keep & (cols[None, :] >= (last_key - left)[:, None])
        qk = tl.where(keep, qk, float("-inf"))
    return qk


@triton.jit
def ws_row_state(start_m, diag, k_len, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr):
    """What a warp-specialised kernel's program starts its key loop with: (offs_m, last_key,
    m_i, l_i, acc, hi), its rows, each row's last visible key (causal; with a left window, a
    row's first visible key is last_key - left), the online-softmax state, and the end of its
    keys."""
    # start_m is a multiple of BLOCK_M, so OR adds. Not "+": triton 3.6's data partitioning
    # splits tl.arange(0, BLOCK_M) between the two consumer groups (the second gets 64..127) and
    # also adds 64 to the scalar added to it, so the second group's rows came out 64 too high
    # (wrong causal masks and log-sum-exp rows on the H100; visible in the TTGIR).
    offs_m = start_m | tl.arange(0, BLOCK_M)
    # Row r sees keys j <= r + diag (causal); as a per-row bound, one compare per score.
    last_key = offs_m + diag
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(k_len, tl.maximum(start_m + BLOCK_M + diag, 0))
    return offs_m, last_key, m_i, l_i, acc, hi


@triton.jit(do_not_specialize=["q_len", "k_len"])
def attention_fwd_ws_kernel(
    Q, KDesc, VDesc, Out, LSE,
    stride_qb, stride_qh, stride_qm,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh, stride_lm,
    q_heads, kv_group, q_len, k_len, scale_log2, window_left,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, K_TAIL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WARP_SPEC: tl.constexpr, HAS_LEFT: tl.constexpr = False,
):
    """Grid (query blocks, batch * q_heads), last query block first. KDesc/VDesc: host tensor
    descriptors over K/V (B, Hkv, Nk, D) with (1, 1, BLOCK_N, HEAD_DIM) boxes (made on the device
    they would race: the producer warp group reads them, another group would write them).
    K_TAIL: k_len is not a multiple of BLOCK_N (the last tile's padding keys are masked).
    HAS_LEFT: a left window, row r sees keys from r + diag - window_left (the loop starts at
    the tile holding the program's first row's first key)."""
    pid_bh, batch, head, kv_head, start_m, diag = dense_program(q_heads, kv_group, q_len, k_len, BLOCK_M,
                                                                BOTTOM_RIGHT)

    b64 = batch.to(tl.int64)
    # Q and Out through descriptors over this (batch, head)'s (q_len, D) rows, made here: rows
    # past q_len read as zeros and are not written. (This Q descriptor together with a masked
    # pointer store of Out measured NaN on the H100 under triton 3.6, either alone did not:
    # benchmarks/ws_bisect_gpu.py; (B, Hq, Nq, D) descriptors do not pass the warp
    # specialisation.)
    q_desc = tl.make_tensor_descriptor(Q + b64 * stride_qb + head.to(tl.int64) * stride_qh, shape=[q_len, HEAD_DIM],
                                       strides=[stride_qm, 1], block_shape=[BLOCK_M, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(Out + b64 * stride_ob + head.to(tl.int64) * stride_oh,
                                       shape=[q_len, HEAD_DIM], strides=[stride_om, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])

    offs_m, last_key, m_i, l_i, acc, hi = ws_row_state(start_m, diag, k_len, BLOCK_M, HEAD_DIM, CAUSAL)
    offs_n = tl.arange(0, BLOCK_N)
    q = q_desc.load([start_m, 0])
    lo = 0
    if HAS_LEFT:
        lo = (tl.maximum(start_m + diag - window_left, 0) // BLOCK_N) * BLOCK_N

    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        k = KDesc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = dot(q, tl.trans(k), None, DOT_PRECISION)
        qk = visible_scores(qk, start_n, offs_n, last_key, k_len, window_left, CAUSAL, K_TAIL, HAS_LEFT)
        # A positive scale keeps the argmax, so the max is taken on raw scores and scale and
        # shift fold into one FMA per score.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        # A row with no visible key yet keeps m = -inf: subtracting 0 keeps p = 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_shift)
        p = tl.math.exp2(qk * scale_log2 - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = VDesc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = dot(round_to(p, v.dtype, DOT_PRECISION), v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2_K, float("-inf"))
    o_desc.store([start_m, 0], round_to(out, Out.dtype.element_ty, DOT_PRECISION))
    tl.store(LSE + b64 * stride_lb + head.to(tl.int64) * stride_lh + offs_m * stride_lm, lse, mask=offs_m < q_len)
