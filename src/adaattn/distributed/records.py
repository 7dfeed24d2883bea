"""What each rank records of a ring call for adaattn.stats, and the collection of every rank's records.

`record` adds this rank's CallRecord (the block engine that ran, the algorithm, kernel calls and
skipped shards, and under a policy each head's level and the errors measured);
`gather_records` brings every rank's records to every rank; `summarize_ranks` makes one
summary per ring call of them.
"""

from __future__ import annotations

import torch.distributed as dist

from .. import stats
from .layout import group_info


def record(c, q, k, wall_ms) -> None:
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
    group, _, world = group_info(group)
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
