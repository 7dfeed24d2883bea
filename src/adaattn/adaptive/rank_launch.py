"""Launch of the tile-plan kernel (kernels/attention_rank.py)."""

from __future__ import annotations

import torch

from ..backends.triton_configs import interpreting, next_pow2
from ..backends.triton_launch import LOG2E, dot_precision
from .blocks import Plan, Summaries


def _kernel():
    from ..kernels.attention_rank import rank_fwd_kernel

    return rank_fwd_kernel


def config(head_dim: int, key_block: int) -> dict:
    """Warps, stages and summary chunk of a launch (interpreter: the smallest)."""
    if interpreting():
        return {"num_warps": 4, "num_stages": 1, "BLOCK_S": 16}
    return {"num_warps": 8 if head_dim > 64 else 4, "num_stages": 3 if key_block <= 64 else 2, "BLOCK_S": 64}


def rank_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, summaries: Summaries | None,
                 scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q (B, Hq, N, D) over k/v (B, Hkv, N, D/Dv) under `plan` (summaries None: the
    plan's summarised blocks are skipped; a plan made with summaries=False has none); unit last
    strides."""
    b, hq, n, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    nqb, nkb = plan.state.shape[2], plan.state.shape[3]
    if out is None:
        out = torch.empty((b, hq, n, dv), dtype=q.dtype, device=q.device)
    if n == 0 or out.numel() == 0:
        return out
    cfg = config(d, plan.key_block)
    has_summary = summaries is not None
    ks, vs = (summaries.keys, summaries.values) if has_summary else (q, q)
    _kernel()[(nqb, b * hq)](
        q, k, v, ks, vs, plan.state, plan.eidx, plan.ecnt, out,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        hq, hq // hkv, n, nkb, float(scale) * LOG2E,
        HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), HEAD_DIM_V=dv, BLOCK_DV=max(16, next_pow2(dv)),
        BLOCK_M=plan.query_block, BLOCK_N=plan.key_block, BLOCK_S=cfg["BLOCK_S"],
        CAUSAL=plan.causal, HAS_SUMMARY=has_summary, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


__all__ = ["rank_forward", "config"]
