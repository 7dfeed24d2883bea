"""Dispatch overhead: wall time per call of adaattn.attention against SDPA on the kernel it picks."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import planner
from ..api import attention
from ..policy import EXACT
from ..problem import validate
from . import timing
from .grid import Shape
from .suite import error_text, make_inputs

ADAATTN = "adaattn"
RUN = "backend.run"  # the picked backend's run, called directly: the same code without dispatch
SAME_KERNEL = "sdpa same kernel"  # SDPA pinned to the kernel adaattn picks, context entered once
PLAIN = "sdpa"  # SDPA with torch's own kernel choice
SDPA_KERNELS = {"sdpa.cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa.flash": SDPBackend.FLASH_ATTENTION,
                "sdpa.efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa.math": SDPBackend.MATH}

SHAPES_CUDA = (
    Shape(2, 16, 16, 128, 128, torch.bfloat16, False),
    Shape(2, 16, 16, 4096, 128, torch.bfloat16, False),
)
SHAPES_CPU = (
    Shape(1, 4, 4, 128, 64, torch.float32, False),
    Shape(1, 4, 4, 512, 64, torch.float32, False),
)

HOW = (
    "Per shape, each variant runs in a loop of `calls_per_repeat` calls with one synchronize at the "
    "end; the variants are interleaved (rotated order) for `repeats` rounds; per_call_us is the "
    "median over rounds of loop time / calls. 'sdpa same kernel' is "
    "F.scaled_dot_product_attention inside torch.nn.attention.sdpa_kernel(<kernel adaattn picked>), "
    "the context entered once around the loop, as a user pinning the kernel would; 'backend.run' "
    "is the picked runner alone (planner.bind); 'sdpa' is plain SDPA. overhead_* compares "
    "adaattn with 'baseline'; vs_plain_* with plain SDPA."
)


def default_shapes(device_type: str) -> tuple[Shape, ...]:
    return SHAPES_CUDA if device_type == "cuda" else SHAPES_CPU


def _variants(shape: Shape, q, k, v) -> tuple[str, dict[str, tuple[Callable, Callable]], str]:
    """The picked backend, {variant: (call, context factory)}, and the same-kernel baseline's name."""
    extra = {"enable_gqa": True} if shape.gqa else {}
    problem = validate(q, k, v, None, 0.0, shape.causal, None, shape.gqa)
    picked = planner.get_plan(problem, EXACT).backend
    run = planner.bind(picked, problem)
    none = contextlib.nullcontext
    variants = {
        ADAATTN: (lambda: attention(q, k, v, is_causal=shape.causal, enable_gqa=shape.gqa), none),
        RUN: (lambda: run(q, k, v), none),
        PLAIN: (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, **extra), none),
    }
    kernel = SDPA_KERNELS.get(picked)
    baseline = RUN
    if kernel is not None:
        variants[SAME_KERNEL] = (variants[PLAIN][0], lambda: sdpa_kernel(kernel))
        baseline = SAME_KERNEL
    elif picked.startswith("sdpa"):
        baseline = PLAIN  # sdpa.cpu: torch's own choice is the same kernel
    return picked, variants, baseline


def _loop_us(fn: Callable, context: Callable, calls: int, device: torch.device) -> float:
    with context():
        timing.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        timing.synchronize(device)
        elapsed = time.perf_counter() - t0
    return elapsed / calls * 1e6


def measure_shape(shape: Shape, device: torch.device, repeats: int, target_ms: float, seed: int = 0) -> dict:
    """Per-call microseconds of each variant on one shape, and adaattn's overhead over the baselines."""
    row: dict = {**shape.as_dict(), "picked": None, "error": None}
    try:
        q, k, v = make_inputs(shape, device, seed, requires_grad=False)
        picked, variants, baseline = _variants(shape, q, k, v)
        row["picked"] = picked
        for fn, context in variants.values():  # warm-up: lazy init, cuDNN plans, allocator
            with context():
                for _ in range(3):
                    fn()
        estimate = max(_loop_us(*variants[ADAATTN], calls=5, device=device), 0.1)
        calls = int(max(5, min(5000, target_ms * 1e3 / estimate)))
        names = list(variants)
        samples: dict[str, list[float]] = {n: [] for n in names}
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for r in range(repeats):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    samples[name].append(_loop_us(*variants[name], calls=calls, device=device))
        finally:
            if gc_was_enabled:
                gc.enable()
        per_call = {n: statistics.median(s) for n, s in samples.items()}
        ours = per_call[ADAATTN]
        row.update(
            calls_per_repeat=calls,
            repeats=repeats,
            per_call_us=per_call,
            baseline=baseline,
            overhead_us=ours - per_call[baseline],
            overhead_pct=100.0 * (ours - per_call[baseline]) / per_call[baseline],
            vs_plain_sdpa_us=ours - per_call[PLAIN],
            vs_plain_sdpa_pct=100.0 * (ours - per_call[PLAIN]) / per_call[PLAIN],
        )
    except Exception as e:
        row["error"] = error_text(e)
    return row


def run_overhead(shapes: tuple[Shape, ...], device: torch.device, repeats: int | None = None,
                 target_ms: float = 20.0) -> list[dict]:
    """One row per shape (see measure_shape); a failure becomes the row's `error`, never raised."""
    if repeats is None:
        repeats = 21 if device.type == "cuda" else 9
    return [measure_shape(s, device, repeats, target_ms, seed=1000 + i) for i, s in enumerate(shapes)]
