"""decode: one query row against a long KV cache; the figure is the bandwidth of reading K and V."""

from __future__ import annotations

import torch

from .. import peers
from ..cases import Case
from ..dense import describe, error_check, random_qkv
from ..grid import Grid, dtype_name
from ..peers import Call
from . import options

NAME = "decode"
HELP = ("bf16 B=16 Hq=32 Hkv=8 D=128, one query row, KV 8k/32k: cuDNN, FA2, efficient, flash_attn, adaattn, "
        "triton; TB/s of K and V read, x cuDNN")
NEEDS_CUDA = True
DEFAULT = Grid((8192, 32768), batch=16, heads=32, kv_heads=8, head_dim=128, dtypes=(torch.bfloat16,), causal="no")


def cases(args, device):
    grid = options.grid(args, DEFAULT, causal="no")  # one query row: every cached key takes part
    kv_heads = grid.kv_heads or grid.heads
    out = []
    for dtype in grid.dtypes:
        for i, n in enumerate(grid.seq_lens):
            series = f"decode {describe(grid.batch, grid.heads, kv_heads, grid.head_dim, dtype)}"
            kv_bytes = 2 * grid.batch * kv_heads * n * grid.head_dim * torch.finfo(dtype).bits // 8
            out.append(Case(NAME, f"{series} KV={n}", n, {"batch": grid.batch, "heads": grid.heads,
                            "kv_heads": kv_heads, "head_dim": grid.head_dim, "dtype": dtype_name(dtype), "q_len": 1,
                            "kv_len": n, "kv_bytes": kv_bytes}, "cuDNN", "TB/s", kv_bytes,
                            _maker(grid, kv_heads, n, dtype, device, options.seed(args) + i), series=series))
    return out


def _maker(grid, kv_heads, n, dtype, device, seed):
    def make():
        q, k, v = random_qkv(grid.batch, grid.heads, kv_heads, 1, n, grid.head_dim, dtype, device, seed)
        call = Call(q, k, v)
        rows = [*(peers.sdpa(call, name) for name in ("cuDNN", "FA2", "efficient")), peers.flash_attn(call),
                peers.adaattn(call), peers.triton(call)]
        return rows, error_check(call)

    return make
