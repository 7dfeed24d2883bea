"""Our Triton attention's kernel variants on one GPU: checked, then timed against SDPA.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/triton_variants_gpu.py \
        --out $OUT/triton_variants.json --commit <git sha>

bf16, B=2, H=16, D=128, N in {4096, 16384}, causal and not (--sizes to change N).

0. Compiles every (variant, causal) kernel once in parallel worker processes at a small size
   with the same specialisation as the timed sizes, so the timing below finds them in
   Triton's cache (one compile takes 10-20 s; run serially they would not fit the budget).
1. SDPA FLASH_ATTENTION and CUDNN_ATTENTION, forward and forward+backward, as peers.
2. Forward variants (pointer or TMA loads, grid order, tile config), each forced (no
   autotuning): a float64 check at B=1 H=16 N=1024 (MEASURING.md: err <= 2 err(SDPA) + 1e-6),
   a sampled-row float64 check at every timed size, then do_bench median of the kernel launch.
3. The 4k causal question: the same kernel timed as the config tuner times it (launch_fwd),
   through the public function, through the custom op, and the host time per call of each
   (measured with the GPU kept busy, so it is pure CPU time).
4. Backward variants (separate dq pass, atomic dq, atomic dq with rotated start; tile
   configs): gradients against float64 at B=1 H=16 N=1024 (causal and not), then forward+
   backward (autograd, with the fastest checked forward for that shape) and backward alone.
The short table comes last; JSON goes to --out. A failing variant is reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time

os.environ.setdefault("ADAATTN_TRITON_AUTOTUNE", "0")  # nothing is tuned behind our back

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_timing import host_us_per_call, section_runner  # noqa: E402,F401  (exp_fma_gpu.py uses the first from here)

K = None  # KernelConfig, set after the import below (workers import it themselves)

B, H, D = 2, 16, 128
DEVICE = os.environ.get("ADAATTN_BENCH_DEVICE", "cuda")  # "cpu" only for a dry run under TRITON_INTERPRET=1
CHECK_N = 1024  # float64 checks: H=16 and N a multiple of 16 keep the timed kernels' specialisation
DTYPE = torch.bfloat16


def _configs():
    from adaattn.backends.triton_attention import KernelConfig as C

    fwd = [
        # name, fwd mode, grid order, config ("ws": kernels/attention_fwd_ws.py, num_warps per
        # warp group; the other modes run kernels/attention_fwd.py)
        ("ws 128/128/4/2", "ws", "query_major", C(128, 128, 4, 2)),  # first: the backward checks run from it
        ("ptr 128/128/8/3", "ptr", "query_major", C(128, 128, 8, 3)),  # the general kernel's first config
        ("ws 128/64/4/2", "ws", "query_major", C(128, 64, 4, 2)),
        ("ptr 128/64/8/3", "ptr", "query_major", C(128, 64, 8, 3)),
    ]
    bwd = [
        # name, dq mode, forced configs
        ("separate 32/128/8/2 + dq 128/64/8/3", "separate", dict(dkdv=C(32, 128, 8, 2), dq=C(128, 64, 8, 3))),
        ("atomic 64/128/8/2", "atomic", dict(dkdv_atomic=C(64, 128, 8, 2))),
    ]
    return fwd, bwd


def log(msg: str) -> None:
    print(msg, flush=True)


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den else (0.0 if num == 0 else float("inf"))


def flops(n, causal, backward) -> float:
    f = 4 * B * H * n * n * D * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


def inputs(b, n, seed, grad=False):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(b, H, n, D, device=DEVICE, generator=g).to(DTYPE).requires_grad_(grad) for _ in range(3)]


def run_fwd(ta, variant, q, k, v, causal):
    _, mode, order, cfg = variant
    with ta.forced_configs(fwd=cfg, fwd_ws=cfg):
        return ta.launch_fwd(q, k, v, None, None, None, q.shape[2], k.shape[2], D ** -0.5, causal, False, -1, -1,
                             fwd_mode=mode, grid_order=order)


def run_fwd_bwd(ta, fwd_variant, bwd_variant, q, k, v, causal, dout):
    """Autograd forward + backward through the public function, both variants forced."""
    _, mode, order, fcfg = fwd_variant
    _, dq_mode, bcfgs = bwd_variant
    with ta.forced_configs(fwd=fcfg, fwd_ws=fcfg, **bcfgs), ta.kernel_variants(fwd=mode, fwd_grid=order, dq=dq_mode):
        out = ta.triton_attention(q, k, v, is_causal=causal, deterministic=False)
        out.backward(dout)
    return out


# ---------------------------------------------------------------- 0. parallel compiles

def _compile_job(job):
    """Runs in a worker: one small launch so the kernel lands in Triton's on-disk cache."""
    kind, idx, causal = job
    t0 = time.time()
    try:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
        from adaattn.backends import triton_attention as ta

        fwd, bwd = _configs()
        q, k, v = inputs(1, 256, 0)
        if kind == "fwd":
            run_fwd(ta, fwd[idx], q, k, v, causal)
        else:
            out, lse = run_fwd(ta, fwd[0], q, k, v, causal)
            _, dq_mode, bcfgs = bwd[idx]
            with ta.forced_configs(**bcfgs):
                ta.launch_bwd(torch.randn_like(out), q, k, v, out, lse, None, None, None, 256, 256, D ** -0.5, causal,
                              False, -1, -1, deterministic=False, dq_mode=dq_mode)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return job, time.time() - t0, None
    except Exception as e:
        return job, time.time() - t0, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


