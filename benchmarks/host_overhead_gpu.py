"""Host time of the quantized path, piece by piece (GPU): at a small N every call is host-bound,
so wall time per call is host time. Prints per-call microseconds and cProfile summaries.

    PYTHONPATH=src python3 benchmarks/host_overhead_gpu.py [--out FILE] [--n 256]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402

import adaattn  # noqa: E402
from adaattn.adaptive import analysis  # noqa: E402
from adaattn.backends import triton_attention as ta  # noqa: E402
from adaattn.backends import triton_quant as tq  # noqa: E402

DEVICE = "cuda"
B, H, D = 2, 16, 128


def wall_us(fn, calls=300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def profile(fn, calls=300, sort="tottime", top=25) -> str:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(top)
    return s.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "host_overhead.json"))
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    n = args.n
    q, k, v = (torch.randn(B, H, n, D, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": args.commit, "shape": f"bf16 B={B} H={H} N={n} D={D}", "rows": [], "profiles": {}}
    qk_mode, pv_mode = tq.level_modes(tq.LEVEL_FP8, True)
    prepared = tq.Prepared(k, v)
    kq, kscale, vq, v_scale, v_mean, n_blocks = prepared.get(qk_mode, pv_mode, 128)
    out = torch.empty_like(q)
    qq = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    qs = torch.empty((B * H, n), dtype=torch.float32, device=DEVICE)
    descs = (ta.TensorDescriptor(kq, list(kq.shape), list(kq.stride()), [1, 1, 128, D]),
             ta.TensorDescriptor(vq, list(vq.shape), list(vq.stride()), [1, 1, D, 128]))
    ta.ensure_triton_allocator()

    def ws_kernel(descs=descs):
        tq.attention_fp8_ws_kernel[(triton.cdiv(n, 128), B * H)](
            qq, qs, *descs, kscale, v_scale, v_mean, out, out.stride(0), out.stride(1), out.stride(2),
            H, 1, n, n, n, n_blocks, 0.1, HEAD_DIM=D, BLOCK_M=128, BLOCK_N=128, CAUSAL=False, BOTTOM_RIGHT=False,
            K_TAIL=False, DOT_PRECISION="tf32", EMULATE=False, WARP_SPEC=True, num_warps=4, num_stages=2)

    def ws_kernel_new_desc():
        ws_kernel((ta.TensorDescriptor(kq, list(kq.shape), list(kq.stride()), [1, 1, 128, D]),
                   ta.TensorDescriptor(vq, list(vq.shape), list(vq.stride()), [1, 1, D, 128])))

    def qpass():
        tq.quantize_q_kernel[(triton.cdiv(n, 64), B * H)](
            q, qq, qs, q.stride(0), q.stride(1), q.stride(2), H, n, n, HEAD_DIM=D, BLOCK_M=64, EMULATE=False,
            num_warps=4, num_stages=1)

    def empty_launch():
        torch.empty(1, device=DEVICE)

    pols = {tau: adaattn.Policy(mode="auto", precisions=("native", "int8", "fp8"), tolerance=tau, verify=0.0)
            for tau in (3e-2, 8e-2)}
    pols.update({f"v{tau}": adaattn.Policy(mode="auto", precisions=("native", "int8", "fp8"), tolerance=tau / 100,
                                           verify=1.0) for tau in (3, 8)})
    rows_idx = analysis.sample_rows(n, 64, None, DEVICE)
    ref, _ = analysis.exact_rows(q, k, v, rows_idx, None, D ** -0.5, need_p=False)
    fns = {
        "torch.empty (baseline)": empty_launch,
        "sdpa.cudnn": lambda: _cudnn(q, k, v),
        "fp8 ws kernel launch (descriptors made once)": ws_kernel,
        "fp8 ws kernel launch (descriptors per call)": ws_kernel_new_desc,
        "quantize_q launch": qpass,
        "Prepared(k, v).get fp8 (1 launch)": lambda: tq.Prepared(k, v).get(qk_mode, pv_mode, 128),
        "Prepared(k, v).get qk8 (1 launch)": lambda: tq.Prepared(k, v).get(*tq.level_modes(tq.LEVEL_QK8), 64),
        "_launch_quant_ws fp8 (prepared)": lambda: tq._launch_quant_ws(tq.LEVEL_FP8, q, v, prepared, out, 0.1, False,
                                                                       False),
        "quant_attention fp8": lambda: tq.quant_attention(q, k, v, levels=[tq.LEVEL_FP8], fp8_qk=True),
        "quant_attention qk8 (warp-specialised)": lambda: tq.quant_attention(q, k, v, levels=[tq.LEVEL_QK8]),
        "quant_attention qk8 (general kernel)": lambda: _general(lambda: tq.quant_attention(
            q, k, v, levels=[tq.LEVEL_QK8])),
        "triton_attention exact": lambda: ta.triton_attention(q, k, v),
        "attention auto 3e-2 verify=0": lambda: adaattn.attention(q, k, v, policy=pols[3e-2], label="h3"),
        "attention auto 8e-2 verify=0": lambda: adaattn.attention(q, k, v, policy=pols[8e-2], label="h8"),
        "attention exact (default policy)": lambda: adaattn.attention(q, k, v),
        "attention auto 3e-2 verify=1 (every call verified)": lambda: adaattn.attention(
            q, k, v, policy=pols["v3"], label="v3"),
        "attention auto 8e-2 verify=1 (every call verified)": lambda: adaattn.attention(
            q, k, v, policy=pols["v8"], label="v8"),
        "attention auto 8e-2 verify=1, torch verification": lambda: _torch_verification(
            lambda: adaattn.attention(q, k, v, policy=pols["v8"], label="v8t")),
        "sample_rows": lambda: analysis.sample_rows(n, 64, None, DEVICE),
        "exact_rows (64 rows)": lambda: analysis.exact_rows(q, k, v, rows_idx, None, 0.1, need_p=False),
        "head_errors": lambda: analysis.head_errors(out.index_select(2, rows_idx), ref),
    }
    with torch.no_grad():
        for name, fn in fns.items():
            try:
                us = wall_us(fn)
                result["rows"].append({"impl": name, "us_per_call": us})
                print(f"{name:48s} {us:8.1f} us/call", flush=True)
            except Exception as e:
                result["rows"].append({"impl": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"{name:48s} {type(e).__name__}: {str(e)[:300]}", flush=True)
        for name in ("attention auto 3e-2 verify=0", "quant_attention qk8 (warp-specialised)",
                     "attention auto 3e-2 verify=1 (every call verified)"):
            for sort in ("tottime", "cumulative"):
                text = profile(fns[name], sort=sort)
                result["profiles"][f"{name} by {sort}"] = text
                print(f"--- {name} by {sort}\n{text}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def _general(fn):
    with ta.kernel_variants(fwd="ptr"):
        return fn()


def _torch_verification(fn):
    """fn() with sampled verification on its torch path (kernels/verify.py off)."""
    from adaattn.backends import triton_verify

    saved = triton_verify.exact_rows, triton_verify.verify_step
    triton_verify.exact_rows, triton_verify.verify_step = (lambda *a: None), (lambda *a: False)
    try:
        return fn()
    finally:
        triton_verify.exact_rows, triton_verify.verify_step = saved


def _cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v)


if __name__ == "__main__":
    sys.exit(main())
