"""Query-aware sparse decode: each decode step reads only the pages that matter for its queries,
under the policy's tolerance, measured.

    cache = KVCache(layers, B, Hkv, max_len, D, device="cuda", summaries=True)   # page summaries at append
    policy = Policy(mode="auto", approximations=("skip",), tolerance=5e-2)
    plan = plan_decode(cache, heads=Hq, policy=policy)                           # once per step
    out = decode_attention(q, cache, layer, plan=plan)

Per step, per sequence and KV head (kernels/page_select.py): each page's share of the queries'
softmax mass is estimated from its key centroid (the cache's page summaries); the pages whose
shares sum to at most the head's threshold theta are skipped, the first page (attention sinks)
and the newest pages always read; the split-KV kernel then reads only the kept pages. No host
synchronisation: the step is capturable in a CUDA graph.

Each call site (a cache's layer) keeps a threshold per KV head and a controller. On a fraction
`Policy.verify` of calls (and a site's first), drawn on the host, the exact step runs as well, on
the GPU: each head's relative error ||o - o_exact|| / ||o_exact|| is measured, a head over the
tolerance gets the exact output in that call, and theta moves toward an error of TARGET x
tolerance (multiplied by at most STEP_UP, divided by up to STEP_DOWN, per verified call). Errors, pages read
and thresholds stay on the device; stats hold them as device tensors, read when asked.

Speed first: a step whose K/V are small (under MIN_BYTES per layer) runs dense, since selection
cannot pay there; a site whose verified steps keep more than KEEP_DENSE of the pages, DENSE_AFTER
times in a row (diffuse heads, random K/V), runs dense for the next REPROBE calls, then tries again. The figures behind
these constants: benchmarks/NOTES.md, sparse decode. On CUDA a verified call also times its sparse step
against the exact one, and a site whose sparse step measured over PAYS x the exact step's time, DENSE_AFTER
verified calls in a row, runs dense likewise: selection never runs where it measured slower.
"""

from __future__ import annotations

import random
from typing import Optional

import torch

from ..backends.triton.bound import bound
from ..backends.reference import relative_errors
from .gathered import sdpa_gathered

SINK_PAGES = 1  # the first page of each sequence is always read (attention sinks)
RECENT_PAGES = 2  # and its newest pages (the query's own neighbourhood)
TARGET = 0.25  # the controller aims each head's measured error at TARGET x tolerance
THETA_MIN, THETA_MAX = 1e-6, 1.0
STEP_UP, STEP_DOWN = 1.5, 4.0  # theta grows by at most STEP_UP per verified call, shrinks by up to STEP_DOWN
MIN_BYTES = 32 << 20  # K/V bytes per layer below which a step runs dense
KEEP_DENSE = 0.9  # a site keeping more than this fraction of pages on DENSE_AFTER verified calls in a row runs dense ...
PAYS = 0.95  # ... as does one whose sparse step measured more than PAYS x the exact step's time (CUDA) ...
OUTLIER = 4.0  # (a site's first call's timing is not counted, nor a lone one over OUTLIER x the exact step's)
DENSE_AFTER = 2
REPROBE = 64  # ... for this many calls
MAX_LAG = 4  # a verified call's figures are waited for once this many later calls have gone by
SELECT_BLOCK_P = 32  # pages per program of the selection's first kernel (page_estimate_kernel)
MAX_PAGES = 8192  # the selection holds a sequence's page shares in registers: up to this many pages
SELECT_ITERS = 30  # bisection steps of the selection's cut


