"""train: forward and backward of dense causal attention, TFLOP/s counted 3.5x the forward."""

from __future__ import annotations

import torch

from ...policy import Policy
from .. import peers
from ..dense import shape_case
from ..grid import Grid
from . import options

NAME = "train"
HELP = ("fwd+bwd, bf16 causal B=2 H=16 D=128, N 4k/16k: cuDNN, FA2, flash_attn, adaattn, triton, and triton with "
        "deterministic=True (the atomic-free, bitwise-reproducible backward); x cuDNN")
NEEDS_CUDA = True
DEFAULT = Grid((4096, 16384), batch=2, heads=16, kv_heads=None, head_dim=128, dtypes=(torch.bfloat16,), causal="yes")


def cases(args, device):
    grid = options.grid(args, DEFAULT)
    return [shape_case(NAME, s, device, train_peers, "cuDNN", True, options.seed(args) + i,
                       options.error_rows(args))
            for i, s in enumerate(grid.shapes())]


def train_peers(call) -> list:
    """The dense GPU peers, and Triton pinned with deterministic=True: the backward whose bits do
    not depend on timing (no atomics; the Gluon backward adds dq by reductions and never runs it)."""
    deterministic = Policy(backends=("triton",), deterministic=True)
    return [*peers.gpu_peers(call), peers.adaattn(call, "triton deterministic", deterministic)]
