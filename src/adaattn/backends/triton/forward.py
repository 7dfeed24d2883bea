"""The forward launchers of our exact Triton kernels: launch_fwd (the general pointer / TMA
kernel, kernels/attention_fwd.py, and for packed calls on Hopper the Gluon forward timed beside
it) and the triton.ws runner's forward (kernels/attention_fwd_ws.py, and on Hopper the Gluon
forward, kernels/attention_fwd_gluon.py). Each takes the frozen launch description of launch.py."""

from __future__ import annotations

from typing import Optional

import torch

from .common import (
    LOG2E,
    alibi_args,
    MASK_NONE,
    KernelConfig,
    RowLayout,
    block_d,
    cdiv,
    dot_precision,
    ensure_triton_allocator,
    gluon_fwd_here,
    interpreting,
    mask_args,
    new_output,
    pointer_ready,
    run_gluon_first,
    shared_layout,
    tensor_descriptor,
)
from .bound import bound
from .configs import fitting_configs
from .launch import AttentionLaunch, check_variant, gluon_varlen_fwd_ok, shape_key
from .layout import clear_packed_tails, heads_rows, lse_shape, lse_strides, out_shape, row_layout
from .tuner import CONFIGS


def launch_fwd(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               launch: AttentionLaunch, stats: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None, slopes: Optional[torch.Tensor] = None):
    """Run the forward kernel; returns (out (..., Dv) like q, lse fp32 (B, Hq, Nq) or (Hq, T)).
    stats: a (2, *lse shape) fp32 tensor (stats_shape) the kernel fills with the row max and
    log2 row sum under an additive mask, for launch_bwd; ignored without one. Packed rows past
    the last sequence give 0 (and an lse of -inf). sinks: (Hq,) logits joining each row's denominator
    (the ptr variant, dense calls); the lse then includes them. out_dtype: float32 for an unrounded
    output (the ptr variant; default q's dtype). slopes: ALiBi slopes, float32 (Hq,) or (B, Hq)
    (the ptr variant, dense calls)."""
    out, lse = _launch_fwd(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, launch, stats,
                           sinks, out_dtype, slopes)
    if cu_seqlens_q is not None:
        clear_packed_tails((out, cu_seqlens_q, 0, 0.0), (lse, cu_seqlens_q, 1, float("-inf")))
    return out, lse


