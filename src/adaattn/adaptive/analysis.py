"""Cheap analysis for adaptive precision: sampled exact rows, per-head errors, predictions.

All of it runs on the inputs' device with no host synchronisation; callers decide when to
read results back.

- `sample_rows` draws query rows from a generator of its own (the caller's RNG streams are
  untouched).
- `exact_rows` computes exact attention for those rows in float32 from the inputs, which
  are bf16/fp16: their products are exact in fp32 (and in TF32, should the caller allow it),
  so the reference is accurate to about 1e-4, far below any tolerance.
- `head_errors` is the tolerance's measure: per query head, ||o - o_exact|| / ||o_exact||
  over the sampled rows of every batch.
- `predict_errors` estimates each level's error per head from cheap statistics: the dynamic
  range (amax / rms, an outlier ratio) of Q rows and of smoothed K, the spread of V about
  its mean, and how concentrated the sampled attention rows are (sum of p^2, the inverse of
  the effective number of keys; entropy is reported beside it). The model: rounding noise
  of a quantizer with step amax / QMAX has variance step^2 / 12 (INT8), e4m3 rounds with a
  relative error of standard deviation about 0.026; a score perturbed by noise of
  standard deviation sigma moves the output by about sigma * sqrt(sum_j p_j^2 ||v_j - o||^2),
  and a P.V product with relative noise delta on P and V by
  delta * sqrt(2 sum_j p_j^2 ||v_j - v_mean||^2).
"""

from __future__ import annotations

import math

import torch

from ..backends.reference import relative_errors
from .quant_reference import smoothing_mean

# e4m3 keeps 3 mantissa bits: the rounding error is uniform within +-2^-4 of the leading
# power of two, so relative to the value it is 2^-3 / sqrt(12) * sqrt(E[1 / (1 + m)^2]) for a
# mantissa m spread log-uniformly over [0, 1): about 0.026.
FP8_REL_STD = 2.0 ** -3 / math.sqrt(12.0) * math.sqrt(0.5)
INT8_MAX = 127.0
# Relative rounding error (standard deviation) of storing the output in each dtype.
OUTPUT_ROUNDING = {torch.bfloat16: 2.0 ** -9 / math.sqrt(3.0), torch.float16: 2.0 ** -12 / math.sqrt(3.0)}


def sample_rows(q_len: int, count: int, generator: torch.Generator | None, device) -> torch.Tensor:
    """`count` distinct query rows (all of them when q_len <= count), sorted, on `device`."""
    if q_len <= count:
        return torch.arange(q_len, device=device)
    return torch.randperm(q_len, generator=generator, device=device)[:count].sort().values


def _keep(rows, q_len, k_len, causal, bottom_right, window_left, window_right, device):
    """(R, Nk) bool: which keys the sampled rows see, from positions alone (None: all)."""
    if not causal and window_left < 0 and window_right < 0:
        return None
    pos = rows[:, None] + (k_len - q_len if bottom_right else 0)
    j = torch.arange(k_len, device=device)[None, :]
    keep = torch.ones(rows.shape[0], k_len, dtype=torch.bool, device=device)
    right = 0 if causal else window_right
    if causal or window_right >= 0:
        keep &= j <= pos + right
    if window_left >= 0:
        keep &= j >= pos - window_left
    return keep


def exact_rows(q, k, v, rows, attn_mask, scale, causal=False, bottom_right=False, window_left=-1,
               window_right=-1, need_p=True):
    """Exact attention for query `rows` of every (batch, head): (o (B, Hq, R, Dv) float32,
    p (B, Hq, R, Nk) float32 or None). Without p, bf16/fp16 inputs and no explicit mask, one
    Triton launch computes o (adaptive/verify_launch.py, about 1e-5 relative). Otherwise torch,
    one kv head at a time, so the temporaries stay a
    (B, group * R, Nk) slice; P.V runs in float64 (P is not a bf16/fp16 value, and a float32
    matmul may run in TF32 or bf16 under the caller's precision settings). GQA heads share
    their kv head without copies; fully masked rows give 0."""
    if not need_p:  # one Triton launch where it applies (bf16/fp16, no explicit mask)
        from . import verify_launch

        ref = verify_launch.exact_rows(q, k, v, rows, attn_mask, scale, causal, bottom_right, window_left,
                                       window_right)
        if ref is not None:
            return ref, None
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = hq // hkv
    r = rows.shape[0]
    keep = _keep(rows, nq, nk, causal, bottom_right, window_left, window_right, q.device)
    mask = None if attn_mask is None else attn_mask.expand(b, hq, nq, nk)
    outs, ps = [], []
    for h in range(hkv):
        heads = slice(h * g, (h + 1) * g)
        qs = q[:, heads].index_select(2, rows).float().reshape(b, g * r, d)
        # bf16/fp16 products are exact in fp32 (and in TF32 or bf16 passes).
        s = (qs @ k[:, h].float().transpose(-1, -2)).reshape(b, g, r, nk) * scale
        kh = keep
        if mask is not None:
            m = mask[:, heads].index_select(2, rows)
            if m.dtype == torch.bool:
                kh = m if kh is None else (m & kh)
            else:
                s = s + m.float()
        if kh is not None:
            s = s.masked_fill(~kh, float("-inf"))
        p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)  # rows with no visible key
        o = (p.double().reshape(b, g * r, nk) @ v[:, h].double()).float().reshape(b, g, r, v.shape[-1])
        outs.append(o)
        if need_p:
            ps.append(p)
    return torch.cat(outs, 1), (torch.cat(ps, 1) if need_p else None)


