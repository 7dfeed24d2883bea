"""quant: the quantized path (mode="auto" with INT8/FP8 per head) against cuDNN and adaattn exact."""

from __future__ import annotations

from ...policy import Policy
from .. import peers
from ..dense import shape_case
from . import options
from .prefill import DEFAULT

NAME = "quant"
HELP = ("bf16 B=2 H=16 D=128, N 4k/16k, causal and not: mode=auto (native,int8,fp8) at three tolerances and "
        "(native,int8) at the default one, with per-head levels and measured error; vs cuDNN, adaattn exact, "
        "triton, SageAttention; x cuDNN")
NEEDS_CUDA = True


def cases(args, device):
    grid = options.grid(args, DEFAULT)
    tols = options.tolerances(args)

    def rows(call):
        return [peers.sdpa(call, "cuDNN"), peers.adaattn(call, "adaattn exact"), peers.triton(call), peers.sage(call),
                *peers.auto(call, tols),
                *peers.auto(call, (Policy().tolerance,), ("native", "int8"), prefix="auto int8")]

    return [shape_case(NAME, s, device, rows, "cuDNN", False, options.seed(args) + i, options.error_rows(args))
            for i, s in enumerate(grid.shapes())]
