"""Where each rank's positions lie: the layouts of a sequence sharded over a process group.

The global sequence of length N is split over `world` ranks, each holding N / world positions
of q, k and v (the sequence dimension is dim 2 of (B, H, N, D)).
- balance="plain": rank r holds positions [r*n, (r+1)*n).
- balance="zigzag" (head-tail): the sequence is cut into 2*world chunks of N / (2*world);
  rank r holds chunks r and 2*world-1-r, concatenated. Under a causal mask every rank then
  does about the same work. (torch's context_parallel head-tail balancer lays shards out the
  same way.)
`shard` / `unshard` split and restore the global sequence; `positions` says which global
positions a rank's shard holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BALANCES = ("zigzag", "plain")


def group_info(group) -> tuple[object, int, int]:
    """(group, rank, world) or (None, 0, 1) when torch.distributed is not in use."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialized")
        return None, 0, 1
    if group is None:
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def check_balance(balance: str) -> None:
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, not {balance!r}")


def positions(rank: int, world: int, n_local: int, balance: str = "zigzag",
              device: torch.device | str | None = None) -> torch.Tensor:
    """Global sequence positions (int64, length n_local) of the shard that rank `rank` holds."""
    check_balance(balance)
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
    check_balance(balance)
    group, rank, world = group_info(group)
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
    check_balance(balance)
    group, _, world = group_info(group)
    if world == 1:
        return x_local
    return _Unshard.apply(x_local, dim, group, balance)

