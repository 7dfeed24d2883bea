"""host: what a call costs the host, beside what it costs the GPU, for each path adaattn runs.

Per path and peer, three figures (medians; peers interleaved, the order rotated every round):

- host us: Python and launch time per call. The GPU is kept busy (torch.cuda._sleep) while
  --host-calls calls are issued, so no call waits on the GPU; the loop's wall time over the calls.
  Best of 3 loops per round.
- kernel ms: GPU time of one call alone. The GPU is held by a sleep while the call is issued
  after an L2 flush, so its kernels run back to back between two events: the GPU's own time,
  host gaps excluded.
- latency ms: one call timed alone from the host: synchronise, flush L2, synchronise, then the
  wall time from the call to its synchronise. What a user waiting on one call (a layer, a decode
  step) feels: max(host, kernel) roughly, plus the launch.

Paths (B=2 H=16 D=128 bf16 at 4k unless named): the forward and forward+backward, causal, through
cuDNN (torch's SDPA), adaattn's default call, and our Triton kernels pinned; the causal window
(1023, 0) forward and forward+backward; mode="auto" at tolerance 3e-2 with our quantized kernels
pinned (an approximation runs); decode B=16 Hq=32 Hkv=8 at 8k: SDPA (flash) on the tensors,
decode_attention over a KVCache with a plan, plan_decode itself, KVCache.append of one token
against a static cache's index_copy_; small calls B=1 H=8 D=64 at N=1, 64 and 512: SDPA and
adaattn's default, and each of torch's flash, cuDNN and efficient kernels pinned beside our runner
for it pinned (which kernel's host path sets a small call's time). Rows "... (bound)" run our
prefill kernels with bound launches on (backends/triton/bound.py, ADAATTN_TRITON_BOUND=1), and rows
"... (triton's launch[es])" run decode steps and appends with site launches off
(ADAATTN_TRITON_SITES=0), so the table shows what each saves.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...api import attention, decode_attention, plan_decode
from ...backends.triton import bound as bound_mod
from ...kv import KVCache
from ...policy import Policy

NAME = "host"
HELP = ("host time per call (GPU kept busy), kernel time (GPU alone) and single-call latency (L2 cleared) "
        "per path: Triton fwd and fwd+bwd, windows, auto, decode with a plan, plan_decode, KVCache.append, "
        "small calls; against SDPA where it has the call, with bound launches on (ADAATTN_TRITON_BOUND=1) and "
        "site launches off (ADAATTN_TRITON_SITES=0)")
NEEDS_CUDA = True
FIGURE = "host us"
HOST_CALLS = 50
ROUNDS = 5
FLUSH_BYTES = 256 * 2**20
TRITON = Policy(backends=("triton",))
AUTO = Policy(mode="auto", precisions=("native", "int8", "fp8"), tolerance=3e-2,
              backends=("triton.quant.ws", "triton.quant.general"))


def cases(args, device):
    return []  # the suite times its paths itself (run)


@contextmanager
def _bound_on():
    bound_mod.set_enabled(True)
    try:
        yield
    finally:
        bound_mod.set_enabled(None)


@contextmanager
def _sites_off():
    """Decode steps and appends through triton's own launches (ADAATTN_TRITON_SITES=0)."""
    bound_mod.set_enabled(False)
    bound_mod.set_sites_enabled(False)
    try:
        yield
    finally:
        bound_mod.set_enabled(None)
        bound_mod.set_sites_enabled(None)


@contextmanager
def _none():
    """The default call: bound launches off whatever the environment says (the "(bound)" rows turn
    them on), so the comparison holds under ADAATTN_TRITON_BOUND=1 too."""
    bound_mod.set_enabled(False)
    try:
        yield
    finally:
        bound_mod.set_enabled(None)


