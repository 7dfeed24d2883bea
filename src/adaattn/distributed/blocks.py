"""The block engine of a ring call, as the planner chooses it (planner.choose("ring_block", ...)).

`choose_blocks` asks the planner for the runner of a RingBlockProblem (backends/ring_blocks.py:
ring.torch, ring.triton, ring.cudnn): kernel="auto" takes the planner's order, a named kernel its
runner, refused with that runner's reasons where it cannot run the tensors; `block_engine` makes
the chosen runner's engine (planner.ring_block_engine), which the ring drives. `explain_ring_block`
shows the choice for one rank's shards, every runner with its reasons, with no process group.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import planner
from ..backends.ring_blocks import KERNELS, RingBlockProblem, ring_block_problem
from ..policy import Policy

# What a refusal of a named kernel suggests instead.
_INSTEAD = {"triton": "Use kernel='torch' or 'auto'.", "cudnn": "Use kernel='auto'."}


def check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, not {kernel!r}")


def choose_blocks(problem: RingBlockProblem, policy: Optional[Policy] = None) -> planner.Choice:
    """The planner's choice of block runner for `problem` (problem.kernel: "auto" or the one
    named). A named kernel that cannot run these tensors raises ValueError with its reasons."""
    runner = None if problem.kernel == "auto" else f"ring.{problem.kernel}"
    try:
        return planner.choose("ring_block", problem, policy, runner=runner)
    except planner.RunnerDeclines as e:
        raise ValueError(f"kernel={problem.kernel!r} cannot run these tensors: {' '.join(e.reasons)} "
                         f"{_INSTEAD.get(problem.kernel, '')}".rstrip()) from e


def block_engine(problem: RingBlockProblem, policy: Optional[Policy] = None):
    """The engine of the runner the planner chooses for `problem` (see choose_blocks)."""
    return planner.ring_block_engine(choose_blocks(problem, policy))


def explain_ring_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                       kernel: str = "auto", deterministic: bool = False,
                       policy: Optional[Policy] = None) -> planner.Choice:
    """Which block runner ring_attention would run for these shards (one rank's q (B, Hq, n, D),
    k (B, Hkv, n, D), v (B, Hkv, n, Dv); no process group needed), why, and every runner with its
    reasons (str() of the Choice prints them). A named kernel that cannot run them raises
    ValueError with its reasons, as ring_attention does."""
    check_kernel(kernel)
    deterministic = deterministic or (policy is not None and policy.deterministic)
    problem = ring_block_problem(q, k, v, causal=causal, kernel=kernel, deterministic=deterministic)
    return choose_blocks(problem, policy)
