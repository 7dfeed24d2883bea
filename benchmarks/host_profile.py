"""Where one call's host time goes, on the GPU machine: cProfile over N calls issued while the GPU
sleeps (so no call waits on it), the top functions by own time and by cumulative time.

    python benchmarks/host_profile.py [--path triton_fwd|triton_train|window_train|decode|append|small]
                                      [--calls 200] [--top 25]

Paths as in `adaattn bench --suite host` (B2 H16 D128 bf16 4k; decode B16 Hq32 Hkv8 D128 8k).
Each path is warmed (compiles, tuning, plans) before profiling.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import adaattn
from adaattn import Policy
from adaattn.kv import KVCache


def _calls(path: str):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s, grad=False):
        t = torch.randn(*s, generator=g, device=dev, dtype=torch.bfloat16)
        return t.requires_grad_() if grad else t

    if path in ("triton_fwd", "triton_train", "window_train"):
        q, k, v = (rnd(2, 16, 4096, 128, grad=True) for _ in range(3))
        go = rnd(2, 16, 4096, 128)
        kw = dict(is_causal=True)
        if path == "window_train":
            kw["window"] = (1023, 0)
        else:
            kw["policy"] = Policy(backends=("triton",))
        if path == "triton_fwd":
            def call():
                with torch.no_grad():
                    adaattn.attention(q, k, v, **kw)
        else:
            def call():
                torch.autograd.grad(adaattn.attention(q, k, v, **kw), (q, k, v), go)
        return call
    s, hq, hkv, n, d = 16, 32, 8, 8192, 128
    cache = KVCache(1, s, hkv, n + 8192, d, dtype=torch.bfloat16, device=dev)
    cache.append(0, rnd(s, hkv, n, d), rnd(s, hkv, n, d))
    if path == "decode":
        qd = rnd(s, hq, 1, d)
        plan = adaattn.plan_decode(cache, heads=hq, query_len=1)
        return lambda: adaattn.decode_attention(qd, cache, 0, plan=plan)
    if path == "append":
        k1, v1 = rnd(s, hkv, 1, d), rnd(s, hkv, 1, d)
        return lambda: cache.append(0, k1, v1)
    if path == "small":
        qs = rnd(1, 8, 64, 64)
        return lambda: adaattn.attention(qs, qs, qs)
    raise ValueError(f"unknown path {path!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", default="triton_fwd")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    call = _calls(args.path)
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second on an H100/H200: the GPU stays busy while we issue
    t0 = time.perf_counter()
    for _ in range(args.calls // 4):
        call()
    plain_us = (time.perf_counter() - t0) / (args.calls // 4) * 1e6
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    torch.cuda._sleep(int(4e9))
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    print(f"{args.path}: {plain_us:.1f} us a call unprofiled (GPU held), {args.calls} calls profiled")
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
