"""The quantized forward, warp-specialised for Hopper: the dense fast paths of the qk8 and fp8
levels (attention_qk8_ws_kernel, attention_fp8_ws_kernel).

The same math as attention_quant.py (the float64 simulation in adaptive/quant_reference.py
is the reference for both): Q quantized per row, INT8 for qk8 and E4M3 for fp8, by the
pre-pass launch (quantize_kv_kernel's Q programs, or `quantize_q_kernel`) before the attention
kernel (a reduction over Q's tile inside the warp-specialised kernel does not pass triton 3.6's
warp-specialisation pass); K smoothed and quantized per block of BLOCK_N keys by the pre-pass
(its scales read per tile). qk8: INT8
Q.K^T, scores to float by the bias trick, P.V in V's dtype. fp8: FP8 Q.K^T, P scaled into
E4M3's range by folding log2(448) into the subtracted max, each tile's P.V started from zero
and added in fp32 times the tile's V scale (V smoothed, one scale per key block).

Written in the form Triton's automatic warp specialisation on Hopper accepts (see
attention_fwd_ws.py): tensor-descriptor loads, one branch-free key loop, masks as selects.
(A second session's note that INT8 products do not pass was wrong for this form: the INT8
product with an int32 result and no accumulator operand passes triton 3.6 and 3.9.) Scope:
every head at the level (no per-head level array), dense, no attn_mask, no sliding window
(causal top-left or bottom-right is fine), HEAD_DIM 64 or 128, positive scale; everything else
runs attention_quant_fwd_kernel.
"""

import triton
import triton.language as tl

from .attention_fwd import dense_program, dot, round_to
from .attention_fwd_ws import visible_scores, ws_row_state
from .attention_quant import INT_BIAS, biased_float, quantize_rows, to_fp8

LOG2_FP8_MAX: tl.constexpr = tl.constexpr(8.807354922057604)  # log2(448)


@triton.jit
def quantize_q_kernel(Q, Qq, QScale, stride_qb, stride_qh, stride_qm, q_heads, q_len, q_pitch,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, EMULATE: tl.constexpr,
                      QK_MODE: tl.constexpr = 2):
    """Grid (query blocks, batch * q_heads): Q rows to INT8 (QK_MODE 1) or E4M3 (2), one scale
    per row (attention_quant.quantize_rows), for a call whose K and V were quantized earlier
    (otherwise quantize_kv_kernel does it in the same launch). Qq is (B, Hq, Nq, D) contiguous,
    QScale (B * Hq, q_pitch) fp32 (q_pitch >= Nq, a multiple of 4: 16-byte rows)."""
    pid_bh = tl.program_id(1)
    quantize_rows(Q, Qq, QScale, stride_qb, stride_qh, stride_qm, pid_bh // q_heads, pid_bh % q_heads, q_heads,
                  q_len, q_pitch, tl.program_id(0) * BLOCK_M, HEAD_DIM, BLOCK_M, QK_MODE, EMULATE)


