"""Attention of a few query rows per sequence against a KV cache (decode, speculative decoding,
chunked prefill against the cache), bottom-right causal: query row i of T sees keys up to
length - T + i.

Two runners:
    "sdpa"    the sequences' pages gathered into (S, Hkv, L, D) tensors (quantized pages
              dequantized) and torch's SDPA with a length mask: every cache, dtype and device.
    "triton"  the split-KV kernel (kernels/decode.py): a GQA group's query rows in one tile, the
              keys of each sequence split across programs by occupancy, pages read through the
              block table (FP8/INT8 dequantized in registers), splits merged by log-sum-exp.
              Page sizes 16-256 (powers of two), head dims up to 256; CUDA or the interpreter.
Both read the longest length on the host (to size the gather or the splits). The default is
"sdpa" until the kernel is measured on a GPU (benchmarks/NOTES.md).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .cache import PagedKVCache


RUNNERS = ("sdpa", "triton")


def decode_attention(query: torch.Tensor, cache: PagedKVCache, layer: int, seqs: Optional[Sequence[int]] = None,
                     scale: Optional[float] = None, runner: str = "sdpa", splits: Optional[int] = None
                     ) -> torch.Tensor:
    """query (S, Hq, T, D) of the S sequences `seqs` (default: every sequence of a KVCache's
    batch) against what `layer` of the cache holds for them, the last T cached tokens of each
    being the queries' own (bottom-right causal). Returns (S, Hq, T, Dv) in the query's dtype.

    runner: "sdpa" or "triton" (see the module docstring); splits: the triton runner's key
    splits per sequence (default: from the batch, heads and lengths against the GPU's SMs)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
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
    if runner == "triton":
        return _split_kv(query, cache, layer, seqs, longest, scale, splits)
    k, v = cache.gather(layer, seqs, longest, dtype=query.dtype)
    n = torch.tensor(lengths, device=query.device)
    keys = torch.arange(longest, device=query.device)
    rows = torch.arange(t, device=query.device)
    visible = keys[None, None, :] <= (n[:, None, None] - t + rows[None, :, None])  # (S, T, L)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=visible[:, None], scale=scale,
                                         enable_gqa=hq != cache.kv_heads)
    return out


def _split_kv(query, cache, layer, seqs, longest, scale, splits):
    from triton import next_power_of_2

    from ..kernels.decode import decode_merge_kernel, decode_split_kernel

    s, hq, t, d = query.shape
    hkv, dv, page = cache.kv_heads, cache.value_dim, cache.page_size
    if query.dtype != cache.dtype:
        raise TypeError(f"query dtype {query.dtype} must be the cache's dtype {cache.dtype} for runner='triton'")
    if page < 16 or page > 256 or page & (page - 1):
        raise ValueError(f"runner='triton' needs a page_size that is a power of two in [16, 256], got {page}")
    if max(d, dv) > 256:
        raise ValueError(f"runner='triton' takes head dims up to 256, got {max(d, dv)}")
    g = hq // hkv
    pages = -(-longest // page)
    if splits is None:
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 4
        splits = -(-2 * sms // (s * hkv))  # about two programs per SM
    splits = max(1, min(int(splits), pages))
    per_split = -(-pages // splits)
    splits = -(-pages // per_split)
    dev = query.device
    seq_t = torch.tensor(seqs, dtype=torch.int32, device=dev)
    o_part = torch.empty(s, hq, t, splits, dv, dtype=torch.float32, device=dev)
    l_part = torch.empty(s, hq, t, splits, dtype=torch.float32, device=dev)
    k_pool, v_pool = cache.k[layer], cache.v[layer]
    quantized = cache.storage != "native"
    ks = cache.k_scale[layer] if quantized else l_part  # a placeholder pointer when not read
    vs = cache.v_scale[layer] if quantized else l_part
    scale = d ** -0.5 if scale is None else float(scale)
    block_m = max(16, next_power_of_2(g * t))
    from ..backends.triton_launch import dot_precision

    decode_split_kernel[(splits, s * hkv)](
        query, k_pool, v_pool, ks, vs, cache.block_table, cache.lengths[layer], seq_t, o_part, l_part, scale,
        *query.stride(), *k_pool.stride(), *v_pool.stride(),
        *(ks.stride() if quantized else (0, 0)), *cache.block_table.stride(),
        *o_part.stride(), *l_part.stride(),
        hkv, splits, per_split,
        G=g, T=t, D=d, DV=dv, BLOCK_M=block_m, BLOCK_D=max(16, next_power_of_2(d)),
        BLOCK_DV=max(16, next_power_of_2(dv)), PAGE=page, QUANTIZED=quantized,
        DOT_PRECISION=dot_precision(query.dtype),
    )
    out = torch.empty(s, hq, t, dv, dtype=query.dtype, device=dev)
    decode_merge_kernel[(s * hq * t,)](
        o_part, l_part, out, *o_part.stride(), *l_part.stride(), *out.stride(), hq, t, splits,
        DV=dv, BLOCK_DV=max(16, next_power_of_2(dv)), BLOCK_S=max(2, next_power_of_2(splits)),
        DOT_PRECISION=dot_precision(query.dtype),
    )
    return out
