"""Options every suite reads: the grid options of `adaattn bench` over the suite's own defaults."""

from __future__ import annotations

import argparse

from ..grid import Grid, override

GRID_OPTIONS = ("seq_lens", "batch", "heads", "kv_heads", "head_dim", "causal")


def grid(args: argparse.Namespace, default: Grid, **fixed) -> Grid:
    """`default` with every grid option given on the command line (and `fixed`) in its place."""
    given = {k: getattr(args, k, None) for k in GRID_OPTIONS}
    given["dtypes"] = getattr(args, "dtype", None)
    given.update(fixed)
    out = override(default, **given)
    kv = out.kv_heads or out.heads
    if out.heads % kv:
        raise ValueError(f"--heads ({out.heads}) must be a multiple of --kv-heads ({kv})")
    return out


def tolerances(args: argparse.Namespace) -> tuple[float, ...]:
    return tuple(getattr(args, "tolerances", None) or (1e-2, 3e-2, 8e-2))


def seed(args: argparse.Namespace) -> int:
    return int(getattr(args, "seed", 0) or 0)


def error_rows(args: argparse.Namespace) -> int:
    return int(getattr(args, "error_rows", 256) or 256)
