"""Attention of a few query rows per sequence against a KV cache (decode, speculative decoding,
chunked prefill against the cache).

`decode_attention` runs the exact path of this version: the sequences' pages gathered into
(S, Hkv, L, D) tensors (quantized pages dequantized) and torch's SDPA with a mask of each
sequence's length, bottom-right causal for several query rows (query i of T sees keys up to
length - T + i). It is correct for every cache and batch; it is not the split-KV kernel of
DESIGN.md (not written yet), and it reads the longest sequence's length on the host.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .cache import PagedKVCache


def decode_attention(query: torch.Tensor, cache: PagedKVCache, layer: int, seqs: Optional[Sequence[int]] = None,
                     scale: Optional[float] = None) -> torch.Tensor:
    """query (S, Hq, T, D) of the S sequences `seqs` (default: every sequence of a KVCache's
    batch) against what `layer` of the cache holds for them, the last T cached tokens of each
    being the queries' own (bottom-right causal). Returns (S, Hq, T, Dv) in the query's dtype."""
    if seqs is None:
        if not hasattr(cache, "batch"):
            raise ValueError("seqs is required for a PagedKVCache (the sequence ids the query rows belong to)")
        seqs = range(cache.batch)
    seqs = [int(s) for s in seqs]
    if query.dim() != 4 or query.shape[0] != len(seqs):
        raise ValueError(f"query must be (S={len(seqs)}, Hq, T, D), got {tuple(query.shape)}")
    s, hq, t, d = query.shape
    if d != cache.head_dim:
        raise ValueError(f"query head_dim {d} must equal the cache's head_dim {cache.head_dim}")
    if hq % cache.kv_heads:
        raise ValueError(f"query heads ({hq}) must be a multiple of the cache's kv_heads ({cache.kv_heads})")
    lengths = [cache.length(x, layer) for x in seqs]
    if any(n < t for n in lengths):
        raise ValueError(f"each sequence must hold at least the query's {t} tokens in layer {layer}; lengths "
                         f"{lengths}")
    longest = max(lengths)
    k, v = cache.gather(layer, seqs, longest, dtype=query.dtype)
    n = torch.tensor(lengths, device=query.device)
    keys = torch.arange(longest, device=query.device)
    rows = torch.arange(t, device=query.device)
    visible = keys[None, None, :] <= (n[:, None, None] - t + rows[None, :, None])  # (S, T, L)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=visible[:, None], scale=scale,
                                         enable_gqa=hq != cache.kv_heads)
    return out
