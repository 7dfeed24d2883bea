"""Does a copy pay? Time adaattn on views a fused kernel cannot load as they are (it copies them:
sdpa.fused_form) against torch's math kernel (what would run if the fused runners declined) and
against the same call on aligned tensors. One call at a time, L2 cleared, median of rounds.

    PYTHONPATH=src python -m tests.fuzz.copy_cost [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _time(fn, rounds=15):
    flush = torch.empty(64 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    times = []
    for _ in range(rounds):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(argv=None) -> int:
    import adaattn

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for n, d, dtype, view in ((1024, 128, torch.bfloat16, "slice_odd"), (4096, 128, torch.bfloat16, "slice_odd"),
                              (4096, 128, torch.bfloat16, "last_transposed"), (4096, 100, torch.bfloat16, "odd_dim"),
                              (256, 64, torch.float32, "slice_odd"), (2048, 64, torch.float32, "slice_odd")):
        b, h = 2, 16
        base = torch.randn(b, h, n, d + 3, dtype=dtype, device="cuda")
        aligned = torch.randn(b, h, n, d, dtype=dtype, device="cuda")
        if view == "slice_odd":
            q = base[..., 3:3 + d]
        elif view == "last_transposed":
            q = torch.randn(b, h, d, n, dtype=dtype, device="cuda").transpose(-1, -2)
        else:
            q = aligned
        k, v = aligned, torch.randn_like(aligned)
        ours = _time(lambda: adaattn.attention(q, k, v, is_causal=True))
        ran = adaattn.explain(q, k, v, is_causal=True).chosen
        fresh = _time(lambda: adaattn.attention(aligned, k, v, is_causal=True))

        def math():
            with sdpa_kernel(SDPBackend.MATH):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        math_ms = _time(math)
        row = {"n": n, "d": d, "dtype": str(dtype).replace("torch.", ""), "view": view, "runner": ran,
               "ours_copy_ms": round(ours, 4), "aligned_ms": round(fresh, 4), "math_ms": round(math_ms, 4),
               "copy_vs_math": round(math_ms / ours, 2), "copy_overhead": round(ours / fresh, 3)}
        rows.append(row)
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
