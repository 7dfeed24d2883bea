"""ring_attention: exact attention over a sequence sharded across a process group (the call).

This file checks a call's arguments, decides what the call runs and hands it to the autograd
function. The rest of the ring, one idea a file:
    layout.py    shard / unshard / positions: where each rank's positions lie (plain, zigzag)
    bands.py     the kernel calls of a block: bands of key offsets in global positions
    blocks.py    the block engine, as the planner chooses it (backends/ring_blocks.py runs it)
    comm.py      K/V shards around the ring or all-gathered; gradients back to their owners
    function.py  the autograd function: forward over every shard, merged by log-sum-exp; backward
    adaptive.py  quantized blocks under a policy, verified against exact ones
    records.py   adaattn.stats records of each rank, gathered and summarized
    module.py    RingAttention, the nn.Module

Kernels. kernel="triton" runs the pairs through our Triton forward and backward (natural-log
lse, fp32), kernel="torch" through torch math in float32 (float64 for float64 inputs),
kernel="cudnn" the full and square causal pairs through cuDNN's fused kernel (torch's aten op,
which returns the lse, and its backward, which takes a pair's global out and lse) and the
other bands through Triton, and "auto" takes what the planner chooses: cuDNN's split where it
runs cuDNN for a call of the shard's shape, else Triton where it runs (CUDA tensors,
float16/bfloat16/float32, head dims it takes), and torch otherwise. Partial results merge
exactly by log-sum-exp in float32 (float64).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import stats
from ..api import attention
from ..backends.ring_blocks import ring_block_problem
from ..policy import EXACT, Policy
from ..problem import check_modifier_tensor, check_scale, check_sinks_shape, check_softcap, check_window, default_scale
from . import adaptive
from .bands import Window
from .blocks import KERNELS, block_engine, check_kernel
from .comm import ALGORITHMS
from .function import Call, RingFunction
from .layout import check_balance, group_info
from .records import record


def _check(q, k, v, enable_gqa, window):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("ring_attention takes (B, H, N, D) tensors")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk and (not enable_gqa or hq % hk):
        raise ValueError(f"Hq={hq} and Hkv={hk} differ: pass enable_gqa=True with Hq a multiple of Hkv")
    if q.shape[2] != k.shape[2]:
        raise ValueError("ring_attention needs equal local query and key lengths (self-attention shards)")
    return check_window(window)


def _check_docs(cu_seqlens, n_global: int) -> Optional[tuple]:
    """cu_seqlens as a tuple of ints [0, ..., n_global], nondecreasing; None stays None."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dim()}-D {cu_seqlens.dtype}")
        cu = tuple(int(x) for x in cu_seqlens.tolist())
    elif isinstance(cu_seqlens, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool)
                                                         for x in cu_seqlens):
        cu = tuple(cu_seqlens)
    elif isinstance(cu_seqlens, (list, tuple)):
        bad = next(x for x in cu_seqlens if not isinstance(x, int) or isinstance(x, bool))
        raise TypeError(f"cu_seqlens must hold Python ints, got an element of type {type(bad).__name__} ({bad!r})")
    else:
        raise TypeError(f"cu_seqlens must be a 1-D integer tensor or a list of ints, got {type(cu_seqlens).__name__}")
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != n_global or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the global length {n_global}, "
                         f"got {list(cu)[:8]}{'...' if len(cu) > 8 else ''}")
    return cu


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                   is_causal: bool = False, scale: float | None = None, window: Window = None,
                   enable_gqa: bool = False, balance: str = "zigzag", cu_seqlens=None,
                   algorithm: str = "ring", kernel: str = "auto", policy: Optional[Policy] = None,
                   label: Optional[str] = None, softcap: Optional[float] = None,
                   sinks: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention over a sequence sharded across `group` (default: the world group); exact unless
    `policy` allows quantized precisions.

    q (B, Hq, n, D), k (B, Hkv, n, D), v (B, Hkv, n, Dv) are this rank's shards of the
    sequence (dim 2), laid out as `shard(x, 2, group, balance)` lays them out; every rank holds
    the same n. Returns this rank's output shard (B, Hq, n, Dv) in the input dtype.
    is_causal / window=(left, right) apply in global positions (None on a side: unbounded);
    scale defaults to 1/sqrt(D); enable_gqa allows Hq a multiple of Hkv.
    cu_seqlens: packed documents, [0, end of document 0, ..., N] in global positions (a list, or
        an integer tensor: a CUDA one costs a host sync); a query sees only keys of its own
        document (and, with is_causal/window, only those the mask allows there).
    algorithm: "ring" (K/V shards pass around the ring, overlapping compute) or "allgather"
        (all K/V shards gathered at once: world x the K/V memory, one collective; for short
        shards).
    kernel: "auto" (cuDNN's fused kernel for the full and square causal blocks where the planner
        runs cuDNN for a call of the shard's shape, our Triton kernels for the other blocks and
        CUDA tensors cuDNN does not take, torch math on the CPU), "cudnn" (that split, asked for),
        "triton" or "torch".
    policy: None (exact) or a Policy. Under mode="auto" with "int8"/"fp8" among its precisions,
        each rank's blocks run at per-head quantized levels under policy.tolerance, verified on
        a fraction policy.verify of calls against the exact blocks over every rank's rows
        (adaattn.distributed.adaptive says how); the backward is exact, and inputs that require
        grad run exact unless policy.train_quantized. policy.deterministic asks for the
        deterministic backward. Rank approximations ("skip", "lowrank") do not run here: a policy
        allowing them and no quantized precision is refused (ValueError), as is policy.backends,
        unless the call is adaattn.attention's (below).
    label: names the call site whose per-head levels and measurements a call uses (default:
        one site per shape, mask and policy).
    softcap: c > 0, every block's scores c * tanh(s / c) before masking (Gemma 2), in the torch and
        Triton blocks (cuDNN's take none; a quantized policy then runs exact blocks).
    sinks: (Hq,) logits, one per query head, joining each row's softmax with no value (gpt-oss's
        s_aux; problem.Modifiers): applied to the merged output from the global log-sum-exp, with a
        gradient. alibi_slopes are not yet applied across ranks (ValueError): the bias needs each
        block's global positions.
    Differentiable in q, k, v and sinks. With no initialized process group, or world size 1, no
    documents and kernel="auto", this is adaattn.attention (with `policy`, `label` and the
    modifiers).
    """
    if alibi_slopes is not None:
        raise ValueError("ring_attention applies softcap and sinks; alibi_slopes are not yet applied across ranks "
                         "(the bias needs each block's global positions): run the call with adaattn.attention on "
                         "one device, or without them")
    if sinks is not None:
        check_modifier_tensor("sinks", sinks, q.device.type)
        check_sinks_shape(sinks, q.shape[1])
    cap = check_softcap(softcap) or 0.0
    check_balance(balance)
    window = _check(q, k, v, enable_gqa, window)
    scale = check_scale(scale)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, not {algorithm!r}")
    check_kernel(kernel)
    group, rank, world = group_info(group)
    docs = _check_docs(cu_seqlens, q.shape[2] * world)
    policy = check_policy(policy)
    if world == 1 and docs is None and kernel == "auto":
        return attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, window=window,
                         policy=policy, label=label, sinks=sinks, softcap=softcap)
    _ring_policy(policy)
    if balance == "zigzag" and world > 1 and q.shape[2] % 2:
        raise ValueError(f"zigzag balance needs an even local length, got {q.shape[2]}")
    scale = default_scale(q.shape[-1]) if scale is None else scale
    blocks = ring_block_problem(q, k, v, causal=bool(is_causal), kernel=kernel, deterministic=policy.deterministic,
                                softcap=cap)
    c = Call(group, rank, world, q.shape[2], bool(is_causal), scale, window, balance, docs, algorithm,
             block_engine(blocks, policy), v.shape[-1])
    if policy.mode == "auto" and not cap:  # (the quantized blocks apply no soft cap: such calls run exact)
        _adapt(c, q, k, v, policy, kernel, label)
    if not stats.enabled:
        return RingFunction.apply(q, k, v, c, sinks)
    if stats.timing():
        with stats.Timer(q.device) as timer:
            out = RingFunction.apply(q, k, v, c, sinks)
        wall = timer.ms
    else:
        out, wall = RingFunction.apply(q, k, v, c, sinks), None
    record(c, q, k, wall)
    return out


def check_policy(policy) -> Policy:
    if policy is None:
        return EXACT
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an adaattn.Policy or None, got {type(policy).__name__}")
    return policy


def _ring_policy(policy: Policy) -> None:
    """Refuse what the ring's blocks cannot do (rather than accept it and do nothing). A policy that
    allows a quantized precision as well (Policy(mode="auto") alone allows everything) runs its
    blocks quantized: rank approximations are allowed, not asked for, and the ring has none."""
    if policy.approximations and not {"int8", "fp8"} & set(policy.precisions):
        raise ValueError(f"ring_attention's blocks run exact or quantized: Policy.approximations="
                         f"{policy.approximations} (rank approximations) is not available across ranks and "
                         f"Policy.precisions={policy.precisions} allows no quantized level; allow int8 or fp8, "
                         "or run the whole sequence on one GPU with adaattn.attention")
    if policy.backends is not None:
        raise ValueError(f"ring_attention picks its block kernels with kernel= {KERNELS}, not "
                         f"Policy.backends (got {policy.backends}); pass backends=None")


def _adapt(c: Call, q, k, v, policy: Policy, kernel: str, label: Optional[str]) -> None:
    """Under mode="auto": this call's kind (exact, quantized, or verified) from its site."""
    levels, reasons = adaptive.quant_levels(q, k, v, policy, kernel)
    c.adapt = {"tolerance": policy.tolerance}
    if not levels:
        c.adapt.update({"ran": "exact", "why": " ".join(reasons)})
        return
    key = (label, policy.tolerance, policy.precisions, policy.verify, policy.train_quantized, c.world, c.balance,
           c.algorithm, q.shape[0], q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], q.dtype, str(q.device),
           c.causal, c.window, c.scale, c.docs is not None, _length_bucket(c.n), c.engine.name)
    site = adaptive.site_for(key, policy, levels, q)
    c.kind = site.begin(q.device)
    c.quant = adaptive.QuantBlocks(site, c.engine)


def _length_bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
