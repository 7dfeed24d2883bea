"""Masked and windowed attention: our Triton kernel against SDPA's kernels that take them.

    PYTHONPATH=src python3 benchmarks/masked_dispatch_gpu.py --out $OUT/masked.json [--commit SHA]

sdpa.cudnn declines masks and windows (it gives non-zero output for fully masked rows), so
these calls go to sdpa.efficient unless Triton is faster: this measures that choice for the
priority data. bf16, B=2, H=16, D=128, N=4096: a boolean mask broadcast over heads, an
additive mask, and a causal sliding window (1024, 0) (SDPA gets it as a boolean mask);
forward and forward+backward, do_bench median, each output checked against SDPA's math
kernel in float32 first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from adaattn.backends import triton_attention as ta

B, H, N, D = 2, 16, 4096, 128


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "masked_dispatch.json"))
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device=dev, generator=g, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    keep = torch.rand(B, 1, N, N, device=dev, generator=g) > 0.1
    i = torch.arange(N, device=dev)
    window_keep = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 1024)
    cases = {
        "bool mask": dict(ours=dict(attn_mask=keep), sdpa=dict(attn_mask=keep)),
        "additive mask": dict(ours=dict(attn_mask=torch.where(keep, 0.0, -1e4).to(torch.bfloat16)),
                              sdpa=dict(attn_mask=torch.where(keep, 0.0, -1e4).to(torch.bfloat16))),
        "causal window (1024, 0)": dict(ours=dict(is_causal=True, window=(1024, 0)), sdpa=dict(attn_mask=window_keep)),
    }
    rows = []
    grad = torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16)
    for name, c in cases.items():
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **{
                kk: (vv.float() if isinstance(vv, torch.Tensor) and vv.is_floating_point() else vv)
                for kk, vv in c["sdpa"].items()})
        impls = {
            "triton": lambda c=c: ta.triton_attention(q, k, v, **c["ours"]),
            "sdpa.efficient": lambda c=c: _pinned(SDPBackend.EFFICIENT_ATTENTION, q, k, v, c["sdpa"]),
        }
        for impl, fn in impls.items():
            row = {"case": name, "impl": impl, "n": N}
            try:
                with torch.no_grad():
                    out = fn()
                row["err_vs_fp32_math"] = ((out.float() - ref).norm() / ref.norm()).item()
                with torch.no_grad():
                    row["fwd_ms"] = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

                def step(fn=fn):
                    for t in (q, k, v):
                        t.grad = None
                    fn().backward(grad)

                row["fwd_bwd_ms"] = triton.testing.do_bench(step, warmup=5, rep=40, return_mode="median")
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            rows.append(row)
            print(f"{name:26s} {impl:15s} " + (f"fwd {row['fwd_ms']:.3f} ms  fwd+bwd {row['fwd_bwd_ms']:.3f} ms  "
                                              f"err {row['err_vs_fp32_math']:.2e}" if "fwd_ms" in row else row["error"]),
                  flush=True)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "commit": args.commit, "shape": f"bf16 B={B} H={H} N={N} D={D}", "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def _pinned(backend, q, k, v, kw):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, **kw)


if __name__ == "__main__":
    sys.exit(main())
