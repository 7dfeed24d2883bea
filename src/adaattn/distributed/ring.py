"""Ring attention: exact attention over a sequence sharded across a process group.

Layout. The global sequence of length N is split over `world` ranks, each holding N / world
positions of q, k and v (the sequence dimension is dim 2 of (B, H, N, D)).
- balance="plain": rank r holds positions [r*n, (r+1)*n).
- balance="zigzag" (head-tail): the sequence is cut into 2*world chunks of N / (2*world);
  rank r holds chunks r and 2*world-1-r, concatenated. Under a causal mask every rank then
  does about the same work. (torch's context_parallel head-tail balancer lays shards out the
  same way.)
Masks (causal, sliding window, documents) always apply in GLOBAL positions, so the result
equals single-process attention on the global tensors, sharded the same way. Documents
(`cu_seqlens`, the boundaries of packed documents in the global sequence) confine each query
to keys of its own document, as a FlexAttention document mask or varlen attention does.

Blocks. A rank's positions form a few runs of consecutive global positions (one for plain,
two for zigzag, split further at document boundaries). A local query run against a visiting
key run sees a band of key offsets: the global causal/window condition shifted by the runs'
distance. Each band is trimmed to the rows and keys that take part, which leaves a band the
kernels take as it is (top-left causal and/or window sides, or no mask), so a block is one
kernel call per (query run, key run) pair, and fully visible pairs next to each other merge
into one call. Pairs that see nothing are skipped; this is decided on the host from the
shards' positions, with no device sync.

Kernels. kernel="triton" runs the pairs through our Triton forward and backward (natural-log
lse, fp32), kernel="torch" through torch math in float32 (float64 for float64 inputs),
kernel="cudnn" the full and square causal pairs through cuDNN's fused kernel (torch's aten op,
which returns the lse, and its backward, which takes a pair's global out and lse) and the
other bands through Triton, and "auto" takes cuDNN's split where the planner runs cuDNN for a
call of the shard's shape, else Triton where it runs (CUDA tensors, float16/bfloat16/float32,
head dims it takes), and torch otherwise. Partial results merge exactly by log-sum-exp in float32 (float64).

Algorithms. algorithm="ring": at step s rank r holds the K/V shard of rank (r - s) mod world;
it starts sending that shard to rank r+1 (and receiving the next from r-1) before it computes
the block, so transfer overlaps compute. algorithm="allgather": every rank gathers all K/V
shards at once (asynchronously, while it attends to its own shard), which costs world x the
K/V memory but one collective instead of world - 1 exchanges: the choice for short shards.

Backward (a torch.autograd.Function) visits the same pairs with the saved global lse and
output: P = exp(S*scale - lse), delta = rowsum(dout * out), dS = P * (dP - delta); the Triton
backward kernels take exactly those (lse, out) for a pair. dq accumulates locally. In the ring,
the dk/dv accumulators travel with their K/V shard and one last hop returns each to the rank
that owns the shard; in the all-gather variant every rank makes dk/dv for all shards and a
reduce-scatter (an all-reduce on backends without one) sums them to their owners.

GQA: Hq a multiple of Hkv; K/V are never repeated, neither in communication nor in compute.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from bisect import bisect_right
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable

from .. import stats
from ..api import attention
from ..policy import EXACT, Policy
from . import adaptive
from ..backends.masks import position_keep
from ..problem import Problem, check_scale, check_window, default_scale

BALANCES = ("zigzag", "plain")
ALGORITHMS = ("ring", "allgather")
KERNELS = ("auto", "cudnn", "triton", "torch")

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


# ----------------------------------------------------------------------------- runs and pairs


@functools.lru_cache(maxsize=4096)
def _runs(rank: int, world: int, n: int, balance: str, docs: Optional[tuple]) -> tuple:
    """The runs of consecutive global positions in rank's shard, split at document starts:
    (local_start, global_start, length, document) each."""
    if balance == "plain" or world == 1:
        pieces = [(0, rank * n, n)]
    else:
        c = n // 2
        pieces = [(0, rank * c, c), (c, (2 * world - 1 - rank) * c, c)]
    if docs is None:
        return tuple((lo, g, m, 0) for lo, g, m in pieces)
    runs = []
    for lo, g, m in pieces:
        pos, end = g, g + m
        while pos < end:
            d = bisect_right(docs, pos) - 1
            stop = min(end, docs[d + 1])
            runs.append((lo + pos - g, pos, stop - pos, d))
            pos = stop
    return tuple(runs)


def _global_band(causal: bool, window: Window) -> tuple[Optional[int], Optional[int]]:
    """The visible key offsets (key position - query position) as (lowest, highest); None where
    unbounded."""
    lo = hi = None
    if causal:
        hi = 0
    if window is not None:
        left, right = window
        if left is not None:
            lo = -left
        if right is not None:
            hi = right if hi is None else min(hi, right)
    return lo, hi


def _trim(nq: int, nk: int, dist_: int, lo_g: Optional[int], hi_g: Optional[int]):
    """The part of a (query run, key run) pair that takes part, or None.

    dist_ is the key run's global start less the query run's. Local key j is visible to local
    query i iff lo_g <= j - i + dist_ <= hi_g. Returns (qs, qe, ks, ke, left, right): the rows
    [qs, qe) that see at least one key, the keys [ks, ke) they see, and the band of the trimmed
    block as the kernels take it, top-left: key j visible to row i iff -left <= j - i <= right,
    with -1 for an unbounded side (right = 0 is causal).
    """
    lo = None if lo_g is None else lo_g - dist_
    hi = None if hi_g is None else hi_g - dist_
    qs = 0 if hi is None else max(0, -hi)
    qe = nq if lo is None else min(nq, nk - lo)
    if qs >= qe:
        return None
    ks = 0 if lo is None else max(0, qs + lo)
    ke = nk if hi is None else min(nk, qe + hi)
    if ks >= ke:
        return None
    # After the trim lo <= 0 <= hi in the block's own indices (a top-left band).
    lo2 = None if lo is None else lo - ks + qs
    hi2 = None if hi is None else hi - ks + qs
    left = -1 if lo2 is None or lo2 <= -(qe - qs - 1) else -lo2
    right = -1 if hi2 is None or hi2 >= ke - ks - 1 else hi2
    return qs, qe, ks, ke, left, right


def _merge_full(pairs: list) -> list:
    """Merge unmasked pairs that share their keys and have adjacent rows, or share their rows
    and have adjacent keys: one kernel call instead of several."""
    pairs = list(pairs)
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(pairs):
            if a[4] != -1 or a[5] != -1:
                continue
            for j, b in enumerate(pairs):
                if j == i or b[4] != -1 or b[5] != -1:
                    continue
                if a[2:4] == b[2:4] and a[1] == b[0]:
                    pairs[i] = (a[0], b[1], a[2], a[3], -1, -1)
                elif a[0:2] == b[0:2] and a[3] == b[2]:
                    pairs[i] = (a[0], a[1], a[2], b[3], -1, -1)
                else:
                    continue
                del pairs[j]
                merged = True
                break
            if merged:
                break
    return pairs


@functools.lru_cache(maxsize=4096)
def _pairs(q_rank: int, k_rank: int, world: int, n: int, balance: str, causal: bool, window: Window,
           docs: Optional[tuple]) -> tuple:
    """The kernel calls of one block (local queries of q_rank against the K/V shard of k_rank):
    (q_start, q_end, k_start, k_end, left, right) each, in local indices; empty when no query
    sees a key of that shard."""
    if q_rank == k_rank and window is None and docs is None:
        # A shard against itself: global positions grow with the local index, so the global
        # causal mask is the local one.
        return ((0, n, 0, n, -1, 0 if causal else -1),)
    lo_g, hi_g = _global_band(causal, window)
    pairs = []
    for ql, qg, qn, qd in _runs(q_rank, world, n, balance, docs):
        for kl, kg, kn, kd in _runs(k_rank, world, n, balance, docs):
            if qd != kd:
                continue
            t = _trim(qn, kn, kg - qg, lo_g, hi_g)
            if t is not None:
                qs, qe, ks, ke, left, right = t
                pairs.append((ql + qs, ql + qe, kl + ks, kl + ke, left, right))
    return tuple(_merge_full(pairs))


# ----------------------------------------------------------------------------- block engines


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _band_keep(n: int, m: int, left: int, right: int, device) -> Optional[torch.Tensor]:
    """Bool (n, m), True where key j is visible to row i (-left <= j - i <= right, -1: unbounded);
    None: all."""
    return position_keep(n, m, False, (None if left < 0 else left, None if right < 0 else right), device)


class _TorchBlocks:
    """A block in torch math, in float32 (float64 for float64 inputs): correct on every device."""

    name = ran = "torch"

    def __init__(self, dtype: torch.dtype):
        self.cdt = _compute_dtype(dtype)

    def _scores(self, q, k, scale, left, right):
        b, hq, n, d = q.shape
        hk = k.shape[1]
        qg = q.to(self.cdt).reshape(b, hk, hq // hk, n, d)
        s = torch.matmul(qg, k.to(self.cdt).unsqueeze(2).transpose(-2, -1)) * scale
        mask = _band_keep(n, k.shape[2], left, right, q.device)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return qg, s

    def forward(self, q, k, v, scale, left, right):
        """(out, lse) of q (B, Hq, n, D) against k/v (B, Hkv, m, D/Dv), lse in natural log;
        a row that sees no key gives out 0 and lse -inf."""
        b, hq, n, _ = q.shape
        _, s = self._scores(q, k, scale, left, right)
        row_max = s.amax(dim=-1, keepdim=True)
        row_max = row_max.masked_fill(torch.isneginf(row_max), 0.0)
        p = torch.exp(s - row_max)
        denom = p.sum(dim=-1, keepdim=True)
        out = torch.matmul(p, v.to(self.cdt).unsqueeze(2)) / denom.masked_fill(denom == 0, 1.0)
        lse = (row_max + torch.log(denom)).squeeze(-1)
        return out.reshape(b, hq, n, v.shape[-1]), lse.reshape(b, hq, n)

    def merge(self, out, lse, block_out, block_lse) -> None:
        """out/lse (views of the accumulators) become their merge with the block's, in place."""
        new_out, new_lse = _merge(out, lse, block_out.to(self.cdt), block_lse.to(self.cdt))
        out.copy_(new_out)
        lse.copy_(new_lse)

    def backward(self, q, k, v, dout, out, lse, scale, left, right):
        """(dq, dk, dv) of the block from the GLOBAL lse and out of its rows: delta =
        rowsum(dout * out), P = exp(S*scale - lse), dS = P * (dout @ v^T - delta); dk/dv summed
        over each group."""
        b, hq, n, d = q.shape
        hk, dv_dim = k.shape[1], v.shape[-1]
        g = hq // hk
        delta = (dout.to(self.cdt) * out.to(self.cdt)).sum(-1)
        qg, s = self._scores(q, k, scale, left, right)
        lse_g = lse.to(self.cdt).reshape(b, hk, g, n, 1)
        lse_g = lse_g.masked_fill(torch.isneginf(lse_g), float("inf"))
        p = torch.exp(s - lse_g)
        dog = dout.to(self.cdt).reshape(b, hk, g, n, dv_dim)
        dv = torch.matmul(p.transpose(-2, -1), dog).sum(2)
        dp = torch.matmul(dog, v.to(self.cdt).unsqueeze(2).transpose(-2, -1))
        ds = p * (dp - delta.reshape(b, hk, g, n, 1))
        dq = torch.matmul(ds, k.to(self.cdt).unsqueeze(2)).reshape(b, hq, n, d) * scale
        dk = torch.matmul(ds.transpose(-2, -1), qg).sum(2) * scale
        return dq, dk, dv


