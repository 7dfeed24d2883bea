"""How one figure is taken: median time of a call, and the memory it allocates (CUDA)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Spread:
    """Milliseconds per call over `samples` timed repetitions."""

    min: float
    median: float
    max: float
    samples: int

    @classmethod
    def of(cls, times_ms: list[float]) -> "Spread":
        return cls(min(times_ms), statistics.median(times_ms), max(times_ms), len(times_ms))


def median_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds per call of `fn` (see `spread_ms`)."""
    return spread_ms(fn, device, warmup_ms, rep_ms).median


def spread_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100,
              min_samples: int = 3) -> Spread:
    """Min, median and max milliseconds per call of `fn` (see `samples_ms`)."""
    return Spread.of(samples_ms(fn, device, warmup_ms, rep_ms, min_samples))


def samples_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100,
               min_samples: int = 3) -> list[float]:
    """Min, median and max milliseconds per call of `fn`, over at least `min_samples` calls.

    CUDA: every sample of triton.testing.do_bench (return_mode="all") where triton imports, else
    CUDA events; a call longer than `rep_ms` gets further samples timed by the wall clock around a
    synchronised call. CPU: perf_counter around each call, as many calls as fit in `rep_ms`
    (at least `min_samples`, at most 1000).
    """
    if device.type != "cuda":
        return _wall_samples(fn, device, rep_ms, min_samples)
    do_bench = _do_bench()
    if do_bench is not None:
        times = [float(t) for t in do_bench(fn, warmup=int(warmup_ms), rep=int(rep_ms), return_mode="all")]
    else:
        times = _cuda_events_samples(fn, device, warmup_ms, rep_ms)
    while len(times) < min_samples:
        times.append(_synced_call_ms(fn, device))
    return times


def _synced_call_ms(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def _wall_samples(fn: Callable[[], object], device: torch.device, rep_ms: float, min_samples: int) -> list[float]:
    fn()  # warm-up: first-call allocations and lazy initialisation
    times = [_synced_call_ms(fn, device)]
    reps = max(min_samples, min(1000, int(rep_ms / max(times[0], 1e-4))))
    return times + [_synced_call_ms(fn, device) for _ in range(reps - 1)]


def _cuda_events_samples(fn: Callable[[], object], device: torch.device, warmup_ms: float, rep_ms: float) -> list[float]:
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
        return [s.elapsed_time(e) for s, e in events]


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


def release_after_error(device: torch.device) -> None:
    """After a failed call (an out-of-memory, say), give the CUDA cache back before the next one."""
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        except Exception:
            pass
