"""Timing helpers shared by the GPU benchmark scripts (run as `python3 benchmarks/<script>.py`)."""

from __future__ import annotations

import time
import traceback

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


def section_runner(result: dict, log, t_start: float | None = None):
    """section(name, fn): log the name, run fn, return its value; on an exception print the
    traceback, append "name: error" to result["errors"] and return None, so one failing
    section does not stop the others."""
    def section(name, fn):
        t0 = time.time()
        log(f"== {name}" + (f"  (t={t0 - t_start:.0f}s)" if t_start is not None else ""))
        try:
            value = fn()
        except Exception as e:
            traceback.print_exc()
            result["errors"].append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            value = None
        log(f"   ({time.time() - t0:.1f}s)")
        return value

    return section


def graph_ms(fn, rep: int = 60) -> float:
    """GPU time of fn() alone: fn captured in a CUDA graph (after three warm-up calls on a side
    stream) and the replay timed, do_bench median. Raises where fn cannot be captured."""
    import triton.testing

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=10, rep=rep, return_mode="median")
