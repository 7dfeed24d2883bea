"""Every Triton config candidate, forced one at a time, against an fp32 reference on the GPU.

    PYTHONPATH=src python3 benchmarks/triton_config_check.py [--n 8192] [--d 64] [--hq 6] [--hkv 2]

The GPU tests run the first candidate of each kernel (ADAATTN_TRITON_AUTOTUNE=0); the tuner
may pick any of the others. This checks each one: output and gradients against SDPA's math
kernel in fp32 on the same bf16 inputs, with SDPA's cuDNN/flash in bf16 as the peer
(MEASURING.md: err(ours) <= 2 err(peer) + 1e-6). Prints one line per config, failures first.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from adaattn.backends import triton_attention as ta


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--hq", type=int, default=6)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--no-causal", action="store_true")
    args = ap.parse_args()
    causal = not args.no_causal
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = lambda h: (args.b, h, args.n, args.d)  # noqa: E731
    q = torch.randn(shape(args.hq), device="cuda", generator=g).bfloat16()
    k = torch.randn(shape(args.hkv), device="cuda", generator=g).bfloat16()
    v = torch.randn(shape(args.hkv), device="cuda", generator=g).bfloat16()
    dout = torch.randn(shape(args.hq), device="cuda", generator=g).bfloat16()

    def grads(fn, dtype):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*xs)
        out.backward(dout.to(dtype))
        return [out.detach()] + [x.grad for x in xs]

    with sdpa_kernel(SDPBackend.MATH):
        ref = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True),
                    torch.float32)
    peer = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True),
                 torch.bfloat16)
    peer_err = [rel(p, r) for p, r in zip(peer, ref)]
    names = ("out", "dq", "dk", "dv")
    print(f"B={args.b} Hq={args.hq} Hkv={args.hkv} N={args.n} D={args.d} causal={causal} bf16; "
          "peer (SDPA bf16) errors " + " ".join(f"{n}={e:.2e}" for n, e in zip(names, peer_err)))
    block_d = ta._block_d(args.d)
    lines = []
    for kind in ("fwd", "dkdv", "dq"):
        for cfg in ta.fitting_configs(kind, block_d, torch.bfloat16, q.device):
            with ta.forced_configs(**{kind: cfg}):
                try:
                    ours = grads(lambda a, b, c: ta.triton_attention(a, b, c, is_causal=causal), torch.bfloat16)
                except Exception as e:
                    lines.append((True, f"{kind:<5} {cfg!s:<18} ERROR {type(e).__name__}: {str(e)[:100]}"))
                    continue
            errs = [rel(o, r) for o, r in zip(ours, ref)]
            bad = [n for n, e, p in zip(names, errs, peer_err) if not e <= 2 * p + 1e-6]
            lines.append((bool(bad), f"{kind:<5} {cfg!s:<18} " + " ".join(f"{n}={e:.2e}" for n, e in zip(names, errs))
                          + (f"  FAIL {','.join(bad)}" if bad else "  ok")))
    ours = grads(lambda a, b, c: ta.triton_attention(a, b, c, is_causal=causal), torch.bfloat16)
    errs = [rel(o, r) for o, r in zip(ours, ref)]
    lines.append((any(not e <= 2 * p + 1e-6 for e, p in zip(errs, peer_err)),
                  "tuned " + " ".join(f"{n}={e:.2e}" for n, e in zip(names, errs)) + f"  chosen {ta.CONFIGS.chosen}"))
    for bad, line in sorted(lines, key=lambda x: not x[0]):
        print(line)
    return 1 if any(bad for bad, _ in lines) else 0


if __name__ == "__main__":
    raise SystemExit(main())