def _paths(device):
    """[(path, baseline peer, [(peer, call, context factory, note)])]: inputs made here."""
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, grad=False):
        t = torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)
        return t.requires_grad_() if grad else t

    out = []
    b, h, n, d = 2, 16, 4096, 128
    q, k, v = (rnd(b, h, n, d, grad=True) for _ in range(3))
    go = rnd(b, h, n, d)

    def fwd(f):
        def call():
            with torch.no_grad():
                return f(q, k, v)
        return call

    def fwd_bwd(f):
        def call():
            o = f(q, k, v)
            return torch.autograd.grad(o, (q, k, v), go)
        return call

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    default = lambda q, k, v: attention(q, k, v, is_causal=True)  # noqa: E731
    triton = lambda q, k, v: attention(q, k, v, is_causal=True, policy=TRITON)  # noqa: E731
    window = lambda q, k, v: attention(q, k, v, is_causal=True, window=(1023, 0))  # noqa: E731
    auto = lambda q, k, v: attention(q, k, v, is_causal=True, policy=AUTO)  # noqa: E731
    for what, wrap in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        out.append((f"{what} causal B2 H16 D128 bf16 4k", "cuDNN", [
            ("cuDNN", wrap(cudnn), _none, ""), ("adaattn", wrap(default), _none, "default policy"),
            ("triton", wrap(triton), _none, "Policy(backends=('triton',))"),
            ("triton (bound)", wrap(triton), _bound_on, "ADAATTN_TRITON_BOUND=1")]))
        out.append((f"{what} window (1023, 0) B2 H16 D128 bf16 4k", "adaattn", [
            ("adaattn", wrap(window), _none, ""), ("adaattn (bound)", wrap(window), _bound_on, "")]))
    out.append(("fwd auto 3e-2 (quantized kernels pinned) B2 H16 D128 bf16 4k", "adaattn exact", [
        ("adaattn exact", fwd(default), _none, ""), ("auto", fwd(auto), _none, ""),
        ("auto (bound)", fwd(auto), _bound_on, "")]))

    s, hq, hkv, nk = 16, 32, 8, 8192
    kk, vv = rnd(s, hkv, nk, d), rnd(s, hkv, nk, d)
    qd = rnd(s, hq, 1, d)
    cache = KVCache(1, s, hkv, nk + 4096, d, dtype=torch.bfloat16, device=device)
    cache.append(0, kk, vv)
    plan = plan_decode(cache, heads=hq, query_len=1)

    def sdpa_decode():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qd, kk, vv, enable_gqa=True)

    dec = lambda: decode_attention(qd, cache, 0, plan=plan)  # noqa: E731
    out.append((f"decode B{s} Hq{hq} Hkv{hkv} D{d} bf16 8k", "SDPA flash", [
        ("SDPA flash", sdpa_decode, _none, "on the K/V tensors"),
        ("decode_attention", dec, _none, "plan made once; site launches (the default)"),
        ("decode_attention (triton's launches)", dec, _sites_off, "ADAATTN_TRITON_SITES=0")]))
    out.append((f"plan_decode B{s} Hq{hq} Hkv{hkv} 8k", "plan_decode", [
        ("plan_decode", lambda: plan_decode(cache, heads=hq, query_len=1), _none, "")]))
    k1, v1 = rnd(s, hkv, 1, d), rnd(s, hkv, 1, d)
    static_k = torch.zeros(s, hkv, nk + 4096, d, dtype=torch.bfloat16, device=device)
    static_v = torch.zeros_like(static_k)
    pos = torch.tensor([nk], device=device)

    def index_copy():
        static_k.index_copy_(2, pos, k1)
        static_v.index_copy_(2, pos, v1)

    def append():  # (the cache has room for the suite's appends: about 2,200)
        cache.append(0, k1, v1)

    out.append((f"append one token B{s} Hkv{hkv} D{d} bf16", "static index_copy_", [
        ("static index_copy_", index_copy, _none, "HF StaticCache's update"),
        ("KVCache.append", append, _none, "site launch (the default)"),
        ("KVCache.append (triton's launch)", append, _sites_off, "ADAATTN_TRITON_SITES=0")]))

    for n_small in (1, 64, 512):
        qs, ks, vs = (rnd(1, 8, n_small, 64) for _ in range(3))
        peers = [("SDPA", lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(qs, ks, vs), _none, ""),
                 ("adaattn", lambda qs=qs, ks=ks, vs=vs: attention(qs, ks, vs), _none, "default policy")]
        # Where small calls' host time goes: each of torch's kernels pinned, and each of our SDPA
        # runners pinned (the planner ranks them by kernel time alone).
        for kernel, runner in ((SDPBackend.FLASH_ATTENTION, "sdpa.flash"), (SDPBackend.CUDNN_ATTENTION, "sdpa.cudnn"),
                               (SDPBackend.EFFICIENT_ATTENTION, "sdpa.efficient")):
            def pinned(qs=qs, ks=ks, vs=vs, kernel=kernel):
                with sdpa_kernel(kernel):
                    return F.scaled_dot_product_attention(qs, ks, vs)

            policy = Policy(backends=(runner,))
            peers += [(f"SDPA {runner[5:]}", pinned, _none, "torch's kernel pinned"),
                      (f"adaattn {runner}", lambda qs=qs, ks=ks, vs=vs, policy=policy: attention(qs, ks, vs, policy=policy),
                       _none, "our runner pinned")]
        out.append((f"small B1 H8 D64 bf16 N={n_small}", "SDPA", peers))
    return out, cache


