"""How one figure is taken: median time of a call, and the memory it allocates (CUDA)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def _do_bench() -> Callable | None:
    try:
        from triton.testing import do_bench
    except Exception:  # triton missing, or a build without a GPU driver
        return None
    return do_bench


def method(device: torch.device) -> str:
    """What `median_ms` uses on this device, for the record."""
    if device.type == "cuda":
        if _do_bench() is not None:
            return "triton.testing.do_bench(fn, warmup, rep, return_mode='median')"
        return "CUDA events around each call after warm-up, median"
    return "time.perf_counter around each call after one warm-up call, median"


def median_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds per call of `fn`.

    CUDA: triton.testing.do_bench where triton imports, else CUDA events. CPU: perf_counter
    around each call, as many calls as fit in `rep_ms` (at least 3, at most 1000).
    """
    if device.type == "cuda":
        do_bench = _do_bench()
        if do_bench is not None:
            return float(do_bench(fn, warmup=int(warmup_ms), rep=int(rep_ms), return_mode="median"))
        return _cuda_events_ms(fn, device, warmup_ms, rep_ms)
    return _wall_ms(fn, rep_ms)


def _wall_ms(fn: Callable[[], object], rep_ms: float) -> float:
    fn()  # warm-up: first-call allocations and lazy initialisation
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    reps = max(3, min(1000, int(rep_ms * 1e-3 / max(first, 1e-7))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _cuda_events_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float, rep_ms: float) -> float:
    with torch.cuda.device(device):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end) / 5, 1e-3)
        for _ in range(max(1, int(warmup_ms / estimate))):
            fn()
        reps = max(1, int(rep_ms / estimate))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for s, e in events:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def peak_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """MiB one call of `fn` allocates above what was allocated before it (inputs and all); None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
