"""The shapes adaptive rank works in: key-block summaries, mass estimates, tile plans, and the
block layouts of a size (which tiles may be listed, always exact, or the computed tail), cached
per size. blocks.py computes them; rank_launch.py launches the Triton passes that fill them.
Neither imports the other's callers: both import this module."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..backends.triton.common import cdiv

LOCAL_BLOCKS = 1  # key blocks just before a causal query block's own, kept exact


def _cached(fn):
    """fn(n, ..., device) memoised per arguments: layouts are the same for every call of a size."""
    cached = functools.lru_cache(maxsize=64)(lambda *args: fn(*args[:-1], torch.device(args[-1])))

    @functools.wraps(fn)
    def wrapper(*args):
        return cached(*args[:-1], str(args[-1]))
    return wrapper


@dataclass
class Summaries:
    """Per key block (B, Hkv, n_kb, .): mean key and value in the inputs' dtype, the keys'
    per-channel variance in float32, and each block's key count (n_kb,) float32."""

    keys: torch.Tensor
    values: torch.Tensor
    variance: torch.Tensor
    counts: torch.Tensor
    key_block: int


@_cached
def block_counts(n: int, key_block: int, device) -> torch.Tensor:
    nkb = cdiv(n, key_block)
    return (n - torch.arange(nkb, device=device) * key_block).clamp(max=key_block).float()


@_cached
def sampled_rows(n: int, query_block: int, per_block: int, device) -> torch.Tensor:
    """(n_qb, r) query rows per query block: the last row of each of r equal parts (clamped to
    the sequence), so the block's last row, which sees the most keys, is always one."""
    nqb = cdiv(n, query_block)
    r = max(1, min(per_block, query_block))
    step = query_block // r
    offs = torch.arange(r, device=device) * step + (step - 1)
    offs[-1] = query_block - 1
    rows = torch.arange(nqb, device=device)[:, None] * query_block + offs[None, :]
    return rows.clamp_(max=n - 1)


@dataclass
class Estimate:
    """mass (B, Hq, n_qb, n_kb) float32: estimated share of each query block's attention in each
    key block (rows sum to 1 over visible blocks); entropy (Hq,) float32: mean over sampled rows
    of the block distribution's entropy plus log2 of the keys per block, in bits."""

    mass: torch.Tensor
    entropy: torch.Tensor
    rows: torch.Tensor = field(repr=False)
    cost: torch.Tensor | None = None  # (B, Hq, n_qb, n_kb): mass * min(1, logit spread within the block)


@dataclass
class Plan:
    """A tile plan on the device. state int8 (B, Hq, n_qb, n_kb): 1 summarised, 2 exact (listed
    or tail), 0 skipped or not visible. eidx int32 (B, Hq, n_qb, n_kb + 1): the listed exact key
    blocks first, ascending; ecnt int32 (B, Hq, n_qb). density (Hq,) float32: exact tiles over
    visible tiles; summarised (Hq,) float32: summarised blocks over visible blocks."""

    state: torch.Tensor
    eidx: torch.Tensor
    ecnt: torch.Tensor
    density: torch.Tensor
    summarised: torch.Tensor
    query_block: int
    key_block: int
    causal: bool


def block_layout(n: int, causal: bool, query_block: int, key_block: int, device, local: int = LOCAL_BLOCKS):
    return _block_layout(n, causal, query_block, key_block, local, device)


@_cached
def _block_layout(n: int, causal: bool, query_block: int, key_block: int, local: int, device):
    """(listable, forced, tail) bool (n_qb, n_kb): blocks that may be listed (whole tiles every
    row of the query block sees, outside the tail), those of them always exact (the first block
    and the local ones), and the tail the kernel always computes exactly."""
    if query_block % key_block:
        raise ValueError(f"query_block ({query_block}) must be a multiple of key_block ({key_block})")
    nqb, nkb = cdiv(n, query_block), cdiv(n, key_block)
    qb = torch.arange(nqb, device=device)[:, None]
    kb = torch.arange(nkb, device=device)[None, :]
    if causal:
        lo = qb * (query_block // key_block)
        listable = kb < lo
        tail = (kb >= lo) & (kb * key_block < torch.clamp((qb + 1) * query_block, max=n))
        forced = listable & ((kb == 0) | (kb >= lo - local))
    else:
        full = n // key_block
        listable = (kb < full).expand(nqb, nkb)
        tail = (kb >= full).expand(nqb, nkb)
        own_lo = qb * query_block // key_block
        own_hi = ((qb + 1) * query_block + key_block - 1) // key_block
        forced = listable & ((kb == 0) | ((kb >= own_lo) & (kb < own_hi)))
    return listable, forced, tail


@_cached
def _layout_counts(n: int, causal: bool, query_block: int, key_block: int, local: int, device):
    """(visible tiles, tail tiles) of one (batch, head) as ints: the denominators of a plan's
    density, read once per size."""
    listable, _, tail = _block_layout(n, causal, query_block, key_block, local, device)
    return int((listable | tail).sum()), int(tail.sum())


def layout_counts(n: int, causal: bool, query_block: int, key_block: int, device, local: int = LOCAL_BLOCKS):
    return _layout_counts(n, causal, query_block, key_block, local, device)
