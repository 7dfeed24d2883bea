"""`adaattn eval`: held-out bits per byte of the shipped GPT, and what a policy does to its attention.

    adaattn eval                                   # shipped weights, context 8192, exact policy
    adaattn eval --context 1024 --device cpu       # a quick look on the CPU
    adaattn eval --mode auto --precisions int8,fp8 --approximations lowrank,skip --tolerance 1e-2
    adaattn eval --kv-cache fp8,int8 --no-structure # also through adaattn KV caches, 16 bytes a step

Prints, for this machine's held-out stdlib bytes: the unigram baseline and the model's bits per
byte at the context length with the policy; per layer, the relative L2 error of the policy's
attention output against float64 exact attention on captured Q/K/V (torch SDPA's error in the
same dtype beside it); with --kv-cache, the bits per byte again with every byte
predicted through an adaattn KV cache of that storage (decode_attention, --kv-chunk bytes per
step); and per layer and head the attention entropy in bits (with what a
uniform causal head would have) and the mean attention distance. `--json` and `--plot` write
the same as data and a picture of a few heads.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..problem import default_scale
from ..api import attention
from ..backends import reference as accuracy
from ..kv.cache import STORAGES
from ..policy import PRECISIONS, APPROXIMATIONS, Policy
from .capture import Capture, _autocast, capture, default_dtype
from .data import load_corpus, unigram_bits_per_byte, windows
from .gpt import GPT
from .pretrained import DEFAULT_WEIGHTS, load

# Bytes of float32 scores one entropy chunk may hold (a few copies are made).
ENTROPY_CHUNK_BYTES = 128 * 2**20


@torch.no_grad()
def score_windows(model: GPT, wins: torch.Tensor, batch: int = 8, dtype: torch.dtype | None = None, *,
                  kv_cache: str | None = None, chunk: int = 16) -> dict:
    """Mean next-byte cross-entropy in bits of `model` on (W, N + 1) int64 windows.

    Each window's bytes 1..N are predicted from the bytes before them in that window: in one
    forward, or with kv_cache ("native", "fp8", "int8") through an adaattn KV cache of that storage,
    `chunk` bytes at a time, each chunk appended to the cache (quantized there; the first chunk sets
    the keys' center) and attending over all the cache holds (decode_attention, bottom-right causal).
    Returns {"bits_per_byte", "windows", "bytes", "seq_len"} (and "storage", "chunk" with kv_cache).
    """
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    device = next(model.parameters()).device
    dtype = dtype or default_dtype(device)
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    n = wins.shape[1] - 1
    try:
        for i in range(0, len(wins), batch):
            part = wins[i:i + batch].to(device)
            inputs, targets = part[:, :-1], part[:, 1:]
            cache = None if kv_cache is None else model.make_cache(len(part), n, storage=kv_cache, dtype=dtype,
                                                                      device=device)
            with _autocast(device, dtype):
                step = n if cache is None else chunk
                for j0 in range(0, n, step):
                    j1 = min(n, j0 + step)
                    logits, _ = model(inputs[:, j0:j1], cache=cache, through_cache=cache is not None)
                    total += F.cross_entropy(logits.float().flatten(0, 1), targets[:, j0:j1].flatten(),
                                             reduction="sum").double()
            count += targets.numel()
    finally:
        model.train(was_training)
    result = {"bits_per_byte": float(total) / max(count, 1) / math.log(2), "windows": len(wins),
              "bytes": count, "seq_len": n}
    return result if kv_cache is None else {**result, "storage": kv_cache, "chunk": chunk}


def heldout_windows(seq_len: int, max_windows: int | None = None, data: torch.Tensor | None = None) -> torch.Tensor:
    """Non-overlapping (W, seq_len + 1) windows of held-out bytes (default: this machine's stdlib);
    with `max_windows`, that many spread evenly over the text."""
    data = load_corpus().heldout if data is None else data
    wins = windows(data, seq_len)
    if max_windows is not None and max_windows < len(wins):
        wins = wins[torch.linspace(0, len(wins) - 1, max_windows).round().long().unique()]
    return wins


def heldout_bits_per_byte(model: GPT, seq_len: int, *, batch: int = 8, max_windows: int | None = None,
                          dtype: torch.dtype | None = None) -> dict:
    """score_windows on held-out windows of `seq_len` (all of them, or `max_windows` spread out)."""
    return score_windows(model, heldout_windows(seq_len, max_windows), batch, dtype)


def uniform_entropy_bits(n: int) -> float:
    """Mean over causal rows i = 0..n-1 of log2(i + 1): the entropy of a head that attends uniformly."""
    return float(torch.log2(torch.arange(1, n + 1, dtype=torch.float64)).mean())


def _row_chunk(heads: int, n: int) -> int:
    return max(1, min(n, ENTROPY_CHUNK_BYTES // max(1, heads * n * 4 * 3)))


def _probabilities(q: torch.Tensor, k: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Causal softmax rows r0..r1 of all heads of one sequence: q (Hq, N, D), k (Hq, N, D) -> (Hq, r1-r0, N) float32."""
    n = k.shape[1]
    s = (q[:, r0:r1].float() @ k.float().transpose(1, 2)) * default_scale(q.shape[-1])
    cols = torch.arange(n, device=q.device)
    rows = torch.arange(r0, r1, device=q.device)
    s = s.masked_fill(cols[None, None, :] > rows[None, :, None], float("-inf"))
    return torch.softmax(s, dim=-1)


@torch.no_grad()
def attention_structure(cap: Capture) -> dict:
    """Per layer and head, averaged over every query row of every sequence in the capture.

    entropy_bits[l][h]: -sum_j p_ij log2 p_ij of the causal attention row (0 for a head that
    puts all weight on one key; uniform_entropy_bits(N) for one that spreads evenly).
    mean_distance[l][h]: sum_j p_ij (i - j), in tokens (bytes).
    max_weight[l][h]: the row's largest weight.
    """
    entropy, distance, peak = [], [], []
    for lc in cap.layers:
        b, hq, n, _ = lc.q.shape
        group = hq // lc.k.shape[1]
        ent = torch.zeros(hq, dtype=torch.float64, device=lc.q.device)
        dist = torch.zeros_like(ent)
        top = torch.zeros_like(ent)
        step = _row_chunk(hq, n)
        cols = torch.arange(n, device=lc.q.device, dtype=torch.float32)
        for bi in range(b):
            k = lc.k[bi].repeat_interleave(group, dim=0)
            for r0 in range(0, n, step):
                r1 = min(n, r0 + step)
                p = _probabilities(lc.q[bi], k, r0, r1)
                ent += torch.special.entr(p).sum(-1).sum(-1).double()
                rows = torch.arange(r0, r1, device=p.device, dtype=torch.float32)
                dist += (rows[None, :] - p @ cols).sum(-1).double()
                top += p.amax(-1).sum(-1).double()
        rows_total = b * n
        entropy.append((ent / rows_total / math.log(2)).tolist())
        distance.append((dist / rows_total).tolist())
        peak.append((top / rows_total).tolist())
    n = cap.layers[0].q.shape[2] if cap.layers else 0
    return {"seq_len": n, "entropy_bits": entropy, "mean_distance": distance, "max_weight": peak,
            "uniform_entropy_bits": uniform_entropy_bits(n) if n else None}


def policy_errors(cap: Capture, policy: Policy | None, error_rows: int = 512) -> list[dict]:
    """Per layer: relative L2 error against float64 exact attention on sampled query rows.

    'policy': adaattn.attention with `policy` on the captured q, k, v; 'sdpa': torch SDPA in the
    same dtype (the yardstick of MEASURING.md); 'model': the output the model's forward made.
    'policy_per_head' lists the policy's error for each query head.
    """
    out = []
    for lc in cap.layers:
        n = lc.q.shape[2]
        rows = accuracy.sample_rows(n, error_rows)
        ref = accuracy.sampled_reference(lc.q, lc.k, lc.v, rows, causal=True)
        with torch.no_grad():
            ours = attention(lc.q, lc.k, lc.v, is_causal=True, enable_gqa=lc.gqa, policy=policy,
                             label=f"layer{lc.layer}")
            peer = F.scaled_dot_product_attention(lc.q, lc.k, lc.v, is_causal=True, enable_gqa=lc.gqa)
        per_head = accuracy.relative_errors(ours.index_select(2, rows.to(ours.device)), ref, (0, 2, 3))
        out.append({
            "layer": lc.layer,
            "policy": accuracy.relative_error(ours, ref, rows),
            "sdpa": accuracy.relative_error(peer, ref, rows),
            "model": accuracy.relative_error(lc.out, ref, rows),
            "policy_per_head": per_head.tolist(),
            "error_rows": len(rows),
        })
    return out


def format_errors(errors: list[dict]) -> str:
    head = f"{'layer':>5} {'policy':>9} {'sdpa':>9} {'model':>9}  worst head"
    lines = [head, "-" * len(head)]
    for e in errors:
        ph = e["policy_per_head"]
        worst = max(range(len(ph)), key=ph.__getitem__)
        lines.append(f"{e['layer']:>5} {e['policy']:>9.2e} {e['sdpa']:>9.2e} {e['model']:>9.2e}  "
                     f"h{worst} {ph[worst]:.2e}")
    return "\n".join(lines)


def format_structure(structure: dict) -> str:
    ent = structure["entropy_bits"]
    heads = len(ent[0]) if ent else 0
    lines = [f"attention entropy in bits per layer and head at N={structure['seq_len']} "
             f"(uniform causal head: {structure['uniform_entropy_bits']:.2f}; one-hot: 0); "
             "mean attention distance in bytes after '/'"]
    lines.append(f"{'layer':>5} " + " ".join(f"{'h' + str(h):>12}" for h in range(heads)))
    for i, (row, dist) in enumerate(zip(ent, structure["mean_distance"])):
        lines.append(f"{i:>5} " + " ".join(f"{e:>5.2f}/{d:<6.0f}" for e, d in zip(row, dist)))
    return "\n".join(lines)


def choose_heads(entropy: list[list[float]], count: int = 4) -> list[tuple[int, int]]:
    """(layer, head) pairs spread over the entropy range: the lowest, the highest and between."""
    flat = sorted((e, l, h) for l, row in enumerate(entropy) for h, e in enumerate(row))
    if not flat:
        return []
    idx = sorted({round(i * (len(flat) - 1) / max(1, count - 1)) for i in range(count)})
    return [(flat[i][1], flat[i][2]) for i in idx]


@torch.no_grad()
def pooled_map(q: torch.Tensor, k: torch.Tensor, size: int = 256) -> torch.Tensor:
    """One head's causal attention (q, k: (N, D)) averaged into a (size, size) grid of blocks."""
    n = q.shape[0]
    block = math.ceil(n / size)
    pad = block * size - n
    grid = torch.zeros(size, size, dtype=torch.float64, device=q.device)
    step = max(block, (_row_chunk(1, n) // block) * block)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        p = _probabilities(q[None], k[None], r0, r1)[0]
        p = F.pad(p, (0, pad)).view(r1 - r0, size, block).sum(-1)  # mass per key block
        rows = torch.arange(r0, r1, device=q.device) // block
        grid.index_add_(0, rows, p.double())
    counts = torch.bincount(torch.arange(n, device=q.device) // block, minlength=size).clamp_min(1)
    return (grid / counts[:, None]).float().cpu()


def plot_heads(cap: Capture, structure: dict, path: Path, count: int = 4, zoom: int = 256) -> Path | None:
    """A figure of `count` heads: the whole causal map pooled into blocks, and a zoom on raw weights."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("adaattn eval: matplotlib is not installed; skipping the plot", file=sys.stderr)
        return None
    picks = choose_heads(structure["entropy_bits"], count)
    n = structure["seq_len"]
    fig, axes = plt.subplots(2, len(picks), figsize=(4 * len(picks), 8), squeeze=False)
    z0 = max(0, n // 2 - zoom // 2)
    z1 = min(n, z0 + zoom)
    for col, (layer, head) in enumerate(picks):
        lc = cap.layers[layer]
        kh = head // (lc.q.shape[1] // lc.k.shape[1])
        q, k = lc.q[0, head], lc.k[0, kh]
        grid = pooled_map(q, k)
        ax = axes[0][col]
        ax.imshow(torch.log10(grid.clamp_min(1e-9)).numpy(), cmap="magma", vmin=-7, vmax=0,
                  extent=(0, n, n, 0), interpolation="nearest")
        ent = structure["entropy_bits"][layer][head]
        ax.set_title(f"layer {layer} head {head}: entropy {ent:.2f} bits\n"
                     f"mean distance {structure['mean_distance'][layer][head]:.0f}", fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        raw = _probabilities(q[None], k[None], z0, z1)[0][:, z0:z1].float().cpu()
        ax = axes[1][col]
        ax.imshow(torch.log10(raw.clamp_min(1e-9)).numpy(), cmap="magma", vmin=-6, vmax=0,
                  extent=(z0, z1, z1, z0), interpolation="nearest")
        ax.set_title(f"zoom: queries and keys {z0}..{z1}", fontsize=9)
        ax.set_xlabel("key position")
    fig.suptitle(f"causal attention of a held-out stdlib window, N={n} "
                 f"(log10 weight; top: mean over {math.ceil(n / 256)}x{math.ceil(n / 256)} blocks)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _sync(model: GPT) -> None:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def evaluate(
    model: GPT,
    context: int,
    policy: Policy | None = None,
    *,
    batch: int = 8,
    max_windows: int | None = None,
    structure: bool = True,
    error_rows: int = 512,
    plot: Path | None = None,
    kv_caches: tuple[str, ...] = (),
    kv_chunk: int = 16,
    repeat: int = 1,
    log=print,
) -> dict:
    """Everything `adaattn eval` reports, as a dict (see the module docstring). repeat: score the
    held-out text this many times (the same call sites each time) and record each pass's wall
    time in result["heldout"]["passes_s"]: the first pays compiles and each call site's first-call
    work, the later ones are the warm cost."""
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be a positive int, got {repeat!r}")
    corpus = load_corpus()
    result: dict = {"context": context, "policy": repr(policy), "corpus": corpus.info,
                    "unigram_bits_per_byte": unigram_bits_per_byte(corpus.train, corpus.heldout)}
    model.set_attention("adaattn", policy)
    passes = []
    for _ in range(repeat):
        _sync(model)
        t0 = time.perf_counter()
        result["heldout"] = heldout_bits_per_byte(model, context, batch=batch, max_windows=max_windows)
        _sync(model)
        passes.append(time.perf_counter() - t0)
    result["heldout"]["passes_s"] = passes
    log(f"held-out bits per byte at context {context}: {result['heldout']['bits_per_byte']:.4f} "
        f"({result['heldout']['windows']} windows, {result['heldout']['bytes']} bytes, "
        f"{', '.join(f'{t:.3f}' for t in passes)} s); unigram baseline {result['unigram_bits_per_byte']:.4f}")
    exact = result["heldout"]["bits_per_byte"]
    wins = heldout_windows(context, max_windows) if kv_caches else None
    for storage in kv_caches:
        t0 = time.perf_counter()
        r = score_windows(model, wins, batch, kv_cache=storage, chunk=kv_chunk)
        r["relative_to_forward"] = r["bits_per_byte"] / exact - 1
        result.setdefault("kv_cache", {})[storage] = r
        log(f"through an adaattn KV cache ({storage}, {kv_chunk} bytes a step): {r['bits_per_byte']:.4f} bits per byte "
            f"({100 * r['relative_to_forward']:+.3f}% against the forward; {time.perf_counter() - t0:.1f} s)")
    cap = capture(model, seq_len=context, batch=1)
    model.set_attention("adaattn", policy)
    result["errors"] = policy_errors(cap, policy, error_rows)
    log(f"\nper-layer relative L2 error against float64 exact attention, captured Q/K/V at N={context} "
        f"({result['errors'][0]['error_rows'] if result['errors'] else 0} sampled query rows; "
        "policy = adaattn.attention with the policy, sdpa = torch in the same dtype, model = the forward's own)")
    log(format_errors(result["errors"]))
    if structure:
        result["structure"] = attention_structure(cap)
        log("")
        log(format_structure(result["structure"]))
        if plot is not None:
            png = plot_heads(cap, result["structure"], Path(plot))
            if png is not None:
                result["plot"] = str(png)
                log(f"wrote {png}")
    return result


def _names(allowed):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in names if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"expected names from {allowed}, got {', '.join(bad)}")
        return names

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `adaattn eval`; sets `func` to the command."""
    parser.add_argument("--weights", type=Path, default=None,
                        help=f"weights file (default: the shipped {DEFAULT_WEIGHTS.name})")
    parser.add_argument("--context", type=int, default=8192, help="context length N (default 8192)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if available)")
    parser.add_argument("--batch", type=int, default=8, help="windows per forward (default 8)")
    parser.add_argument("--max-windows", type=int, default=None,
                        help="held-out windows to score, spread over the text (default: all on CUDA, 2 on the CPU)")
    parser.add_argument("--mode", choices=("exact", "auto"), default="exact")
    # Not given: Policy's own defaults (--mode auto naming neither list allows every precision and
    # approximation), as `adaattn explain` and adaattn.Policy.
    parser.add_argument("--tolerance", type=float, default=None, help=f"in (0, 1); default {Policy.tolerance:g}")
    parser.add_argument("--precisions", type=_names(PRECISIONS), default=None, metavar="NAME,...")
    parser.add_argument("--approximations", type=_names(APPROXIMATIONS), default=None, metavar="NAME,...")
    parser.add_argument("--backends", default=None, metavar="NAME,...", help="Policy.backends restriction")
    parser.add_argument("--kv-cache", type=_names(STORAGES), default=(), metavar="STORAGE,...",
                        help="also score through adaattn KV caches of these storages (native, fp8, int8)")
    parser.add_argument("--kv-chunk", type=int, default=16, help="bytes per step through the KV cache (default 16)")
    parser.add_argument("--error-rows", type=int, default=512, help="query rows sampled for the float64 error")
    parser.add_argument("--no-structure", action="store_true", help="skip the entropy table")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG", help="write a picture of a few heads")
    parser.add_argument("--repeat", type=int, default=1,
                        help="score the held-out text this many times and print each pass's wall time (the first "
                             "pays compiles and first calls; default 1)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the results as JSON")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run `adaattn eval`; returns the exit code (2 for bad arguments or a missing weights file)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("adaattn eval: --device cuda given but no CUDA device is available", file=sys.stderr)
        return 2
    if args.context < 2:
        print(f"adaattn eval: --context must be at least 2, got {args.context}", file=sys.stderr)
        return 2
    if args.kv_chunk < 1:
        print(f"adaattn eval: --kv-chunk must be at least 1, got {args.kv_chunk}", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print(f"adaattn eval: --repeat must be at least 1, got {args.repeat}", file=sys.stderr)
        return 2
    try:
        given = {"tolerance": args.tolerance, "precisions": args.precisions, "approximations": args.approximations,
                 "backends": tuple(args.backends.split(",")) if args.backends else None}
        policy = Policy(mode=args.mode, **{k: v for k, v in given.items() if v is not None})
    except (TypeError, ValueError) as e:
        print(f"adaattn eval: {e}", file=sys.stderr)
        return 2
    try:
        model = load(args.weights, device)
    except (FileNotFoundError, ValueError) as e:
        print(f"adaattn eval: {e}", file=sys.stderr)
        return 2
    max_windows = args.max_windows
    if max_windows is None and device.type == "cpu":
        max_windows = 2
    meta = model.meta
    print(f"adaattn eval: {args.weights or DEFAULT_WEIGHTS} ({model.num_params() / 1e6:.1f}M parameters, "
          f"stored {meta.get('storage')}, trained on Python {meta.get('corpus', {}).get('python', '?')} stdlib) "
          f"on {device}, policy {policy}")
    result = evaluate(model, args.context, policy, batch=args.batch, max_windows=max_windows,
                      structure=not args.no_structure, error_rows=args.error_rows, plot=args.plot,
                      kv_caches=args.kv_cache, kv_chunk=args.kv_chunk, repeat=args.repeat)
    result["weights"] = str(args.weights or DEFAULT_WEIGHTS)
    result["weights_meta"] = meta
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`python3 -m adaattn.models.evaluate ...`, the same as `adaattn eval ...`."""
    parser = argparse.ArgumentParser(prog="adaattn eval", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(cli())
