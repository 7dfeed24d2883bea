"""INT4 KV pages (kv/cache.py storage="int4", per token and group of channels): the quantization
against a float64 simulation of it, the split-KV kernel's dequantization (under the interpreter)
against float64 attention on the cache's own values, and the pool sized by bytes."""

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


def _bf16_toward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float64 values of float32 precision, rounded to bfloat16 toward +inf (up) or -inf, exactly:
    the nearest bfloat16, then one step of bfloat16's spacing where it went the wrong way."""
    near = x.to(torch.bfloat16).double()
    spacing = torch.exp2(torch.floor(torch.log2(near.abs().clamp_min(1e-38))) - 7)
    if up:
        return torch.where(near < x, near + spacing, near)
    low = torch.where(near > x, near - spacing, near)
    # (stepping down past a power of two: the spacing below it is half as large)
    return torch.where(low.to(torch.bfloat16).double() != low, near - spacing / 2, low)


def _simulate(x: torch.Tensor, group: int, center: torch.Tensor | None) -> torch.Tensor:
    """float64: (Hkv, N, D) values less `center` (Hkv, D), each token's groups of `group` channels
    quantized to 16 levels: minimum rounded down and (max - min) / 15 rounded up to bfloat16,
    codes round((x - min) / scale) in [0, 15], value = code x scale + minimum."""
    y = x.double() - (0 if center is None else center.double()[:, None])
    y = y.float().double().unflatten(-1, (-1, group))  # the cache subtracts in float32
    low = _bf16_toward(y.amin(-1), up=False)
    scale = _bf16_toward(((y.amax(-1) - low).float() / 15).double(), up=True)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((y - low[..., None]) / safe[..., None]).round().clamp(0, 15)
    out = (codes * scale[..., None] + low[..., None]).flatten(-2)
    return out + (0 if center is None else center.double()[:, None])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group_size", [16, 64])
