"""Decode steps over a KV cache: the planner's choice among kv/runners.py's runners
(plan_decode, explain_decode), the plan built by kv/decode.py."""

from __future__ import annotations

import torch

from ..kv import decode as kv_decode
from ..kv.runners import decode_problem, decode_runners
from ..policy import Policy
from .choice import KINDS, Choice, _ORDERS, RunnerDeclines, choose, register_kind

DECODE_RUNNER_NAMES = ("sdpa", "triton")


def _decode_order(problem, names: tuple) -> tuple:
    """Page selection first (it runs only where it pays); then the split-KV kernel on CUDA, and
    SDPA first elsewhere (the kernel runs on the CPU only in the interpreter)."""
    dense = ("kv.triton", "kv.sdpa") if problem.device_type == "cuda" else ("kv.sdpa", "kv.triton")
    return ("kv.sparse",) + dense


def plan_decode(cache, seqs=None, *, heads: int, query_len: int = 1, dtype: torch.dtype | None = None,
                runner: str | None = None, splits: int | None = None, max_len: int | None = None,
                policy: Policy | None = None, sparse=None):
    """A plan for decode_attention over `seqs` (default: a KVCache's whole batch) with `heads`
    query heads and `query_len` rows each, made once per step and shared by the layers.

    max_len: the longest sequence the plan covers (default: the longest now in any layer plus
    query_len, so it holds after this step's appends); a plan for CUDA-graph capture passes the
    longest it will replay to. runner: "triton", "sdpa" or None (chosen here, among the decode
    runners of kv/runners.py: `explain_decode` lists them with their reasons); splits: the triton
    runner's splits of the longest sequence (default: from the keys of the whole batch against the
    GPU's SMs). policy: an adaattn.Policy; with mode="auto" and "skip" among its approximations,
    over a cache with summaries, steps read only the pages that matter (kv/sparse.py) where that
    pays; sparse=True runs that path whatever the size (a ValueError where it cannot), sparse=False
    never, and sparse="always" like True but without the site's turns to the dense step where
    selection does not pay (to measure the selection itself)."""
    if runner is not None and runner not in DECODE_RUNNER_NAMES:
        raise ValueError(f"runner must be one of {DECODE_RUNNER_NAMES} or None, got {runner!r}")
    seqs, dtype, now, max_len = kv_decode.check_step(cache, seqs, heads, query_len, dtype, max_len, policy, sparse)
    problem = decode_problem(cache, now, heads, query_len, dtype, max_len, sparse)
    if runner is not None:
        try:
            dense = choose("decode", problem, policy, runner=f"kv.{runner}")
        except RunnerDeclines as e:
            raise ValueError(f"runner={runner!r} cannot take this call: {' '.join(e.reasons)}") from None
    else:
        dense = choose("decode", problem, policy)
        if dense.runner == "kv.sparse":  # page selection runs over the first dense runner that can
            first = next(n for n, why in dense.reasons if not why and n != "kv.sparse")
            dense = Choice("decode", first, KINDS["decode"][first].why(problem), dense.reasons, problem)
    sparse_reasons = dict(dense.reasons)["kv.sparse"]
    if sparse is None and not sparse_reasons and dense.runner != "kv.triton":  # (a named kv.sdpa)
        sparse_reasons = ("the dense path reads every page anyway (sparse=True runs it, for testing).",)
    if sparse and sparse_reasons:
        raise ValueError(f"sparse={sparse!r} cannot run: {' '.join(sparse_reasons).rstrip('.')}")
    sparse_on = not sparse_reasons
    if policy is None:
        sparse_why = ""
    elif sparse_on:
        sparse_why = (f"reads the pages the queries need, tolerance {policy.tolerance:g} per head, verified on "
                      f"{policy.verify:.0%} of calls" + (" (asked for)" if sparse else "")
                      + (", never dense (sparse='always')" if sparse == "always" else ""))
    else:
        sparse_why = ("off (sparse=False)" if sparse is False else "dense: " + " ".join(sparse_reasons).rstrip("."))
    return kv_decode.build_plan(cache, seqs, heads, query_len, max_len, now, dense.runner[len("kv."):], dense.why,
                                splits, policy, sparse_on, sparse == "always", sparse_why)


def explain_decode(cache, seqs=None, *, heads: int, query_len: int = 1, dtype: torch.dtype | None = None,
                   max_len: int | None = None, policy: Policy | None = None, sparse=None,
                   lengths: list[int] | None = None, device: str | None = None) -> Choice:
    """Every decode runner for this step with its reasons, and the one plan_decode runs (its `why`
    and `runner`; where page selection is chosen it runs over the first dense runner listed that
    can). lengths: the tokens each sequence holds (default: what the cache holds); device: plan
    for this device type instead of the cache's (a cache on the meta device, say)."""
    seqs, dtype, now, max_len = kv_decode.check_step(cache, seqs, heads, query_len, dtype, max_len, policy, sparse)
    if lengths is not None:
        if len(lengths) != len(seqs) or min(lengths) < 0:
            raise ValueError(f"lengths must give each of the {len(seqs)} sequences a length >= 0, got {lengths!r}")
        now = list(lengths)
        max_len = max(max_len, max(now) + query_len)
    problem = decode_problem(cache, now, heads, query_len, dtype, max_len, sparse, device)
    choice = choose("decode", problem, policy)
    if choice.runner == "kv.sparse":
        over = next(n for n, why in choice.reasons if not why and n != "kv.sparse")
        choice = Choice("decode", choice.runner, f"{choice.why}, over {over}", choice.reasons, problem)
    return choice


for _runner in decode_runners():
    register_kind("decode", _runner)
_ORDERS["decode"] = _decode_order