class SparseSite:
    """One call site's state: a cache's layer under one tolerance. Thresholds are per (sequence
    slot, KV head): sequences of a batch attend differently, and a slot's threshold starts afresh
    when its sequence is freed, added or reset."""

    def __init__(self, kv_heads: int, tolerance: float, device: torch.device, slots: int = 1):
        self.tolerance = tolerance
        self.theta = torch.full((slots, kv_heads), 0.5 * tolerance, dtype=torch.float32, device=device)
        self.error = torch.zeros(kv_heads, dtype=torch.float32, device=device)  # last measured, per KV head (max over sequences)
        self.pages = torch.ones(kv_heads, dtype=torch.float32, device=device)  # fraction of pages read, per KV head
        self.dense_until = 0  # calls below this run dense (the site was diffuse, or sparse did not pay)
        self._diffuse = 0  # verified calls in a row where sparse did not pay
        self._pending: Optional[tuple] = None  # (event or None, host copy of the pages read, timing events) of a verified call
        self._host: Optional[torch.Tensor] = None  # pinned buffer the pages read come back through
        self._pending_call = 0  # the oldest verified call whose figures are not applied yet
        self._outliers = 0  # verified timings in a row over OUTLIER x the exact step's
        self.decisions = {"dense": 0, "sparse": 0, "verified": 0}  # how this site's calls ran (host counts)
        self.measured: Optional[tuple] = None  # (sparse ms, exact ms, pages read) of the last verified call read back
        self.expected_pages = 0.5  # the fraction of pages a call is expected to read (the last read back): sizes its programs
        self.why_dense = ""

    @property
    def calls(self) -> int:
        """Calls made at this site so far."""
        return self.decisions["dense"] + self.decisions["sparse"]

    def forget(self, seq: int) -> None:
        """A sequence slot starts over (freed, added or reset): its thresholds go back to the start."""
        self.theta[seq] = 0.5 * self.tolerance

    def poll(self) -> None:
        """Apply the figures of an earlier verified call once they have reached the host: without
        waiting, unless MAX_LAG calls have gone by since (a host running far ahead of the GPU would
        otherwise run on stale decisions for as long as it leads)."""
        if self._pending is None or torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # (an event may not be queried while a graph is being captured)
        event, host, timing = self._pending
        if event is not None and not event.query():
            if self.calls - self._pending_call < MAX_LAG:
                return
            event.synchronize()
        self._pending = None
        pages = float(host.mean())
        self.expected_pages = pages
        slow = False
        if timing is not None:  # CUDA: the verified call timed its sparse step and the exact one
            t0, t1, t2, exact_first = timing
            first, second = t0.elapsed_time(t1), t1.elapsed_time(t2)
            sparse_ms, exact_ms = (second, first) if exact_first else (first, second)
            self.measured = (sparse_ms, exact_ms, pages)
            # a site's first call compiles; a lone figure far off is a compile (a new length class) or an
            # allocation, two in a row are the cost
            if self._pending_call > 0:
                far = sparse_ms > OUTLIER * exact_ms
                self._outliers = self._outliers + 1 if far else 0
                slow = sparse_ms > PAYS * exact_ms and (not far or self._outliers >= 2)
        if slow:
            self.why_dense = (f"the sparse step measured {sparse_ms:.3f} ms against the dense step's {exact_ms:.3f} ms "
                              f"reading {pages:.0%} of the pages")
        elif pages > KEEP_DENSE:
            self.why_dense = f"verified calls kept {pages:.0%} of the pages (over {KEEP_DENSE:.0%})"
        self._diffuse = self._diffuse + 1 if slow or pages > KEEP_DENSE else 0
        if self._diffuse >= DENSE_AFTER:
            self.dense_until = self.calls + REPROBE
            self._diffuse = DENSE_AFTER - 1  # a re-probe that finds the site still diffuse goes back at once

    def dense_now(self) -> bool:
        return self.calls < self.dense_until

    def reprobe_due(self) -> bool:
        return self.dense_until > 0 and self.calls == self.dense_until


def site(cache, layer: int, tolerance: float) -> SparseSite:
    sites = cache._sparse_sites
    got = sites.get(layer)
    if got is None or got.tolerance != tolerance:
        got = sites[layer] = SparseSite(cache.kv_heads, tolerance, cache.device, slots=cache.block_table.shape[0])
    return got


def declines(cache, policy) -> str:
    """Why sparse decode cannot run for this cache (or a DecodeProblem: its `summaries` and
    `max_pages_per_seq`) and policy ('' when it can)."""
    if policy is None or policy.mode != "auto" or "skip" not in policy.approximations:
        return "the policy does not allow skipping (Policy(mode='auto', approximations=('skip',)))"
    if not cache.summaries:
        return "the cache keeps no page summaries (make it with summaries=True)"
    if cache.max_pages_per_seq > MAX_PAGES:
        return (f"the selection holds up to {MAX_PAGES} pages of a sequence, and this cache's sequences may hold "
                f"{cache.max_pages_per_seq} (use larger pages)")
    return ""


def page_counts(cache, layer: int, seq_ids: torch.Tensor) -> torch.Tensor:
    """(S,) pages each sequence holds in `layer`, on the device."""
    n = cache.lengths[layer][seq_ids.long()]
    return (n + cache.page_size - 1) // cache.page_size


def select(query: torch.Tensor, cache, layer: int, plan, theta: torch.Tensor, scale: float, kernel: bool):
    """Kept pages per (sequence, KV head): (SEL (S*Hkv, max pages) int32, ascending in each row's
    first COUNT entries; COUNT (S*Hkv,) int32). theta: (sequence slots, Hkv) fp32, indexed by the
    plan's sequence ids."""
    if kernel:
        return _select_kernel(query, cache, layer, plan, theta, scale)
    return select_reference(query, cache, layer, plan.seq_ids, theta, scale)


