"""Query-aware sparse decode (adaattn.kv.sparse): page summaries kept at append, bounds that bound,
the selection kernel against its torch reference, the sparse step against float64 on the pages it
keeps, and the tolerance held by the controller on keys and values of the 32k checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import decode_reference

from adaattn import Policy, stats
from adaattn import KVCache, PagedKVCache, decode_attention, plan_decode
from adaattn.kv import sparse

triton = pytest.importorskip("triton")

SKIP = Policy(mode="auto", approximations=("skip",), tolerance=5e-2)


def _stored_keys(cache, layer, seq):
    """(Hkv, N, D) float64 keys of `seq` as the decode kernel sees them (quantized keys
    dequantized, less the sequence's center)."""
    n = cache.length(seq, layer)
    k, _ = cache.gather(layer, [seq], n, torch.float64)
    k = k[0]
    if cache.storage != "native":
        k = k - cache.k_center[layer][seq].double()[:, None, :]
    return k


def _filled(cache_cls=PagedKVCache, storage="native", append="torch", seed=0, dtype=torch.float16):
    torch.manual_seed(seed)
    hkv, d = 2, 16
    cache = cache_cls(1, hkv, d, 16, 8, dtype=dtype, storage=storage, append=append, summaries=True, max_seqs=3)
    a, b = cache.add(), cache.add()
    for t, gain in ((5, 1.0), (1, 3.0), (7, 0.5), (1, 8.0), (20, 1.0)):  # mid-page starts, scale growth
        k = torch.randn(2, hkv, t, d) * gain
        cache.append(0, [a, b], k.to(dtype), torch.randn(2, hkv, t, d).to(dtype))
    return cache, (a, b)


@pytest.mark.parametrize("storage", ["native", "fp8", "int8", "int4"])
@pytest.mark.parametrize("append", ["torch", "triton"])
def test_page_summaries_are_the_stored_keys_sum_min_and_max(storage, append):
    """Both appends keep, per (page, KV head), the sum and per-channel min/max of the keys as
    stored (after quantization, rescaling of a page's earlier rows included)."""
    if append == "triton":
        from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401
    cache, seqs = _filled(storage=storage, append=append)
    p = cache.page_size
    for seq in seqs:
        k = _stored_keys(cache, 0, seq)  # (Hkv, N, D)
        n = k.shape[1]
        for i, page in enumerate(cache.pages_of(seq)[: -(-n // p)]):
            rows = k[:, i * p:(i + 1) * p]
            torch.testing.assert_close(cache.k_sum[0][page].double(), rows.sum(1), rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(cache.k_min[0][page].double(), rows.amin(1), rtol=0, atol=1e-6)
            torch.testing.assert_close(cache.k_max[0][page].double(), rows.amax(1), rtol=0, atol=1e-6)


def test_a_reused_page_starts_its_summaries_afresh():
    cache = PagedKVCache(1, 1, 8, 2, 4, dtype=torch.float32, summaries=True, max_seqs=2)
    a = cache.add()
    cache.append(0, [a], torch.full((1, 1, 4, 8), 100.0), torch.zeros(1, 1, 4, 8))
    cache.free(a)
    b = cache.add()
    cache.append(0, [b], torch.ones(1, 1, 2, 8), torch.zeros(1, 1, 2, 8))
    page = cache.pages_of(b)[0]
    assert cache.k_max[0][page].tolist() == [[1.0] * 8] and cache.k_sum[0][page].tolist() == [[2.0] * 8]


@pytest.mark.parametrize("storage", ["native", "fp8", "int8"])
def test_the_bounds_really_bound_every_key_score(storage):
    """No page's true largest score exceeds its min/max bound, and its centroid's score never
    exceeds it either (the centroid is the selection's lower bound)."""
    cache, seqs = _filled(storage=storage, seed=7)
    torch.manual_seed(8)
    p = cache.page_size
    for seq in seqs:
        k = _stored_keys(cache, 0, seq)
        n = k.shape[1]
        q = torch.randn(64, k.shape[-1], dtype=torch.float64) * 3
        for i, page in enumerate(cache.pages_of(seq)[: -(-n // p)]):
            rows = k[:, i * p:(i + 1) * p]  # (Hkv, r, D)
            for h in range(k.shape[0]):
                true_max = (q @ rows[h].T).amax(1)
                lo, hi = cache.k_min[0][page, h].double(), cache.k_max[0][page, h].double()
                bound = torch.maximum(q * lo, q * hi).sum(1)
                centroid = q @ (cache.k_sum[0][page, h].double() / rows.shape[1])
                assert (true_max <= bound + 1e-9).all()
                assert (centroid <= true_max + 1e-6).all()


def _structured(b=2, hkv=2, g=3, n=600, d=32, seed=0, dtype=torch.float32):
    """Keys with a few pages aligned with each query (as trained heads attend), the rest noise."""
    torch.manual_seed(seed)
    k = torch.randn(b, hkv, n, d)
    q = torch.randn(b, hkv * g, 1, d)
    for i in range(b):
        for h in range(hkv):
            for start in torch.randint(0, n - 16, (3,)).tolist():
                k[i, h, start:start + 16] += 0.6 * q[i, h * g:(h + 1) * g, 0].mean(0)
    return q.to(dtype), k.to(dtype), torch.randn(b, hkv, n, d).to(dtype)


def test_selection_kernel_matches_its_reference_and_keeps_sinks_and_the_newest_pages():
    from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401

    q, k, v = _structured()
    b, hkv, n, d = k.shape
    cache = KVCache(1, b, hkv, 1024, d, dtype=torch.float32, page_size=16, summaries=True)
    cache.append(0, k, v)
    plan = plan_decode(cache, heads=q.shape[1], runner="triton", policy=SKIP, sparse=True)
    npages = -(-n // 16)
    kept = []
    for theta in (0.0, 0.02, 0.2, 1.0):
        th = torch.full((b, hkv), theta)
        sel, count = sparse.select(q, cache, 0, plan, th, d ** -0.5, kernel=True)
        ref_sel, ref_count = sparse.select_reference(q, cache, 0, plan.seq_ids, th, d ** -0.5)
        assert count.tolist() == ref_count.tolist(), theta
        keep = sparse.kept_mask(sel, count, npages)
        assert keep.equal(sparse.kept_mask(ref_sel, ref_count, npages))
        for row in range(b * hkv):  # ascending, no repeats
            listed = sel[row, :int(count[row])]
            assert listed.tolist() == sorted(set(listed.tolist()))
        assert keep[:, :sparse.SINK_PAGES].all() and keep[:, npages - sparse.RECENT_PAGES:].all()
        shares = sparse.page_shares(q, cache, 0, plan.seq_ids, d ** -0.5).view(b * hkv, -1)
        dropped = torch.where(keep, torch.zeros_like(shares), shares).sum(1)
        assert (dropped <= theta + 1e-6).all(), (theta, dropped)
        if theta == 0.0:
            assert keep.all()
        kept.append(int(count.sum()))
    assert kept == sorted(kept, reverse=True) and kept[-1] < kept[0] / 2, kept  # a larger theta drops more


@pytest.mark.parametrize("storage,dtype", [("native", torch.bfloat16), ("native", torch.float16), ("fp8", torch.bfloat16),
                                           ("int4", torch.bfloat16)])
def test_the_sparse_step_matches_float64_on_the_pages_it_keeps(storage, dtype):
    """The split-KV kernel reading only the kept pages, against float64 attention restricted to
    them (GQA 3:1, a paged cache, ragged lengths, one and two query rows), within 2x SDPA's own
    error on the same keys (INT4: with a window of the newest 40 tokens, read from its ring)."""
    from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401

    q1, k, v = _structured(n=500, seed=2)
    hkv, d = k.shape[1], k.shape[3]
    cache = PagedKVCache(1, hkv, d, 80, 16, dtype=dtype, storage=storage, summaries=True, max_seqs=2,
                         window=40 if storage == "int4" else 0)
    seqs = [cache.add(), cache.add()]
    lens = (500, 230)
    for i, s in enumerate(seqs):
        cache.append(0, [s], k[i:i + 1, :, :lens[i]].to(dtype), v[i:i + 1, :, :lens[i]].to(dtype))
    for t in (1, 2):
        q = torch.cat([q1] * t, 2).to(dtype) + 0.1 * torch.randn(2, q1.shape[1], t, d).to(dtype)
        plan = plan_decode(cache, seqs, heads=q.shape[1], query_len=t, runner="triton", policy=SKIP, sparse=True,
                           splits=3)
        sel, count = sparse.select(q, cache, 0, plan, torch.full((2, hkv), 0.1), d ** -0.5, kernel=True)
        from adaattn.kv.decode import _split_kv

        out = _split_kv(q, cache, 0, plan, None, sel=sel, count=count)
        keep = sparse.kept_mask(sel, count, sel.shape[1]).view(2, hkv, -1)
        assert not keep.all()
        for i, s in enumerate(seqs):
            n = lens[i]
            k64, v64 = cache.gather(0, [s], n, torch.float64)
            tok = keep[i][:, torch.arange(n) // 16]  # (Hkv, N) keys on kept pages
            kk, vv = k64[0], v64[0]
            g = q.shape[1] // hkv
            scores = q[i].double() @ kk.repeat_interleave(g, 0).transpose(-1, -2) / math.sqrt(d)
            visible = torch.arange(n)[None, :] <= (n - t + torch.arange(t))[:, None]
            mask = visible[None] & tok.repeat_interleave(g, 0)[:, None, :]
            ref = torch.softmax(scores.masked_fill(~mask, -math.inf), -1) @ vv.repeat_interleave(g, 0)
            sdpa = torch.nn.functional.scaled_dot_product_attention(
                q[i], kk.to(dtype).repeat_interleave(g, 0), vv.to(dtype).repeat_interleave(g, 0), attn_mask=mask)
            bar = 2 * ((sdpa.double() - ref).norm() / ref.norm()).item() + 1e-6
            err = ((out[i].double() - ref).norm() / ref.norm()).item()
            assert err <= bar, (storage, t, i, err, bar)


def test_the_cpu_path_gives_the_kernels_result():
    from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401

    q, k, v = _structured(seed=4)
    cache = KVCache(1, 2, 2, 700, 32, dtype=torch.float32, page_size=16, summaries=True)
    cache.append(0, k, v)
    th = torch.tensor([[0.1, 0.02], [0.3, 0.05]])  # per (sequence, KV head)
    outs = []
    for runner in ("sdpa", "triton"):
        plan = plan_decode(cache, heads=6, runner=runner, policy=SKIP, sparse=True)
        sel, count = sparse.select(q, cache, 0, plan, th, 32 ** -0.5, kernel=runner == "triton")
        counts = count.view(2, 2)
        assert counts[1, 0] < counts[0, 0] and counts[0, 1] > counts[0, 0], counts  # each row its own threshold
        if runner == "triton":
            from adaattn.kv.decode import _split_kv

            outs.append(_split_kv(q, cache, 0, plan, None, sel=sel, count=count))
        else:
            outs.append(sparse.sparse_reference(q, cache, 0, plan.seq_ids, sel, count, 32 ** -0.5, [600, 600]))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)


def test_the_plan_says_why_sparse_decode_does_or_does_not_run():
    cache = KVCache(1, 1, 2, 256, 16, dtype=torch.float32, page_size=16)
    cache.append(0, torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16))
    no_skip = Policy(mode="auto", precisions=("native", "int8", "fp8"), approximations=("lowrank",))
    assert "does not allow skipping" in plan_decode(cache, heads=2, policy=no_skip).explain()
    assert "no page summaries" in plan_decode(cache, heads=2, policy=Policy(mode="auto")).explain()  # skip allowed
    assert "no page summaries" in plan_decode(cache, heads=2, policy=SKIP).explain()
    with pytest.raises(ValueError, match="sparse=True cannot run: the cache keeps no page summaries"):
        plan_decode(cache, heads=2, policy=SKIP, sparse=True)
    with pytest.raises(ValueError, match="sparse=True cannot run: the policy does not allow"):
        plan_decode(cache, heads=2, sparse=True)
    with pytest.raises(TypeError, match="policy must be an adaattn.Policy"):
        plan_decode(cache, heads=2, policy="auto")
    with pytest.raises(TypeError, match="sparse must be None, True, False or .always."):
        plan_decode(cache, heads=2, policy=SKIP, sparse=1)
    small = KVCache(1, 1, 2, 256, 16, dtype=torch.float32, page_size=16, summaries=True)
    small.append(0, torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16))
    plan = plan_decode(small, heads=2, policy=SKIP)
    assert not plan.sparse and "under 32 MiB" in plan.explain()
    assert plan_decode(small, heads=2, policy=SKIP, sparse=True).sparse
    assert plan_decode(small, heads=2).sparse_why == ""


def test_a_diffuse_site_runs_dense_and_every_verified_call_meets_the_tolerance():
    """Random K/V (no page stands out): verified calls give each head an output within the
    tolerance; after DENSE_AFTER verified calls that keep most pages, the site runs dense, and
    stats say so."""
    torch.manual_seed(11)
    cache = KVCache(1, 2, 2, 1200, 32, dtype=torch.float32, page_size=16, summaries=True)
    k, v = torch.randn(2, 2, 1024, 32), torch.randn(2, 2, 1024, 32)
    cache.append(0, k, v)
    policy = Policy(mode="auto", approximations=("skip",), tolerance=1e-2, verify=1.0)
    with stats.collect() as records:
        for step in range(6):
            kn, vn = torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32)
            cache.append(0, kn, vn)
            k, v = torch.cat([k, kn], 2), torch.cat([v, vn], 2)
            q = torch.randn(2, 4, 1, 32)
            plan = plan_decode(cache, heads=4, policy=policy, sparse=True)
            out = decode_attention(q, cache, 0, plan=plan)
            for i in range(2):
                ref = decode_reference(q[i], k[i], v[i])
                err = ((out[i].double() - ref).flatten(1).norm(dim=-1) / ref.flatten(1).norm(dim=-1)).max()
                assert err <= 1e-2, (step, i, float(err))
    modes = [r.decisions["sparse"] for r in records]
    assert modes[:sparse.DENSE_AFTER] == ["sparse"] * sparse.DENSE_AFTER and modes[-1] == "dense", modes
    assert records[-1].backend == "kv.sdpa" and "dense until call" in records[-1].decisions["sparse_why"]
    assert records[0].backend == "kv.sdpa.sparse" and len(records[0].as_dict()["decisions"]["pages_read"]) == 2
    with stats.collect() as always:  # sparse="always" runs the selection whatever the site decided
        decode_attention(q, cache, 0, plan=plan_decode(cache, heads=4, policy=policy, sparse="always"))
    assert always[-1].decisions["sparse"] == "sparse"
    with pytest.raises(TypeError, match="'always'"):
        plan_decode(cache, heads=4, policy=policy, sparse="yes")


@pytest.fixture(scope="module")
def checkpoint_kv():
    """Keys, values and queries of the 32k checkpoint's deepest layers on held-out text (4096
    tokens on the CPU, where a 32k forward would take a minute)."""
    from adaattn.models import pretrained
    from adaattn.models.capture import capture

    model = pretrained.load(pretrained.LONG_WEIGHTS)
    return capture(model, seq_len=4096, layers=[5, 7], dtype=torch.float32).layers


def test_the_tolerance_holds_on_the_32k_checkpoint_and_pages_are_skipped(checkpoint_kv):
    """Decode steps over the checkpoint's own keys and values (each step appends its token, then
    attends): a warm-up verifies every call, then calls run on the controller's thresholds alone.
    Verified steps are within the tolerance (a head over it gets the exact output), the unverified
    steps' mean error is within it, and deep layers skip pages. (A single unverified step can
    exceed it: the centroid estimate misses a page whose mass sits on one key; benchmarks/NOTES.md,
    sparse decode.)"""
    tau = 5e-2
    warm, steps = 12, 24
    for lc in checkpoint_kv:
        q, k, v = lc.q[0], lc.k[0], lc.v[0]  # (H, N, D)
        hkv, n, d = k.shape
        cache = KVCache(1, 1, hkv, n, d, dtype=torch.float32, page_size=64, summaries=True)
        n0 = n - warm - steps
        cache.append(0, k[None, :, :n0], v[None, :, :n0])
        errs, read = [], []
        for i in range(warm + steps):
            pos = n0 + i
            cache.append(0, k[None, :, pos:pos + 1], v[None, :, pos:pos + 1])
            policy = Policy(mode="auto", approximations=("skip",), tolerance=tau, verify=1.0 if i < warm else 0.0)
            plan = plan_decode(cache, heads=q.shape[0], policy=policy, sparse=True)
            qi = q[None, :, pos:pos + 1]
            out = decode_attention(qi, cache, 0, plan=plan)
            ref = decode_reference(qi[0], k[:, :pos + 1], v[:, :pos + 1])
            err = ((out[0].double() - ref).flatten(1).norm(dim=-1) / ref.flatten(1).norm(dim=-1)).max().item()
            site = cache._sparse_sites[0]
            if i < warm:
                assert err <= tau, (lc.layer, i, err)
            else:
                errs.append(err)
                sel, count = sparse.select_reference(qi, cache, 0, plan.seq_ids, site.theta, d ** -0.5)
                read.append(count.float().mean().item() / -(-(pos + 1) // 64))
        assert sum(errs) / len(errs) <= tau, (lc.layer, errs)
        if lc.layer == 7:
            assert sum(read) / len(read) < 0.9, (lc.layer, read)


def test_the_gpt_decodes_through_its_policy_and_a_cache_with_summaries():
    """GPT(policy=skip) over make_cache(summaries=True): each decode step's plan carries the
    model's policy and says what it decided (here dense: the K/V are small, and the CPU path
    reads every page anyway; the GPU run is bench --suite decode's generation case), and the logits are the
    dense decode's."""
    from adaattn.models.gpt import GPT, GPTConfig

    torch.manual_seed(5)
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64)).eval()
    tokens = torch.randint(0, 256, (2, 140))
    outs = {}
    for name, policy in (("dense", None), ("skip", Policy(mode="auto", approximations=("skip",), tolerance=1e-9))):
        model.set_attention("adaattn", None)
        cache = model.make_cache(2, 160, summaries=True)
        assert cache.summaries
        with torch.no_grad():
            model(tokens[:, :128], cache=cache)
            model.set_attention("adaattn", policy)
            start, plan = model._plan(tokens[:, 128:129], cache, torch.float32)
            assert plan.policy is policy and (policy is None) == (plan.sparse_why == "")
            assert policy is None or plan.sparse_why.startswith("dense: "), plan.sparse_why
            got = [model(tokens[:, i:i + 1], cache=cache)[0] for i in range(128, 140)]
        outs[name] = torch.cat(got, 1)
    torch.testing.assert_close(outs["skip"], outs["dense"], rtol=1e-5, atol=1e-5)


def test_the_decode_summary_sums_layers_and_bounds_by_the_oracle():
    """bench --suite decode's summary: the whole model is the sum of the layers' times, the oracle
    bound scales each layer's dense time by its oracle pages, and each bar is judged per layer
    on the selection itself (the sparse="always" rows)."""
    from adaattn.bench.suites import sparse_decode as sd

    rows = []
    for layer, (dense_ms, ms, pages, oracle, err, fixed) in enumerate([(1.0, 1.0, 1.0, 1.0, 0.0, 0.01),
                                                                        (1.0, 0.25, 0.2, 0.1, 0.04, 0.2)]):
        case = f"sparse decode, 32k checkpoint, layer {layer}"
        rows.append({"case": case, "layer": layer, "peer": "kv bf16", "ms": dense_ms})
        for tau in sd.TAUS:
            for suffix, t in (("", ms), (" always", ms * 1.2)):
                rows.append({"case": case, "layer": layer, "peer": f"kv bf16 sparse tau={tau:g}{suffix}", "ms": t,
                             "x_baseline_paired": dense_ms / t, "pages_read": pages, "oracle_pages": oracle,
                             "x_oracle": pages / oracle, "error_max": err, "fixed_budget_error_max": fixed})
    rows.append({"case": "sparse decode, random K/V", "workload": "random", "peer": "kv bf16 sparse tau=0.05",
                 "ms": 1.02, "x_baseline_paired": 1 / 1.02, "decisions_while_timed": {"dense": 9}})
    out, text = sd.summarize(rows)
    w = {e["tolerance"]: e for e in out["whole_model"]}[5e-2]
    assert w["x_dense"] == pytest.approx(2.0 / 1.25) and w["oracle_bound_x_dense"] == pytest.approx(2.0 / 1.1)
    assert w["x_dense_always"] == pytest.approx(2.0 / 1.5)
    layer1 = [e for e in out["layers"] if e["layer"] == 1 and e["tolerance"] == 5e-2][0]
    assert layer1["of_ideal"] == pytest.approx(0.8 / 1.2) and layer1["meets_oracle_1.5"] is False
    assert layer1["meets_tolerance"] is True and layer1["ours_lower_than_fixed_budget"] is True
    assert [e for e in out["layers"] if e["layer"] == 1 and e["tolerance"] == 1e-2][0]["meets_tolerance"] is False
    assert out["random"][0]["over_dense"] == pytest.approx(0.02) and "whole model" in text


class _Elapsed:
    """Stands in for a CUDA event: elapsed_time to the next one is fixed; query() says whether the
    GPU has reached it, synchronize() waits for it."""

    def __init__(self, ms, done=True):
        self.ms, self.done, self.waited = ms, done, False

    def elapsed_time(self, other):
        return other.ms - self.ms

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = self.done = True


def _timed(sparse_ms, exact_first=False):
    """The timing events of a verified call whose sparse step took sparse_ms and exact one 1 ms."""
    if exact_first:
        return (_Elapsed(0.0), _Elapsed(1.0), _Elapsed(1.0 + sparse_ms), True)
    return (_Elapsed(0.0), _Elapsed(sparse_ms), _Elapsed(sparse_ms + 1.0), False)


def test_a_site_whose_sparse_step_measured_slower_runs_dense():
    """On CUDA a verified call times its sparse step against the exact one (in either order);
    DENSE_AFTER verified calls in a row where sparse did not pay (over PAYS x the exact time) send
    the site dense, whatever the pages it kept, and it says why. A paying one keeps it sparse; a
    site's first call (it compiles) is not counted, nor a lone figure over OUTLIER x the exact time
    (a compile), but two such in a row are."""
    far = sparse.OUTLIER + 0.5
    cases = (((0.97, 0.97), 5, True), ((0.3, 0.3), 5, False), ((0.97, 0.97), 0, False), ((far, 0.97), 5, False),
             ((far, far, far), 5, True))
    for times, first, goes_dense in cases:
        site = sparse.SparseSite(2, 5e-2, torch.device("cpu"), slots=3)
        site.decisions["sparse"] = first
        for i, sparse_ms in enumerate(times):
            site._pending = (None, torch.tensor([0.4, 0.4]), _timed(sparse_ms, exact_first=i % 2 == 1))
            site._pending_call = first
            site.poll()
            site.decisions["sparse"] += 1
        assert site.measured == pytest.approx((times[-1], 1.0, 0.4))
        assert site.dense_now() is goes_dense, (times, first)
        if goes_dense and times[-1] == 0.97:
            assert "measured 0.970 ms against the dense step's 1.000 ms" in site.why_dense


def test_a_site_waits_for_its_verified_figures_once_max_lag_calls_have_gone_by():
    """A host far ahead of the GPU: the verified call's figures are applied without waiting when
    they are there, and waited for MAX_LAG calls after the oldest verified call not yet applied,
    even when later verified calls have replaced it in between."""
    site = sparse.SparseSite(2, 5e-2, torch.device("cpu"), slots=1)
    site.decisions["sparse"] = 10
    for step in range(sparse.MAX_LAG + 1):
        event = _Elapsed(0.0, done=False)
        if site._pending is None:
            site._pending_call = site.calls
        site._pending = (event, torch.tensor([0.3, 0.3]), None)  # as verify() leaves it, a new one each call
        site.decisions["sparse"] += 1
        site.poll()
        if step + 1 < sparse.MAX_LAG:
            assert site._pending is not None and not event.waited, step
        else:
            assert site._pending is None and event.waited and site.expected_pages == pytest.approx(0.3), step
            break


def test_thresholds_are_per_sequence_and_start_afresh_for_a_new_sequence():
    """Thresholds live per (sequence slot, KV head), indexed by the sequence's id, not by its place in
    the plan: a plan over seqs [2, 0] moves slots 2 and 0 and leaves slot 1 alone; the selection
    reads each row's own slot; a freed slot starts over."""
    torch.manual_seed(3)
    cache = PagedKVCache(1, 2, 16, num_pages=96, page_size=16, max_seqs=3, summaries=True)
    ids = [cache.add() for _ in range(3)]
    cache.free(ids[1])
    seqs = [ids[2], ids[0]]
    for s in seqs:
        cache.append(0, [s], torch.randn(1, 2, 200, 16), torch.randn(1, 2, 200, 16))
    policy = Policy(mode="auto", approximations=("skip",), tolerance=5e-2, verify=1.0)
    q = torch.randn(2, 4, 1, 16)
    for _ in range(3):
        decode_attention(q, cache, 0, seqs, plan=plan_decode(cache, seqs, heads=4, policy=policy, sparse=True))
    site = cache._sparse_sites[0]
    start = torch.full((2,), 0.5 * 5e-2)
    assert site.theta.shape == (3, 2) and torch.equal(site.theta[1], start)  # slot 1 holds no sequence here
    assert not torch.equal(site.theta[2], start) and not torch.equal(site.theta[0], start)
    plan = plan_decode(cache, seqs, heads=4, policy=policy, sparse=True)
    theta = torch.zeros(3, 2)
    theta[ids[0]] = 1.0  # sequence 0 may drop everything it estimates; sequence 2 nothing
    for kernel in (False, True):
        _, count = sparse.select(q, cache, 0, plan, theta, 16 ** -0.5, kernel)
        counts = count.view(2, 2)  # rows in the plan's order: seq 2, then seq 0
        assert (counts[0] == 13).all() and (counts[1] < 13).all(), (kernel, counts)
    with pytest.raises(ValueError, match="theta must be"):
        sparse.select(q, cache, 0, plan, torch.zeros(2), 16 ** -0.5, True)
    moved = site.theta[2].clone()
    cache.free(ids[0])
    assert torch.equal(site.theta[ids[0]], start) and torch.equal(site.theta[2], moved)


def test_sparse_split_kv_covers_every_listed_page_whatever_the_expected_pages():
    """The sparse split-KV's programs are sized from the site's expected pages; with every page
    listed (theta 0) and the smallest expected fraction, on a ragged paged batch with two query
    rows each, its output is the CPU path's."""
    from helpers import NEEDS_CUDA_OR_INTERPRETER  # noqa: F401

    from adaattn.kv.decode import _split_kv

    torch.manual_seed(8)
    cache = PagedKVCache(1, 2, 32, num_pages=96, page_size=16, max_seqs=3, summaries=True)
    seqs = [cache.add() for _ in range(3)]
    lengths = [500, 130, 333]
    for s, n in zip(seqs, lengths):
        cache.append(0, [s], torch.randn(1, 2, n, 32), torch.randn(1, 2, n, 32))
    q = torch.randn(3, 6, 2, 32)
    plan = plan_decode(cache, seqs, heads=6, query_len=2, runner="triton", policy=SKIP, sparse=True)
    theta = torch.zeros(3, 2)
    sel, count = sparse.select(q, cache, 0, plan, theta, 32 ** -0.5, kernel=True)
    for pages in (0.05, 0.4, 1.0):
        got = _split_kv(q, cache, 0, plan, None, sel=sel, count=count, pages=pages)
        ref = sparse.sparse_reference(q, cache, 0, plan.seq_ids, sel, count, 32 ** -0.5, lengths)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)