"""adaattn.distributed.ring_attention on gloo (CPU), world sizes 2 and 4, against float64 reference.

Each world size is one spawned group: every rank runs all cases, rank 0 saves the unsharded
outputs and gradients, and the parent compares them with the float64 reference (autograd for
the gradients) to the measuring standard: float64 rel err < 1e-10; float32 err <= 2 * err of
torch SDPA on the same float32 inputs + 1e-6.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from adaattn.backends.reference import reference_attention

D = 16
HQ = 4

# (name, dtype, balance, causal, hkv, window, docs, algorithm, kernel); docs are cu_seqlens
# fractions of the global length (placed so that documents straddle shards and chunks).
CASES = []
for _dt in (torch.float64, torch.float32):
    for _bal in ("zigzag", "plain"):
        for _causal, _hkv, _win, _docs, _alg in ((False, 4, None, None, "ring"), (True, 4, None, None, "ring"),
                                                 (True, 2, None, None, "ring"), (True, 4, (8, 0), None, "ring"),
                                                 (False, 2, (3, 5), None, "ring"), (True, 2, None, "docs", "ring"),
                                                 (False, 4, (4, 2), "docs", "ring"),
                                                 (True, 2, None, None, "allgather"),
                                                 (True, 4, (6, 0), "docs", "allgather")):
            _name = f"{str(_dt)[6:]}-{_bal}-{'causal' if _causal else 'full'}-hkv{_hkv}-win{_win}-{_docs}-{_alg}"
            CASES.append((_name, _dt, _bal, _causal, _hkv, _win, _docs, _alg, "torch"))
# Our Triton block kernels (the interpreter on CPU), at world size 2 only: the interpreter is slow.
TRITON_CASES = [
    ("triton-float32-zigzag-causal-gqa", torch.float32, "zigzag", True, 2, None, None, "ring", "triton"),
    ("triton-float32-plain-window", torch.float32, "plain", False, 4, (5, 3), None, "ring", "triton"),
    ("triton-float16-zigzag-docs-causal", torch.float16, "zigzag", True, 2, None, "docs", "allgather", "triton"),
]


# Score modifiers across ranks: (name, balance, causal, hkv, docs, algorithm, softcap); sinks in each.
SINK_CASES = (("sinks-zigzag-causal-gqa", "zigzag", True, 2, None, "ring", None),
              ("sinks-softcap-plain-docs", "plain", False, 4, "docs", "allgather", 1.5))


def _n_global(world: int) -> int:
    return 48 if world == 2 else 32


def _docs(kind, n):
    """Global cu_seqlens: boundaries at 0, n/8+1, n/2-3, n/2+5 (an empty-free but uneven split)."""
    if kind is None:
        return None
    return [0, n // 8 + 1, n // 2 - 3, n // 2 + 5, n]


def _cases(world):
    return CASES + (TRITON_CASES if world == 2 else [])


def _inputs(dtype, hkv, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HQ, n, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, hkv, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, hkv, n, D, generator=g, dtype=torch.float64)
    go = torch.randn(1, HQ, n, D, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), go.to(dtype)


@contextlib.contextmanager
def _gloo_group(rank: int, world: int, port: int):
    """A spawned worker's gloo process group; on a clean exit every rank meets at a barrier
    (rank 0 has saved its results by then)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, path: str) -> None:
    from adaattn.distributed import ring_attention, shard, unshard

    with _gloo_group(rank, world, port):
        results = {}
        n = _n_global(world)
        for name, dtype, balance, causal, hkv, window, docs, algorithm, kernel in _cases(world):
            q, k, v, go = _inputs(dtype, hkv, n)
            ql, kl, vl, gol = (shard(t, 2, balance=balance) for t in (q, k, v, go))
            ql, kl, vl = (t.detach().requires_grad_() for t in (ql, kl, vl))
            out = ring_attention(ql, kl, vl, is_causal=causal, window=window, enable_gqa=hkv != HQ,
                                 balance=balance, cu_seqlens=_docs(docs, n), algorithm=algorithm, kernel=kernel)
            (out * gol).sum().backward()
            full = [unshard(t.detach(), 2, balance=balance) for t in (out, ql.grad, kl.grad, vl.grad)]
            results[name] = [t.clone() for t in full]
        # Sinks across ranks: applied from the global lse; each rank's d sinks is its rows' share.
        for name, balance, causal, hkv, docs, algorithm, cap in SINK_CASES:
            q, k, v, go = _inputs(torch.float64, hkv, n, seed=5)
            q = q * 3  # scores past the cap
            sinks = torch.linspace(-2.0, 3.0, HQ, dtype=torch.float64).requires_grad_()
            ql, kl, vl, gol = (shard(t, 2, balance=balance) for t in (q, k, v, go))
            ql, kl, vl = (t.detach().requires_grad_() for t in (ql, kl, vl))
            out = ring_attention(ql, kl, vl, is_causal=causal, enable_gqa=hkv != HQ, balance=balance,
                                 cu_seqlens=_docs(docs, n), algorithm=algorithm, kernel="torch", sinks=sinks,
                                 softcap=cap)
            (out * gol).sum().backward()
            ds = sinks.grad.clone()
            torch.distributed.all_reduce(ds)
            results[name] = [unshard(t.detach(), 2, balance=balance) for t in (out, ql.grad, kl.grad, vl.grad)] + [ds]
        # unshard is differentiable: the gradient of a loss every rank computes on the full
        # tensor reaches each shard summed over ranks.
        x = torch.arange(n, dtype=torch.float64).reshape(1, 1, n, 1)
        xl = shard(x, 2).requires_grad_()
        (unshard(xl, 2) * 2).sum().backward()
        results["_unshard_roundtrip"] = [unshard(xl.detach(), 2), xl.grad.clone()]
        from adaattn.backends import ring_blocks

        results["_triton_failed"] = ring_blocks.TritonBlocks.failed  # a fallback would hide a kernel bug
        # Each ring call records this rank's decisions; gather_records brings every rank's.
        import adaattn
        from adaattn.distributed import gather_records

        q, k, v, _ = _inputs(torch.float32, 2, n)
        with adaattn.stats.collect() as records:
            ring_attention(*(shard(t, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True, kernel="torch")
        results["_records"] = gather_records(records)
        if rank == 0:
            torch.save(results, path)


def _rel(x, ref) -> float:
    return float(torch.linalg.vector_norm(x.double() - ref) / torch.linalg.vector_norm(ref))


def _mask(n, causal, window, docs):
    """The global bool mask (True takes part), written from the definitions."""
    i = torch.arange(n).unsqueeze(1)
    j = torch.arange(n).unsqueeze(0)
    mask = torch.ones(n, n, dtype=torch.bool)
    if causal:
        mask &= j <= i
    if window is not None:
        if window[0] is not None:
            mask &= j >= i - window[0]
        if window[1] is not None:
            mask &= j <= i + window[1]
    cu = _docs(docs, n)
    if cu is not None:
        doc = torch.bucketize(torch.arange(n), torch.tensor(cu[1:]), right=True)
        mask &= doc.unsqueeze(1) == doc.unsqueeze(0)
    return mask


def _reference(dtype, causal, hkv, window, docs, n):
    q, k, v, go = _inputs(dtype, hkv, n)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    out = reference_attention(qr, kr, vr, attn_mask=_mask(n, causal, window, docs))
    (out * go.double()).sum().backward()
    return [out.detach(), qr.grad, kr.grad, vr.grad]


def _sdpa(dtype, causal, hkv, window, docs, n):
    q, k, v, go = _inputs(dtype, hkv, n)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(n, causal, window, docs), enable_gqa=hkv != HQ)
    (out * go).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_reference(world, tmp_path):
    import torch.multiprocessing as mp

    path = str(tmp_path / f"ring{world}.pt")
    mp.start_processes(_worker, args=(world, _free_port(), path), nprocs=world, join=True,
                       start_method="spawn")
    results = torch.load(path)
    n = _n_global(world)
    failures = []
    for name, dtype, balance, causal, hkv, window, docs, algorithm, kernel in _cases(world):
        got = results[name]
        ref = _reference(dtype, causal, hkv, window, docs, n)
        base = _sdpa(dtype, causal, hkv, window, docs, n) if dtype != torch.float64 else None
        for what, g, r, i in zip(("out", "dq", "dk", "dv"), got, ref, range(4)):
            assert g.dtype == dtype and g.shape == r.shape, (name, what, g.dtype, g.shape)
            err = _rel(g, r)
            bound = 1e-10 if base is None else 2 * _rel(base[i], r) + 1e-6
            if not err <= bound:
                failures.append(f"{name} {what}: err {err:.3e} > {bound:.3e}")
    for name, _, causal, hkv, docs, _, cap in SINK_CASES:
        q, k, v, go = _inputs(torch.float64, hkv, n, seed=5)
        q = q * 3
        t64 = [t.double().requires_grad_() for t in (q, k, v)] + [
            torch.linspace(-2.0, 3.0, HQ, dtype=torch.float64).requires_grad_()]
        ref = reference_attention(*t64[:3], attn_mask=_mask(n, causal, None, docs), sinks=t64[3], softcap=cap)
        want = [ref.detach()] + list(torch.autograd.grad(ref, t64, go))
        for what, g, r in zip(("out", "dq", "dk", "dv", "dsinks"), results[name], want):
            if not _rel(g, r) <= 1e-10:
                failures.append(f"{name} {what}: err {_rel(g, r):.3e}")
    assert not failures, "\n".join(failures)
    assert results["_triton_failed"] is False
    recs = results["_records"]
    assert [len(r) for r in recs] == [1] * world
    assert [r[0]["decisions"]["rank"] for r in recs] == list(range(world))
    assert all(r[0]["backend"] == "ring.torch" and r[0]["decisions"]["world"] == world for r in recs)
    # zigzag causal: every rank visits every shard (one kernel call each), skipping none
    assert all(r[0]["decisions"]["kernel_calls"] == world and r[0]["decisions"]["shards_skipped"] == 0 for r in recs)
    full, grad = results["_unshard_roundtrip"]
    assert torch.equal(full, torch.arange(n, dtype=torch.float64).reshape(1, 1, n, 1))
    assert torch.equal(grad, torch.full_like(grad, 2.0 * world))


def test_world_size_one_is_adaattn_attention():
    import torch.distributed as dist

    import adaattn
    from adaattn.distributed import RingAttention, ring_attention, shard, unshard

    assert not (dist.is_available() and dist.is_initialized())
    q, k, v, _ = _inputs(torch.float32, 2, 24)
    for kwargs in ({}, {"is_causal": True}, {"is_causal": True, "window": (8, 0)}):
        want = adaattn.attention(q, k, v, enable_gqa=True, **kwargs)
        got = ring_attention(q, k, v, enable_gqa=True, **kwargs)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got = RingAttention(balance="plain")(q, k, v, enable_gqa=True, **kwargs)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert shard(q, 2) is q and unshard(q, 2) is q


def test_import_adaattn_does_not_import_distributed():
    import subprocess

    code = "import sys, adaattn; print('adaattn.distributed' in sys.modules)"
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"


def _pair_cover(q_rank, k_rank, world, n, balance, causal, window, docs):
    """How many kernel calls cover each (local query, local key) pair of one block."""
    from adaattn.backends.ring_blocks import band_keep
    from adaattn.distributed.bands import block_pairs

    cover = torch.zeros(n, n, dtype=torch.int64)
    for qa, qb, ka, kb, left, right in block_pairs(q_rank, k_rank, world, n, balance, causal, window, docs):
        band = band_keep(qb - qa, kb - ka, left, right, "cpu")
        cover[qa:qb, ka:kb] += 1 if band is None else band.long()
    return cover


def test_block_pairs_cover_the_global_mask_once():
    """Every visible (query, key) pair of every block is in exactly one kernel call and no
    invisible pair is in any, over random layouts, masks and documents."""
    from adaattn.distributed import positions

    g = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(300):
        world = int(torch.randint(1, 6, (1,), generator=g))
        balance = ("zigzag", "plain")[trial % 2]
        n = 2 * int(torch.randint(1, 9, (1,), generator=g))
        total = n * world
        causal = bool(trial % 3)
        window = None
        if trial % 4:
            sides = [None if torch.rand(1, generator=g) < 0.3 else int(torch.randint(0, total, (1,), generator=g))
                     for _ in range(2)]
            window = tuple(sides)
        docs = None
        if trial % 5 < 3:
            cuts = sorted(set(torch.randint(0, total + 1, (int(torch.randint(0, 5, (1,), generator=g)),),
                                            generator=g).tolist()) | {0, total})
            docs = tuple(cuts)
        qi = torch.arange(total).unsqueeze(1)
        kj = torch.arange(total).unsqueeze(0)
        doc_of = None if docs is None else torch.bucketize(torch.arange(total), torch.tensor(docs[1:]), right=True)
        for r in range(world):
            for s in range(world):
                qp, kp = positions(r, world, n, balance), positions(s, world, n, balance)
                want = torch.ones(n, n, dtype=torch.bool)
                d = kp.unsqueeze(0) - qp.unsqueeze(1)
                if causal:
                    want &= d <= 0
                if window is not None:
                    if window[0] is not None:
                        want &= d >= -window[0]
                    if window[1] is not None:
                        want &= d <= window[1]
                if doc_of is not None:
                    want &= doc_of[qp].unsqueeze(1) == doc_of[kp].unsqueeze(0)
                cover = _pair_cover(r, s, world, n, balance, causal, window, docs)
                assert torch.equal(cover, want.long()), (world, balance, n, causal, window, docs, r, s)
                checked += 1
    del qi, kj
    assert checked > 1000


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_world_size_one_block_path_matches_float64(kernel):
    """Without a process group, documents (or a named kernel) run the block path on the one
    shard; it matches float64 with gradients."""
    from adaattn.distributed import ring_attention

    n = 40
    for causal, window, docs in ((True, None, [0, 9, 30, 40]), (False, (6, 2), [0, 17, 40]), (True, (5, 0), None)):
        q, k, v, go = _inputs(torch.float32, 2, n, seed=3)
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        cu = None if docs is None else [0] + [x * 1 for x in docs[1:]]
        mask = torch.ones(n, n, dtype=torch.bool)
        i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        if causal:
            mask &= j <= i
        if window is not None:
            mask &= (j >= i - window[0]) & (j <= i + window[1])
        if cu is not None:
            doc = torch.bucketize(torch.arange(n), torch.tensor(cu[1:]), right=True)
            mask &= doc.unsqueeze(1) == doc.unsqueeze(0)
        ref = reference_attention(qr, kr, vr, attn_mask=mask)
        (ref * go.double()).sum().backward()
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        out = ring_attention(qs, ks, vs, is_causal=causal, window=window, enable_gqa=True, cu_seqlens=cu,
                             kernel=kernel)
        (out * go).sum().backward()
        sq, sk, sv = (t.detach().requires_grad_() for t in (q, k, v))
        base = F.scaled_dot_product_attention(sq, sk, sv, attn_mask=mask, enable_gqa=True)
        (base * go).sum().backward()
        for got, want, sdpa in ((out, ref, base), (qs.grad, qr.grad, sq.grad), (ks.grad, kr.grad, sk.grad),
                                (vs.grad, vr.grad, sv.grad)):
            assert _rel(got.detach(), want.detach()) <= 2 * _rel(sdpa.detach(), want.detach()) + 1e-6
    from adaattn.backends import ring_blocks

    assert ring_blocks.TritonBlocks.failed is False  # the kernels ran (a fallback would hide a bug)


def test_bad_arguments_are_refused():
    from adaattn.distributed import ring_attention

    q, k, v, _ = _inputs(torch.float32, 4, 16)
    with pytest.raises(ValueError, match="algorithm"):
        ring_attention(q, k, v, algorithm="tree")
    with pytest.raises(ValueError, match="kernel"):
        ring_attention(q, k, v, kernel="cuda")
    with pytest.raises(ValueError, match="cu_seqlens"):
        ring_attention(q, k, v, cu_seqlens=[0, 5, 12])  # does not end at 16
    with pytest.raises(ValueError, match="cu_seqlens"):
        ring_attention(q, k, v, cu_seqlens=[0, 9, 5, 16])
    with pytest.raises(TypeError, match="cu_seqlens"):
        ring_attention(q, k, v, cu_seqlens=[0.0, 16.0])
    with pytest.raises(ValueError, match="kernel='triton'"):
        ring_attention(q.double(), k.double(), v.double(), kernel="triton")
    with pytest.raises(ValueError, match="alibi_slopes are not yet applied across ranks"):
        ring_attention(q, k, v, alibi_slopes=torch.ones(4))
    with pytest.raises(ValueError, match="softcap must be a finite float > 0"):
        ring_attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\) = \(4,\)"):
        ring_attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        ring_attention(q, k, v, sinks=[0.0] * 4)


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_world_size_one_block_path_applies_sinks_and_softcap_with_their_gradients(softcap):
    """The block path (documents, or a named kernel) with sinks and a soft cap, one shard: against
    float64 (the torch blocks), and our Triton blocks against the standard (the interpreter)."""
    from adaattn.distributed import ring_attention

    n = 40
    q, k, v, go = _inputs(torch.float64, 2, n, seed=4)
    q = q * 3  # scores past the cap
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0], dtype=torch.float64)
    t64 = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    mask = _mask(n, True, None, None)
    ref = reference_attention(*t64[:3], attn_mask=mask, sinks=t64[3], softcap=softcap)
    want = [ref.detach()] + list(torch.autograd.grad(ref, t64, go))
    for kernel in ("torch", "auto"):  # "auto" at world size 1: adaattn.attention
        ts = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = ring_attention(*ts[:3], is_causal=True, enable_gqa=True, kernel=kernel, sinks=ts[3], softcap=softcap)
        got = [out.detach()] + list(torch.autograd.grad(out, ts, go))
        for what, g, r in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
            assert _rel(g, r) <= 1e-10, (kernel, what, _rel(g, r))
    if os.environ.get("TRITON_INTERPRET") != "1" or softcap is None:
        return
    t32 = [t.float().requires_grad_() for t in (q, k, v, sinks)]
    out = ring_attention(*t32[:3], is_causal=True, enable_gqa=True, kernel="triton", sinks=t32[3], softcap=softcap)
    got = [out.detach()] + list(torch.autograd.grad(out, t32, go.float()))
    e = [t.float().requires_grad_() for t in (q, k, v, sinks)]
    eager = reference_attention(*e[:3], attn_mask=mask, sinks=e[3], softcap=softcap).float()
    yard = [eager.detach()] + list(torch.autograd.grad(eager, e, go.float()))
    for what, g, y, r in zip(("out", "dq", "dk", "dv", "dsinks"), got, yard, want):
        assert _rel(g, r) <= 2 * _rel(y, r) + 1e-6, (what, _rel(g, r), _rel(y, r))
    from adaattn.backends import ring_blocks

    assert ring_blocks.TritonBlocks.failed is False


