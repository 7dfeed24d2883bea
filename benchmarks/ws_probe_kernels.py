"""A probe, not a product kernel: the plainest attention forward loop under Triton's automatic
warp specialisation on Hopper (`tl.range(..., warp_specialize=True)`: one producer warp group
issuing TMA loads, two consumer warp groups of 64 query rows each), to measure what it buys
before the product kernels are restructured around it. Dense inputs only: (B*H*N, D) row
tensors, N a multiple of BLOCK_M and BLOCK_N, no masks but causal.

QK: 0 bf16, 1 int8 (per-block K scales, per-row Q scales), 2 fp8 (per-tensor scales),
3 int8 with one K scale per head (per-row Q scales).
PV: 0 bf16, 1 fp8 (V transposed, (B*H*D, N), per-tensor scale).
"""

import triton
import triton.language as tl


@triton.jit
def _tile(acc, l_i, m_i, q, row_scale, k_desc, v_desc, ks_ptr, kv_row, vt_row, start_n, offs_m,
          BLOCK_N: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr, MASKED: tl.constexpr,
          FRESH: tl.constexpr):
    k = k_desc.load([kv_row + start_n, 0])
    if QK == 1:
        qk = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
        rs = row_scale * tl.load(ks_ptr + start_n // BLOCK_N)
    elif QK == 4:  # fp8 with per-block K scales
        qk = tl.dot(q, tl.trans(k))
        rs = row_scale * tl.load(ks_ptr + start_n // BLOCK_N)
    elif QK == 3:  # int32 -> float by the bias bit trick (see kernels/attention_quant.biased_float)
        qk = (tl.dot(q, tl.trans(k), out_dtype=tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        rs = row_scale
    else:
        qk = tl.dot(q, tl.trans(k))
        rs = row_scale
    if PV == 1:
        shift = 8.807354922057604  # log2(448): P comes out scaled into e4m3's range
    else:
        shift = 0.0
    if MASKED:
        cols = start_n + tl.arange(0, BLOCK_N)
        s = tl.where(offs_m[:, None] >= cols[None, :], qk * rs[:, None], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - (m_new - shift)[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * rs)
        p = tl.math.exp2(qk * rs[:, None] - (m_new - shift)[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if PV == 1:
        vt = v_desc.load([vt_row, start_n])
        if FRESH:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), tl.trans(vt))
        else:
            acc = tl.dot(p.to(tl.float8e4nv), tl.trans(vt), acc * alpha[:, None])
    else:
        v = v_desc.load([kv_row + start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def ws_probe_fwd(Q, Out, k_desc, v_desc, KScale, n_ctx, n_blocks, scale_log2, q_scale, v_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, QK: tl.constexpr,
                 PV: tl.constexpr, CAUSAL: tl.constexpr, WS: tl.constexpr, FRESH: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q_desc = tl.make_tensor_descriptor(Q, shape=[tl.num_programs(1) * n_ctx, D], strides=[D, 1],
                                       block_shape=[BLOCK_M, D])
    q = q_desc.load([bh * n_ctx + start_m, 0])
    if QK == 1 or QK == 3:
        qf = q.to(tl.float32)
        qs = tl.maximum(tl.max(tl.abs(qf), 1) / 127.0, 1e-30)
        q = tl.minimum(tl.maximum(tl.floor(qf / qs[:, None] + 0.5), -127.0), 127.0).to(tl.int8)
        row_scale = qs * scale_log2
        if QK == 3:
            row_scale = row_scale * tl.load(KScale)
    elif QK == 2 or QK == 4:
        q = (q.to(tl.float32) / q_scale).to(tl.float8e4nv)
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * (scale_log2 * q_scale)
    else:
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * (scale_log2 * q_scale)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kv_row = bh * n_ctx
    vt_row = bh * D
    ks_ptr = KScale + bh * n_blocks
    hi = n_ctx
    if CAUSAL:
        hi = start_m
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=WS):
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, row_scale, k_desc, v_desc, ks_ptr, kv_row, vt_row, start_n,
                              offs_m, BLOCK_N, QK, PV, False, FRESH)
    if CAUSAL:
        for start_n in tl.range(start_m, start_m + BLOCK_M, BLOCK_N, warp_specialize=WS):
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, row_scale, k_desc, v_desc, ks_ptr, kv_row, vt_row, start_n,
                                  offs_m, BLOCK_N, QK, PV, True, FRESH)
    out = acc / l_i[:, None]
    if PV == 1:
        out = out * v_scale
    o_desc = tl.make_tensor_descriptor(Out, shape=[tl.num_programs(1) * n_ctx, D], strides=[D, 1],
                                       block_shape=[BLOCK_M, D])
    o_desc.store([bh * n_ctx + start_m, 0], out.to(Out.dtype.element_ty))


@triton.jit(do_not_specialize=["q_len", "k_len"])
def ws_bisect_fwd(Q, KDesc, VDesc, K2Desc, V2Desc, Out, LSE, stride_qb, stride_qh, stride_qm, stride_ob, stride_oh,
                  stride_om, q_heads, q_len, k_len, scale_log2,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  Q_GLOBAL: tl.constexpr, GUARD: tl.constexpr, KV_2D: tl.constexpr, STORE_LSE: tl.constexpr,
                  DESC_STORE: tl.constexpr):
    """The product kernel (kernels/attention_fwd_ws.py, not causal) with its differences from
    ws_probe_fwd switchable, to find which one the H100 run (triton 3.6) turns into NaN."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // q_heads
    head = pid_bh % q_heads
    start_m = pid_m * BLOCK_M
    b64 = batch.to(tl.int64)
    if Q_GLOBAL:
        q_desc = tl.make_tensor_descriptor(Q, shape=[tl.num_programs(1) * q_len, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        q = q_desc.load([pid_bh * q_len + start_m, 0])
    else:
        q_desc = tl.make_tensor_descriptor(Q + b64 * stride_qb + head.to(tl.int64) * stride_qh,
                                           shape=[q_len, HEAD_DIM], strides=[stride_qm, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        q = q_desc.load([start_m, 0])
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in tl.range(0, k_len, BLOCK_N, warp_specialize=True):
        if KV_2D:
            k = K2Desc.load([pid_bh * k_len + start_n, 0])
        else:
            k = KDesc.load([batch, head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        if GUARD:
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        alpha = tl.math.exp2(m_i - m_shift)
        p = tl.math.exp2(qk * scale_log2 - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_2D:
            v = V2Desc.load([pid_bh * k_len + start_n, 0])
        else:
            v = VDesc.load([batch, head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if DESC_STORE:
        o_desc = tl.make_tensor_descriptor(Out, shape=[tl.num_programs(1) * q_len, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        o_desc.store([pid_bh * q_len + start_m, 0], out.to(Out.dtype.element_ty))
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        tl.store(Out + b64 * stride_ob + head.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=offs_m[:, None] < q_len)
    if STORE_LSE:
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(LSE + pid_bh.to(tl.int64) * q_len + offs_m, lse, mask=offs_m < q_len)
