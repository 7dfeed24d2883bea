"""What a suite measures: cases (one problem each) and their peers, timed side by side in one run."""

from __future__ import annotations

import contextlib
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import stats
from . import timing
from .progress import Progress
from .suite import error_text, failed, with_warnings


@dataclass
class Peer:
    """One row of a case: a call timed beside the others on the same inputs.

    forward: () -> output, called once before timing (its output goes to the case's error check);
    timed: what is timed (default: forward), e.g. forward and backward; context: entered around
    every call of this peer, timing included (e.g. torch's sdpa_kernel pinning); warm: calls made
    before timing; info: () -> extra fields for the row, called after timing; reason: why the peer
    cannot run here (then forward is None and the row is listed as not run).
    """

    name: str
    forward: Callable[[], object] | None = None
    timed: Callable[[], object] | None = None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    warm: int = 1
    info: Callable[[], dict] | None = None
    reason: str = ""


def unavailable(name: str, reason: str) -> Peer:
    return Peer(name, reason=reason)


def graphed(name: str, call: Callable[[], object], info: Callable[[], dict] | None = None) -> Peer:
    """A peer replaying `call` captured once in a CUDA graph (after one warm call, which compiles).
    Where the warm call or the capture raises, the peer's row reports it, not its whole case (a
    kernel's OutOfResources took every row of the decode suite's cases with it, H200)."""
    try:
        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
    except Exception as e:  # noqa: BLE001 - reported in the peer's row by measure()
        error = e

        def failed():
            raise error

        return Peer(name, failed, info=info)
    # The replay reads what the capture read (a decode cache's pools, its plan's tensors) through
    # addresses fixed at capture: `call` keeps them alive as long as the peer. Dropping it freed a
    # cache made only for this peer, whose memory the next capture's empty_cache() unmapped (an
    # illegal memory access in the decode suite, H200).
    return Peer(name, lambda: (graph.replay(), call, out)[2], info=info)


@dataclass
class Case:
    """One problem of a suite. `make()` builds its inputs (lazily, so one case's memory is freed
    before the next) and returns (peers, check): check(output) -> relative error, or None.

    x: the size the plot puts on its horizontal axis (N, KV length, prompt length); work: what one
    call does in `unit`s (FLOPs, bytes, tokens) for the figure work / time; baseline: the peer the
    ratio column divides by.
    """

    suite: str
    label: str
    x: int
    fields: dict
    baseline: str
    figure: str  # "TFLOP/s", "TB/s" or "tokens/s"
    work: float
    make: Callable[[], tuple[list[Peer], Callable[[object], float] | None]]
    series: str = ""  # cases of one series share a plot panel (default: the label without x)
    also: tuple[str, ...] = ()  # further peers to divide by: each row gets x_<peer> (spaces as _)


SCALE = {"TFLOP/s": 1e12, "TB/s": 1e12, "tokens/s": 1.0}


@dataclass
class Settings:
    device: torch.device
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    progress: bool = True
    not_run: dict = field(default_factory=dict)  # peer name -> reason


def run_cases(cases: list[Case], settings: Settings) -> list[dict]:
    """Every peer of every case: one row each (see `measure`), ratios to the case's baseline filled in."""
    progress = Progress(len(cases), enabled=settings.progress)
    rows: list[dict] = []
    try:
        for case in cases:
            progress.step(case.label)
            rows.extend(_run_case(case, settings, progress))
    finally:
        progress.close()
    return rows


def _run_case(case: Case, settings: Settings, progress: Progress) -> list[dict]:
    base = {"suite": case.suite, "case": case.label, "series": case.series or case.label, "x": case.x,
            **case.fields, "baseline": case.baseline, "figure_unit": case.figure}
    try:
        peers, check = case.make()
    except Exception as e:  # the inputs themselves did not fit, say
        timing.release_after_error(settings.device)
        return [{**base, "peer": case.baseline, **_empty(), "error": error_text(e)}]
    rows, timed = [], []
    for peer in peers:
        if peer.forward is None:
            settings.not_run.setdefault(peer.name, peer.reason)
            continue
        progress.note(peer.name)
        row = {**base, "peer": peer.name, **measure(peer, case, check, settings)}
        rows.append(row)
        if row["error"] is None:
            timed.append((peer, row))
    time_interleaved(timed, case, settings)
    del peers, check, timed
    timing.release_after_error(settings.device)
    for name, field_name in ((case.baseline, "x_baseline"), *((a, "x_" + a.replace(" ", "_")) for a in case.also)):
        ref = next((r for r in rows if r["peer"] == name and r["ms"] is not None), None)
        for r in rows:
            r[field_name] = None if ref is None or r["ms"] is None else ref["ms"] / r["ms"]
    return rows


def _empty() -> dict:
    return {"ms": None, "ms_min": None, "ms_max": None, "samples": 0, "figure": None, "rel_error": None,
            "ran": None, "error": None}


def measure(peer: Peer, case: Case, check, settings: Settings) -> dict:
    """Time one peer: min/median/max ms, the figure (work / median), error, what adaattn ran."""
    row = _empty()
    device = settings.device
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with peer.context(), stats.collect() as records:
                for _ in range(max(1, peer.warm)):
                    out = peer.forward()
            row["ran"] = sorted({r.backend for r in records}) or None
            if check is not None and out is not None:
                err = check(out)  # a float, or (float, further fields such as per-head errors)
                if isinstance(err, tuple):
                    err, extra = err
                    row.update(extra)
                row["rel_error"] = err
            del out
        except Exception as e:
            failed(row, e, device)
    return with_warnings(row, caught)


def paired_ratio(base: list[float] | None, times: list[float]) -> float | None:
    """The median over rounds of baseline time / this time, each pair taken in the same round
    (interleaved_samples' sample j of every call is in round j): clocks that drift between
    rounds cancel, which the ratio of two medians does not do."""
    if not base:
        return None
    pairs = [b / t for b, t in zip(base, times) if t > 0]
    return statistics.median(pairs) if pairs else None


def time_interleaved(timed: list, case: Case, settings: Settings) -> None:
    """Time every peer of a case call by call in turn (timing.interleaved_samples): each round
    times every peer once, the order rotated every round, so a drift of clocks or temperature,
    large on a GPU held at full load, falls on all rows alike; a row's spread is over its
    samples."""
    samples: dict[int, list[float]] = {id(row): [] for _, row in timed}
    live = [(peer, row) for peer, row in timed if row["error"] is None]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = timing.interleaved_samples([(peer.timed or peer.forward, peer.context) for peer, _ in live],
                                         settings.device, settings.warmup_ms, settings.rep_ms)
    for (peer, row), times in zip(live, got):
        if isinstance(times, BaseException):
            failed(row, times, settings.device)
            with_warnings(row, caught)
        else:
            samples[id(row)] = times
    base = next((samples[id(row)] for peer, row in timed if peer.name == case.baseline and row["error"] is None), None)
    for peer, row in timed:
        if row["error"] is not None or not samples[id(row)]:
            continue
        row["x_baseline_paired"] = paired_ratio(base, samples[id(row)])
        spread = timing.Spread.of(samples[id(row)])
        row.update(ms=spread.median, ms_min=spread.min, ms_max=spread.max, samples=spread.samples,
                   figure=case.work / (spread.median * 1e-3) / SCALE[case.figure])
        if peer.info is not None:
            try:
                row.update(peer.info())
            except Exception as e:
                failed(row, e, settings.device)
