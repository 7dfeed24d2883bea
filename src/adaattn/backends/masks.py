"""Turning causal and sliding-window options into an explicit mask, for backends without them."""

from __future__ import annotations

import torch


def position_keep(
    q_len: int,
    kv_len: int,
    causal: bool,
    window: tuple[int | None, int | None] | None,
    device: torch.device,
    bottom_right: bool = False,
) -> torch.Tensor | None:
    """(q_len, kv_len) bool, True where query i may attend key j, or None when all may.

    Top-left aligned as SDPA (query i sits at position i); with `bottom_right`, query i sits at
    i + kv_len - q_len, as in a KV cache.
    """
    if not causal and window is None:
        return None
    i = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len if bottom_right else 0)
    j = torch.arange(kv_len, device=device).unsqueeze(0)
    keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if causal:
        keep = keep & (j <= i)
    if window is not None:
        left, right = window
        if left is not None:
            keep = keep & (j >= i - left)
        if right is not None:
            keep = keep & (j <= i + right)
    return keep


def merge(attn_mask: torch.Tensor | None, keep: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """One mask in SDPA's convention (bool: True takes part; float: added to scores)."""
    if keep is None:
        return attn_mask
    if attn_mask is None:
        return keep
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


def fold_positions(
    attn_mask: torch.Tensor | None,
    q_len: int,
    kv_len: int,
    causal: bool,
    window: tuple[int | None, int | None] | None,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """attn_mask with causal/window folded in."""
    return merge(attn_mask, position_keep(q_len, kv_len, causal, window, device), dtype)
