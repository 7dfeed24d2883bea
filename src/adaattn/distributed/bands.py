"""Which kernel calls a block takes: the bands of one rank's queries against one K/V shard.

Masks (causal, sliding window, documents) always apply in GLOBAL positions, so the result
equals single-process attention on the global tensors, sharded the same way. Documents
(`cu_seqlens`, the boundaries of packed documents in the global sequence) confine each query
to keys of its own document, as a FlexAttention document mask or varlen attention does.

A rank's positions form a few runs of consecutive global positions (one for plain, two for
zigzag, split further at document boundaries). A local query run against a visiting key run
sees a band of key offsets: the global causal/window condition shifted by the runs' distance.
Each band is trimmed to the rows and keys that take part, which leaves a band the kernels take
as it is (top-left causal and/or window sides, or no mask), so a block is one kernel call per
(query run, key run) pair, and fully visible pairs next to each other merge into one call.
Pairs that see nothing are skipped; this is decided on the host from the shards' positions,
with no device sync.
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from typing import Optional

Window = Optional[tuple]

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
def block_pairs(q_rank: int, k_rank: int, world: int, n: int, balance: str, causal: bool, window: Window,
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