def test_int4_pages_hold_the_simulated_quantization(dtype, group_size):
    g = torch.Generator().manual_seed(1)
    hkv, n, d, page = 2, 45, 64, 8
    cache = PagedKVCache(1, hkv, d, num_pages=16, page_size=page, dtype=dtype, storage="int4", max_seqs=2,
                         group_size=group_size)
    s = cache.add()
    k = (torch.randn(1, hkv, n, d, generator=g) * 3 + 1).to(dtype)
    v = torch.randn(1, hkv, n, d, generator=g).to(dtype)
    cache.append(0, [s], k[:, :, :20], v[:, :, :20])
    cache.append(0, [s], k[:, :, 20:], v[:, :, 20:])  # a second append mid-page
    assert cache.k[0].dtype == torch.uint8 and cache.k[0].shape[-1] == d // 2
    assert cache.k_scale[0].shape == (16, page, hkv, d // group_size, 2)
    got_k, got_v = cache.gather(0, [s], n, dtype=torch.float64)
    center = k[0, :, :20].float().mean(1)  # (the centre is the first append's mean)
    want_k, want_v = _simulate(k[0], group_size, center), _simulate(v[0], group_size, None)
    # The cache dequantizes in float32 (code x scale + minimum, plus the centre): float32's rounding.
    torch.testing.assert_close(got_k[0], want_k, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got_v[0], want_v, rtol=1e-6, atol=1e-6)


def test_every_value_lies_within_half_a_step_even_far_from_zero():
    """The minimum rounds down and the scale up, so no value of a group is clipped: each is within
    half its group's step, also where the group sits far from zero (float32 values of 1000 + small
    ones, where bfloat16's nearest minimum would lie above the smallest)."""
    g = torch.Generator().manual_seed(4)
    cache = PagedKVCache(1, 1, 32, num_pages=2, page_size=8, dtype=torch.float32, storage="int4", max_seqs=1)
    s = cache.add()
    v = 1000 + torch.randn(1, 1, 8, 32, generator=g) * 0.5
    cache.append(0, [s], v, v)
    _, got = cache.gather(0, [s], 8, dtype=torch.float64)
    step = cache.v_scale[0][0, :, 0, :, 0].double().repeat_interleave(16, -1)  # (8, 32)
    assert bool(((got[0, 0] - v[0, 0].double()).abs() <= step / 2 * (1 + 1e-3) + 1e-4).all())
    # (a stored minimum of bfloat16 near 1000 is a multiple of 4: the step, not the minimum, sets the error)
    assert float((got[0, 0] - v[0, 0].double()).abs().max()) <= 0.5 * float(step.max()) + 1e-4


def test_a_token_is_written_once_a_later_larger_append_leaves_it_alone():
    g = torch.Generator().manual_seed(2)
    cache = PagedKVCache(1, 1, 16, num_pages=4, page_size=8, dtype=torch.float32, storage="int4", max_seqs=1)
    s = cache.add()
    small, large = torch.randn(1, 1, 3, 16, generator=g) * 0.1, torch.randn(1, 1, 2, 16, generator=g) * 10
    cache.append(0, [s], small, small)
    before = cache.v[0][0, :3].clone(), cache.v_scale[0][0, :3].clone()
    cache.append(0, [s], large, large)
    assert torch.equal(cache.v[0][0, :3], before[0]) and torch.equal(cache.v_scale[0][0, :3], before[1])
    _, v = cache.gather(0, [s], 5, dtype=torch.float64)
    assert (v[..., :3, :] - small.double()).abs().max() < 0.02  # the small tokens keep their own fine step


def _filled(kind, storage, lens, hkv, d, dtype, g, window=0):
    page = 16
    if kind == "contiguous":
        cache = KVCache(1, len(lens), hkv, max(lens), d, dtype=dtype, device=DEV, storage=storage, page_size=page,
                        window=window)
        seqs = list(range(len(lens)))
    else:
        cache = PagedKVCache(1, hkv, d, 64, page, dtype=dtype, device=DEV, storage=storage, max_seqs=len(lens) + 1,
                             window=window)
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
@pytest.mark.parametrize("runner,window", [("triton", 0), ("triton", 16), ("sdpa", 0)])
def test_int4_decode_matches_float64_on_the_caches_own_values(kind, t, runner, window):
    """The split-KV kernel dequantizes in registers, and with a window reads the newest tokens from
    the ring (the sdpa runner reads gather's values): against float64 attention on the values the
    cache holds, GQA, ragged lengths (one shorter than the window), one and three query rows,
    several splits."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, dtype = 4, 2, 32, torch.float16
    lens = [37, 9, 70] if kind == "paged" else [50, 50]
    cache, seqs = _filled(kind, "int4", lens, hkv, d, dtype, g, window)
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


def test_a_byte_budget_holds_the_tokens_int4_s_bytes_allow():
    """0.5625 bytes a value at groups of 64 (3.56x bf16's tokens), 0.75 at groups of 16 (2.67x)."""
    kw = dict(dtype=torch.bfloat16, max_seqs=2, device="meta")
    budget = 256 * 2**20
    held = {s: PagedKVCache.for_budget(budget, 4, 8, 128, 64, storage=s, **kw).capacity
            for s in ("native", "fp8", "int8", "int4")}
    coarse = PagedKVCache.for_budget(budget, 4, 8, 128, 64, storage="int4", group_size=64, **kw).capacity
    assert coarse >= 3.5 * held["native"] and held["int4"] >= 2.6 * held["native"]
    assert held["fp8"] >= 1.9 * held["native"]
    per_page = 4 * PagedKVCache.page_bytes(8, 128, 64, storage="int4")
    assert per_page == 4 * 64 * 8 * 2 * (64 + 8 * 4)  # codes, and two bfloat16 per group of 16
    assert held["int4"] // 64 == budget // per_page
    with pytest.raises(ValueError, match="holds no page"):
        PagedKVCache.for_budget(1000, 4, 8, 128, 64, storage="int4", **kw)
    with pytest.raises(ValueError, match="head_dim and value_dim must be even"):
        PagedKVCache(1, 2, 15, 4, storage="int4")
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        PagedKVCache(1, 2, 16, 4, storage="int4", group_size=0)


def test_groups_shrink_to_a_power_of_two_that_divides_the_head_dim():
    cache = PagedKVCache(1, 1, 72, 2, 8, value_dim=40, storage="int4", group_size=16, device="meta")
    assert (cache.k_group, cache.v_group) == (8, 8)
    assert PagedKVCache(1, 1, 96, 2, 8, storage="int4", group_size=64, device="meta").k_group == 32


def test_an_empty_int4_pool_holds_zeros_and_appends_leave_the_other_slots_so():
    cache = PagedKVCache(1, 1, 8, num_pages=2, page_size=8, dtype=torch.float32, storage="int4", max_seqs=1)
    s = cache.add()
    cache.append(0, [s], torch.ones(1, 1, 2, 8) * 0.1, torch.ones(1, 1, 2, 8) * 0.1)
    cache.append(0, [s], torch.ones(1, 1, 1, 8) * 5, torch.ones(1, 1, 1, 8) * 5)
    _, v = cache.gather(0, [s], 8, dtype=torch.float64)  # the page's 8 slots, 3 of them filled
    assert not v[0, 0, 3:].any() and torch.allclose(v[0, 0, 2], torch.full((8,), 5.0, dtype=torch.float64))


def test_a_window_keeps_the_newest_tokens_exact_and_both_appends_write_the_same():
    """Ragged appends (one longer than the window, one token, mid-page starts): the newest `window`
    tokens of each sequence read back as appended, older ones as INT4; the one-launch append
    writes the torch append's pages, scales and rings, bit for bit."""
    from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401

    g = torch.Generator().manual_seed(6)
    hkv, d, dv, w = 2, 32, 16, 12
    caches = [PagedKVCache(1, hkv, d, 24, 8, value_dim=dv, dtype=torch.bfloat16, storage="int4", max_seqs=3,
                           append=a, window=w, device=DEV) for a in ("torch", "triton")]
    seqs = [[c.add() for _ in range(2)] for c in caches][0]
    ks, vs = [], []
    for t in (5, 1, 20, 1, 3):
        k = (torch.randn(2, hkv, t, d, generator=g) * 2 + 1).to(DEV, torch.bfloat16)
        v = torch.randn(2, hkv, t, dv, generator=g).to(DEV, torch.bfloat16)
        ks.append(k)
        vs.append(v)
        for c in caches:
            c.append(0, seqs, k, v)
    k_all, v_all = torch.cat(ks, 2).double(), torch.cat(vs, 2).double()
    n = k_all.shape[2]
    for name in ("k", "v", "k_scale", "v_scale", "k_window", "v_window"):
        torch.testing.assert_close(getattr(caches[1], name)[0], getattr(caches[0], name)[0], rtol=0, atol=0)
    got_k, got_v = caches[0].gather(0, seqs, n, dtype=torch.float64)
    assert torch.equal(got_k[:, :, n - w:], k_all[:, :, n - w:]) and torch.equal(got_v[:, :, n - w:], v_all[:, :, n - w:])
    assert 0 < float((got_v[:, :, :n - w] - v_all[:, :, :n - w]).abs().max()) < 0.5


def test_a_window_is_refused_off_int4_and_counted_in_a_byte_budget():
    with pytest.raises(ValueError, match="storage 'int8' holds none"):
        PagedKVCache(1, 2, 16, 4, storage="int8", window=64)
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        PagedKVCache(1, 2, 16, 4, storage="int4", window=-1)
    kw = dict(storage="int4", dtype=torch.bfloat16, max_seqs=4, device="meta")
    budget = 64 * 2**20
    plain = PagedKVCache.for_budget(budget, 2, 8, 128, 64, **kw)
    windowed = PagedKVCache.for_budget(budget, 2, 8, 128, 64, window=512, **kw)
    rings = 2 * 4 * 512 * 8 * 256 * 2  # layers x sequences x window x Hkv x (D + Dv) x bf16
    per_page = 2 * PagedKVCache.page_bytes(8, 128, 64, storage="int4")
    assert windowed.num_pages == (budget - rings) // per_page < plain.num_pages


def test_decode_pipeline_stages_fit_the_devices_shared_memory(monkeypatch):
    """The split-KV kernel's stages shrink where their tiles would not fit a program's shared memory:
    INT4 with a window at head dim 128 in 3 stages asked for 233,472 of an H200's 232,448 bytes
    (OutOfResources; 2 stages ran), bf16 at head dim 256 would ask for 384 KiB. Where they fit, the
    tuned stages stay (bf16 and INT4 at head dim 128, contiguous: 3)."""
    from types import SimpleNamespace

    from adaattn import hardware
    from adaattn.kv import decode as kd

    monkeypatch.setattr(hardware, "max_shared_memory", lambda index: 232448)  # an H100/H200's per block

    def cache(storage="native", d=128, window=0):
        return SimpleNamespace(device=torch.device("cuda", 0), head_dim=d, value_dim=d, dtype=torch.bfloat16,
                               storage=storage, k_group=16, v_group=16, window=window)

    assert kd._stages(cache(), True) == 3
    assert kd._stages(cache(), False) == 2
    assert kd._stages(cache("int4"), True) == 3
    assert kd._stages(cache("int8"), True) == 3
    assert kd._stages(cache("int4", window=512), True) == 2
    assert kd._stages(cache("mixed"), True) == 2  # the model dtype's tile and INT4's scales
    # a storage per head counts the model dtype's tile and the window's together (1 stage; a bound)
    assert kd._stages(cache("mixed", window=512), True) == 1
    assert kd._stages(cache("mixed", d=64, window=512), True) == 2
    # one part of such a cache (a layer whose heads all hold it): that storage's own tile
    assert kd._stages(cache("mixed", window=512), True, "int8") == 3
    assert kd._stages(cache("mixed", window=512), True, "int4") == 2
    assert kd._stages(cache("mixed", window=512), True, "native") == 3
    assert kd._stages(cache(d=256), True) == 1
    assert kd._stages(cache("int4", d=256, window=512), True) == 1
    cpu = cache("int4", window=512)
    cpu.device = torch.device("cpu")
    assert kd._stages(cpu, True) == 3


@TRITON
@pytest.mark.parametrize("d,dv,group,window", [(72, 40, 16, 0), (64, 64, 64, 8), (48, 32, 16, 8)])
def test_int4_kernel_reads_every_groups_scales_and_the_ring_where_reached(d, dv, group, window):
    """The split-KV kernel loads a token's (scale, minimum) pairs of every group in one vector load
    (the pools keep them together, group after group), and reads the window's ring only in tiles
    that reach the newest keys: head dims that are not powers of two (72/40: groups of 8, 9 and 5
    of them, in blocks of 128 and 64), one group of 64, windows inside and across tiles, against
    float64 attention over the values the cache holds (ragged lengths, several splits)."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(5)
    hq, hkv, dtype, lens = 4, 2, torch.float16, [70, 23]
    cache = KVCache(1, len(lens), hkv, max(lens), d, value_dim=dv, dtype=dtype, device=DEV, storage="int4",
                    page_size=16, group_size=group, window=window)
    for part in (cache.k_scale[0], cache.v_scale[0]):  # the layout the kernel's one load assumes
        assert part.stride()[-2:] == (2, 1)
    for s, n in enumerate(lens):
        cache.append(0, (torch.randn(1, hkv, n, d, generator=g) * 2).to(DEV, dtype),
                     torch.randn(1, hkv, n, dv, generator=g).to(DEV, dtype), seqs=[s])
    q = torch.randn(len(lens), hq, 1, d, generator=g).to(DEV, dtype)
    out = adaattn.decode_attention(q, cache, 0, runner="triton", splits=3)
    k_all, v_all = cache.gather(0, list(range(len(lens))), max(lens), dtype=torch.float64)
    for row, n in enumerate(lens):
        want = reference_attention(q[row:row + 1].double(), k_all[row:row + 1, :, :n], v_all[row:row + 1, :, :n],
                                   None, True, None, None, bottom_right=True)
        assert relative_errors(out[row:row + 1], want).item() < 2e-3, row
