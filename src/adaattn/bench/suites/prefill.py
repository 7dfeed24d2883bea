"""prefill: the yardstick of MEASURING.md, forward (or forward+backward with --backward)."""

from __future__ import annotations

import torch

from .. import peers
from ..dense import shape_case
from ..grid import Grid
from . import options

NAME = "prefill"
HELP = ("bf16 B=2 H=16 D=128, N 4k/16k (--full: 1k-64k), causal and not: cuDNN, FA2, SageAttention, "
        "flash_attn, adaattn, triton, mode=auto at three tolerances; TFLOP/s and float64 error, x cuDNN")
NEEDS_CUDA = True
DEFAULT = Grid((4096, 16384), batch=2, heads=16, kv_heads=None, head_dim=128, dtypes=(torch.bfloat16,), causal="both")
FULL_SEQ_LENS = (1024, 4096, 16384, 65536)


def cases(args, device):
    full = getattr(args, "full", False) and getattr(args, "seq_lens", None) is None
    grid = options.grid(args, DEFAULT, **({"seq_lens": FULL_SEQ_LENS} if full else {}))
    tols = options.tolerances(args)

    def rows(call):
        cudnn, fa2, *ours = peers.gpu_peers(call)
        return [cudnn, fa2, peers.sage(call), *ours, *peers.auto(call, tols)]

    backward = bool(getattr(args, "backward", False))
    return [shape_case(NAME, s, device, rows, "cuDNN", backward, options.seed(args) + i, options.error_rows(args))
            for i, s in enumerate(grid.shapes())]
