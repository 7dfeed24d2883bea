"""The autograd function of one ring call: the forward over every visiting shard's blocks, merged
by log-sum-exp, and the exact backward.

A Call holds what one call decided (group, mask in global positions, algorithm, block engine).
The forward runs each block's bands through the engine (and, under a quantized policy, the
quantized blocks, or both on a verified call: adaptive.py) and merges partial results exactly.
The backward visits the same pairs with the saved global lse and output: P = exp(S*scale - lse),
delta = rowsum(dout * out), dS = P * (dP - delta); the block engines' backward takes exactly
those (lse, out) for a pair. dq accumulates locally; dk/dv return to the rank that owns their
shard (comm.py). GQA: Hq a multiple of Hkv; K/V are never repeated, neither in communication
nor in compute.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..backends.modifiers import sink_backward, sink_margin
from . import adaptive
from .bands import block_pairs
from .comm import Ring, gathered_shards, reduce_to_owners, ring_shards


class Call:
    """What one call decided: the group, the mask in global positions and how blocks run.
    `engine` runs the exact blocks (and every backward block); under a policy that allows
    quantized levels, `quant` runs the forward's blocks ("quant"), or both run ("verify")."""

    def __init__(self, group, rank, world, n, causal, scale, window, balance, docs, algorithm, engine, value_dim):
        self.group, self.rank, self.world, self.n, self.value_dim = group, rank, world, n, value_dim
        self.causal, self.scale, self.window, self.balance, self.docs = causal, scale, window, balance, docs
        self.algorithm, self.engine = algorithm, engine
        self.quant = None  # adaptive.QuantBlocks, when this call's forward may run quantized
        self.kind = "exact"  # "exact", "quant" or "verify"
        self.adapt: Optional[dict] = None  # the policy's decisions for adaattn.stats

    def pairs(self, src: int) -> tuple:
        return block_pairs(self.rank, src, self.world, self.n, self.balance, self.causal, self.window, self.docs)

    def shards(self, k, v):
        return (ring_shards if self.algorithm == "ring" else gathered_shards)(self, k, v)


def forward_engines(c: Call, q, shards, engines: list, timer=None, names=()) -> list:
    """[(out in the compute dtype, lse)] of the local queries against every (src, k, v) of
    `shards`, one per engine of `engines`, merged by log-sum-exp; with `timer`
    (adaptive.EventTimer), each engine's blocks and merges are timed under its name. A first
    block that covers every row is taken as it is."""
    cdt = c.engine.cdt
    acc: list = [[None, None] for _ in engines]
    for src, ks, vs in shards:
        for qa, qb, ka, kb, left, right in c.pairs(src):
            for i, eng in enumerate(engines):
                with (timer.span(names[i]) if timer is not None else contextlib.nullcontext()):
                    bo, bl = eng.forward(q[:, :, qa:qb], ks[:, :, ka:kb], vs[:, :, ka:kb], c.scale, left, right)
                    a = acc[i]
                    if a[0] is None and (qa, qb) == (0, q.shape[2]):
                        a[0], a[1] = bo.to(cdt), bl.to(cdt)
                        continue
                    if a[0] is None:
                        a[0] = q.new_zeros(*q.shape[:-1], vs.shape[-1], dtype=cdt)
                        a[1] = q.new_full(q.shape[:-1], float("-inf"), dtype=cdt)
                    eng.merge(a[0][:, :, qa:qb], a[1][:, :, qa:qb], bo, bl)
    for a in acc:
        if a[0] is None:  # no key visible to any local query (a window, documents)
            a[0] = q.new_zeros(*q.shape[:-1], c.value_dim, dtype=cdt)
            a[1] = q.new_full(q.shape[:-1], float("-inf"), dtype=cdt)
    return [tuple(a) for a in acc]


def forward_blocks(c: Call, q, shards):
    """(out in the compute dtype, lse) of the exact blocks."""
    return forward_engines(c, q, shards, [c.engine])[0]


