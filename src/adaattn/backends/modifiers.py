"""`mods.torch`: attention with score modifiers (soft-capping, sinks, ALiBi) in plain torch ops.

The exact fallback for calls with a score modifier (problem.Modifiers has the formulas), on any
device: the scores in float32 (float64 for float64 inputs), as torch's math kernel computes half
precision, a block of query rows at a time so the scores of a long call never sit in memory
whole. Gradients flow to q, k, v, an additive mask that wants one, the sinks and the ALiBi slopes
through autograd. Our kernels apply the modifiers in-tile where they can (their `modifiers`);
this runner takes what they decline.
"""

from __future__ import annotations

import torch

from .base import Runner
from .masks import position_keep

# Bytes of float32 scores one block of query rows may hold (the softmax keeps a few such tensors).
BLOCK_BYTES = 128 * 2**20


def _rows_per_block(problem) -> int:
    per_row = max(1, problem.batch * problem.q_heads * max(problem.kv_len, 1) * 4)
    return max(1, min(problem.q_len, BLOCK_BYTES // per_row))


def modified_attention(query, key, value, attn_mask, problem, modifiers) -> torch.Tensor:
    """(B, Hq, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv) -> (B, Hq, Nq, Dv) in the query dtype."""
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    b, hq, nq, _ = query.shape
    hkv, nk, dv = key.shape[1], key.shape[2], value.shape[-1]
    groups = hq // hkv if hkv else 1
    if nq == 0 or nk == 0:  # nothing to attend: zeros, as SDPA (the sink carries no value either)
        return query.new_zeros(b, hq, nq, dv) + 0 * query.sum() + 0 * key.sum() + 0 * value.sum()
    # Query heads grouped over their KV head: (B, Hkv, G, N, D) against (B, Hkv, 1, N, D), no copy of K/V.
    q = query.reshape(b, hkv, groups, nq, query.shape[-1]).to(compute)
    k = key.unsqueeze(2).to(compute)
    v = value.unsqueeze(2).to(compute)
    keep = position_keep(nq, nk, problem.causal, problem.window, query.device, problem.bottom_right)
    mask = attn_mask
    if mask is not None:
        mask = mask.expand(b, hq, nq, nk).reshape(b, hkv, groups, nq, nk)
    if keep is not None:
        keep = keep.view(1, 1, 1, nq, nk)
    slopes = modifiers.alibi_slopes
    if slopes is not None:
        slopes = slopes.to(compute)
        slopes = (slopes[None] if slopes.dim() == 1 else slopes).expand(b, hq).reshape(b, hkv, groups, 1, 1)
    sinks = None
    if modifiers.sinks is not None:
        sinks = modifiers.sinks.to(compute).view(1, hkv, groups, 1, 1)
    offset = nk - nq if problem.bottom_right else 0
    cols = torch.arange(nk, device=query.device, dtype=compute)
    step = _rows_per_block(problem)
    outs = []
    for r0 in range(0, nq, step):
        r1 = min(nq, r0 + step)
        s = torch.matmul(q[..., r0:r1, :], k.transpose(-1, -2)) * problem.scale
        if modifiers.softcap is not None:
            s = torch.tanh(s / modifiers.softcap) * modifiers.softcap
        if slopes is not None:
            rows = torch.arange(r0, r1, device=query.device, dtype=compute)[:, None] + offset
            s = s - slopes * (rows - cols).abs()
        if keep is not None:
            s = s.masked_fill(~keep[..., r0:r1, :], float("-inf"))
        if mask is not None:
            m = mask[..., r0:r1, :]
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(compute)
        top = s.amax(dim=-1, keepdim=True)
        if sinks is not None:
            top = torch.maximum(top, sinks)  # the sink is never masked
        top = torch.where(torch.isneginf(top), torch.zeros_like(top), top).detach()
        p = torch.exp(s - top)
        denom = p.sum(dim=-1, keepdim=True)
        if sinks is not None:
            denom = denom + torch.exp(sinks - top)
        p = p / torch.where(denom == 0, torch.ones_like(denom), denom)  # a dead row: zeros
        if problem.dropout_p > 0:
            p = torch.nn.functional.dropout(p, problem.dropout_p)
        outs.append(torch.matmul(p, v))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    return out.reshape(b, hq, nq, dv).to(query.dtype)


class ModifiedTorchRunner(Runner):
    """Score modifiers in torch ops (modified_attention): exact, any device and dtype."""

    name = "mods.torch"
    modifiers = frozenset(("softcap", "sinks", "alibi_slopes"))

    def supports(self, problem, policy) -> list[str]:
        reasons = []
        if problem.device_type == "meta":
            reasons.append("computes on real tensors (meta calls go to the meta runner).")
        if problem.varlen:
            reasons.append("takes dense (B, H, N, D) tensors, not packed sequences.")
        if not problem.modifiers:
            reasons.append("runs calls with a score modifier only (softcap, sinks, alibi_slopes); others have "
                           "faster runners.")
        return reasons

    def run(self, query, key, value, attn_mask, problem, launch, label=None, modifiers=None):
        from ..problem import NO_MODIFIERS

        return modified_attention(query, key, value, attn_mask, problem, modifiers or NO_MODIFIERS)
