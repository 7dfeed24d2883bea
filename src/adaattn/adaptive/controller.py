"""Per-call-site precision controllers: which level each head runs at, kept honest by sampling.

A controller belongs to one call site (an `AdaAttention` module, a `label`, or else one
shape class of anonymous calls under one policy) and holds, per query head, the level it
runs at ("exact", "qk8", "fp8") and the errors measured there.

First call (warm-up, the one call that synchronises): statistics of the inputs predict each
level's error per head (adaptive/analysis.py); each head starts at the cheapest allowed
level predicted to meet tau * PREDICT_MARGIN; the output's sampled rows are checked against
exact rows, and a head over tau * VERIFY_MARGIN is recomputed one level up, checked again,
until every head meets it or is exact.

Later calls launch each level present once (heads of other levels skipped in-kernel). On a
fraction `Policy.verify` of calls (drawn on the host, no synchronisation), 64 query rows per
head are checked on the device: heads over the margin are recomputed one level up in the
same call, checked again, and recomputed exactly if still over, all with device-side head
masks. The measured errors and final levels are copied back asynchronously and applied to
the controller on a later call (a head moved up stays up; its error feeds an EMA).

Inside CUDA-graph capture nothing is sampled: the levels known at capture are launched, or
every head exact if the controller never warmed up. Under torch.compile the call is one
custom op whose body runs this logic eagerly.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
import zlib
from collections import deque

import torch

from .. import hardware
from . import analysis
from . import choice as choice_mod
from . import quant_launch as tq
from . import verify_launch

PREDICT_MARGIN = 0.7
VERIFY_MARGIN = 0.8
DOWN_MARGIN = 0.4  # a head measuring below tolerance * this ...
DOWN_AFTER = 8  # ... on this many verified calls in a row retries the next cheaper level once
SAMPLE_ROWS = 64
EMA = 0.3
MEASURED_CALLS = 3  # verified calls timed before their median replaces a size's predicted time
MEASURED_KEEP = 8

def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int32 tensor on `device` without synchronising (a pinned, asynchronous copy)."""
    t = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _up(level: int, allowed: tuple[int, ...]) -> int:
    """The next more precise allowed level (exact is always allowed)."""
    above = [a for a in allowed if a < level]
    return max(above) if above else tq.LEVEL_EXACT