def precompile(n_fwd, n_bwd, workers, timeout_s) -> dict:
    jobs = [("bwd", i, c) for i in range(n_bwd) for c in (False, True)]
    jobs += [("fwd", i, c) for i in range(n_fwd) for c in (False, True)]
    done, errors = {}, {}
    t0 = time.time()
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(workers)
    try:
        pending = pool.imap_unordered(_compile_job, jobs)
        for _ in jobs:
            left = timeout_s - (time.time() - t0)
            if left <= 0:
                raise TimeoutError
            job, secs, err = pending.next(timeout=left)
            done[str(job)] = secs
            if err:
                errors[str(job)] = err
                log(f"  compile {job} FAILED after {secs:.0f}s: {err}")
    except (TimeoutError, mp.TimeoutError):
        log(f"  precompile stopped at {timeout_s}s with {len(done)}/{len(jobs)} done; the rest compile when timed")
    finally:
        pool.terminate()
    log(f"  {len(done)}/{len(jobs)} kernels compiled in {time.time() - t0:.0f}s with {workers} workers"
        + (f", {len(errors)} failed" if errors else ""))
    return {"jobs": len(jobs), "done": len(done), "errors": errors, "seconds": time.time() - t0}


# ---------------------------------------------------------------- checks

def causal_keep(n):
    return torch.ones(n, n, dtype=torch.bool, device=DEVICE).tril()


def check_forward(ta, variant, causal) -> dict:
    from adaattn.backends.reference import reference_attention

    q, k, v = inputs(1, CHECK_N, 7 + causal)
    out, _ = run_fwd(ta, variant, q, k, v, causal)
    mask = causal_keep(CHECK_N) if causal else None
    ref = reference_attention(q.double(), k.double(), v.double(), mask)
    peer = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    e, et = rel_err(out, ref), rel_err(peer, ref)
    ok = bool(torch.isfinite(out).all()) and e <= 2 * et + 1e-6
    return {"ok": ok, "err": e, "err_torch": et}


