"""`adaattn bench --suite NAME`: build the suite's cases, time every peer, write JSON and PNG, print the table."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import overhead as overhead_mod
from . import report, timing
from .cases import Settings, run_cases
from .peers import HOW
from .plot import write_suite_plot
from .suites import SUITES
from .table import format_suite_table

SCHEMA = "adaattn-bench-suite/1"
METHOD = {
    "spread": "ms_min / ms / ms_max: min, median and max over the timed repetitions of one peer",
    "figure": "work / median time: TFLOP/s (attention forward 4*B*H*Nq*Nk*D, halved when causal, x3.5 with "
    "backward; windows and documents count only the pairs they attend), TB/s (decode: bytes of K and V "
    "read), tokens/s (models)",
    "x_baseline": "the case's baseline median time / this peer's median time (> 1: faster than the baseline)",
    "x_baseline_paired": "the median over timing rounds of baseline time / this peer's time, both taken in the same "
    "round (clock drift between rounds cancels)",
    "rel_error": "||out - ref64|| / ||ref64|| on up to --error-rows query rows sampled evenly, float64 reference",
    "ran": "the runners adaattn.stats recorded for one call of the peer (adaattn rows)",
    "peers": HOW,
}


def device_for(args: argparse.Namespace, needs_cuda: bool, name: str) -> torch.device | str:
    """The device to run on, or a one-line reason why the suite cannot run here."""
    if name == "cpu":
        if args.device not in (None, "cpu"):
            return f"--suite cpu runs on the CPU; drop --device {args.device}"
        return torch.device("cpu")
    wanted = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(wanted)
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--suite {name} needs a CUDA GPU and none is available here (--suite cpu runs on the CPU)"
    if needs_cuda and device.type != "cuda":
        return f"--suite {name} needs a CUDA GPU and none is available here (--suite cpu runs on the CPU)"
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def main_suite(args: argparse.Namespace) -> int:
    """Run one suite; returns 0, 1 where it cannot run on this machine, 2 for bad arguments."""
    suite = SUITES[args.suite]
    device = device_for(args, suite.needs_cuda, suite.name)
    if isinstance(device, str):
        print(f"adaattn bench: {device}", file=sys.stderr)
        return 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        cases = suite.cases(args, device)
    except (ValueError, FileNotFoundError) as e:
        print(f"adaattn bench: --suite {suite.name}: {e}", file=sys.stderr)
        return 2
    env, started = report.start(device, args.commit, f"adaattn bench --suite {suite.name}", timing.interleaved_method(device))
    t0 = time.perf_counter()
    settings = Settings(device, args.warmup_ms, args.rep_ms, progress=not args.no_progress)
    if suite.run is not None:
        rows = suite.run(args, device, settings)
        if rows is None:  # a process that does not report (a rank other than 0)
            return 0
    else:
        rows = run_cases(cases, settings)
    written = suite.finish(args, rows) if suite.finish is not None else []
    summary, summary_text = suite.summarize(rows) if suite.summarize is not None else (None, "")
    ov_rows = []
    if suite.dispatch_overhead and args.overhead != "no":
        ov_rows = overhead_mod.run_overhead(overhead_mod.default_shapes(device.type), device)
    wall_s = time.perf_counter() - t0

    if args.out is not None:
        record = {
            "schema": SCHEMA, "suite": suite.name, "date": started.isoformat(timespec="seconds"), **env,
            "config": {"suite": suite.name, "device": str(device), "argv": sys.argv[1:], "rep_ms": args.rep_ms,
                       "warmup_ms": args.warmup_ms, "error_rows": args.error_rows, "seed": args.seed},
            "method": {"timing": timing.interleaved_method(device), **METHOD,
                       **({"overhead": overhead_mod.HOW} if ov_rows else {})},
            "not_run": settings.not_run, **({"summary": summary} if summary is not None else {}), "rows": rows, "overhead": ov_rows, "wall_s": round(wall_s, 2),
        }
        stem = f"{suite.name}-{report.output_stem(env, started)}"
        print(f"wrote {report.write_json(args.out / f'{stem}.json', record)}")
        title = f"adaattn bench --suite {suite.name}, {env['device_name']}, torch {env['torch']}"
        if suite.plot is not None and summary is not None:
            png = suite.plot(args.out / f"{stem}.png", summary, title)
        else:
            png = write_suite_plot(args.out / f"{stem}.png", rows, title)
        if png is not None:
            print(f"wrote {png}")

    for path in written:
        print(f"wrote {path}")
    for name, why in settings.not_run.items():
        print(f"not run: {name}: {why}")
    if ov_rows:
        print()
        print(report.format_overhead(ov_rows))
    print(f"\n--suite {suite.name}: {len(rows)} rows in {wall_s:.1f} s\n")
    print(format_suite_table(rows))
    if summary_text:
        print(f"\n{summary_text}")
    return 0