class PrecisionController:
    """Levels and measured errors per query head for one call site."""

    def __init__(self, site: str, tolerance: float, verify: float, allowed: tuple[int, ...], q_heads: int,
                 fp8_qk: bool = False, seed: int = 0, allow_ws: bool = True, runner: str = choice_mod.GENERAL):
        self.site = site
        self.runner = runner  # whose cost entries predict this site's time
        self.allow_ws = allow_ws  # the warp-specialised kernels may run (runner triton.quant.ws)
        self.tolerance = float(tolerance)
        self.verify = float(verify)
        self.allowed = tuple(sorted(set(allowed) | {tq.LEVEL_EXACT}))
        self.q_heads = q_heads
        self.fp8_qk = fp8_qk
        self.levels: list[int] | None = None
        self.errors: list[float | None] = [None] * q_heads  # last measured, per head
        self.ema: list[float | None] = [None] * q_heads
        self.predicted: dict[str, list[float]] | None = None
        self.statistics: dict[str, list[float]] | None = None
        self.calls = 0
        self.verified_calls = 0
        self.escalations = 0
        self.step_downs = 0
        self._calm = [0] * q_heads  # consecutive verified calls far below the tolerance
        self._probing: list[int | None] = [None] * q_heads  # a cheaper level being retried
        self._no_probe = [False] * q_heads
        self._pending: deque = deque()
        self._rng = random.Random(zlib.crc32(site.encode()) ^ seed)  # sites verify on different calls
        self._generators: dict = {}
        self._device_levels: dict = {}
        self._up_tables: dict = {}
        self._captured: list = []  # device tensors a CUDA graph points at: never freed
        self._lock = threading.RLock()
        # Time: quantized or exact, per problem size (batch, heads, q_len, kv_len); the site's
        # measurements of its own option (verified calls) and of both (first call, without data).
        self._choices: dict[tuple, choice_mod.Choice] = {}
        self._measured: dict[tuple, float] = {}
        self._samples: dict[tuple, deque] = {}
        self._exact_samples: dict[tuple, list] = {}
        self._exact_measured: dict[tuple, float] = {}
        self._ratio: float | None = None  # quantized / exact, measured at the site's first size
        self.last_choice: choice_mod.Choice | None = None

    # ---- host-side state ----------------------------------------------------------------

    def describe(self) -> dict:
        """Levels, last measured and predicted errors per head (applies finished readbacks)."""
        self.poll()
        names = None if self.levels is None else [tq.LEVELS[x] for x in self.levels]
        return {"site": self.site, "tolerance": self.tolerance, "levels": names, "errors": list(self.errors),
                "error_ema": list(self.ema), "predicted": self.predicted, "statistics": self.statistics,
                "calls": self.calls, "verified_calls": self.verified_calls, "escalations": self.escalations,
                "step_downs": self.step_downs,
                "choice": None if self.last_choice is None else self.last_choice.as_dict()}

    def poll(self, wait: bool = False) -> None:
        """Apply finished verification readbacks (all of them, waiting, with wait=True)."""
        with self._lock:
            while self._pending:
                event, started, errors, levels, first_errors, timed = self._pending[0]
                if not wait and event is not None and not event.query():
                    return
                if event is not None:
                    event.synchronize()
                self._pending.popleft()
                self._apply(started, levels.tolist(), errors.tolist(), first_errors.tolist())
                if timed is not None:
                    self._apply_time(*timed)

    def _apply(self, started: list[int], levels: list[int], errors: list[float], first_errors: list[float]) -> None:
        """One verified call's readback: the levels it started at, the levels it ended at (a
        head over the margin was recomputed higher), and the final measured errors."""
        with self._lock:
            for h in range(self.q_heads):
                if levels[h] < started[h]:  # escalated in that call: stay up
                    self.escalations += 1
                    if self._probing[h] == started[h]:
                        self._no_probe[h] = True  # the cheaper level was tried again and failed
                    self._probing[h] = None
                    self.levels[h] = min(self.levels[h], levels[h])
                    self._forget_times()  # the site's option changed: its times are measured again
                    self.ema[h] = errors[h]
                    self._calm[h] = 0
                elif levels[h] == self.levels[h]:
                    prev = self.ema[h]
                    self.ema[h] = errors[h] if prev is None else (1 - EMA) * prev + EMA * errors[h]
                    self._calm[h] = self._calm[h] + 1 if errors[h] <= self.tolerance * DOWN_MARGIN else 0
                    self._maybe_step_down(h)
                self.errors[h] = errors[h]

    def _maybe_step_down(self, h: int) -> None:
        """A head that escalated (or started high) and has measured far below the tolerance for
        DOWN_AFTER verified calls tries the next cheaper level again, if its prediction allows;
        once such a retry fails the head stays where it is (no oscillation)."""
        if self._calm[h] < DOWN_AFTER or self._no_probe[h] or self.predicted is None:
            return
        cheaper = [a for a in self.allowed if a > self.levels[h]]
        if not cheaper:
            return
        level = min(cheaper)
        if self.predicted[tq.LEVELS[level]][h] > self.tolerance * PREDICT_MARGIN:
            return
        self.levels[h] = level
        self._probing[h] = level
        self._calm[h] = 0
        self.step_downs += 1
        self._forget_times()

    def _forget_times(self) -> None:
        """The levels changed: the option's measured times no longer hold (the exact runner's
        do; choices are keyed by the levels, so the new ones are decided afresh)."""
        self._measured.clear()
        self._samples.clear()

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            g = torch.Generator(device=device)
            g.manual_seed(self._rng.randrange(2 ** 31))
            self._generators[key] = g
        return self._generators[key]

    def _snapshot(self, device: torch.device) -> tuple[list[int], torch.Tensor]:
        """(levels, the same levels as an int32 device tensor), taken together under the lock so
        a readback applied from another thread cannot change one without the other."""
        with self._lock:
            levels = list(self.levels)
            key = (str(device), tuple(levels))
            t = self._device_levels.get(key)
            if t is None:
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    t = torch.empty(len(levels), dtype=torch.int32, device=device)
                    for h, lv in enumerate(levels):  # device-side fills: capturable
                        t[h].fill_(lv)
                else:
                    t = _to_device(levels, device)
                self._device_levels[key] = t
            return levels, t

    def _up_table(self, device: torch.device) -> torch.Tensor:
        """level -> the next more precise allowed level, on the device."""
        key = str(device)
        t = self._up_tables.get(key)
        if t is None:
            t = _to_device([_up(x, self.allowed) for x in range(len(tq.LEVELS))], device)
            self._up_tables[key] = t
        return t

    # ---- one call -------------------------------------------------------------------------

    def run(self, q, k, v, attn_mask, scale, causal, bottom_right, window_left, window_right, exact=None,
            problem=None):
        """(out, info): attention with every head at its level; info feeds adaattn.stats.

        exact (a backends.ExactAlternative) and problem: the fastest exact runner for this call,
        which runs instead where the site's option is no faster (adaptive/choice.py)."""
        self.calls += 1
        kw = dict(scale=scale, causal=causal, bottom_right=bottom_right, window_left=window_left,
                  window_right=window_right, fp8_qk=self.fp8_qk, allow_ws=self.allow_ws)
        # The pre-pass and the kernels read rows with unit stride along the head dimension.
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing:
            return self._run_captured(q, k, v, attn_mask, kw, exact, problem)
        self.poll()
        if self.levels is None:
            if q.numel() == 0 or k.shape[2] == 0:  # nothing to learn from: exact, warm up later
                out = tq.quant_attention(q, k, v, attn_mask, levels=[tq.LEVEL_EXACT], **kw)
                return out, {"levels": ["exact"] * self.q_heads, "verified": False,
                             "errors": [None] * self.q_heads, "note": "empty input: exact, no warm-up"}
            out, info = self._warm_up(q, k, v, attn_mask, kw)
            if exact is not None:
                picked = self.choose(problem, exact, (q, k, v, attn_mask, kw))
                info.update(picked.as_dict())
            return out, info
        picked = self.choose(problem, exact) if exact is not None else None
        if picked is not None and not picked.quantized:
            return exact.run(q, k, v, attn_mask, problem), self.exact_info(picked, exact, "an earlier call")
        verify = self.verify > 0 and self._rng.random() < self.verify and q.numel() > 0 and k.shape[2] > 0
        prepared = tq.Prepared(k, v)
        levels, levels_dev = self._snapshot(q.device)
        present = sorted(set(levels))
        timer = _Timer(q.device) if verify and picked is not None else None
        out = tq.quant_attention(q, k, v, attn_mask, levels=present,
                                 head_levels=levels_dev if len(present) > 1 else None, prepared=prepared, **kw)
        exact_timer = None
        if timer is not None:
            timer.stop()
            if len(self._exact_samples.get(_size(problem), ())) < MEASURED_CALLS:
                # The exact runner timed beside it on the first few verified calls: the two
                # figures then come from the same clocks (its output is discarded).
                exact_timer = _Timer(q.device)
                exact.run(q, k, v, attn_mask, problem)
                exact_timer.stop()
        info = {"levels": [tq.LEVELS[x] for x in levels], "verified": verify,
                "errors": list(self.errors), "errors_measured_on": "an earlier call"}
        if picked is not None:
            info.update(picked.as_dict())
        if not verify:
            return out, info
        self.verified_calls += 1
        errors, final, first = self._verify(q, k, v, attn_mask, out, levels_dev, present, prepared, kw)
        self._queue(levels, errors, final, first, None if timer is None else (timer, _size(problem), exact_timer))
        info.update(verified=True, errors=errors, levels_after=final, errors_measured_on="this call")
        return out, info

    # ---- time: the site's option against the exact runner ---------------------------------

    def exact_info(self, picked: choice_mod.Choice, exact, measured_on: str) -> dict:
        """What stats record of a call the site handed to the exact runner."""
        return {"levels": [tq.LEVELS[x] for x in self.levels], "verified": False, "errors": list(self.errors),
                "errors_measured_on": measured_on, **picked.as_dict(), "ran": exact.name}

    def choose(self, problem, exact, inputs=None) -> choice_mod.Choice:
        """The site's choice for this problem size (cached until its levels or measurements
        change). With `inputs` (the first call, which synchronises anyway) and no figure to
        compare, both options are timed once here on a CUDA device."""
        key = _size(problem)
        levels = tuple(self.levels)
        ckey = (key, levels)
        picked = self._choices.get(ckey)
        if picked is not None:
            self.last_choice = picked
            return picked
        arch = hardware.arch(problem.device_type, problem.device_index)
        predicted = choice_mod.predict_levels(self.runner, arch, problem, levels)
        exact_ms = self._exact_measured.get(key, exact.predicted_ms)  # measured here, else predicted
        measured = self._measured.get(key)
        needs = (measured is None and predicted is None) or exact_ms is None
        if needs and inputs is not None and problem.device_type == "cuda" and self._ratio is None \
                and any(lv != tq.LEVEL_EXACT for lv in levels):
            measured, exact_ms = self._time_both(problem, exact, levels, *inputs)
            self._measured[key], self._exact_measured[key] = measured, exact_ms
            self._ratio = measured / exact_ms if exact_ms > 0 else None
        picked = choice_mod.decide(levels, predicted, measured, exact.name, exact_ms, self._ratio)
        self._choices[ckey] = picked
        self.last_choice = picked
        return picked

    def _time_both(self, problem, exact, levels, q, k, v, attn_mask, kw) -> tuple[float, float]:
        """Milliseconds of one steady-state launch of the site's levels and of one exact call
        (after one untimed exact call: its first may build plans), on the current stream."""
        present = sorted(set(levels))
        head_levels = torch.tensor(levels, dtype=torch.int32, device=q.device) if len(present) > 1 else None
        exact.run(q, k, v, attn_mask, problem)
        t = _Timer(q.device)
        exact.run(q, k, v, attn_mask, problem)
        t.stop()
        u = _Timer(q.device)
        tq.quant_attention(q, k, v, attn_mask, levels=present, head_levels=head_levels, prepared=tq.Prepared(k, v),
                           **kw)
        u.stop()
        return u.ms(), t.ms()

    def _apply_time(self, timer: "_Timer", key: tuple, exact_timer: "_Timer | None" = None) -> None:
        """A verified call's measured time of the site's option (and, on the first few, of the
        exact runner beside it). Once MEASURED_CALLS of each are in, the median of the last
        MEASURED_KEEP takes the place of the prediction for that size (one slow sample, a clock
        dip say, does not flip the choice)."""
        times = self._samples.setdefault(key, deque(maxlen=MEASURED_KEEP))
        times.append(timer.ms())
        if exact_timer is not None:
            self._exact_samples.setdefault(key, []).append(exact_timer.ms())
            if len(self._exact_samples[key]) >= MEASURED_CALLS:
                self._exact_measured[key] = statistics.median(self._exact_samples[key])
        if len(times) >= MEASURED_CALLS:
            self._measured[key] = statistics.median(times)
            self._choices = {k: c for k, c in self._choices.items() if k[0] != key}

    def _sample_rows(self, q_len: int, device: torch.device) -> torch.Tensor:
        """SAMPLE_ROWS distinct query rows (all when q_len <= SAMPLE_ROWS), sorted, int32 on
        `device`: drawn on the host from this site's RNG, copied without synchronising."""
        if q_len <= SAMPLE_ROWS:
            return torch.arange(q_len, dtype=torch.int32, device=device)
        return _to_device(sorted(self._rng.sample(range(q_len), SAMPLE_ROWS)), device)

    def _verify(self, q, k, v, attn_mask, out, levels_dev, present, prepared, kw):
        """A steady-state verified call, on the device: sampled exact rows, per-head errors, heads
        over the margin recomputed one level up in `out`, still over: exact. Returns (errors
        after, levels after, errors before) as device tensors. Each stage is one launch of
        kernels/verify.py where it runs (`_step` has the torch equivalent)."""
        rows = self._sample_rows(q.shape[2], q.device)
        ref, _ = analysis.exact_rows(q, k, v, rows, attn_mask, kw["scale"], kw["causal"], kw["bottom_right"],
                                     kw["window_left"], kw["window_right"], need_p=False)
        limit = self.tolerance * VERIFY_MARGIN
        up_table = self._up_table(q.device)
        hq = q.shape[1]
        pitch = -(-hq // 4) * 4  # rows 16-byte aligned, like every other kernel argument
        work = torch.empty((3, pitch), dtype=torch.int32, device=q.device)[:, :hq]  # redo, exact redo, final
        errs = torch.empty((3, pitch), dtype=torch.float32, device=q.device)[:, :hq]  # before, between, after
        _step(out, rows, ref, levels_dev, up_table, work, errs[0], limit, 0)
        up_levels = sorted({_up(x, self.allowed) for x in present if x != tq.LEVEL_EXACT})
        if up_levels:
            tq.quant_attention(q, k, v, attn_mask, levels=up_levels, head_levels=work[0], out=out, prepared=prepared,
                               **kw)
        if any(x != tq.LEVEL_EXACT for x in up_levels):
            _step(out, rows, ref, levels_dev, up_table, work, errs[1], limit, 1)
            tq.quant_attention(q, k, v, attn_mask, levels=[tq.LEVEL_EXACT], head_levels=work[1], out=out,
                               prepared=prepared, **kw)
        _step(out, rows, ref, levels_dev, up_table, work, errs[2], limit, 2)
        return errs[2], work[2], errs[0]

    def _queue(self, started, errors, levels, first, timed=None) -> None:
        if errors.is_cuda:
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (errors, levels, first)]
            for h, t in zip(host, (errors, levels, first)):
                h.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            entry = (event, list(started), *host, timed)
        else:
            entry = (None, list(started), errors, levels, first, timed)
        with self._lock:
            self._pending.append(entry)

    def _warm_up(self, q, k, v, attn_mask, kw):
        """Predict, run, verify and escalate until every head meets the margin (synchronises)."""
        prepared = tq.Prepared(k, v)
        rows = analysis.sample_rows(q.shape[2], SAMPLE_ROWS, self._generator(q.device), q.device)
        ref, p = analysis.exact_rows(q, k, v, rows, attn_mask, kw["scale"], kw["causal"], kw["bottom_right"],
                                     kw["window_left"], kw["window_right"])
        stats = analysis.head_statistics(q, k, v, rows, p, ref)
        predicted = analysis.predict_errors(stats, kw["scale"], q.shape[-1], q.dtype, self.fp8_qk)
        pred_host = {name: t.tolist() for name, t in predicted.items()}
        self.statistics = {name: t.tolist() for name, t in stats.items()}
        self.predicted = pred_host
        levels = []
        for h in range(self.q_heads):
            choice = tq.LEVEL_EXACT
            for level in sorted(self.allowed, reverse=True):  # cheapest first
                if pred_host[tq.LEVELS[level]][h] <= self.tolerance * PREDICT_MARGIN:
                    choice = level
                    break
            levels.append(choice)
        present = sorted(set(levels))
        head_levels = torch.tensor(levels, dtype=torch.int32, device=q.device)
        out = tq.quant_attention(q, k, v, attn_mask, levels=present, head_levels=head_levels if len(present) > 1
                                 else None, prepared=prepared, **kw)
        limit = self.tolerance * VERIFY_MARGIN
        while True:
            errors = analysis.head_errors(out.index_select(2, rows), ref).tolist()
            redo = [(-1 if levels[h] == tq.LEVEL_EXACT or errors[h] <= limit else _up(levels[h], self.allowed))
                    for h in range(self.q_heads)]
            if all(x < 0 for x in redo):
                break
            self.escalations += sum(x >= 0 for x in redo)
            tq.quant_attention(q, k, v, attn_mask, levels=sorted({x for x in redo if x >= 0}),
                               head_levels=torch.tensor(redo, dtype=torch.int32, device=q.device), out=out,
                               prepared=prepared, **kw)
            levels = [r if r >= 0 else lv for r, lv in zip(redo, levels)]
        with self._lock:
            self.levels = levels
            self.errors = list(errors)
            self.ema = list(errors)
        self.verified_calls += 1
        info = {"levels": [tq.LEVELS[x] for x in levels], "verified": True, "errors": list(errors),
                "errors_measured_on": "this call", "predicted": {n: pred_host[n] for n in pred_host}}
        return out, info

    def _run_captured(self, q, k, v, attn_mask, kw, exact=None, problem=None):
        if self.levels is None:
            out = tq.quant_attention(q, k, v, attn_mask, levels=[tq.LEVEL_EXACT], **kw)
            return out, {"levels": ["exact"] * self.q_heads, "verified": False, "errors": [None] * self.q_heads,
                         "note": "captured before warm-up: every head exact"}
        picked = self._choices.get((_size(problem), tuple(self.levels))) if exact is not None else None
        if picked is not None and not picked.quantized:  # the choice made eagerly holds in the graph
            return (exact.run(q, k, v, attn_mask, problem),
                    self.exact_info(picked, exact, "an earlier call (graph capture)"))
        levels, levels_dev = self._snapshot(q.device)
        present = sorted(set(levels))
        self._captured.append(levels_dev)  # the graph reads it on every replay
        out = tq.quant_attention(q, k, v, attn_mask, levels=present,
                                 head_levels=levels_dev if len(present) > 1 else None, **kw)
        return out, {"levels": [tq.LEVELS[x] for x in levels], "verified": False,
                     "errors": list(self.errors), "errors_measured_on": "an earlier call (graph capture)"}


