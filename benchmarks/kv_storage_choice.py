"""Which storage each KV head of the shipped 32k GPT can take under a tolerance, measured
(adaattn.kv.storage_errors): the model reads held-out text, each layer's keys and values but the
last `--rows` positions stand as the cache (bf16, as a GPU cache holds them), and the queries of
those last positions attend it, decode-like (every cached key visible). Prints each (layer, KV
head)'s output error per storage and, per tolerance, the storages chosen (choose_storages) and the
bytes a cached value takes against bf16's 2.

    python benchmarks/kv_storage_choice.py [--seq-len 16384] [--batch 1] [--rows 32] [--group-size 16]
        [--window 0] [--json out.json]

INT4 is the cache's own (per token and group of channels; --window keeps the newest tokens in
bf16, their bytes counted in INT4's bytes a value).

CPU is fine at 16k (about 25 s on 2 cores); --device cuda for longer contexts.
"""

from __future__ import annotations

import argparse
import json

import torch

from adaattn.kv import choose_storages, storage_errors
from adaattn.kv.choose import storage_bytes
from adaattn.models import pretrained
from adaattn.models.capture import capture

STORAGES = ("int4", "fp8", "int8")
TOLERANCES = (1e-2, 3e-2, 5e-2)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default=None, help="a GPT checkpoint (default: the shipped 32k one)")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rows", type=int, default=32, help="query positions at the end that attend the cache")
    ap.add_argument("--offset", type=int, default=123456, help="byte offset into the held-out text")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--group-size", type=int, default=16, help="INT4's channels per scale")
    ap.add_argument("--window", type=int, default=0, help="INT4's newest tokens kept in bf16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not 0 < args.rows < args.seq_len:
        raise SystemExit(f"--rows must be in (0, --seq-len), got {args.rows}")
    path = args.weights
    if path is None:
        from importlib import resources

        path = str(resources.files("adaattn").joinpath("models/weights/gpt_stdlib_32k.pt"))
    model = pretrained.load(path, args.device)
    cap = capture(model, seq_len=args.seq_len, batch=args.batch, offset=args.offset)
    n, t = args.seq_len, args.rows
    layers = []
    for lc in cap.layers:
        k, v = (x[:, :, : n - t].to(torch.bfloat16) for x in (lc.k, lc.v))
        q = lc.q[:, :, n - t:].to(torch.bfloat16)
        errors = storage_errors(k, v, q, storages=STORAGES, group_size=args.group_size, window=args.window)
        layers.append({"layer": lc.layer, "errors": {s: [round(float(x), 5) for x in e] for s, e in errors.items()},
                       "chosen": {str(tol): choose_storages(errors, tol) for tol in TOLERANCES}})
        print(f"layer {lc.layer}: " + "  ".join(f"{s} {layers[-1]['errors'][s]}" for s in STORAGES))
    summary = {}
    for tol in TOLERANCES:
        chosen = [c for row in layers for c in row["chosen"][str(tol)]]
        per_value = sum(_bytes(c, n - t, args) for c in chosen) / len(chosen)
        counts = {s: chosen.count(s) for s in sorted(set(chosen))}
        summary[str(tol)] = {"counts": counts, "bytes_per_value": per_value, "x_fewer_than_bf16": 2.0 / per_value}
        print(f"tolerance {tol:g}: {counts}, {per_value:.3f} bytes a value ({2.0 / per_value:.2f}x fewer than bf16)")
    out = {"weights": path, "seq_len": n, "batch": args.batch, "rows": t, "offset": args.offset,
           "group_size": args.group_size, "window": args.window,
           "bits_per_byte": cap.bits_per_byte, "torch": torch.__version__, "device": args.device,
           "layers": layers, "summary": summary}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _bytes(storage: str, cached: int, args) -> float:
    """Bytes a cached value takes in `storage`, INT4's window (bf16) spread over the cached tokens."""
    one = storage_bytes(storage, torch.bfloat16, 128, args.group_size)
    if storage != "int4" or not args.window:
        return one
    w = min(args.window, cached)
    return ((cached - w) * one + w * 2.0) / cached


if __name__ == "__main__":
    main()