def _fail_once(engine: type, error: BaseException, what: str, then: str) -> None:
    """A block engine's run-time failure: re-raised where no fallback can mend it, else one
    warning per engine class, which then hands its blocks on for the rest of the process."""
    if isinstance(error, adaptive.NOT_RECOVERABLE):
        raise error
    if not engine.failed:
        engine.failed = True
        warnings.warn(f"adaattn.distributed: {what} failed ({type(error).__name__}: {str(error).strip()[:200]}); "
                      f"blocks run in {then} from now on", RuntimeWarning, stacklevel=5)


class _TritonBlocks:
    """A block through our Triton forward and backward kernels (natural-log lse, fp32); a kernel
    that fails hands that block, and the rest of the process's blocks, to torch math with one
    warning."""

    name = "triton"
    failed = False

    def __init__(self, dtype: torch.dtype, deterministic: bool):
        self.cdt = torch.float32
        self.deterministic = deterministic
        self.fallback = _TorchBlocks(dtype)

    @property
    def ran(self) -> str:
        """The engine that runs this one's blocks now (after a failure, its fallback's)."""
        return self.fallback.ran if _TritonBlocks.failed else self.name

    def _launch(self, q, k, v, scale, left, right):
        from ..backends.triton_launch import make_launch

        variant = _variant(q, k, v, scale, left, right)
        return make_launch(variant, scale, right == 0, left, -1 if right == 0 else right, False,
                           self.deterministic)

    def _failed(self, error: BaseException) -> None:
        _fail_once(_TritonBlocks, error, "the Triton block kernels", "torch math")

    def forward(self, q, k, v, scale, left, right):
        from ..backends.triton_launch import launch_fwd

        if not _TritonBlocks.failed:
            try:
                return launch_fwd(q, k, v, None, None, None, q.shape[2], k.shape[2],
                                  self._launch(q, k, v, scale, left, right))
            except Exception as e:  # a kernel failure: fall back, once, loudly
                self._failed(e)
        return self.fallback.forward(q, k, v, scale, left, right)

    def merge(self, out, lse, block_out, block_lse) -> None:
        from ..backends.triton_merge import merge_into

        if not _TritonBlocks.failed:
            try:
                return merge_into(out, lse, block_out, block_lse)
            except Exception as e:
                self._failed(e)
        self.fallback.merge(out, lse, block_out, block_lse)

    def backward(self, q, k, v, dout, out, lse, scale, left, right):
        from ..backends.triton_launch import launch_bwd

        if not _TritonBlocks.failed:
            try:
                return launch_bwd(dout, q, k, v, out, lse.contiguous(), None, None, None, q.shape[2], k.shape[2],
                                  self._launch(q, k, v, scale, left, right))
            except Exception as e:
                self._failed(e)
        return self.fallback.backward(q, k, v, dout, out, lse, scale, left, right)


