"""KV caches and decode on a CUDA GPU: the one-launch append against the torch append, the split-KV
kernel against float64, and a decode step (appends and attention of every layer) captured once in
a CUDA graph and replayed as the sequences grow."""

from __future__ import annotations


import pytest
import torch
from helpers import decode_reference

from adaattn import KVCache, PagedKVCache, decode_attention, plan_decode

pytestmark = pytest.mark.gpu


_reference = decode_reference


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("storage", ["native", "fp8", "int8"])
def test_append_kernel_matches_torch_append_on_cuda(storage):
    torch.manual_seed(0)
    hkv, d = 8, 128
    caches = [PagedKVCache(1, hkv, d, 64, 64, device="cuda", storage=storage, max_seqs=4, append=a)
              for a in ("torch", "triton")]
    for c in caches:
        [c.add() for _ in range(4)]
    for t, gain in ((100, 1.0), (1, 6.0), (37, 0.3), (1, 1.0)):
        k = torch.randn(4, hkv, t, d, device="cuda", dtype=torch.bfloat16) * gain
        v = torch.randn(4, hkv, t, d, device="cuda", dtype=torch.bfloat16)
        for c in caches:
            c.append(0, range(4), k, v)
    a, b = caches
    assert a.lengths.tolist() == b.lengths.tolist()
    if storage != "native":  # torch divides by a scalar through its reciprocal on CUDA: scales may differ by an ulp
        torch.testing.assert_close(b.k_scale[0], a.k_scale[0], rtol=1e-6, atol=0)
    for s in range(4):
        n = a.length(s)
        for x, y in zip(a.gather(0, [s], n, torch.float64), b.gather(0, [s], n, torch.float64)):
            if storage == "native":
                torch.testing.assert_close(y, x, rtol=0, atol=0)
            else:  # at most one step of the storage format apart (a page whose scale differs by an ulp differs
                # in every value by that ulp, so equality is not the test)
                unit = 1.01 * max(a.k_scale[0].max().item(), a.v_scale[0].max().item())  # one int8 step at most
                step = x.abs() / 8 + unit / 64 if storage == "fp8" else torch.full_like(x, unit)
                assert ((y - x).abs() <= step).all()
                assert ((y - x).abs() > x.abs() * 1e-6).double().mean().item() < 0.01  # whole steps: rare


