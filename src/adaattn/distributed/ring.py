"""Ring attention: exact attention over a sequence sharded across a process group.

Layout. The global sequence of length N is split over `world` ranks, each holding N / world
positions of q, k and v (the sequence dimension is dim 2 of (B, H, N, D)).
- balance="plain": rank r holds positions [r*n, (r+1)*n).
- balance="zigzag" (head-tail): the sequence is cut into 2*world chunks of N / (2*world);
  rank r holds chunks r and 2*world-1-r, concatenated. Under a causal mask every rank then
  does about the same work.
Masks (causal, sliding window) are always applied in GLOBAL positions, so the result equals
single-process attention on the global tensors, sharded the same way.

Forward. At step s (0 .. world-1) rank r holds the K/V shard of rank (r - s) mod world; it
starts sending that shard to rank r+1 (and receiving the next from r-1) before it computes the
block, so transfer overlaps compute. Each visible block gives a partial (out, lse); partials
merge by log-sum-exp in float32 (float64 for float64 inputs). Blocks with no visible
(query, key) pair are skipped; rows that see no key of a block carry lse = -inf and add nothing.

Backward (a torch.autograd.Function) runs the ring again with the saved global lse and
output: P = exp(S*scale - lse), delta = rowsum(dout * out), dS = P * (dP - delta). dq
accumulates locally; the dk/dv accumulators travel with their K/V shard, and one last hop
returns each to the rank that owns the shard, so every rank ends with the gradient of its own
k/v shard.

GQA: Hq a multiple of Hkv; K/V are never repeated, neither in communication nor in compute
(the query heads of a group are folded into a group axis).

Per-block compute is plain torch math (`_block_forward` / `_block_backward`), correct on every
device. It is kept in those two functions so that a later change can route a block to the
Triton kernels (adaattn.backends.triton_ops.triton_fwd returns (out, lse) with natural-log
lse, which is what `_merge` expects); that routing is not implemented here.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..api import attention

BALANCES = ("zigzag", "plain")

Window = Optional[tuple]


# ----------------------------------------------------------------------------- group helpers


def _group_info(group) -> tuple[object, int, int]:
    """(group, rank, world) or (None, 0, 1) when torch.distributed is not in use."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialized")
        return None, 0, 1
    if group is None:
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _check_balance(balance: str) -> None:
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, not {balance!r}")


def positions(rank: int, world: int, n_local: int, balance: str = "zigzag",
              device: torch.device | str | None = None) -> torch.Tensor:
    """Global sequence positions (int64, length n_local) of the shard that rank `rank` holds."""
    _check_balance(balance)
    if balance == "plain" or world == 1:
        return torch.arange(rank * n_local, (rank + 1) * n_local, device=device)
    if n_local % 2:
        raise ValueError(f"zigzag balance needs an even local length, got {n_local}")
    c = n_local // 2
    tail = 2 * world - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange(tail * c, (tail + 1) * c, device=device)])


def shard(x: torch.Tensor, dim: int, group=None, balance: str = "zigzag") -> torch.Tensor:
    """This rank's shard of the global tensor `x` along `dim` (every rank passes the same x).

    plain: chunk `rank` of `world`; zigzag: chunks rank and 2*world-1-rank of 2*world,
    concatenated. With no process group (or world size 1) returns x. Differentiable (a slice).
    """
    _check_balance(balance)
    group, rank, world = _group_info(group)
    if world == 1:
        return x
    n = x.shape[dim]
    parts = 2 * world if balance == "zigzag" else world
    if n % parts:
        raise ValueError(f"length {n} along dim {dim} is not divisible by {parts} ({balance}, world {world})")
    chunks = x.chunk(parts, dim)
    if balance == "plain":
        return chunks[rank].contiguous()
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)


def _reorder_gathered(pieces: list[torch.Tensor], dim: int, balance: str) -> torch.Tensor:
    if balance == "plain":
        return torch.cat(pieces, dim)
    world = len(pieces)
    halves = [p.chunk(2, dim) for p in pieces]
    ordered = [halves[i][0] for i in range(world)] + [halves[world - 1 - j][1] for j in range(world)]
    return torch.cat(ordered, dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, balance):
        world = dist.get_world_size(group)
        ctx.dim, ctx.group, ctx.balance = dim, group, balance
        x = x.contiguous()
        pieces = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(pieces, x, group=group)
        return _reorder_gathered(pieces, dim, balance)

    @staticmethod
    def backward(ctx, grad):
        # The adjoint of all-gather is reduce-scatter: sum the gradients of every rank, keep ours.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return shard(grad, ctx.dim, ctx.group, ctx.balance), None, None, None


def unshard(x_local: torch.Tensor, dim: int, group=None, balance: str = "zigzag") -> torch.Tensor:
    """All-gather the shards along `dim` and restore the global order (inverse of `shard`).

    Differentiable: the backward sums the gradient over ranks and returns this rank's slice.
    With no process group (or world size 1) returns x_local.
    """
    _check_balance(balance)
    group, _, world = _group_info(group)
    if world == 1:
        return x_local
    return _Unshard.apply(x_local, dim, group, balance)


