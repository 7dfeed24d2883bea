"""adaattn.distributed.ring_attention on gloo (CPU), world sizes 2 and 4, against float64 reference.

Each world size is one spawned group: every rank runs all cases, rank 0 saves the unsharded
outputs and gradients, and the parent compares them with the float64 reference (autograd for
the gradients) to the measuring standard: float64 rel err < 1e-10; float32 err <= 2 * err of
torch SDPA on the same float32 inputs + 1e-6.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch
import torch.nn.functional as F

from adaattn.backends.reference import reference_attention

D = 16
HQ = 4

# (name, dtype, balance, causal, hkv, window, n_global)
CASES = []
for _dt in (torch.float64, torch.float32):
    for _bal in ("zigzag", "plain"):
        for _causal, _hkv, _win in ((False, 4, None), (True, 4, None), (True, 2, None), (True, 4, (8, 0)),
                                    (False, 2, (3, 5))):
            _name = f"{str(_dt)[6:]}-{_bal}-{'causal' if _causal else 'full'}-hkv{_hkv}-win{_win}"
            CASES.append((_name, _dt, _bal, _causal, _hkv, _win))


def _n_global(world: int) -> int:
    return 48 if world == 2 else 32


def _inputs(dtype, hkv, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HQ, n, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, hkv, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, hkv, n, D, generator=g, dtype=torch.float64)
    go = torch.randn(1, HQ, n, D, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), go.to(dtype)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist

    from adaattn.distributed import ring_attention, shard, unshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        n = _n_global(world)
        for name, dtype, balance, causal, hkv, window in CASES:
            q, k, v, go = _inputs(dtype, hkv, n)
            ql, kl, vl, gol = (shard(t, 2, balance=balance) for t in (q, k, v, go))
            ql, kl, vl = (t.detach().requires_grad_() for t in (ql, kl, vl))
            out = ring_attention(ql, kl, vl, is_causal=causal, window=window, enable_gqa=hkv != HQ,
                                 balance=balance)
            (out * gol).sum().backward()
            full = [unshard(t.detach(), 2, balance=balance) for t in (out, ql.grad, kl.grad, vl.grad)]
            results[name] = [t.clone() for t in full]
        # unshard is differentiable: the gradient of a loss every rank computes on the full
        # tensor reaches each shard summed over ranks.
        x = torch.arange(n, dtype=torch.float64).reshape(1, 1, n, 1)
        xl = shard(x, 2).requires_grad_()
        (unshard(xl, 2) * 2).sum().backward()
        results["_unshard_roundtrip"] = [unshard(xl.detach(), 2), xl.grad.clone()]
        if rank == 0:
            torch.save(results, path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _rel(x, ref) -> float:
    return float(torch.linalg.vector_norm(x.double() - ref) / torch.linalg.vector_norm(ref))


def _reference(dtype, causal, hkv, window, n):
    q, k, v, go = _inputs(dtype, hkv, n)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    out = reference_attention(qr, kr, vr, is_causal=causal, window=window)
    (out * go.double()).sum().backward()
    return [out.detach(), qr.grad, kr.grad, vr.grad]


def _sdpa(dtype, causal, hkv, window, n):
    q, k, v, go = _inputs(dtype, hkv, n)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = None
    i = torch.arange(n).unsqueeze(1)
    j = torch.arange(n).unsqueeze(0)
    if causal or window is not None:
        mask = torch.ones(n, n, dtype=torch.bool)
        if causal:
            mask &= j <= i
        if window is not None:
            if window[0] is not None:
                mask &= j >= i - window[0]
            if window[1] is not None:
                mask &= j <= i + window[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hkv != HQ)
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
    for name, dtype, balance, causal, hkv, window in CASES:
        got = results[name]
        ref = _reference(dtype, causal, hkv, window, n)
        base = _sdpa(dtype, causal, hkv, window, n) if dtype != torch.float64 else None
        for what, g, r, i in zip(("out", "dq", "dk", "dv"), got, ref, range(4)):
            assert g.dtype == dtype and g.shape == r.shape, (name, what, g.dtype, g.shape)
            err = _rel(g, r)
            bound = 1e-10 if base is None else 2 * _rel(base[i], r) + 1e-6
            if not err <= bound:
                failures.append(f"{name} {what}: err {err:.3e} > {bound:.3e}")
    assert not failures, "\n".join(failures)
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
