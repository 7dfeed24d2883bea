"""Sampled verification of the quantized forward: exact rows and per-head errors, one launch each.

`exact_rows_kernel`: exact attention for R sampled query rows of every (batch, query head), in
fp32 from bf16/fp16 inputs. Q.K^T on the tensor cores is exact (products of 8- or 11-bit
mantissas fit fp32; fp32 accumulation). P.V splits P into two input-dtype terms, P = P_hi + P_lo,
so the product sees 16 (bf16) or 22 (fp16) bits of each probability: about 1e-5 relative,
far below any tolerance. Causal / sliding windows come from positions; an explicit mask runs
the torch reference (adaptive/analysis.py) instead.

`verify_step_kernel`: per query head, ||out - ref|| / ||ref|| over the sampled rows of every
batch (||out|| where ref is all zero), and the controller's decision for that stage:
  STAGE 0: a head over `limit` that is not exact is redone one level up (Up[level]);
  STAGE 1: a redone head still over `limit` (and not redone exact) is redone exact;
  STAGE 2: errors only.
Work (int32, 3 rows of work_pitch >= Hq): row 0 the level each head is redone at (-1: not),
row 1 the exact redo
(0 or -1), row 2 the level each head ends at.
"""

import triton
import triton.language as tl

from .attention_fwd import dot


@triton.jit
def exact_rows_kernel(
    Q, K, V, Rows, Ref, Part,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    q_heads, kv_group, n_rows, q_len, k_len, scale, window_left, window_right, split_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Grid (batch * q_heads, cdiv(n_rows, BLOCK_R), key splits): rows BLOCK_R at a time, keys
    split_len (a multiple of BLOCK_N) at a time. Rows: int32/int64 (n_rows,) query positions.
    Ref: fp32 (B, Hq, n_rows, HEAD_DIM) contiguous, written when not SPLIT. SPLIT: Part fp32
    (B * Hq, splits, n_rows, HEAD_DIM + 2) gets each split's unnormalised sum, row max and row
    sum (the caller combines them). window_right is 0 for causal; with a right bound and no left
    one, keys past the chunk's last visible key are not read."""
    pid = tl.program_id(0)
    batch = pid // q_heads
    head = pid % q_heads
    kv_head = head // kv_group
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    r_ok = offs_r < n_rows
    d_ok = offs_d < HEAD_DIM
    rows = tl.load(Rows + offs_r, mask=r_ok, other=0).to(tl.int64)
    q = tl.load(Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh + rows[:, None] * stride_qm
                + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    pos = rows + (k_len - q_len if BOTTOM_RIGHT else 0)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    begin = tl.program_id(2) * split_len
    end = tl.minimum(k_len, begin + split_len)
    if HAS_RIGHT and not HAS_LEFT:
        end = tl.minimum(end, tl.max(tl.where(r_ok, pos + window_right + 1, 0), 0)).to(tl.int32)
    for start in range(begin, end, BLOCK_N):
        cols = start + offs_n
        c_ok = cols < k_len
        k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                    mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        s = dot(q, tl.trans(k), None, DOT_PRECISION) * scale
        keep = c_ok[None, :] & r_ok[:, None]
        if HAS_RIGHT:
            keep = keep & (cols[None, :] <= pos[:, None] + window_right)
        if HAS_LEFT:
            keep = keep & (cols[None, :] >= pos[:, None] - window_left)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vn + offs_d[None, :],
                    mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        p_hi = p.to(v.dtype)
        p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
        acc = dot(p_lo, v, dot(p_hi, v, acc * alpha[:, None], DOT_PRECISION), DOT_PRECISION)
        m_i = m_new
    if SPLIT:
        part = Part + ((pid.to(tl.int64) * tl.num_programs(2) + tl.program_id(2)) * n_rows + offs_r) * (HEAD_DIM + 2)
        tl.store(part[:, None] + offs_d[None, :], acc, mask=r_ok[:, None] & d_ok[None, :])
        tl.store(part + HEAD_DIM, m_i, mask=r_ok)
        tl.store(part + HEAD_DIM + 1, l_i, mask=r_ok)
    else:
        out = tl.where((l_i > 0.0)[:, None], acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], 0.0)
        tl.store(Ref + (pid.to(tl.int64) * n_rows + offs_r[:, None]) * HEAD_DIM + offs_d[None, :], out,
                 mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def verify_step_kernel(
    Out, Rows, Ref, Levels, Up, Work, Err,
    stride_ob, stride_oh, stride_om, stride_rb, work_pitch,
    batch, q_heads, n_rows, limit,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, STAGE: tl.constexpr,
):
    """Grid (q_heads,). Out (B, Hq, Nq, HEAD_DIM) in any float dtype, Ref as exact_rows_kernel
    writes it, Levels int32 (Hq,) the levels the call started at, Up int32 (levels,) the next
    more precise allowed level, Err fp32 (Hq,) written; stride_rb = q_heads * n_rows * HEAD_DIM."""
    head = tl.program_id(0)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_r < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = tl.load(Rows + offs_r, mask=offs_r < n_rows, other=0).to(tl.int64)
    diff2 = tl.zeros([BLOCK_R], dtype=tl.float32)
    ref2 = tl.zeros([BLOCK_R], dtype=tl.float32)
    # Scalar bases carried through the loop (tensors of pointers would be, and spill).
    o_base = Out + head.to(tl.int64) * stride_oh
    x_base = Ref + head.to(tl.int64) * n_rows * HEAD_DIM
    o_offs = rows[:, None] * stride_om + offs_d[None, :]
    x_offs = offs_r[:, None] * HEAD_DIM + offs_d[None, :]
    for _ in range(batch):
        o = tl.load(o_base + o_offs, mask=ok, other=0.0).to(tl.float32)
        x = tl.load(x_base + x_offs, mask=ok, other=0.0)
        diff2 += tl.sum((o - x) * (o - x), 1)
        ref2 += tl.sum(x * x, 1)
        o_base += stride_ob
        x_base += stride_rb
    diff = tl.sqrt(tl.sum(diff2, 0))
    ref = tl.sqrt(tl.sum(ref2, 0))
    err = tl.where(ref > 0.0, diff / tl.maximum(ref, 1e-30), diff)
    tl.store(Err + head, err)
    if STAGE == 0:
        level = tl.load(Levels + head)
        over = (err > limit) & (level != 0)
        redo = tl.where(over, tl.load(Up + level), -1)
        tl.store(Work + head, redo)
        tl.store(Work + 2 * work_pitch + head, tl.where(over, redo, level))
    elif STAGE == 1:
        level = tl.load(Levels + head)
        redo = tl.load(Work + head)
        still = (redo > 0) & (err > limit)
        tl.store(Work + work_pitch + head, tl.where(still, 0, -1))
        tl.store(Work + 2 * work_pitch + head, tl.where(still, 0, tl.where(redo >= 0, redo, level)))
