"""Block analysis and tile plans for adaptive rank (torch on the inputs' device; no host sync).

A query block of QUERY_BLOCK rows meets each key block of `key_block` keys in one of three ways
(kernels/attention_rank.py): exact, summarised (the block's mean key with a log-count bias and
its mean value), or skipped. This module computes, all on the device:

- `summarize`: per key block the mean key, mean value and per-channel key variance;
- `estimate`: the attention mass of every (query block, key block), from a few sampled rows of
  each query block scored against the key summaries and the always-exact keys (a softmax,
  averaged over the rows), each block's summary cost, and each head's entropy;
- `make_plan`: per query block, key blocks exact in descending estimated error of leaving
  them out until what is left is at most the head's threshold; the first key block (attention
  sinks) and the local blocks are always exact; the rest summarised where allowed, otherwise
  skipped;
- `plan_reference`: the output of a plan in float64 (what the kernel must match), and
  `true_block_mass`: the exact attention's own block masses, from which the oracle of
  MEASURING.md is built (exact tiles from the true mass, summaries for the rest).
"""

from __future__ import annotations

import torch

from ..backends.reference import relative_errors
from ..backends.triton.common import cdiv, interpreting
from .block_layout import (  # noqa: F401 - the types and layouts of this module's results, named here too
    LOCAL_BLOCKS,
    Estimate,
    Plan,
    Summaries,
    _cached,
    block_counts,
    block_layout,
    layout_counts,
    sampled_rows,
)

QUERY_BLOCK = 128
KEY_BLOCK = 64
ROWS_PER_BLOCK = 8  # sampled query rows per query block for the mass estimate
# From this many keys the estimate samples twice the rows: the tiles saved outweigh its cost (at
# 128k on an H100: +0.7 ms of estimate, 0.04 less density of a ~33 ms dense layer; NOTES.md).
LONG_ROWS_FROM = 65536


def rows_per_block(n: int) -> int:
    """Sampled rows per query block of the estimate at n keys."""
    return 2 * ROWS_PER_BLOCK if n >= LONG_ROWS_FROM else ROWS_PER_BLOCK


ESTIMATE_ELEMENTS = 1 << 25  # float32 elements of one chunk of the estimate's score tensors


def _triton_runs(t: torch.Tensor) -> bool:
    """Whether the Triton versions of these passes run for tensors like t (CUDA, or the interpreter)."""
    return t.is_cuda or interpreting()


def _block_sums(x: torch.Tensor, key_block: int, square: bool = False) -> torch.Tensor:
    """(B, H, n_kb, D) float32 sums of x (B, H, N, D) (or of x^2) over each key block, one head
    at a time so that no float32 copy of x is made whole."""
    b, h, n, d = x.shape
    nkb = cdiv(n, key_block)
    full = n // key_block
    if x.numel() <= ESTIMATE_ELEMENTS and n % key_block == 0:
        xf = x.float()
        return (xf * xf if square else xf).reshape(b, h, nkb, key_block, d).sum(3)
    out = torch.empty((b, h, nkb, d), dtype=torch.float32, device=x.device)
    for i in range(h):
        xi = x[:, i].float()
        if square:
            xi = xi * xi
        if full:
            out[:, i, :full] = xi[:, : full * key_block].reshape(b, full, key_block, d).sum(2)
        if nkb > full:
            out[:, i, full] = xi[:, full * key_block:].sum(1)
    return out


