"""Merging partial attention results (out, lse) by log-sum-exp with one Triton launch
(kernels/lse_merge.py): the step that combines blocks of keys computed apart (ring attention's
visiting shards)."""

from __future__ import annotations

import torch

from .bound import bound
from .common import cdiv, next_pow2

MERGE_ROWS = 32  # rows per program: 32 x 128 float32 accumulator values and as many of the block


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """out (B, H, n, Dv) float32 and lse (B, H, n) float32 become the exact merge of themselves
    and (block_out, block_lse) (same shapes; block_out any float dtype, block_lse float32), in
    place. Unit strides along Dv and along n of the lse's (views of contiguous tensors along n
    qualify)."""
    from ...kernels.lse_merge import lse_merge_kernel

    b, h, n, dv = out.shape
    if out.numel() == 0:
        return
    for t, name in ((out, "out"), (block_out, "block_out")):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit stride along its last dim, got strides {t.stride()}")
    for t, name in ((lse, "lse"), (block_lse, "block_lse")):
        if t.dtype != torch.float32 or (n > 1 and t.stride(-1) != 1):
            raise ValueError(f"{name} must be float32 with a unit row stride, got {t.dtype} strides {t.stride()}")
    if out.dtype != torch.float32:
        raise ValueError(f"out must be float32, got {out.dtype}")
    bound(lse_merge_kernel)[(cdiv(n, MERGE_ROWS), b * h)](
        out, lse, block_out, block_lse,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        block_out.stride(0), block_out.stride(1), block_out.stride(2), block_lse.stride(0), block_lse.stride(1),
        h, n, HEAD_DIM_V=dv, BLOCK_DV=max(16, next_pow2(dv)), BLOCK_M=MERGE_ROWS, num_warps=4,
    )
