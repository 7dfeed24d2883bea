"""A storage per KV head (kv/mixed.py): explicit per-head storages read in one launch of the
split-KV kernel (under the interpreter) against float64 attention on the cache's own values, each
head holding what a cache of its storage holds, and storage="auto" choosing per head from the
error measured at a layer's first decode step."""

from __future__ import annotations

import pytest
import torch

import adaattn
from adaattn.backends.reference import reference_attention, relative_errors
from adaattn.kv import KVCache, PagedKVCache

ROWS = [["int4", "int8", "native", "int4"], ["native", "native", "int8", "int8"]]


def _kv(s, hkv, n, d, seed):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(s, hkv, n, d, generator=g) * 2 + 0.3).half()
    v = torch.randn(s, hkv, n, d, generator=g).half()
    return k, v


def _filled(kind, storage, lens, hkv=4, d=32, seed=0, **kw):
    k, v = _kv(len(lens), hkv, max(lens), d, seed)
    if kind == "paged":
        cache = PagedKVCache(2, hkv, d, 64, 16, dtype=torch.float16, storage=storage, max_seqs=len(lens) + 1, **kw)
        dropped = cache.add()  # a sequence added, filled and freed first: its pages and lengths are reused
        cache.append(0, [dropped], k[:1, :, :40], v[:1, :, :40])
        cache.free(dropped)
        seqs = [cache.add() for _ in lens]
    else:
        cache = KVCache(2, len(lens), hkv, max(lens) + 8, d, dtype=torch.float16, storage=storage, page_size=16, **kw)
        seqs = list(range(len(lens)))
    for layer in range(2):
        for i, (s, n) in enumerate(zip(seqs, lens)):
            for lo, hi in ((0, n - 5), (n - 5, n)):  # a prompt, then a few tokens at a time
                if kind == "paged":
                    cache.append(layer, [s], k[i:i + 1, :, lo:hi], v[i:i + 1, :, lo:hi])
                else:
                    cache.append(layer, k[i:i + 1, :, lo:hi], v[i:i + 1, :, lo:hi], seqs=[s])
    return cache, seqs, k, v


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_each_head_holds_what_a_cache_of_its_storage_holds(kind):
    lens = [70, 33]
    cache, seqs, k, v = _filled(kind, ROWS, lens, window=16)
    for layer, row in enumerate(ROWS):
        got_k, got_v = cache.gather(layer, seqs, max(lens), torch.float64)
        for h, storage in enumerate(row):
            one = KVCache(1, len(lens), 1, max(lens) + 8, 32, dtype=torch.float16, storage=storage, page_size=16,
                          window=16 if storage == "int4" else 0)
            for i, n in enumerate(lens):
                for lo, hi in ((0, n - 5), (n - 5, n)):
                    one.append(0, k[i:i + 1, h:h + 1, lo:hi], v[i:i + 1, h:h + 1, lo:hi], seqs=[i])
            want_k, want_v = one.gather(0, list(range(len(lens))), max(lens), torch.float64)
            for i, n in enumerate(lens):
                assert torch.equal(got_k[i, h, :n], want_k[i, 0, :n]), (layer, h, storage)
                assert torch.equal(got_v[i, h, :n], want_v[i, 0, :n]), (layer, h, storage)


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("runner", ["triton", "sdpa"])
def test_one_launch_reads_heads_of_every_storage(kind, t, runner):
    """GQA 2:1, ragged lengths, INT4 with a window: the kernel against float64 on the values the
    cache holds; the plan and the stats say what each head holds."""
    if runner == "triton":
        from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401
    lens = [70, 33]
    cache, seqs, _, _ = _filled(kind, ROWS, lens, window=16)
    q = torch.randn(len(lens), 8, t, 32, generator=torch.Generator().manual_seed(5)).half()
    for layer in (0, 1):
        with adaattn.stats.collect() as records:
            out = adaattn.decode_attention(q, cache, layer, seqs=seqs, runner=runner,
                                           **({"splits": 2} if runner == "triton" else {}))
        assert records[-1].backend == f"kv.{runner}"
        assert records[-1].decisions["head_storages"] == cache.storages(layer)
        k64, v64 = cache.gather(layer, seqs, max(lens), torch.float64)
        for i, n in enumerate(lens):
            want = reference_attention(q[i:i + 1].double(), k64[i:i + 1, :, :n], v64[i:i + 1, :, :n], None, True,
                                       None, None, bottom_right=True)
            assert relative_errors(out[i:i + 1], want).item() < 2e-3, (layer, i)
    plan = adaattn.plan_decode(cache, seqs, heads=8, query_len=t)
    assert "storage per head: layer 0: native 1, int8 1, int4 2 of 4 heads" in plan.explain()


