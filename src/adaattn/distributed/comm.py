"""Communication: how K/V shards reach every rank, and how their gradients return to the owners.

algorithm="ring": at step s rank r holds the K/V shard of rank (r - s) mod world; it starts
sending that shard to rank r+1 (and receiving the next from r-1) before it computes the block,
so transfer overlaps compute. algorithm="allgather": every rank gathers all K/V shards at once
(asynchronously, while it attends to its own shard), which costs world x the K/V memory but one
collective instead of world - 1 exchanges: the choice for short shards.

In the ring's backward the dk/dv accumulators travel with their K/V shard and one last hop
returns each to the rank that owns the shard (Ring.exchange); in the all-gather variant every
rank makes dk/dv for all shards and `reduce_to_owners` sums them to their owners.
`c` below is a function.Call (its group, rank and world).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ALGORITHMS = ("ring", "allgather")


class Ring:
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


def ring_shards(c, k, v):
    """(source rank, k, v) for every K/V shard, passed around the ring; the next exchange is
    under way while the caller computes with the current shard."""
    cur = [k.contiguous(), v.contiguous()]
    ring = Ring(c.group, c.rank, c.world) if c.world > 1 else None
    for step in range(c.world):
        nxt, reqs = ring.exchange(cur) if step < c.world - 1 else (None, None)
        yield (c.rank - step) % c.world, cur[0], cur[1]
        Ring.wait(reqs)
        cur = nxt


def gathered_shards(c, k, v):
    """(source rank, k, v) for every K/V shard: an asynchronous all-gather while the caller
    computes with the local shard, then the others."""
    k, v = k.contiguous(), v.contiguous()
    if c.world == 1:
        yield c.rank, k, v
        return
    ks = [torch.empty_like(k) for _ in range(c.world)]
    vs = [torch.empty_like(v) for _ in range(c.world)]
    works = [dist.all_gather(ks, k, group=c.group, async_op=True),
             dist.all_gather(vs, v, group=c.group, async_op=True)]
    yield c.rank, k, v
    for w in works:
        w.wait()
    for src in range(c.world):
        if src != c.rank:
            yield src, ks[src], vs[src]


def reduce_to_owners(c, grads: torch.Tensor) -> torch.Tensor:
    """grads (world, ...) holds this rank's contribution to every shard's gradient; returns the
    sum over ranks of the slot of this rank's shard."""
    if c.world == 1:
        return grads[0]
    if "nccl" in str(dist.get_backend(c.group)):
        out = torch.empty_like(grads[0])
        dist.reduce_scatter_tensor(out, grads.flatten(0, 1), group=c.group)
        return out
    dist.all_reduce(grads, group=c.group)  # gloo has no reduce-scatter
    return grads[c.rank]
