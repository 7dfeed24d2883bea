"""KV caches (adaattn.kv): contiguous and paged, native and quantized at append, and decode
against them, checked against float64 attention over each sequence's full history."""

from __future__ import annotations


import json

import pytest
import torch
from helpers import decode_reference

import adaattn
from adaattn import KVCache, PagedKVCache, decode_attention, plan_decode
from adaattn.kv.cache import QMAX


_reference = decode_reference


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _torch_error(q, k, v):
    """err(torch): SDPA in the inputs' dtype against float64 (MEASURING.md's yardstick)."""
    g = q.shape[0] // k.shape[0]
    t, n = q.shape[1], k.shape[1]
    mask = torch.arange(n)[None, :] <= (n - t + torch.arange(t))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0),
                                                           attn_mask=mask)
    return _rel(out, _reference(q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_contiguous_cache_decode_matches_float64(dtype, hq, hkv):
    torch.manual_seed(0)
    b, d, layers = 3, 64, 2
    cache = KVCache(layers, b, hkv, 300, d, dtype=dtype, page_size=32)
    hist_k = torch.randn(b, hkv, 0, d, dtype=dtype)
    hist_v = hist_k.clone()
    for step, t in enumerate((130, 1, 1, 3, 1)):  # a prompt, decode steps, a 3-token speculative step
        k, v = torch.randn(b, hkv, t, d, dtype=dtype), torch.randn(b, hkv, t, d, dtype=dtype)
        for layer in range(layers):
            cache.append(layer, k, v)
        hist_k, hist_v = torch.cat([hist_k, k], 2), torch.cat([hist_v, v], 2)
        q = torch.randn(b, hq, t, d, dtype=dtype)
        out = decode_attention(q, cache, layers - 1)
        assert out.shape == (b, hq, t, d) and out.dtype == dtype
        for i in range(b):
            ref = _reference(q[i], hist_k[i], hist_v[i])
            assert _rel(out[i], ref) <= 2 * _torch_error(q[i], hist_k[i], hist_v[i]) + 1e-6, (step, i)
    assert cache.length(0) == 136 and cache.lengths[1].tolist() == [136] * b
    torch.testing.assert_close(cache.keys(0)[:, :, :136], hist_k, rtol=0, atol=0)  # the contiguous view


def test_paged_cache_ragged_lengths_add_extend_free_and_reuse():
    torch.manual_seed(1)
    hkv, d, dtype = 2, 64, torch.bfloat16
    cache = PagedKVCache(1, hkv, d, num_pages=12, page_size=16, dtype=dtype, max_seqs=4)
    hist = {}
    seqs = [cache.add() for _ in range(3)]
    for s, n in zip(seqs, (5, 40, 17)):  # ragged prompts, appended one sequence at a time
        k, v = torch.randn(1, hkv, n, d, dtype=dtype), torch.randn(1, hkv, n, d, dtype=dtype)
        cache.append(0, [s], k, v)
        hist[s] = (k[0], v[0])
    assert [len(cache.pages_of(s)) for s in seqs] == [1, 3, 2]
    cache.free(seqs[1])  # three pages back
    new = cache.add(reserve=33)
    assert len(cache.pages_of(new)) == 3 and new == seqs[1]  # the freed id and pages reused
    k, v = torch.randn(1, hkv, 33, d, dtype=dtype), torch.randn(1, hkv, 33, d, dtype=dtype)
    cache.append(0, [new], k, v)
    hist[new] = (k[0], v[0])
    live = [seqs[0], new, seqs[2]]
    for _ in range(3):  # decode steps for the whole ragged batch
        k, v = torch.randn(3, hkv, 1, d, dtype=dtype), torch.randn(3, hkv, 1, d, dtype=dtype)
        cache.append(0, live, k, v)
        for i, s in enumerate(live):
            hist[s] = (torch.cat([hist[s][0], k[i]], 1), torch.cat([hist[s][1], v[i]], 1))
        q = torch.randn(3, 4, 1, d, dtype=dtype)
        out = decode_attention(q, cache, 0, live)
        for i, s in enumerate(live):
            ref = _reference(q[i], *hist[s])
            assert _rel(out[i], ref) <= 2 * _torch_error(q[i], *hist[s]) + 1e-6
    assert [cache.length(s) for s in live] == [8, 36, 20]
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.append(0, [seqs[0]], torch.randn(1, hkv, 120, d, dtype=dtype), torch.randn(1, hkv, 120, d, dtype=dtype))
    with pytest.raises(ValueError, match="not in this cache"):
        cache.free(3)


def _simulated(x, page_size, storage, center=False):
    """float64 simulation of one append of x (Hkv, N, D) into empty pages: per (page, head) scale
    amax / QMAX, values rounded to the storage format, dequantized. center: keys, stored less their
    mean over this (first) append, taken in fp32 as the cache does, and given back after."""
    hkv, n, d = x.shape
    c = x.float().mean(1, keepdim=True) if center else torch.zeros(hkv, 1, d)
    r = x.float() - c
    out = torch.empty(hkv, n, d, dtype=torch.float64)
    for p0 in range(0, n, page_size):
        blk = r[:, p0:p0 + page_size].double()
        scale = blk.abs().amax((1, 2), keepdim=True) / QMAX[storage]
        y = (blk / scale).float()
        y = y.to(torch.float8_e4m3fn).double() if storage == "fp8" else y.round().double()
        out[:, p0:p0 + page_size] = y * scale
    return (out.float() + c).double() if center else out


@pytest.mark.parametrize("storage", ["fp8", "int8"])
def test_quantized_pages_match_a_float64_simulation_and_decode_within_tolerance(storage):
    torch.manual_seed(2)
    hkv, d, n, page = 2, 64, 100, 32
    cache = PagedKVCache(1, hkv, d, num_pages=16, page_size=page, dtype=torch.float32, storage=storage)
    s = cache.add()
    k, v = torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d)
    cache.append(0, [s], k, v)
    got_k, got_v = cache.gather(0, [s], n, torch.float64)
    sim_k, sim_v = _simulated(k[0], page, storage, center=True), _simulated(v[0], page, storage)
    torch.testing.assert_close(got_k[0], sim_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_v[0], sim_v, rtol=1e-6, atol=1e-6)
    # Decode-time appends grow a partly filled page's scale: values are rescaled, never clipped.
    big = torch.randn(1, hkv, 1, d) * 8
    cache.append(0, [s], big, big)
    got_k, _ = cache.gather(0, [s], n + 1, torch.float64)
    full = torch.cat([k, big], 2)[0].double()
    scale = cache.k_scale[0][cache.pages_of(s)[-1]]  # the last page's (grown) scale per head
    step = scale.max().item() * (QMAX[storage] / 16 if storage == "fp8" else 1.0)  # e4m3: 3 mantissa bits
    assert (got_k[0] - full).abs().max().item() <= step
    q = torch.randn(1, 4, 1, d)
    out = decode_attention(q, cache, 0, [s])
    assert _rel(out[0], _reference(q[0], full, torch.cat([v, big], 2)[0])) <= 3e-2


@pytest.mark.parametrize("storage", ["fp8", "int8"])
def test_keys_sharing_an_offset_are_stored_less_their_center_and_decode_is_unchanged(storage):
    """Keys = a common offset + small residuals: the cache quantizes the residuals (less the first
    append's mean), so the keys come back to within the residuals' rounding, not the offset's; a
    later sequence's first append sets its own center."""
    torch.manual_seed(6)
    hkv, d, n = 2, 32, 40
    cache = PagedKVCache(1, hkv, d, num_pages=8, page_size=16, dtype=torch.float32, storage=storage, max_seqs=2)
    s = cache.add()
    offset = 40.0 * torch.randn(1, hkv, 1, d)
    k = offset + torch.randn(1, hkv, n, d)
    v = torch.randn(1, hkv, n, d)
    cache.append(0, [s], k, v)
    got_k, _ = cache.gather(0, [s], n, torch.float64)
    rel = ((got_k - k.double()).norm() / (k - k.mean(2, keepdim=True)).double().norm()).item()
    assert rel <= (4e-2 if storage == "fp8" else 1.2e-2)  # the residuals' own rounding
    torch.testing.assert_close(cache.k_center[0][s], k[0].mean(1), rtol=1e-6, atol=1e-5)
    q = torch.randn(1, 4, 1, d) * 0.05
    out = decode_attention(q, cache, 0, [s])
    assert _rel(out[0], _reference(q[0], k[0], v[0])) <= 3e-2


def test_a_long_chunk_against_the_cache_goes_to_sdpa_and_an_explicit_triton_runner_is_refused():
    torch.manual_seed(7)
    cache = KVCache(1, 1, 2, 400, 16, dtype=torch.float32)
    k = torch.randn(1, 2, 300, 16)
    cache.append(0, k, k)
    plan = plan_decode(cache, heads=4, query_len=100)  # 2 x 100 rows per KV head: over one tile
    assert plan.runner == "sdpa" and "fit one tile" in plan.why
    q = torch.randn(1, 4, 100, 16)
    assert _rel(decode_attention(q, cache, 0, plan=plan)[0], _reference(q[0], k[0], k[0])) < 1e-5
    with pytest.raises(ValueError, match="fit one tile"):
        plan_decode(cache, heads=4, query_len=100, runner="triton")


def test_bad_arguments_name_what_they_got():
    cache = PagedKVCache(2, 2, 16, 4, 8)
    s = cache.add()
    with pytest.raises(ValueError, match="key must be"):
        cache.append(0, [s], torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16))
    with pytest.raises(ValueError, match="layer must be"):
        cache.append(2, [s], torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    with pytest.raises(ValueError, match="storage must be"):
        PagedKVCache(1, 2, 16, 4, storage="fp4")
    with pytest.raises(ValueError, match="seqs is required"):
        decode_attention(torch.randn(1, 2, 1, 16), cache, 0)
    with pytest.raises(ValueError, match="at least the query's"):
        decode_attention(torch.randn(1, 2, 1, 16), cache, 0, [s])


def _raises(msg, fn, *args):
    """fn(*args) raises ValueError with exactly `msg`."""
    with pytest.raises(ValueError) as e:
        fn(*args)
    assert str(e.value) == msg


def test_an_append_past_max_len_is_refused_naming_max_len_and_writes_nothing():
    torch.manual_seed(11)
    cache = KVCache(1, 1, 2, max_len=100, head_dim=16, dtype=torch.float32)  # pages hold 128: the limit is 100
    k = torch.randn(1, 2, 105, 16)
    _raises("sequence 0 of layer 0 holds 0 tokens; 105 more would make 105, over max_len=100, the most this "
            "KVCache holds per sequence", cache.append, 0, k, k)
    assert cache.length(0) == 0 and cache.lengths.tolist() == [[0]]
    cache.append(0, k[:, :, :60], k[:, :, :60])
    _raises("sequence 0 of layer 0 holds 60 tokens; 41 more would make 101, over max_len=100, the most this "
            "KVCache holds per sequence", cache.append, 0, k[:, :, 60:101], k[:, :, 60:101])
    cache.append(0, k[:, :, 60:100], k[:, :, 60:100])  # exactly max_len
    _raises("sequence 0 of layer 0 holds 100 tokens; 1 more would make 101, over max_len=100, the most this "
            "KVCache holds per sequence", cache.append, 0, k[:, :, :1], k[:, :, :1])
    _raises("sequence 0 holds 100 tokens; 1 more would make 101, over max_len=100, the most this KVCache holds "
            "per sequence", cache.reserve, 0, 1)
    q = torch.randn(1, 2, 1, 16)
    ref = _reference(q[0], k[0, :, :100], k[0, :, :100])
    assert cache.length(0) == 100 and _rel(decode_attention(q, cache, 0)[0], ref) < 1e-5


def test_an_append_past_max_len_is_checked_per_sequence_before_anything_is_written():
    cache = KVCache(1, 2, 1, 100, 16, dtype=torch.float32)
    k = torch.randn(2, 1, 90, 16)
    cache.append(0, k[1:], k[1:], seqs=[1])  # sequence 1 holds 90, sequence 0 nothing
    _raises("sequence 1 of layer 0 holds 90 tokens; 11 more would make 101, over max_len=100, the most this "
            "KVCache holds per sequence", cache.append, 0, k[:, :, :11], k[:, :, :11])
    assert [cache.length(0), cache.length(1)] == [0, 90] and cache.lengths.tolist() == [[0, 90]]
    cache.append(0, k[:, :, :10], k[:, :, :10])
    assert [cache.length(0), cache.length(1)] == [10, 100]


def test_a_paged_append_or_reservation_past_what_a_sequence_can_hold_names_max_len():
    cache = PagedKVCache(2, 1, 16, num_pages=8, page_size=16, dtype=torch.float32, max_pages_per_seq=2)
    s = cache.add()
    k = torch.randn(1, 1, 33, 16)
    tail = "the most this PagedKVCache holds per sequence (max_pages_per_seq=2 pages of page_size=16)"
    _raises(f"sequence 0 of layer 1 holds 0 tokens; 33 more would make 33, over max_len=32, {tail}",
            cache.append, 1, [s], k, k)
    cache.append(1, [s], k[:, :, :20], k[:, :, :20])
    _raises(f"sequence 0 of layer 1 holds 20 tokens; 13 more would make 33, over max_len=32, {tail}",
            cache.append, 1, [s], k[:, :, 20:], k[:, :, 20:])  # at the page boundary
    cache.append(1, [s], k[:, :, 20:32], k[:, :, 20:32])
    assert cache.length(s, 1) == 32 and len(cache.pages_of(s)) == 2
    free = len(cache._free_pages)
    _raises(f"sequence 1 holds 0 tokens; 40 more would make 40, over max_len=32, {tail}", cache.add, 40)
    assert len(cache._free_pages) == free and cache.add() == 1  # the refused add() kept no id and no page


triton = pytest.importorskip("triton")


@pytest.mark.parametrize("storage", ["native", "fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_kv_kernel_matches_float64_on_ragged_paged_batches(storage, dtype):
    """The triton runner (kernels/decode.py) against float64 attention over the values the cache
    holds (dequantized in float64): ragged lengths, GQA 4:1, one and three query rows, several
    splits (some of them past a short sequence's end)."""
    from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401  (the interpreter runs it on the CPU)

    torch.manual_seed(3)
    hkv, d = 2, 64
    cache = PagedKVCache(1, hkv, d, num_pages=40, page_size=16, dtype=dtype, storage=storage, max_seqs=4)
    seqs = [cache.add() for _ in range(3)]
    for s, n in zip(seqs, (5, 70, 33)):
        k = torch.randn(1, hkv, n, d, dtype=dtype)
        cache.append(0, [s], k, torch.randn_like(k))
    for t in (1, 3):
        q = torch.randn(3, 8, t, d, dtype=dtype)
        out = decode_attention(q, cache, 0, seqs, runner="triton", splits=3)
        assert out.shape == (3, 8, t, d) and out.dtype == dtype
        for i, s in enumerate(seqs):
            k64, v64 = cache.gather(0, [s], cache.length(s), torch.float64)
            ref = _reference(q[i], k64[0], v64[0])
            bar = 2 * _torch_error(q[i], k64[0].to(dtype), v64[0].to(dtype)) + 1e-6
            assert _rel(out[i], ref) <= bar, (storage, t, s, _rel(out[i], ref), bar)


@pytest.mark.parametrize("storage", ["native", "fp8"])
def test_split_kv_kernel_on_a_contiguous_cache_computes_pages_and_matches_reading_the_block_table(storage):
    """A KVCache's plan computes each key's page (CONTIG): the same output as reading the block
    table, bit for bit, and within float64's bar."""
    from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401

    torch.manual_seed(4)
    b, hkv, d, dtype = 2, 2, 32, torch.bfloat16
    cache = KVCache(1, b, hkv, 100, d, dtype=dtype, page_size=16, storage=storage)
    k = torch.randn(b, hkv, 75, d, dtype=dtype)
    cache.append(0, k, torch.randn_like(k))
    q = torch.randn(b, 4, 2, d, dtype=dtype)
    plan = plan_decode(cache, heads=4, query_len=2, runner="triton", splits=2)
    assert plan.contiguous
    out = decode_attention(q, cache, 0, plan=plan)
    plan.contiguous = False
    torch.testing.assert_close(decode_attention(q, cache, 0, plan=plan), out, rtol=0, atol=0)
    for i in range(b):
        k64, v64 = cache.gather(0, [i], 75, torch.float64)
        bar = 2 * _torch_error(q[i], k64[0].to(dtype), v64[0].to(dtype)) + 1e-6
        assert _rel(out[i], _reference(q[i], k64[0], v64[0])) <= bar


def test_split_kv_kernel_refuses_what_it_cannot_take():
    cache = PagedKVCache(1, 2, 64, 8, page_size=8, dtype=torch.bfloat16)
    s = cache.add()
    cache.append(0, [s], torch.randn(1, 2, 4, 64, dtype=torch.bfloat16), torch.randn(1, 2, 4, 64, dtype=torch.bfloat16))
    q = torch.randn(1, 2, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="runner='triton' cannot take this call: the query's dtype"):
        decode_attention(q.half(), cache, 0, [s], runner="triton")
    with pytest.raises(ValueError, match="runner must be one of"):
        decode_attention(q, cache, 0, [s], runner="flash")
    plan = plan_decode(cache, [s], heads=2, runner="triton", max_len=4)
    cache.append(0, [s], torch.randn(1, 2, 1, 64, dtype=torch.bfloat16), torch.randn(1, 2, 1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="the plan covers 4 tokens"):
        decode_attention(q, cache, 0, plan=plan)
    with pytest.raises(ValueError, match="as planned"):
        decode_attention(torch.randn(1, 4, 1, 64, dtype=torch.bfloat16), cache, 0, plan=plan_decode(cache, [s], heads=2))


@pytest.mark.parametrize("storage", ["native", "fp8", "int8", "int4"])
def test_append_kernel_writes_what_the_torch_append_writes(storage):
    """The one-launch append (kernels/kv_append.py) against the torch path, on ragged appends that
    start mid-page, cross pages and grow quantized pages' scales; device lengths advance once per
    sequence."""
    from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401

    torch.manual_seed(5)
    hkv, d, dtype = 2, 32, torch.bfloat16
    caches = [PagedKVCache(2, hkv, d, num_pages=24, page_size=8, dtype=dtype, storage=storage, max_seqs=3,
                           append=a) for a in ("torch", "triton")]
    seqs = [[c.add() for _ in range(3)] for c in caches][0]
    for t, who, gain in ((5, [0, 1, 2], 1.0), (1, [0, 2], 4.0), (11, [1], 0.5), (3, [2, 0], 9.0), (1, [0, 1, 2], 1.0)):
        k = torch.randn(len(who), hkv, t, d, dtype=dtype) * gain
        v = torch.randn(len(who), hkv, t, d, dtype=dtype).transpose(2, 3).contiguous().transpose(2, 3)  # strided
        for layer in (0, 1):
            for c in caches:
                c.append(layer, [seqs[i] for i in who], k, v)
    torch_c, kern_c = caches
    assert kern_c.lengths.tolist() == torch_c.lengths.tolist() == [[10, 17, 10]] * 2
    for layer in (0, 1):
        for s in seqs:
            n = torch_c.length(s, layer)
            a, b = torch_c.gather(layer, [s], n, torch.float64), kern_c.gather(layer, [s], n, torch.float64)
            torch.testing.assert_close(b[0], a[0], rtol=0, atol=0)
            torch.testing.assert_close(b[1], a[1], rtol=0, atol=0)
        if storage != "native":
            torch.testing.assert_close(kern_c.k_scale[layer], torch_c.k_scale[layer], rtol=0, atol=0)
    assert int(kern_c._count.abs().sum()) == 0
    kern_c._lengths[0][0] = -1
    kern_c.sync()  # the host mirror read back from the device
    assert kern_c.length(seqs[0], 0) == 10


def test_the_append_kernel_path_refuses_an_append_past_max_len_from_the_host_mirror():
    """The check reads the host mirror of the lengths (no device read per append) before any launch."""
    from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401

    cache = KVCache(1, 2, 1, 40, 16, dtype=torch.float32, page_size=16, append="triton")  # pages hold 48
    k = torch.randn(2, 1, 30, 16)
    cache.append(0, k, k)
    _raises("sequence 0 of layer 0 holds 30 tokens; 11 more would make 41, over max_len=40, the most this "
            "KVCache holds per sequence", cache.append, 0, k[:, :, :11], k[:, :, :11])
    assert cache.lengths.tolist() == [[30, 30]]
    cache.append(0, k[:, :, :10], k[:, :, :10])
    assert cache.lengths.tolist() == [[40, 40]] and cache.length(1) == 40


def test_explain_decode_lists_every_decode_runner_with_its_reasons():
    """The planner chooses decode runners as it does prefill ones: explain_decode shows each with its
    reasons, and plan_decode runs the one it names."""
    cache = KVCache(1, 2, 2, 64, 16, dtype=torch.float32)
    cache.append(0, torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16))
    choice = adaattn.explain_decode(cache, heads=4)
    reasons = dict(choice.reasons)
    assert set(reasons) == {"kv.sparse", "kv.triton", "kv.sdpa"}
    assert choice.runner == "kv.sdpa" and reasons["kv.sdpa"] == () and "on the CPU" in choice.why
    assert any("skipping" in r for r in reasons["kv.sparse"])
    plan = plan_decode(cache, heads=4)
    assert f"kv.{plan.runner}" == choice.runner and plan.why == choice.why
    # A query dtype the cache does not hold: the kernel says so, and naming it raises that reason.
    assert any("dtype" in r for r in dict(adaattn.explain_decode(cache, heads=4, dtype=torch.float16).reasons)["kv.triton"])
    with pytest.raises(ValueError, match="runner='triton' cannot take this call: the query's dtype"):
        plan_decode(cache, heads=4, dtype=torch.float16, runner="triton")
    # Planning for CUDA with lengths given (a cache on the meta device: facts only).
    meta = KVCache(1, 8, 8, 8193, 128, device="meta", summaries=True)
    cuda = adaattn.explain_decode(meta, heads=32, lengths=[8192] * 8, device="cuda",
                                  policy=adaattn.Policy(mode="auto", approximations=("skip",)))
    assert dict(cuda.reasons)["kv.sparse"] == () and cuda.runner == "kv.sparse" and "over kv.triton" in cuda.why
    small = adaattn.explain_decode(meta, heads=32, lengths=[64] * 8, device="cuda",
                                   policy=adaattn.Policy(mode="auto", approximations=("skip",)))
    assert small.runner == "kv.triton" and any("does not pay" in r for r in dict(small.reasons)["kv.sparse"])


def test_cli_explain_decode(capsys):
    from adaattn.cli import main

    assert main(["explain", "--decode", "--shape", "8,32,8192,128", "--kv-heads", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "runs: kv.sdpa" in out and "kv.triton" in out and "kv.sparse" in out
    assert main(["explain", "--decode", "--shape", "2,8,4096,64", "--kv-heads", "2", "--device", "cpu", "--cache",
                 "paged", "--summaries", "--mode", "auto", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "decode" and set(data["reasons"]) == {"kv.sparse", "kv.triton", "kv.sdpa"}
