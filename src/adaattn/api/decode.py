"""decode_attention(): one layer's decode step over a KV cache, under a plan the planner makes."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import planner
from ..kv.cache import PagedKVCache
from ..kv.decode import DecodePlan, run_decode


def decode_attention(query: torch.Tensor, cache: PagedKVCache, layer: int, seqs: Optional[Sequence[int]] = None,
                     scale: Optional[float] = None, runner: Optional[str] = None, splits: Optional[int] = None,
                     plan: Optional[DecodePlan] = None, *, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """query (S, Hq, T, D) of the S sequences `seqs` (default: every sequence of a KVCache's
    batch, or the plan's) against what `layer` of the cache holds for them, the last T cached
    tokens of each being the queries' own (bottom-right causal). Returns (S, Hq, T, Dv) in the
    query's dtype.

    plan: from plan_decode, made once per step and shared by the layers (default: one per call,
    from runner and splits).
    softcap, sinks, alibi_slopes: score modifiers, as attention() takes them (ALiBi positions are the
    tokens' own: query row r of a sequence of length L at position L - T + r). On the split-KV
    runner (runner "triton") the kernel caps the scores in-tile (and adds ALiBi's bias: under the
    interpreter so far; on CUDA ALiBi steps take the torch path until their GPU check) and its
    merge adds the sinks to each row's denominator, forward only; a step that needs gradients, or
    the "sdpa" runner, runs exactly in torch ops over the gathered keys (stats backend "kv.mods")."""
    if query.dim() != 4:
        raise ValueError(f"query must be (S, Hq, T, D), got {tuple(query.shape)}")
    if plan is None:
        s, hq, t, _ = query.shape
        plan = planner.plan_decode(cache, seqs, heads=hq, query_len=t, dtype=query.dtype, runner=runner,
                                   splits=splits)
    return run_decode(query, cache, layer, plan, seqs, scale, softcap, sinks, alibi_slopes)