@triton.jit
def quant_ws_prologue(Qq, QScale, Out, KScale, stride_ob, stride_oh, stride_om, q_heads, kv_group, q_len, q_pitch,
                      k_len, n_blocks, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr):
    """What a quantized warp-specialised program starts with, in this order: its place
    (`dense_program`), descriptors made here over its quantized Q rows, their scales and its Out
    rows (rows past q_len read as zeros and are not written), its kv head's K block scales and
    the offset of its block scales (V's too, for fp8) and of its per-channel statistics, then
    its row state (`ws_row_state`). Returns (batch, kv_head, start_m, q_desc, qs_desc, o_desc,
    ks_base, scale_row, stat, offs_m, last_key, m_i, l_i, acc, hi). Q and its scales are loaded
    by the kernel after this (folding those loads in here reordered the TTGIR)."""
    pid_bh, batch, head, kv_head, start_m, diag = dense_program(q_heads, kv_group, q_len, k_len, BLOCK_M,
                                                                BOTTOM_RIGHT)
    b64 = batch.to(tl.int64)
    kv64 = kv_head.to(tl.int64)
    q_desc = tl.make_tensor_descriptor(Qq + pid_bh.to(tl.int64) * q_len * HEAD_DIM, shape=[q_len, HEAD_DIM],
                                       strides=[HEAD_DIM, 1], block_shape=[BLOCK_M, HEAD_DIM])
    qs_desc = tl.make_tensor_descriptor(QScale + pid_bh.to(tl.int64) * q_pitch, shape=[q_len], strides=[1],
                                        block_shape=[BLOCK_M])
    o_desc = tl.make_tensor_descriptor(Out + b64 * stride_ob + head.to(tl.int64) * stride_oh,
                                       shape=[q_len, HEAD_DIM], strides=[stride_om, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    kv_row = b64 * (q_heads // kv_group) + kv64
    scale_row = kv_row * n_blocks
    offs_m, last_key, m_i, l_i, acc, hi = ws_row_state(start_m, diag, k_len, BLOCK_M, HEAD_DIM, CAUSAL)
    return (batch, kv_head, start_m, q_desc, qs_desc, o_desc, KScale + scale_row, scale_row, kv_row * HEAD_DIM,
            offs_m, last_key, m_i, l_i, acc, hi)


@triton.jit(do_not_specialize=["q_len", "k_len", "n_blocks", "q_pitch"])
def attention_qk8_ws_kernel(
    Qq, QScale, KqDesc, VDesc, KScale, Out,
    stride_ob, stride_oh, stride_om,
    q_heads, kv_group, q_len, q_pitch, k_len, n_blocks, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, K_TAIL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """The qk8 level, warp-specialised (the math of attention_quant_fwd_kernel at QK_MODE = INT8,
    PV_MODE = native): Q.K^T in INT8 on the tensor cores from quantize_q_kernel's INT8 Q (per-row
    scales) and the pre-pass's smoothed INT8 K (per-block scales, read per tile), scores to
    float by the bias trick (attention_quant.biased_float), P.V in V's dtype with fp32
    accumulation. Grid (query blocks, batch * q_heads), last query block first. KqDesc: over the
    INT8 K (B, Hkv, Npad, D), box (1, 1, BLOCK_N, D); VDesc: over V (B, Hkv, Nk, D), same box
    (rows past Nk read as zeros). Scope as attention_fp8_ws_kernel's, causal included."""
    (batch, kv_head, start_m, q_desc, qs_desc, o_desc, ks_base, _, _, offs_m, last_key, m_i, l_i, acc,
     hi) = quant_ws_prologue(Qq, QScale, Out, KScale, stride_ob, stride_oh, stride_om, q_heads, kv_group, q_len,
                             q_pitch, k_len, n_blocks, HEAD_DIM, BLOCK_M, CAUSAL, BOTTOM_RIGHT)
    q = q_desc.load([start_m, 0])
    row_scale = qs_desc.load([start_m]) * scale_log2
    offs_n = tl.arange(0, BLOCK_N)

    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        k = KqDesc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        # INT8 scores as biased floats (1.5 * 2^23 + x): the bias leaves in the FMA below.
        qk = biased_float(tl.dot(q, tl.trans(k), out_dtype=tl.int32))
        rs = row_scale * tl.load(ks_base + start_n // BLOCK_N)
        qk = visible_scores(qk, start_n, offs_n, last_key, k_len, 0, CAUSAL, K_TAIL)
        m_new = tl.maximum(m_i, (tl.max(qk, 1) - INT_BIAS) * rs)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_shift)
        p = tl.math.exp2((qk - INT_BIAS) * rs[:, None] - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = VDesc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = dot(round_to(p, v.dtype, DOT_PRECISION), v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    o_desc.store([start_m, 0], round_to(out, Out.dtype.element_ty, DOT_PRECISION))


@triton.jit(do_not_specialize=["q_len", "k_len", "n_blocks", "q_pitch"])
def attention_fp8_ws_kernel(
    Qq, QScale, KqDesc, VqDesc, KScale, VScale, VMean, Out,
    stride_ob, stride_oh, stride_om,
    q_heads, kv_group, q_len, q_pitch, k_len, n_blocks, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, K_TAIL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """Grid (query blocks, batch * q_heads), last query block first. Qq/QScale: quantize_q_kernel's
    output. KqDesc: descriptor over the
    pre-pass's FP8 K (B, Hkv, Npad, D), box (1, 1, BLOCK_N, D); VqDesc: over its transposed FP8
    V (B, Hkv, D, Npad), box (1, 1, D, BLOCK_N). KScale and VScale (B, Hkv, n_blocks), VMean
    (B, Hkv, D) fp32. K_TAIL: k_len is not a multiple of BLOCK_N (padding keys are masked)."""
    (batch, kv_head, start_m, q_desc, qs_desc, o_desc, ks_base, scale_row, stat, offs_m, last_key, m_i, l_i, acc,
     hi) = quant_ws_prologue(Qq, QScale, Out, KScale, stride_ob, stride_oh, stride_om, q_heads, kv_group, q_len,
                             q_pitch, k_len, n_blocks, HEAD_DIM, BLOCK_M, CAUSAL, BOTTOM_RIGHT)
    vs_base = VScale + scale_row
    q = q_desc.load([start_m, 0])
    row_scale = qs_desc.load([start_m]) * scale_log2
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    vs_prev = tl.full([], 1.0, tl.float32)  # the V scale of the tile acc is in units of

    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        k = KqDesc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k))
        rs = row_scale * tl.load(ks_base + start_n // BLOCK_N)
        qk = visible_scores(qk, start_n, offs_n, last_key, k_len, 0, CAUSAL, K_TAIL)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * rs)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_shift)
        # P comes out already scaled by 448 (E4M3's largest finite value): log2(448) is folded
        # into the subtracted max; l carries the same factor, so it cancels in acc / l.
        p = tl.math.exp2(qk * rs[:, None] - (m_shift - LOG2_FP8_MAX)[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = VqDesc.load([batch, kv_head, 0, start_n]).reshape(HEAD_DIM, BLOCK_N)
        # A fresh fp32 accumulator per tile (Hopper's FP8 MMA accumulates with fewer bits). acc is
        # kept in units of the current tile's V scale: the change of unit rides on the per-row
        # alpha, so the add stays one FMA per element (multiplying the product by the scale
        # instead measured 12% slower on the H100).
        vs = tl.load(vs_base + start_n // BLOCK_N)
        acc = acc * (alpha * (vs_prev / vs))[:, None] + tl.dot(to_fp8(p, EMULATE), tl.trans(vt))
        vs_prev = vs
        m_i = m_new

    seen = l_i > 0.0
    v_mean = tl.load(VMean + stat + offs_d)
    out = acc * (vs_prev / tl.where(seen, l_i, 1.0))[:, None]
    out = tl.where(seen[:, None], out + v_mean[None, :], 0.0)
    o_desc.store([start_m, 0], round_to(out, Out.dtype.element_ty, DOT_PRECISION))