def _cp_worker(rank: int, world: int, port: int, path: str) -> None:
    """A torch context_parallel user swaps adaattn in: context_parallel shards the buffers
    (head-tail), the model calls ring_attention on the local shards with balance="zigzag"."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    from adaattn.distributed import positions, ring_attention

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        q, k, v, go = _inputs(torch.float32, 2, 32, seed=5)
        bufs = [t.clone() for t in (q, k, v, go)]
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
            ql, kl, vl, gol = bufs
            ql, kl, vl = (t.detach().clone().requires_grad_() for t in (ql, kl, vl))
            out = ring_attention(ql, kl, vl, mesh.get_group(), is_causal=True, enable_gqa=True, balance="zigzag")
            (out * gol).sum().backward()
        full = context_parallel_unshard(mesh, [out.detach(), ql.grad], [2, 2])
        res = {"pos": positions(rank, world, 32 // world, "zigzag"), "local_q": ql.detach(), "out": full[0],
               "dq": full[1]}
        torch.save(res, f"{path}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_torch_context_parallel_user_swaps_in_ring_attention(tmp_path):
    pytest.importorskip("torch.distributed.tensor.experimental._attention")
    import torch.multiprocessing as mp

    world, path = 2, str(tmp_path / "cp")
    mp.start_processes(_cp_worker, args=(world, _free_port(), path), nprocs=world, join=True, start_method="spawn")
    q, k, v, go = _inputs(torch.float32, 2, 32, seed=5)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, is_causal=True)
    (ref * go.double()).sum().backward()
    for rank in range(world):
        res = torch.load(f"{path}.{rank}")
        # torch's head-tail shard is our zigzag shard
        assert torch.equal(res["local_q"], q[:, :, res["pos"]])
        assert _rel(res["out"], ref.detach()) < 1e-5
        assert _rel(res["dq"], qr.grad) < 1e-5


@pytest.mark.parametrize("block_dtype", [torch.float32, torch.float16])
def test_triton_merge_matches_the_torch_merge(block_dtype):
    """backends.triton.merge.merge_into (one launch) against ring_blocks.lse_merge (torch, the reference):
    rows unseen on either side or both, a view of rows, Dv not a power of two."""
    from adaattn.backends.ring_blocks import lse_merge
    from adaattn.backends.triton.merge import merge_into

    g = torch.Generator().manual_seed(1)
    b, h, n, dv = 2, 3, 45, 24
    out = torch.randn(b, h, n, dv, generator=g)
    lse = torch.randn(b, h, n, generator=g) * 3
    blk = torch.randn(b, h, n, dv, generator=g).to(block_dtype)
    blk_lse = torch.randn(b, h, n, generator=g) * 3
    lse[:, :, :5] = float("-inf")
    out[:, :, :5] = 0
    blk_lse[:, :, 3:9] = float("-inf")
    blk[:, :, 3:9] = 0
    want_out, want_lse = lse_merge(out, lse, blk.float(), blk_lse)
    got_out, got_lse = out.clone(), lse.clone()
    rows = slice(2, 41)  # a view of rows, as the ring merges a pair's rows
    got_out[:, :, :2], got_lse[:, :, :2] = want_out[:, :, :2], want_lse[:, :, :2]
    got_out[:, :, 41:], got_lse[:, :, 41:] = want_out[:, :, 41:], want_lse[:, :, 41:]
    merge_into(got_out[:, :, rows], got_lse[:, :, rows], blk[:, :, rows], blk_lse[:, :, rows])
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse))
    assert torch.isneginf(got_lse[:, :, 3:5]).all() and (got_out[:, :, 3:5] == 0).all()
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)


def test_triton_fallback_blocks_give_float64_gradients(monkeypatch):
    """Once the Triton blocks have failed in a process, blocks run in torch math, backward
    included (the torch backward makes the delta the Triton one would have made); stats name the
    engine that ran and the one that fell back."""
    import adaattn
    from adaattn.backends import ring_blocks
    from adaattn.distributed import ring_attention

    monkeypatch.setattr(ring_blocks.TritonBlocks, "failed", True)
    q, k, v, go = _inputs(torch.float32, 2, 24, seed=7)
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    with adaattn.stats.collect() as recs:
        out = ring_attention(qs, ks, vs, is_causal=True, enable_gqa=True, cu_seqlens=[0, 10, 24], kernel="triton")
    assert [(r.backend, r.fallbacks) for r in recs] == [("ring.torch", ("ring.triton",))]
    # A cuDNN engine whose blocks went to Triton and on to torch names itself as the one that fell back.
    # (on the CPU the planner's ring.cudnn runner declines: here it is told it can run)
    monkeypatch.setattr(ring_blocks.CudnnBlocks, "failed", True)
    monkeypatch.setattr(ring_blocks.CudnnRingBlocks, "supports", lambda self, problem, policy=None: [])
    with adaattn.stats.collect() as recs:
        again = ring_attention(q, k, v, is_causal=True, enable_gqa=True, cu_seqlens=[0, 10, 24], kernel="cudnn")
    assert [(r.backend, r.fallbacks) for r in recs] == [("ring.torch", ("ring.cudnn",))]
    torch.testing.assert_close(again, out.detach(), rtol=0, atol=0)
    (out * go).sum().backward()
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, attn_mask=_mask(24, True, None, None) & _doc_mask(24, [0, 10, 24]))
    (ref * go.double()).sum().backward()
    for got, want in ((out, ref), (qs.grad, qr.grad), (ks.grad, kr.grad), (vs.grad, vr.grad)):
        assert _rel(got.detach(), want.detach()) < 1e-5


def _doc_mask(n, cu):
    doc = torch.bucketize(torch.arange(n), torch.tensor(cu[1:]), right=True)
    return doc.unsqueeze(1) == doc.unsqueeze(0)


def test_window_and_cu_seqlens_elements_are_checked():
    import numpy as np

    from adaattn.distributed import ring_attention

    q, k, v, _ = _inputs(torch.float32, 4, 16)
    with pytest.raises(ValueError, match="window"):
        ring_attention(q, k, v, window=(True, 0))
    with pytest.raises(TypeError, match="Python ints.*int64"):
        ring_attention(q, k, v, cu_seqlens=[0, np.int64(8), 16])


# ----------------------------------------------------------------------------- policies in the ring

PD, PHQ, PHK, PN = 64, 4, 2, 64  # the quantized kernels take head dims 64 and 128


def _policy_inputs(seed=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, PHQ, PN, PD, generator=g)
    k = torch.randn(1, PHK, PN, PD, generator=g) + 0.3  # a key mean: smoothing's share of the scores is real
    v = torch.randn(1, PHK, PN, PD, generator=g)
    go = torch.randn(1, PHQ, PN, PD, generator=g)
    return tuple(t.to(torch.bfloat16) for t in (q, k, v, go))


def _policy_worker(rank: int, world: int, port: int, path: str) -> None:
    """Every rank: quantized blocks under a policy (3 calls at tau=5e-2; a tau no quantized
    level meets; train_quantized gradients), with their stats records gathered."""
    import adaattn
    from adaattn import Policy
    from adaattn.distributed import gather_records, ring_attention, shard, unshard

    with _gloo_group(rank, world, port):
        q, k, v, go = _policy_inputs()
        ql, kl, vl, gol = (shard(t, 2) for t in (q, k, v, go))
        kw = dict(is_causal=True, enable_gqa=True)
        res = {"exact": unshard(ring_attention(ql, kl, vl, **kw), 2)}
        with adaattn.stats.collect() as records:
            loose = Policy(mode="auto", precisions=("int8", "fp8"), tolerance=5e-2, verify=0.5)
            res["loose"] = [unshard(ring_attention(ql, kl, vl, policy=loose, label="loose", **kw), 2) for _ in range(3)]
            tight = Policy(mode="auto", precisions=("fp8",), tolerance=1e-3)
            res["tight"] = [unshard(ring_attention(ql, kl, vl, policy=tight, label="tight", **kw), 2) for _ in range(2)]
            grads = {}
            for name, pol in (("exact", None), ("train_quantized", Policy(mode="auto", precisions=("int8",),
                                                                           tolerance=5e-2, train_quantized=True)),
                              ("no_train_quantized", Policy(mode="auto", precisions=("int8",), tolerance=5e-2))):
                a, b, c = (t.detach().clone().requires_grad_() for t in (ql, kl, vl))
                out = ring_attention(a, b, c, policy=pol, label=name, **kw)
                (out.float() * gol.float()).sum().backward()
                grads[name] = [unshard(t, 2) for t in (out.detach(), a.grad, b.grad, c.grad)]
            res["grads"] = grads
        res["records"] = gather_records(records)
        if rank == 0:
            torch.save(res, path)


def _head_errors(out, ref):
    return ((out.double() - ref).pow(2).sum((0, 2, 3)) / ref.pow(2).sum((0, 2, 3))).sqrt()


def test_policy_blocks_meet_the_tolerance_across_ranks(tmp_path):
    """World 2 (gloo, our quantized kernels in the interpreter): per-head quantized blocks under
    tau, every head's error against float64 within tau (plus the exact ring's own error), the
    decisions the same on both ranks, a tau no level meets giving the exact ring's output, and an
    exact backward."""
    import torch.multiprocessing as mp

    from adaattn.distributed import summarize_ranks

    world, path = 2, str(tmp_path / "policy.pt")
    mp.start_processes(_policy_worker, args=(world, _free_port(), path), nprocs=world, join=True,
                       start_method="spawn")
    res = torch.load(path)
    q, k, v, go = _policy_inputs()
    ref = reference_attention(q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1),
                              is_causal=True)
    base = _head_errors(res["exact"], ref)
    assert base.max() < 5e-3
    calls = summarize_ranks(res["records"])
    loose, tight, grads = calls[:3], calls[3:5], calls[5:]
    for out, call in zip(res["loose"], loose):
        err = _head_errors(out, ref)
        assert (err <= 5e-2 + base).all(), err
        assert call["levels_agree"] and call["mode"] == "auto" and call["world"] == 2
        assert all(b == "ring.triton.quant" for b in call["backends"])
    # Call 1 is verified and measures every head; quantized heads show a quantized error, and
    # the heads left quantized are within tau over both ranks' rows.
    first = loose[0]
    assert first["verified"] is True and all(r == "quantized, verified against exact" for r in first["ran"])
    assert len(first["head_errors"]) == PHQ and all(e > 1e-3 for e in first["head_errors"])
    quantized = [h for h, lv in enumerate(loose[2]["head_levels"]) if lv != "exact"]
    assert quantized, "some head should stay quantized at tau=5e-2"
    assert not torch.equal(res["loose"][2], res["exact"])
    # Rank 1's record of the same call carries the same (summed) errors.
    d0, d1 = (res["records"][r][0]["decisions"] for r in range(2))
    assert d0["head_errors"] == d1["head_errors"] and d0["rank"] == 0 and d1["rank"] == 1
    # fp8 cannot meet 1e-3: on the verified first call every head takes the exact blocks'
    # output (bit for bit the exact ring's), and the site runs exact blocks from then on.
    assert torch.equal(res["tight"][0], res["exact"]) and torch.equal(res["tight"][1], res["exact"])
    assert tight[0]["head_levels"] == ["exact"] * PHQ and tight[1]["backends"] == ["ring.torch"] * 2
    assert "every head" in tight[1]["why"]
    # Gradients: exact whatever the forward ran.
    ex = res["grads"]["exact"]
    for name in ("train_quantized", "no_train_quantized"):
        for i in (1, 2, 3):
            torch.testing.assert_close(res["grads"][name][i], ex[i], rtol=0, atol=0)
    assert not torch.equal(res["grads"]["train_quantized"][0], ex[0])  # its forward ran quantized
    torch.testing.assert_close(res["grads"]["no_train_quantized"][0], ex[0], rtol=0, atol=0)
    assert grads[1]["backends"] == ["ring.triton.quant"] * 2
    assert grads[2]["backends"] == ["ring.torch"] * 2 and all(r == "exact" for r in grads[2]["ran"])
    assert "train_quantized" in res["records"][0][-1]["decisions"]["why"]


def test_policy_site_judges_speed_only_on_a_repeated_level_set():
    from adaattn.adaptive import quant_launch as tq
    from adaattn.distributed import adaptive

    dev = torch.device("cpu")
    site = adaptive.RingSite(5e-2, 0.1, (tq.LEVEL_QK8, tq.LEVEL_FP8), 2, True)
    assert site.levels == [tq.LEVEL_FP8] * 2
    assert site.begin(dev) == "verify"
    # First verified call: a head over tau moves up; the timing (compiles) is not judged.
    assert site.settle([0.01, 0.0001], [1.0, 1.0], 900.0, 1.0) == [0]
    assert site.levels == [tq.LEVEL_QK8, tq.LEVEL_FP8] and not site.runs_exact
    assert site.begin(dev) == "verify"  # a head moved: measure again at once
    assert site.settle([1e-4, 1e-4], [1.0, 1.0], 1.2, 1.0) == []  # new level set: not judged
    assert not site.runs_exact and site.begin(dev) == "verify"
    assert site.settle([1e-4, 1e-4], [1.0, 1.0], 1.2, 1.0) == []  # same levels, slower: exact blocks
    assert site.runs_exact and "exact blocks run" in site.why
    kinds = [site.begin(dev) for _ in range(10)]
    assert kinds == ["exact"] * 9 + ["verify"]  # verify=0.1: one call in ten measures again
    assert site.settle([1e-4, 1e-4], [1.0, 1.0], 0.8, 1.0) == []
    assert not site.runs_exact and "they pay" in site.why and site.begin(dev) == "quant"
    # An outlier (one engine 4x the other) is not judged, at most UNJUDGED_MAX times in a row.
    for _ in range(adaptive.UNJUDGED_MAX):
        site._next_verify = site.calls + 1
        assert site.begin(dev) == "verify"
        site.settle([1e-4, 1e-4], [1.0, 1.0], 5.0, 1.0)
        assert not site.runs_exact
    site._next_verify = site.calls + 1
    site.begin(dev)
    site.settle([1e-4, 1e-4], [1.0, 1.0], 5.0, 1.0)
    assert site.runs_exact


def test_policy_refusals_and_exact_reasons():
    import adaattn
    from adaattn import Policy
    from adaattn.distributed import RingAttention, ring_attention

    q, k, v, _ = _policy_inputs()
    with pytest.raises(ValueError, match=re.escape("Policy.approximations=('skip',) (rank approximations) is not "
                                                   "available across ranks and Policy.precisions=('native',) allows "
                                                   "no quantized level")):
        ring_attention(q, k, v, is_causal=True, enable_gqa=True, kernel="triton",
                       policy=Policy(mode="auto", approximations=("skip",)))
    # Policy(mode="auto") alone allows rank approximations too: the ring runs what it has of it.
    exact = ring_attention(q, k, v, is_causal=True, enable_gqa=True, kernel="torch")
    with adaattn.stats.collect() as recs:
        out = ring_attention(q, k, v, is_causal=True, enable_gqa=True, kernel="torch", policy=Policy(mode="auto"))
    assert torch.equal(out, exact) and recs[0].mode == "auto" and "kernel='torch'" in recs[0].decisions["why"]
    with pytest.raises(ValueError, match="backends"):
        ring_attention(q, k, v, is_causal=True, enable_gqa=True, cu_seqlens=[0, 30, PN],
                       policy=Policy(backends=("triton",)))
    with pytest.raises(TypeError, match="policy"):
        ring_attention(q, k, v, enable_gqa=True, kernel="torch", policy="auto")
    # kernel='torch' under a quantized policy: exact torch blocks, and the record says why.
    pol = Policy(mode="auto", precisions=("int8",), tolerance=5e-2)
    with adaattn.stats.collect() as recs:
        out = ring_attention(q, k, v, is_causal=True, enable_gqa=True, kernel="torch", policy=pol)
    assert torch.equal(out, ring_attention(q, k, v, is_causal=True, enable_gqa=True, kernel="torch"))
    d = recs[0].decisions
    assert recs[0].backend == "ring.torch" and recs[0].mode == "auto" and "kernel='torch'" in d["why"]
    # World 1 with kernel='auto' is adaattn.attention, policy and label included.
    skip = Policy(mode="auto", approximations=("skip",), tolerance=5e-2)
    want = adaattn.attention(q, k, v, is_causal=True, enable_gqa=True, policy=skip, label="w1")
    got = RingAttention(policy=skip, label="w1")(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_policy_kernel_failure_runs_exact_blocks_under_the_same_kind(monkeypatch):
    """A quantized kernel failure on one rank must not change the call's kind (the other ranks'
    all-reduce and backward ring pass would wait for it): exact blocks run under it, one warning."""
    import adaattn
    from adaattn import Policy
    from adaattn.adaptive import quant_launch as tq
    from adaattn.distributed import adaptive, ring_attention

    def broken(*a, **k):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(tq, "quant_attention", broken)
    adaptive.reset()
    q, k, v, _ = _policy_inputs()
    pol = Policy(mode="auto", precisions=("int8",), tolerance=5e-2, verify=0.5)
    want = ring_attention(q, k, v, is_causal=True, enable_gqa=True, kernel="triton")
    with pytest.warns(RuntimeWarning, match="quantized block kernel failed"):
        with adaattn.stats.collect() as recs:
            outs = [ring_attention(q, k, v, is_causal=True, enable_gqa=True, kernel="triton", policy=pol, label="broken")
                    for _ in range(3)]
    for out in outs:
        assert torch.equal(out, want)
    site = next(iter(adaptive._SITES.values()))
    assert site.failed and site.calls == 3 and site.verified == 2  # calls 1 and 3 verified, as scheduled
    assert [r.decisions["ran"] for r in recs] == ["exact"] * 3 and all(r.backend == "ring.triton" for r in recs)


def test_cudnn_kernel_is_refused_where_cudnn_cannot_run():
    from adaattn.distributed import ring_attention

    q, k, v, _ = _inputs(torch.float32, 4, 16)
    with pytest.raises(ValueError, match=re.escape("kernel='cudnn' cannot run these tensors: sdpa.cudnn runs on "
                                                   "cuda tensors only, got cpu.")):
        ring_attention(q, k, v, is_causal=True, kernel="cudnn")


def test_explain_ring_block_lists_every_runner_with_its_reasons_on_cpu(monkeypatch):
    """The planner's choice for one rank's CPU shards, no process group: torch math, with the
    Triton and cuDNN runners' reasons (the interpreter off, as outside the tests); a named
    kernel that cannot run them is refused with its reason."""
    from adaattn import planner
    from adaattn.distributed import explain_ring_block

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, _ = _inputs(torch.float32, 2, 16)
    choice = explain_ring_block(q, k, v, causal=True)
    assert isinstance(choice, planner.Choice) and choice.kind == "ring_block"
    assert choice.runner == "ring.torch"
    reasons = dict(choice.reasons)
    assert sorted(reasons) == ["ring.cudnn", "ring.torch", "ring.triton"]
    assert reasons["ring.torch"] == ()
    assert any("CUDA" in r for r in reasons["ring.triton"]), reasons["ring.triton"]
    assert "sdpa.cudnn runs on cuda tensors only, got cpu." in reasons["ring.cudnn"]
    assert "ring.cudnn" in str(choice) and "ring.triton" in str(choice)
    assert explain_ring_block(q, k, v, kernel="torch").runner == "ring.torch"
    with pytest.raises(ValueError, match=re.escape("kernel='cudnn' cannot run these tensors: sdpa.cudnn runs on "
                                                   "cuda tensors only, got cpu.")):
        explain_ring_block(q, k, v, causal=True, kernel="cudnn")
    with pytest.raises(ValueError, match="kernel must be one of"):
        explain_ring_block(q, k, v, kernel="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hkv", [8, 2])
def test_gpu_cudnn_blocks_merge_and_backward_match_float64(hkv, dtype, monkeypatch):
    """The cuDNN block engine as a rank of a ring uses it: the second half of the queries against
    the first half of the keys (a full block) and against the second half (a square causal
    block), merged by log-sum-exp; each block's backward from the merged (global) output and lse.
    Output and gradients against float64, to the measuring standard."""
    from adaattn import planner
    from adaattn.backends import ring_blocks
    from adaattn.distributed import explain_ring_block

    torch.manual_seed(5)
    b, hq, n, d, half = 2, 8, 1000, 128, 500
    q, k, v, go = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for h in (hq, hkv, hkv, hq))
    go = go[:, :, half:].contiguous()
    qs = q[:, :, half:]
    eng = planner.ring_block_engine(explain_ring_block(qs, k, v, causal=True, kernel="cudnn"))
    assert isinstance(eng, ring_blocks.CudnnBlocks)
    ring_blocks.CudnnBlocks.failed = False
    calls = _count_cudnn_calls(monkeypatch)
    scale = d ** -0.5
    blocks = (((0, half), -1, -1), ((half, n), -1, 0))
    out = lse = None
    for (ka, kb), left, right in blocks:
        bo, bl = eng.forward(qs, k[:, :, ka:kb], v[:, :, ka:kb], scale, left, right)
        if out is None:
            out, lse = bo.float(), bl.float().clone()
        else:
            eng.merge(out, lse, bo, bl)
    out = out.to(dtype)
    dq = torch.zeros(qs.shape, device="cuda")
    dk = torch.zeros(k.shape, device="cuda")
    dv = torch.zeros(v.shape, device="cuda")
    for (ka, kb), left, right in blocks:
        bdq, bdk, bdv = eng.backward(qs, k[:, :, ka:kb], v[:, :, ka:kb], go, out, lse, scale, left, right)
        dq += bdq
        dk[:, :, ka:kb] += bdk
        dv[:, :, ka:kb] += bdv
    assert ring_blocks.CudnnBlocks.failed is False  # cuDNN ran every block (a fallback would hide a bug)
    assert calls == ["fwd", "fwd", "bwd", "bwd"]  # and no block went to Triton
    if torch.cuda.get_device_capability() >= (9, 0):
        # A shard of the cp suite's 128k over 4 ranks: the planner runs cuDNN there (results/
        # 2026-11-27-cp-world4-h100: the auto rows beat the Triton rows), so auto takes its blocks.
        shard_q = torch.empty(1, 32, 32768, 128, device="cuda", dtype=dtype, requires_grad=True)
        shard_kv = torch.empty(1, 8, 32768, 128, device="cuda", dtype=dtype, requires_grad=True)
        assert explain_ring_block(shard_q, shard_kv, shard_kv, causal=True).runner == "ring.cudnn"
    mask = torch.arange(n, device="cuda").unsqueeze(0) <= torch.arange(half, n, device="cuda").unsqueeze(1)
    qr, kr, vr = (t.double().requires_grad_() for t in (qs, k, v))
    ref = reference_attention(qr, kr, vr, attn_mask=mask)
    (ref * go.double()).sum().backward()
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (qs, k, v))
    sd = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
    (sd * go).sum().backward()
    for name, got, want, base in (("out", out, ref, sd), ("dq", dq, qr.grad, qt.grad), ("dk", dk, kr.grad, kt.grad),
                                  ("dv", dv, vr.grad, vt.grad)):
        err, err_sdpa = _rel(got.detach(), want.detach()), _rel(base.detach(), want.detach())
        assert err <= 2 * err_sdpa + 1e-6, (name, err, err_sdpa)


def _count_cudnn_calls(monkeypatch) -> list:
    """The cuDNN engine's kernel calls, in order ("fwd"/"bwd"), from now on in this test."""
    from adaattn.backends import ring_blocks

    calls: list = []

    def counted(kind, op):
        def run(*args):
            got = op(*args)  # a call the op refuses (GQA, before K/V are repeated) is not counted
            calls.append(kind)
            return got
        return staticmethod(run)

    monkeypatch.setattr(ring_blocks.CudnnBlocks, "_fwd", counted("fwd", ring_blocks.CudnnBlocks._fwd))
    monkeypatch.setattr(ring_blocks.CudnnBlocks, "_bwd", counted("bwd", ring_blocks.CudnnBlocks._bwd))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [None, -0.05])
