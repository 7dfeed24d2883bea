"""INT4 KV layouts simulated on the shipped 32k GPT's own keys, values and queries (issue 50): the
output error per (layer, KV head) of decode-like attention (the last 32 of 16,384 positions'
queries against the rest as a bf16 cache) when K and V are quantized to 4 bits with each layout's
scales, in float64. Not the cache's code: a simulation to choose the next layout to build.

    python benchmarks/kv_int4_layouts.py [WINDOW]   # WINDOW: newest tokens kept in bf16 (default 0)
"""
import torch
from adaattn.models import pretrained
from adaattn.models.capture import capture
m = pretrained.load("src/adaattn/models/weights/gpt_stdlib_32k.pt")
n, t, P = 16384, 32, 64
cap = capture(m, seq_len=n, batch=1, offset=123456)

def q4(x, dims):  # symmetric int4 [-7,7] with amax over `dims` (keepdim)
    s = x.abs().amax(dim=dims, keepdim=True).clamp_min(1e-12) / 7.0
    return (x / s).round().clamp(-7, 7) * s

def q4_asym(x, dims):  # asymmetric 4-bit [0,15] min/max over dims (KIVI-style zero point)
    lo, hi = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    s = ((hi - lo) / 15.0).clamp_min(1e-12)
    return ((x - lo) / s).round().clamp(0, 15) * s + lo

def paged(x):  # (B,H,N,D) -> (B,H,N/P,P,D)
    b, h, nn, d = x.shape
    return x[:, :, : nn // P * P].reshape(b, h, nn // P, P, d)

def unpaged(x, ref):
    b, h, np_, p, d = x.shape
    return x.reshape(b, h, np_ * p, d)

layouts = {
    "page,head (today)": (lambda k: q4(paged(k - k.mean(2, keepdim=True)), (3, 4)), lambda v: q4(paged(v), (3, 4)), True),
    "K per channel/page, V per token": (lambda k: q4(paged(k - k.mean(2, keepdim=True)), (3,)), lambda v: q4(paged(v), (4,)), True),
    "K per channel/page asym, V per token asym": (lambda k: q4_asym(paged(k), (3,)), lambda v: q4_asym(paged(v), (4,)), False),
    "per token group16 asym (K and V)": (lambda k: q4_asym(paged(k).reshape(*paged(k).shape[:-1], -1, 16), (5,)).flatten(-2), lambda v: q4_asym(paged(v).reshape(*paged(v).shape[:-1], -1, 16), (5,)).flatten(-2), False),
    "per token group32 asym (K and V)": (lambda k: q4_asym(paged(k).reshape(*paged(k).shape[:-1], -1, 32), (5,)).flatten(-2), lambda v: q4_asym(paged(v).reshape(*paged(v).shape[:-1], -1, 32), (5,)).flatten(-2), False),
    "per token group64 asym (K and V)": (lambda k: q4_asym(paged(k).reshape(*paged(k).shape[:-1], -1, 64), (5,)).flatten(-2), lambda v: q4_asym(paged(v).reshape(*paged(v).shape[:-1], -1, 64), (5,)).flatten(-2), False),
    "K per channel/page asym, V per token group16 asym": (lambda k: q4_asym(paged(k), (3,)), lambda v: q4_asym(paged(v).reshape(*paged(v).shape[:-1], -1, 16), (5,)).flatten(-2), False),
    "K per token group16 asym, V per token asym": (lambda k: q4_asym(paged(k).reshape(*paged(k).shape[:-1], -1, 16), (5,)).flatten(-2), lambda v: q4_asym(paged(v), (4,)), False),
}
# Bytes a stored value takes, scales included (bf16 scale and minimum per group; the fp32 per-page
# scales of the first two are a few bytes a page), at D=64 (this model's head dim) and pages of 64.
BYTES = {"page,head (today)": 0.5, "K per channel/page, V per token": 0.5 + (2 / 64 + 2 / 64) / 2,
         "K per channel/page asym, V per token asym": 0.5 + (4 / 64 + 4 / 64) / 2,
         "per token group16 asym (K and V)": 0.75, "per token group32 asym (K and V)": 0.625,
         "per token group64 asym (K and V)": 0.5625,
         "K per channel/page asym, V per token group16 asym": 0.5 + (4 / 64 + 4 / 16) / 2,
         "K per token group16 asym, V per token asym": 0.5 + (4 / 16 + 4 / 64) / 2}
import sys
WINDOW = int(sys.argv[1]) if len(sys.argv) > 1 else 0
for name, (fk, fv, centered) in layouts.items():
    errs = []
    for lc in cap.layers:
        k, v = (x[:, :, : n - t].to(torch.bfloat16).double() for x in (lc.k, lc.v))
        nn = (n - t) // P * P
        k, v = k[:, :, :nn], v[:, :, :nn]
        q = lc.q[:, :, n - t:].to(torch.bfloat16).double()
        g = q.shape[1] // k.shape[1]
        kq = unpaged(fk(k), k) + (k.mean(2, keepdim=True) if centered else 0)
        vq = unpaged(fv(v), v)
        if WINDOW:
            kq[:, :, -WINDOW:], vq[:, :, -WINDOW:] = k[:, :, -WINDOW:], v[:, :, -WINDOW:]
        def att(kk, vv):
            kk, vv = kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1)
            return torch.softmax(q @ kk.transpose(-1, -2) / 8.0, -1) @ vv
        o, oq = att(k, v), att(kq, vq)
        for h in range(k.shape[1]):
            sl = slice(h * g, (h + 1) * g)
            errs.append(((oq[:, sl] - o[:, sl]).norm() / o[:, sl].norm()).item())
    w = WINDOW / (n - t)  # the window's share of the tokens, at 2 bytes
    print(f"{name:50s} bytes/value {BYTES[name] * (1 - w) + 2 * w:.3f}  min {min(errs):.3f} median {sorted(errs)[len(errs)//2]:.3f} max {max(errs):.3f}  <=5e-2: {sum(e <= 0.05 for e in errs)}/16")
