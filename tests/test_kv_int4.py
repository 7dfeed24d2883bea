"""INT4 KV pages (kv/cache.py storage="int4"): the quantization against a float64 simulation of it,
the split-KV kernel's unpacking (under the interpreter) against float64 attention on the cache's
own values, and the pool sized by bytes."""

from __future__ import annotations

import os

import pytest
import torch

import adaattn
from adaattn.backends.reference import reference_attention, relative_errors
from adaattn.kv import KVCache, PagedKVCache

TRITON = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                            reason="the split-KV kernel needs CUDA or the interpreter")
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _simulate(x: torch.Tensor, page: int, center: torch.Tensor | None) -> torch.Tensor:
    """float64: (Hkv, N, D) values of one sequence appended at once from position 0, less `center`
    (Hkv, D), quantized with one scale per (page, KV head), amax / 7, rounded to [-7, 7]."""
    x = x.double() - (0 if center is None else center.double()[:, None])
    out = torch.empty_like(x)
    for p0 in range(0, x.shape[1], page):
        blk = x[:, p0:p0 + page]
        scale = (blk.abs().amax((1, 2), keepdim=True) / 7).float().double()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        out[:, p0:p0 + page] = (blk / safe).round().clamp(-7, 7) * scale
    return out + (0 if center is None else center.double()[:, None])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int4_pages_hold_the_simulated_quantization(dtype):
    g = torch.Generator().manual_seed(1)
    hkv, n, d, page = 2, 45, 16, 8
    cache = PagedKVCache(1, hkv, d, num_pages=16, page_size=page, dtype=dtype, storage="int4", max_seqs=2)
    s = cache.add()
    k = (torch.randn(1, hkv, n, d, generator=g) * 3 + 1).to(dtype)
    v = torch.randn(1, hkv, n, d, generator=g).to(dtype)
    cache.append(0, [s], k, v)
    assert cache.k[0].dtype == torch.uint8 and cache.k[0].shape[-1] == d // 2
    got_k, got_v = cache.gather(0, [s], n, dtype=torch.float64)
    center = k[0].float().mean(1)
    want_k, want_v = _simulate(k[0], page, center), _simulate(v[0], page, None)
    # The cache dequantizes in float32 (scale times value, plus the centre): equal to float32's rounding.
    assert torch.allclose(got_k[0], want_k, rtol=1e-6, atol=1e-6)
    assert torch.allclose(got_v[0], want_v, rtol=1e-6, atol=1e-6)


def test_an_append_that_raises_a_pages_scale_requantizes_what_the_page_holds():
    g = torch.Generator().manual_seed(2)
    cache = PagedKVCache(1, 1, 8, num_pages=4, page_size=8, dtype=torch.float32, storage="int4", max_seqs=1)
    s = cache.add()
    small, large = torch.randn(1, 1, 3, 8, generator=g) * 0.1, torch.randn(1, 1, 2, 8, generator=g) * 10
    cache.append(0, [s], small, small)
    cache.append(0, [s], large, large)
    _, v = cache.gather(0, [s], 5, dtype=torch.float64)
    step = float(cache.v_scale[0][cache.block_table[s, 0].long(), 0])
    whole = torch.cat([small, large], 2).double()
    assert (v - whole).abs().max() <= step  # at most one more rounding of the earlier tokens
    assert (v[..., 3:, :] - whole[..., 3:, :]).abs().max() <= step / 2 + 1e-6


def _filled(kind, storage, lens, hkv, d, dtype, g):
    page = 16
    if kind == "contiguous":
        cache = KVCache(1, len(lens), hkv, max(lens), d, dtype=dtype, device=DEV, storage=storage, page_size=page)
        seqs = list(range(len(lens)))
    else:
        cache = PagedKVCache(1, hkv, d, 64, page, dtype=dtype, device=DEV, storage=storage, max_seqs=len(lens) + 1)
        seqs = [cache.add() for _ in lens]
        for _ in range(3):  # pages taken in turns: each sequence's pages spread through the pool
            for s in seqs:
                cache.reserve(s, page)
    for s, n in zip(seqs, lens):
        k = (torch.randn(1, hkv, n, d, generator=g) * 2).to(DEV, dtype)
        v = torch.randn(1, hkv, n, d, generator=g).to(DEV, dtype)
        if kind == "contiguous":
            cache.append(0, k, v, seqs=[s])
        else:
            cache.append(0, [s], k, v)
    return cache, seqs


@TRITON
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("runner", ["triton", "sdpa"])
def test_int4_decode_matches_float64_on_the_caches_own_values(kind, t, runner):
    """The split-KV kernel unpacks the nibbles in registers (and the sdpa runner reads gather's
    values): against float64 attention on the values the cache holds, GQA, ragged lengths, one
    and three query rows, several splits."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, dtype = 4, 2, 32, torch.float16
    lens = [37, 9, 70] if kind == "paged" else [50, 50]
    cache, seqs = _filled(kind, "int4", lens, hkv, d, dtype, g)
    q = (torch.randn(len(seqs), hq, t, d, generator=g)).to(DEV, dtype)
    with adaattn.stats.collect() as records:
        out = adaattn.decode_attention(q, cache, 0, seqs=seqs, runner=runner,
                                       **({"splits": 3} if runner == "triton" else {}))
    assert records[-1].backend == f"kv.{runner}"
    k_all, v_all = cache.gather(0, seqs, max(lens), dtype=torch.float64)
    for row, n in enumerate(lens):
        want = reference_attention(q[row:row + 1].double(), k_all[row:row + 1, :, :n], v_all[row:row + 1, :, :n],
                                   None, True, None, None, bottom_right=True)
        assert relative_errors(out[row:row + 1], want).item() < 2e-3, row


def test_a_byte_budget_holds_four_times_the_tokens_at_int4():
    kw = dict(dtype=torch.bfloat16, max_seqs=2, device="meta")
    budget = 256 * 2**20
    held = {s: PagedKVCache.for_budget(budget, 4, 8, 128, 64, storage=s, **kw).capacity
            for s in ("native", "fp8", "int8", "int4")}
    assert held["int4"] >= 3.5 * held["native"] and held["fp8"] >= 1.9 * held["native"]
    per_page = 4 * PagedKVCache.page_bytes(8, 128, 64, storage="int4")
    assert held["int4"] // 64 == budget // per_page
    with pytest.raises(ValueError, match="holds no page"):
        PagedKVCache.for_budget(1000, 4, 8, 128, 64, storage="int4", **kw)
    with pytest.raises(ValueError, match="head_dim and value_dim must be even"):
        PagedKVCache(1, 2, 15, 4, storage="int4")


def test_an_empty_int4_pool_holds_zeros_and_both_appends_leave_it_so():
    """Bytes 0x88 are two zeros: the slots no token has filled decode to 0 before and after either
    append's requantization of a page (the torch path rewrites whole pages)."""
    from adaattn.kv.cache import _decode

    cache = PagedKVCache(1, 1, 8, num_pages=2, page_size=8, dtype=torch.float32, storage="int4", max_seqs=1)
    assert torch.equal(_decode(cache.k[0], "int4"), torch.zeros(2, 8, 1, 8))
    s = cache.add()
    cache.append(0, [s], torch.ones(1, 1, 2, 8) * 0.1, torch.ones(1, 1, 2, 8) * 0.1)
    cache.append(0, [s], torch.ones(1, 1, 1, 8) * 5, torch.ones(1, 1, 1, 8) * 5)  # the page's scale grows
    assert not _decode(cache.v[0], "int4")[0, 3:].any() and not _decode(cache.v[0], "int4")[1].any()
