"""The table: every available backend, torch's SDPA and `adaattn.attention`, on each shape."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from .. import planner
from ..api import attention
from ..policy import EXACT
from ..problem import validate
from . import accuracy, timing
from .grid import Shape
from .progress import Progress

TORCH = "torch"  # F.scaled_dot_product_attention called directly: torch's own kernel choice
ADAATTN = "adaattn"  # adaattn.attention with the default policy: dispatch included
YARDSTICK = "reference"  # the float64 error yardstick, never timed
NEVER_TIMED = (YARDSTICK, "meta")  # meta tensors compute nothing


def interpreted(name: str, device: torch.device) -> bool:
    """A Triton runner on the CPU runs in Triton's interpreter: a correctness path, never timed."""
    return device.type == "cpu" and "triton" in name and os.environ.get("TRITON_INTERPRET", "") == "1"

HOW_BACKENDS_RUN = (
    "Each registry runner row calls planner.bind(name, problem)(q, k, v): that runner alone, without "
    "adaattn's dispatch. "
    "Row 'torch' calls torch.nn.functional.scaled_dot_product_attention directly (torch chooses the "
    "kernel); row 'adaattn' calls adaattn.attention with the default policy (validation, plan lookup "
    "and the chosen backend), its choice in 'picked'."
)


@dataclass
class Settings:
    """How each figure is taken."""

    device: torch.device
    backward: bool = False
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    error_rows: int = 256
    seed: int = 0
    wanted: Callable[[str], bool] = lambda name: True
    progress: bool = True
    declined: dict = field(default_factory=dict)  # shape label -> {backend: reasons}, filled by run


def error_text(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:240]


def failed(row: dict, e: BaseException, device: torch.device) -> None:
    """A call raised: its row says so, and CUDA memory is given back before the next one."""
    row["error"] = error_text(e)
    timing.release_after_error(device)


def with_warnings(row: dict, caught: list) -> dict:
    """`row` with the first line of each distinct warning its call raised, if any."""
    texts = (str(w.message).strip() for w in caught)
    msgs = list(dict.fromkeys([*row.get("warnings", ()), *(t.splitlines()[0][:200] for t in texts if t)]))
    if msgs:
        row["warnings"] = msgs
    return row


