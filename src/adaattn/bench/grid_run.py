"""`adaattn bench` without --suite: every registry backend over a grid of shapes (the --quick/--full/grid options)."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import overhead as overhead_mod
from . import report, timing
from .grid import Grid, base_grid, override
from .suite import ADAATTN, HOW_BACKENDS_RUN, NEVER_TIMED, TORCH, Case, Settings, run_suite

SCHEMA = "adaattn-bench/1"
GRID_OPTIONS = ("seq_lens", "batch", "heads", "kv_heads", "head_dim", "dtype", "causal")

FLOPS_NOTE = ("forward 4*B*H*Nq*Nk*D, halved when causal (Nq = Nk); with --backward 3.5x the forward "
              "(MEASURING.md). TFLOP/s = flops / median time.")
MEMORY_NOTE = ("CUDA: torch.cuda.max_memory_allocated during one call minus memory_allocated just "
               "before it (inputs and everything else already live), in MiB; null on the CPU.")


def _error_note(rows: int) -> str:
    return (f"rel_error = ||out - ref64|| / ||ref64|| over all batches and heads, on up to {rows} query "
            "rows chosen evenly over [0, N) (every row when N is at most that; each row's "
            "'error_rows' gives the count). The float64 reference of a sampled row uses that row's "
            "query and all keys, or when causal only keys j <= row. With --backward the error is the "
            "forward output's.")


def _fail(msg: str) -> int:
    print(f"adaattn bench: {msg}", file=sys.stderr)
    return 2


def _wanted(spec: str | None):
    from ..planner import runner_names

    if spec is None:
        return None, (lambda name: True)
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    known = [n for n in runner_names() if n not in NEVER_TIMED] + [TORCH, ADAATTN]
    unknown = [b for b in names if not any(k == b or k.startswith(b + ".") for k in known)]
    if unknown or not names:
        raise ValueError(f"--backends: unknown {', '.join(unknown) or '(empty)'}; known: {', '.join(known)}")
    return names, (lambda name: any(name == b or name.startswith(b + ".") for b in names))


def _gpt_cases(grid: Grid, device: torch.device, args: argparse.Namespace):
    from .workload import gpt_cases

    if getattr(args, "no_progress", False) is False:
        print("bench: capturing q, k, v from the GPT", file=sys.stderr, flush=True)
    return gpt_cases(grid, device, args.weights, args.gpt_layers or "ends")


def main_grid(args: argparse.Namespace) -> int:
    """The grid table: every backend on every shape of the grid; returns the exit code (2 for bad arguments)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return _fail("--device cuda given but no CUDA device is available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        return _fail(f"--device must be cpu or cuda[:i], got {args.device!r}")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    given = {k: getattr(args, k) for k in GRID_OPTIONS if getattr(args, k) is not None}
    mode = "full" if args.full else ("quick" if args.quick or not given else "custom")
    if args.overhead == "only":
        mode = "overhead"
    gpt = getattr(args, "workload", "random") == "gpt"
    if gpt:
        fixed = [f"--{k.replace('_', '-')}" for k in ("heads", "kv_heads", "head_dim") if k in given]
        if fixed:
            return _fail(f"{', '.join(fixed)}: --workload gpt takes heads and head dim from the model")
        given.setdefault("causal", "yes")
    grid = override(base_grid(args.full, device.type), dtypes=given.pop("dtype", None), **given)
    kv = grid.kv_heads or grid.heads
    if grid.heads % kv:
        return _fail(f"--heads ({grid.heads}) must be a multiple of --kv-heads ({kv})")
    try:
        restrict, wanted = _wanted(args.backends)
    except ValueError as e:
        return _fail(str(e))
    run_overhead = args.overhead or ("yes" if device.type == "cuda" or mode == "quick" else "no")
    rep_ms = args.rep_ms
    settings = Settings(device=device, backward=args.backward, warmup_ms=args.warmup_ms, rep_ms=rep_ms,
                        error_rows=args.error_rows, seed=args.seed, wanted=wanted,
                        progress=not args.no_progress)
    shapes = grid.shapes()
    cases: list[Case] | None = None
    workload = None
    if gpt and run_overhead != "only":
        try:
            cases, workload = _gpt_cases(grid, device, args)
        except (FileNotFoundError, ValueError) as e:
            return _fail(f"--workload gpt: {e}")
        shapes = [c.shape for c in cases]
    env, started = report.start(device, args.commit, f"adaattn bench ({mode})", timing.method(device))
    t0 = time.perf_counter()

    rows = [] if run_overhead == "only" else run_suite(shapes, settings, cases)
    ov_rows = []
    if run_overhead in ("yes", "only"):
        if settings.progress:
            print("bench: dispatch overhead", file=sys.stderr, flush=True)
        ov_rows = overhead_mod.run_overhead(overhead_mod.default_shapes(device.type), device)
    wall_s = time.perf_counter() - t0

    if args.out is not None:
        record = {
            "schema": SCHEMA,
            "date": started.isoformat(timespec="seconds"),
            **env,
            "config": {
                "mode": mode, "device": str(device), "grid": grid.as_dict(),
                "shapes": [s.as_dict() for s in shapes] if run_overhead != "only" else [],
                "backward": args.backward, "backends": list(restrict) if restrict else None,
                "rep_ms": rep_ms, "warmup_ms": args.warmup_ms, "error_rows": args.error_rows,
                "seed": args.seed, "overhead": run_overhead,
                **({"workload": workload} if workload else {}),
            },
            "method": {
                "timing": timing.method(device), "flops": FLOPS_NOTE, "error_rows": _error_note(args.error_rows),
                "memory": MEMORY_NOTE, "backends": HOW_BACKENDS_RUN, "overhead": overhead_mod.HOW,
            },
            "declined": settings.declined,
            "rows": rows,
            "overhead": ov_rows,
            "wall_s": round(wall_s, 2),
        }
        stem = report.output_stem(env, started)
        path = report.write_json(args.out / f"{stem}.json", record)
        print(f"wrote {path}")
        if rows:
            title = (f"adaattn bench {'fwd+bwd' if args.backward else 'fwd'}, {env['device_name']}, "
                     f"torch {env['torch']}")
            png = report.write_plot(args.out / f"{stem}.png", rows, title)
            if png is not None:
                print(f"wrote {png}")

    declined = {}
    for per_shape in settings.declined.values():
        for name, why in per_shape.items():
            declined.setdefault(name, " ".join(why))
    for name, why in declined.items():
        print(f"not run: {name}: {why}")
    if ov_rows:
        print()
        print(report.format_overhead(ov_rows))
    print(f"\n{len(rows)} rows, {len(ov_rows)} overhead rows in {wall_s:.1f} s")
    if rows:
        print(report.format_table(rows, args.backward))
    return 0
