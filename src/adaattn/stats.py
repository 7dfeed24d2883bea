"""Per-call records of what ran: off by default, thread-safe, one branch when off.

    import adaattn
    with adaattn.stats.collect(timing=True) as records:
        model(x)
    print(adaattn.stats.summary(records))
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import torch

enabled = False  # read on every call: a plain module global, True while anything records
_user_enabled = False
_timing = False
_lock = threading.Lock()
_records: list[CallRecord] = []
_sinks: list[tuple[list[CallRecord], bool]] = []  # open collect() blocks: (their list, timing)
_limit = 100_000


def _refresh() -> None:
    global enabled
    enabled = _user_enabled or bool(_sinks)


@dataclass
class CallRecord:
    """One call of `attention`: what ran, on what, and why."""

    backend: str
    shape: str
    dtype: str
    device: str
    mode: str
    decisions: dict = field(default_factory=dict)
    fallbacks: tuple[str, ...] = ()
    label: str | None = None
    wall_ms: float | None = None

    def as_dict(self) -> dict:
        return {
            "backend": self.backend,
            "shape": self.shape,
            "dtype": self.dtype,
            "device": self.device,
            "mode": self.mode,
            "decisions": {k: _plain(v) for k, v in self.decisions.items()},
            "fallbacks": list(self.fallbacks),
            "label": self.label,
            "wall_ms": self.wall_ms,
        }


def _plain(value):
    """Decisions may hold device tensors (per-head errors measured on the GPU, kept there so
    that recording never synchronises); they become plain lists only when read."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "resolve"):
        return value.resolve()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def enable(timing: bool = False, limit: int = 100_000) -> None:
    """Start recording calls; with `timing`, each record gets its wall time (synchronises CUDA)."""
    global _user_enabled, _timing, _limit
    with _lock:
        _timing = bool(timing)
        _limit = int(limit)
        _user_enabled = True
        _refresh()


def disable() -> None:
    """Stop recording (open collect() blocks keep recording until they close)."""
    global _user_enabled, _timing
    with _lock:
        _user_enabled = False
        _timing = False
        _refresh()


def timing() -> bool:
    return _timing or any(t for _, t in _sinks)


def clear() -> None:
    with _lock:
        _records.clear()


def records() -> list[CallRecord]:
    """A copy of the records kept so far (oldest first, at most `limit`)."""
    with _lock:
        return list(_records)


def add(record: CallRecord) -> None:
    with _lock:
        if len(_records) >= _limit:
            del _records[: len(_records) // 2]  # keep the newest half
        _records.append(record)
        for sink, _ in _sinks:
            sink.append(record)


class Timer:
    """Wall time of a block; synchronises the device so the time covers the work."""

    def __init__(self, device: torch.device | None):
        self.cuda = device is not None and device.type == "cuda"
        self.device = device

    def __enter__(self) -> "Timer":
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.ms = (time.perf_counter() - self.t0) * 1e3


@contextlib.contextmanager
def collect(timing: bool = False) -> Iterator[list[CallRecord]]:
    """Record every call made while the block is open (from any thread) into the list it yields.

    Blocks may nest or overlap; each gets its own list, and recording stops when the last one
    closes unless enable() turned it on.
    """
    out: list[CallRecord] = []
    entry = (out, bool(timing))
    with _lock:
        _sinks.append(entry)
        _refresh()
    try:
        yield out
    finally:
        with _lock:
            for i, e in enumerate(_sinks):
                if e is entry:
                    del _sinks[i]
                    break
            _refresh()


def summary(recs: list[CallRecord] | None = None) -> str:
    """A short table: how many calls each backend served, per shape."""
    recs = records() if recs is None else recs
    if not recs:
        return "no attention calls recorded (adaattn.stats.enable() turns recording on)"
    counts = Counter((r.label or "-", r.backend, r.shape, r.dtype) for r in recs)
    width = max(5, *(len(label) for label, *_ in counts))
    lines = [f"{'label':<{width}} {'backend':<16} {'calls':>6}  shape, dtype"]
    for (label, backend, shape, dtype), n in counts.most_common():
        lines.append(f"{label:<{width}} {backend:<16} {n:>6}  {shape}, {dtype}")
    times = [r.wall_ms for r in recs if r.wall_ms is not None]
    if times:
        lines.append(f"total wall time {sum(times):.3f} ms over {len(times)} timed calls")
    return "\n".join(lines)