class _CudnnBlocks:
    """Blocks through cuDNN's fused attention (torch's `_scaled_dot_product_cudnn_attention` op,
    which returns the natural-log lse, and its backward, which takes a pair's GLOBAL out and lse
    as the Triton backward does). cuDNN takes a full block or a square causal one; every other
    band (windows, trimmed causal bands) goes to the Triton blocks. A cuDNN failure hands that
    block, and the rest of the process's cuDNN blocks, to the Triton blocks with one warning.
    GQA goes in natively where the op takes it, else with K/V repeated to the query heads for
    the block (a copy of one shard's K/V, small against the block's work)."""

    name = "cudnn"
    failed = False
    # Whether the op takes Hq != Hkv, learned on the first GQA block of the process, forward and
    # backward apart.
    native_gqa: dict = {"fwd": None, "bwd": None}

    def __init__(self, dtype: torch.dtype, deterministic: bool):
        self.cdt = torch.float32
        self.triton = _TritonBlocks(dtype, deterministic)

    @property
    def ran(self) -> str:
        return self.triton.ran if _CudnnBlocks.failed else self.name

    @staticmethod
    def _takes(q, k, v, scale, left, right) -> bool:
        """A full or square causal block, with a positive scale (torch's fused kernels give NaN for
        is_causal with a scale <= 0, as backends/sdpa.py notes), and equal q/v head dims."""
        full = left < 0 and right < 0
        square_causal = left < 0 and right == 0 and q.shape[2] == k.shape[2]
        return ((full or square_causal) and scale > 0 and q.shape[2] > 0 and k.shape[2] > 0
                and v.shape[-1] == q.shape[-1])

    def _failed(self, error: BaseException) -> None:
        _fail_once(_CudnnBlocks, error, "the cuDNN block kernel", "our Triton kernels")

    def _gqa(self, kind: str, fn, q, k, v):
        """fn(q, k, v) with K/V as cuDNN takes them: natively where it can, else repeated (a
        backward's dk/dv are then summed back over each group). kind: "fwd" or "bwd"."""
        group = q.shape[1] // k.shape[1]
        if group == 1:
            return fn(q, k, v)
        native = _CudnnBlocks.native_gqa
        if native[kind] is not False:
            try:
                got = fn(q, k, v)
                native[kind] = True
                return got
            except RuntimeError as e:
                if native[kind] or isinstance(e, adaptive.NOT_RECOVERABLE):  # not a refusal of GQA
                    raise
                native[kind] = False
        got = fn(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        if kind == "bwd":
            dq, dk, dv = got
            b, _, m, d = dk.shape
            return dq, dk.view(b, -1, group, m, d).sum(2), dv.view(b, -1, group, m, dv.shape[-1]).sum(2)
        return got

    @staticmethod
    def _fwd(q, k, v, scale, causal):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        return out, lse.reshape(q.shape[:3]).contiguous()

    @staticmethod
    def _bwd(q, k, v, dout, out, lse, scale, causal):
        seed = torch.empty((), dtype=torch.long, device=q.device)
        return tuple(torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.contiguous().unsqueeze(-1), seed, seed, None, None, None, q.shape[2],
            k.shape[2], 0.0, causal, scale=scale))

    def forward(self, q, k, v, scale, left, right):
        if not _CudnnBlocks.failed and self._takes(q, k, v, scale, left, right):
            try:
                return self._gqa("fwd", lambda a, b, c: self._fwd(a, b, c, scale, right == 0), q, k, v)
            except Exception as e:  # a kernel failure: fall back, once, loudly
                self._failed(e)
        return self.triton.forward(q, k, v, scale, left, right)

    def merge(self, out, lse, block_out, block_lse) -> None:
        self.triton.merge(out, lse, block_out, block_lse)

    def backward(self, q, k, v, dout, out, lse, scale, left, right):
        if not _CudnnBlocks.failed and self._takes(q, k, v, scale, left, right):
            try:
                return self._gqa("bwd", lambda a, b, c: self._bwd(a, b, c, dout, out, lse, scale, right == 0),
                                 q, k, v)
            except Exception as e:
                self._failed(e)
        return self.triton.backward(q, k, v, dout, out, lse, scale, left, right)


