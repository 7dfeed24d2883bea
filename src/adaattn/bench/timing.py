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


def interleaved_method(device: torch.device) -> str:
    """What `interleaved_samples` does on this device, for the record."""
    if device.type == "cuda":
        return ("the peers of a case timed call by call in turn, the order rotated every round "
                "(timing.interleaved_samples): CUDA events around each call after zeroing 256 MiB (L2), as "
                "triton.testing.do_bench does; about --rep-ms of samples per peer; median")
    return "time.perf_counter around each synchronised call, the peers of a case in turn; median"


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


L2_FLUSH_BYTES = 256 * 2**20  # what triton.testing.do_bench zeroes between calls


def interleaved_samples(calls: list, device: torch.device, warmup_ms: float = 25, rep_ms: float = 100,
                        min_samples: int = 3) -> list:
    """Samples (ms) of several calls taken call by call in turn: round r times call 0, 1, ...
    once each (the order rotated every round), so every call sees the same clocks and
    temperature; a GPU that throttles under a long run slows them all alike. Each call gets
    about rep_ms of samples (at least min_samples), after about warmup_ms of warm-up.

    calls: [(fn, context)] where context() is entered around each call (timing included).
    Returns one list per call, or an exception where that call raised (it is then dropped).
    CUDA: events around each call after zeroing L2_FLUSH_BYTES, as do_bench does; CPU: the wall
    clock around each synchronised call.
    """
    out: list = [[] for _ in calls]
    live = list(range(len(calls)))

    def once(i, timed):
        fn, context = calls[i]
        with context():
            if timed is None:
                fn()
            else:
                start, end = timed
                start.record()
                fn()
                end.record()

    estimate = {}
    for i in list(live):  # warm-up and an estimate of each call's time
        try:
            t0 = time.perf_counter()
            synchronize(device)
            once(i, None)
            synchronize(device)
            first = max((time.perf_counter() - t0) * 1e3, 1e-3)
            for _ in range(max(0, min(100, int(warmup_ms / first)))):
                once(i, None)
            synchronize(device)
            # The median of three synchronised calls: one slow call (a kernel compiled on first
            # use, say) must not cut a peer's samples to the minimum.
            estimate[i] = statistics.median(_synced_call_ms(lambda i=i: once(i, None), device) for _ in range(3))
        except Exception as e:
            out[i] = e
            live.remove(i)
    counts = {i: max(min_samples, min(10000, int(rep_ms / max(estimate[i], 1e-3)))) for i in live}
    cuda = device.type == "cuda"
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if cuda else None
    pending: list = []
    rounds = max(counts.values(), default=0)
    for r in range(rounds):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        for i in order:
            if r >= counts[i] or isinstance(out[i], BaseException):
                continue
            try:
                if cuda:
                    flush.zero_()
                    ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    once(i, ev)
                    pending.append((i, ev))
                else:
                    out[i].append(_synced_call_ms(lambda i=i: once(i, None), device))
            except Exception as e:
                out[i] = e
    synchronize(device)
    for i, (start, end) in pending:
        if not isinstance(out[i], BaseException):
            out[i].append(start.elapsed_time(end))
    return out


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
