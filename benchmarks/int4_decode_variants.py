"""INT4 decode: the split-KV kernel's time as shipped against its earlier INT4 tile loads, and
against the same caches in bf16 and INT8 and against cuDNN (benchmarks/NOTES.md, sessions 40-41).

Each variant swaps a @triton.jit helper of adaattn.kernels.decode (load_int4 or int4_tile) in a
fresh process before anything compiles, so every variant compiles on its own:

- A: as shipped (since session 41: a token's scales and minima of every group in one vector load,
  and the window's ring read only in tiles that reach the newest W keys);
- S: the scales and minima by two scalar loads a group (the kernel of session 40);
- M: the ring's loads masked in every tile (the kernel of session 40);
- SM: both, the kernel of session 40 as it was.

Times are the decode_attention call with a plan, captured in a CUDA graph, replayed one at a time
with L2 cleared (256 MiB zeroed) before each: median of --reps, in us. B16 Hkv8 32k, bf16, D 64 (Hq
24) and 128 (Hq 32); each row also gives the output's error against float64 over the unquantized
keys and values and the plan's stages. Errors of every variant must equal A's (same arithmetic).
Session 41's table (A then held SM's loads, and D, W, DW the loads now shipped) is
results/2026-11-29-int4-decode-variants-A-D-W-DW-h200.json.

    python benchmarks/int4_decode_variants.py [--variants A,S,M,SM] [--kv-len 32768] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/int4_decode_variants.py --check   # CPU: outputs equal A's
    (each variant in its own process: the interpreter keeps the helpers its first call found)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def load_int4_scalar_scales(row_ptrs, scale_ptrs, live, stride_d, WIDTH: tl.constexpr,
                            GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """kernels/decode.load_int4 as in session 40: each group's scale and minimum in two loads (the
    pairs 2 apart, as the pools lay them; session 40 read that stride from the pools)."""
    half = tl.arange(0, BLOCK_W // 2)
    b = tl.load(row_ptrs + half[None, :] * stride_d, mask=live[:, None] & (half[None, :] < WIDTH // 2), other=0)
    b = b.to(tl.int32)
    codes = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_N, BLOCK_W)).to(tl.float32)
    NG: tl.constexpr = BLOCK_W // GROUP
    grp = tl.arange(0, NG)
    at = scale_ptrs + grp[None, :] * 2
    ok = live[:, None] & (grp[None, :] < WIDTH // GROUP)
    scale = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    low = tl.load(at + 1, mask=ok, other=0.0).to(tl.float32)
    x = tl.reshape(codes, (BLOCK_N, NG, GROUP)) * scale[:, :, None] + low[:, :, None]
    return tl.reshape(x, (BLOCK_N, BLOCK_W))


load_int4 = None  # the load the M tile calls: the shipped one or S's (set by swap, before compiling)


@triton.jit
def int4_tile_masked_ring(K, V, KS, VS, KW, VW, centre, page, slot, keys, live, length, seq, hk,
                          stride_kp, stride_kn, stride_kh, stride_kd, stride_vp, stride_vn, stride_vh, stride_vd,
                          stride_ksp, stride_ksn, stride_ksh, stride_vsp, stride_vsn, stride_vsh, stride_ws,
                          stride_wn, stride_wh, stride_wd, stride_xs, stride_xn, stride_xh, stride_xd, D: tl.constexpr, DV: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                          WINDOW: tl.constexpr):
    """kernels/decode.int4_tile as in session 40: the ring's loads masked in every tile."""
    dq = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    paged = live
    if WINDOW > 0:
        newest = live & (keys >= length - WINDOW)
        paged = live & (keys < length - WINDOW)
    k = load_int4(K + page[:, None] * stride_kp + slot[:, None] * stride_kn + hk * stride_kh,
                  KS + page[:, None] * stride_ksp + slot[:, None] * stride_ksn + hk * stride_ksh, paged,
                  stride_kd, D, GK, BLOCK_N, BLOCK_D)
    v = load_int4(V + page[:, None] * stride_vp + slot[:, None] * stride_vn + hk * stride_vh,
                  VS + page[:, None] * stride_vsp + slot[:, None] * stride_vsn + hk * stride_vsh, paged,
                  stride_vd, DV, GV, BLOCK_N, BLOCK_DV)
    if WINDOW > 0:
        ring = keys % WINDOW
        kw = tl.load(KW + seq.to(tl.int64) * stride_ws + ring[:, None] * stride_wn + hk * stride_wh
                     + dq[None, :] * stride_wd, mask=newest[:, None] & (dq[None, :] < D), other=0.0).to(tl.float32)
        k = k + tl.where(newest[:, None], kw - centre[None, :], 0.0)
        v = v + tl.load(VW + seq.to(tl.int64) * stride_xs + ring[:, None] * stride_xn + hk * stride_xh
                        + dv[None, :] * stride_xd, mask=newest[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
    return k, v


def swap(variant: str) -> None:
    """Put the variant's helpers into adaattn.kernels.decode (before anything compiles)."""
    from adaattn.kernels import decode as kd

    if "S" in variant:
        kd.load_int4 = load_int4_scalar_scales
    if "M" in variant:
        globals()["load_int4"] = kd.load_int4
        kd.int4_tile = int4_tile_masked_ring


LAYOUTS = (("int4", dict(storage="int4")), ("int4 g64", dict(storage="int4", group_size=64)),
           ("int4 w512", dict(storage="int4", window=512)))


def _caches(d: int, hq: int, n: int, device: str, layouts):
    from adaattn import plan_decode
    from adaattn.kv import KVCache

    torch.manual_seed(0)
    b, hkv = (16, 8) if device == "cuda" else (2, 2)
    k = torch.randn(b, hkv, n, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(b, hkv, n, d, device=device, dtype=torch.bfloat16)
    q = torch.randn(b, hq if device == "cuda" else 2 * hkv, 1, d, device=device, dtype=torch.bfloat16)
    for name, kw in layouts:
        if "window" in kw and device != "cuda":
            kw = dict(kw, window=16)
        cache = KVCache(1, b, hkv, n + 1, d, dtype=torch.bfloat16, device=device, page_size=64, **kw)
        cache.append(0, k, v)
        if cache.storage == "int4":
            assert cache.k_scale[0].stride()[3] == 2 and cache.k_scale[0].stride()[-1] == 1, "pairs not together"
        yield name, q, k, v, cache, plan_decode(cache, heads=q.shape[1], runner="triton")


def _timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def worker(variant: str, n: int, reps: int) -> dict:
    swap(variant)
    from adaattn import decode_attention

    out = {}
    for d, hq in ((64, 24), (128, 32)):
        layouts = LAYOUTS if variant != "A" else (("bf16", {}), ("int8", dict(storage="int8"))) + LAYOUTS
        for name, q, k, v, cache, plan in _caches(d, hq, n, "cuda", layouts):
            ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                   enable_gqa=True)
            call = lambda: decode_attention(q, cache, 0, plan=plan)  # noqa: E731
            err = float((call().double() - ref).norm() / ref.norm())
            out[f"D{d} {name}"] = {"us": round(_timed(call, reps), 1), "rel_err": err, "stages": plan.num_stages}
            del cache
            torch.cuda.empty_cache()
        if variant == "A":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def cudnn():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            out[f"D{d} cuDNN"] = {"us": round(_timed(cudnn, reps), 1)}
    return out


def outputs(variant: str) -> dict:
    """CPU (TRITON_INTERPRET=1): the variant's outputs on small caches, as lists. (One variant a
    process: the interpreter keeps the helpers its first call found.)"""
    swap(variant)
    from adaattn import decode_attention

    return {name: decode_attention(q, cache, 0, plan=plan).float().flatten().tolist()
            for name, q, _, _, cache, plan in _caches(64, 4, 200, "cpu", LAYOUTS)}


def _in_process(variant: str, *args: str) -> dict:
    run = subprocess.run([sys.executable, __file__, "--worker", variant, *args], capture_output=True, text=True,
                         env=dict(os.environ))
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    return json.loads(line[7:]) if line else {"error": (run.stderr or run.stdout)[-600:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="A,S,M,SM")
    p.add_argument("--kv-len", type=int, default=32768)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", default=None)
    p.add_argument("--check", action="store_true", help="CPU, under TRITON_INTERPRET=1: outputs equal A's")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if args.worker:
        got = outputs(args.worker) if args.check else worker(args.worker, args.kv_len, args.reps)
        print("RESULT " + json.dumps(got))
        return 0
    if args.check:
        shipped = _in_process("A", "--check")
        diffs = {}
        for v in (v for v in variants if v != "A"):
            got = _in_process(v, "--check")
            diffs[v] = {name: (max(abs(a - b) for a, b in zip(got[name], want)) if name in got else got.get("error"))
                        for name, want in shipped.items()}
        print(json.dumps(diffs))
        return 0 if all(x == 0.0 for d in diffs.values() for x in d.values()) else 1
    results = {}
    for v in variants:  # each in its own process: its helpers compile from scratch
        results[v] = _in_process(v, "--kv-len", str(args.kv_len), "--reps", str(args.reps))
        print(v, json.dumps(results[v]), flush=True)
    if args.json:
        meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__, "triton": triton.__version__, "kv_len": args.kv_len, "reps": args.reps}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "variants": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
