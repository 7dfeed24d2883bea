"""torch custom ops over our exact Triton kernels (`adaattn::triton_fwd`, `adaattn::triton_bwd`),
with fake (meta) implementations and autograd, so torch.compile(fullgraph=True) traces through
them. The launch description (triton_launch.AttentionLaunch) travels as a string (launch_id)."""

from __future__ import annotations

from typing import Optional

import torch

from .triton_launch import launch_bwd, launch_fwd, launch_of, lse_shape, new_output, out_shape, stats_shape


@torch.library.custom_op("adaattn::triton_fwd", mutates_args=())
def triton_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int, max_seqlen_k: int, launch: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, stats). Dense q (B, Hq, Nq, D) or packed (T, Hq, D) with cu_seqlens. stats:
    the split row statistics the backward reads under an additive mask (triton_launch.stats_shape),
    empty otherwise."""
    stats = new_output(stats_shape(q, attn_mask, cu_seqlens_q is not None), torch.float32, q.device)
    out, lse = launch_fwd(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          launch_of(launch), stats)
    return out, lse, stats


@triton_fwd.register_fake
def _triton_fwd_fake(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, launch):
    lse = q.new_empty(lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)
    stats = q.new_empty(stats_shape(q, attn_mask, cu_seqlens_q is not None), dtype=torch.float32)
    # Contiguous, as the real outputs are (empty_like would copy a view's strides).
    return q.new_empty(out_shape(q, v)), lse, stats


@torch.library.custom_op("adaattn::triton_bwd", mutates_args=())
def triton_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, attn_mask: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, launch: str,
    stats: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv). stats: triton_fwd's third output."""
    return launch_bwd(dout, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                      max_seqlen_k, launch_of(launch), stats)


@triton_bwd.register_fake
def _triton_bwd_fake(dout, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, launch, stats=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, attn_mask, cu_q, cu_k, max_q, max_k, launch = inputs
    out, lse, stats = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, cu_q, cu_k, stats)
    ctx.options = (max_q, max_k, launch)
    ctx.mark_non_differentiable(lse, stats)


def _fwd_backward(ctx, dout, dlse, dstats):
    q, k, v, out, lse, attn_mask, cu_q, cu_k, stats = ctx.saved_tensors
    dq, dk, dv = triton_bwd(dout, q, k, v, out, lse, attn_mask, cu_q, cu_k, *ctx.options, stats)
    return dq, dk, dv, None, None, None, None, None, None


triton_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)
