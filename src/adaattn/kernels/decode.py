"""Split-KV decode over a paged KV cache: a few query rows per sequence against its cached keys.

One program owns one (sequence, KV head, split): the query rows of the whole GQA group of that
KV head (G query heads x T rows, packed into one BLOCK_M tile, row r = g * T + t) against the
keys of its split, page by page (BLOCK_N = the page size), through the sequence's block-table
row. Pages in FP8 or INT8 are dequantized in registers with their (page, KV head) scale. Each
program writes its split's normalised output and natural-log log-sum-exp; a second kernel merges
the splits by log-sum-exp.

Positions are bottom-right aligned: query row t of T sits at position len - T + t and sees keys
j <= that (len: the sequence's length in this layer, read on the device).

Pool layout per layer: (num_pages, PAGE, Hkv, D), token-major pages (adaattn.kv.cache).
"""

import triton
import triton.language as tl

from .attention_fwd import dot, masked_softmax_step, round_to

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def decode_split_kernel(
    Q, K, V, KS, VS, TABLE, LENS, SEQS, O_PART, L_PART,
    sm_scale,
    stride_qs, stride_qh, stride_qt, stride_qd,
    stride_kp, stride_kn, stride_kh, stride_kd,
    stride_vp, stride_vn, stride_vh, stride_vd,
    stride_sp, stride_sh,
    stride_ts, stride_tp,
    stride_os, stride_oh, stride_ot, stride_osp, stride_od,
    stride_ls, stride_lh, stride_lt, stride_lsp,
    HKV, SPLITS, PAGES_PER_SPLIT,
    G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr,
    QUANTIZED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_sh = tl.program_id(1)
    split = tl.program_id(0)
    s = pid_sh // HKV
    h = pid_sh % HKV
    seq = tl.load(SEQS + s)
    length = tl.load(LENS + seq)

    rows = tl.arange(0, BLOCK_M)
    g = rows // T
    t = rows % T
    row_ok = rows < G * T
    dq = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + s * stride_qs + (h * G + g)[:, None] * stride_qh + t[:, None] * stride_qt + dq[None, :] * stride_qd
    q = tl.load(q_ptr, mask=row_ok[:, None] & (dq[None, :] < D), other=0.0)
    pos = length - T + t  # each row's position: it sees keys <= pos

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    qk_scale = sm_scale * LOG2E
    n_pages = tl.cdiv(length, PAGE)
    first = split * PAGES_PER_SPLIT
    last = tl.minimum(first + PAGES_PER_SPLIT, n_pages)
    cols = tl.arange(0, PAGE)
    for p in range(first, last):
        page = tl.load(TABLE + seq * stride_ts + p * stride_tp).to(tl.int64)
        keys = p * PAGE + cols
        k_ptr = K + page * stride_kp + cols[:, None] * stride_kn + h * stride_kh + dq[None, :] * stride_kd
        k = tl.load(k_ptr, mask=dq[None, :] < D, other=0.0)
        v_ptr = V + page * stride_vp + cols[:, None] * stride_vn + h * stride_vh + dv[None, :] * stride_vd
        v = tl.load(v_ptr, mask=dv[None, :] < DV, other=0.0)
        if QUANTIZED:  # dequantized in fp32 and multiplied in fp32: no rounding beyond the pages' own
            k = k.to(tl.float32) * tl.load(KS + page * stride_sp + h * stride_sh)
            v = v.to(tl.float32) * tl.load(VS + page * stride_sp + h * stride_sh)
            qk = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee") * qk_scale
        else:
            qk = dot(q, tl.trans(k), tl.zeros([BLOCK_M, PAGE], tl.float32), DOT_PRECISION) * qk_scale
        visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] < length)
        qk = tl.where(visible, qk, float("-inf"))
        pexp, alpha, m_new = masked_softmax_step(qk, m_i)
        l_i = l_i * alpha + tl.sum(pexp, 1)
        acc = acc * alpha[:, None]
        # P stays in fp32 for P.V (decode is bound by reading K and V, so the fp32 product costs no
        # time there): the output's error is then the inputs' rounding alone.
        acc = tl.dot(pexp, v.to(tl.float32), acc, input_precision="ieee")
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    o_ptr = (O_PART + s * stride_os + (h * G + g)[:, None] * stride_oh + t[:, None] * stride_ot + split * stride_osp
             + dv[None, :] * stride_od)
    tl.store(o_ptr, out, mask=row_ok[:, None] & (dv[None, :] < DV))
    l_ptr = L_PART + s * stride_ls + (h * G + g) * stride_lh + t * stride_lt + split * stride_lsp
    tl.store(l_ptr, lse, mask=row_ok)


@triton.jit
def decode_merge_kernel(
    O_PART, L_PART, OUT,
    stride_os, stride_oh, stride_ot, stride_osp, stride_od,
    stride_ls, stride_lh, stride_lt, stride_lsp,
    stride_s, stride_h, stride_t, stride_d,
    HQ, T, SPLITS,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (sequence, query head, row): the splits' outputs weighted by
    exp(lse_split - lse_total); a row that saw no key gives zeros."""
    pid = tl.program_id(0)
    s = pid // (HQ * T)
    h = (pid // T) % HQ
    t = pid % T
    sp = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    lse = tl.load(L_PART + s * stride_ls + h * stride_lh + t * stride_lt + sp * stride_lsp, mask=sp < SPLITS,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, 0)
    o = tl.load(O_PART + s * stride_os + h * stride_oh + t * stride_ot + sp[:, None] * stride_osp
                + dv[None, :] * stride_od, mask=(sp[:, None] < SPLITS) & (dv[None, :] < DV), other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + s * stride_s + h * stride_h + t * stride_t + dv * stride_d,
             round_to(out, OUT.dtype.element_ty, DOT_PRECISION), mask=dv < DV)
