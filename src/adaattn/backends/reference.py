"""Exact attention in float64 with plain tensor math: the yardstick for tests and verification."""

from __future__ import annotations

import math

import torch

from .base import Runner
from .masks import fold_positions


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
) -> torch.Tensor:
    """Attention in float64 on (B, H, N, D) tensors; returns float64 (B, Hq, Nq, Dv).

    Semantics follow torch SDPA's math backend: causal is top-left aligned, GQA repeats
    key/value heads, and a row with no key to attend gives zeros.
    """
    q, k, v = query.double(), key.double(), value.double()
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    nq, nk = q.shape[2], k.shape[2]
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    mask = fold_positions(attn_mask, nq, nk, is_causal, window, q.device, q.dtype)
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        else:
            s = s + mask.double()
    if nk == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    row_max = s.amax(dim=-1, keepdim=True)
    dead = torch.isneginf(row_max)
    p = torch.exp(s - torch.where(dead, torch.zeros_like(row_max), row_max))
    denom = p.sum(dim=-1, keepdim=True)
    p = torch.where(dead, torch.zeros_like(p), p / torch.where(dead, torch.ones_like(denom), denom))
    return p @ v


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

    def run(self, query, key, value, attn_mask, problem, launch, label=None):
        out = reference_attention(
            query, key, value, attn_mask, problem.causal, problem.scale, problem.window
        )
        return out.to(query.dtype)
