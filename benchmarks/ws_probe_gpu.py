"""What Triton's automatic warp specialisation buys our forward loop on Hopper: the probe kernels
of ws_probe_kernels.py (bf16, and FP8 for both products) with and without it, against SDPA's
cuDNN backend in the same run.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/ws_probe_gpu.py --out $OUT/ws_probe.json

bf16 inputs, B=2, H=16, D=128, N in {4096, 16384}, not causal (the Hopper warp-specialisation
pass of triton 3.9 rejects the probe's two-loop causal form and INT8 products; see NOTES.md).
Errors are against float64 on 64 sampled rows per (batch, head).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

B, H, D = 2, 16, 128
FP8_MAX = 448.0

# name: (QK, PV, WS, BLOCK_M, BLOCK_N, num_warps, num_stages, FRESH)
VARIANTS = {
    "bf16 plain 128/128/w8/s3": (0, 0, False, 128, 128, 8, 3, True),
    "bf16 ws 128/128/w4/s2": (0, 0, True, 128, 128, 4, 2, True),
    "bf16 ws 128/64/w4/s2": (0, 0, True, 128, 64, 4, 2, True),
    "bf16 ws 128/64/w4/s3": (0, 0, True, 128, 64, 4, 3, True),
    "fp8 plain 128/128/w8/s3": (2, 1, False, 128, 128, 8, 3, True),
    "fp8 ws 128/128/w4/s2": (2, 1, True, 128, 128, 4, 2, True),
    "fp8 ws 128/128/w4/s3": (2, 1, True, 128, 128, 4, 3, True),
    "fp8 ws 128/64/w4/s3": (2, 1, True, 128, 64, 4, 3, True),
    "fp8 ws 128/128/w4/s2 chained acc": (2, 1, True, 128, 128, 4, 2, False),
    "fp8qk bf16pv ws 128/128/w4/s2": (2, 0, True, 128, 128, 4, 2, True),
}


def log(msg):
    print(msg, flush=True)


def _alloc(size, alignment, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def prepare(q, k, v, qk_mode, pv_mode):
    """Host-side quantization for the probe (per-tensor scales, K and V smoothed by their mean)."""
    b, h, n, d = q.shape
    args = {}
    if qk_mode == 2:
        ks = k.float() - k.float().mean(dim=2, keepdim=True)
        args["q_scale"] = q.float().abs().amax().item() / FP8_MAX
        k_scale = ks.abs().amax().item() / FP8_MAX
        args["kq"] = (ks / k_scale).to(torch.float8_e4m3fn).reshape(b * h * n, d)
        args["k_scale"] = k_scale
    else:
        args["q_scale"], args["k_scale"] = 1.0, 1.0
        args["kq"] = k.reshape(b * h * n, d)
    if pv_mode == 1:
        vm = v.float().mean(dim=2, keepdim=True)
        vs = v.float() - vm
        v_scale = vs.abs().amax().item() / FP8_MAX
        args["vq"] = (vs / v_scale).to(torch.float8_e4m3fn).transpose(2, 3).contiguous().reshape(b * h * d, n)
        args["v_scale"], args["v_mean"] = v_scale, vm
    else:
        args["vq"] = v.reshape(b * h * n, d)
        args["v_scale"], args["v_mean"] = 1.0, None
    return args


def launch(name, q, prep, out):
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ws_probe_kernels import ws_probe_fwd

    qk_mode, pv_mode, ws, bm, bn, w, s, fresh = VARIANTS[name]
    b, h, n, d = q.shape
    kd = TensorDescriptor(prep["kq"], list(prep["kq"].shape), list(prep["kq"].stride()), [bn, d])
    if pv_mode == 1:
        vd = TensorDescriptor(prep["vq"], list(prep["vq"].shape), list(prep["vq"].stride()), [d, bn])
    else:
        vd = TensorDescriptor(prep["vq"], list(prep["vq"].shape), list(prep["vq"].stride()), [bn, d])
    ks = torch.full((1,), prep["k_scale"], device=q.device)
    ws_probe_fwd[(n // bm, b * h)](
        q, out, kd, vd, ks, n, n // bn, d ** -0.5 * 1.4426950408889634 * prep["k_scale"], prep["q_scale"],
        prep["v_scale"], BLOCK_M=bm, BLOCK_N=bn, D=d, QK=qk_mode, PV=pv_mode, CAUSAL=False, WS=ws,
        FRESH=fresh, num_warps=w, num_stages=s)
    if prep["v_mean"] is not None:
        out += prep["v_mean"].to(out.dtype)  # (a product kernel adds it in its epilogue)
    return out


def inputs(n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, n, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]


def _compile(name):
    import triton

    triton.set_allocator(_alloc)
    t0 = time.time()
    try:
        q, k, v = inputs(256)
        qk_mode, pv_mode = VARIANTS[name][:2]
        launch(name, q, prepare(q, k, v, qk_mode, pv_mode), torch.empty_like(q))
        torch.cuda.synchronize()
        return name, time.time() - t0, None
    except Exception as e:
        return name, time.time() - t0, f"{type(e).__name__}: {str(e)[-300:]}"


def sampled_err(out, q, k, v, rows=64):
    n = q.shape[2]
    idx = torch.linspace(0, n - 1, rows, device=q.device).long()
    s = (q[:, :, idx].double() @ k.double().transpose(-1, -2)) * D ** -0.5
    ref = torch.softmax(s, -1) @ v.double()
    o = out[:, :, idx].double()
    return ((o - ref).norm() / ref.norm()).item()


def main():
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="ws_probe.json")
    ap.add_argument("--commit", default="")
    ap.add_argument("--sizes", default="4096,16384")
    args = ap.parse_args()
    t0 = time.time()
    triton.set_allocator(_alloc)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": args.commit, "shape": {"b": B, "h": H, "d": D, "dtype": "bfloat16", "causal": False},
           "variants": {k: list(v) for k, v in VARIANTS.items()}, "compile": {}, "rows": []}
    log(f"{res['gpu']} torch {torch.__version__} triton {triton.__version__}")
    pool = mp.get_context("spawn").Pool(min(len(VARIANTS), 16))
    for name, secs, err in pool.imap_unordered(_compile, list(VARIANTS)):
        res["compile"][name] = {"s": secs, "error": err}
        log(f"  compile {name:34s} {secs:5.1f}s " + (f"FAILED {err}" if err else "ok"))
    pool.terminate()
    for n in [int(x) for x in args.sizes.split(",")]:
        q, k, v = inputs(n, n)
        flops = 4 * B * H * n * n * D
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref_out = F.scaled_dot_product_attention(q, k, v)
            ms = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v), return_mode="median")
        cud = ms
        res["rows"].append({"impl": "sdpa.cudnn", "n": n, "ms": ms, "tflops": flops / ms / 1e9,
                            "err": sampled_err(ref_out, q, k, v)})
        log(f"  N={n:5d} {'sdpa.cudnn':34s} {ms:8.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s err {res['rows'][-1]['err']:.1e}")
        for name in VARIANTS:
            row = {"impl": name, "n": n}
            if res["compile"][name]["error"]:
                row["error"] = res["compile"][name]["error"]
                res["rows"].append(row)
                continue
            try:
                qk_mode, pv_mode = VARIANTS[name][:2]
                prep = prepare(q, k, v, qk_mode, pv_mode)
                out = torch.empty_like(q)
                launch(name, q, prep, out)
                row["err"] = sampled_err(out, q, k, v)
                row["finite"] = bool(torch.isfinite(out).all())
                prep["v_mean"] = None  # time the kernel alone
                row["ms"] = triton.testing.do_bench(lambda: launch(name, q, prep, out), return_mode="median")
                row["tflops"] = flops / row["ms"] / 1e9
                row["vs_cudnn"] = cud / row["ms"]
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
            res["rows"].append(row)
            log(f"  N={n:5d} {name:34s} " + (f"{row['ms']:8.3f} ms {row['tflops']:5.0f} TFLOP/s "
                                              f"{row['vs_cudnn']:.2f}x cuDNN err {row['err']:.1e}"
                                              if "ms" in row else row["error"]))
        del q, k, v
        torch.cuda.empty_cache()
    res["wall_s"] = time.time() - t0
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
