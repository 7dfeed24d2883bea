"""`adaattn bench --suite NAME`: each suite times adaattn against its peers on one kind of workload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import calibrate, cp, cpu, decode, distributed, gpt, hf, host, modifiers, prefill, quant, rank, train, varlen, window


@dataclass(frozen=True)
class Suite:
    """name; help (one line for --help); needs_cuda: refuses to run without a GPU; cases:
    (args, device) -> list of bench.cases.Case, built without touching the device (inputs are made
    when each case runs); dispatch_overhead: also measure adaattn's per-call overhead (bench.overhead)."""

    name: str
    help: str
    needs_cuda: bool
    cases: Callable
    dispatch_overhead: bool = False
    finish: Callable | None = None  # (args, rows) -> paths written, after the rows are timed
    summarize: Callable | None = None  # rows -> (dict for the JSON's "summary", text printed after the table)
    plot: Callable | None = None  # (path, summary, title) -> path written or None: the PNG in place of the default
    # (args, device, settings) -> rows, in place of timing `cases` with the common harness (a suite
    # whose processes time in lock step, such as cp under torchrun); None on a process that does
    # not report (a rank other than 0), which then writes and prints nothing.
    run: Callable | None = None


SUITES = {
    m.NAME: Suite(m.NAME, m.HELP, m.NEEDS_CUDA, m.cases, getattr(m, "DISPATCH_OVERHEAD", False),
                  getattr(m, "finish", None), getattr(m, "summarize", None),
                  getattr(m, "plot", None), getattr(m, "run", None))
    for m in (prefill, train, decode, quant, window, varlen, hf, gpt, rank, distributed, cp, cpu, calibrate,
              modifiers, host)
}

__all__ = ["SUITES", "Suite"]
