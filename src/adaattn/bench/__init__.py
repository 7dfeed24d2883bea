"""`adaattn bench`: time adaattn against its peers, on this machine, in one run.

    adaattn bench                      # --quick: on a CPU the cpu suite, on a GPU the quick grid
    adaattn bench --suite prefill      # one suite: prefill train decode quant window varlen hf gpt rank cpu
    adaattn bench --full --out DIR     # the grid of every backend at the prefill yardstick
    adaattn bench --seq-lens 1k,4k --causal yes --backends sdpa.cudnn,torch,adaattn
    adaattn bench --workload gpt       # the grid on q, k, v captured from the shipped GPT

A suite prints a table last: per case and peer the min / median / max time over the repetitions,
the figure (TFLOP/s, TB/s or tokens/s), the ratio to the case's named baseline and the error
against float64. `--out` writes the same as JSON, with the versions and git commit, and a PNG
plot where matplotlib imports. The grid table (no --suite) is described in grid_run.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .grid import CAUSAL, Grid, Shape, dtype_name, parse_dtypes, parse_seq_lens
from .suite import Settings, run_suite
from .suites import SUITES
from .suites.gpt import PARTS as GPT_PARTS
from .suites.rank import PARTS as RANK_PARTS
from .workload import WORKLOADS


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


def _floats(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not 0 < v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"tolerances are numbers in (0, 1), got {text!r}")
    return vals


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    allowed = GPT_PARTS + tuple(p for p in RANK_PARTS if p not in GPT_PARTS)
    bad = [p for p in parts if p not in allowed]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"--gpt-parts takes some of {','.join(allowed)}, got {text!r}")
    return parts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `adaattn bench`; sets `func` to the command."""
    parser.add_argument("--suite", choices=tuple(SUITES), default=None,
                        help="run one suite: " + "; ".join(f"{s.name}: {s.help}" for s in SUITES.values()))
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
    w.add_argument("--weights", type=Path, default=None,
                   help="GPT weights for --workload gpt and --suite gpt (default: shipped) and --suite rank (default: "
                   "the 32k checkpoint)")
    w.add_argument("--gpt-layers", default=None, metavar="ends|all|I,J",
                   help="layers to take q, k, v from (default ends: first, middle, last; --suite rank: all)")
    s = parser.add_argument_group("suites (each applies where the suite says)")
    s.add_argument("--tolerances", type=_floats, default=None, metavar="T,T,T",
                   help="mode=auto tolerances of prefill and quant (default 1e-2,3e-2,8e-2) and rank (1e-2,5e-2)")
    s.add_argument("--window-size", type=_positive, default=None,
                   help="window: keys to the left (default 1024 up to N=16k, 4096 above)")
    s.add_argument("--documents", type=_positive, default=None, help="varlen: documents packed (default 8)")
    s.add_argument("--doc-len", type=_positive, default=None, help="varlen: tokens per document (default 8192)")
    s.add_argument("--prompt-len", type=_positive, default=None, help="hf: prompt tokens (default 2048; CPU 128)")
    s.add_argument("--new-tokens", type=_positive, default=None, help="hf: tokens generate() adds (default 64; CPU 8)")
    s.add_argument("--gpt-parts", type=_parts, default=None, metavar="PART,...",
                   help=f"gpt: some of {','.join(GPT_PARTS)} (default all); rank: some of {','.join(RANK_PARTS)} "
                   "(default kernels,heldout)")
    s.add_argument("--decode-parts", choices=("all", "dense", "sparse", "storage"), default="all",
                   help="decode: the dense cases (random K/V), the sparse decode cases on the 32k checkpoint's "
                   "K/V, a storage per KV head on the checkpoint's K/V, or all (default)")
    s.add_argument("--gpt-size", choices=("shipped", "medium"), default=None,
                   help="gpt step: the shipped config, or GPT-2 medium's size (24 layers, d=1024)")
    s.add_argument("--gpt-windows", type=_positive, default=None, help="gpt heldout: windows of 8192 bytes (default 16)")
    s.add_argument("--install", action="store_true",
                   help="calibrate: write the measured costs to this user's cache, where the planner reads them")
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


def main(args: argparse.Namespace) -> int:
    """Run `adaattn bench` with parsed arguments; returns the exit code (2 for bad arguments).

    --suite NAME runs that suite; without it, --quick (the default) on a machine without CUDA runs
    the cpu suite, and every other form the grid table of every backend.
    """
    if args.suite is None and _quick_on_cpu(args):
        args.suite = "cpu"
    if args.suite is not None:
        from .command import main_suite

        return main_suite(args)
    from .grid_run import main_grid

    return main_grid(args)


def _quick_on_cpu(args: argparse.Namespace) -> bool:
    grid_given = any(getattr(args, k, None) is not None for k in ("seq_lens", "batch", "heads", "kv_heads",
                                                                   "head_dim", "dtype", "causal"))
    on_cpu = args.device == "cpu" or (args.device is None and not torch.cuda.is_available())
    plain = (not args.full and not grid_given and args.workload == "random" and args.backends is None
             and args.overhead != "only" and not args.backward)
    return on_cpu and plain


__all__ = ["Grid", "SUITES", "Settings", "Shape", "add_arguments", "dtype_name", "main", "run_suite"]
