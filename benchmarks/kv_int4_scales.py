"""Which scale groups suit INT4 KV pages: a float64 simulation on the shipped 32k GPT's own keys and
values (every layer and KV head), and on random ones.

For each storage (INT4, INT8, FP8) and scale layout, the keys (less their mean, as the cache stores
them) and values are quantized and dequantized, and the attention output of the last `--rows` query
positions (each attending every earlier key, as decode steps do) is compared with the exact one:
the relative L2 error per query head, reported per KV head as the worst of its group.

Layouts (bytes of scales per token and KV head, fp32 scales, at head dim D and pages of 64):
  page    one scale per (page, KV head), as kv/cache.py stores every quantized storage (8 / 64)
  kivi    keys: one scale per (page, channel); values: one per token (KIVI's layout) (4 D / 64 + 4)
  group32 keys and values: one scale per token and 32 channels (2 x 4 D / 32)

    python benchmarks/kv_int4_scales.py --seq-len 4096 --rows 64 --json out.json   (CPU, a minute)
"""

from __future__ import annotations

import argparse
import json
import math

import torch

QMAX = {"int4": 7.0, "int8": 127.0, "fp8": 448.0}
PAGE = 64


def _round(y: torch.Tensor, storage: str) -> torch.Tensor:
    if storage == "fp8":
        return y.clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
    return y.round().clamp(-QMAX[storage], QMAX[storage])


def _by(x: torch.Tensor, amax: torch.Tensor, storage: str) -> torch.Tensor:
    scale = (amax / QMAX[storage]).float().double()  # fp32 scales, as stored
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return _round(x / safe, storage) * scale


def quantize(x: torch.Tensor, storage: str, layout: str, keys: bool) -> torch.Tensor:
    """x (Hkv, N, D) float64, quantized and dequantized."""
    h, n, d = x.shape
    pad = (-n) % PAGE
    xp = torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(h, -1, PAGE, d)  # (H, pages, PAGE, D)
    if layout == "page":
        out = _by(xp, xp.abs().amax((2, 3), keepdim=True), storage)
    elif layout == "kivi":
        amax = xp.abs().amax(2, keepdim=True) if keys else xp.abs().amax(3, keepdim=True)
        out = _by(xp, amax, storage)
    elif layout == "group32":
        g = xp.reshape(h, xp.shape[1], PAGE, d // 32, 32)
        out = _by(g, g.abs().amax(4, keepdim=True), storage).reshape(xp.shape)
    else:
        raise ValueError(layout)
    return out.reshape(h, -1, d)[:, :n]


def attention_rows(q, k, v, rows):
    """q (Hq, N, D), k/v (Hkv, N, D): outputs of the last `rows` positions, causal, (Hq, rows, D)."""
    hq, n, d = q.shape
    g = hq // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    qs = q[:, n - rows:]
    s = qs @ k.transpose(1, 2) / math.sqrt(d)
    pos = torch.arange(n - rows, n)[:, None]
    s = s.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
    return torch.softmax(s, -1) @ v


def head_errors(q, k, v, rows, storage, layout, which="kv"):
    """Per KV head: the worst relative error of its query heads' outputs; `which`: quantize the keys
    ("k"), the values ("v") or both ("kv")."""
    exact = attention_rows(q, k, v, rows)
    centre = k.mean(1, keepdim=True)
    kq = quantize(k - centre, storage, layout, keys=True) + centre if "k" in which else k
    vq = quantize(v, storage, layout, keys=False) if "v" in which else v
    got = attention_rows(q, kq, vq, rows)
    err = (got - exact).flatten(1).norm(dim=1) / exact.flatten(1).norm(dim=1)  # per query head
    return err.reshape(k.shape[0], -1).amax(1).tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from adaattn.models import pretrained
    from adaattn.models.capture import capture

    model = pretrained.load(pretrained.LONG_WEIGHTS)
    cap = capture(model, seq_len=args.seq_len)
    sources = {"gpt32k": [(c.q[0].double(), c.k[0].double(), c.v[0].double()) for c in cap.layers]}
    gen = torch.Generator().manual_seed(0)
    shape = sources["gpt32k"][0]
    sources["random"] = [tuple(torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in shape)]
    result = {"seq_len": args.seq_len, "rows": args.rows, "page": PAGE, "errors": {}}
    for name, layers in sources.items():
        for storage in ("int8", "fp8", "int4"):
            for layout in ("page", "kivi", "group32"):
                errs = [e for q, k, v in layers for e in head_errors(q, k, v, args.rows, storage, layout)]
                result["errors"][f"{name} {storage} {layout}"] = errs
                srt = sorted(errs)
                print(f"{name:7s} {storage:5s} {layout:8s} heads {len(errs):3d}  median {srt[len(srt) // 2]:.2e}  "
                      f"max {srt[-1]:.2e}  <=1e-2: {sum(e <= 1e-2 for e in errs):2d}  "
                      f"<=5e-2: {sum(e <= 5e-2 for e in errs):2d}")
    for which in ("k", "v"):  # INT4 on one of the two, the other exact: where the error comes from
        for layout in ("page", "kivi", "group32"):
            errs = [e for q, k, v in sources["gpt32k"] for e in head_errors(q, k, v, args.rows, "int4", layout, which)]
            result["errors"][f"gpt32k int4 {layout} {which} only"] = errs
            srt = sorted(errs)
            print(f"gpt32k  int4  {layout:8s} {which} only  median {srt[len(srt) // 2]:.2e}  max {srt[-1]:.2e}  "
                  f"<=5e-2: {sum(e <= 5e-2 for e in errs):2d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