@pytest.mark.parametrize("storage", ["native", "fp8"])
def test_decode_step_replays_in_a_cuda_graph_as_sequences_grow(storage):
    """Append (every layer) and attention captured once; ten replays grow the sequences by ten
    tokens. Each replay's output equals the eager call's on the same cache state, and stays within
    the float64 bar (native) or the quantized bar."""
    torch.manual_seed(1)
    layers, b, hq, hkv, d, prompt, steps = 2, 3, 8, 2, 64, 200, 10
    cache = KVCache(layers, b, hkv, prompt + steps + 1, d, device="cuda", storage=storage, page_size=64)
    hist = [[torch.randn(b, hkv, prompt, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            for _ in range(layers)]
    for layer in range(layers):
        cache.append(layer, *hist[layer])
    plan = plan_decode(cache, heads=hq, max_len=prompt + steps + 1)
    static_q = torch.zeros(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    static_k = torch.zeros(layers, b, hkv, 1, d, device="cuda", dtype=torch.bfloat16)
    static_v = torch.zeros_like(static_k)

    def step():
        outs = []
        for layer in range(layers):
            cache.append(layer, static_k[layer], static_v[layer])
            outs.append(decode_attention(static_q, cache, layer, plan=plan))
        return outs

    step()  # compile, and one real step (the captured one below starts from prompt + 1)
    for layer in range(layers):
        for i, x in enumerate((static_k, static_v)):
            hist[layer][i] = torch.cat([hist[layer][i], x[layer]], 2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    cache.sync()  # capture ran the host side once but advanced nothing on the device
    for _ in range(steps - 1):
        static_q.copy_(torch.randn_like(static_q))
        static_k.copy_(torch.randn_like(static_k))
        static_v.copy_(torch.randn_like(static_v))
        graph.replay()
        torch.cuda.synchronize()
        cache.sync()
        for layer in range(layers):
            for i, x in enumerate((static_k, static_v)):
                hist[layer][i] = torch.cat([hist[layer][i], x[layer]], 2)
            n = hist[layer][0].shape[2]
            assert cache.length(0, layer) == n
            eager = decode_attention(static_q, cache, layer, plan=plan)
            torch.testing.assert_close(outs[layer], eager, rtol=0, atol=0)
            for s in range(b):
                ref = _reference(static_q[s], hist[layer][0][s], hist[layer][1][s])
                bar = 1e-2 if storage == "native" else 1e-1  # fp8: E4M3 rounding of K and V, ~4e-2 typical
                assert _rel(outs[layer][s], ref) <= bar


def _first_divergences_are_near_ties(model, got, want, prompt_len):
    """Where `got` first differs from `want` in each row, the full forward's logits on `want`'s
    prefix (bf16) must put the top two within two bf16 ulps: a tie that two correct kernels may
    round either way. Returns the fraction of generated tokens (after prompt_len) that are equal."""
    for r in range(len(want)):
        bad = (got[r] != want[r]).nonzero()
        if len(bad):
            p = int(bad[0])
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                top = model(want[r:r + 1, :p])[0][0, -1].float().topk(2).values
            assert top[0] - top[1] <= 2 * 2.0 ** (torch.floor(torch.log2(top[0].abs())) - 7), (r, p, top)
    return (got[:, prompt_len:] == want[:, prompt_len:]).float().mean().item()


def test_shipped_gpt_greedy_tokens_through_the_cache_equal_sdpa_and_fp8_bits_per_byte_stay_within_a_tenth_percent():
    from adaattn.models import DEFAULT_WEIGHTS, load
    from adaattn.models.evaluate import heldout_windows, score_windows

    if not DEFAULT_WEIGHTS.is_file():
        pytest.skip(f"no shipped weights at {DEFAULT_WEIGHTS}")
    model = load(None, "cuda")
    prompts = heldout_windows(512, 8)[:, :512].cuda()
    model.set_attention("sdpa")
    want = model.generate(prompts, 64)  # torch SDPA over the same bf16 cache (decode runner "sdpa")
    recomputed = model.generate(prompts, 64, use_cache=False)  # SDPA over the whole sequence every step
    model.set_attention("adaattn")
    got = model.generate(prompts, 64)  # the split-KV decode kernel
    # Greedy bf16 decoding meets near-ties (top two logits an ulp apart) in these prompts; two
    # correct kernels may round one either way, and the rows go different ways from there.
    equal = _first_divergences_are_near_ties(model, got, want, 512)
    equal_recomputed = _first_divergences_are_near_ties(model, got, recomputed, 512)
    print(f"greedy tokens equal: adaattn Cache vs SDPA over the cache {equal:.4f}, vs SDPA recomputing {equal_recomputed:.4f}")
    assert equal >= 0.9
    wins = heldout_windows(8192, 8)
    exact = score_windows(model, wins)["bits_per_byte"]
    fp8 = score_windows(model, wins, kv_cache="fp8")["bits_per_byte"]
    native = score_windows(model, wins, kv_cache="native")["bits_per_byte"]
    print(f"bits per byte at 8192: forward {exact:.5f}, bf16 cache {native:.5f}, fp8 cache {fp8:.5f} "
          f"({100 * (fp8 / exact - 1):+.3f}%)")
    assert abs(native / exact - 1) < 1e-3
    assert abs(fp8 / exact - 1) <= 1e-3


@pytest.mark.parametrize("storage", ["native", "fp8"])
def test_sparse_decode_on_cuda_matches_its_reference_and_replays_in_a_cuda_graph(storage):
    """Sparse decode (kv/sparse.py) on the GPU: summaries kept by the append kernel equal the torch
    append's; the selection kernel keeps the reference's pages; the sparse step equals the CPU path's
    masked SDPA over the same pages; a captured step (selection, kernel, merge) replays as the
    sequences grow, reading the thresholds on the device."""
    from adaattn import Policy
    from adaattn.kv import sparse
    from adaattn.kv.decode import _split_kv

    torch.manual_seed(2)
    b, hkv, g, d, n = 3, 4, 4, 128, 3000
    k = torch.randn(b, hkv, n + 8, d, device="cuda")
    q = torch.randn(b, hkv * g, 1, d, device="cuda")
    for i in range(b):
        for h in range(hkv):
            for start in torch.randint(0, n - 64, (4,)).tolist():
                k[i, h, start:start + 32] += 0.3 * q[i, h * g:(h + 1) * g, 0].mean(0)
    k, v = k.bfloat16(), torch.randn(b, hkv, n + 8, d, device="cuda", dtype=torch.bfloat16)
    q = q.bfloat16()
    caches = [KVCache(1, b, hkv, n + 8, d, device="cuda", storage=storage, summaries=True, append=a)
              for a in ("torch", "triton")]
    for c in caches:
        c.append(0, k[:, :, :n], v[:, :, :n])
    cache = caches[1]
    if storage == "native":
        torch.testing.assert_close(cache.k_sum[0], caches[0].k_sum[0], rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(cache.k_max[0], caches[0].k_max[0], rtol=0, atol=0)
    # (quantized: the torch append's scales may differ by an ulp, see above; each cache's summaries
    # are checked against its own stored keys)
    stored, _ = cache.gather(0, range(b), n, torch.float32)
    if storage != "native":
        stored = stored - cache.k_center[0][:b, :, None, :]
    full = n // 64  # the sequences' full pages
    blocks = stored[:, :, :full * 64].reshape(b, hkv, full, 64, d)
    for i in range(b):
        phys = cache.block_table[i, :full].long()
        torch.testing.assert_close(cache.k_max[0][phys].transpose(0, 1), blocks[i].amax(2), rtol=0, atol=1e-6)
        torch.testing.assert_close(cache.k_sum[0][phys].transpose(0, 1), blocks[i].sum(2), rtol=1e-4, atol=1e-3)
    policy = Policy(mode="auto", approximations=("skip",), tolerance=5e-2, verify=0.0)
    plan = plan_decode(cache, heads=hkv * g, policy=policy, sparse=True, max_len=n + 8)
    th = torch.full((b, hkv), 0.3, device="cuda")
    sel, count = sparse.select(q, cache, 0, plan, th, d ** -0.5, kernel=True)
    ref_sel, ref_count = sparse.select_reference(q, cache, 0, plan.seq_ids, th, d ** -0.5)
    maxp = -(-n // 64)
    agree = (sparse.kept_mask(sel, count, maxp) == sparse.kept_mask(ref_sel, ref_count, maxp)).float().mean()
    assert agree > 0.99 and int(count.sum()) < 0.8 * b * hkv * maxp, (float(agree), count.tolist())
    out = _split_kv(q, cache, 0, plan, None, sel=sel, count=count)
    ref = sparse.sparse_reference(q, cache, 0, plan.seq_ids, sel, count, d ** -0.5, [n] * b)
    assert _rel(out, ref.double()) < 1e-2
    # capture a whole step (append + selection + sparse decode) and replay as the sequences grow
    decode_attention(q, cache, 0, plan=plan)  # compile, and the site's first (unverified here) call
    static_k, static_v = k[:, :, n:n + 1].clone(), v[:, :, n:n + 1].clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache.append(0, static_k, static_v)
        out = decode_attention(q, cache, 0, plan=plan)
    cache.sync()  # capture ran the host side once but advanced nothing on the device
    for step in range(4):
        static_k.copy_(k[:, :, n + step:n + step + 1])
        static_v.copy_(v[:, :, n + step:n + step + 1])
        graph.replay()
        torch.cuda.synchronize()
        cache.sync()
        m = n + step + 1
        assert cache.length(0) == m
        eager = decode_attention(q, cache, 0, plan=plan)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        for i in range(b):
            exact = _reference(q[i], k[i, :, :m], v[i, :, :m])
            assert _rel(out[i], exact) < 0.15, (step, i)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("window", [0, 16])
def test_int4_pages_decode_on_the_gpu_as_float64_on_the_caches_values(kind, t, window):
    """INT4 pages (with and without a window) through the split-KV kernel on CUDA (the interpreter
    checks it in CI)."""
    import test_kv_int4

    test_kv_int4.test_int4_decode_matches_float64_on_the_caches_own_values(kind, t, "triton", window)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_storage_per_head_decodes_on_the_gpu_as_float64_on_the_caches_values(kind):
    """Heads of every storage read in one launch on CUDA, appended by the append kernel, and
    storage='auto' choosing at the first decode step (the interpreter checks both in CI)."""
    from adaattn.backends.reference import reference_attention, relative_errors

    g = torch.Generator(device="cuda").manual_seed(7)
    rows = [["int4", "int8", "native", "int4"]] * 2
    for storage in (rows, "auto"):
        kw = dict(dtype=torch.bfloat16, device="cuda", storage=storage, window=64,
                  tolerance=0.05 if storage == "auto" else None)
        lens = [300, 130]
        if kind == "paged":
            cache = PagedKVCache(2, 4, 128, 64, 16, max_seqs=3, **kw)
            seqs = [cache.add() for _ in lens]
        else:
            cache = KVCache(2, 2, 4, 320, 128, page_size=16, **kw)
            seqs = [0, 1]
        k = torch.randn(2, 4, 300, 128, device="cuda", generator=g).bfloat16()
        v = torch.randn(2, 4, 300, 128, device="cuda", generator=g).bfloat16()
        for layer in range(2):
            for i, (s, n) in enumerate(zip(seqs, lens)):
                PagedKVCache.append(cache, layer, [s], k[i:i + 1, :, :n], v[i:i + 1, :, :n])
        q = torch.randn(2, 16, 1, 128, device="cuda", generator=g).bfloat16()
        for layer in range(2):
            out = decode_attention(q, cache, layer, seqs=seqs, runner="triton")
            k64, v64 = cache.gather(layer, seqs, max(lens), torch.float64)
            for i, n in enumerate(lens):
                want = reference_attention(q[i:i + 1].double(), k64[i:i + 1, :, :n], v64[i:i + 1, :, :n], None, True,
                                           None, None, bottom_right=True)
                assert relative_errors(out[i:i + 1], want).item() < 1e-2, (storage, layer, i)


@pytest.mark.parametrize("storage", ["native", "fp8", "int8", "int4", [["int4", "int8", "native", "int4"]] * 2],
                         ids=["native", "fp8", "int8", "int4", "per-head"])
def test_site_launches_give_triton_s_own_launches_bit_for_bit_eagerly_and_in_a_cuda_graph(storage):
    """Decode steps and appends with site launches on (the default; ADAATTN_TRITON_SITES=0 turns
    them off: the decode plan's and the append's launches found once, then only their tensors
    slotted in) against the same
    steps through triton's own launches: the caches' pools, lengths and every output equal bit for
    bit, eager steps and a step captured in a CUDA graph and replayed."""
    from adaattn.backends.triton import bound

    def run(on: bool):
        bound.set_sites_enabled(on)
        try:
            torch.manual_seed(3)
            layers, b, hq, hkv, d = 2, 4, 16, 4, 128
            cache = KVCache(layers, b, hkv, 700, d, device="cuda", storage=storage)
            for layer in range(layers):
                cache.append(layer, *(torch.randn(b, hkv, 300, d, device="cuda", dtype=torch.bfloat16)
                                      for _ in range(2)))
            plan = plan_decode(cache, heads=hq, max_len=700)
            q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
            tok = [torch.randn(layers, b, hkv, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            outs = []

            def step():
                res = []
                for layer in range(layers):
                    cache.append(layer, tok[0][layer], tok[1][layer])
                    res.append(decode_attention(q, cache, layer, plan=plan))
                return res

            for _ in range(3):
                outs += [o.clone() for o in step()]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = step()
            for _ in range(3):
                graph.replay()
                outs += [o.clone() for o in captured]
            torch.cuda.synchronize()
            cache.sync()
            state = [*cache.k, *cache.v, cache.lengths]
            if cache.storage == "mixed":  # (its pools are its layers' parts)
                from adaattn.kv import mixed

                state += [x for layer in range(layers) for x in mixed.tensors(cache, layer)]
            return outs, [t.clone() for t in state]
        finally:
            bound.set_sites_enabled(None)

    own, own_state = run(False)
    sites, site_state = run(True)
    assert all(torch.equal(a, b) for a, b in zip(own, sites)) and len(own) == len(sites) == 12
    assert all(torch.equal(a, b) for a, b in zip(own_state, site_state))
