"""window: causal sliding-window attention at long lengths, forward and forward+backward."""

from __future__ import annotations

import torch

from .. import peers
from ..cases import Case, unavailable
from ..dense import describe, error_check, random_qkv, window_pairs
from ..grid import Grid, dtype_name
from ..peers import Call
from . import options

NAME = "window"
HELP = ("causal sliding window, bf16 B=1 H=16 D=128: window 1024 at 16k and 4096 at 64k (--window-size), fwd and "
        "fwd+bwd: FlexAttention, SDPA efficient with a mask where memory allows, flash_attn, adaattn, triton; x flex")
NEEDS_CUDA = True
DEFAULT = Grid((16384, 65536), batch=1, heads=16, kv_heads=None, head_dim=128, dtypes=(torch.bfloat16,), causal="yes")


def default_window(n: int) -> int:
    return 1024 if n <= 16384 else 4096


def cases(args, device):
    grid = options.grid(args, DEFAULT, causal="yes")
    kv_heads = grid.kv_heads or grid.heads
    out = []
    for dtype in grid.dtypes:
        for i, n in enumerate(grid.seq_lens):
            left = getattr(args, "window_size", None) or default_window(n)
            for backward in (False, True):
                what = "fwd+bwd" if backward else "fwd"
                series = f"window {describe(grid.batch, grid.heads, kv_heads, grid.head_dim, dtype)} {what}"
                flops = 4.0 * grid.batch * grid.heads * grid.head_dim * window_pairs(n, left) * (3.5 if backward else 1)
                fields = {"batch": grid.batch, "heads": grid.heads, "kv_heads": kv_heads, "head_dim": grid.head_dim,
                          "dtype": dtype_name(dtype), "seq_len": n, "window": [left, 0], "pass": what}
                make = _maker(grid, kv_heads, n, left, dtype, backward, device, options.seed(args) + i)
                out.append(Case(NAME, f"{series} N={n} window {left}", n, fields, "flex", "TFLOP/s", flops, make,
                                series=series))
    return out


def _maker(grid, kv_heads, n, left, dtype, backward, device, seed):
    def keep(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= left)

    def make():
        q, k, v = random_qkv(grid.batch, grid.heads, kv_heads, n, n, grid.head_dim, dtype, device, seed, backward)
        call = Call(q, k, v, causal=True, window=(left, 0), backward=backward)
        rows = [peers.flex(call, keep), _efficient_with_mask(call, n, left), peers.flash_attn(call),
                peers.adaattn(call), peers.triton(call)]
        return rows, error_check(call)

    return make


def _efficient_with_mask(call: Call, n: int, left: int):
    """SDPA's efficient kernel with the window as an (N, N) boolean mask, where it fits (4x its bytes free)."""
    free = torch.cuda.mem_get_info(call.q.device)[0] if call.q.is_cuda else 0
    if 4 * n * n > free:
        return unavailable("efficient+mask", f"an {n}x{n} mask (and its additive copy) does not fit in free memory")
    mask = torch.ones(n, n, dtype=torch.bool, device=call.q.device).tril_().triu_(-left)
    plain = Call(call.q, call.k, call.v, causal=False, backward=call.backward)
    return peers.sdpa(plain, "efficient+mask", torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION, mask=mask)
