"""Launch of the tile-plan kernel (kernels/attention_rank.py)."""

from __future__ import annotations

import torch

from ..backends.triton_configs import interpreting, next_pow2
from ..backends.triton_launch import dot_precision
from .blocks import Plan, Summaries

LOG2E = 1.4426950408889634


def _kernel():
    from ..kernels.attention_rank import rank_fwd_kernel

    return rank_fwd_kernel


def config(head_dim: int, key_block: int) -> dict:
    """Warps, stages and summary chunk of a launch (interpreter: the smallest)."""
    if interpreting():
        return {"num_warps": 4, "num_stages": 1, "BLOCK_S": 16}
    return {"num_warps": 8 if head_dim > 64 else 4, "num_stages": 3 if key_block <= 64 else 2, "BLOCK_S": 64}


def rank_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, summaries: Summaries, scale: float,
                 spread: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q (B, Hq, N, D) over k/v (B, Hkv, N, D/Dv) under `plan`; unit last strides."""
    b, hq, n, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    nqb, nkb = plan.state.shape[2], plan.state.shape[3]
    if out is None:
        out = torch.empty((b, hq, n, dv), dtype=q.dtype, device=q.device)
    if n == 0 or out.numel() == 0:
        return out
    cfg = config(d, plan.key_block)
    has_summary = bool(summaries is not None)
    ks = summaries.keys if has_summary else q
    vs = summaries.values if has_summary else q
    var = summaries.variance if has_summary else q
    _kernel()[(nqb, b * hq)](
        q, k, v, ks, vs, var, plan.state, plan.eidx, plan.ecnt, out,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        hq, hq // hkv, n, nkb, float(scale) * LOG2E, 0.5 * float(scale) ** 2 * LOG2E,
        HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), HEAD_DIM_V=dv, BLOCK_DV=max(16, next_pow2(dv)),
        BLOCK_M=plan.query_block, BLOCK_N=plan.key_block, BLOCK_S=cfg["BLOCK_S"],
        CAUSAL=plan.causal, HAS_SUMMARY=has_summary, SPREAD=bool(spread and has_summary),
        DOT_PRECISION=dot_precision(q.dtype), F32_PRECISION="ieee" if interpreting() else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


__all__ = ["rank_forward", "config"]