def _select_kernel(query, cache, layer, plan, theta, scale):
    from ..backends.triton.common import cdiv, next_pow2 as next_power_of_2

    from ..kernels.page_select import page_cut_kernel, page_estimate_kernel

    s, hq, t, d = query.shape
    hkv = cache.kv_heads
    g = hq // hkv
    slots = cache.block_table.shape[0]
    if tuple(theta.shape) != (slots, hkv) or theta.dtype != torch.float32 or not theta.is_contiguous():
        raise ValueError(f"theta must be a contiguous float32 ({slots}, {hkv}) tensor (sequence slots x KV heads), got "
                         f"{theta.dtype} {tuple(theta.shape)}")
    block_m = max(16, next_power_of_2(g * t))
    maxp = min(-(-plan.max_len // cache.page_size), cache.max_pages_per_seq)
    blocks = cdiv(maxp, SELECT_BLOCK_P)
    key = ("select", block_m, maxp, str(query.device))
    if key not in plan._scratch:
        dev = query.device
        plan._scratch[key] = (torch.empty(s * hkv, block_m, maxp, dtype=torch.float32, device=dev),
                              torch.empty(s * hkv, blocks, block_m, dtype=torch.float32, device=dev),
                              torch.empty(s * hkv, blocks, block_m, dtype=torch.float32, device=dev),
                              torch.zeros(s * hkv, maxp, dtype=torch.int32, device=dev),
                              torch.zeros(s * hkv, dtype=torch.int32, device=dev))
    rows, part_m, part_l, sel, count = plan._scratch[key]
    sums = cache.k_sum[layer]
    lens = cache.lengths[layer]
    bound(page_estimate_kernel)[(s * hkv, blocks)](
        query, sums, cache.block_table, lens, plan.seq_ids, rows, part_m, part_l, scale,
        *query.stride(), *sums.stride()[:2], *cache.block_table.stride(), *rows.stride()[:2],
        *part_m.stride()[:2], hkv,
        G=g, T=t, D=d, BLOCK_M=block_m, BLOCK_D=max(16, next_power_of_2(d)), BLOCK_P=SELECT_BLOCK_P,
        PAGE=cache.page_size, num_warps=4,
    )
    all_p = max(16, next_power_of_2(maxp))
    bound(page_cut_kernel)[(s * hkv,)](
        lens, plan.seq_ids, theta, rows, part_m, part_l, sel, count,
        *rows.stride()[:2], *part_m.stride()[:2], sel.stride(0), hkv, SINK_PAGES, RECENT_PAGES,
        G=g, T=t, BLOCK_M=block_m, BLOCK_P=SELECT_BLOCK_P, ALL_B=max(2, next_power_of_2(blocks)), ALL_P=all_p,
        PAGE=cache.page_size, ITERS=SELECT_ITERS, num_warps=4 if all_p <= 2048 else 8,
    )
    return sel, count


def page_shares(query: torch.Tensor, cache, layer: int, seq_ids: torch.Tensor, scale: float) -> torch.Tensor:
    """(S, Hkv, max pages) float64: each page's estimated share of its rows' softmax mass (the
    largest over the GQA group's query rows), the selection's ranking; pages past a sequence's end
    get -1. The reference of kernels/page_select.py, steps 1 and 2."""
    s, hq, t, d = query.shape
    hkv, p = cache.kv_heads, cache.page_size
    sid = seq_ids.long()
    n = cache.lengths[layer][sid].long()  # (S,)
    npages = (n + p - 1) // p
    maxp = int(npages.max())
    idx = torch.arange(maxp, device=query.device)
    ok = idx[None, :] < npages[:, None]  # (S, P)
    phys = cache.block_table[sid][:, :maxp].long()  # (S, P)
    cnt = torch.clamp(n[:, None] - idx[None, :] * p, max=p).clamp_min(1).double()  # (S, P)
    cen = cache.k_sum[layer][phys].double() / cnt[:, :, None, None]  # (S, P, Hkv, D)
    qg = query.double().view(s, hkv, hq // hkv * t, d)  # rows of each KV head's group
    est = torch.einsum("shrd,sphd->shrp", qg, cen) * scale + cnt.log()[:, None, None, :]
    est = est.masked_fill(~ok[:, None, None, :], float("-inf"))
    share = torch.exp(est - torch.logsumexp(est, -1, keepdim=True)).amax(2)  # (S, Hkv, P)
    return share.masked_fill(~ok[:, None, :], -1.0)


def select_reference(query, cache, layer, seq_ids, theta, scale):
    """The selection in torch (float64 estimates): the CPU path and the kernel's reference."""
    s = query.shape[0]
    hkv = cache.kv_heads
    share = page_shares(query, cache, layer, seq_ids, scale)  # (S, Hkv, P)
    maxp = share.shape[-1]
    npages = page_counts(cache, layer, seq_ids).long()[:, None, None]
    idx = torch.arange(maxp, device=query.device)[None, None, :]
    ok = idx < npages
    forced = (idx < SINK_PAGES) | (idx >= npages - RECENT_PAGES)
    share = torch.where(forced, torch.full_like(share, 2.0), share).masked_fill(~ok, 2.0)
    lo = torch.zeros(s, hkv, 1, dtype=torch.float64, device=query.device)
    hi = torch.full_like(lo, 1.5)
    th = theta[seq_ids.long()].double().view(s, hkv, 1)
    for _ in range(SELECT_ITERS):
        mid = 0.5 * (lo + hi)
        below = torch.where(share < mid, share, torch.zeros_like(share)).sum(-1, keepdim=True)
        good = below <= th
        lo = torch.where(good, mid, lo)
        hi = torch.where(good, hi, mid)
    keep = ok & (share >= lo)  # (S, Hkv, P)
    count = keep.sum(-1).view(-1).to(torch.int32)
    order = torch.sort(torch.where(keep, idx, maxp + idx).expand_as(keep), -1).values  # kept first, ascending
    sel = torch.where(order < maxp, order, torch.zeros_like(order)).view(s * hkv, maxp).to(torch.int32)
    return sel, count


def kept_mask(sel: torch.Tensor, count: torch.Tensor, maxp: int) -> torch.Tensor:
    """(S*Hkv, maxp) bool: the pages each row of SEL lists."""
    n = sel.shape[0]
    listed = torch.arange(sel.shape[1], device=sel.device)[None, :] < count[:, None].long()
    keep = torch.zeros(n, maxp + 1, dtype=torch.bool, device=sel.device)
    target = torch.where(listed, sel.long().clamp(0, maxp - 1), torch.full_like(sel, maxp, dtype=torch.long))
    keep.scatter_(1, target, listed)
    return keep[:, :maxp]


def sparse_reference(query, cache, layer, seq_ids, sel, count, scale, lengths):
    """Attention over the kept pages only, by torch's SDPA over the gathered cache with the
    unkept pages masked: the CPU path (it reads every page; it is for correctness, not speed)."""

    s, hq = query.shape[:2]
    hkv = cache.kv_heads
    longest = max(lengths)
    maxp = -(-longest // cache.page_size)
    keep = kept_mask(sel, count, maxp).view(s, hkv, maxp).repeat_interleave(hq // hkv, 1)  # (S, Hq, P)
    return sdpa_gathered(query, cache, layer, seq_ids, torch.tensor(lengths, device=query.device), longest, scale,
                         pages=keep)


def should_verify(site_: SparseSite, policy, query: torch.Tensor) -> bool:
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return site_.calls == 0 or site_.reprobe_due() or random.random() < policy.verify


def verify(site_: SparseSite, out: torch.Tensor, exact: torch.Tensor, count: torch.Tensor, npages: torch.Tensor,
           seq_ids: torch.Tensor, timing: Optional[tuple] = None) -> torch.Tensor:
    """Measure each head's error against the exact step, give heads over the tolerance the exact
    output, move the thresholds of each (sequence, KV head); nothing waits for the GPU. timing:
    CUDA events before the selection, after the sparse step and after the exact one, read back
    with the pages. Returns the output to use."""
    s, hq, t, dv = out.shape
    hkv = site_.theta.shape[1]
    ref = exact.float()
    err = relative_errors(out, ref, (2, 3), torch.float32)  # (S, Hq)
    over = err > site_.tolerance
    out = torch.where(over[:, :, None, None], exact, out)
    err_sk = err.view(s, hkv, hq // hkv).amax(2)  # (S, Hkv)
    pages = (count.view(s, hkv).float() / npages.view(s, 1).float().clamp_min(1)).mean(0)
    factor = (TARGET * site_.tolerance / err_sk.clamp_min(1e-30)).clamp(1 / STEP_DOWN, STEP_UP)
    rows = seq_ids.long()
    site_.theta[rows] = (site_.theta[rows] * factor).clamp(THETA_MIN, THETA_MAX)
    site_.error.copy_(err_sk.amax(0))
    site_.pages.copy_(pages)
    if out.is_cuda:
        if site_._host is None:
            site_._host = torch.empty(hkv, dtype=torch.float32, pin_memory=True)
        site_._host.copy_(pages, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        if site_._pending is None:  # the lag counts from the oldest verified call not yet applied
            site_._pending_call = site_.calls
        site_._pending = (event, site_._host, timing)
    else:
        site_._pending_call = site_.calls
        site_._pending = (None, pages.clone(), None)
    return out
