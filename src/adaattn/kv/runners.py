"""The decode runners over a KV cache, as the planner sees them: a DecodeProblem (the facts of one
step) and three runners, each with `supports(problem, policy) -> reasons` and `why(problem)`.

    kv.sparse  the split-KV kernel reading only the pages the queries need (kv/sparse.py), under
               Policy(mode="auto", approximations=("skip",)) over a cache with summaries, where the
               step's K/V are large enough for selection to pay
    kv.triton  the split-KV kernel (kernels/decode.py) over every page
    kv.sdpa    torch's SDPA over the cache's views or its gathered pages

planner.plan_decode picks one (planner.choose("decode", ...): in that order on CUDA, kv.sdpa before
kv.triton elsewhere) and kv/decode.py builds the plan and runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import sparse
from .cache import KVCache, PagedKVCache, value_bytes

MAX_TILE_ROWS = 128  # query rows of one KV head (GQA group x query_len) the kernel packs into a tile


@dataclass(frozen=True)
class DecodeProblem:
    """One decode step's facts: the cache (kind, storage, dtype, dims), the query (heads, rows,
    dtype), the sequences' longest length now and planned, and `sparse`, what the caller asked of
    page selection (None: where it pays, True / "always": run it, False: never)."""

    device_type: str
    cache_kind: str  # "KVCache" or "PagedKVCache"
    storage: str
    cache_dtype: torch.dtype
    dtype: torch.dtype
    heads: int
    kv_heads: int
    query_len: int
    head_dim: int
    value_dim: int
    page_size: int
    sequences: int
    longest: int
    max_len: int
    kv_bytes: int  # K/V bytes per layer the step reads (dense), from the lengths now
    summaries: bool  # the cache keeps page summaries (sparse decode's key bounds)
    max_pages_per_seq: int
    kernel_reasons: tuple[str, ...]  # why the split-KV kernel cannot take the step (kernel_declines)
    sparse: Any = None

    def describe(self) -> str:
        return (f"{self.cache_kind}({self.storage}, {str(self.cache_dtype).replace('torch.', '')}, page "
                f"{self.page_size}) on {self.device_type}: {self.sequences} sequence(s), Hq={self.heads} "
                f"Hkv={self.kv_heads}, {self.query_len} query row(s), up to {self.max_len} keys, D={self.head_dim}"
                + (f" Dv={self.value_dim}" if self.value_dim != self.head_dim else ""))


def decode_problem(cache: PagedKVCache, now: list[int], heads: int, query_len: int, dtype: torch.dtype,
                   max_len: int, sparse_: Any = None, device_type: str | None = None) -> DecodeProblem:
    """The DecodeProblem of a step over `cache` whose sequences hold `now` tokens (the one place
    that makes one); `device_type` plans for another device than the cache's (explain)."""
    def elem(dim):
        if cache.storage == "mixed":  # the average over the layers' heads chosen so far (the model dtype before)
            held = [x for here in cache._mixed if here is not None for x in here.storages] or ["native"]
            return sum(value_bytes(x, cache.dtype, dim, cache.group_size) for x in held) / len(held)
        return value_bytes(cache.storage, cache.dtype, dim, cache.group_size)

    device_type = device_type or cache.device.type
    return DecodeProblem(
        device_type=device_type, cache_kind="KVCache" if isinstance(cache, KVCache) else "PagedKVCache",
        storage=cache.storage, cache_dtype=cache.dtype, dtype=dtype, heads=heads, kv_heads=cache.kv_heads,
        query_len=query_len, head_dim=cache.head_dim, value_dim=cache.value_dim, page_size=cache.page_size,
        sequences=len(now), longest=max(now), max_len=max_len,
        kv_bytes=int(cache.kv_heads * (cache.head_dim * elem(cache.head_dim) + cache.value_dim * elem(cache.value_dim))
                     * sum(now)),
        summaries=cache.summaries, max_pages_per_seq=cache.max_pages_per_seq,
        kernel_reasons=kernel_declines(device_type, dtype, cache.dtype, max(cache.head_dim, cache.value_dim),
                                       heads // cache.kv_heads * query_len),
        sparse=sparse_)


def kernel_declines(device_type: str, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int,
                    rows: int) -> tuple[str, ...]:
    """Why the split-KV kernel cannot take a step (empty when it can): `head_dim` the larger of
    the cache's two, `rows` a KV head's query rows (GQA group x query_len)."""
    reasons = []
    if device_type != "cuda":
        from ..backends.triton.common import interpreting

        if not interpreting():
            reasons.append("the split-KV kernel runs on CUDA (or under TRITON_INTERPRET=1).")
    try:
        import triton  # noqa: F401
    except ImportError:
        reasons.append("triton is not installed.")
    if dtype != cache_dtype:
        reasons.append(f"the query's dtype {dtype} is not the cache's {cache_dtype}.")
    if head_dim > 256:
        reasons.append(f"head dims up to 256 (got {head_dim}).")
    if rows > MAX_TILE_ROWS:
        reasons.append(f"a KV head's query rows (GQA group x query_len = {rows}) fit one tile of up to "
                       f"{MAX_TILE_ROWS}.")
    return tuple(reasons)


class SparseDecode:
    name = "kv.sparse"
    exact = False

    def supports(self, problem: DecodeProblem, policy) -> list[str]:
        if problem.sparse is False:
            return ["off (sparse=False)."]
        why = sparse.declines(problem, policy)
        if why:
            return [why + "."]
        if problem.sparse is None and problem.kv_bytes < sparse.MIN_BYTES:
            return [f"{problem.kv_bytes / 2**20:.1f} MiB of K/V per layer, under {sparse.MIN_BYTES >> 20} MiB, where "
                    "selecting pages does not pay."]
        if problem.sparse is None and (problem.device_type != "cuda" or problem.kernel_reasons):
            return ["the dense path reads every page anyway (sparse=True runs it, for testing)."]
        return []

    def why(self, problem: DecodeProblem) -> str:
        return "reads the pages the queries need" + (" (asked for)" if problem.sparse else "")


class SplitKVDecode:
    name = "kv.triton"
    exact = True

    def supports(self, problem: DecodeProblem, policy) -> list[str]:
        return list(problem.kernel_reasons)

    def why(self, problem: DecodeProblem) -> str:
        return ("the split-KV kernel reads the cache where it lies (paged, any storage); SDPA needs the pages "
                "gathered or a contiguous view (benchmarks/NOTES.md, decode)")


class SdpaDecode:
    name = "kv.sdpa"
    exact = True

    def supports(self, problem: DecodeProblem, policy) -> list[str]:
        return []

    def why(self, problem: DecodeProblem) -> str:
        kernel = problem.kernel_reasons
        if problem.device_type != "cuda" and all("runs on CUDA" in r for r in kernel):  # (none: the interpreter)
            return "on the CPU, torch's SDPA (the kernel runs here only in the interpreter)"
        return "the split-KV kernel declines: " + " ".join(kernel)


def decode_runners() -> list:
    return [SparseDecode(), SplitKVDecode(), SdpaDecode()]