# ----------------------------------------------------------------------------- block math


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: Window) -> torch.Tensor | None:
    """Bool (n, m), True = the pair takes part; None when every pair does."""
    keep = None
    qp, kp = q_pos.unsqueeze(1), k_pos.unsqueeze(0)
    if causal:
        keep = kp <= qp
    if window is not None:
        left, right = window
        if left is not None:
            inside = kp >= qp - left
            keep = inside if keep is None else keep & inside
        if right is not None:
            inside = kp <= qp + right
            keep = inside if keep is None else keep & inside
    return keep


def _scores(q, k, scale, q_pos, k_pos, causal, window):
    """Scores (B, Hkv, G, n, m) with invisible pairs at -inf; q folded to (B, Hkv, G, n, D)."""
    b, hq, n, d = q.shape
    hk = k.shape[1]
    qg = q.reshape(b, hk, hq // hk, n, d)
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-2, -1)) * scale
    mask = _mask(q_pos, k_pos, causal, window)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return qg, s


def _block_forward(q, k, v, scale, q_pos, k_pos, causal, window):
    """Partial attention of the local queries to one visiting K/V shard: (out, lse).

    q (B, Hq, n, D), k (B, Hkv, m, D), v (B, Hkv, m, Dv), all in the compute dtype; q_pos (n,),
    k_pos (m,) global positions on q's device. Returns out (B, Hq, n, Dv) normalised within the
    block and lse (B, Hq, n) in natural log; a row with no visible key gives out 0, lse -inf.
    Plain torch math; this is the hook where a later change may call
    adaattn.backends.triton_ops.triton_fwd (same (out, lse) contract) on GPUs.
    """
    b, hq, n, _ = q.shape
    _, s = _scores(q, k, scale, q_pos, k_pos, causal, window)
    row_max = s.amax(dim=-1, keepdim=True)
    row_max = row_max.masked_fill(torch.isneginf(row_max), 0.0)
    p = torch.exp(s - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, v.unsqueeze(2)) / denom.masked_fill(denom == 0, 1.0)
    lse = (row_max + torch.log(denom)).squeeze(-1)
    return out.reshape(b, hq, n, v.shape[-1]), lse.reshape(b, hq, n)


def _block_backward(q, k, v, dout, lse, delta, scale, q_pos, k_pos, causal, window):
    """Gradient contributions (dq, dk, dv) of one block, from the GLOBAL lse and delta.

    q (B, Hq, n, D), k/v (B, Hkv, m, D/Dv), dout (B, Hq, n, Dv), lse/delta (B, Hq, n), all in
    the compute dtype. P = exp(S*scale - lse) (0 where masked or lse = -inf),
    dS = P * (dout @ v^T - delta). dk/dv are summed over the query heads of each group.
    """
    b, hq, n, d = q.shape
    hk, dv_dim = k.shape[1], v.shape[-1]
    g = hq // hk
    qg, s = _scores(q, k, scale, q_pos, k_pos, causal, window)
    lse_g = lse.reshape(b, hk, g, n, 1)
    lse_g = lse_g.masked_fill(torch.isneginf(lse_g), float("inf"))
    p = torch.exp(s - lse_g)
    dog = dout.reshape(b, hk, g, n, dv_dim)
    dv = torch.matmul(p.transpose(-2, -1), dog).sum(2)
    dp = torch.matmul(dog, v.unsqueeze(2).transpose(-2, -1))
    ds = p * (dp - delta.reshape(b, hk, g, n, 1))
    dq = torch.matmul(ds, k.unsqueeze(2)).reshape(b, hq, n, d) * scale
    dk = torch.matmul(ds.transpose(-2, -1), qg).sum(2) * scale
    return dq, dk, dv


def _merge(out, lse, block_out, block_lse):
    """Exact log-sum-exp merge of two partial results (rows with lse = -inf on both stay 0)."""
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(torch.isneginf(new), 0.0)
    out = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return out, new


# ----------------------------------------------------------------------------- the ring