def _outlier_head():
    """Two sequences of 200 tokens, 3 KV heads of dim 64: head 1 carries an outlier channel in
    every group of 16; 6 query heads, one row each."""
    k, v = _kv(2, 3, 200, 64, seed=3)
    k[:, 1, :, 5::16] *= 20
    v[:, 1, :, 7::16] *= 20
    return k, v, (0.3 * torch.randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(4))).half()


def test_auto_puts_a_smooth_head_in_int4_and_keeps_an_outlier_head_higher():
    """storage='auto': the prompt waits in the model dtype; the layer's first decode step chooses,
    per head, the storage of fewest bytes whose error on its queries is within the tolerance (head
    1 carries an outlier channel in every group), and moves the tokens there; a layer whose first
    step meets too few tokens keeps the model dtype."""
    from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401

    k, v, q = _outlier_head()
    cache = PagedKVCache(2, 3, 64, 64, 16, dtype=torch.float16, storage="auto", tolerance=0.12, max_seqs=3)
    s = [cache.add(), cache.add()]
    assert "nothing held yet" in cache.storages(0)
    for layer, n in ((0, 200), (1, 20)):
        cache.append(layer, s, k[:, :, :n], v[:, :, :n])
    assert "pending" in cache.storages(0)
    before = cache.gather(0, s, 200, torch.float64)
    assert torch.equal(before[0], k.double()) and torch.equal(before[1], v.double())  # held as they came
    with adaattn.stats.collect() as records:
        out = adaattn.decode_attention(q, cache, 0, seqs=s, runner="triton")
    assert cache._mixed[0].storages == ("int4", "int8", "int4")
    assert "measured int4 [" in records[-1].decisions["head_storages"] and "first decode step" in cache.storages(0)
    errors = cache._mixed[0].errors
    assert float(errors["int4"][1]) > 0.12 >= float(errors["int4"][0]) and float(errors["int8"][1]) <= 0.12
    # every token moved: what the layer holds now is what caches of the chosen storages hold
    k64, v64 = cache.gather(0, s, 200, torch.float64)
    want = reference_attention(q.double(), k64, v64, None, True, None, None, bottom_right=True)
    assert relative_errors(out, want).item() < 2e-3
    assert relative_errors(out, reference_attention(q.double(), k.double(), v.double(), None, True, None, None,
                                                    bottom_right=True)).item() < 0.12
    here = cache._mixed[0].parts  # the pools hold each storage's bytes only: two INT4 heads, one INT8 head
    assert here["int4"][1].k[0].shape == (64, 16, 2, 32) and here["int8"][1].k[0].shape == (64, 16, 1, 64)
    adaattn.decode_attention(q, cache, 1, seqs=s, runner="triton")
    assert cache._mixed[1].storages == ("native",) * 3 and "fewer than 64" in cache.storages(1)
    cache.append(0, s, k[:, :, :1], v[:, :, :1])  # later appends go to the chosen storages
    assert cache.length(s[0], 0) == 201 and cache._mixed[0].parts["int4"][1].length(s[0]) == 201


def test_auto_leaves_out_a_storage_whose_decode_kernel_measured_slower_than_the_model_dtype(monkeypatch):
    """On CUDA, INT4's split-KV kernel measured 1.9x the model dtype's time (H200): "auto" does not
    choose it there, and says so; the heads the CPU would put in INT4 take INT8 where it is within
    the tolerance. Measured here as a CUDA device would (slower_than_exact patched)."""
    from adaattn.kv import mixed

    assert mixed.slower_than_exact("cuda") == ["int4"] and mixed.slower_than_exact("cpu") == []
    monkeypatch.setattr(mixed, "slower_than_exact", lambda device_type: ["int4"])
    k, v, q = _outlier_head()
    cache = PagedKVCache(1, 3, 64, 64, 16, dtype=torch.float16, storage="auto", tolerance=0.12, max_seqs=3)
    s = [cache.add(), cache.add()]
    cache.append(0, s, k, v)
    out = adaattn.decode_attention(q, cache, 0, seqs=s, runner="sdpa")
    assert cache._mixed[0].storages == ("int8",) * 3
    assert "int4" not in cache._mixed[0].errors and "int4 no candidate on cpu" in cache.storages(0)
    assert relative_errors(out, reference_attention(q.double(), k.double(), v.double(), None, True, None, None,
                                                    bottom_right=True)).item() < 0.12
    cache = PagedKVCache(1, 3, 63, 64, 16, dtype=torch.float16, storage="auto", tolerance=0.12, max_seqs=3)
    monkeypatch.setattr(mixed, "slower_than_exact", lambda device_type: ["int4", "int8"])
    s = [cache.add()]
    cache.append(0, s, k[:1, :, :, :63], v[:1, :, :, :63])
    adaattn.decode_attention(q[:1, :, :, :63], cache, 0, seqs=s, runner="sdpa")
    assert cache._mixed[0].storages == ("native",) * 3  # no candidate left: the model dtype


