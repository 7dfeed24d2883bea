"""Key-block summaries for adaptive rank in one launch: per (batch, kv head, key block) the mean
key, the keys' per-channel variance and the mean value, reading K and V once. The float32 torch
version (adaptive/blocks.summarize, kernel=False) is the reference."""

import triton
import triton.language as tl


@triton.jit
def summary_kernel(
    K, V, KS, VS, KVar,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    kv_heads, seq_len, n_kb,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
):
    """Grid (n_kb, batch * kv_heads). K (B, Hkv, N, D), V (B, Hkv, N, Dv), unit last strides.
    KS (B, Hkv, n_kb, D) and VS (B, Hkv, n_kb, Dv) in the inputs' dtype, KVar (B, Hkv, n_kb, D)
    float32, contiguous. The last block may be partial: its means are over the keys it has."""
    kb = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // kv_heads).to(tl.int64)
    head = (pid_bh % kv_heads).to(tl.int64)
    offs_n = kb * KEY_BLOCK + tl.arange(0, KEY_BLOCK)
    n_ok = offs_n < seq_len
    count = tl.minimum(seq_len - kb * KEY_BLOCK, KEY_BLOCK).to(tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    k = tl.load(K + batch * stride_kb + head * stride_kh + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    mean = tl.sum(k, 0) / count
    var = tl.maximum(tl.sum(k * k, 0) / count - mean * mean, 0.0)
    out = (pid_bh.to(tl.int64) * n_kb + kb)
    tl.store(KS + out * HEAD_DIM + offs_d, mean.to(KS.dtype.element_ty), mask=d_ok)
    tl.store(KVar + out * HEAD_DIM + offs_d, var, mask=d_ok)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    v = tl.load(V + batch * stride_vb + head * stride_vh + offs_n[:, None].to(tl.int64) * stride_vn
                + offs_dv[None, :], mask=n_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
    tl.store(VS + out * HEAD_DIM_V + offs_dv, (tl.sum(v, 0) / count).to(VS.dtype.element_ty), mask=dv_ok)
