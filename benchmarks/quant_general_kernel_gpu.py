"""The general quantized kernel alone (K/V quantized once, reused), one config, on one GPU.

    PYTHONPATH=src python3 benchmarks/quant_general_kernel_gpu.py [--n 16384] [--config 128,128,8,3]

bf16 B=2 H=16 D=128: the fp8 level (FP8 and INT8 Q.K^T) and qk8 through attention_quant_fwd_kernel
(the warp-specialised kernels off), causal and not, do_bench median of the launch alone. For A/B
comparisons of the general kernel's tile loop between commits (fifth session: per-block V scales).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from adaattn.backends import triton_attention as ta
from adaattn.backends import triton_quant as tq


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--config", default="128,128,8,3")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "quant_general_kernel.json"))
    args = ap.parse_args()
    b, h, n, d = 2, 16, args.n, 128
    cfg = ta.KernelConfig(*[int(x) for x in args.config.split(",")])
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    rows = []
    for causal in (False, True):
        for level, fp8_qk in ((tq.LEVEL_FP8, True), (tq.LEVEL_FP8, False), (tq.LEVEL_QK8, False)):
            kind = tq._KINDS[level][fp8_qk]
            prep = tq.Prepared(k, v)
            with ta.kernel_variants(fwd="ptr"), ta.forced_configs(**{kind: cfg}):
                def run():
                    tq.launch_level(q, k, v, prep, out, None, None, level, d ** -0.5, causal, False, -1, -1, fp8_qk)

                run()
                ms = triton.testing.do_bench(run, warmup=10, rep=100, return_mode="median")
            rows.append({"kind": kind, "causal": causal, "n": n, "config": str(cfg), "ms": ms})
            print(f"{kind:18s} causal={causal!s:5} {cfg}: {ms:.3f} ms", flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
