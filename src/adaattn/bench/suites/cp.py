"""cp: context parallelism across the GPUs of one host, launched by torchrun, against ideal scaling
and torch's context_parallel.

    torchrun --standalone --nproc-per-node 8 -m adaattn bench --suite cp --out benchmarks/results

(`benchmarks/cp.sh` is that command.) Every rank runs this module in lock step: each timed call is
preceded by a barrier, timed by the wall clock around a synchronised call, and the slowest rank's
time is the sample (ranks agree on every count, so collectives always pair). Without torchrun the
suite runs as a process group of one (NCCL on a GPU, gloo on a CPU): the dry run the launcher is
checked with.

Per total length N (the sequence the ranks share, zigzag-sharded as `adaattn.distributed.shard`
lays it out) and per pass (forward; forward and backward):
- "ideal": one shard's work on one GPU: adaattn.attention on the whole sequence for 1/world of
  the heads (Hq/world query heads, Hkv/world KV heads: the same kernel, lengths and GQA groups at
  1/world of the work and memory), or, where Hkv does not split evenly, on all heads divided by
  the world size (every rank runs it on its own GPU at once, and the slowest counts);
- "adaattn.distributed": ring_attention on the rank's shard;
- "torch cp allgather" / "torch cp alltoall": F.scaled_dot_product_attention inside torch's
  `context_parallel` (its load-balanced shards are the zigzag shards), with each of its K/V
  rotate methods; GQA is passed as enable_gqa where torch's ring takes it, else as K/V repeated
  to the query heads (the row says which);
- at world size 1 also "adaattn.distributed blocks" (kernel="triton"): the per-block path every
  rank of a real ring runs, which a world of one would otherwise skip.

The outputs of the distributed rows are gathered and checked on sampled rows against float64, to
MEASURING.md's standard (relative error <= 2 x that of torch's SDPA on the same rows + 1e-6).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...backends.reference import relative_error, sample_rows, sampled_reference
from ..dense import describe, random_qkv
from ..grid import Grid, dtype_name
from . import options
from .cp_peer import _init, _agree_all, _time, _torch_cp

NAME = "cp"
HELP = ("context parallelism under torchrun (benchmarks/cp.sh; without torchrun: a world of one), causal GQA "
        "bf16 Hq=32 Hkv=8 D=128 at total lengths 128k/512k/1M as memory allows: adaattn.distributed vs ideal "
        "scaling (one shard's work on one GPU: adaattn.attention on 1/world of the heads) and torch's "
        "context_parallel over SDPA")
NEEDS_CUDA = False
DEFAULT = Grid((131072, 524288, 1048576), batch=1, heads=32, kv_heads=8, head_dim=128, dtypes=(torch.bfloat16,),
               causal="yes")
CPU_DEFAULT = Grid((256,), batch=1, heads=4, kv_heads=2, head_dim=16, dtypes=(torch.float32,), causal="yes")
IDEAL, OURS, TRITON, BLOCKS = ("ideal", "adaattn.distributed", "adaattn.distributed triton",
                               "adaattn.distributed blocks")
ROTATE = ("allgather", "alltoall")
MEMORY_SHARE = 0.85  # a length runs where its estimated bytes fit in this share of the device's memory
HOW = {
    "launch": "torchrun --standalone --nproc-per-node W -m adaattn bench --suite cp (benchmarks/cp.sh); one "
    "process per GPU, each holding the whole random sequence once to shard it",
    "timing": "per sample: a barrier, then the wall clock around one synchronised call on every rank; the "
    "sample is the slowest rank's time (all_reduce MAX); median of the samples; each peer's samples taken "
    "together after one warm-up call, peers in turn (ideal, ours, torch); counts agreed across ranks",
    IDEAL: "one shard's work on one GPU: adaattn.attention on the whole sequence for Hq/W query and Hkv/W KV heads "
    "(where Hkv splits over the W ranks; else all heads, divided by W); every rank on its own GPU at once, the "
    "slowest counts",
    OURS: "adaattn.distributed.ring_attention(q, k, v, is_causal=True, enable_gqa=True) on the rank's zigzag "
    "shard (kernel auto: cuDNN's fused kernel for the full and square causal blocks where the planner runs cuDNN "
    "for a call of the shard's shape, our Triton kernels for the rest)",
    TRITON: "the same with kernel='triton' (world size > 1): every block through our Triton kernels",
    BLOCKS: "the same with kernel='triton' (world size 1 only: the block path a real ring runs)",
    "torch cp ROTATE": "F.scaled_dot_product_attention(q, k, v, is_causal=True) inside torch.distributed.tensor."
    "experimental.context_parallel(mesh, buffers=[q, k, v, dout]) with set_rotate_method(ROTATE), torch's "
    "choice of SDPA kernel",
    "error": "outputs gathered to rank 0; relative error against float64 on sampled rows (128 where N > 256k); "
    "passes if <= 2 x torch SDPA's own error on those rows + 1e-6",
}


# ----------------------------------------------------------------------------- process group


def cases(args, device):
    """Not timed by the common harness (its counts are per process): see run()."""
    return []


def _grid(args, device) -> Grid:
    return options.grid(args, DEFAULT if device.type == "cuda" else CPU_DEFAULT)


def _estimate_bytes(n: int, grid: Grid, world: int, elem: int) -> int:
    """The most a rank holds at once: the whole sequence's q, k, v and dout (made to shard it), and
    a torch context_parallel call (the largest peer): its copies of them, the K/V it gathers, and
    float32 gradient accumulators of its shard. (Where torch's ring refuses enable_gqa it repeats
    K/V to the query heads and may not fit; that row then says why it did not run.)"""
    kv = grid.kv_heads or grid.heads
    d = grid.head_dim
    inputs = n * d * elem * (2 * grid.heads + 2 * kv)
    peer = inputs + n * d * elem * 2 * kv + (n // max(world, 1)) * d * 4 * 2 * (grid.heads + 2 * kv)
    return inputs + peer


def _fits(n: int, grid: Grid, world: int, elem: int, device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return True, ""
    total = torch.cuda.get_device_properties(device).total_memory
    need = _estimate_bytes(n, grid, world, elem)
    ok = _agree_all(need <= MEMORY_SHARE * total, device)
    return ok, "" if ok else (f"needs about {need / 2**30:.0f} GiB a rank, over {MEMORY_SHARE:.0%} of the "
                              f"{total / 2**30:.0f} GiB of some rank's GPU")


def run(args, device, settings) -> list[dict] | None:
    """Time every peer at every length; returns the rows on rank 0 and None on the other ranks."""
    from ...api import attention
    from ... import distributed as cp

    device = _init(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    grid = _grid(args, device)
    kv_heads = grid.kv_heads or grid.heads
    gqa = kv_heads != grid.heads
    rows: list[dict] = []
    for dtype in grid.dtypes:
        elem = torch.empty((), dtype=dtype).element_size()
        for i, n in enumerate(grid.seq_lens):
            parts = 2 * world if world > 1 else 1
            label = describe(grid.batch, grid.heads, kv_heads, grid.head_dim, dtype)
            base = {"seq_len": n, "batch": grid.batch, "heads": grid.heads, "kv_heads": kv_heads,
                    "head_dim": grid.head_dim, "dtype": dtype_name(dtype), "causal": True, "world_size": world}
            ok, why = _fits(n, grid, world, elem, device)
            if n % parts:
                ok, why = False, f"N={n} is not a multiple of {parts} (zigzag over {world} ranks)"
            if not ok:
                for what in ("fwd", "fwd+bwd"):
                    rows.append(_row(base, what, label, n, IDEAL, None, world, note=why))
                continue
            seed = options.seed(args) + i

            def make(seed=seed, dtype=dtype, n=n):
                q, k, v = random_qkv(grid.batch, grid.heads, kv_heads, n, n, grid.head_dim, dtype, device, seed)
                gen = torch.Generator(device=device).manual_seed(seed + 7919)
                return q, k, v, torch.randn(q.shape, generator=gen, device=device).to(dtype)

            rows_n = _length(args, device, cp, attention, make, gqa, world, rank, base, label, n)
            rows += rows_n
            if rank == 0:
                _progress(args, rows, rows_n)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    dist.barrier()
    if rank == 0 and args.out is not None:
        (args.out / PARTIAL).unlink(missing_ok=True)
    return rows if rank == 0 else None


PARTIAL = "cp-partial-rows.json"  # the rows so far, rewritten after each length, removed at the end


def _progress(args, rows: list[dict], new: list[dict]) -> None:
    """After each length: a line per new row on stdout and the rows so far on disk, so a run cut
    off at its longest length keeps the shorter ones."""
    for r in new:
        ms = "-" if r["ms"] is None else f"{r['ms']:.2f} ms"
        err = "" if r["rel_error"] is None else f", error {r['rel_error']:.2e}"
        print(f"cp: N={r['seq_len']} {r['pass']} {r['peer']}: {ms}, x ideal {_f(r.get('x_baseline'))}{err}"
              + (f" ({r['note']})" if r.get("note") and r["ms"] is None else ""), flush=True)
    if args.out is not None:
        import json

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / PARTIAL).write_text(json.dumps(rows, indent=1, default=str))


def _flops(n: int, base: dict, backward: bool) -> float:
    f = 4.0 * base["batch"] * base["heads"] * n * n * base["head_dim"] * 0.5
    return f * (3.5 if backward else 1.0)


def _row(base: dict, what: str, label: str, n: int, peer: str, samples, world: int, scale: float = 1.0,
         note: str = "", **extra) -> dict:
    """One table row; samples None for a row not run (note says why)."""
    series = f"world {world} {label} causal {what}"
    row = {**base, "pass": what, "suite": NAME, "case": f"{series} N={n}", "series": series, "x": n, "peer": peer,
           "baseline": IDEAL, "figure_unit": "TFLOP/s", "ms": None, "ms_min": None, "ms_max": None,
           "figure": None, "rel_error": None, **extra}
    if samples:
        ms = [s * scale for s in samples]
        row.update(ms=statistics.median(ms), ms_min=min(ms), ms_max=max(ms), samples=len(ms))
        row["figure"] = _flops(n, base, what == "fwd+bwd") / (row["ms"] * 1e-3) / 1e12
    if note:
        row["note"] = note
        if not samples:
            row["error"] = note  # the table's note column
    return row


def _length(args, device, cp, attention, make, gqa, world, rank, base, label, n) -> list[dict]:
    """Every peer at one total length; make() gives the whole sequence's q, k, v, dout (the same
    on every rank, the same on every call). A torch peer takes a fresh copy and shards it in place,
    so a rank never holds the whole sequence twice."""
    q, k, v, dout = make()
    rep_ms = args.rep_ms
    out: list[dict] = []
    timed: dict = {}
    errors: dict = {}
    idx = sample_rows(n, 128 if n > 262144 else options.error_rows(args))

    # Ideal: one shard's work on one GPU through adaattn.attention: the whole sequence for a
    # world's share of the heads (every KV head's group whole), or where the KV heads do not
    # split evenly the whole call divided by the world size.
    hkv = k.shape[1]
    split = hkv % world == 0
    hs, ks_ = (q.shape[1] // world, hkv // world) if split else (q.shape[1], hkv)
    sq, sk, sv, sd = q[:, :hs], k[:, :ks_], v[:, :ks_], dout[:, :hs]

    def single(backward):
        qq, kk, vv = ((t.detach().requires_grad_() for t in (sq, sk, sv)) if backward else (sq, sk, sv))
        o = attention(qq, kk, vv, is_causal=True, enable_gqa=gqa)
        if backward:
            o.backward(sd)
        return o

    timed[(IDEAL, False)], got = _time(lambda: single(False), device, rep_ms)
    single_out = _rows_on_primary(got, idx)
    del got
    timed[(IDEAL, True)] = _time(lambda: single(True), device, rep_ms)[0]

    # Ours on the zigzag shard.
    ql, kl, vl, dl = (cp.shard(t, 2) for t in (q, k, v, dout))
    ql, kl, vl, dl = (t.contiguous() for t in (ql, kl, vl, dl))
    ours = [(OURS, "auto")] + ([(TRITON, "triton")] if world > 1 and q.is_cuda else []) + \
        ([(BLOCKS, "triton")] if world == 1 and q.is_cuda else [])
    for peer, kernel in ours:
        def ring(backward, kernel=kernel):
            qq, kk, vv = ((t.detach().requires_grad_() for t in (ql, kl, vl)) if backward else (ql, kl, vl))
            o = cp.ring_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa, kernel=kernel)
            if backward:
                o.backward(dl)
            return o

        timed[(peer, False)], got = _time(lambda: ring(False), device, rep_ms)
        errors[peer] = _rows_on_primary(cp.unshard(got, 2), idx)
        del got
        timed[(peer, True)] = _time(lambda: ring(True), device, rep_ms)[0]
    del ql, kl, vl, dl

    # The reference and SDPA's own rows before torch's context_parallel runs: a call that raises
    # inside it can leave F.scaled_dot_product_attention patched (torch 2.11).
    if rank == 0:
        with torch.no_grad():
            ref = sampled_reference(q, k, v, idx, causal=True)
            picked = torch.arange(len(idx))
            sdpa_err = relative_error(_sdpa_rows(q, k, v, idx), ref, picked)
    del q, k, v, dout, sq, sk, sv, sd
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # torch's context_parallel over SDPA, each rotate method, on a fresh copy of the inputs.

    notes = {}
    for method in ROTATE:
        peer = f"torch cp {method}"
        sdpa = F.scaled_dot_product_attention
        try:
            # The copy is made on every rank before any collective, and all agree it was: a rank
            # out of memory here would otherwise leave the others waiting in torch's first one.
            try:
                bufs, short = make(), None
            except torch.OutOfMemoryError as e:
                bufs, short = None, e
            if not _agree_all(short is None, device):
                raise short or torch.OutOfMemoryError("another rank ran out of memory copying the inputs")
            samples, full, how = _torch_cp(*bufs, gqa, method, device, rep_ms)
            del bufs
            timed[(peer, False)], timed[(peer, True)] = samples
            errors[peer] = _rows_on_primary(full, idx)
            del full
            notes[peer] = how
        except Exception as e:  # every rank raises alike (the same call on the same shapes)
            notes[peer] = f"not run: {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            if rank == 0:
                print(f"cp: N={n} {peer}: {notes[peer]}", flush=True)
        finally:
            F.scaled_dot_product_attention = sdpa
            if device.type == "cuda":
                torch.cuda.empty_cache()

    if rank == 0:
        with torch.no_grad():
            err = {p: relative_error(o, ref, picked) for p, o in errors.items()}
            err[IDEAL] = relative_error(single_out, ref[:, :hs], picked)
    else:
        sdpa_err, err = None, {}
    for backward in (False, True):
        what = "fwd+bwd" if backward else "fwd"
        ideal = timed[(IDEAL, backward)]
        rows = [_row(base, what, label, n, IDEAL, ideal, world, scale=1.0 if split else 1.0 / world,
                     rel_error=err.get(IDEAL),
                     note=(f"one GPU, whole sequence, {hs} of {base['heads']} query heads" if split
                           else f"one GPU, whole sequence, / {world}"))]
        for peer in [p for p, _ in ours] + [f"torch cp {m}" for m in ROTATE]:
            samples = timed.get((peer, backward))
            e = err.get(peer)
            row = _row(base, what, label, n, peer, samples, world, rel_error=e,
                       note=notes.get(peer, "") if samples is None or peer.startswith("torch") else "")
            if samples and e is not None and sdpa_err is not None:
                row["sdpa_rel_error"] = sdpa_err
                row["error_ok"] = e <= 2 * sdpa_err + 1e-6
            rows.append(row)
        base_ms = rows[0]["ms"]
        for r in rows:
            r["x_baseline"] = None if r["ms"] is None or base_ms is None else base_ms / r["ms"]
        out += rows
    return out


def _rows_on_primary(out: torch.Tensor, idx: torch.Tensor):
    """The sampled query rows of a whole-sequence output, kept on rank 0 only."""
    return out.index_select(2, idx.to(out.device)).clone() if dist.get_rank() == 0 else None


def _sdpa_rows(q, k, v, idx) -> torch.Tensor:
    """torch SDPA's output on the sampled query rows (causal as a boolean mask), one KV head's
    group at a time: the yardstick of the error standard."""
    n = k.shape[2]
    idx = idx.to(q.device)
    keep = torch.arange(n, device=q.device).unsqueeze(0) <= idx.unsqueeze(1)
    group = q.shape[1] // k.shape[1]
    parts = []
    for h in range(k.shape[1]):
        qs = q[:, h * group:(h + 1) * group].index_select(2, idx)
        ks = k[:, h:h + 1].expand(-1, group, -1, -1)
        vs = v[:, h:h + 1].expand(-1, group, -1, -1)
        parts.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=keep))
    return torch.cat(parts, 1)


def summarize(rows: list[dict]) -> tuple[dict, str]:
    """Per length and pass: scaling efficiency (ideal / ours) and ours against torch's faster rotate
    method; the issue's lines at the longest length run."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["seq_len"], r["pass"]), {})[r["peer"]] = r
    entries, lines = [], []
    for (n, what), peers in sorted(by.items()):
        ours, ideal = peers.get(OURS, {}), peers.get(IDEAL, {})
        torch_rows = [peers[p] for p in peers if p.startswith("torch cp") and peers[p].get("ms")]
        best = min(torch_rows, key=lambda r: r["ms"]) if torch_rows else None
        e = {"seq_len": n, "pass": what, "world_size": (ours or ideal).get("world_size"),
             "ours_ms": ours.get("ms"), "ideal_ms": ideal.get("ms"),
             "efficiency": None if not (ours.get("ms") and ideal.get("ms")) else ideal["ms"] / ours["ms"],
             "torch_best": None if best is None else best["peer"],
             "x_torch": None if not (best and ours.get("ms")) else best["ms"] / ours["ms"],
             "ours_error": ours.get("rel_error"), "sdpa_error": ours.get("sdpa_rel_error"),
             "error_ok": ours.get("error_ok"), "not_run": ideal.get("note") if ideal.get("ms") is None else None}
        entries.append(e)
        if e["not_run"]:
            lines.append(f"N={n} {what}: not run ({e['not_run']})")
            continue
        triton = peers.get(TRITON, {})
        e["triton_efficiency"] = (None if not (triton.get("ms") and ideal.get("ms"))
                                  else ideal["ms"] / triton["ms"])
        text = f"N={n} {what}: efficiency {_f(e['efficiency'])} of ideal"
        if e["triton_efficiency"] is not None:
            text += f" (Triton blocks {_f(e['triton_efficiency'])})"
        if e["x_torch"] is not None:
            text += f", {_f(e['x_torch'])}x {e['torch_best']}"
        text += f", error {_f(e['ours_error'], '.2e')} (sdpa {_f(e['sdpa_error'], '.2e')})"
        lines.append(text)
    run = [e for e in entries if e["efficiency"] is not None]
    longest = max((e["seq_len"] for e in run), default=None)
    at = [e for e in run if e["seq_len"] == longest]
    summary = {"how": HOW, "cases": entries, "longest": longest,
               "efficiency_at_longest": min((e["efficiency"] for e in at), default=None),
               "x_torch_at_longest": min((e["x_torch"] for e in at if e["x_torch"] is not None), default=None),
               "errors_ok": all(e["error_ok"] for e in run if e["error_ok"] is not None) if run else None}
    if longest is not None:
        lines.append(f"longest run N={longest}: efficiency {_f(summary['efficiency_at_longest'])} (line 0.85), "
                     f"x torch {_f(summary['x_torch_at_longest'])} (line 1.1)")
    return summary, "\n".join(lines)


def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)
