"""Per-head KV storage errors (adaattn.kv.storage_errors) and the choice under a tolerance
(choose_storages), on the CPU."""

from __future__ import annotations

import pytest
import torch

from adaattn.kv import choose_storages, storage_errors


def _kv(b=2, h=4, n=200, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
    q = torch.randn(b, 2 * h, 3, d, generator=g)
    return q, k, v


def test_a_smooth_head_goes_to_int4_and_a_head_with_outliers_stays_higher():
    q, k, v = _kv()
    # Head 1: an outlier channel in every group of 16 of its keys and values (each token's groups
    # spend their 16 levels on it; the page's one INT8 scale too)
    k[:, 1, :, 3::16] *= 40
    v[:, 1, :, 5::16] *= 40
    errors = storage_errors(k, v, q, storages=("int4", "fp8", "int8"))
    assert errors["int4"][1] > 3 * errors["int4"][0] and errors["int8"][1] > 3 * errors["int8"][0]
    assert choose_storages(errors, 0.3) == ["int4", "int8", "int4", "int4"]
    assert choose_storages(errors, 0.1) == ["int4", "int8", "int4", "int4"]
    assert choose_storages(errors, 0.05) == ["int8", "native", "int8", "int8"]  # equal bytes: the lower error
    assert choose_storages({"fp8": errors["fp8"], "int8": errors["int8"] + 0.03}, 0.05) == ["fp8", "native", "fp8",
                                                                                           "fp8"]
    assert choose_storages(errors, 0.03) == ["int8", "native", "int8", "int8"]
    assert choose_storages(errors, 1e-4) == ["native"] * 4


def test_errors_are_per_kv_head_over_its_query_group_and_native_float32_is_exact():
    q, k, v = _kv(h=3, n=130, d=32, seed=1)
    whole = storage_errors(k, v, q, storages=("native", "int8", "int4"), page_size=16)
    assert float(whole["native"].max()) < 1e-12  # float32 keys are stored as they are
    for h in range(3):
        one = storage_errors(k[:, h:h + 1], v[:, h:h + 1], q[:, 2 * h:2 * h + 2], storages=("int8", "int4"),
                             page_size=16)
        for s in ("int8", "int4"):
            assert one[s][0].item() == pytest.approx(whole[s][h].item(), rel=1e-9)
    assert bool((whole["int8"] < whole["int4"]).all()) and bool((whole["int4"] > 0.05).all())


def test_errors_measure_the_cache_s_own_quantization():
    """The error of a head is what decode over a cache of that storage gives against the same
    decode over the unquantized keys: the cache's own append and read-back, not a model of it."""
    from adaattn.kv import KVCache

    q, k, v = _kv(b=1, h=2, n=96, d=32, seed=2)
    e = storage_errors(k, v, q, storages=("fp8",), page_size=32)["fp8"]
    cache = KVCache(1, 1, 2, 96, 32, dtype=torch.float32, storage="fp8", page_size=32, append="torch")
    cache.append(0, k, v)
    ks, vs = cache.gather(0, [0], 96)
    qd = q.double()

    def attend(kk, vv):
        kk, vv = (t.double().repeat_interleave(2, 1) for t in (kk, vv))
        return torch.softmax(qd @ kk.transpose(-1, -2) * 32 ** -0.5, -1) @ vv

    o, o_q = attend(k, v), attend(ks, vs)
    for h in range(2):
        rows = slice(2 * h, 2 * h + 2)
        want = ((o_q[:, rows] - o[:, rows]).norm() / o[:, rows].norm()).item()
        assert e[h].item() == pytest.approx(want, rel=1e-5)


def test_without_queries_the_keys_stand_in_and_bad_arguments_raise():
    _, k, v = _kv(h=2, n=80)
    proxy = storage_errors(k, v, storages=("int4",), proxy_rows=16)
    assert proxy["int4"].shape == (2,) and bool((proxy["int4"] > 0).all())
    with pytest.raises(ValueError, match="storages"):
        storage_errors(k, v, storages=("int2",))
    with pytest.raises(ValueError, match="query"):
        storage_errors(k, v, torch.randn(2, 3, 1, 64))
    with pytest.raises(ValueError, match="tolerance"):
        choose_storages(proxy, -1.0)
    with pytest.raises(ValueError, match="no token"):
        storage_errors(k[:, :, :0], v[:, :, :0])


@pytest.mark.parametrize("storage,window,append", [("native", 0, "torch"), ("fp8", 0, "torch"), ("int8", 0, "torch"),
                                                   ("int4", 0, "torch"), ("int4", 24, "torch"), ("int4", 24, "triton")])
def test_the_measured_values_are_the_caches_own_bit_for_bit(storage, window, append):
    """formats.stored_values (what the choice measures on) against a cache's append of a prompt
    and its gather: ragged lengths past a page, bf16, keys centred."""
    if append == "triton":
        from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401
    from adaattn.kv import KVCache
    from adaattn.kv.formats import stored_values

    g = torch.Generator().manual_seed(9)
    k = (torch.randn(2, 3, 70, 32, generator=g) * 2 + 0.5).bfloat16()
    v = torch.randn(2, 3, 70, 16, generator=g).bfloat16()
    cache = KVCache(1, 2, 3, 80, 32, value_dim=16, dtype=torch.bfloat16, storage=storage, page_size=16, append=append,
                    window=window)
    cache.append(0, k, v)
    got_k, got_v = cache.gather(0, [0, 1], 70, dtype=torch.float32)
    assert torch.equal(got_k, stored_values(k, storage, torch.bfloat16, 16, centre=True, window=window))
    assert torch.equal(got_v, stored_values(v, storage, torch.bfloat16, 16, window=window))
