"""SDPA over a paged cache's pages, gathered: the exact decode path that reads what the split-KV
kernel reads, for decode (kv/decode.py), the sparse step's dense fallback (kv/sparse.py) and the HF
integration's paged cache."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def sdpa_gathered(query, cache, layer, seqs, lengths: torch.Tensor, longest: int, scale,
                  pages: Optional[torch.Tensor] = None):
    """SDPA of `query` (S, Hq, T, D) over the first `longest` tokens of each sequence's pages,
    gathered (quantized pages dequantized), bottom-right causal under `lengths` (S,), a device
    tensor: nothing is read on the host, so a captured call serves every length up to `longest`.
    pages: (S, Hq, ceil(longest / page size)) bool, the pages each head may read (None: all)."""
    t = query.shape[2]
    k, v = cache.gather(layer, seqs, longest, dtype=query.dtype)
    keys = torch.arange(longest, device=query.device)
    rows = torch.arange(t, device=query.device)
    visible = keys[None, None, :] <= (lengths[:, None, None] - t + rows[None, :, None])  # (S, T, L)
    mask = visible[:, None]
    if pages is not None:
        mask = mask & pages[:, :, None, keys // cache.page_size]  # (S, Hq, T, L)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=query.shape[1] != cache.kv_heads)
