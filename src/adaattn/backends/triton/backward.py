"""The backward launchers of our exact Triton kernels: launch_bwd (delta, dk/dv and dq kernels of
kernels/attention_bwd.py, dq added atomically or in its own pass), and where the settings and the
call allow it (launch.bwd_ws_here, launch.bwd_ws_ok) the warp-specialised backward
(kernels/attention_bwd_ws.py, launch_bwd_ws), on Hopper timed beside the Gluon backward
(kernels/attention_bwd_gluon.py). Also the scales of ds (ds_scales) and when delta is recomputed
exactly (exact_delta_keys)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .bound import bound
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
    gluon_bwd_here,
    interpreting,
    mask_args,
    new_output,
    pointer_ready,
    run_gluon_first,
    shared_layout,
    tensor_descriptor,
)
from .configs import BWD_WS_PAIR, DELTA_CONFIG, INTERPRET_CONFIGS, exact_delta_config, fitting_configs
from .launch import AttentionLaunch, bwd_ws_here, bwd_ws_ok, shape_key
from .layout import bwd_outputs, clear_packed_tails, heads_rows, lse_strides, row_layout
from .tuner import CONFIGS


DS_SCALE_FLOOR = 2.0 ** -6
# A backward whose out and lse come from these very keys (exact_delta) recomputes delta = rowsum(P * dP)
# in fp32 for query tiles whose rows see at most this many keys; the others take rowsum(dO * O) from
# the saved output, as FA2 and cuDNN do (kernels/attention_bwd.py, "delta", says why and what it costs).
EXACT_DELTA_KEYS = 64


# Under ds_split (calls torch answers with its math kernel) every query tile takes the exact delta:
# math's delta is exact, and rowsum(dO * O) from a rounded O missed it on peaked rows at any length
# (bfloat16, Dv 16, 674 keys, logits x30: dk 3.7x math's, ds in two roundings or not; CUDA fuzzer seed
# 5300 #16237, reproduced under the interpreter; with the exact delta, math's 1.644e-3).
ALL_KEYS = 1 << 30


def exact_delta_keys(lay: RowLayout, launch: AttentionLaunch) -> int:
    """The delta kernels' EXACT_KEYS: EXACT_DELTA_KEYS where at least 1/8 of the query rows see at
    most that many keys, else 0 (the exact pass not compiled in: its shared memory slows the delta
    pass of every tile; compiled in, it cost a causal 4k backward 2% on an H200 for the first rows).
    Packed calls are judged by their longest sequences. Under ds_split, ALL_KEYS: an extra pass over
    the keys (two products a tile), only in calls torch answers with math."""
    if launch.ds_split and lay.q_len > 0:
        return ALL_KEYS
    most = EXACT_DELTA_KEYS
    nq, nk = lay.q_len, lay.k_len
    if most <= 0 or nq <= 0:
        return 0
    if nk <= most or (launch.has_left and launch.has_right and launch.left + launch.right + 1 <= most):
        return most
    diag = nk - nq if launch.bottom_right else 0
    short = 0  # rows that see at most `most` keys: the first under a right bound, the last under a left one
    if launch.has_right:
        short += min(max(most - diag - launch.right, 0), nq)
    if launch.has_left:
        short += min(max(nq - max(nk - most + launch.left - diag, 0), 0), nq)
    return most if 8 * short >= nq else 0


def ds_scales(scale: float) -> tuple[float, float]:
    """(ds scale, post scale) of a backward launch: ds goes to the products times the softmax
    scale, kept at DS_SCALE_FLOOR or more in magnitude (half precision's range: a near-overflow ds
    needs the scale, a tiny scale made it subnormal), and dq/dk are multiplied by the rest in fp32
    (kernels/attention_bwd.py, dkdv_tile)."""
    ds = math.copysign(max(abs(scale), DS_SCALE_FLOOR), scale) if scale else DS_SCALE_FLOOR
    return ds, scale / ds


def _clear_packed_grads(grads: tuple, cu_seqlens_q, cu_seqlens_k) -> tuple:
    """Packed gradients: rows past the last sequence (of q for dq, of k/v for dk/dv) are 0."""
    if cu_seqlens_q is not None:
        dq, dk, dv = grads
        clear_packed_tails((dq, cu_seqlens_q, 0, 0.0), (dk, cu_seqlens_k, 0, 0.0), (dv, cu_seqlens_k, 0, 0.0))
    return grads


def launch_bwd(dout, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               launch: AttentionLaunch, stats: Optional[torch.Tensor] = None, exact_delta: bool = False,
               slopes: Optional[torch.Tensor] = None, sinks: bool = False):
    """Run delta, dk/dv and dq kernels; returns (dq, dk, dv) shaped like q, k, v.
    launch.dq_mode "separate" is the one whose bits do not depend on timing. stats: what
    launch_fwd filled under an additive mask (recomputed probabilities then keep full precision
    under large biases); without it the backward reads lse alone. Packed rows past the last
    sequence get 0. exact_delta: out and lse are these keys' own forward (not a ring step's global
    ones), so delta may be recomputed from q, k, v where a query tile sees few keys (EXACT_DELTA_KEYS).
    slopes: the forward's ALiBi slopes (launch_fwd), float32; no gradient reaches them. sinks: the
    forward folded sinks into its rows (a recomputed delta is then not divided by the keys' row sum)."""
    return _clear_packed_grads(_launch_bwd(dout, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_q, max_seqlen_k, launch, stats, exact_delta, slopes, sinks),
                               cu_seqlens_q, cu_seqlens_k)


def _launch_bwd(dout, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                launch: AttentionLaunch, stats: Optional[torch.Tensor] = None, exact_delta: bool = False,
                slopes: Optional[torch.Tensor] = None, sinks: bool = False):
    from ...kernels.attention_bwd import (
        attention_bwd_delta_kernel,
        attention_bwd_dkdv_kernel,
        attention_bwd_dq_kernel,
    )

    mode = launch.dq_mode
    atomic = mode != "separate"
    q, k, v = pointer_ready(q), pointer_ready(k), pointer_ready(v)
    dout, out = pointer_ready(dout), pointer_ready(out)
    if mode != "atomic_rotate" and out.dtype == q.dtype and slopes is None and bwd_ws_here(q) and bwd_ws_ok(
            dout, q, k, v, attn_mask, cu_seqlens_q is not None, launch):
        return _launch_bwd_ws(dout, q, k, v, out, lse, launch, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, exact_delta=exact_delta,
                              sinks=sinks)
    lay = row_layout(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    (dq, dk, dv), empty = bwd_outputs(q, k, v, lay)
    if empty:
        return dq, dk, dv
    mask, mask_strides, mask_kind = mask_args(attn_mask, lay, q)
    alibi = alibi_args(slopes) if slopes is not None else {}
    bd, bdv = block_d(lay.head_dim), block_d(lay.value_dim)  # Q/K/dQ/dK tiles; V/O/dO/dV tiles
    cu_q, cu_k = lay.offsets(cu_seqlens_q, cu_seqlens_k, q)
    flags = dict(IS_VARLEN=lay.varlen, BOTTOM_RIGHT=launch.bottom_right, HAS_LEFT=launch.has_left,
                 HAS_RIGHT=launch.has_right, MASK_KIND=mask_kind, DOT_PRECISION=dot_precision(q.dtype),
                 SOFTCAP=launch.softcap * LOG2E, DS_SPLIT=launch.ds_split, **alibi)
    lse_st = lse_strides(lse, lay)
    dcfg = INTERPRET_CONFIGS["delta"] if interpreting() else DELTA_CONFIG
    split = {}
    if stats is not None and stats.numel() > 0:
        if stats[0].stride() != lse.stride():
            raise ValueError(f"stats planes must be laid out as lse, got strides {stats[0].stride()} and "
                             f"{lse.stride()}")
        # One int32 flag per (batch, head), raised by the delta kernel where a row needs the split form.
        # float32: every head, from the start. An fp32 lse keeps log2(sum) to 2^-17 of |m|-sized
        # rows, which is 5e-6 of p, far above float32's rounding: its gradients were 5-18x torch's
        # math error at logits x30-100 (the interpreter fuzz, --policy triton).
        marks = (torch.ones if q.dtype == torch.float32 else torch.zeros)(
            lay.batch * lay.q_heads, dtype=torch.int32, device=q.device)
        split = dict(Stats=stats, Flags=marks, SPLIT_STATS=True)
        flags.update(split, stride_ls=stats.stride(0))
    left, right = launch.left, launch.right
    scale, post_scale = ds_scales(launch.scale)

    delta = torch.empty_like(lse)
    # Atomic dq: an fp32 accumulator the delta kernel zeroes (dq itself when it is fp32).
    # Poisoned like an output, so rows the zeroing missed show up as NaN.
    if atomic:
        dq_acc = dq if dq.dtype == torch.float32 else new_output(q.shape, torch.float32, q.device)
        dq_acc_strides = lay.strides(dq_acc)
    else:
        dq_acc, dq_acc_strides = dq, (0, 0, 0)
    exact = {}
    if exact_delta and exact_delta_keys(lay, launch):  # delta = rowsum(P * dP) where a query tile sees few keys
        if not interpreting():
            dcfg = exact_delta_config(bd, q.dtype, q.device, mask.element_size() if mask_kind else 0, bdv)
        exact = dict(Q=q, K=k, V=v, LSE=lse, Mask=mask, CuSeqlensK=cu_k, **dict(zip(
            ("stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh",
             "stride_vn", "stride_mb", "stride_mh", "stride_mm", "stride_mn"),
            lay.strides(q) + lay.strides(k) + lay.strides(v) + tuple(mask_strides))),
            kv_group=lay.q_heads // lay.kv_heads, k_len_dense=lay.k_len, scale_log2=launch.scale * LOG2E,
            window_left=left, window_right=right, BLOCK_N=dcfg.block_n, BOTTOM_RIGHT=launch.bottom_right,
            HAS_LEFT=launch.has_left, HAS_RIGHT=launch.has_right, MASK_KIND=mask_kind,
            DOT_PRECISION=flags["DOT_PRECISION"], EXACT_KEYS=exact_delta_keys(lay, launch),
            SOFTCAP=launch.softcap * LOG2E, ROW_NORM=not sinks, **alibi)
        if split:
            exact["stride_ls"] = stats.stride(0)
    bound(attention_bwd_delta_kernel)[(cdiv(lay.q_len, dcfg.block_m), lay.batch * lay.q_heads)](
        out, dout, delta, dq_acc, cu_q, *lay.strides(out), *lay.strides(dout), *lse_st,
        *dq_acc_strides, lay.q_heads, lay.q_len,
        HEAD_DIM=lay.head_dim, BLOCK_D=bd, HEAD_DIM_V=lay.value_dim, BLOCK_DV=bdv,
        BLOCK_M=dcfg.block_m, IS_VARLEN=lay.varlen,
        ZERO_DQ=atomic, num_warps=dcfg.num_warps, num_stages=dcfg.num_stages, **split, **exact,
    )

    dq_acc_dirty = [False]

    def run_dkdv(cfg: KernelConfig):
        grid = (cdiv(lay.k_len, cfg.block_n), lay.batch * lay.kv_heads)
        if atomic and dq_acc_dirty[0]:
            dq_acc.zero_()  # config timing runs the kernel many times; each run adds into dq_acc
        dq_acc_dirty[0] = atomic
        bound(attention_bwd_dkdv_kernel)[grid](
            q, k, v, dout, lse, delta, dk, dv, dq_acc, mask, cu_q, cu_k,
            *lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(dout), *lse_st,
            *lay.strides(dk), *lay.strides(dv), *dq_acc_strides, *mask_strides,
            lay.kv_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
            scale, launch.scale * LOG2E, left, right,
            HEAD_DIM=lay.head_dim, BLOCK_D=bd, HEAD_DIM_V=lay.value_dim, BLOCK_DV=bdv,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ATOMIC_DQ=atomic, ROTATE=mode == "atomic_rotate",
            post_scale=post_scale, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
        )

    def run_dq(cfg: KernelConfig):
        grid = (cdiv(lay.q_len, cfg.block_m), lay.batch * lay.q_heads)
        bound(attention_bwd_dq_kernel)[grid](
            q, k, v, dout, lse, delta, dq, mask, cu_q, cu_k,
            *lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(dout), *lse_st,
            *lay.strides(dq), *mask_strides,
            lay.q_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
            scale, launch.scale * LOG2E, left, right,
            HEAD_DIM=lay.head_dim, BLOCK_D=bd, HEAD_DIM_V=lay.value_dim, BLOCK_DV=bdv,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, post_scale=post_scale, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **flags,
        )

    mask_elem = mask.element_size() if mask_kind else 0
    key = shape_key(q, lay, launch, mask_kind, mask_elem)
    kernels = ((("dkdv_atomic" if atomic else "dkdv"), run_dkdv),) + (() if atomic else (("dq", run_dq),))
    for kind, run in kernels:
        candidates = (lambda kind=kind: fitting_configs(kind, bd, q.dtype, q.device, mask_elem, bdv))
        run(CONFIGS.pick(kind, key + ((mode,) if atomic else ()), candidates, run))
    if atomic:  # the kernels add ds k products with ds at the ds scale (attention_bwd.dkdv_tile)
        if dq_acc is dq:
            dq.mul_(post_scale)
        else:
            dq.copy_(dq_acc.mul_(post_scale))
    return dq, dk, dv


def launch_bwd_ws(dout, q, k, v, out, lse, launch: AttentionLaunch, configs: Optional[tuple] = None,
                  warp_spec: bool = True, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                  exact_delta: bool = False):
    """The warp-specialised backward: prep, dk/dv and dq kernels, no atomics (bitwise reproducible).
    Returns (dq, dk, dv). configs: (dkdv, dq) KernelConfigs to run instead of the tuned ones;
    warp_spec: False runs the same loops unspecialised (as the interpreter always does). Packed
    (T, H, D) tensors come with cu_seqlens_q/k and max_seqlen_q/k, and exact_delta, as in launch_bwd."""
    return _clear_packed_grads(_launch_bwd_ws(dout, q, k, v, out, lse, launch, configs, warp_spec, cu_seqlens_q,
                                              cu_seqlens_k, max_seqlen_q, max_seqlen_k, exact_delta),
                               cu_seqlens_q, cu_seqlens_k)


def _launch_bwd_ws(dout, q, k, v, out, lse, launch: AttentionLaunch, configs: Optional[tuple] = None,
                   warp_spec: bool = True, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                   exact_delta: bool = False, sinks: bool = False):
    from ...kernels.attention_bwd_ws import attention_bwd_dkdv_ws_kernel, attention_bwd_dq_ws_kernel

    q, k, v = pointer_ready(q), pointer_ready(k), pointer_ready(v)
    dout, out = pointer_ready(dout), pointer_ready(out)
    lay = row_layout(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    (dq, dk, dv), empty = bwd_outputs(q, k, v, lay)
    if empty:
        return dq, dk, dv
    d = lay.head_dim
    varlen = lay.varlen
    cu_q, cu_k = lay.offsets(cu_seqlens_q, cu_seqlens_k, q)
    stat, pitch, plane = _bwd_stat_planes(out, dout, lse, lay, cu_q,
                                          (q, k, v, cu_k, launch) if exact_delta else None, sinks)
    descriptor = tensor_descriptor()
    ensure_triton_allocator()
    group = lay.q_heads // lay.kv_heads
    causal = launch.has_right
    common = dict(HEAD_DIM=d, CAUSAL=causal, BOTTOM_RIGHT=launch.bottom_right, HAS_LEFT=launch.has_left,
                  IS_VARLEN=varlen, DOT_PRECISION=dot_precision(q.dtype), WARP_SPEC=warp_spec and not interpreting(),
                  DS_SPLIT=launch.ds_split)
    scale, post_scale = ds_scales(launch.scale)

    def heads(t, box_rows):
        # Packed tensors go as they are: the kernels make one descriptor per sequence.
        return t if varlen else descriptor(t, list(t.shape), list(t.stride()), [1, 1, box_rows, d])

    def run_dkdv(cfg: KernelConfig):
        bound(attention_bwd_dkdv_ws_kernel)[(cdiv(lay.k_len, cfg.block_n), lay.batch * lay.kv_heads)](
            heads(q, cfg.block_m), heads(dout, cfg.block_m),
            descriptor(stat, [2 * plane], [1], [cfg.block_m]), k, v, dk, dv, cu_q, cu_k,
            *lay.strides(q)[1:], *lay.strides(dout)[1:],
            *lay.strides(k), *lay.strides(v), *lay.strides(dk), *lay.strides(dv),
            lay.kv_heads, group, lay.q_len, lay.k_len, pitch, plane, scale, launch.scale * LOG2E, launch.left,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, post_scale=post_scale, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **common,
        )

    def run_dq(cfg: KernelConfig):
        bound(attention_bwd_dq_ws_kernel)[(cdiv(lay.q_len, cfg.block_m), lay.batch * lay.q_heads)](
            q, dout, heads(k, cfg.block_n), heads(v, cfg.block_n), stat, dq, cu_q, cu_k,
            *lay.strides(q), *lay.strides(dout), *lay.strides(dq), *lay.strides(k)[1:], *lay.strides(v)[1:],
            lay.q_heads, group, lay.q_len, lay.k_len, pitch, plane, scale, launch.scale * LOG2E, launch.left,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, K_TAIL=varlen or lay.k_len % cfg.block_n != 0,
            post_scale=post_scale, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )

    key = shape_key(q, lay, launch, MASK_NONE)

    def run_pair():
        for i, (kind, run, written) in enumerate((("dkdv_ws", run_dkdv, dk), ("dq_ws", run_dq, dq))):
            if configs is not None:
                run(configs[i])
            else:
                run(CONFIGS.pick(kind, key, lambda kind=kind: fitting_configs(kind, d, q.dtype, q.device), run,
                                 lambda written=written: written))

    if (configs is not None or not warp_spec or launch.dq_mode == "separate" or launch.ds_split
            or not gluon_bwd_here(q)):  # (the Gluon backward rounds ds once)
        run_pair()
        return dq, dk, dv

    # Free to add dq atomically: the Gluon backward is timed beside the pair.
    def run(cfg: KernelConfig):
        if cfg.impl == "gluon":
            _run_bwd_gluon(dq, dk, dv, dout, q, k, v, stat, pitch, plane, lay, launch, cfg, cu_q, cu_k)
        else:
            run_pair()

    def pick(gluon: bool) -> KernelConfig:
        if not gluon:
            return BWD_WS_PAIR
        return CONFIGS.pick("bwd_gluon", key,
                            lambda: fitting_configs("bwd_gluon", d, q.dtype, q.device) + [BWD_WS_PAIR], run, lambda: dq)

    run_gluon_first(pick, run, True)
    return dq, dk, dv


def _bwd_stat_planes(out, dout, lse, lay: RowLayout, cu_q, exact: Optional[tuple] = None,
                     sinks: bool = False) -> tuple:
    """The prep kernel's planes of a backward (kernels/attention_bwd_ws.py): (stat, pitch, plane),
    lse in the log2 domain at stat[bh * pitch + row] and delta at stat[plane + bh * pitch + row]. Whole
    128-row tiles (the largest BLOCK_M) per (sequence, head), the longest sequence's length each,
    so a tile's statistics never leave its plane. exact: (q, k, v, cu_k, launch) where delta may be
    recomputed from them (launch_bwd's exact_delta)."""
    from ...kernels.attention_bwd_ws import attention_bwd_ws_prep_kernel

    pitch = cdiv(lay.q_len, 128) * 128
    plane = lay.batch * lay.q_heads * pitch
    stat = torch.empty(2 * plane, dtype=torch.float32, device=out.device)
    extra = {}
    if exact is not None and exact_delta_keys(lay, exact[-1]):
        q, k, v, cu_k, launch = exact
        extra = dict(Q=q, K=k, V=v, CuK=cu_k, **dict(zip(
            ("stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh",
             "stride_vn"), lay.strides(q) + lay.strides(k) + lay.strides(v))),
            kv_group=lay.q_heads // lay.kv_heads, k_len=lay.k_len, scale_log2=launch.scale * LOG2E,
            window_left=launch.left, BLOCK_N=64, CAUSAL=launch.has_right, BOTTOM_RIGHT=launch.bottom_right,
            HAS_LEFT=launch.has_left, DOT_PRECISION=dot_precision(q.dtype), EXACT_KEYS=exact_delta_keys(lay, launch),
            ROW_NORM=not sinks)
    bound(attention_bwd_ws_prep_kernel)[(pitch // 64, lay.batch * lay.q_heads)](
        out, dout, lse, stat, cu_q, *lay.strides(out), *lay.strides(dout), *lse_strides(lse, lay),
        lay.q_heads, lay.q_len, pitch, plane, HEAD_DIM_V=lay.head_dim, BLOCK_DV=lay.head_dim, BLOCK_M=64,
        IS_VARLEN=lay.varlen, num_warps=4, **extra,
    )
    return stat, pitch, plane


def _run_bwd_gluon(dq, dk, dv, dout, q, k, v, stat, pitch, plane, lay: RowLayout, launch: AttentionLaunch,
                   cfg: KernelConfig, cu_q=None, cu_k=None) -> None:
    """kernels/attention_bwd_gluon.py into dq, dk, dv (dense or packed with cu_q / cu_k, unit last
    strides) from the prep kernel's planes: one kernel adds dq into a zeroed fp32 accumulator by
    TMA reductions, and dq is converted from it. dq's bits depend on the order of the reductions:
    never for a deterministic launch. P goes through shared memory at head dim 128 (in registers
    it spills), and dq's product runs in two column halves there (fewer live registers; 1-2%
    faster)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ...kernels.attention_bwd_gluon import attention_bwd_gluon_kernel

    d, bm, bn = lay.head_dim, cfg.block_m, cfg.block_n
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def desc(t, box):
        if len(box) == 4:
            t = heads_rows(t, lay)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), shared_layout(box, t.dtype))

    packed = {}
    if lay.varlen:  # sequences from cu_q / cu_k; dK and dV at a sequence's end stored by row
        packed = dict(VARLEN=True, CuQ=cu_q, CuK=cu_k, DK=dk, DV=dv, stride_dkn=dk.stride(0),
                      stride_dkh=dk.stride(1), stride_dvn=dv.stride(0), stride_dvh=dv.stride(1))
    scale, post_scale = ds_scales(launch.scale)
    rows, keys = (1, 1, bm, d), (1, 1, bn // 2, d)
    bound(attention_bwd_gluon_kernel)[(cdiv(lay.k_len, bn), lay.batch * lay.kv_heads)](
        desc(q, rows), desc(dout, rows), desc(k, keys), desc(v, keys), desc(dk, keys), desc(dv, keys),
        desc(dq_acc, rows), desc(stat, (bm,)), lay.kv_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
        pitch, plane, scale, launch.scale * LOG2E, launch.left, post_scale, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
        STAGES=cfg.num_stages, CAUSAL=launch.has_right, BOTTOM_RIGHT=launch.bottom_right,
        HAS_LEFT=launch.has_left, P_SMEM=d > 64, DQ_SPLIT=2 if d > 64 else 1, num_warps=cfg.num_warps, **packed,
    )
    if post_scale != 1.0:  # one pass: the fp32 product rounds once into dq's dtype
        torch.mul(dq_acc, post_scale, out=dq)
    else:
        dq.copy_(dq_acc)