@functools.lru_cache(maxsize=256)
def _shard_problem(device_type, device_index, dtype, q_heads, kv_heads, n, head_dim, value_dim, causal,
                   needs_grad) -> Problem:
    """A dense shard-against-shard call of this class, as the planner sees one."""
    return Problem(batch=1, q_heads=q_heads, kv_heads=kv_heads, q_len=n, kv_len=n, head_dim=head_dim,
                   value_dim=value_dim, dtype=dtype, device_type=device_type, device_index=device_index,
                   causal=causal, window_left=-1, window_right=-1, mask_kind="none", dropout_p=0.0,
                   scale=default_scale(head_dim), needs_grad=needs_grad, gqa=q_heads != kv_heads, tma_aligned=True)


@functools.lru_cache(maxsize=256)
def _cudnn_reasons(problem: Problem, deterministic: bool) -> tuple[str, ...]:
    """Why the ring's cuDNN blocks cannot run tensors of this class: the sdpa.cudnn runner's declared
    limits, and what the aten op the blocks call adds."""
    from ..planner import REGISTRY

    runner = REGISTRY.get("sdpa.cudnn")
    reasons = [f"sdpa.cudnn {r}" for r in runner.supports(problem, EXACT)] if runner else ["sdpa.cudnn is not here."]
    if problem.head_dim % 8:
        reasons.append(f"cuDNN's fused op takes head dims in multiples of 8, not {problem.head_dim}.")
    if deterministic:
        reasons.append("a deterministic backward was asked for; cuDNN's is not documented as one.")
    return tuple(reasons)


