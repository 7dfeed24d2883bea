"""torch custom ops over our exact Triton kernels (`adaattn::triton_fwd`, `adaattn::triton_bwd`),
with fake (meta) implementations and autograd, so torch.compile(fullgraph=True) traces through
them. The launch description (launch.AttentionLaunch) travels as a string (launch_id).
Eager calls with no compiler, transform or mode watching skip the ops' dispatch (attention_fwd:
the same launches through an autograd.Function)."""

from __future__ import annotations

from typing import Optional

import torch

from .backward import launch_bwd
from .common import LOG2E, new_output
from .forward import launch_fwd
from .launch import launch_of
from .layout import lse_shape, out_shape, stats_shape


@torch.library.custom_op("adaattn::triton_fwd", mutates_args=())
def triton_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int, max_seqlen_k: int, launch: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, stats). Dense q (B, Hq, Nq, D) or packed (T, Hq, D) with cu_seqlens. stats:
    the split row statistics the backward reads under an additive mask (layout.stats_shape),
    empty otherwise."""
    return _forward(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, launch)


def _forward(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, launch: str,
             sinks=None, out_dtype=None, slopes=None) -> tuple:
    stats = new_output(stats_shape(q, attn_mask, cu_seqlens_q is not None), torch.float32, q.device)
    out, lse = launch_fwd(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          launch_of(launch), stats, sinks, out_dtype, slopes)
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
    """(dq, dk, dv). stats: triton_fwd's third output. out and lse are these keys' own forward, so
    the backward may recompute delta from them (backward.launch_bwd, exact_delta)."""
    return launch_bwd(dout, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                      max_seqlen_k, launch_of(launch), stats, exact_delta=True)


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


SECOND_ORDER = ("adaattn's Triton attention backward has no derivative of its own (no second-order gradients); "
                "differentiate through another backend, e.g. Policy(backends=('sdpa.math',))")


class _EagerAttention(torch.autograd.Function):
    """triton_fwd with its autograd, for eager calls, without the custom op's dispatch: the same
    launches, saved tensors and gradients (the custom op's layers measured 190-390 us more host time
    a forward and backward on an H100's host: benchmarks/NOTES.md, 2026-11-27). Not differentiable
    twice, as the custom op's backward is not: gradients made with
    create_graph=True raise when differentiated, never give a silent zero."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, cu_q, cu_k, max_q, max_k, launch):
        out, lse, stats = _forward(q, k, v, attn_mask, cu_q, cu_k, max_q, max_k, launch)
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, cu_q, cu_k, stats)
        ctx.options = (max_q, max_k, launch)
        ctx.mark_non_differentiable(lse, stats)
        return out, lse, stats

    @staticmethod
    def backward(ctx, dout, dlse, dstats):
        q, k, v, out, lse, attn_mask, cu_q, cu_k, stats = ctx.saved_tensors
        max_q, max_k, launch = ctx.options
        grads = launch_bwd(dout, q, k, v, out, lse, attn_mask, cu_q, cu_k, max_q, max_k, launch_of(launch), stats,
                           exact_delta=True)
        if torch.is_grad_enabled():  # create_graph=True: a backward through these gradients raises
            grads = _FirstOrderOnly.apply(*grads, q, k, v)
        return (*grads, None, None, None, None, None, None)


class _FirstOrderOnly(torch.autograd.Function):
    """Gradients made under create_graph=True, tied to the inputs they came from (so any second
    backward toward those inputs runs this node), whose own backward raises."""

    @staticmethod
    def forward(ctx, dq, dk, dv, *inputs):
        return dq.view_as(dq), dk.view_as(dk), dv.view_as(dv)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(SECOND_ORDER)


def attention_fwd(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                  launch: str) -> tuple:
    """(out, lse, stats) of triton_fwd, differentiable: through the custom op where a compiler,
    transform or mode may be watching (eager_ok says when not), else through _EagerAttention."""
    if eager_ok(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k):
        return _EagerAttention.apply(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     launch)
    return triton_fwd(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, launch)


class _ModifiedAttention(torch.autograd.Function):
    """Attention with sinks and/or ALiBi slopes on our pointer kernels (soft-capping rides in the
    launch). Sinks (a logit z per query head joining each row's denominator, no value): the forward
    folds z into each row's softmax (kernels/attention_fwd, HAS_SINKS), so its output and lse are the
    sinks' own, and the kernels' backward from them is the whole gradient of q, k and v; d z =
    -sum_rows e^(z - lse) delta, delta = rowsum(dO . out), from the output unrounded (the forward
    writes it in float32 then: from the rounded one, bfloat16 d z was 2.2-2.3x eager's error). ALiBi:
    the slopes go to every kernel that computes scores (alibi_bias); they get no gradient here (the
    runner declines slopes that want one). Eager calls only: the runner declines these under
    torch.compile."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, sinks, slopes, launch):
        z = None if sinks is None else sinks.detach().float().contiguous()
        m = None if slopes is None else slopes.detach().float().contiguous()
        out, lse, stats = _forward(q, k, v, attn_mask, None, None, q.shape[2], k.shape[2], launch, z,
                                   None if z is None else torch.float32, m)
        ctx.save_for_backward(q, k, v, attn_mask, out, lse, stats, z, m)
        ctx.launch, ctx.sinks_dtype = launch, None if sinks is None else sinks.dtype
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, attn_mask, out, lse, stats, z, m = ctx.saved_tensors
        dq, dk, dv = launch_bwd(dout, q, k, v, out, lse, attn_mask, None, None, q.shape[2], k.shape[2],
                                launch_of(ctx.launch), stats, exact_delta=True, slopes=m, sinks=z is not None)
        dz = None
        if z is not None:
            # In float64: d z sums rows of either sign, so what it keeps is what the terms keep.
            delta = (dout.double() * out.double()).sum(-1)  # (B, Hq, Nq)
            if stats.numel():  # e^(z - lse) from the split statistics: (z log2 e - m) - log2 sum keeps the
                # low bits a float32 lse loses at |lse| of a few units (float32 d z was 4x eager's error)
                weight = torch.exp2((z.double()[None, :, None] * LOG2E - stats[0].double()) - stats[1].double())
            else:
                weight = torch.exp(sinks_minus_lse(z.double(), lse.double()))
            dz = -(weight * delta).sum((0, 2)).to(ctx.sinks_dtype)
        return dq, dk, dv, None, dz, None, None


def sinks_minus_lse(sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """z - lse per row, (B, Hq, Nq) in float32 (float64 sinks stay float64)."""
    return sinks.to(torch.promote_types(sinks.dtype, torch.float32))[None, :, None] - lse


def modified_attention(q, k, v, attn_mask, sinks, slopes, launch: str) -> torch.Tensor:
    """Dense (B, Hq, Nq, D) attention with sinks (Hq,) and/or ALiBi slopes ((Hq,) or (B, Hq)) on
    our kernels (_ModifiedAttention)."""
    return _ModifiedAttention.apply(q, k, v, attn_mask, sinks, slopes, launch)


def eager_ok(*tensors) -> bool:
    """Whether a call may bypass the custom ops: plain tensors, no tracing or compiling, no functorch
    transform, no torch-function or dispatch mode (each of these needs the ops' registrations)."""
    if any(t is not None and type(t) is not torch.Tensor for t in tensors):
        return False
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active() or torch.jit.is_tracing():
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    return torch.utils._python_dispatch._get_current_dispatch_mode() is None
