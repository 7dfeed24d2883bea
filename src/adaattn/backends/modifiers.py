"""`mods.torch`: attention with score modifiers (soft-capping, sinks, ALiBi) in plain torch ops.

The exact fallback for calls with a score modifier (problem.Modifiers has the formulas), on any
device: the scores in float32 for half precision, as torch's math kernel computes it, and in float64
for float32 and float64, a block of query rows at a time so the scores of a long call never sit in memory
whole. Gradients flow to q, k, v, an additive mask that wants one, the sinks and the ALiBi slopes
through autograd. Our kernels apply the modifiers in-tile where they can (their `modifiers`);
this runner takes what they decline.
"""

from __future__ import annotations

import torch

from .base import Runner
from .masks import position_keep

# Bytes of scores one block of query rows may hold (the softmax keeps a few such tensors).
BLOCK_BYTES = 128 * 2**20


def _rows_per_block(problem, compute: torch.dtype) -> int:
    per_row = max(1, problem.batch * problem.q_heads * max(problem.kv_len, 1) * (8 if compute == torch.float64 else 4))
    return max(1, min(problem.q_len, BLOCK_BYTES // per_row))


def modified_attention(query, key, value, attn_mask, problem, modifiers) -> torch.Tensor:
    """(B, Hq, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv) -> (B, Hq, Nq, Dv) in the query dtype."""
    # Half precision computes in float32, as torch's math kernel; float32 in float64: gradients that sum
    # the whole score matrix (the ALiBi slopes') lost their low bits to float32 cancellation (a CPU fuzzer,
    # seed 4900 --modifiers #62: 4.6x eager's float32 error).
    compute = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else torch.float64
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
    if slopes is not None:  # in float64: the slopes' gradient sums the whole score matrix (float32 lost 10x)
        slopes = slopes.to(torch.float64)
        slopes = (slopes[None] if slopes.dim() == 1 else slopes).expand(b, hq).reshape(b, hkv, groups, 1, 1)
    sinks = None
    if modifiers.sinks is not None:
        sinks = modifiers.sinks.to(compute).view(1, hkv, groups, 1, 1)
    offset = nk - nq if problem.bottom_right else 0
    cols = torch.arange(nk, device=query.device, dtype=torch.float64)
    step = _rows_per_block(problem, compute)
    outs = []
    for r0 in range(0, nq, step):
        r1 = min(nq, r0 + step)
        s = torch.matmul(q[..., r0:r1, :], k.transpose(-1, -2)) * problem.scale
        if modifiers.softcap is not None:
            s = torch.tanh(s / modifiers.softcap) * modifiers.softcap
        if slopes is not None:
            rows = torch.arange(r0, r1, device=query.device, dtype=torch.float64)[:, None] + offset
            s = s - (slopes * (rows - cols).abs()).to(compute)
        if keep is not None:
            s = s.masked_fill(~keep[..., r0:r1, :], float("-inf"))
        if mask is not None:
            m = mask[..., r0:r1, :]
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(compute)
        # torch.softmax, whose backward p * (g - sum p g) keeps each row's gradient summing to zero
        # (an exp / sum / divide graph did not: float32 ALiBi slope gradients 10-300x eager's error).
        if sinks is not None:  # one more logit a row, never masked, its weight dropped after
            s = torch.cat([s, sinks.expand(*s.shape[:-1], 1)], dim=-1)
            p = torch.softmax(s, dim=-1)[..., :-1]
        else:
            dead = torch.isneginf(s.amax(dim=-1, keepdim=True))  # every key masked: zeros, not NaN
            p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
        if problem.dropout_p > 0:
            p = torch.nn.functional.dropout(p, problem.dropout_p)
        outs.append(torch.matmul(p, v))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    return out.reshape(b, hq, nq, dv).to(query.dtype)


def sink_margin(lse: torch.Tensor, sinks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """lse - z per row (B, H, N), in `dtype`: a sink z[h] weighs each row's plain output by
    w = sigmoid(lse - z) (the row's softmax with one more logit that carries no value)."""
    return lse.detach().to(dtype) - sinks.detach().to(dtype)[None, :, None]


def sink_backward(grad: torch.Tensor, out: torch.Tensor, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For O' = w O (w = sigmoid(margin)) and g = dL/dO': (w g, the plain backward's dout against
    O', whose delta then carries the lse's own path; d sinks = -sum over rows of (1 - w)
    rowsum(g O')), both in margin's dtype. 1 - w is sigmoid(-margin): where w is near 1, 1 - w
    would keep only its rounding (d sinks 50x eager's error in float32)."""
    g = grad.to(margin.dtype)
    dsinks = -((g * out.to(margin.dtype)).sum(-1) * torch.sigmoid(-margin)).sum((0, 2))
    return g * torch.sigmoid(margin)[..., None], dsinks


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