def _cudnn_for(device_type, device_index, dtype, q_heads, kv_heads, n, head_dim, value_dim, causal, needs_grad,
               deterministic) -> tuple[tuple[str, ...], bool]:
    """(reasons the ring's cuDNN blocks cannot run tensors of this class, whether the planner's
    fastest exact runner for a dense shard-against-shard call of it is cuDNN). The pick is read from
    the planner each call (its own plan cache, which planner.reset() clears)."""
    from ..planner import get_plan

    problem = _shard_problem(device_type, device_index, dtype, q_heads, kv_heads, n, head_dim, value_dim, causal,
                             needs_grad)
    reasons = _cudnn_reasons(problem, deterministic)
    if reasons:
        return reasons, False
    try:
        return (), get_plan(problem, EXACT).backend == "sdpa.cudnn"
    except Exception:  # no runner takes it: the Triton blocks decide for themselves
        return (), False


@functools.lru_cache(maxsize=256)
def _variant_for(device_type, device_index, dtype, head_dim, value_dim, windowed, aligned, positive) -> str:
    from ..backends.triton_attention import TritonRunner
    from ..policy import Policy
    from ..problem import Problem

    problem = Problem(batch=1, q_heads=1, kv_heads=1, q_len=1, kv_len=1, head_dim=head_dim, value_dim=value_dim,
                      dtype=dtype, device_type=device_type, device_index=device_index, causal=True,
                      window_left=0 if windowed else -1, window_right=-1, mask_kind="none", dropout_p=0.0,
                      scale=1.0 if positive else -1.0, needs_grad=False, tma_aligned=aligned)
    for variant in ("ws", "tma", "ptr"):
        if not TritonRunner(variant).supports(problem, Policy()):
            return variant
    return "ptr"