def forward_verified(c: Call, q, k, v):
    """A verified call: quantized and exact blocks in one pass over the shards, the errors and
    times summed over the ranks (one all-reduce), the site's decisions taken; returns
    (out, lse) with the heads over the tolerance taken from the exact blocks."""
    site = c.quant.site
    timer = adaptive.EventTimer(("quant", "exact"), q.device)
    names = ("quant", "exact") if site.verified % 2 else ("exact", "quant")  # who runs first alternates
    engines = {"quant": c.quant, "exact": c.engine}
    got = dict(zip(names, forward_engines(c, q, c.shards(k, v), [engines[n] for n in names], timer, names)))
    (oq, lq), (oe, le) = got["quant"], got["exact"]
    hq = q.shape[1]
    times = timer.totals()
    timed = times["quant"] is not None
    sums = torch.cat([(oq - oe).double().pow(2).sum((0, 2, 3)), oe.double().pow(2).sum((0, 2, 3)),
                      torch.tensor([times["quant"] or 0.0, times["exact"] or 0.0], dtype=torch.float64).to(q.device)])
    if c.world > 1:
        dist.all_reduce(sums, group=c.group)
    vals = sums.tolist()
    bad = site.settle(vals[:hq], vals[hq:2 * hq], vals[-2] if timed else None, vals[-1] if timed else None)
    if bad:
        heads = torch.tensor(bad, device=q.device)
        oq.index_copy_(1, heads, oe.index_select(1, heads))
        lq.index_copy_(1, heads, le.index_select(1, heads))
    c.adapt["heads_redone_exact"] = bad
    return oq, lq


def backward_block(c: Call, q, dout, out, lse, src, ks, vs, dq, dk, dv) -> None:
    """Add the gradients of the local queries' block against the K/V shard of `src` into dq
    (local) and dk/dv (that shard's accumulators)."""
    for qa, qb, ka, kb, left, right in c.pairs(src):
        rows = slice(qa, qb)
        bdq, bdk, bdv = c.engine.backward(
            q[:, :, rows], ks[:, :, ka:kb], vs[:, :, ka:kb], dout[:, :, rows], out[:, :, rows], lse[:, :, rows],
            c.scale, left, right)
        dq[:, :, rows] += bdq
        dk[:, :, ka:kb] += bdk
        dv[:, :, ka:kb] += bdv


class RingFunction(torch.autograd.Function):
    """The ring's forward and exact backward. sinks (Hq,): applied to the merged output from the
    global lse, O' = w O; the backward is the plain one with dout = w g against O' (its delta
    then carries the lse's own path), and d sinks = -sum over rows of (1 - w) rowsum(g O')."""

    @staticmethod
    def forward(ctx, q, k, v, c: Call, sinks=None):
        if c.kind == "verify":
            out, lse = forward_verified(c, q, k, v)
        elif c.kind == "quant":
            out, lse = forward_engines(c, q, c.shards(k, v), [c.quant])[0]
        else:
            out, lse = forward_blocks(c, q, c.shards(k, v))
        if sinks is not None:
            out = out * torch.sigmoid(sink_margin(lse, sinks, lse.dtype))[..., None]
        # One layout whatever built it (a first block's output keeps its kernel's layout): the
        # backward hands row slices of it and of the contiguous dout to kernels side by side.
        result = out.to(q.dtype).contiguous()
        extra = () if sinks is None else (sinks.detach(),)
        if c.kind == "exact":
            ctx.save_for_backward(q, k, v, result, lse, *extra)
        else:  # the backward is exact: it recomputes the exact output and log-sum-exp
            ctx.save_for_backward(q, k, v, *extra)
        ctx.call = c
        ctx.sinks = sinks is not None
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        c = ctx.call
        saved = list(ctx.saved_tensors)
        sinks = saved.pop() if ctx.sinks else None
        if c.kind == "exact":
            q, k, v, out, lse = saved
        else:
            q, k, v = saved
            out, lse = forward_blocks(c, q, c.shards(k, v))
            if sinks is not None:
                out = out * torch.sigmoid(sink_margin(lse, sinks, lse.dtype))[..., None]
            out = out.to(q.dtype)
        cdt = c.engine.cdt
        dsinks = None
        if sinks is not None:
            dout, dsinks = sink_backward(dout, out, sink_margin(lse, sinks, cdt))
            dout, dsinks = dout.to(q.dtype), dsinks.to(ctx.sinks_dtype)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        if c.algorithm == "allgather":
            dks = torch.zeros((c.world, *k.shape), dtype=cdt, device=k.device)
            dvs = torch.zeros((c.world, *v.shape), dtype=cdt, device=v.device)
            for src, ks, vs in c.shards(k, v):
                backward_block(c, q, dout, out, lse, src, ks, vs, dq, dks[src], dvs[src])
            dk, dv = reduce_to_owners(c, dks), reduce_to_owners(c, dvs)
        else:
            dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
            dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
            ring = Ring(c.group, c.rank, c.world) if c.world > 1 else None
            for src, ks, vs in c.shards(k, v):
                backward_block(c, q, dout, out, lse, src, ks, vs, dq, dk, dv)
                if ring is not None:
                    # The accumulators follow their shard; after the last step this hop brings
                    # each back to the rank that owns the shard.
                    grads, reqs = ring.exchange([dk, dv], tag0=2)
                    Ring.wait(reqs)
                    dk, dv = grads
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, dsinks