def test_per_head_storages_are_checked_and_sized_by_bytes():
    with pytest.raises(ValueError, match="storage per head must be 2 layer"):
        PagedKVCache(2, 4, 32, 8, storage=[["int4"] * 4])
    with pytest.raises(ValueError, match="a head's storage must be one of"):
        PagedKVCache(1, 2, 32, 8, storage=[["int4", "fp8"]])
    with pytest.raises(ValueError, match="give tolerance > 0"):
        PagedKVCache(1, 2, 32, 8, storage="auto")
    with pytest.raises(ValueError, match="summaries"):
        PagedKVCache(1, 2, 32, 8, storage="auto", tolerance=0.05, summaries=True)
    with pytest.raises(ValueError, match="tolerance=0.05 is storage='auto''s"):
        PagedKVCache(1, 2, 32, 8, storage="int8", tolerance=0.05)
    with pytest.raises(ValueError, match="holds none"):
        PagedKVCache(1, 2, 32, 8, storage=[["int8", "native"]], window=16)
    with pytest.raises(ValueError, match="group_size=32 sets INT4's channels"):
        PagedKVCache(1, 2, 32, 8, storage="int8", group_size=32)
    with pytest.raises(ValueError, match="a list per layer of one name per KV head"):
        PagedKVCache(1, 2, 32, 8, storage=["int4", "int8"])
    odd = PagedKVCache(1, 2, 15, 8, storage=[["int8", "native"]])  # no INT4 head: odd head dims are fine
    assert odd.storages(0).startswith("native 1, int8 1")
    with pytest.raises(ValueError, match="for_budget needs the storages"):
        PagedKVCache.for_budget(2**20, 1, 2, 32, storage="auto", tolerance=0.05)
    budget = 64 * 2**20
    rows = [["int4", "int8"], ["native", "int4"]]
    per_page = sum(PagedKVCache.page_bytes(1, 128, 64, storage=x) for row in rows for x in row)
    cache = PagedKVCache.for_budget(budget, 2, 2, 128, 64, storage=rows, device="meta", max_seqs=2)
    assert cache.num_pages == budget // per_page and cache.storages(1).startswith("native 1, int4 1 of 2")


@pytest.mark.parametrize("storage,layout", [("int8", {}), ("int4", dict(window=16)), ("native", {})])
def test_a_layer_whose_heads_all_hold_one_storage_decodes_as_a_cache_of_that_storage(storage, layout):
    """A mixed layer with every head in one storage runs that storage's own kernel path: its output
    equals, bit for bit, a cache of that storage holding the same tokens (the MIXED branch reads
    INT8 through fp32 and would differ); a layer of two storages still reads through the branch."""
    from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401
    from adaattn.kv import mixed

    k, v = _kv(2, 4, 90, 32, seed=5)
    q = torch.randn(2, 8, 1, 32, generator=torch.Generator().manual_seed(6)).half()
    rows = [[storage] * 4, ["int8", "int8", "native", "native"]]
    per_head = PagedKVCache(2, 4, 32, 32, 16, dtype=torch.float16, storage=rows, max_seqs=2, **layout)
    plain = PagedKVCache(1, 4, 32, 32, 16, dtype=torch.float16, storage=storage, max_seqs=2, **layout)
    s, p = [per_head.add(), per_head.add()], [plain.add(), plain.add()]
    for layer in range(2):
        per_head.append(layer, s, k, v)
    plain.append(0, p, k, v)
    assert mixed.uniform_part(per_head, 0) is not None and mixed.uniform_part(per_head, 1) is None
    got = adaattn.decode_attention(q, per_head, 0, seqs=s, runner="triton")
    want = adaattn.decode_attention(q, plain, 0, seqs=p, runner="triton")
    assert torch.equal(got, want)
    two = adaattn.decode_attention(q, per_head, 1, seqs=s, runner="triton")
    k64, v64 = per_head.gather(1, s, 90, torch.float64)
    ref = reference_attention(q.double(), k64, v64, None, True, None, None, bottom_right=True)
    assert relative_errors(two, ref).item() < 2e-3
