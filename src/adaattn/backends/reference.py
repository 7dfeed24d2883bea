"""Exact attention in float64 with plain tensor math: the yardstick for tests, verification and
benchmarks (sampled_reference: the exact rows of a long call, with relative_error)."""

from __future__ import annotations


import torch

from ..problem import default_scale
from .base import Runner
from .masks import merge, position_keep


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    bottom_right: bool = False,
) -> torch.Tensor:
    """Attention in float64 on (B, H, N, D) tensors; returns float64 (B, Hq, Nq, Dv).

    Semantics follow torch SDPA's math backend: causal is top-left aligned, GQA repeats
    key/value heads, and a row with no key to attend gives zeros. The score modifiers
    (problem.Modifiers has the formulas) apply to s = scale * q.k before masking: softcap
    c * tanh(s / c), then the ALiBi bias -slope * |i - j|, then the masks; sinks join each
    row's denominator. `bottom_right` puts query i at i + Nk - Nq (causal, window and ALiBi).
    """
    q, k, v = query.double(), key.double(), value.double()
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    nq, nk = q.shape[2], k.shape[2]
    s = (q @ k.transpose(-2, -1)) * (default_scale(q.shape[-1]) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        i = torch.arange(nq, device=q.device, dtype=torch.float64)[:, None] + (nk - nq if bottom_right else 0)
        j = torch.arange(nk, device=q.device, dtype=torch.float64)[None, :]
        slopes = alibi_slopes.double()
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        s = s - slopes * (i - j).abs()
    keep = position_keep(nq, nk, is_causal, window, q.device, bottom_right)
    mask = merge(attn_mask, keep, q.dtype)
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        else:
            s = s + mask.double()
    if nk == 0:
        return q.new_zeros(*s.shape[:-1], v.shape[-1])
    row_max = s.amax(dim=-1, keepdim=True)
    dead = torch.isneginf(row_max)
    if sinks is not None:  # the sink is never masked: a row whose keys are all masked gives 0 by it
        z = sinks.double()[None, :, None, None]
        row_max = torch.where(dead, z, torch.maximum(row_max, z))
        p = torch.exp(s - row_max)
        return (p @ v) / (p.sum(dim=-1, keepdim=True) + torch.exp(z - row_max))
    p = torch.exp(s - torch.where(dead, torch.zeros_like(row_max), row_max))
    denom = p.sum(dim=-1, keepdim=True)
    p = torch.where(dead, torch.zeros_like(p), p / torch.where(dead, torch.ones_like(denom), denom))
    return p @ v


# Bytes of float64 scores one reference chunk may hold; the softmax makes a few copies.
CHUNK_BYTES = 256 * 2**20


def sample_rows(q_len: int, max_rows: int) -> torch.Tensor:
    """Up to `max_rows` query row indices spread evenly over [0, q_len), first and last included."""
    if q_len <= max_rows:
        return torch.arange(q_len)
    return torch.linspace(0, q_len - 1, max_rows).round().long().unique()


def sampled_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rows: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
) -> torch.Tensor:
    """Exact float64 attention for the query rows `rows` only, all batches and heads.

    query (B, Hq, Nq, D), key/value (B, Hkv, Nk, D/Dv) with Hq a multiple of Hkv; returns
    float64 (B, Hq, len(rows), Dv). Causal is top-left aligned: row i attends keys j <= i,
    so a row's reference needs only its own query and the keys up to it. `window` (left, right):
    row i attends keys i-left .. i+right (None on a side: unbounded), as adaattn's `window`. Batches and
    key/value head groups go in chunks so the scores stay under CHUNK_BYTES.
    """
    b, hq, _, _ = query.shape
    hk, nk = key.shape[1], key.shape[2]
    group = hq // hk
    rows = rows.to(query.device)
    keep = None
    keys = torch.arange(nk, device=query.device).unsqueeze(0)
    if causal:
        keep = keys <= rows.unsqueeze(1)
    if window is not None:
        left, right = window
        inside = torch.ones(len(rows), nk, dtype=torch.bool, device=query.device)
        if left is not None:
            inside &= keys >= rows.unsqueeze(1) - left
        if right is not None:
            inside &= keys <= rows.unsqueeze(1) + right
        keep = inside if keep is None else keep & inside
    per_kv_head = group * len(rows) * max(nk, 1) * 8 * 3
    kv_chunk = max(1, min(hk, CHUNK_BYTES // max(per_kv_head, 1)))
    out = []
    for bi in range(b):
        parts = []
        for h0 in range(0, hk, kv_chunk):
            h1 = min(hk, h0 + kv_chunk)
            q = query[bi : bi + 1, h0 * group : h1 * group].index_select(2, rows)
            parts.append(
                reference_attention(q, key[bi : bi + 1, h0:h1], value[bi : bi + 1, h0:h1], keep, False, scale)
            )
        out.append(torch.cat(parts, dim=1))
    return torch.cat(out, dim=0)


def relative_from_squares(d2: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """||out - ref|| / ||ref|| from d2 = ||out - ref||^2 and r2 = ||ref||^2 (||out - ref|| where
    the reference is 0)."""
    return torch.where(r2 > 0, d2 / r2.clamp_min(torch.finfo(r2.dtype).tiny), d2).sqrt()


def relative_errors(out: torch.Tensor, ref: torch.Tensor, dims=None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """||out - ref|| / ||ref|| over `dims` (every dim when None), computed in `dtype`; where the
    reference is 0, ||out - ref||. The library's one relative error: per head it is the tolerance's
    measure (adaptive/analysis.head_errors, rank and sparse decode), over sampled rows the
    benchmarks' (relative_error)."""
    ref = ref.to(dtype)
    diff = out.to(dtype) - ref
    if dims is None:
        return relative_from_squares(diff.pow(2).sum(), ref.pow(2).sum())
    return relative_from_squares(diff.pow(2).sum(dims), ref.pow(2).sum(dims))


def relative_error(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor) -> float:
    """‖out[rows] − ref‖ / ‖ref‖ in float64, over all batches, heads and the sampled rows."""
    return float(relative_errors(out.detach().index_select(2, rows.to(out.device)), ref))


class ReferenceRunner(Runner):
    """float64 math; slow and memory-hungry (N x N scores). Chosen only when named in a policy."""

    name = "reference"

    def supports(self, problem, policy) -> list[str]:
        reasons = []
        if problem.varlen:
            reasons.append("takes dense (B, H, N, D) tensors, not packed sequences.")
        if problem.dropout_p > 0:
            reasons.append("dropout is not implemented in the float64 reference.")
        return reasons

    modifiers = frozenset(("softcap", "sinks", "alibi_slopes"))

    def run(self, query, key, value, attn_mask, problem, launch, label=None, modifiers=None):
        m = modifiers
        out = reference_attention(
            query, key, value, attn_mask, problem.causal, problem.scale, problem.window,
            softcap=None if m is None else m.softcap, sinks=None if m is None else m.sinks,
            alibi_slopes=None if m is None else m.alibi_slopes, bottom_right=problem.bottom_right,
        )
        return out.to(query.dtype)
