"""cpu: torch's math kernel against its fused CPU flash kernel against adaattn's dispatch."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from .. import peers
from ..dense import shape_case
from ..grid import Grid
from . import options

NAME = "cpu"
HELP = ("the CPU (what --quick runs without CUDA): float32 B=1 H=4 D=64 N 128-2048 and bf16 N 128-1024, causal "
        "and not: "
        "SDPA math vs SDPA's fused CPU flash kernel vs adaattn.attention; x math")
NEEDS_CUDA = False
DISPATCH_OVERHEAD = True
DEFAULT = Grid((128, 512, 1024, 2048), batch=1, heads=4, kv_heads=None, head_dim=64, dtypes=(torch.float32,),
               causal="both")
BF16_SEQ_LENS = (128, 512, 1024)  # torch's bf16 math kernel on a CPU takes ~0.5 s at 2048: too slow for CI


def rows(call):
    return [peers.sdpa(call, "math"), peers.sdpa(call, "fused", SDPBackend.FLASH_ATTENTION), peers.adaattn(call)]


def cases(args, device):
    grid = options.grid(args, DEFAULT)
    shapes = grid.shapes()
    if getattr(args, "dtype", None) is None and getattr(args, "seq_lens", None) is None:
        shapes += options.grid(args, DEFAULT, dtypes=(torch.bfloat16,), seq_lens=BF16_SEQ_LENS).shapes()
    return [shape_case(NAME, s, device, rows, "math", bool(getattr(args, "backward", False)),
                       options.seed(args) + i, options.error_rows(args))
            for i, s in enumerate(shapes)]
