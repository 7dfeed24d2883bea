"""`adaattn info | explain | bench | eval`, and `adaattn --version`."""

from __future__ import annotations

import argparse
import json
import sys

import torch

DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def _ints(text: str, count: int | None = None) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.replace("x", ",").split(",") if x != "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if count is not None and len(vals) != count:
        raise argparse.ArgumentTypeError(f"expected {count} comma-separated integers, got {text!r}")
    return vals


def _window(text: str) -> tuple[int | None, int | None]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"--window takes LEFT,RIGHT (use - for unbounded), got {text!r}")
    try:
        left, right = (None if p.strip() in ("", "-", "none") else int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window takes LEFT,RIGHT integers, got {text!r}") from None
    return left, right


def cmd_info(args: argparse.Namespace) -> int:
    from .api import info
    from .hardware import format_report

    rep = info()
    print(json.dumps(rep, indent=2, default=str) if args.json else format_report(rep))
    return 0


def _explain_decode(args, dev, b, h, n, d, kv_heads, policy) -> int:
    """`explain --decode`: B sequences holding N tokens each, H query heads of --query-len rows."""
    from .kv import KVCache, PagedKVCache
    from .planner import explain_decode

    t = args.query_len
    try:  # facts only: the cache lives on the meta device, its lengths are given
        if args.cache == "kv":
            cache = KVCache(1, b, kv_heads, n + t, d, dtype=DTYPES[args.dtype], device="meta", storage=args.storage,
                            page_size=args.page_size, summaries=args.summaries)
            seqs = None
        else:
            pages = b * -(-(n + t) // args.page_size)
            cache = PagedKVCache(1, kv_heads, d, pages, args.page_size, dtype=DTYPES[args.dtype], device="meta",
                                 storage=args.storage, max_seqs=b, summaries=args.summaries,
                                 max_pages_per_seq=-(-(n + t) // args.page_size))
            seqs = [cache.add() for _ in range(b)]
        choice = explain_decode(cache, seqs, heads=h, query_len=t, policy=policy, lengths=[n] * b, device=dev.type)
    except (TypeError, ValueError) as e:
        print(f"adaattn explain: {e}", file=sys.stderr)
        return 2
    print(json.dumps(choice.as_dict(), indent=2) if args.json else choice)
    return 0


def _explain_ring(args, dev, b, h, n, d, kv_heads, policy) -> int:
    """`explain --ring`: one rank's block of ring_attention, shards of N tokens (the block runners)."""
    from .distributed import explain_ring_block

    dtype = DTYPES[args.dtype]
    # Facts only: one row per shard, expanded to N (no N-long allocation).
    q = torch.empty(b, h, 1, d, dtype=dtype, device=dev).expand(b, h, n, d)
    k = torch.empty(b, kv_heads, 1, d, dtype=dtype, device=dev).expand(b, kv_heads, n, d)
    try:
        choice = explain_ring_block(q, k, k, causal=args.causal, kernel=args.kernel, policy=policy)
    except (TypeError, ValueError) as e:
        print(f"adaattn explain: {e}", file=sys.stderr)
        return 2
    print(json.dumps(choice.as_dict(), indent=2) if args.json else choice)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from .api import explain_problem
    from .policy import Policy
    from .problem import Problem, check_window, default_scale, window_sides

    b, h, n, d = args.shape
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "meta"):
        print(f"adaattn explain: --device must be cpu, cuda, cuda:N or meta, got {device!r}", file=sys.stderr)
        return 2
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("adaattn explain: --device cuda given but no CUDA device is available", file=sys.stderr)
        return 2
    kv_heads = h if args.kv_heads is None else args.kv_heads
    if min(b, h, n, d) <= 0 or kv_heads <= 0 or (args.kv_len is not None and args.kv_len < 0):
        print("adaattn explain: --shape values and --kv-heads must be positive, --kv-len non-negative", file=sys.stderr)
        return 2
    if h % kv_heads:
        print(f"adaattn explain: heads ({h}) must be a multiple of --kv-heads ({kv_heads})", file=sys.stderr)
        return 2
    try:
        # Options not given take Policy's own defaults (mode="auto" alone: every precision and
        # approximation, policy.mode_defaults), so the CLI and the library agree.
        given = {"tolerance": args.tolerance,
                 "precisions": tuple(args.precisions.split(",")) if args.precisions else None,
                 "approximations": tuple(a for a in args.approximations.split(",") if a)
                 if args.approximations is not None else None,
                 "backends": tuple(args.backends.split(",")) if args.backends else None}
        policy = Policy(mode=args.mode, **{k: v for k, v in given.items() if v is not None})
    except (TypeError, ValueError) as e:
        print(f"adaattn explain: {e}", file=sys.stderr)
        return 2
    if args.decode and args.ring:
        print("adaattn explain: --decode and --ring are two kinds of call; give one", file=sys.stderr)
        return 2
    if args.decode:
        return _explain_decode(args, dev, b, h, n, d, kv_heads, policy)
    if args.ring:
        return _explain_ring(args, dev, b, h, n, d, kv_heads, policy)
    try:
        left, right = window_sides(check_window(args.window))
    except ValueError as e:
        print(f"adaattn explain: {e}", file=sys.stderr)
        return 2
    problem = Problem(
        batch=b, q_heads=h, kv_heads=kv_heads, q_len=n, kv_len=n if args.kv_len is None else args.kv_len, head_dim=d,
        value_dim=d, dtype=DTYPES[args.dtype], device_type=dev.type,
        device_index=(dev.index or 0) if dev.type == "cuda" else None, causal=args.causal,
        window_left=left, window_right=right, mask_kind=args.mask, dropout_p=0.0, scale=default_scale(d),
        needs_grad=args.grad, layout="bhsd", gqa=kv_heads != h, mask_dtype=None if args.mask != "additive"
        else DTYPES[args.dtype], tma_aligned=True,
    )
    exp = explain_problem(problem, policy)
    print(json.dumps(exp.as_dict(), indent=2) if args.json else exp)
    return 0 if exp.chosen else 1


def build_parser() -> argparse.ArgumentParser:
    from .bench import add_arguments as bench_arguments

    from .policy import Policy, mode_defaults
    from .version import __version__

    p = argparse.ArgumentParser(prog="adaattn", description="adaattn: adaptive attention for PyTorch")
    p.add_argument("--version", action="version", version=f"adaattn {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    pi = sub.add_parser("info", help="versions, devices, tensor-core precisions and available backends")
    pi.add_argument("--json", action="store_true", help="print JSON instead of text")
    pi.set_defaults(func=cmd_info)

    pe = sub.add_parser("explain", help="which backend a call of this shape runs, and why the others decline")
    pe.add_argument("--shape", type=lambda s: _ints(s, 4), required=True, metavar="B,H,N,D",
                    help="batch, query heads, query length, head dim")
    pe.add_argument("--kv-len", type=int, default=None, help="key/value length (default: N)")
    pe.add_argument("--kv-heads", type=int, default=None, help="key/value heads for GQA (default: H)")
    pe.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    pe.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if available)")
    pe.add_argument("--causal", action="store_true")
    pe.add_argument("--window", type=_window, default=None, metavar="LEFT,RIGHT")
    pe.add_argument("--mask", choices=("none", "bool", "additive"), default="none")
    pe.add_argument("--grad", action="store_true", help="inputs require grad (training)")
    pe.add_argument("--mode", choices=("exact", "auto"), default="exact")
    auto = mode_defaults("auto")
    pe.add_argument("--tolerance", type=float, default=None,
                    help=f"Policy.tolerance (mode auto), in (0, 1); default {Policy.tolerance:g}")
    pe.add_argument("--precisions", default=None,
                    help="comma-separated Policy.precisions; mode auto naming neither list allows every "
                         f"precision ({','.join(auto[0])}) and approximation ({','.join(auto[1])})")
    pe.add_argument("--approximations", default=None,
                    help="comma-separated Policy.approximations ('' for none); see --precisions")
    pe.add_argument("--backends", default=None, help="comma-separated Policy.backends restriction")
    pe.add_argument("--decode", action="store_true",
                    help="a decode step: B sequences holding N cached tokens each, H query heads (the decode runners)")
    pe.add_argument("--query-len", type=int, default=1, help="--decode: query rows per sequence (default 1)")
    pe.add_argument("--cache", choices=("kv", "paged"), default="kv", help="--decode: KVCache or PagedKVCache")
    pe.add_argument("--storage", choices=("native", "fp8", "int8", "int4"), default="native", help="--decode: page storage")
    pe.add_argument("--page-size", type=int, default=64, help="--decode: tokens per page")
    pe.add_argument("--summaries", action="store_true", help="--decode: the cache keeps page summaries")
    pe.add_argument("--ring", action="store_true",
                    help="a block of ring_attention: one rank's shards of N tokens (the ring's block runners)")
    pe.add_argument("--kernel", choices=("auto", "torch", "triton", "cudnn"), default="auto",
                    help="--ring: the block kernel asked for (ring_attention's kernel=)")
    pe.add_argument("--json", action="store_true")
    pe.set_defaults(func=cmd_explain)

    pb = sub.add_parser("bench", help="benchmark suites (--suite NAME): each times adaattn against its peers in one run")
    bench_arguments(pb)

    from .models.evaluate import add_arguments as eval_arguments

    pv = sub.add_parser("eval", help="held-out bits per byte of the shipped GPT and a policy's error on its attention")
    eval_arguments(pv)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
