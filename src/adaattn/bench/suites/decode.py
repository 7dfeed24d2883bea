"""decode: a few query rows against a long KV cache; the figure is the bandwidth of reading K and V.

Two kinds of case:
- contiguous: B sequences of equal length. The dense peers (SDPA kernels, flash_attn, adaattn's
  attention call) read (B, Hkv, N, D) tensors; the cache peers read an adaattn.kv.KVCache holding
  the same keys and values (bf16, and FP8/INT8 quantized once at append).
- ragged: B sequences of lengths spread over 1k..N, in a contiguous KVCache and in a PagedKVCache
  (page 64, pages interleaved between sequences as continuous batching leaves them), bf16 and FP8.

TB/s counts the bytes of K and V in the model dtype (bf16), for every row: a quantized cache reads
half of them (INT4 0.28-0.38 with its scales), so its figure is the bf16 bandwidth it is worth.
"""

from __future__ import annotations

import torch

from ...backends.reference import relative_errors
from ...problem import default_scale
from ...api import decode_attention, plan_decode
from ...kv import KVCache, PagedKVCache
from .. import peers
from ..cases import Case, Peer, graphed
from ..dense import describe, error_check, random_qkv
from ..grid import Grid, dtype_name
from ..peers import Call
from . import options

NAME = "decode"
HELP = ("bf16 B=16 Hq=32 Hkv=8 D=128, one query row, KV 8k/32k and a ragged batch 1k..32k: cuDNN, FA2, "
        "efficient, flash_attn, adaattn, and adaattn.kv caches (contiguous, paged page 64; bf16, fp8, int8, int4) "
        "through decode_attention with a plan, eager and CUDA-graph replay; TB/s of bf16 K and V, x cuDNN; "
        "sparse decode on every layer of the 32k checkpoint (suites/sparse_decode.py), and a storage per KV "
        "head (storage='auto') over the checkpoint's whole decode attention (suites/kv_storage.py)")
NEEDS_CUDA = True
DEFAULT = Grid((8192, 32768), batch=16, heads=32, kv_heads=8, head_dim=128, dtypes=(torch.bfloat16,), causal="no")
PAGE = 64


def cases(args, device):
    parts = getattr(args, "decode_parts", "all")
    out = _dense_cases(args, device) if parts in ("all", "dense") else []
    if parts in ("all", "sparse"):
        from . import sparse_decode

        out += sparse_decode.cases(device)
    if parts in ("all", "storage"):  # a storage per KV head on the checkpoint's K/V (suites/kv_storage.py)
        from . import kv_storage

        out += kv_storage.cases(device)
    return out


def summarize(rows):
    """The sparse part's figures against its bars (suites/sparse_decode.py); nothing for the dense part."""
    from . import sparse_decode

    if not any("sparse decode" in r.get("case", "") or r.get("workload") == "generation" for r in rows):
        return None, ""
    return sparse_decode.summarize(rows)


def _dense_cases(args, device):
    grid = options.grid(args, DEFAULT, causal="no")  # one query row: every cached key takes part
    kv_heads = grid.kv_heads or grid.heads
    seed = options.seed(args)
    out = []
    for dtype in grid.dtypes:
        series = f"decode {describe(grid.batch, grid.heads, kv_heads, grid.head_dim, dtype)}"
        for i, n in enumerate(grid.seq_lens):
            kv_bytes = 2 * grid.batch * kv_heads * n * grid.head_dim * torch.finfo(dtype).bits // 8
            out.append(Case(NAME, f"{series} KV={n}", n, {"batch": grid.batch, "heads": grid.heads,
                            "kv_heads": kv_heads, "head_dim": grid.head_dim, "dtype": dtype_name(dtype), "q_len": 1,
                            "kv_len": n, "kv_bytes": kv_bytes}, "cuDNN", "TB/s", kv_bytes,
                            _contiguous(grid, kv_heads, n, dtype, device, seed + i), series=series))
        longest = max(grid.seq_lens)
        lens = ragged_lengths(grid.batch, min(1024, longest), longest)
        kv_bytes = 2 * kv_heads * sum(lens) * grid.head_dim * torch.finfo(dtype).bits // 8
        out.append(Case(NAME, f"{series} ragged {min(lens)}..{max(lens)}", longest,
                        {"batch": grid.batch, "heads": grid.heads, "kv_heads": kv_heads, "head_dim": grid.head_dim,
                         "dtype": dtype_name(dtype), "q_len": 1, "kv_len": max(lens), "kv_lens": lens,
                         "kv_bytes": kv_bytes}, "kv bf16", "TB/s", kv_bytes,
                        _ragged(grid, kv_heads, lens, dtype, device, seed + 50), series=f"{series} ragged"))
    return out


def ragged_lengths(batch: int, shortest: int, longest: int) -> list[int]:
    """`batch` lengths spread evenly from shortest to longest, shuffled reproducibly."""
    if batch == 1:
        return [longest]
    lens = [round(shortest + (longest - shortest) * i / (batch - 1)) for i in range(batch)]
    order = torch.randperm(batch, generator=torch.Generator().manual_seed(batch)).tolist()
    return [lens[i] for i in order]