def block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, cdiv(N, block), D) float32 means of x (B, H, N, D) over each block of rows (the
    last one partial)."""
    return _block_sums(x, block) / block_counts(x.shape[2], block, x.device)[:, None]


def summarize(k: torch.Tensor, v: torch.Tensor, key_block: int = KEY_BLOCK, *, kernel: bool | None = None) -> Summaries:
    """kernel: True one Triton launch (kernels/block_summary.py; unit last strides), False these
    torch passes (the reference), None the kernel wherever Triton runs and the strides allow."""
    if kernel is None:
        kernel = _triton_runs(k) and k.stride(-1) == 1 and v.stride(-1) == 1
    if kernel:
        from .rank_launch import summarize_blocks

        return summarize_blocks(k, v, key_block)
    counts = block_counts(k.shape[2], key_block, k.device)
    c = counts[:, None]
    mean_k = block_means(k, key_block)
    var = (_block_sums(k, key_block, square=True) / c - mean_k * mean_k).clamp_min_(0.0)
    mean_v = block_means(v, key_block)
    return Summaries(mean_k.to(k.dtype).contiguous(), mean_v.to(v.dtype).contiguous(), var.contiguous(), counts,
                     key_block)


def _visible_counts(rows: torch.Tensor, counts: torch.Tensor, key_block: int, causal: bool) -> torch.Tensor:
    """(R, n_kb) float32: how many keys of each block a row sees (0: none)."""
    if not causal:
        return counts[None, :].expand(rows.numel(), -1)
    start = torch.arange(counts.numel(), device=rows.device) * key_block
    seen = (rows.reshape(-1, 1) - start[None, :] + 1).clamp(min=0).float()
    return torch.minimum(seen, counts[None, :])


@_cached
def _exact_keys(n: int, causal: bool, query_block: int, key_block: int, local: int, device):
    """(n_qb, W) key positions each query block's estimate scores exactly (the blocks it keeps
    exact whatever the plan: the first block, and the local and own blocks), -1 where none, and
    (n_qb, n_kb) bool: the blocks they cover."""
    nqb, nkb = cdiv(n, query_block), cdiv(n, key_block)
    qb = torch.arange(nqb, device=device)[:, None]
    if causal:
        start = (qb * query_block - local * key_block).clamp(min=key_block)
        width = query_block + local * key_block
    else:
        start = (qb * query_block).clamp(min=key_block)
        width = query_block
    near = start + torch.arange(width, device=device)[None, :]
    near = torch.where((near < n) & (near < (qb + 1) * query_block), near, -1)
    first = torch.arange(min(key_block, n), device=device)[None, :].expand(nqb, -1)
    keys = torch.cat([first, near], 1)
    covered = torch.zeros((nqb, nkb), dtype=torch.bool, device=device)
    covered.scatter_(1, (keys.clamp(min=0) // key_block), True)
    return keys, covered


@_cached
def _estimate_layout(n: int, causal: bool, query_block: int, key_block: int, per_block: int, local: int, device):
    """What an estimate of a size needs besides the inputs: sampled rows (n_qb, r), the keys
    scored exactly (n_qb, W), their bias (0 / -inf per row, (n_qb*r, W)), each summary's log key
    count (-inf where not visible or scored exactly, (n_qb*r, n_kb)), the block of each exact
    key (n_qb*r, W), and log2 of the keys each row sees per block."""
    rows = sampled_rows(n, query_block, per_block, device)
    nqb, r = rows.shape
    counts = block_counts(n, key_block, device)
    seen = _visible_counts(rows, counts, key_block, causal)  # (nqb*r, nkb)
    near, covered = _exact_keys(n, causal, query_block, key_block, local, device)
    w = near.shape[1]
    near_ok = (near >= 0)[:, None, :].expand(nqb, r, w)
    if causal:
        near_ok = near_ok & (near[:, None, :] <= rows[:, :, None])
    near_bias = torch.where(near_ok, 0.0, float("-inf")).reshape(nqb * r, w)
    summ_ok = (seen > 0) & ~covered.repeat_interleave(r, 0)
    log_seen = torch.where(summ_ok, seen.clamp_min(1.0).log(), float("-inf"))
    near_block = (near.clamp(min=0) // key_block).repeat_interleave(r, 0)
    return rows, near, near_bias, log_seen, near_block, seen.clamp_min(1.0).log2()


def estimate(q: torch.Tensor, k: torch.Tensor, s: Summaries, scale: float, causal: bool, *,
             query_block: int = QUERY_BLOCK, per_block: int = ROWS_PER_BLOCK, spread: bool = True,
             local: int = LOCAL_BLOCKS, kernel: bool | None = None) -> Estimate:
    """Sampled rows of each query block score the keys it always keeps exact (first, local and
    own blocks) exactly, and every other key block through its summary: the mean key with a
    log-count bias, plus (spread=True) half the variance of the row's logits over the block's
    keys (diagonal covariance), so a block whose keys spread is not underestimated. A softmax
    over both gives each row's block masses; the query block's are their mean over its rows.

    kernel: True runs the one-launch Triton version (kernels/attention_estimate.py), False these
    torch passes (the reference), None the kernel wherever Triton runs (CUDA, or the interpreter)."""
    if kernel is None:
        kernel = _triton_runs(q)
    if kernel:
        from .rank_launch import estimate_blocks

        return estimate_blocks(q, k, s, scale, causal, query_block=query_block, per_block=per_block,
                               spread=spread, local=local)
    b, hq, n, d = q.shape
    hkv = s.keys.shape[1]
    g = hq // hkv
    kb_size = s.key_block
    rows, near, near_bias, log_seen, near_block, log2_keys = _estimate_layout(
        n, causal, query_block, kb_size, per_block, local, q.device)
    nqb, r = rows.shape
    nkb = s.counts.numel()
    w = near.shape[1]
    mass = torch.empty((b, hq, nqb, nkb), dtype=torch.float32, device=q.device)
    cost = torch.empty_like(mass)
    entropy = torch.empty((hq,), dtype=torch.float32, device=q.device)
    flat = rows.reshape(-1)
    near_flat = near.clamp(min=0).reshape(-1)
    per_kv_head = b * g * nqb * r * (2 * nkb + w)
    hc = max(1, min(hkv, ESTIMATE_ELEMENTS // max(1, per_kv_head)))
    for h0 in range(0, hkv, hc):
        h1 = min(hkv, h0 + hc)
        c = h1 - h0
        heads = slice(h0 * g, h1 * g)
        qs = q[:, heads].index_select(2, flat).float().reshape(b, c, g * nqb * r, d)
        logits = (qs @ s.keys[:, h0:h1].float().transpose(-1, -2)) * scale  # (b, c, g*R, nkb)
        spread_var = (scale * scale) * ((qs * qs) @ s.variance[:, h0:h1].transpose(-1, -2))
        if spread:
            logits = logits + 0.5 * spread_var
        kn = k[:, h0:h1].index_select(2, near_flat).float().reshape(b, c, 1, nqb, w, d)
        exact = (qs.reshape(b, c, g, nqb, r, d) @ kn.transpose(-1, -2)).reshape(b, c * g, nqb * r, w) * scale
        logits = logits.reshape(b, c * g, nqb * r, nkb)
        spread_var = spread_var.reshape(b, c * g, nqb * r, nkb)
        p = torch.softmax(torch.cat([logits + log_seen, exact + near_bias], -1), -1)
        p_sum, p_near = p[..., :nkb], p[..., nkb:]
        p_block = p_sum.scatter_add(-1, near_block.expand(b, c * g, -1, -1), p_near)
        mass[:, heads] = p_block.reshape(b, c * g, nqb, r, nkb).mean(3)
        cost[:, heads] = (p_sum * spread_var.sqrt().clamp(max=1.0)).reshape(b, c * g, nqb, r, nkb).mean(3)
        ent = (-(p_sum * torch.where(p_sum > 0, p_sum.log2(), 0.0)).sum(-1) + (p_sum * log2_keys).sum(-1)
               - (p_near * torch.where(p_near > 0, p_near.log2(), 0.0)).sum(-1))
        entropy[heads] = ent.mean((0, 2))
    return Estimate(mass, entropy, rows, cost)


def make_plan(est: Estimate, thresholds: torch.Tensor, n: int, causal: bool, *, summaries: bool = True,
              query_block: int = QUERY_BLOCK, key_block: int = KEY_BLOCK, local: int = LOCAL_BLOCKS,
              kernel: bool | None = None) -> Plan:
    """Per (batch, head, query block): listable blocks exact in descending estimated error of
    leaving them out, while the estimated error of the blocks not exact exceeds thresholds[head]
    ((Hq,) float32); the rest summarised (summaries=True) or skipped. A skipped block's error is
    its mass; a summarised block's, its mass times the spread (standard deviation, capped at 1)
    of the row's logits over its keys (est.cost): a block of near-equal logits summarises
    almost exactly, however much mass it holds.

    kernel: True one Triton launch (kernels/rank_plan.py: the same cut, found by bisection; equal
    values are kept together), False these torch passes (the reference), None the kernel wherever
    Triton runs."""
    mass = est.cost if summaries and est.cost is not None else est.mass
    if kernel is None:
        kernel = _triton_runs(mass)
    if kernel:
        from .rank_launch import plan_blocks

        return plan_blocks(mass, thresholds, n, causal, summaries=summaries, query_block=query_block,
                           key_block=key_block, local=local)
    b, hq, nqb, nkb = mass.shape
    listable, forced, tail = block_layout(n, causal, query_block, key_block, mass.device, local)
    cand = listable & ~forced
    m = torch.where(cand, mass, 0.0)
    vals, order = torch.sort(m, dim=-1, descending=True)
    total = vals.sum(-1, keepdim=True)
    before = total - (torch.cumsum(vals, -1) - vals)  # mass not exact if kept up to (not incl.) j
    keep_sorted = (before > thresholds.view(1, hq, 1, 1)) & (vals > 0)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    exact = (keep & cand) | forced
    return plan_from_masks(exact, (cand & ~keep) if summaries else None, n, causal, query_block=query_block,
                           key_block=key_block, local=local)


def plan_from_masks(exact: torch.Tensor, summarised: torch.Tensor | None, n: int, causal: bool, *,
                    query_block: int = QUERY_BLOCK, key_block: int = KEY_BLOCK, local: int = LOCAL_BLOCKS) -> Plan:
    """A plan from bool (B, Hq, n_qb, n_kb) masks of the listable blocks to run exact and to
    summarise (None: none); the tail is always exact, blocks outside both are skipped."""
    b, hq, nqb, nkb = exact.shape
    listable, _, tail = block_layout(n, causal, query_block, key_block, exact.device, local)
    exact = exact & listable
    summ = torch.zeros_like(exact) if summarised is None else (summarised & listable & ~exact)
    state = torch.where(exact | tail, 2, torch.where(summ, 1, 0)).to(torch.int8)
    ecnt = exact.sum(-1, dtype=torch.int32)
    pos = torch.where(exact, torch.cumsum(exact, -1, dtype=torch.int64) - 1, nkb)
    kb = torch.arange(nkb, device=exact.device, dtype=torch.int32).expand(b, hq, nqb, nkb)
    eidx = torch.zeros((b, hq, nqb, nkb + 1), dtype=torch.int32, device=exact.device)
    eidx.scatter_(-1, pos, kb)
    visible, tails = layout_counts(n, causal, query_block, key_block, exact.device, local)
    tiles = (exact.sum((0, 2, 3)).float() + b * tails) / (b * visible)
    summ_share = summ.sum((0, 2, 3)).float() / (b * visible)
    return Plan(state, eidx, ecnt, tiles, summ_share, query_block, key_block, causal)


def dense_plan(b: int, hq: int, n: int, causal: bool, device, *, query_block: int = QUERY_BLOCK,
               key_block: int = KEY_BLOCK) -> Plan:
    """Every visible tile exact (threshold 0): the kernel then computes exact attention."""
    nqb, nkb = cdiv(n, query_block), cdiv(n, key_block)
    est = Estimate(torch.ones((b, hq, nqb, nkb), device=device), torch.zeros(hq, device=device),
                   torch.zeros(0, device=device))
    return make_plan(est, torch.full((hq,), -1.0, device=device), n, causal, summaries=False,
                     query_block=query_block, key_block=key_block)


# ----------------------------------------------------------------------------- references


def _row_keep(state: torch.Tensor, n: int, causal: bool, query_block: int, key_block: int):
    """(N, N) bool of exact (query, key) pairs and (N, n_kb) bool of summarised blocks per row,
    from one head's state (n_qb, n_kb)."""
    exact_blocks = (state == 2).repeat_interleave(query_block, 0)[:n].repeat_interleave(key_block, 1)[:, :n]
    if causal:
        i = torch.arange(n, device=state.device)
        exact_blocks = exact_blocks & (i[None, :] <= i[:, None])
    summ = (state == 1).repeat_interleave(query_block, 0)[:n]
    return exact_blocks, summ


