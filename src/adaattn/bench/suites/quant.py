"""quant: mode="auto" (per-head INT8/FP8 under a tolerance) against the default exact call, cuDNN
and SageAttention, on MEASURING.md's yardstick calls: the prefill yardsticks, GQA, and decode."""

from __future__ import annotations

import torch

from ...policy import Policy
from .. import peers
from ..cases import Case
from ..dense import describe, error_check, random_qkv, shape_case
from ..grid import Grid, Shape, dtype_name
from ..peers import Call
from . import options
from .prefill import DEFAULT

NAME = "quant"
HELP = ("bf16 B=2 H=16 D=128 N 4k/16k causal and not, GQA Hq=32 Hkv=8 N=8k causal, and decode B=16 Hq=32 Hkv=8 "
        "KV 8k/32k: mode=auto (native,int8,fp8) at three tolerances and (native,int8) at the default one, with "
        "per-head levels and per-head float64 error; vs cuDNN, adaattn exact (the default call), triton, "
        "SageAttention; x cuDNN and x adaattn exact")
NEEDS_CUDA = True
EXACT = "adaattn exact"
GQA = Shape(batch=2, heads=32, kv_heads=8, seq_len=8192, head_dim=128, dtype=torch.bfloat16, causal=True)
DECODE = Grid((8192, 32768), batch=16, heads=32, kv_heads=8, head_dim=128, dtypes=(torch.bfloat16,), causal="no")


def _auto_rows(call, tols):
    return [*peers.auto(call, tols), *peers.auto(call, (Policy().tolerance,), ("native", "int8"), prefix="auto int8")]


def cases(args, device):
    grid = options.grid(args, DEFAULT)
    tols = options.tolerances(args)
    seed, rows_n = options.seed(args), options.error_rows(args)

    def rows(call):
        return [peers.sdpa(call, "cuDNN"), peers.adaattn(call, EXACT), peers.triton(call), peers.sage(call),
                *_auto_rows(call, tols)]

    out = [shape_case(NAME, s, device, rows, "cuDNN", False, seed + i, rows_n, also=(EXACT,), per_head=True)
           for i, s in enumerate(grid.shapes())]
    if getattr(args, "seq_lens", None) is None:  # the fixed yardstick calls beside the grid
        out.append(shape_case(NAME, GQA, device, rows, "cuDNN", False, seed + len(out), rows_n, also=(EXACT,),
                              per_head=True))
        out += [_decode_case(n, device, tols, seed + 100 + i) for i, n in enumerate(DECODE.seq_lens)]
    return out


def _decode_case(n: int, device, tols, seed: int) -> Case:
    b, hq, hkv, d, dtype = DECODE.batch, DECODE.heads, DECODE.kv_heads, DECODE.head_dim, torch.bfloat16
    series = f"decode {describe(b, hq, hkv, d, dtype)}"
    kv_bytes = 2 * b * hkv * n * d * torch.finfo(dtype).bits // 8

    def make():
        q, k, v = random_qkv(b, hq, hkv, 1, n, d, dtype, device, seed)
        call = Call(q, k, v)
        return ([peers.sdpa(call, "cuDNN"), peers.adaattn(call, EXACT), peers.triton(call), *_auto_rows(call, tols)],
                error_check(call, per_head=True))

    return Case(NAME, f"{series} KV={n}", n, {"batch": b, "heads": hq, "kv_heads": hkv, "head_dim": d,
                "dtype": dtype_name(dtype), "q_len": 1, "kv_len": n, "kv_bytes": kv_bytes}, "cuDNN", "TB/s", kv_bytes,
                make, series=series, also=(EXACT,))