def cache_peer(name: str, q: torch.Tensor, cache, seqs=None, graph: bool = False) -> Peer:
    """decode_attention over `cache` with a plan made before timing; with `graph`, the call
    captured once in a CUDA graph and replayed."""
    plan = plan_decode(cache, seqs, heads=q.shape[1], query_len=q.shape[2])

    def call():
        return decode_attention(q, cache, 0, plan=plan)

    def info():
        return {"decode_plan": plan.explain()}

    return graphed(name, call, info) if graph else Peer(name, call, info=info)


def _fill_contiguous(k, v, storage, lens=None, **layout):
    b, hkv, n, d = k.shape
    cache = KVCache(1, b, hkv, n, d, dtype=k.dtype, device=k.device, storage=storage, page_size=PAGE, **layout)
    if lens is None:
        cache.append(0, k, v)
    else:
        for i, m in enumerate(lens):
            cache.append(0, k[i:i + 1, :, :m], v[i:i + 1, :, :m], seqs=[i])
    return cache


def _fill_paged(k, v, storage, lens):
    """A PagedKVCache whose sequences took their pages in turns, 8 pages at a time, as sequences
    growing side by side do: each sequence's pages are spread through the pool."""
    b, hkv, _, d = k.shape
    pages = sum(-(-m // PAGE) for m in lens)
    cache = PagedKVCache(1, hkv, d, pages, PAGE, dtype=k.dtype, device=k.device, storage=storage, max_seqs=b)
    seqs = [cache.add() for _ in range(b)]
    held = [0] * b
    while any(h < m for h, m in zip(held, lens)):
        for i, m in enumerate(lens):
            if held[i] < m:
                step = min(8 * PAGE, m - held[i])
                cache.reserve(seqs[i], step)
                held[i] += step
    for i, m in enumerate(lens):
        cache.append(0, [seqs[i]], k[i:i + 1, :, :m], v[i:i + 1, :, :m])
    return cache, seqs


def _contiguous(grid, kv_heads, n, dtype, device, seed):
    def make():
        q, k, v = random_qkv(grid.batch, grid.heads, kv_heads, 1, n, grid.head_dim, dtype, device, seed)
        call = Call(q, k, v)
        rows = [*(peers.sdpa(call, name) for name in ("cuDNN", "FA2", "efficient")), peers.flash_attn(call),
                peers.adaattn(call), peers.triton(call)]
        for storage in ("native", "fp8", "int8", "int4"):
            cache = _fill_contiguous(k, v, storage)
            name = f"kv {'bf16' if storage == 'native' else storage}"
            rows.append(cache_peer(name, q, cache))
            if storage in ("native", "fp8", "int4"):
                rows.append(cache_peer(f"{name} graph", q, cache, graph=True))
        # INT4's other layouts (kv/cache.py): groups of 64 channels (0.5625 bytes a value against
        # 0.75 at 16), and the newest 512 tokens kept in bf16
        for name, layout in (("kv int4 g64 graph", dict(group_size=64)), ("kv int4 w512 graph", dict(window=512))):
            rows.append(cache_peer(name, q, _fill_contiguous(k, v, "int4", **layout), graph=True))
        return rows, error_check(call)

    return make


def _ragged(grid, kv_heads, lens, dtype, device, seed):
    def make():
        b = grid.batch
        q, k, v = random_qkv(b, grid.heads, kv_heads, 1, max(lens), grid.head_dim, dtype, device, seed)
        rows = []
        for storage in ("native", "fp8"):
            tag = "bf16" if storage == "native" else storage
            rows.append(cache_peer(f"kv {tag}", q, _fill_contiguous(k, v, storage, lens)))
            paged, seqs = _fill_paged(k, v, storage, lens)
            rows.append(cache_peer(f"kv {tag} paged", q, paged, seqs))
            rows.append(cache_peer(f"kv {tag} paged graph", q, paged, seqs, graph=True))
        n = torch.tensor(lens, device=device)
        mask = (torch.arange(max(lens), device=device)[None, :] < n[:, None])[:, None, None, :]
        rows.append(peers.sdpa(Call(q, k, v), "efficient (padded, mask)", kernel=peers.SDPA_KERNELS["efficient"],
                               mask=mask))
        return rows, _ragged_check(q, k, v, lens)

    return make


def _ragged_check(q, k, v, lens):
    """Relative error against float64 over the whole batch, each sequence against its own keys."""
    g = q.shape[1] // k.shape[1]
    refs = []
    for i, m in enumerate(lens):
        kk = k[i, :, :m].double().repeat_interleave(g, 0)
        vv = v[i, :, :m].double().repeat_interleave(g, 0)
        p = torch.softmax(q[i].double() @ kk.transpose(-1, -2) * default_scale(q.shape[-1]), -1)
        refs.append(p @ vv)
    ref = torch.stack(refs)

    def check(out):
        return relative_errors(out, ref).item()

    return check
