"""Timing helpers shared by the GPU benchmark scripts (run as `python3 benchmarks/<script>.py`)."""

from __future__ import annotations

import time

import torch


def host_us_per_call(fn, calls: int = 100, sleep_cycles: int = 500_000_000) -> float:
    """CPU time of one call while the GPU is kept busy (so no call waits for the GPU). Keep
    calls x launches per call under the launch queue's depth (about a thousand), or the host
    waits for the GPU after all. 500M sleep cycles are about 0.3 s of GPU time on an H100."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return t * 1e6