class _Ring:
    """Point-to-point exchange with the ring neighbours: send to rank+1, receive from rank-1."""

    def __init__(self, group, rank: int, world: int):
        self.group = group
        self.send_to = dist.get_global_rank(group, (rank + 1) % world)
        self.recv_from = dist.get_global_rank(group, (rank - 1) % world)

    def exchange(self, tensors: list[torch.Tensor], tag0: int = 0):
        """Start sending `tensors` on and receiving same-shaped ones; returns (buffers, requests)."""
        ops, bufs = [], []
        for i, t in enumerate(tensors):
            ops.append(dist.P2POp(dist.isend, t, self.send_to, self.group, tag0 + i))
        for i, t in enumerate(tensors):
            buf = torch.empty_like(t)
            bufs.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, self.recv_from, self.group, tag0 + i))
        return bufs, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(reqs) -> None:
        for r in reqs or ():
            r.wait()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _visiting(q_pos_cpu, src: int, world: int, m: int, balance: str, causal: bool, window: Window, device):
    """Global positions (on `device`) of the K/V shard of rank `src`, or None when no local query
    sees any of its keys (the block is skipped). Decided on the CPU: no device sync."""
    vis = _mask(q_pos_cpu, positions(src, world, m, balance), causal, window)
    if vis is not None and not bool(vis.any()):
        return None
    return positions(src, world, m, balance, device)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, rank, world, causal, scale, window, balance):
        cdt = _compute_dtype(q.dtype)
        ring = _Ring(group, rank, world)
        n, m = q.shape[2], k.shape[2]
        q_pos = positions(rank, world, n, balance, q.device)
        q_pos_cpu = positions(rank, world, n, balance)
        qc = q.to(cdt)
        out = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=cdt)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=cdt)
        cur_k, cur_v = k.contiguous(), v.contiguous()
        for step in range(world):
            reqs, nxt = None, None
            if step < world - 1:
                nxt, reqs = ring.exchange([cur_k, cur_v])
            k_pos = _visiting(q_pos_cpu, (rank - step) % world, world, m, balance, causal, window, q.device)
            if k_pos is not None:
                bo, bl = _block_forward(qc, cur_k.to(cdt), cur_v.to(cdt), scale, q_pos, k_pos, causal, window)
                out, lse = _merge(out, lse, bo, bl)
            if reqs is not None:
                _Ring.wait(reqs)
                cur_k, cur_v = nxt
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.args = (group, rank, world, causal, scale, window, balance)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, rank, world, causal, scale, window, balance = ctx.args
        cdt = _compute_dtype(q.dtype)
        ring = _Ring(group, rank, world)
        n, m = q.shape[2], k.shape[2]
        q_pos = positions(rank, world, n, balance, q.device)
        q_pos_cpu = positions(rank, world, n, balance)
        qc, doc = q.to(cdt), dout.to(cdt)
        delta = (doc * out.to(cdt)).sum(-1)
        dq = torch.zeros_like(qc)
        dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
        dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
        cur_k, cur_v = k.contiguous(), v.contiguous()
        for step in range(world):
            kv_reqs, nxt = None, None
            if step < world - 1:
                nxt, kv_reqs = ring.exchange([cur_k, cur_v])
            k_pos = _visiting(q_pos_cpu, (rank - step) % world, world, m, balance, causal, window, q.device)
            if k_pos is not None:
                bdq, bdk, bdv = _block_backward(qc, cur_k.to(cdt), cur_v.to(cdt), doc, lse, delta, scale,
                                                q_pos, k_pos, causal, window)
                dq += bdq
                dk += bdk
                dv += bdv
            # The accumulators follow their shard; after the last step this hop brings each
            # back to the rank that owns the shard.
            grads, g_reqs = ring.exchange([dk, dv], tag0=2)
            _Ring.wait(kv_reqs)
            _Ring.wait(g_reqs)
            dk, dv = grads
            if nxt is not None:
                cur_k, cur_v = nxt
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


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
    if window is not None:
        if len(window) != 2 or any(w is not None and (not isinstance(w, int) or w < 0) for w in window):
            raise ValueError(f"window must be (left, right) with non-negative ints or None, got {window!r}")
        window = tuple(window)
    return window


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                   is_causal: bool = False, scale: float | None = None, window: Window = None,
                   enable_gqa: bool = False, balance: str = "zigzag") -> torch.Tensor:
    """Exact attention over a sequence sharded across `group` (default: the world group).

    q (B, Hq, n, D), k (B, Hkv, n, D), v (B, Hkv, n, Dv) are this rank's shards of the
    sequence (dim 2), laid out as `shard(x, 2, group, balance)` lays them out; every rank holds
    the same n. Returns this rank's output shard (B, Hq, n, Dv) in the input dtype.
    is_causal / window=(left, right) apply in global positions (None on a side: unbounded);
    scale defaults to 1/sqrt(D); enable_gqa allows Hq a multiple of Hkv. Differentiable in
    q, k and v. With no initialized process group, or world size 1, this is adaattn.attention.
    """
    _check_balance(balance)
    window = _check(q, k, v, enable_gqa, window)
    group, rank, world = _group_info(group)
    if world == 1:
        return attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, window=window)
    if balance == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"zigzag balance needs an even local length, got {q.shape[2]}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, group, rank, world, bool(is_causal), float(scale), window, balance)


class RingAttention(nn.Module):
    """ring_attention as a module, holding its process group and balance."""

    def __init__(self, group=None, balance: str = "zigzag"):
        super().__init__()
        _check_balance(balance)
        self.group = group
        self.balance = balance

    def forward(self, q, k, v, is_causal: bool = False, scale: float | None = None, window: Window = None,
                enable_gqa: bool = False) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, is_causal=is_causal, scale=scale, window=window,
                              enable_gqa=enable_gqa, balance=self.balance)

    def extra_repr(self) -> str:
        return f"balance={self.balance!r}"
