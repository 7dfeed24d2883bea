"""The quantization pre-pass alone on one GPU, GPU time (CUDA-graph replay) per setting.

    PYTHONPATH=src python3 benchmarks/prepass_sweep_gpu.py --out $OUT/prepass.json

bf16 B=2 H=16 D=128, N in {4096, 16384}: for the qk8 warp-specialised path (INT8 K, 128-key
blocks, INT8 Q in the same launch) and the fp8 one (FP8 K and V, 256-key blocks, E4M3 Q), the pre-pass's GPU time for each (key blocks per program at most, slice
elements, warps) of triton_quant's PREPASS_* settings, and the bandwidth it reaches (bytes read
once + written over the time). (The fifth session's first sweeps also timed a V statistics
launch, since removed: results/2026-11-22-prepass-sweep-*.json.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton

from adaattn.backends import triton_quant as tq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_timing  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prepass.json"))
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    b, h, d = 2, 16, 128
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": args.commit, "shape": f"bf16 B={b} H={h} D={d}", "rows": []}
    defaults = (tq.PREPASS_MAX_BLOCKS, tq.PREPASS_SLICE, tq.PREPASS_WARPS)
    for n in (4096, 16384):
        tq.PREPASS_MAX_BLOCKS, tq.PREPASS_SLICE, tq.PREPASS_WARPS = defaults
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for level, block_n in ((tq.LEVEL_QK8, 128), (tq.LEVEL_FP8, 256)):
            qk, pv = tq.level_modes(level, True)
            # bytes: Q, K (and V) read once, their quantized copies written (1 byte per element)
            elems = q.numel() * (3 if level == tq.LEVEL_FP8 else 2)
            moved = elems * 3
            for blocks, slice_, warps in itertools.product((1, 2, 4), (8192, 16384), (4, 8)):
                tq.PREPASS_MAX_BLOCKS, tq.PREPASS_SLICE, tq.PREPASS_WARPS = blocks, slice_, warps

                def run():
                    tq.Prepared(k, v).get(qk, pv, block_n, tq.QuantizedQ(q, qk))

                try:
                    ms = gpu_timing.graph_ms(run)
                except Exception as e:
                    ms = None
                    print(f"  failed: {type(e).__name__}: {e}", flush=True)
                row = {"n": n, "level": tq.LEVELS[level], "block_n": block_n, "max_blocks": blocks,
                       "slice": slice_, "warps": warps, "ms": ms,
                       "tb_per_s": moved / ms / 1e9 if ms else None}
                result["rows"].append(row)
                print(f"N={n:6d} {tq.LEVELS[level]:4s} blocks<={blocks} slice {slice_} warps {warps}: "
                      + (f"{ms * 1000:7.1f} us  {row['tb_per_s']:.2f} TB/s" if ms else "-"), flush=True)
        # Q alone, at the defaults
        tq.PREPASS_MAX_BLOCKS, tq.PREPASS_SLICE, tq.PREPASS_WARPS = defaults
        qq = tq.QuantizedQ(q, tq.QK_FP8)

        def q_alone():
            qq.done = False
            qq.ensure()

        qa = gpu_timing.graph_ms(q_alone)
        result["rows"].append({"n": n, "piece": "quantize_q_kernel alone", "ms": qa})
        print(f"N={n}: Q alone {qa * 1000:.1f} us", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