def check_gradients(ta, fwd_variant, bwd_variant, causal) -> dict:
    from adaattn.backends.reference import reference_attention

    q, k, v = inputs(1, CHECK_N, 11 + causal, grad=True)
    dout = torch.randn(q.shape, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(3)).to(DTYPE)
    out = run_fwd_bwd(ta, fwd_variant, bwd_variant, q, k, v, causal, dout)
    ours = [out, q.grad, k.grad, v.grad]
    mask = causal_keep(CHECK_N) if causal else None
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, mask)
    ref.backward(dout.double())
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
    peer = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    peer.backward(dout)
    row = {"ok": True}
    for name, o, r, p in zip(("out", "dq", "dk", "dv"), ours, (ref, q64.grad, k64.grad, v64.grad),
                             (peer, qt.grad, kt.grad, vt.grad)):
        e, et = rel_err(o, r), rel_err(p, r)
        ok = bool(torch.isfinite(o).all()) and e <= 2 * et + 1e-6
        row[name] = {"err": e, "err_torch": et, "ok": ok}
        row["ok"] &= ok
    return row


def sampled_rows_err(out, q, k, v, causal, rows=(0, 1, 1000, -1)) -> float:
    n = q.shape[2]
    idx = torch.tensor([r % n for r in rows], device=DEVICE)
    s = (q[:, :, idx].double() @ k.double().transpose(-1, -2)) * D ** -0.5
    if causal:
        s = s.masked_fill(torch.arange(n, device=DEVICE)[None, None, None, :] > idx[None, None, :, None],
                          float("-inf"))
    return rel_err(out[:, :, idx], torch.softmax(s, -1) @ v.double())


# ---------------------------------------------------------------- timing

def bench(fn, warmup=25, rep=100) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def sdpa_rows(sizes) -> list:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for n in sizes:
        for causal in (False, True):
            q, k, v = inputs(B, n, n + causal, grad=True)
            dout = torch.randn_like(q)
            for name, backend in (("sdpa.flash", SDPBackend.FLASH_ATTENTION), ("sdpa.cudnn", SDPBackend.CUDNN_ATTENTION)):
                for backward in (False, True):
                    row = {"impl": name, "n": n, "causal": causal, "pass": "fwd+bwd" if backward else "fwd"}
                    try:
                        def fwd():
                            with sdpa_kernel(backend):
                                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                        def step():
                            for t in (q, k, v):
                                t.grad = None
                            fwd().backward(dout)

                        if backward:
                            row["ms"] = bench(step, 10, 60)
                        else:
                            with torch.no_grad():
                                row["ms"] = bench(fwd)
                        row["tflops"] = flops(n, causal, backward) / row["ms"] / 1e9
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    rows.append(row)
                    log(f"  N={n:5d} causal={causal!s:5s} {name:10s} {row['pass']:7s} "
                        + (f"{row['ms']:8.3f} ms {row['tflops']:5.0f} TFLOP/s" if "ms" in row else row["error"]))
            del q, k, v, dout
            torch.cuda.empty_cache()
    return rows


def forward_rows(ta, fwd_variants, sizes) -> tuple[list, dict]:
    rows, checks = [], {}
    for variant in fwd_variants:
        name = variant[0]
        for causal in (False, True):
            try:
                checks[(name, causal)] = check_forward(ta, variant, causal)
            except Exception as e:
                checks[(name, causal)] = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            c = checks[(name, causal)]
            log(f"  check {name:28s} causal={causal!s:5s} " + ("PASS" if c["ok"] else "FAIL")
                + (f" err {c['err']:.2e} (torch {c['err_torch']:.2e})" if "err" in c else f" {c.get('error')}"))
    for n in sizes:
        for causal in (False, True):
            q, k, v = inputs(B, n, n + causal)
            for variant in fwd_variants:
                name = variant[0]
                row = {"variant": name, "n": n, "causal": causal}
                if not checks[(name, causal)]["ok"]:
                    row["error"] = "failed its float64 check"
                    rows.append(row)
                    continue
                try:
                    _, mode, order, cfg = variant
                    with torch.no_grad():
                        out, _ = run_fwd(ta, variant, q, k, v, causal)
                        row["sampled_row_err"] = sampled_rows_err(out, q, k, v, causal)
                        row["ok"] = row["sampled_row_err"] < 2e-2
                        with ta.forced_configs(fwd=cfg, fwd_ws=cfg):  # entered once, outside the timed calls
                            row["ms"] = bench(lambda: ta.launch_fwd(q, k, v, None, None, None, n, n, D ** -0.5, causal,
                                                                    False, -1, -1, fwd_mode=mode, grid_order=order))
                        row["tflops"] = flops(n, causal, False) / row["ms"] / 1e9
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
                log(f"  N={n:5d} causal={causal!s:5s} {name:28s} "
                    + (f"{row['ms']:8.3f} ms {row['tflops']:5.0f} TFLOP/s  row err {row['sampled_row_err']:.1e}"
                       if "ms" in row else row["error"]))
            del q, k, v
            torch.cuda.empty_cache()
    return rows, {f"{k[0]} causal={k[1]}": v for k, v in checks.items()}