def _variant(q, k, v, scale, left, right) -> str:
    """The fastest of our forward variants that takes this block (as the planner's rules say)."""
    from ..problem import tma_aligned

    return _variant_for(q.device.type, q.device.index, q.dtype, q.shape[-1], v.shape[-1], left >= 0 or right > 0,
                        tma_aligned(q, k, v), scale > 0)


def _triton_reasons(q, v) -> list[str]:
    from ..backends.triton_attention import triton_reasons

    return triton_reasons(q.device.type, q.device.index, q.dtype, q.shape[-1], v.shape[-1])


def _engine(kernel: str, q, v, deterministic: bool, causal: bool, needs_grad: bool, kv_heads: int):
    if kernel == "torch":
        return _TorchBlocks(q.dtype)
    reasons = _triton_reasons(q, v)
    if kernel == "triton":
        if reasons:
            raise ValueError(f"kernel='triton' cannot run these tensors: {' '.join(reasons)} Use kernel='torch' "
                             "or 'auto'.")
        return _TritonBlocks(q.dtype, deterministic)
    if kernel == "auto" and (q.device.type != "cuda" or reasons):
        return _TorchBlocks(q.dtype)  # CPU tensors (the interpreter included) take torch math
    cudnn, first = _cudnn_for(q.device.type, q.device.index, q.dtype, q.shape[1], kv_heads, q.shape[2],
                              q.shape[-1], v.shape[-1], causal, needs_grad, deterministic)
    if kernel == "cudnn":
        if cudnn or reasons:
            triton = [f"The Triton blocks (for the other bands): {r}" for r in reasons]
            raise ValueError(f"kernel='cudnn' cannot run these tensors: {' '.join((*cudnn, *triton))} Use "
                             "kernel='auto'.")
        return _CudnnBlocks(q.dtype, deterministic)
    # auto: cuDNN where the planner runs it for a shard-sized call, else our Triton kernels.
    return _CudnnBlocks(q.dtype, deterministic) if first else _TritonBlocks(q.dtype, deterministic)


def _merge(out, lse, block_out, block_lse):
    """Exact log-sum-exp merge of two partial results (rows with lse = -inf on both stay 0)."""
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(torch.isneginf(new), 0.0)
    out = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return out, new


# ----------------------------------------------------------------------------- communication


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


def _ring_shards(c: "_Call", k, v):
    """(source rank, k, v) for every K/V shard, passed around the ring; the next exchange is
    under way while the caller computes with the current shard."""
    cur = [k.contiguous(), v.contiguous()]
    ring = _Ring(c.group, c.rank, c.world) if c.world > 1 else None
    for step in range(c.world):
        nxt, reqs = ring.exchange(cur) if step < c.world - 1 else (None, None)
        yield (c.rank - step) % c.world, cur[0], cur[1]
        _Ring.wait(reqs)
        cur = nxt


def _gathered_shards(c: "_Call", k, v):
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


def _reduce_to_owners(c: "_Call", grads: torch.Tensor) -> torch.Tensor:
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


# ----------------------------------------------------------------------------- the autograd function


class _Call:
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
        return _pairs(self.rank, src, self.world, self.n, self.balance, self.causal, self.window, self.docs)

    def shards(self, k, v):
        return (_ring_shards if self.algorithm == "ring" else _gathered_shards)(self, k, v)


def _forward_engines(c: _Call, q, shards, engines: list, timer=None, names=()) -> list:
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


def _forward_blocks(c: _Call, q, shards):
    """(out in the compute dtype, lse) of the exact blocks."""
    return _forward_engines(c, q, shards, [c.engine])[0]


def _forward_verified(c: _Call, q, k, v):
    """A verified call: quantized and exact blocks in one pass over the shards, the errors and
    times summed over the ranks (one all-reduce), the site's decisions taken; returns
    (out, lse) with the heads over the tolerance taken from the exact blocks."""
    site = c.quant.site
    timer = adaptive.EventTimer(("quant", "exact"), q.device)
    names = ("quant", "exact") if site.verified % 2 else ("exact", "quant")  # who runs first alternates
    engines = {"quant": c.quant, "exact": c.engine}
    got = dict(zip(names, _forward_engines(c, q, c.shards(k, v), [engines[n] for n in names], timer, names)))
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