def test_gpu_ring_cudnn_kernel_matches_float64_on_transposed_inputs(causal, scale, monkeypatch):
    """ring_attention(kernel="cudnn") without a process group runs the block path on its one
    shard: (B, N, H, D) tensors viewed as (B, H, N, D), GQA, output and gradients against float64.
    A positive scale runs cuDNN forward and backward; a negative one runs Triton (torch's fused
    kernels give NaN for is_causal with a scale <= 0)."""
    from adaattn.backends import ring_blocks
    from adaattn.distributed import ring_attention

    ring_blocks.CudnnBlocks.failed = False
    calls = _count_cudnn_calls(monkeypatch)
    torch.manual_seed(11)
    b, n, hq, hkv, d = 2, 777, 8, 2, 128
    q, k, v, go = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   for h in (hq, hkv, hkv, hq))
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out = ring_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=True, kernel="cudnn")
    (out * go).sum().backward()
    assert calls == (["fwd", "bwd"] if scale is None else [])
    assert ring_blocks.CudnnBlocks.failed is False
    mask = None
    if causal:
        mask = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, attn_mask=mask, scale=scale)
    (ref * go.double()).sum().backward()
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
    # torch's own error: its fused kernels' dq is NaN at a negative scale (H100, torch 2.11), so
    # there the baseline is its math kernel.
    with sdpa_kernel(SDPBackend.MATH) if scale is not None and scale < 0 else contextlib.nullcontext():
        sd = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
        (sd * go).sum().backward()
    for name, got, want, base in (("out", out, ref, sd), ("dq", qs.grad, qr.grad, qt.grad),
                                  ("dk", ks.grad, kr.grad, kt.grad), ("dv", vs.grad, vr.grad, vt.grad)):
        err, err_sdpa = _rel(got.detach(), want.detach()), _rel(base.detach(), want.detach())
        assert torch.isfinite(got).all(), name
        assert err <= 2 * err_sdpa + 1e-6, (name, err, err_sdpa)
