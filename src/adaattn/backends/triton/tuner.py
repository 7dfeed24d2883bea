"""The config tuner of our Triton kernels: each candidate timed once per shape class, the
fastest remembered; forced configs (tests, benchmarks) and ADAATTN_TRITON_AUTOTUNE=0 skip it."""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from typing import Callable, Optional

import torch

from ... import settings
from .common import KernelConfig, interpreting
from .configs import INTERPRET_CONFIGS


class ConfigChooser:
    """Times the fitting candidates once per shape class and remembers the fastest."""

    def __init__(self):
        self._lock = threading.Lock()
        self.chosen: dict = {}
        self.untimed: dict = {}  # first fitting candidate per class, remembered while tune is off
        self.timings: dict = {}
        self.tune = None  # None: settings.current().autotune decides; tests may set True/False

    def pick(self, kind: str, key: tuple, candidates, launch: Callable,
             output: Optional[Callable[[], torch.Tensor]] = None) -> KernelConfig:
        """candidates: a list, or a function returning one (only called when the class is new).
        output: what launch writes (the part of it that every candidate writes). When given, a
        candidate whose output holds a NaN or an infinity where another candidate's does not is
        dropped with a warning: a config the compiler gets wrong must not win on speed (seen
        with triton 3.6 on an H100: a 3-stage warp-specialised config wrote NaN)."""
        current = settings.current()
        forced = current.forced(kind)
        if forced is not None:
            return forced
        tune = current.autotune if self.tune is None else self.tune
        if interpreting():
            return INTERPRET_CONFIGS[kind]
        cfg = self.chosen.get((kind, key))
        if cfg is not None:
            return cfg
        if not tune and (kind, key) in self.untimed:
            return self.untimed[(kind, key)]
        if callable(candidates):
            candidates = candidates()
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not tune or len(candidates) == 1 or capturing:
            # No timing inside CUDA-graph capture: take the first candidate that fits.
            if not capturing:
                with self._lock:
                    self.untimed[(kind, key)] = candidates[0]
            return candidates[0]
        timings: dict = {}
        failures: dict = {}
        finite: dict = {}
        for c in candidates:
            try:
                timings[c] = _do_bench(lambda: launch(c), warmup=5, rep=20,
                                                     return_mode="median")
                if output is not None:
                    finite[c] = bool(torch.isfinite(output()).all())
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # out of resources, or a compile failure for this shape
                failures[str(c)] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
        if any(finite.values()):  # (all non-finite: the inputs are, nothing to tell apart)
            for c in [c for c, ok in finite.items() if not ok]:
                del timings[c]
                failures[str(c)] = "wrote NaN or infinity where another config's output is finite"
                warnings.warn(f"adaattn triton: {kind} config {c} wrote NaN or infinity where another config's "
                              f"output is finite, for shape class {key}; it is not used (a compiler bug).",
                              RuntimeWarning, stacklevel=2)
        if not timings:
            raise RuntimeError(f"adaattn triton: no {kind} config ran for shape class {key}: {failures}")
        # The two fastest are timed once more, and each keeps its better time: one slow
        # reading (clocks, another process) must not decide, nor make a slow config look
        # fast. Seen on an H100: a candidate read 1.19 ms once and 0.34 ms in another run.
        for c in sorted(timings, key=timings.get)[:2] if len(timings) > 1 else []:
            timings[c] = min(timings[c], _do_bench(lambda: launch(c), warmup=5, rep=20,
                                                                 return_mode="median"))
        best = min(timings, key=timings.get)
        with self._lock:
            self.chosen[(kind, key)] = best
            self.timings[(kind, key)] = {**{str(c): t for c, t in timings.items()}, **failures}
        return best


CONFIGS = ConfigChooser()


@contextmanager
def forced_configs(**kinds: KernelConfig):
    """Run with fixed configs, e.g. forced_configs(fwd=KernelConfig(128, 64, 8, 3)); for tests
    and benchmarks comparing variants (a settings override: plans made under it are its own)."""
    with settings.override(forced_configs=kinds):
        yield




def _do_bench(fn, **kw):
    import triton.testing

    return triton.testing.do_bench(fn, **kw)