def make_inputs(shape: Shape, device: torch.device, seed: int, requires_grad: bool) -> tuple[torch.Tensor, ...]:
    """Fresh torch.randn query, key, value in (B, H, N, D), made on `device`, reproducible from `seed`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for heads in (shape.heads, shape.kv_heads, shape.kv_heads):
        t = torch.randn(shape.batch, heads, shape.seq_len, shape.head_dim, generator=gen, device=device)
        out.append(t.to(shape.dtype).requires_grad_(requires_grad))
    return tuple(out)


Runner = tuple[str, "Callable | str", "str | None"]  # name, forward call or error string, backend picked


def runners(shape: Shape, q, k, v, settings: Settings) -> tuple[list[Runner], dict[str, list[str]]]:
    """The rows to measure on one shape, and the backends that declined it with their reasons."""
    gqa = shape.gqa
    problem = validate(q, k, v, None, 0.0, shape.causal, None, gqa)
    rows: list[Runner] = []
    declined: dict[str, list[str]] = {}

    if settings.wanted(TORCH):
        extra = {"enable_gqa": True} if gqa else {}
        sdpa = F.scaled_dot_product_attention
        rows.append((TORCH, lambda: sdpa(q, k, v, is_causal=shape.causal, **extra), None))

    for name in planner.runner_names():
        if name in NEVER_TIMED or not settings.wanted(name):
            continue
        if interpreted(name, q.device):
            declined[name] = ["runs under TRITON_INTERPRET (a correctness path, not a timing one)."]
            continue
        try:
            fn = planner.bind(name, problem)
        except planner.NoBackendError as e:
            declined[name] = [str(e).split(": ", 1)[-1]]
            continue
        except Exception as e:  # it failed earlier in this process, say
            rows.append((name, error_text(e), None))
            continue
        rows.append((name, lambda f=fn: f(q, k, v), None))

    if settings.wanted(ADAATTN):
        try:
            picked = planner.get_plan(problem, EXACT).backend
        except Exception as e:
            rows.append((ADAATTN, error_text(e), None))
        else:
            rows.append((ADAATTN, lambda: attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa), picked))
    return rows, declined


def _with_backward(forward: Callable, inputs: tuple[torch.Tensor, ...], grad_out: torch.Tensor) -> Callable:
    def step():
        out = forward()
        return torch.autograd.grad(out, inputs, grad_out)

    return step


def measure(name: str, forward: Callable, shape: Shape, inputs, ref, rows_idx, settings: Settings) -> dict:
    """One row: time, TFLOP/s, error and peak memory of one runner; an exception becomes `error`."""
    row: dict = {"ms": None, "tflops": None, "rel_error": None, "peak_mib": None, "error": None}
    device = settings.device
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = forward()
            if ref is not None:
                row["rel_error"] = accuracy.relative_error(out, ref, rows_idx)
            fn = forward
            if settings.backward:
                fn = _with_backward(forward, inputs, torch.randn_like(out))
                fn()  # the backward's first run, so its failures land here
            del out
            row["ms"] = timing.median_ms(fn, device, settings.warmup_ms, settings.rep_ms)
            row["tflops"] = shape.flops(settings.backward) / (row["ms"] * 1e-3) / 1e12
            row["peak_mib"] = timing.peak_mib(fn, device)
        except Exception as e:
            failed(row, e, device)
    return with_warnings(row, caught)


@dataclass
class Case:
    """One benchmarked call: its shape, where its inputs come from, and fields added to its rows.

    make: (device, requires_grad) -> (q, k, v) in (B, H, N, D) with the shape's sizes and dtype;
    None means fresh torch.randn inputs. fields: e.g. {"workload": "gpt", "layer": 3}.
    """

    shape: Shape
    make: Callable[[torch.device, bool], tuple[torch.Tensor, ...]] | None = None
    fields: dict = field(default_factory=dict)

    def label(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.fields.items())
        return f"{self.shape.label()} {extra}" if extra else self.shape.label()


def run_suite(shapes: list[Shape], settings: Settings, cases: list[Case] | None = None) -> list[dict]:
    """Benchmark every shape (or every case, when `cases` is given); one dict per (shape, runner), in order.

    Each row holds the shape's fields (and the case's), `backend`, `picked` (for the adaattn
    row), `ms` (median), `tflops`, `rel_error` against the float64 reference on `error_rows`
    sampled query rows (None if the reference failed), `peak_mib` (CUDA), and `error` (a string
    when the runner raised; its figures are then None). Never raises for a failing backend.
    """
    if cases is None:
        cases = [Case(s) for s in shapes]
    progress = Progress(len(cases), enabled=settings.progress)
    out: list[dict] = []
    try:
        for i, case in enumerate(cases):
            progress.step(case.label())
            out.extend(_run_shape(case, settings, progress, seed=settings.seed + i))
    finally:
        progress.close()
    return out


def _run_shape(case: Case, settings: Settings, progress: Progress, seed: int) -> list[dict]:
    device = settings.device
    shape = case.shape
    if case.make is None:
        q, k, v = make_inputs(shape, device, seed, settings.backward)
    else:
        q, k, v = case.make(device, settings.backward)
    rows_idx = accuracy.sample_rows(shape.seq_len, settings.error_rows)
    ref, ref_error = None, None
    progress.note("float64 reference")
    try:
        with torch.no_grad():
            ref = accuracy.sampled_reference(q.detach(), k.detach(), v.detach(), rows_idx, shape.causal)
    except Exception as e:
        ref_error = error_text(e)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    table, declined = runners(shape, q, k, v, settings)
    settings.declined[case.label()] = declined
    rows = []
    for name, fn, picked in table:
        progress.note(name)
        base = {**shape.as_dict(), **case.fields, "backend": name, "picked": picked, "error_rows": len(rows_idx)}
        if isinstance(fn, str):
            row = {"ms": None, "tflops": None, "rel_error": None, "peak_mib": None, "error": fn}
        else:
            row = measure(name, fn, shape, (q, k, v), ref, rows_idx, settings)
        if ref_error is not None:
            row["reference_error"] = ref_error
        rows.append({**base, **row})
    _mark_error_checks(rows)
    return rows


def _mark_error_checks(rows: list[dict]) -> None:
    """MEASURING.md's bar: err ≤ 2·err(torch) + 1e-6, where the torch row has an error figure."""
    peer = next((r["rel_error"] for r in rows if r["backend"] == TORCH and r["rel_error"] is not None), None)
    for r in rows:
        r["error_within_2x_torch"] = None if peer is None or r["rel_error"] is None else bool(
            r["rel_error"] <= 2 * peer + 1e-6
        )
