"""Bound launches against triton's own on a GPU: outputs and gradients bitwise equal, path by path.

Each path runs with bound launches off (backends/triton/bound.py: triton's JITFunction.run), then
on twice (the first fills the bound table through triton's launch, the second is a bound launch),
and the bound call's outputs and gradients must equal the first call's bit for bit. Backward paths
run under torch.use_deterministic_algorithms (our deterministic backward: no atomics), so equal
launches give equal bits.

    python benchmarks/bound_launch_check.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import adaattn
from adaattn import Policy
from adaattn.backends.triton import bound as B
from adaattn.kv import KVCache, PagedKVCache


def _paths(dev):
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s, dt=torch.bfloat16, grad=False):
        t = torch.randn(*s, generator=g, device=dev, dtype=dt)
        return t.requires_grad_() if grad else t

    out = {}
    for name, pol in (("triton", Policy(backends=("triton",))), ("ptr", Policy(backends=("triton.ptr",))),
                      ("tma", Policy(backends=("triton.tma",))), ("ws", Policy(backends=("triton.ws",)))):
        for causal in (False, True):
            for hk in (8, 2):
                q, k, v = rnd(2, 8, 300, 128, grad=True), rnd(2, hk, 300, 128, grad=True), rnd(2, hk, 300, 128, grad=True)
                out[f"{name} causal={causal} hkv={hk}"] = (
                    lambda q=q, k=k, v=v, pol=pol, causal=causal: adaattn.attention(
                        q, k, v, is_causal=causal, enable_gqa=True, policy=pol), (q, k, v))
    q, k, v = (rnd(1, 4, 1000, 64, dt=torch.float16, grad=True) for _ in range(3))
    out["window (100, 0) fp16"] = (lambda: adaattn.attention(q, k, v, is_causal=True, window=(100, 0)), (q, k, v))
    mask = torch.rand(1, 1, 1000, 1000, device=dev) > 0.3
    out["bool mask triton"] = (lambda: adaattn.attention(q, k, v, attn_mask=mask, policy=Policy(backends=("triton",))),
                               (q, k, v))
    sinks = rnd(4, dt=torch.float32, grad=True)
    out["softcap+sinks+alibi triton.ptr"] = (
        lambda: adaattn.attention(q, k, v, is_causal=True, softcap=20.0, sinks=sinks,
                                  alibi_slopes=torch.linspace(0.1, 0.5, 4, device=dev),
                                  policy=Policy(backends=("triton.ptr",))), (q, k, v, sinks))
    qp, kp, vp = (rnd(700, 4, 64, dt=torch.float16, grad=True) for _ in range(3))
    cu = torch.tensor([0, 100, 450, 700], device=dev, dtype=torch.int32)
    out["varlen"] = (lambda: adaattn.varlen_attention(qp, kp, vp, cu, cu, 350, 350, is_causal=True), (qp, kp, vp))
    xq = rnd(2, 8, 512, 128)
    out["auto fp8/int8"] = (lambda: adaattn.attention(
        xq, xq, xq, is_causal=True, policy=Policy(mode="auto", precisions=("native", "int8", "fp8"), tolerance=5e-2,
                                                  backends=("triton.quant.ws", "triton.quant.general"))), ())
    for storage in ("native", "int8", "int4", "fp8"):
        for paged in (False, True):
            s, hq, hkv, d = 4, 16, 4, 128
            if paged:
                cache = PagedKVCache(1, hkv, d, num_pages=80, page_size=64, dtype=torch.bfloat16, device=dev,
                                     max_seqs=s, storage=storage)
                seqs = [cache.add() for _ in range(s)]
                for i, n in zip(seqs, (700, 1, 64, 1000)):
                    cache.append(0, [i], rnd(1, hkv, n, d), rnd(1, hkv, n, d))
            else:
                cache = KVCache(1, s, hkv, 1200, d, dtype=torch.bfloat16, device=dev, storage=storage)
                cache.append(0, rnd(s, hkv, 900, d), rnd(s, hkv, 900, d))
                seqs = None
            qd = rnd(s, hq, 1, d)
            plan = adaattn.plan_decode(cache, seqs, heads=hq, query_len=1)
            out[f"decode {storage} paged={paged}"] = (
                lambda qd=qd, cache=cache, plan=plan: adaattn.decode_attention(qd, cache, 0, plan=plan), ())
    return out


def _run(call, inputs):
    torch.manual_seed(0)
    o = call()
    o = o[0] if isinstance(o, tuple) else o
    grads = ()
    if inputs and o.requires_grad:
        grads = torch.autograd.grad(o, inputs, torch.ones_like(o) * 0.01, allow_unused=True)
    torch.cuda.synchronize()
    return [t.detach().clone() for t in (o, *grads) if t is not None]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.use_deterministic_algorithms(True, warn_only=True)
    results = {}
    for name, (call, inputs) in _paths(dev).items():
        try:
            B.set_enabled(False)
            want = _run(call, inputs)
            B.set_enabled(True)
            _run(call, inputs)
            n_bound = sum(len(b.entries) for b in B._bound.values())
            got = _run(call, inputs)
            same = len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
            results[name] = {"bitwise_equal": same, "tensors": len(got), "bound_entries": n_bound}
        except Exception as e:  # reported: a path this GPU does not take
            results[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        finally:
            B.set_enabled(None)
        print(f"{name:40s} {results[name]}", flush=True)
    bad = [n for n, r in results.items() if r.get("bitwise_equal") is False]
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": __import__("triton").__version__, "paths": results, "not_equal": bad}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    print("not equal:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