def _launch_fwd(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                launch: AttentionLaunch, stats: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
                out_dtype: Optional[torch.dtype] = None, slopes: Optional[torch.Tensor] = None):
    q, k, v = pointer_ready(q), pointer_ready(k), pointer_ready(v)
    lay = row_layout(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    if out_dtype not in (None, q.dtype) and (out_dtype != torch.float32 or launch.variant != "ptr"):
        raise ValueError(f"out_dtype must be None or float32 on the ptr variant, got {out_dtype} ({launch.variant})")
    out = new_output(out_shape(q, v), out_dtype or q.dtype, q.device)
    lse = new_output(lse_shape(q, lay.varlen), torch.float32, q.device)
    if lay.batch * lay.q_heads == 0 or lay.q_len == 0 or q.numel() == 0 or out.numel() == 0:
        return out, lse
    if (sinks is not None or slopes is not None) and (launch.variant != "ptr" or lay.varlen):
        raise ValueError("sinks and ALiBi slopes run on the ptr forward of dense calls only")
    if lay.k_len == 0 or k.numel() == 0:  # no key: rows give 0, as SDPA's math; the lse is -inf (with sinks: z)
        if sinks is not None:
            lse.copy_(sinks.float()[None, :, None].expand_as(lse))
            if stats is not None and stats.numel():
                stats[0].copy_(lse * LOG2E)
                stats[1].zero_()
            return out.zero_(), lse
        if stats is not None and stats.numel():
            stats[0].fill_(float("-inf"))
            stats[1].zero_()
        return out.zero_(), lse.fill_(float("-inf"))
    mask, mask_strides, mask_kind = mask_args(attn_mask, lay, q)
    split = stats is not None and stats.numel() > 0
    check_variant(launch, lay, q, k, v, mask_kind)
    if launch.variant == "ws":
        _launch_fwd_ws(q, k, v, out, lse, lay, launch)
        return out, lse
    from ...kernels.attention_fwd import attention_fwd_kernel

    # Q/K tiles are bd wide, V/Out tiles bdv: no padding spent on the smaller head dim. Equal
    # head dims give equal widths, so D == Dv compiles to the kernel it always was.
    bd, bdv = block_d(lay.head_dim), block_d(lay.value_dim)
    cu_q, cu_k = lay.offsets(cu_seqlens_q, cu_seqlens_k, q)
    use_tma = launch.variant == "tma"
    head_major = launch.grid_order == "head_major"
    descriptor = tensor_descriptor() if use_tma else None

    def run(cfg: KernelConfig):
        blocks = cdiv(lay.q_len, cfg.block_m)
        grid = (lay.batch * lay.q_heads, blocks) if head_major else (blocks, lay.batch * lay.q_heads)
        extra = dict(Stats=stats, stride_ls=stats.stride(0), STORE_STATS=True) if split else {}
        if sinks is not None:
            extra.update(Sinks=sinks, HAS_SINKS=True)
        if slopes is not None:
            extra.update(alibi_args(slopes))
        if use_tma:
            extra.update(KDesc=descriptor(k, list(k.shape), list(k.stride()), [1, 1, cfg.block_n, bd]),
                         VDesc=descriptor(v, list(v.shape), list(v.stride()), [1, 1, cfg.block_n, bdv]),
                         USE_TMA=True)
        bound(attention_fwd_kernel)[grid](
            q, k, v, out, lse, mask, cu_q, cu_k,
            *lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(out),
            *lse_strides(lse, lay), *mask_strides,
            lay.q_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
            launch.scale * LOG2E, launch.left, launch.right,
            HEAD_DIM=lay.head_dim, BLOCK_D=bd, HEAD_DIM_V=lay.value_dim, BLOCK_DV=bdv,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            IS_VARLEN=lay.varlen, BOTTOM_RIGHT=launch.bottom_right, HAS_LEFT=launch.has_left,
            HAS_RIGHT=launch.has_right, MASK_KIND=mask_kind, DOT_PRECISION=dot_precision(q.dtype),
            SCALE_POSITIVE=launch.scale > 0, HEAD_MAJOR=head_major, EXP_FMA=launch.exp_fma,
            SOFTCAP=launch.softcap * LOG2E, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
        )

    mask_elem = mask.element_size() if mask_kind else 0
    key = shape_key(q, lay, launch, mask_kind, mask_elem)
    if use_tma or head_major:
        key = key + (launch.variant, launch.grid_order)
    if launch.exp_fma:
        key = key + (f"exp_fma{launch.exp_fma}",)

    def general() -> list:
        return fitting_configs("fwd", bd, q.dtype, q.device, mask_elem, bdv,
                               padded=lay.head_dim != bd or lay.value_dim != bdv)

    if gluon_varlen_fwd_ok(q, k, v, out, lay, launch, mask_kind):
        # Packed sequences on Hopper: the Gluon forward, timed beside this kernel's configs.
        def run_any(cfg: KernelConfig):
            if cfg.impl == "gluon":
                _launch_fwd_gluon(q, k, v, out, lse, lay, launch, cfg, cu_q, cu_k)
            else:
                run(cfg)

        def pick(gluon: bool) -> KernelConfig:
            if not gluon:
                return CONFIGS.pick("fwd", key, general, run, lambda: out)
            return CONFIGS.pick("fwd", key + ("gluon",),
                                lambda: fitting_configs("fwd_gluon", lay.head_dim, q.dtype, q.device) + general(),
                                run_any, lambda: out)

        run_gluon_first(pick, run_any, True)
        return out, lse
    run(CONFIGS.pick("fwd", key, general, run, lambda: out))
    return out, lse


def _launch_fwd_ws(q, k, v, out, lse, lay: RowLayout, launch: AttentionLaunch) -> None:
    """The triton.ws runner's forward: the warp-specialised Triton kernel, and on Hopper the Gluon
    kernel too (kernels/attention_fwd_gluon.py; its configs come first, and the tuner times both
    kernels per shape class). A Gluon launch that fails (a triton whose Gluon differs) warns once,
    and the Triton kernel runs from then on."""
    from ...kernels.attention_fwd_ws import attention_fwd_ws_kernel

    descriptor = tensor_descriptor()

    def run_triton(cfg: KernelConfig):
        ensure_triton_allocator()
        box = [1, 1, cfg.block_n, lay.head_dim]
        bound(attention_fwd_ws_kernel)[(cdiv(lay.q_len, cfg.block_m), lay.batch * lay.q_heads)](
            q, descriptor(k, list(k.shape), list(k.stride()), box),
            descriptor(v, list(v.shape), list(v.stride()), box), out, lse, *lay.strides(q), *lay.strides(out),
            *lse_strides(lse, lay), lay.q_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
            launch.scale * LOG2E, launch.left, HEAD_DIM=lay.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            CAUSAL=launch.has_right, BOTTOM_RIGHT=launch.bottom_right, K_TAIL=lay.k_len % cfg.block_n != 0,
            DOT_PRECISION=dot_precision(q.dtype), WARP_SPEC=not interpreting(), HAS_LEFT=launch.has_left,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def run(cfg: KernelConfig):
        if cfg.impl == "gluon":
            _launch_fwd_gluon(q, k, v, out, lse, lay, launch, cfg)
        else:
            run_triton(cfg)

    def pick(gluon: bool) -> KernelConfig:
        """The tuned config among the Triton kernel's, and the Gluon kernel's first where it runs."""
        def candidates() -> list:
            triton_configs = fitting_configs("fwd_ws", lay.head_dim, q.dtype, q.device)
            return (fitting_configs("fwd_gluon", lay.head_dim, q.dtype, q.device) if gluon else []) + triton_configs

        cfg = CONFIGS.pick("fwd_ws", shape_key(q, lay, launch, MASK_NONE) + (gluon,), candidates, run, lambda: out)
        if cfg.impl == "gluon" and not gluon:  # a forced Gluon config after a failure: the Triton kernel's first
            cfg = fitting_configs("fwd_ws", lay.head_dim, q.dtype, q.device)[0]
        return cfg

    run_gluon_first(pick, run, gluon_fwd_here(q))


def _launch_fwd_gluon(q, k, v, out, lse, lay: RowLayout, launch: AttentionLaunch, cfg: KernelConfig,
                      cu_q=None, cu_k=None) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ...kernels.attention_fwd_gluon import attention_fwd_gluon_kernel

    d, half = lay.head_dim, cfg.block_m // 2

    def desc(t, rows):
        t = heads_rows(t, lay)
        box = (1, 1, rows, d)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), shared_layout(box, t.dtype))

    packed = {}
    if lay.varlen:  # sequences from cu_q / cu_k; outputs at a sequence's end stored by row
        packed = dict(VARLEN=True, CuQ=cu_q, CuK=cu_k, O=out, stride_om=out.stride(0), stride_oh=out.stride(1))
    bound(attention_fwd_gluon_kernel)[(cdiv(lay.q_len, cfg.block_m), lay.batch * lay.q_heads)](
        desc(q, half), desc(k, cfg.block_n), desc(v, cfg.block_n), desc(out, half), lse, *lse_strides(lse, lay),
        lay.q_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len, launch.scale * LOG2E, launch.left,
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages, CAUSAL=launch.has_right,
        BOTTOM_RIGHT=launch.bottom_right, HAS_LEFT=launch.has_left, num_warps=cfg.num_warps, **packed,
    )