def anomaly_rows(ta, variant, n=4096) -> list:
    """The same forward kernel timed four ways, and the host time of each way."""
    _, mode, order, cfg = variant
    rows = []
    scale = D ** -0.5
    for causal in (False, True):
        q, k, v = inputs(B, n, 99 + causal)
        with ta.forced_configs(fwd=cfg, fwd_ws=cfg), ta.kernel_variants(fwd=mode, fwd_grid=order), torch.no_grad():
            ways = {
                "launch_fwd (as the config tuner times it)":
                    lambda: ta.launch_fwd(q, k, v, None, None, None, n, n, scale, causal, False, -1, -1),
                "triton_attention (public, no grad: direct launch)":
                    lambda: ta.triton_attention(q, k, v, is_causal=causal),
                "flash_fwd custom op (the path the old table timed)":
                    lambda: ta.flash_fwd(q, k, v, None, None, None, n, n, scale, causal, False, -1, -1, False),
            }
            import triton

            for way, fn in ways.items():
                row = {"way": way, "n": n, "causal": causal, "config": str(cfg)}
                try:
                    row["ms"] = bench(fn)
                    row["ms_again"] = bench(fn)
                    # As the old table timed it (warmup 10, rep 60): every sample, to see spread.
                    times = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="all")
                    times = sorted(times)
                    row["old_table_samples"] = len(times)
                    row["old_table_min_median_max"] = [times[0], times[len(times) // 2], times[-1]]
                    row["host_us"] = host_us_per_call(fn)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
                log(f"  N={n} causal={causal!s:5s} {way:52s} " + (
                    f"{row['ms']:.3f} / {row['ms_again']:.3f} ms, old-table samples min/med/max "
                    f"{'/'.join(f'{x:.3f}' for x in row['old_table_min_median_max'])}, host {row['host_us']:.0f} us/call"
                    if "ms" in row else row["error"]))
            # Pure GPU time: the launch captured in a CUDA graph (no host work per replay).
            row = {"way": "CUDA graph of launch_fwd (GPU time only)", "n": n, "causal": causal, "config": str(cfg)}
            try:
                row["ms"] = triton.testing.do_bench_cudagraph(ways["launch_fwd (as the config tuner times it)"],
                                                              rep=60, return_mode="median")
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            log(f"  N={n} causal={causal!s:5s} {row['way']:52s} " + (f"{row['ms']:.3f} ms" if "ms" in row else row["error"]))
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def backward_rows(ta, fwd_variants, bwd_variants, best_fwd, sizes) -> tuple[list, dict]:
    rows, checks = [], {}
    default_fwd = fwd_variants[0]
    for variant in bwd_variants:
        for causal in (False, True):
            try:
                checks[(variant[0], causal)] = check_gradients(ta, default_fwd, variant, causal)
            except Exception as e:
                checks[(variant[0], causal)] = {"ok": False,
                                                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            c = checks[(variant[0], causal)]
            errs = " ".join(f"{k}={c[k]['err']:.1e}/{c[k]['err_torch']:.1e}" for k in ("out", "dq", "dk", "dv") if k in c)
            log(f"  check {variant[0]:36s} causal={causal!s:5s} {'PASS' if c['ok'] else 'FAIL'} {errs or c.get('error')}")
    by_name = {v[0]: v for v in fwd_variants}
    for n in sizes:
        for causal in (False, True):
            fwd_variant = by_name.get(best_fwd.get((n, causal)), default_fwd)
            q, k, v = inputs(B, n, 5 * n + causal, grad=True)
            dout = torch.randn_like(q)
            with torch.no_grad():
                out, lse = run_fwd(ta, default_fwd, q, k, v, causal)
            for variant in bwd_variants:
                name, dq_mode, bcfgs = variant
                row = {"variant": name, "fwd_variant": fwd_variant[0], "n": n, "causal": causal}
                if not checks[(name, causal)]["ok"]:
                    row["error"] = "failed its float64 check"
                    rows.append(row)
                    continue
                try:
                    def step():
                        for t in (q, k, v):
                            t.grad = None
                        ta.triton_attention(q, k, v, is_causal=causal, deterministic=False).backward(dout)

                    def bwd_only():
                        ta.launch_bwd(dout, q, k, v, out, lse, None, None, None, n, n, D ** -0.5, causal,
                                      False, -1, -1, deterministic=False, dq_mode=dq_mode)

                    _, fmode, forder, fcfg = fwd_variant
                    with ta.forced_configs(fwd=fcfg, fwd_ws=fcfg, **bcfgs), \
                            ta.kernel_variants(fwd=fmode, fwd_grid=forder, dq=dq_mode):
                        row["ms"] = bench(step, 10, 60)
                        row["tflops"] = flops(n, causal, True) / row["ms"] / 1e9
                        row["bwd_ms"] = bench(bwd_only, 10, 60)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
                log(f"  N={n:5d} causal={causal!s:5s} {name:36s} "
                    + (f"fwd+bwd {row['ms']:8.3f} ms {row['tflops']:5.0f} TFLOP/s, bwd alone {row['bwd_ms']:.3f} ms"
                       if "ms" in row else row["error"]))
            del q, k, v, dout, out, lse
            torch.cuda.empty_cache()
    return rows, {f"{k[0]} causal={k[1]}": v for k, v in checks.items()}


def dispatcher_rows(sizes, rounds: int = 3) -> list:
    """adaattn.attention (the dispatcher, default policy) forward and forward+backward at each
    shape, against SDPA pinned to cuDNN and our Triton kernel, interleaved: `rounds` rounds of
    one do_bench each, medians kept, so clock drift over the run (measured: cuDNN 3-6% slower
    minutes into a run than at its start) hits every candidate alike."""
    import statistics

    import adaattn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from adaattn.backends import triton_attention as ta

    rows = []
    for n in sizes:
        for causal in (False, True):
            q, k, v = inputs(B, n, 7 * n + causal, grad=True)
            dout = torch.randn_like(q)
            plan = str(adaattn.explain(q, k, v, is_causal=causal)).splitlines()
            chosen = [line for line in plan if "chosen" in line or "runs" in line][:1] or plan[2:3]

            def sdpa_cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            fns = {"adaattn.attention": lambda: adaattn.attention(q, k, v, is_causal=causal),
                   "sdpa.cudnn": sdpa_cudnn,
                   "triton": lambda: ta.triton_attention(q, k, v, is_causal=causal)}
            for backward in (False, True):
                times = {name: [] for name in fns}
                try:
                    for _ in range(rounds):
                        for name, fn in fns.items():
                            if backward:
                                def step(fn=fn):
                                    for t in (q, k, v):
                                        t.grad = None
                                    fn().backward(dout)
                                times[name].append(bench(step, 10, 60))
                            else:
                                with torch.no_grad():
                                    times[name].append(bench(fn))
                    med = {name: statistics.median(t) for name, t in times.items()}
                    fastest = min(med["sdpa.cudnn"], med["triton"])
                    row = {"n": n, "causal": causal, "pass": "fwd+bwd" if backward else "fwd", "plan": chosen,
                           "ms": med, "samples": times, "attention_vs_fastest": med["adaattn.attention"] / fastest}
                except Exception as e:
                    row = {"n": n, "causal": causal, "pass": "fwd+bwd" if backward else "fwd",
                           "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                rows.append(row)
                log(f"  N={n:5d} causal={causal!s:5s} {row['pass']:7s} " + (
                    " ".join(f"{k} {v:8.3f}" for k, v in row["ms"].items())
                    + f" ms: attention {row['attention_vs_fastest']:.3f}x the fastest "
                    + ("(within 3%)" if row["attention_vs_fastest"] <= 1.03 else "(NOT within 3%)")
                    if "ms" in row else row["error"]))
            del q, k, v, dout
            torch.cuda.empty_cache()
    return rows


def git_commit():
    try:
        from adaattn.bench.report import git_commit as commit

        return commit()
    except Exception:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = os.path.join(os.environ["OUT"], "triton_variants.json") if os.environ.get("OUT") else None
    ap.add_argument("--out", default=default_out)
    ap.add_argument("--commit", default=None, help="git commit measured (read from .git when left out)")
    ap.add_argument("--sizes", default="4096,16384")
    ap.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--compile-timeout", type=float, default=240.0)
    ap.add_argument("--skip-precompile", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from adaattn.backends import triton_attention as ta

    ta.CONFIGS.tune = False
    fwd_variants, bwd_variants = _configs()
    sizes = [int(s) for s in args.sizes.split(",")]
    t_start = time.time()
    props = torch.cuda.get_device_properties(0)
    result = {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
              "triton": triton.__version__, "commit": args.commit or git_commit(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "shape": f"bf16 B={B} H={H} D={D}", "sizes": sizes,
              "tma_available": ta.TensorDescriptor is not None, "errors": []}
    log(f"{props.name} (sm{props.major}{props.minor}), torch {torch.__version__}, triton {triton.__version__}, "
        f"commit {result['commit']}, TMA descriptors {'yes' if result['tma_available'] else 'NO'}")

    section = section_runner(result, log, t_start)

    if not args.skip_precompile:
        result["precompile"] = section(
            f"compiling {2 * (len(fwd_variants) + len(bwd_variants))} kernels in {args.workers} processes",
            lambda: precompile(len(fwd_variants), len(bwd_variants), args.workers, args.compile_timeout))
    result["sdpa"] = section("SDPA peers", lambda: sdpa_rows(sizes)) or []
    fwd = section("forward variants", lambda: forward_rows(ta, fwd_variants, sizes))
    result["forward"], result["forward_checks"] = fwd if fwd else ([], {})
    result["host_overhead"] = section("4k: one kernel timed four ways, host time per call",
                                      lambda: anomaly_rows(ta, fwd_variants[0])) or []

    best_fwd = {}
    for n in sizes:
        for causal in (False, True):
            timed = [r for r in result["forward"] if r["n"] == n and r["causal"] == causal and r.get("ok")]
            if timed:
                best_fwd[(n, causal)] = min(timed, key=lambda r: r["ms"])["variant"]
    bwd = section("backward variants", lambda: backward_rows(ta, fwd_variants, bwd_variants, best_fwd, sizes))
    result["backward"], result["backward_checks"] = bwd if bwd else ([], {})
    result["dispatcher"] = section("adaattn.attention (the dispatcher)", lambda: dispatcher_rows(sizes)) or []
    result["wall_s"] = time.time() - t_start

    # ------------------------------------------------------------ the table
    def pick(rows, **kw):
        return [r for r in rows if all(r.get(k) == v for k, v in kw.items()) and "ms" in r]

    summary = []
    log("")
    log("forward: every variant, ms (N, causal)")
    for variant in fwd_variants:
        cells = []
        for n in sizes:
            for causal in (False, True):
                r = pick(result["forward"], variant=variant[0], n=n, causal=causal)
                cells.append(f"{r[0]['ms']:8.3f}" if r else f"{'-':>8s}")
        log(f"  {variant[0]:28s} " + " ".join(cells))
    log("backward: every variant, fwd+bwd ms / bwd alone ms (N, causal)")
    for variant in bwd_variants:
        cells = []
        for n in sizes:
            for causal in (False, True):
                r = pick(result["backward"], variant=variant[0], n=n, causal=causal)
                cells.append(f"{r[0]['ms']:7.2f}/{r[0]['bwd_ms']:6.2f}" if r else f"{'-':>14s}")
        log(f"  {variant[0]:36s} " + " ".join(cells))
    log("")
    log(f"{'N':>6s} {'causal':6s} {'pass':8s} {'default':>9s} {'best':>9s} {'flash':>9s} {'cudnn':>9s} "
        f"{'best/fl':>7s} {'best/cu':>7s} {'target':>12s}  best variant")
    for n in sizes:
        for causal in (False, True):
            for p in ("fwd", "fwd+bwd"):
                flash = pick(result["sdpa"], impl="sdpa.flash", n=n, causal=causal, **{"pass": p})
                cudnn = pick(result["sdpa"], impl="sdpa.cudnn", n=n, causal=causal, **{"pass": p})
                ours = pick(result["forward"] if p == "fwd" else result["backward"], n=n, causal=causal)
                ours = [r for r in ours if r.get("ok", True)]
                default = ([r for r in ours if r["variant"] == (fwd_variants[0][0] if p == "fwd" else bwd_variants[0][0])]
                           or [None])[0]
                best = min(ours, key=lambda r: r["ms"]) if ours else None
                fl = flash[0]["ms"] if flash else None
                cu = cudnn[0]["ms"] if cudnn else None
                r_fl = fl / best["ms"] if best and fl else None
                r_cu = cu / best["ms"] if best and cu else None
                if p == "fwd":
                    target = f"cudnn>=0.8 {'MET' if r_cu and r_cu >= 0.8 else 'no'}"
                else:
                    target = f"flash>=1.1 {'MET' if r_fl and r_fl >= 1.1 else 'no'}"
                summary.append({"n": n, "causal": causal, "pass": p, "default_ms": default and default["ms"],
                                "best_ms": best and best["ms"], "best_variant": best and best["variant"],
                                "flash_ms": fl, "cudnn_ms": cu, "best_vs_flash": r_fl, "best_vs_cudnn": r_cu})

                def f(x):
                    return f"{x:9.3f}" if x else f"{'-':>9s}"

                def g(x):
                    return f"{x:7.2f}" if x else f"{'-':>7s}"

                log(f"{n:6d} {causal!s:6s} {p:8s} {f(default and default['ms'])} {f(best and best['ms'])} {f(fl)} {f(cu)} "
                    f"{g(r_fl)} {g(r_cu)} {target:>12s}  {best['variant'] if best else '-'}")
    result["summary"] = summary
    log("ratios are peer time / ours: above 1 means ours is faster. default = first variant listed "
        "(fwd+bwd rows: the first backward variant after the fastest checked forward).")
    if result["dispatcher"]:
        log("adaattn.attention against the faster of SDPA-cuDNN and our Triton kernel, interleaved:")
        for r in result["dispatcher"]:
            if "ms" in r:
                log(f"  N={r['n']:5d} causal={r['causal']!s:5s} {r['pass']:7s} attention "
                    f"{r['ms']['adaattn.attention']:8.3f} ms: {r['attention_vs_fastest']:.3f}x the fastest "
                    f"({'within 3%' if r['attention_vs_fastest'] <= 1.03 else 'NOT within 3%'})")
    if result["host_overhead"]:
        log("4k host time per call (us) / timed ms:")
        for r in result["host_overhead"]:
            if "ms" in r:
                log(f"  causal={r['causal']!s:5s} {r['way'][:40]:40s} host {r.get('host_us', float('nan')):6.0f} us  "
                    f"timed {r['ms']:.3f} ms")
    for e in result["errors"]:
        log(f"ERROR {e}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    log(f"total {time.time() - t_start:.0f}s" + (f", JSON in {args.out}" if args.out else ""))
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
