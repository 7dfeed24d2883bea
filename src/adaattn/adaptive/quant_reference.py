"""Float64 simulations of the quantized attention schemes of kernels/attention_quant.py.

Each function does what the kernel's comments say it does: the same smoothing, scales,
rounding and tile-by-tile online softmax (P is rounded relative to the running row maximum,
as in the kernel), so a kernel that matches it to about 1e-3 does what the math says. The
quantization step itself (means, scales, the division before rounding) is done in float32
as the kernel does it, so the same values round the same way; everything after it (the
products, the softmax, the accumulation) is float64. Used by tests and to explain the
schemes; never on a hot path.
"""

from __future__ import annotations

import math

import torch

INT8_MAX = 127.0
FP8_MAX = 448.0
_TINY = 1e-30
# The least V block scale: the kernels keep their P.V accumulator in units of the current tile's
# V scale, so a scale near 0 (a block equal to the mean) would blow it up; with 2^-40 that needs
# |V| near 1e19. Below about 4e-10 a block is then quantized on a coarser grid than its range
# asks for (absolute error under 2^-49).
V_SCALE_FLOOR = 2.0 ** -40


from ..problem import default_scale
from .quant_prepass import SMOOTHING_SAMPLE  # the kernels' sample, in one place


def smoothing_mean(x: torch.Tensor) -> torch.Tensor:
    """The vector subtracted from every key (or value) row before quantization: the float32
    mean over the sequence of x (..., N, D), estimated from about 256 evenly strided rows.

    Any vector keeps attention exact (softmax ignores a shift common to a query's scores, and
    the weights of V sum to one), so an estimate costs no accuracy in principle and reads a
    small fraction of K and V; it only needs to be near the mean to shrink what is quantized.
    """
    n = x.shape[-2]
    if n == 0:
        return torch.zeros(x.shape[:-2] + x.shape[-1:], dtype=torch.float32, device=x.device)
    stride = max(1, n // SMOOTHING_SAMPLE)
    return torch.mean(x[..., ::stride, :], dim=-2, dtype=torch.float32)


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """x already divided by its scale: floor(x + 0.5), clamped to [-127, 127], as float64."""
    return torch.clamp(torch.floor(x + 0.5), -INT8_MAX, INT8_MAX).double()


def quantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """x already divided by its scale: rounded to float8 e4m3 (nearest even), as float64."""
    return x.clamp(-FP8_MAX, FP8_MAX).float().to(torch.float8_e4m3fn).double()


def _quantize(x: torch.Tensor, mode: str) -> torch.Tensor:
    return quantize_int8(x) if mode == "int8" else quantize_fp8(x)


def _qmax(mode: str) -> float:
    return INT8_MAX if mode == "int8" else FP8_MAX


def quantize_rows(q: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scales (amax / QMAX) and quantized values of q (..., N, D), float64."""
    q = q.float()
    scale = (q.abs().amax(-1) / _qmax(mode)).clamp_min(_TINY)
    return _quantize(q / scale[..., None], mode), scale.double()


def quantize_key_blocks(k: torch.Tensor, block_n: int, mode: str, k_mean: torch.Tensor | None = None):
    """K smoothed by `smoothing_mean`, then one scale per block of block_n keys.

    Returns (k_q (..., N, D), per-key scale (..., N)), float64."""
    mean = (smoothing_mean(k) if k_mean is None else k_mean.float()).unsqueeze(-2)
    ks = k.float() - mean
    n = ks.shape[-2]
    blocks = math.ceil(n / block_n)
    pad = blocks * block_n - n
    padded = torch.nn.functional.pad(ks, (0, 0, 0, pad))
    amax = padded.unflatten(-2, (blocks, block_n)).abs().amax((-1, -2))
    scale = (amax / _qmax(mode)).clamp_min(_TINY)
    per_key = scale.repeat_interleave(block_n, -1)[..., :n]
    return _quantize(ks / per_key[..., None], mode), per_key.double()


def value_fp8(v: torch.Tensor, block_n: int, v_mean=None):
    """V smoothed by `smoothing_mean`, then one scale per block of block_n keys (the block's
    amax over its keys and channels / 448, at least V_SCALE_FLOOR) into e4m3's range.

    Returns (v_q (..., N, D) float64 e4m3 values, block scales (..., blocks) float64,
    v_mean (..., D) float64)."""
    mean = smoothing_mean(v) if v_mean is None else v_mean.float()
    vs = v.float() - mean.unsqueeze(-2)
    n = vs.shape[-2]
    blocks = math.ceil(n / block_n)
    padded = torch.nn.functional.pad(vs, (0, 0, 0, blocks * block_n - n))
    amax = padded.unflatten(-2, (blocks, block_n)).abs().amax((-1, -2))
    scale = (amax / FP8_MAX).clamp_min(V_SCALE_FLOOR)
    per_key = scale.repeat_interleave(block_n, -1)[..., :n]
    return quantize_fp8(vs / per_key[..., None]), scale.double(), mean.double()


def simulate_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qk: str = "int8",
    pv: str = "native",
    block_n: int = 64,
    scale: float | None = None,
    keep: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Quantized attention in float64, tile by tile as the kernel computes it.

    q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) in their input dtype (GQA: Hq a multiple of
    Hkv); qk in {"int8", "fp8", "native"}; pv in {"native", "fp8"}; keep: bool broadcast to
    (B, Hq, Nq, Nk), True where a query sees a key (causal, windows, masks already folded in);
    bias: additive mask, same broadcast. Returns float64 (B, Hq, Nq, D); a row that sees no
    key is 0. With pv="native", P is rounded to v's dtype before P.V, as in the kernel.
    return_lse: also return each row's log-sum-exp of the quantized scores (natural log, -inf
    for a row that sees no key), the smoothing mean's share scale * q.k_mean added back, as the
    kernel's STORE_LSE writes it.
    """
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = default_scale(d) if scale is None else scale
    mean_share = torch.zeros((b, hq, nq), dtype=torch.float64)
    if qk == "native":
        qq, q_scale = q.double(), torch.ones(q.shape[:-1], dtype=torch.float64)
        kq, k_scale = k.double(), torch.ones(k.shape[:-1], dtype=torch.float64)
    else:
        qq, q_scale = quantize_rows(q, qk)
        k_mean = smoothing_mean(k)
        kq, k_scale = quantize_key_blocks(k, block_n, qk, k_mean)
        mean_share = (q.double() @ k_mean.double().repeat_interleave(group, 1).unsqueeze(-1)).squeeze(-1) * scale
    if pv == "fp8":
        vq, v_scale, v_mean = value_fp8(v, block_n)
        v_scale = v_scale.repeat_interleave(group, 1)
    else:
        vq = v.double()
    kq, k_scale = kq.repeat_interleave(group, 1), k_scale.repeat_interleave(group, 1)
    vq = vq.repeat_interleave(group, 1)
    s = (qq @ kq.transpose(-1, -2)) * q_scale[..., None] * k_scale[..., None, :] * scale
    if bias is not None:
        s = s + bias.double()
    if keep is not None:
        s = s.masked_fill(~keep.expand(s.shape), float("-inf"))
    m = torch.full((b, hq, nq), float("-inf"), dtype=torch.float64)
    l_sum = torch.zeros((b, hq, nq), dtype=torch.float64)
    acc = torch.zeros((b, hq, nq, d), dtype=torch.float64)
    for start in range(0, nk, block_n):
        st = s[..., start:start + block_n]
        m_new = torch.maximum(m, st.amax(-1))
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - shift)
        p = torch.exp(st - shift[..., None])
        l_sum = l_sum * alpha + p.sum(-1)
        if pv == "fp8":
            pq = quantize_fp8(p * FP8_MAX)
        else:
            pq = p.to(v.dtype).double()
        pv_tile = pq @ vq[..., start:start + block_n, :]
        if pv == "fp8":  # the tile's V scale, per (batch, head)
            pv_tile = pv_tile * v_scale[..., start // block_n, None, None]
        acc = acc * alpha[..., None] + pv_tile
        m = m_new
    seen = l_sum > 0
    out = acc / torch.where(seen, l_sum, torch.ones_like(l_sum))[..., None]
    if pv == "fp8":
        out = out / FP8_MAX + v_mean.repeat_interleave(group, 1)[..., None, :]
    out = torch.where(seen[..., None], out, torch.zeros_like(out))
    if not return_lse:
        return out
    lse = torch.where(seen, m + torch.log(torch.where(seen, l_sum, torch.ones_like(l_sum))) + mean_share,
                      torch.full_like(l_sum, float("-inf")))
    return out, lse
