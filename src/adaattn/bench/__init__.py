"""`adaattn bench`: time every available backend over a grid of shapes, and the dispatch overhead.

    adaattn bench                      # --quick: small shapes, under a minute on a 2-core CPU
    adaattn bench --full --out DIR     # the prefill yardstick (bf16, B=2, H=16, D=128, N 1k-16k)
    adaattn bench --seq-lens 1k,4k --causal yes --backends sdpa.cudnn,torch,adaattn
    adaattn bench --workload gpt       # q, k, v captured from the shipped GPT on held-out text

Prints a table last: per (shape, backend) the median time, TFLOP/s, speed relative to torch's
own SDPA, relative error against the float64 reference and peak memory (CUDA). `--out` writes
the same as JSON, with the versions and git commit, and a PNG plot where matplotlib imports.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

from . import overhead as overhead_mod
from . import report, timing
from .grid import CAUSAL, Grid, Shape, base_grid, dtype_name, override, parse_dtypes, parse_seq_lens
from .suite import ADAATTN, HOW_BACKENDS_RUN, TORCH, YARDSTICK, Case, Settings, run_suite
from .workload import WORKLOADS

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


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _arg(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `adaattn bench`; sets `func` to the command."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="small grid (the default when no grid option is given): CPU float32 B=1 H=4 D=64 "
                      "N 128/512/1024; CUDA bf16 B=2 H=16 D=128 N 1k/4k")
    size.add_argument("--full", action="store_true",
                      help="prefill yardstick: bf16 B=2 H=16 D=128 N 1k/4k/16k, causal and not")
    g = parser.add_argument_group("grid (each overrides the --quick or --full value)")
    g.add_argument("--seq-lens", type=_arg(parse_seq_lens), default=None, metavar="N,N,...",
                   help="sequence lengths, Nq = Nk (4k = 4096)")
    g.add_argument("--batch", type=_positive, default=None)
    g.add_argument("--heads", type=_positive, default=None, help="query heads")
    g.add_argument("--kv-heads", type=_positive, default=None, help="key/value heads (GQA; default: --heads)")
    g.add_argument("--head-dim", type=_positive, default=None)
    g.add_argument("--dtype", type=_arg(parse_dtypes), default=None, metavar="DTYPE[,DTYPE]",
                   help="bf16, fp16, fp32 (comma-separated for several)")
    g.add_argument("--causal", choices=tuple(CAUSAL), default=None)
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="random: torch.randn inputs (default); gpt: each layer's q, k, v captured from the "
                   "shipped byte-level GPT on held-out stdlib text (heads, kv heads and head dim are the "
                   "model's; causal defaults to yes)")
    w.add_argument("--weights", type=Path, default=None, help="GPT weights for --workload gpt (default: shipped)")
    w.add_argument("--gpt-layers", default="ends", metavar="ends|all|I,J",
                   help="layers to take q, k, v from (default ends: first, middle, last)")
    parser.add_argument("--backends", default=None, metavar="NAME,...",
                        help="only these rows: registry backends (a prefix such as 'sdpa' takes every "
                        "sdpa.*), 'torch' and 'adaattn'")
    parser.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if available)")
    parser.add_argument("--backward", action="store_true", help="time forward+backward instead of forward")
    ov = parser.add_mutually_exclusive_group()
    ov.add_argument("--overhead", dest="overhead", action="store_const", const="yes",
                    help="measure dispatch overhead (default on CUDA, and with --quick on the CPU)")
    ov.add_argument("--no-overhead", dest="overhead", action="store_const", const="no")
    ov.add_argument("--overhead-only", dest="overhead", action="store_const", const="only",
                    help="measure only the dispatch overhead, no table")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="write bench-<date>-<device>.json (and .png with matplotlib) here")
    parser.add_argument("--rep-ms", type=float, default=100.0,
                        help="time budget per figure in ms: do_bench rep on CUDA, the timed loop on the CPU "
                        "(default 100)")
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warmup on CUDA (default 25)")
    parser.add_argument("--error-rows", type=_positive, default=256,
                        help="query rows sampled for the float64 error (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=_positive, default=None,
                        help="torch.set_num_threads for the run (CPU timing; default: torch's)")
    parser.add_argument("--commit", default=None, metavar="SHA",
                        help="git commit to record where the checkout has no usable history (a copied tree)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(func=main)


def _fail(msg: str) -> int:
    print(f"adaattn bench: {msg}", file=sys.stderr)
    return 2


def _wanted(spec: str | None):
    from ..backends import REGISTRY

    if spec is None:
        return None, (lambda name: True)
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    known = [n for n in REGISTRY if n != YARDSTICK] + [TORCH, ADAATTN]
    unknown = [b for b in names if not any(k == b or k.startswith(b + ".") for k in known)]
    if unknown or not names:
        raise ValueError(f"--backends: unknown {', '.join(unknown) or '(empty)'}; known: {', '.join(known)}")
    return names, (lambda name: any(name == b or name.startswith(b + ".") for b in names))


def _gpt_cases(grid: Grid, device: torch.device, args: argparse.Namespace):
    from .workload import gpt_cases

    if getattr(args, "no_progress", False) is False:
        print("bench: capturing q, k, v from the GPT", file=sys.stderr, flush=True)
    return gpt_cases(grid, device, args.weights, args.gpt_layers)


def main(args: argparse.Namespace) -> int:
    """Run `adaattn bench` with parsed arguments; returns the exit code (2 for bad arguments)."""
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
    env = report.environment(device)
    if args.commit:
        env["git_commit"] = args.commit
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    print(f"adaattn bench ({mode}) on {env['device_name']}: torch {env['torch']}, triton {env['triton']}, "
          f"commit {(env['git_commit'] or 'unknown')[:12]}; timing: {timing.method(device)}", flush=True)

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


__all__ = ["Grid", "Settings", "Shape", "add_arguments", "dtype_name", "main", "run_suite"]