def plan_reference(q, k, v, plan: Plan, scale: float) -> torch.Tensor:
    """The plan's output in float64 (B, Hq, N, Dv): exact tiles exact, summaries from float64
    block means of k and v."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kb = plan.key_block
    q64, k64, v64 = q.double(), k.double(), v.double()
    counts = block_counts(n, kb, q.device).double()
    s64 = _block_sums(k64, kb).double() / counts[:, None]
    vs64 = _block_sums(v64, kb).double() / counts[:, None]
    out = torch.empty((b, hq, n, v.shape[-1]), dtype=torch.float64, device=q.device)
    for bi in range(b):
        for h in range(hq):
            kh = h // g
            exact, summ = _row_keep(plan.state[bi, h], n, plan.causal, plan.query_block, kb)
            s = (q64[bi, h] @ k64[bi, kh].T) * scale
            s = s.masked_fill(~exact, float("-inf"))
            ss = (q64[bi, h] @ s64[bi, kh].T) * scale + counts.log()[None, :]
            ss = ss.masked_fill(~summ, float("-inf"))
            p = torch.softmax(torch.cat([s, ss], 1), 1)
            out[bi, h] = p[:, :n] @ v64[bi, kh] + p[:, n:] @ vs64[bi, kh]
    return out


def true_block_mass(q, k, scale: float, causal: bool, *, query_block: int = QUERY_BLOCK, key_block: int = KEY_BLOCK,
                    rows: int = 4096) -> torch.Tensor:
    """(B, Hq, n_qb, n_kb) float32: exact attention's mass per (query block, key block),
    averaged over the query block's rows, computed rows at a time in float32."""
    b, hq, n, d = q.shape
    g = hq // k.shape[1]
    nqb, nkb = cdiv(n, query_block), cdiv(n, key_block)
    pad = nkb * key_block - n
    out = torch.zeros((b, hq, nqb, nkb), dtype=torch.float32, device=q.device)
    step = max(query_block, rows // query_block * query_block)
    j = torch.arange(n, device=q.device)
    for h in range(hq):
        kh = k[:, h // g].float()
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            s = (q[:, h, r0:r1].float() @ kh.transpose(-1, -2)) * scale
            if causal:
                s = s.masked_fill(j[None, None, :] > torch.arange(r0, r1, device=q.device)[None, :, None],
                                  float("-inf"))
            p = torch.softmax(s, -1)
            p = torch.nn.functional.pad(p, (0, pad)).view(b, r1 - r0, nkb, key_block).sum(-1)
            qpad = (-(r1 - r0)) % query_block
            p = torch.nn.functional.pad(p, (0, 0, 0, qpad)).view(b, -1, query_block, nkb).sum(2)
            cnt = torch.clamp(n - torch.arange(r0, r1 + qpad, query_block, device=q.device), max=query_block)
            out[:, h, r0 // query_block: r0 // query_block + p.shape[1]] = p / cnt[None, :, None]
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per head (dim 1) ||out - ref|| / ||ref|| over batch, rows and channels, float64."""
    return relative_errors(out, ref, (0, 2, 3))


__all__ = ["QUERY_BLOCK", "KEY_BLOCK", "Summaries", "block_means", "summarize", "Estimate", "estimate", "Plan", "make_plan",
           "dense_plan", "plan_from_masks", "plan_reference", "true_block_mass", "relative_error", "block_layout", "sampled_rows",
           "rows_per_block"]
