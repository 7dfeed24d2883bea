"""Where a launch's rows and outputs live: the RowLayout of a dense or packed call (row_layout;
the class itself is common.RowLayout, which the quantized glue builds as well), the shapes and
strides of the outputs and log-sum-exps (out_shape, lse_shape, lse_strides), the split row
statistics a forward saves for its backward (stats_shape), the backward's gradient buffers
(bwd_outputs), the 4-D view a Gluon kernel's descriptors take (heads_rows), and the rows of packed
tensors that no sequence owns (clear_packed_tails)."""

from __future__ import annotations

import torch

from .bound import bound
from .common import RowLayout, cdiv, new_output


def row_layout(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k) -> RowLayout:
    if cu_seqlens_q is not None:
        return RowLayout(cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1], max_seqlen_q, max_seqlen_k,
                         q.shape[-1], True, v.shape[-1])
    return RowLayout(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[-1], False, v.shape[-1])


def lse_shape(q: torch.Tensor, varlen: bool) -> tuple:
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[1], q.shape[2])


def out_shape(q: torch.Tensor, v: torch.Tensor) -> tuple:
    return tuple(q.shape[:-1]) + (v.shape[-1],)


def lse_strides(lse: torch.Tensor, lay: RowLayout) -> tuple:
    if lay.varlen:
        return (0, lse.stride(0), lse.stride(1))
    return (lse.stride(0), lse.stride(1), lse.stride(2))


def stats_shape(q: torch.Tensor, attn_mask, varlen: bool) -> tuple:
    """The shape of the split row statistics a forward saves for its backward: (2, *lse shape)
    under an additive mask or for float32 inputs (planes: row max m in the log2 domain, log2 of the
    row sum; see kernels/attention_bwd.py), (0,) otherwise."""
    if (attn_mask is not None and attn_mask.dtype != torch.bool) or q.dtype == torch.float32:
        return (2,) + lse_shape(q, varlen)
    return (0,)


def bwd_outputs(q, k, v, lay: RowLayout) -> tuple:
    """((dq, dk, dv) shaped like q, k, v, whether the backward has no work); without work the
    gradients are zeros already."""
    grads = tuple(new_output(t.shape, t.dtype, t.device) for t in (q, k, v))
    empty = lay.batch * lay.q_heads == 0 or q.numel() == 0 or k.numel() == 0 or lay.q_len == 0 or lay.k_len == 0
    if empty:
        for g in grads:
            g.zero_()
    return grads, empty


def heads_rows(t: torch.Tensor, lay: RowLayout) -> torch.Tensor:
    """The 4-D (B, H, rows, D) tensor a Gluon kernel's descriptors take: t itself, or for packed
    (T, H, D) tensors the (1, H, T, D) view (its last two box dims are (rows, D), as dense tiles,
    so the shared-memory swizzle is the one the kernels' tiles assume)."""
    return t.permute(1, 0, 2).unsqueeze(0) if lay.varlen else t


def clear_packed_tails(*parts: tuple) -> None:
    """Give the rows of packed tensors past their last sequence the value each asks for, in one
    launch, on the device (no host read). parts: up to three (t, cu, rows_dim, fill): t a
    contiguous (T, ...) with rows_dim 0, or a contiguous lse (H, T) with rows_dim 1, as the
    launches allocate them; rows cu[-1] .. T get `fill`. The attention
    kernels visit each sequence's rows only; a packed tensor longer than cu[-1] has rows no
    sequence owns, which are 0 (outputs, gradients) or -inf (log-sum-exps), as for a query that
    sees no key."""
    from ...kernels.attention_fwd import packed_tail_kernel

    views = []
    for t, cu, rows_dim, fill in parts:
        total = t.shape[rows_dim]
        if total == 0 or t.numel() == 0:
            continue
        assert t.is_contiguous(), "packed outputs and gradients are allocated contiguous"
        views.append((t.movedim(rows_dim, 0).flatten(1), cu, float(fill)))  # (T, rest): a view of t
    if not views:
        return
    n = len(views)
    views += [views[0]] * (3 - n)
    (x0, c0, f0), (x1, c1, f1), (x2, c2, f2) = views
    longest = max(v[0].shape[0] for v in views)
    bound(packed_tail_kernel)[(cdiv(longest, 64), n)](
        x0, x1, x2, c0, c1, c2, c0.shape[0] - 1, x0.shape[0], x1.shape[0], x2.shape[0],
        x0.shape[1], x1.shape[1], x2.shape[1], *x0.stride(), *x1.stride(), *x2.stride(), f0, f1, f2,
        BLOCK_R=64, BLOCK_C=128, num_warps=4)