def _backward_block(c: _Call, q, dout, out, lse, src, ks, vs, dq, dk, dv) -> None:
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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, c: _Call):
        if c.kind == "verify":
            out, lse = _forward_verified(c, q, k, v)
        elif c.kind == "quant":
            out, lse = _forward_engines(c, q, c.shards(k, v), [c.quant])[0]
        else:
            out, lse = _forward_blocks(c, q, c.shards(k, v))
        # One layout whatever built it (a first block's output keeps its kernel's layout): the
        # backward hands row slices of it and of the contiguous dout to kernels side by side.
        result = out.to(q.dtype).contiguous()
        if c.kind == "exact":
            ctx.save_for_backward(q, k, v, result, lse)
        else:  # the backward is exact: it recomputes the exact output and log-sum-exp
            ctx.save_for_backward(q, k, v)
        ctx.call = c
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        c = ctx.call
        if c.kind == "exact":
            q, k, v, out, lse = ctx.saved_tensors
        else:
            q, k, v = ctx.saved_tensors
            out, lse = _forward_blocks(c, q, c.shards(k, v))
            out = out.to(q.dtype)
        cdt = c.engine.cdt
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        if c.algorithm == "allgather":
            dks = torch.zeros((c.world, *k.shape), dtype=cdt, device=k.device)
            dvs = torch.zeros((c.world, *v.shape), dtype=cdt, device=v.device)
            for src, ks, vs in c.shards(k, v):
                _backward_block(c, q, dout, out, lse, src, ks, vs, dq, dks[src], dvs[src])
            dk, dv = _reduce_to_owners(c, dks), _reduce_to_owners(c, dvs)
        else:
            dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
            dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
            ring = _Ring(c.group, c.rank, c.world) if c.world > 1 else None
            for src, ks, vs in c.shards(k, v):
                _backward_block(c, q, dout, out, lse, src, ks, vs, dq, dk, dv)
                if ring is not None:
                    # The accumulators follow their shard; after the last step this hop brings
                    # each back to the rank that owns the shard.
                    grads, reqs = ring.exchange([dk, dv], tag0=2)
                    _Ring.wait(reqs)
                    dk, dv = grads
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