def _host_us(call, context, cycles) -> float:
    """Best of 3 loops of HOST_CALLS calls issued while the GPU sleeps: seconds per call, in us."""
    best = float("inf")
    with context():
        for _ in range(3):
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            t0 = time.perf_counter()
            for _ in range(HOST_CALLS):
                call()
            best = min(best, (time.perf_counter() - t0) / HOST_CALLS)
            torch.cuda.synchronize()
    return best * 1e6


def _kernel_ms(call, context, flush, cycles) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with context():
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        flush.zero_()
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end)


def _latency_ms(call, context, flush) -> float:
    with context():
        torch.cuda.synchronize()
        flush.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3


def _cycles_per_ms() -> float:
    """GPU clock cycles of torch.cuda._sleep per millisecond, measured."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    torch.cuda.synchronize()
    return 10**7 / max(start.elapsed_time(end), 1e-3)


def run(args, device, settings):
    torch.cuda.set_device(device)
    per_ms = _cycles_per_ms()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)
    paths, cache = _paths(device)
    rows = []
    for path, baseline, peers in paths:
        samples = {name: {"host": [], "kernel": [], "latency": []} for name, *_ in peers}
        errors = {}
        for name, call, context, _ in peers:  # warm-up: compiles, tuning, plans
            try:
                with context():
                    for _ in range(3):
                        call()
                torch.cuda.synchronize()
            except Exception as e:  # a peer this machine cannot run: reported, not timed
                errors[name] = f"{type(e).__name__}: {e}"[:300]
        live = [p for p in peers if p[0] not in errors]
        for r in range(ROUNDS):
            order = live[r % len(live):] + live[:r % len(live)] if live else []
            for name, call, context, _ in order:
                host = _host_us(call, context, int(per_ms * 60))
                cycles = int(per_ms * max(2.0, 3 * host * 1e-3))  # the sleep outlasts issuing the call
                samples[name]["host"].append(host)
                samples[name]["kernel"].append(_kernel_ms(call, context, flush, cycles))
                samples[name]["latency"].append(_latency_ms(call, context, flush))
        base = statistics.median(samples[baseline]["latency"]) if baseline not in errors else None
        for name, _, _, note in peers:
            if name in errors:
                rows.append(_row(path, baseline, name, None, None, None, None, None, errors[name]))
                continue
            s = samples[name]
            lat = sorted(s["latency"])
            rows.append(_row(path, baseline, name, statistics.median(s["host"]), statistics.median(s["kernel"]),
                             statistics.median(lat), lat[0], lat[-1], None, base, note))
        if settings.progress:
            print(f"  {path}: done", flush=True)
    del cache
    return rows


def _row(path, baseline, peer, host, kernel, latency, lat_min, lat_max, error, base=None, note=""):
    return {"suite": NAME, "case": path, "series": path, "peer": peer, "baseline": baseline,
            "figure_unit": FIGURE, "figure": None if host is None else round(host, 2),
            "host_us": None if host is None else round(host, 2),
            "kernel_ms": None if kernel is None else round(kernel, 5),
            "ms": None if latency is None else round(latency, 5), "ms_min": lat_min, "ms_max": lat_max,
            "latency_ms": None if latency is None else round(latency, 5),
            "x_baseline": None if latency is None or base is None else round(base / latency, 4),
            "rel_error": None, "error": error, "note": note, "size": 0}


def summarize(rows):
    """Per path: host us, kernel ms and latency ms of each peer, and which one sets the latency."""
    lines = [f"{'path / peer':<58} {'host us':>9} {'kernel ms':>10} {'latency ms':>11} {'x base':>7}  bound by"]
    case = None
    summary = []
    for r in rows:
        if r["case"] != case:
            case = r["case"]
            lines.append(case)
        if r["error"] is not None:
            lines.append(f"  {r['peer']:<56} not run: {r['error'][:80]}")
            continue
        by = "host" if r["host_us"] * 1e-3 > r["kernel_ms"] else "kernel"
        lines.append(f"  {r['peer']:<56} {r['host_us']:>9.1f} {r['kernel_ms']:>10.4f} {r['latency_ms']:>11.4f} "
                     f"{r['x_baseline'] if r['x_baseline'] is not None else float('nan'):>7.3f}  {by}")
        summary.append({"path": case, "peer": r["peer"], "host_us": r["host_us"], "kernel_ms": r["kernel_ms"],
                        "latency_ms": r["latency_ms"], "bound_by": by})
    return {"rows": summary}, "\n".join(lines)


def plot(path, summary, title):
    return None  # the table is the figure
