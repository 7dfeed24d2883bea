"""Merge a partial attention result into an accumulator by log-sum-exp, in one pass: per row,
lse = log(exp(lse) + exp(lse_b)) and out = (exp(lse) out + exp(lse_b) out_b) / exp(lse_new).
Rows where both are -inf (no key seen yet) stay out = 0, lse = -inf. The torch version
(backends/ring_blocks.py, lse_merge) is the reference."""

import triton
import triton.language as tl


@triton.jit
def lse_merge_kernel(
    Out, Lse, Blk, BlkLse,
    stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    stride_bb, stride_bh, stride_bm, stride_blb, stride_blh,
    heads, rows,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Grid (cdiv(rows, BLOCK_M), batch * heads). Out (B, H, rows, Dv) float32 and Lse (B, H, rows)
    float32, updated in place; Blk (B, H, rows, Dv) any float dtype, BlkLse (B, H, rows) float32.
    Unit strides along Dv and along the rows of the lse's."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads).to(tl.int64)
    h = (pid_bh % heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < rows
    offs_d = tl.arange(0, BLOCK_DV)
    ok = m_ok[:, None] & (offs_d < HEAD_DIM_V)[None, :]
    l_ptr = Lse + b * stride_lb + h * stride_lh + offs_m
    l1 = tl.load(l_ptr, mask=m_ok, other=float("-inf"))
    l2 = tl.load(BlkLse + b * stride_blb + h * stride_blh + offs_m, mask=m_ok, other=float("-inf"))
    mx = tl.maximum(l1, l2)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w1 = tl.exp(l1 - mx)
    w2 = tl.exp(l2 - mx)
    total = w1 + w2
    seen = total > 0
    inv = tl.where(seen, 1.0 / tl.where(seen, total, 1.0), 0.0)
    new = tl.where(seen, mx + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    o_ptr = Out + b * stride_ob + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    o1 = tl.load(o_ptr, mask=ok, other=0.0)
    o2 = tl.load(Blk + b * stride_bb + h * stride_bh + offs_m[:, None].to(tl.int64) * stride_bm + offs_d[None, :],
                 mask=ok, other=0.0).to(tl.float32)
    o = o1 * (w1 * inv)[:, None] + o2 * (w2 * inv)[:, None]
    tl.store(o_ptr, o, mask=ok)
    tl.store(l_ptr, new, mask=m_ok)
