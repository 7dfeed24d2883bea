"""A KV cache's append: the one-launch Triton append (kernels/kv_append.py) and the torch one, which
write the same bytes (kv/cache.py's docstring gives the layouts), and the page summaries."""

from __future__ import annotations

import torch

from .formats import PER_PAGE, QMAX, STORAGES, _decode, _encode, _int4_decode, _int4_encode, _quantize


def write_kernel(cache, layer, seqs, key, value) -> None:
    from ..backends.triton.bound import site_launch
    from ..backends.triton.common import interpreting
    from ..backends.triton.common import next_pow2 as next_power_of_2
    from ..kernels.kv_append import append_kernel

    s, hkv, t, d = key.shape
    quantized, per_page, int4 = cache.storage != "native", cache.storage in PER_PAGE, cache.storage == "int4"
    k_pool, v_pool, lengths, ids = cache.k[layer], cache.v[layer], cache.lengths[layer], cache.seq_ids(seqs)
    ks = cache.k_scale[layer] if quantized else cache._count  # placeholder pointers when not read
    vs = cache.v_scale[layer] if quantized else cache._count
    kc = cache.k_center[layer] if quantized else cache._count
    if cache.summaries:
        sums, mins, maxs = cache.k_sum[layer], cache.k_min[layer], cache.k_max[layer]
    else:
        sums = mins = maxs = cache._count
    chunks = -(-(t - 1) // cache.page_size) + 1  # pages T tokens from any slot can touch

    def build():
        return ((key, value, k_pool, v_pool, ks, vs, kc, cache.block_table, lengths, ids,
                 cache._count, sums, mins, maxs, *key.stride(), *value.stride(), *k_pool.stride(), *v_pool.stride(),
                 *(ks.stride() if per_page else (0, 0)), *(kc.stride() if quantized else (0, 0, 0)),
                 *cache.block_table.stride(), *(sums.stride()[:2] if cache.summaries else (0, 0)),
                 t, hkv, chunks, cache.max_pages_per_seq),
                dict(D=d, DV=value.shape[3], BLOCK_D=next_power_of_2(d), BLOCK_DV=next_power_of_2(value.shape[3]),
                     PAGE=cache.page_size, BLOCK_P=next_power_of_2(cache.page_size),
                     STORAGE=STORAGES.index(cache.storage), QMAX=QMAX.get(cache.storage, 1.0),
                     INTERPRET=interpreting(), SUMMARIES=cache.summaries,
                     **(dict(zip(("stride_ksp", "stride_ksn", "stride_ksh", "stride_ksg"), ks.stride()[:4]))
                        | dict(zip(("stride_vsp", "stride_vsn", "stride_vsh", "stride_vsg"), vs.stride()[:4]))
                        | dict(GK=cache.k_group, GV=cache.v_group) if int4 else {}),
                     **(dict(KW=cache.k_window[layer], VW=cache.v_window[layer], WINDOW=cache.window,
                             **dict(zip(("stride_ws", "stride_wn", "stride_wh", "stride_wd"),
                                        cache.k_window[layer].stride())),
                             **dict(zip(("stride_xs", "stride_xn", "stride_xh", "stride_xd"),
                                        cache.v_window[layer].stride()))) if cache.window else {}),
                     num_warps=4 if cache.page_size <= 64 else 8))

    # One layer's appends of one shape are the same launch but for the tensors (a decode step's
    # one token per sequence): known once per layer and layout (bound.site_launch, where bound
    # launches are on; every tensor is put in its slot each call).
    site = (layer, key.shape, key.stride(), value.shape, value.stride(), key.dtype)
    site_launch(cache._sites, site, append_kernel, (s * hkv, chunks),
                (key, value, k_pool, v_pool, ks, vs, kc, cache.block_table, lengths, ids, cache._count, sums, mins,
                 maxs) + ((cache.k_window[layer], cache.v_window[layer]) if cache.window else ()), build)

def write_torch(cache, layer, seqs, key, value) -> None:
    t = key.shape[2]
    start = torch.tensor([cache._lengths[layer][s] for s in seqs], dtype=torch.long, device=cache.device)
    sid = torch.tensor(seqs, dtype=torch.long, device=cache.device)
    pos = start[:, None] + torch.arange(t, device=cache.device)  # (S, T) token positions
    page = cache.block_table[sid[:, None], pos // cache.page_size].long()  # (S, T)
    slot = pos % cache.page_size
    k = key.transpose(1, 2)  # (S, T, Hkv, D)
    v = value.transpose(1, 2)
    if cache.storage == "native":
        cache.k[layer][page, slot] = k.to(cache.dtype)
        cache.v[layer][page, slot] = v.to(cache.dtype)
    elif cache.storage == "int4":  # written once per token: no page is rescaled
        if cache.window:  # the last `window` new tokens into the ring, as they come
            keep = pos >= start[:, None] + t - cache.window  # (S, T)
            seq_at, ring_at = sid[:, None].expand_as(pos)[keep], (pos % cache.window)[keep]
            cache.k_window[layer][seq_at, ring_at] = k[keep].to(cache.dtype)
            cache.v_window[layer][seq_at, ring_at] = v[keep].to(cache.dtype)
        k = k.float() - cache.k_center[layer][sid][:, None]
        for pool, scales, x, group in ((cache.k[layer], cache.k_scale[layer], k, cache.k_group),
                                       (cache.v[layer], cache.v_scale[layer], v, cache.v_group)):
            pool[page, slot], scales[page, slot] = _int4_encode(x, group)
    else:
        k = k.float() - cache.k_center[layer][sid][:, None]
        _per_page(cache, cache.k[layer], cache.k_scale[layer], page, slot, k)
        _per_page(cache, cache.v[layer], cache.v_scale[layer], page, slot, v)
    cache.lengths[layer, sid] += t
    if cache.summaries:
        _summarize(cache, layer, seqs, start, t)

def _summarize(cache, layer, seqs, start, t) -> None:
    """Recompute the summaries of the pages the append touched, from the keys as stored."""
    p = cache.page_size
    pages, fill = [], []
    for i, s in enumerate(seqs):
        first, end = int(start[i]), int(start[i]) + t
        for index in range(first // p, (end - 1) // p + 1):
            pages.append(cache._pages[s][index])
            fill.append(min(p, end - index * p))
    ids = torch.tensor(pages, dtype=torch.long, device=cache.device)
    if cache.storage == "int4":
        x = _int4_decode(cache.k[layer][ids], cache.k_scale[layer][ids])  # (n, page, Hkv, D)
    else:
        x = _decode(cache.k[layer][ids], cache.storage)
    if cache.storage in PER_PAGE:
        x = x * cache.k_scale[layer][ids][:, None, :, None]
    live = (torch.arange(p, device=cache.device)[None, :] < torch.tensor(fill, device=cache.device)[:, None])
    live = live[:, :, None, None]
    cache.k_sum[layer][ids] = torch.where(live, x, 0.0).sum(1)
    cache.k_min[layer][ids] = torch.where(live, x, float("inf")).amin(1)
    cache.k_max[layer][ids] = torch.where(live, x, float("-inf")).amax(1)

def _per_page(cache, pool, scales, page, slot, x) -> None:
    """Quantize x (S, T, Hkv, D) into (page, slot); a touched page whose scale must grow is
    rescaled first."""
    amax = x.float().abs().amax(-1)  # (S, T, Hkv)
    touched = page.reshape(-1)
    src = amax.reshape(-1, amax.shape[-1]) / QMAX[cache.storage]  # (S*T, Hkv): each token's scale need
    need = torch.zeros_like(scales).scatter_reduce_(0, touched[:, None].expand_as(src), src, "amax")
    new_scale = torch.maximum(scales, need)
    grow = new_scale > scales  # (pages, Hkv)
    pages = torch.unique(touched)
    old = scales[pages]
    ratio = torch.where(grow[pages] & (old > 0), old / new_scale[pages], torch.ones_like(old))
    stored = _decode(pool[pages], cache.storage) * ratio[:, None, :, None]  # (P, page, Hkv, D), new units
    pool[pages] = _encode(stored, cache.storage)
    scales.copy_(new_scale)
    safe = torch.where(new_scale > 0, new_scale, torch.ones_like(new_scale))
    pool[page, slot] = _quantize(x, safe[page][..., None], cache.storage)
