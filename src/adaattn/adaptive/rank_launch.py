"""Launch of the tile-plan kernel (kernels/attention_rank.py)."""

from __future__ import annotations

import torch

from ..backends.triton.bound import bound
from ..backends.triton.common import LOG2E, cdiv, dot_precision, interpreting, next_pow2
from .block_layout import Estimate, Plan, Summaries, sampled_rows


def _kernel():
    from ..kernels.attention_rank import rank_fwd_kernel

    return rank_fwd_kernel


PLAN_CHUNK = 4096  # key blocks a plan program holds at once (more: it loops over chunks)


def plan_blocks(values: torch.Tensor, thresholds: torch.Tensor, n: int, causal: bool, *, summaries: bool,
                query_block: int, key_block: int, local: int, chunk: int = PLAN_CHUNK) -> Plan:
    """blocks.make_plan in one Triton launch (kernels/rank_plan.py) on the values it orders by."""
    from ..kernels.rank_plan import plan_kernel
    from .block_layout import layout_counts

    b, hq, nqb, nkb = values.shape
    dev = values.device
    state = torch.empty((b, hq, nqb, nkb), dtype=torch.int8, device=dev)
    eidx = torch.zeros((b, hq, nqb, nkb + 1), dtype=torch.int32, device=dev)
    ecnt = torch.empty((b, hq, nqb), dtype=torch.int32, device=dev)
    scnt = torch.empty_like(ecnt)
    if values.numel():
        bound(plan_kernel)[(nqb, b * hq)](
            values.contiguous(), thresholds.float().contiguous(), state, eidx, ecnt, scnt, hq, nkb, n,
            QUERY_BLOCK=query_block, KEY_BLOCK=key_block, LOCAL=local,
            CHUNK=min(max(16, next_pow2(nkb)), chunk), CAUSAL=causal, SUMMARIES=summaries,
            num_warps=4,
        )
    visible, tails = layout_counts(n, causal, query_block, key_block, dev, local)
    density = (ecnt.sum((0, 2)).float() + b * tails) / (b * visible)
    summarised = scnt.sum((0, 2)).float() / (b * visible)
    return Plan(state, eidx, ecnt, density, summarised, query_block, key_block, causal)


def summarize_blocks(k: torch.Tensor, v: torch.Tensor, key_block: int) -> Summaries:
    """blocks.summarize in one Triton launch (kernels/block_summary.py); unit last strides."""
    from ..kernels.block_summary import summary_kernel
    from .block_layout import block_counts

    b, hkv, n, d = k.shape
    dv = v.shape[-1]
    nkb = cdiv(n, key_block)
    keys = torch.empty((b, hkv, nkb, d), dtype=k.dtype, device=k.device)
    values = torch.empty((b, hkv, nkb, dv), dtype=v.dtype, device=k.device)
    var = torch.empty((b, hkv, nkb, d), dtype=torch.float32, device=k.device)
    if keys.numel() or values.numel():
        bound(summary_kernel)[(nkb, b * hkv)](
            k, v, keys, values, var, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            hkv, n, nkb, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), HEAD_DIM_V=dv, BLOCK_DV=max(16, next_pow2(dv)),
            KEY_BLOCK=key_block, num_warps=2,
        )
    return Summaries(keys, values, var, block_counts(n, key_block, k.device), key_block)


ESTIMATE_GROUP = 8  # query blocks per program of the estimate: the summaries are read once for all


def estimate_blocks(q: torch.Tensor, k: torch.Tensor, s: Summaries, scale: float, causal: bool, *,
                    query_block: int, per_block: int, spread: bool, local: int) -> Estimate:
    """blocks.estimate in one Triton launch (kernels/attention_estimate.py); q, k with unit last
    strides, query length = key length."""
    from ..kernels.attention_estimate import estimate_kernel

    b, hq, n, d = q.shape
    hkv = k.shape[1]
    nkb = s.counts.numel()
    nqb = -(-n // query_block)
    r = max(1, min(per_block, query_block))
    mass = torch.zeros((b, hq, nqb, nkb), dtype=torch.float32, device=q.device)
    cost = torch.zeros_like(mass)
    ent = torch.empty((b, hq, nqb), dtype=torch.float32, device=q.device)
    group = 2 if interpreting() else ESTIMATE_GROUP
    if n:
        bound(estimate_kernel)[(-(-nqb // group), b * hq)](
            q, k, s.keys, s.variance, mass, cost, ent,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            hq, hq // hkv, n, nqb, nkb, float(scale),
            HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), QUERY_BLOCK=query_block, KEY_BLOCK=s.key_block,
            ROWS=r, ROWS_P=max(next_pow2(r), 16 // group), GROUP=group, BLOCK_S=16 if interpreting() else 64, LOCAL=local,
            CAUSAL=causal, SPREAD=spread, DOT_PRECISION="ieee" if interpreting() else "tf32",
            num_warps=4, num_stages=1 if interpreting() else 2,
        )
    rows = sampled_rows(n, query_block, per_block, q.device)
    return Estimate(mass, ent.mean((0, 2)), rows, cost)


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


__all__ = ["rank_forward", "estimate_blocks", "plan_blocks", "summarize_blocks", "config"]