# ----------------------------------------------------------------------------- public entry points


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
                   label: Optional[str] = None) -> torch.Tensor:
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
    Differentiable in q, k and v. With no initialized process group, or world size 1, no
    documents and kernel="auto", this is adaattn.attention (with `policy` and `label`).
    """
    _check_balance(balance)
    window = _check(q, k, v, enable_gqa, window)
    scale = check_scale(scale)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, not {algorithm!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, not {kernel!r}")
    group, rank, world = _group_info(group)
    docs = _check_docs(cu_seqlens, q.shape[2] * world)
    policy = _check_policy(policy)
    if world == 1 and docs is None and kernel == "auto":
        return attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, window=window,
                         policy=policy, label=label)
    _ring_policy(policy)
    if balance == "zigzag" and world > 1 and q.shape[2] % 2:
        raise ValueError(f"zigzag balance needs an even local length, got {q.shape[2]}")
    scale = default_scale(q.shape[-1]) if scale is None else scale
    deterministic = torch.are_deterministic_algorithms_enabled() or policy.deterministic
    c = _Call(group, rank, world, q.shape[2], bool(is_causal), scale, window, balance, docs, algorithm,
              _engine(kernel, q, v, deterministic, bool(is_causal),
                      torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
                      k.shape[1]), v.shape[-1])
    if policy.mode == "auto":
        _adapt(c, q, k, v, policy, kernel, label)
    if not stats.enabled:
        return _RingAttention.apply(q, k, v, c)
    if stats.timing():
        with stats.Timer(q.device) as timer:
            out = _RingAttention.apply(q, k, v, c)
        wall = timer.ms
    else:
        out, wall = _RingAttention.apply(q, k, v, c), None
    _record(c, q, k, wall)
    return out


def _check_policy(policy) -> Policy:
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


def _adapt(c: _Call, q, k, v, policy: Policy, kernel: str, label: Optional[str]) -> None:
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


def _record(c: _Call, q, k, wall_ms) -> None:
    """This rank's decisions for adaattn.stats: the block engine, the algorithm, how many
    kernel calls its blocks took and how many visiting shards it skipped; under a policy, each
    head's level, the errors measured (over every rank's rows) and why."""
    calls = [len(c.pairs(src)) for src in range(c.world)]
    engine = c.engine.ran
    decisions = {"rank": c.rank, "world": c.world, "algorithm": c.algorithm, "balance": c.balance,
                 "kernel_calls": sum(calls), "shards_skipped": sum(1 for n in calls if n == 0),
                 "documents": None if c.docs is None else len(c.docs) - 1}
    backend = f"ring.{engine}"
    if c.adapt is not None:
        decisions.update(c.adapt)
        if c.quant is not None:
            site = c.quant.site.describe()
            ran = {"exact": "exact", "quant": "quantized", "verify": "quantized, verified against exact"}[c.kind]
            if c.quant.site.failed:
                ran = "exact"
            decisions.update({"ran": ran, "verified": c.kind == "verify", "head_levels": site["head_levels"],
                              "head_errors": site["head_errors"], "errors_measured_on": "every row of every rank",
                              "measured_ms": site["measured_ms"], "why": site["why"], "site_calls": site["calls"]})
            if c.kind != "exact" and not c.quant.site.failed:
                backend = "ring.triton.quant"
    stats.add(stats.CallRecord(
        backend=backend,
        shape=f"B={q.shape[0]} H={q.shape[1]}/{k.shape[1]} n={q.shape[2]} x world {c.world} D={q.shape[3]}",
        dtype=str(q.dtype).replace("torch.", ""), device=str(q.device), mode="exact" if c.adapt is None else "auto",
        decisions=decisions, fallbacks=(f"ring.{c.engine.name}",) if engine != c.engine.name else (), wall_ms=wall_ms))


def gather_records(records: list, group=None) -> list:
    """Every rank's adaattn.stats records (from `with adaattn.stats.collect() as records:`),
    gathered to every rank: one list per rank, in rank order. A collective: every rank of the
    group calls it. Without a process group, [records]."""
    group, _, world = _group_info(group)
    if world == 1:
        return [list(records)]
    got: list = [None] * world
    dist.all_gather_object(got, [r.as_dict() if hasattr(r, "as_dict") else r for r in records], group=group)
    return got


def summarize_ranks(per_rank: list) -> list[dict]:
    """One summary per ring call from gather_records' lists (the i-th ring record of every rank
    is the i-th call): what each rank ran, kernel calls and skipped shards summed over ranks,
    and under a policy the per-head levels (the same on every rank: their decisions come from
    sums over the ranks), the errors measured over every rank's rows and whether it was
    verified. Records of other calls (adaattn.attention) are left out."""
    rings = [[r if isinstance(r, dict) else r.as_dict() for r in recs] for recs in per_rank]
    rings = [[r for r in recs if r["backend"].startswith("ring.")] for recs in rings]
    if len({len(r) for r in rings}) > 1:
        raise ValueError(f"ranks recorded different numbers of ring calls: {[len(r) for r in rings]}")
    out = []
    for call in zip(*rings):
        d = [r["decisions"] for r in call]
        row = {"world": len(call), "backends": [r["backend"] for r in call],
               "kernel_calls": sum(x["kernel_calls"] for x in d), "shards_skipped": sum(x["shards_skipped"] for x in d),
               "mode": call[0]["mode"]}
        if call[0]["mode"] == "auto":
            levels = [x.get("head_levels") for x in d]
            row.update({"ran": [x.get("ran") for x in d], "head_levels": levels[0],
                        "levels_agree": all(lv == levels[0] for lv in levels), "head_errors": d[0].get("head_errors"),
                        "verified": d[0].get("verified"), "why": d[0].get("why")})
        out.append(row)
    return out


class RingAttention(nn.Module):
    """ring_attention as a module, holding its process group, balance, algorithm and kernel."""

    def __init__(self, group=None, balance: str = "zigzag", algorithm: str = "ring", kernel: str = "auto",
                 policy: Optional[Policy] = None, label: Optional[str] = None):
        super().__init__()
        self.policy = _check_policy(policy)
        # Each module is its own call site unless labelled: its levels follow its own errors.
        self.label = label if label is not None else f"RingAttention@{id(self):x}"
        _check_balance(balance)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, not {algorithm!r}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, not {kernel!r}")
        self.group = group
        self.balance, self.algorithm, self.kernel = balance, algorithm, kernel

    def forward(self, q, k, v, is_causal: bool = False, scale: float | None = None, window: Window = None,
                enable_gqa: bool = False, cu_seqlens=None) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, is_causal=is_causal, scale=scale, window=window,
                              enable_gqa=enable_gqa, balance=self.balance, cu_seqlens=cu_seqlens,
                              algorithm=self.algorithm, kernel=self.kernel, policy=self.policy, label=self.label)

    def extra_repr(self) -> str:
        extra = "" if self.policy.mode == "exact" else f", policy={self.policy!r}"
        return f"balance={self.balance!r}, algorithm={self.algorithm!r}, kernel={self.kernel!r}{extra}"