def head_errors(out_rows: torch.Tensor, ref_rows: torch.Tensor) -> torch.Tensor:
    """Per query head: ||out - ref|| / ||ref|| over batch, rows and channels (float32, (Hq,)).
    A head whose reference is all zero reports ||out|| itself."""
    return relative_errors(out_rows, ref_rows, (0, 2, 3), torch.float32)


def head_statistics(q, k, v, rows, p, o) -> dict:
    """Cheap statistics per query head (float32 tensors (Hq,)), from the sampled rows, a strided
    sample of keys, and the sampled attention rows p / outputs o of `exact_rows`."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = hq // hkv
    qs = q.index_select(2, rows).float()  # (B, Hq, R, D)
    q_rms_row = qs.pow(2).mean(-1).sqrt()
    q_rms = q_rms_row.pow(2).mean((0, 2)).sqrt()
    q_ratio = (qs.abs().amax(-1) / q_rms_row.clamp_min(1e-30)).mean((0, 2))
    stride = max(1, nk // 256)
    ks = k[:, :, ::stride].float() - smoothing_mean(k)[:, :, None, :]
    k_rms = ks.pow(2).mean((0, 2, 3)).sqrt()
    k_ratio = ks.abs().amax((0, 2, 3)) / k_rms.clamp_min(1e-30)
    # Centred on V's smoothing mean: ||v_j - o|| is unchanged by the shift, and the expanded
    # sum below then does not cancel when V has a large mean.
    v_mean = smoothing_mean(v)
    vc = v.float() - v_mean[:, :, None, :]
    oc = o - v_mean.repeat_interleave(g, 1)[:, :, None, :]
    v_centered_sq = vc.pow(2).sum(-1)  # (B, Hkv, Nk)
    p2 = p.pow(2)  # (B, Hq, R, Nk)
    p2g = p2.reshape(b, hkv, g * p.shape[2], nk)
    # sum_j p_j^2 ||v_j - o||^2 = sum p^2 ||v'||^2 - 2 o' . sum p^2 v' + ||o'||^2 sum p^2
    a = (p2g @ v_centered_sq[..., None]).reshape(b, hq, -1)
    bvec = (p2g @ vc).reshape(b, hq, -1, v.shape[-1])
    c = p2.sum(-1)
    o_sq = o.pow(2).sum(-1)
    spread = (a - 2 * (oc * bvec).sum(-1) + oc.pow(2).sum(-1) * c).clamp_min(0)
    pv_spread = a
    entropy = -(p * torch.log2(p.clamp_min(1e-30))).sum(-1)
    rep = lambda t: t.repeat_interleave(g)  # noqa: E731  per kv head -> per query head
    return {
        "q_rms": q_rms, "q_outlier_ratio": q_ratio,
        "k_rms": rep(k_rms), "k_outlier_ratio": rep(k_ratio),
        "score_sensitivity": (spread.sum((0, 2)) / o_sq.sum((0, 2)).clamp_min(1e-30)).sqrt(),
        "pv_sensitivity": (pv_spread.sum((0, 2)) / o_sq.sum((0, 2)).clamp_min(1e-30)).sqrt(),
        "entropy_bits": entropy.mean((0, 2)),
        "effective_keys": (1.0 / c.clamp_min(1e-30)).mean((0, 2)),
    }


def predict_errors(stats: dict, scale: float, head_dim: int, dtype: torch.dtype, fp8_qk: bool = False) -> dict:
    """Predicted relative error per query head for each level name, float32 tensors (Hq,)."""
    base = OUTPUT_ROUNDING.get(dtype, 0.0)
    qk_scale = scale * math.sqrt(head_dim) * stats["q_rms"] * stats["k_rms"]
    sigma_int8 = qk_scale * torch.sqrt((stats["q_outlier_ratio"] ** 2 + stats["k_outlier_ratio"] ** 2)
                                       / (12.0 * INT8_MAX ** 2))
    sigma_fp8 = qk_scale * math.sqrt(2.0) * FP8_REL_STD
    qk8 = sigma_int8 * stats["score_sensitivity"]
    qk_for_fp8 = (sigma_fp8 if fp8_qk else sigma_int8) * stats["score_sensitivity"]
    pv = math.sqrt(2.0) * FP8_REL_STD * stats["pv_sensitivity"]
    return {
        "exact": torch.full_like(qk8, base),
        "qk8": torch.sqrt(qk8 ** 2 + base ** 2),
        "fp8": torch.sqrt(qk_for_fp8 ** 2 + pv ** 2 + base ** 2),
    }