def _size(problem) -> tuple:
    """The sizes a site's times depend on beyond its shape class."""
    return (problem.batch, problem.q_heads, problem.q_len, problem.kv_len)


class _Timer:
    """CUDA events around work on the current stream (read once the work is done); the wall
    clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def ms(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return float(self.start.elapsed_time(self.end))
        return (self.t1 - self.t0) * 1e3


def _step(out, rows, ref, levels, up, work, err, limit: float, stage: int) -> None:
    """One verification stage (kernels/verify.py's verify_step_kernel, or this torch equivalent
    where it does not run): per-head errors into err; stage 0 writes which heads are redone one
    level up (work[0], -1: not) and the levels they end at (work[2]); stage 1, after that redo,
    which are still over and redone exact (work[1]) and the final levels (work[2])."""
    if verify_launch.verify_step(out, rows, ref, levels, up, work, err, limit, stage):
        return
    e = analysis.head_errors(out.index_select(2, rows), ref)
    err.copy_(e)
    none = torch.full_like(levels, -1)
    if stage == 0:
        over = (e > limit) & (levels != tq.LEVEL_EXACT)
        redo = torch.where(over, up[levels.long()], none)
        work[0].copy_(redo)
        work[2].copy_(torch.where(over, redo, levels))
    elif stage == 1:
        redo = work[0]
        still = (redo > tq.LEVEL_EXACT) & (e > limit)
        work[1].copy_(torch.where(still, torch.zeros_like(none), none))
        work[2].copy_(torch.where(still, torch.zeros_like(none), torch.where(redo >= 0, redo, levels)))


def held_at(site: str, level: int, q_heads: int, *, tolerance: float = 1.0, verify: float = 0.0,
            fp8_qk: bool = False, allow_ws: bool = True, runner: str = choice_mod.GENERAL) -> PrecisionController:
    """A controller of no call site (not registered) with every head held at `level`: what a
    site settled there runs, for calibration and warm-up."""
    ctl = PrecisionController(site, tolerance, verify, (level,), q_heads, fp8_qk=fp8_qk, allow_ws=allow_ws,
                              runner=runner)
    ctl.levels = [level] * q_heads
    return ctl
