"""Measure each SDPA kernel per shape class on this GPU: the data behind src/adaattn/priority.json.

    PYTHONPATH=src python3 benchmarks/sdpa_priority.py --out benchmarks/results/sdpa-priority-<gpu>.json

For each (dtype, sequence bucket, causal, forward or forward+backward) it times every backend
adaattn can pin (sdpa.cudnn, sdpa.flash, sdpa.efficient, flash_attn where installed) and plain
torch SDPA, with triton.testing.do_bench (median), and prints the fastest per class last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import triton

import adaattn
from adaattn import Policy
from adaattn.backends import REGISTRY
from adaattn.problem import validate

BACKENDS = ["sdpa.cudnn", "sdpa.flash", "sdpa.efficient", "flash_attn"]


def flops(b, h, nq, nk, d, causal, backward):
    f = 4 * b * h * nq * nk * d * (0.5 if causal and nq == nk else 1.0)
    return f * (3.5 if backward else 1.0)


def time_call(fn, backward, inputs):
    if backward:
        out = fn()
        grad = torch.randn_like(out)

        def step():
            for t in inputs:
                t.grad = None
            fn().backward(grad)

        return triton.testing.do_bench(step, warmup=10, rep=50, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    rows = []
    shapes = [
        # bucket, b, hq, hkv, nq, nk, d
        ("short", 16, 16, 16, 256, 256, 128),
        ("medium", 2, 16, 16, 1024, 1024, 128),
        ("medium", 2, 16, 16, 4096, 4096, 128),
        ("long", 2, 16, 16, 16384, 16384, 128),
        ("decode", 16, 32, 8, 1, 8192, 128),
        ("decode", 16, 32, 8, 1, 32768, 128),
        ("medium", 2, 32, 8, 4096, 4096, 128),
        ("medium", 2, 16, 16, 4096, 4096, 64),
    ]
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float16]
    for dtype in dtypes:
        for bucket, b, hq, hkv, nq, nk, d in shapes:
            for causal in (False, True):
                if nq == 1 and causal:
                    continue
                for backward in (False, True):
                    if nq == 1 and backward:
                        continue
                    q = torch.randn(b, hq, nq, d, device="cuda", dtype=dtype, requires_grad=backward)
                    k = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype, requires_grad=backward)
                    v = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype, requires_grad=backward)
                    gqa = hq != hkv
                    with torch.no_grad() if not backward else torch.enable_grad():
                        prob = validate(q, k, v, None, 0.0, causal, None, gqa, "bhsd", None)
                    entry = {"dtype": str(dtype).replace("torch.", ""), "bucket": bucket, "shape": [b, hq, hkv, nq, nk, d],
                             "causal": causal, "backward": backward, "ms": {}, "tflops": {}}
                    cands = {name: (lambda name=name: adaattn.attention(q, k, v, is_causal=causal, enable_gqa=gqa, policy=Policy(backends=(name,))))
                             for name in BACKENDS if not REGISTRY[name].supports(prob)}
                    cands["torch"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
                    cands["adaattn"] = lambda: adaattn.attention(q, k, v, is_causal=causal, enable_gqa=gqa)
                    for name, fn in cands.items():
                        try:
                            ms = time_call(fn, backward, (q, k, v))
                        except Exception as e:  # record and go on
                            entry["ms"][name] = None
                            entry.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:160]}"
                            continue
                        entry["ms"][name] = ms
                        entry["tflops"][name] = flops(b, hq, nq, nk, d, causal, backward) / ms / 1e9
                    timed = {k_: v_ for k_, v_ in entry["ms"].items() if v_ is not None and k_ not in ("torch", "adaattn")}
                    entry["fastest"] = min(timed, key=timed.get) if timed else None
                    entry["chosen"] = adaattn.explain(q, k, v, is_causal=causal, enable_gqa=gqa).chosen
                    rows.append(entry)
                    del q, k, v
                    torch.cuda.empty_cache()
    overhead = measure_overhead()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    except Exception:
        commit = None
    result = {"gpu": dev, "torch": torch.__version__, "triton": triton.__version__, "commit": commit,
              "date": time.strftime("%Y-%m-%d"), "rows": rows, "overhead": overhead}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{dev}, torch {torch.__version__}, triton {triton.__version__}")
    hdr = f"{'dtype':<9}{'bucket':<7}{'shape':<28}{'c':<2}{'bwd':<4}" + "".join(f"{n:>15}" for n in BACKENDS + ["torch", "adaattn"]) + "  fastest / chosen"
    print(hdr)
    for r in rows:
        cells = "".join(f"{(r['tflops'].get(n) or 0):>15.1f}" if r["ms"].get(n) else f"{'-':>15}" for n in BACKENDS + ["torch", "adaattn"])
        print(f"{r['dtype']:<9}{r['bucket']:<7}{str(r['shape']):<28}{int(r['causal']):<2}{int(r['backward']):<4}{cells}  {r['fastest']} / {r['chosen']}")
    for o in overhead:
        print(f"overhead N={o['n']}: adaattn {o['adaattn_us']:.1f} us/call, pinned sdpa {o['pinned_us']:.1f}, plain sdpa {o['plain_us']:.1f} "
              f"-> +{o['adaattn_us'] - o['pinned_us']:.1f} us ({100 * (o['adaattn_us'] / o['pinned_us'] - 1):.1f}%) vs pinned")
    return 0


def measure_overhead():
    """Wall-clock per call (many calls, one synchronise), adaattn vs SDPA pinned to the same kernel."""
    from torch.nn.attention import sdpa_kernel

    out = []
    for n in (128, 4096):
        q = torch.randn(2, 16, n, 128, device="cuda", dtype=torch.bfloat16)
        chosen = adaattn.explain(q, q, q).chosen
        kernel = REGISTRY[chosen].kernel if chosen.startswith("sdpa.") else None
        F = torch.nn.functional.scaled_dot_product_attention

        def ada():
            return adaattn.attention(q, q, q)

        def pinned():
            with sdpa_kernel(kernel):
                return F(q, q, q)

        def plain():
            return F(q, q, q)

        calls = 2000 if n == 128 else 200
        res = {"n": n, "chosen": chosen}
        samples = {"ada": [], "pinned": [], "plain": []}
        for _ in range(7):
            for name, fn in (("ada", ada), ("pinned", pinned), ("plain", plain)):
                fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
                samples[name].append((time.perf_counter() - t0) / calls * 1e6)
        med = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
        res.update(adaattn_us=med["ada"], pinned_us=med["pinned"], plain_us=med["plain"])
        out.append(res)
    return out


if __name__ == "__main__":
    sys.exit(main())
