"""Settings: the ADAATTN_* environment variables, read once, and what tests and benchmarks override.

Every plan is cached under the settings it was made with (`current()` is part of the key), so
`override(...)` never meets a stale plan. A bad value raises ValueError naming the variable.

    ADAATTN_POISON_OUTPUTS=1     outputs start as NaN (tests: an unwritten element fails)
    ADAATTN_TRITON_AUTOTUNE=0    take the first fitting kernel config, time nothing
    ADAATTN_TRITON_DQ            how our backward makes dq: atomic (default), separate, atomic_rotate
    ADAATTN_TRITON_BWD_WS        auto (default: the warp-specialised backward where it applies, on
                                 Hopper), on (wherever it applies, the CPU interpreter included), off
    ADAATTN_TRITON_FWD_GLUON     auto (default: on Hopper the Gluon forwards run, the exact one
                                 of triton.ws and the fp8 one of triton.quant.ws, each timed beside
                                 the Triton kernel), off
    ADAATTN_TRITON_BWD_GLUON     auto (default: on Hopper the Gluon backward, dq added by TMA
                                 reductions, is timed beside the warp-specialised pair for
                                 non-deterministic dense calls), off
    ADAATTN_TRITON_DS_SPLIT      auto (default: half-precision gradients of triton.ptr take ds in
                                 two roundings where torch would run its math kernel), on (every
                                 half-precision backward of triton.ptr), off (ds rounded once, as
                                 FA2 and cuDNN do)
    ADAATTN_TRITON_BOUND=1       launch our compiled Triton kernels through their launchers, past
                                 triton's per-call binding (backends/triton/bound.py; default off,
                                 read there: it saved no measurable host time on an H200)
    ADAATTN_TRITON_FWD_GRID      query_major (default) or head_major launch grid of our forward
    ADAATTN_TRITON_EXP_FMA       0 (default), 2, 4: share of exp2 on the FMA units (one in N)
    ADAATTN_FP8_LEVEL_QK         auto (default: FP8 on Hopper), int8, fp8: Q.K^T of the fp8 level
    ADAATTN_FP8_WS_CAUSAL=1      causal fp8-level calls may run the warp-specialised Triton fp8 kernel
    ADAATTN_TRITON_FWD           gone: the forward variants are runners ("triton.ws", "triton.tma",
                                 "triton.ptr"); pin one with Policy(backends=(name,)). Setting it warns.
"""

from __future__ import annotations

import os
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Iterator

DQ_MODES = ("separate", "atomic", "atomic_rotate")
GRID_ORDERS = ("query_major", "head_major")
EXP_FMA_SHARES = ("0", "2", "4")
FP8_LEVEL_QK = ("auto", "int8", "fp8")
BWD_WS = ("auto", "on", "off")
FWD_GLUON = ("auto", "off")
BWD_GLUON = ("auto", "off")
DS_SPLIT = ("auto", "on", "off")


@dataclass(frozen=True)
class Settings:
    """What the environment (or an override) sets; hashable, so plans can be keyed on it."""

    poison_outputs: bool = False
    autotune: bool = True
    dq: str = "atomic"  # measured fastest on the H100 (results/2026-11-22-triton-variants-h100.json)
    bwd_ws: str = "auto"  # kernels/attention_bwd_ws.py; benchmarks/NOTES.md, "A warp-specialised backward for Hopper", has its figures
    fwd_gluon: str = "auto"  # kernels/attention_fwd_gluon.py and attention_quant_gluon.py
    bwd_gluon: str = "auto"  # kernels/attention_bwd_gluon.py
    ds_split: str = "auto"  # kernels/attention_bwd.ds_low; backends/triton/runner.torch_runs_math_gradients
    fwd_grid: str = "query_major"
    exp_fma: str = "0"
    fp8_level_qk: str = "auto"
    fp8_ws_causal: bool = False
    # (kernel kind, KernelConfig) pairs that replace the tuned choice: tests and benchmarks.
    forced_configs: tuple = ()

    def __post_init__(self) -> None:
        for name, allowed in (("dq", DQ_MODES), ("fwd_grid", GRID_ORDERS), ("exp_fma", EXP_FMA_SHARES),
                              ("fp8_level_qk", FP8_LEVEL_QK), ("bwd_ws", BWD_WS),
                              ("fwd_gluon", FWD_GLUON), ("bwd_gluon", BWD_GLUON), ("ds_split", DS_SPLIT)):
            value = getattr(self, name)
            if str(value) not in allowed:
                raise ValueError(f"setting {name} must be one of {allowed}, got {value!r}")
            object.__setattr__(self, name, str(value))

    def forced(self, kind: str):
        """The forced KernelConfig of a kernel kind, or None."""
        for k, cfg in self.forced_configs:
            if k == kind:
                return cfg
        return None


_ENV = {
    "poison_outputs": ("ADAATTN_POISON_OUTPUTS", lambda s: s == "1"),
    "autotune": ("ADAATTN_TRITON_AUTOTUNE", lambda s: s != "0"),
    "dq": ("ADAATTN_TRITON_DQ", str),
    "bwd_ws": ("ADAATTN_TRITON_BWD_WS", str),
    "fwd_gluon": ("ADAATTN_TRITON_FWD_GLUON", str),
    "bwd_gluon": ("ADAATTN_TRITON_BWD_GLUON", str),
    "ds_split": ("ADAATTN_TRITON_DS_SPLIT", str),
    "fwd_grid": ("ADAATTN_TRITON_FWD_GRID", str),
    "exp_fma": ("ADAATTN_TRITON_EXP_FMA", str),
    "fp8_level_qk": ("ADAATTN_FP8_LEVEL_QK", str),
    "fp8_ws_causal": ("ADAATTN_FP8_WS_CAUSAL", lambda s: s == "1"),
}


def from_environment(env=None) -> Settings:
    """Settings from ADAATTN_* variables (os.environ by default); raises ValueError on bad values."""
    env = os.environ if env is None else env
    values = {}
    for field, (var, parse) in _ENV.items():
        if var in env:
            values[field] = parse(env[var])
    if "ADAATTN_TRITON_FWD" in env:
        warnings.warn("ADAATTN_TRITON_FWD is no longer read: the forward variants are runners; pin one with "
                      "Policy(backends=('triton.ws',)) / 'triton.tma' / 'triton.ptr'.", RuntimeWarning, stacklevel=2)
    try:
        return Settings(**values)
    except ValueError as e:
        names = {f: var for f, (var, _) in _ENV.items()}
        msg = str(e)
        for f, var in names.items():
            msg = msg.replace(f"setting {f} ", f"{var} ")
        raise ValueError(msg) from None


_lock = threading.Lock()
_current = from_environment()


def current() -> Settings:
    return _current


@contextmanager
def override(**changes) -> Iterator[Settings]:
    """Run a block with some settings replaced, e.g. override(dq="separate"); `forced_configs`
    takes a dict {kind: KernelConfig} merged over the current ones."""
    global _current
    known = {f.name for f in fields(Settings)}
    unknown = set(changes) - known
    if unknown:
        raise ValueError(f"unknown setting {sorted(unknown)}; known: {sorted(known)}")
    if isinstance(changes.get("forced_configs"), dict):
        merged = dict(_current.forced_configs)
        merged.update(changes["forced_configs"])
        changes["forced_configs"] = tuple(merged.items())
    with _lock:
        old = _current
        _current = replace(old, **changes)
    try:
        yield _current
    finally:
        with _lock:
            _current = old
