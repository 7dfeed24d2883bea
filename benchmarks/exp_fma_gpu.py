"""Softmax exp2 split between the multi-function unit and the FMA units, and tile configs, for
our exact and quantized forward kernels on one GPU, timed against SDPA in the same run.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/exp_fma_gpu.py \
        --out $OUT/exp_fma.json --commit <git sha>

bf16, B=2, H=16, D=128, N in {4096, 16384}, causal and not. For every (kernel, config, exp
share): a float64 check at B=1 N=1024 (exact: err <= 2 err(SDPA) + 1e-6; quantized: the error
must stay within 5% + 1e-4 of the same kernel without the FMA share), sampled rows at every timed
size, then do_bench medians of
  - the kernel alone (exact: launch_fwd; quantized: launch_level on an already quantized K/V),
  - quantized only: the K/V pre-pass alone, and the whole call (quant_attention, pre-pass
    included), plus the host time per whole call with the GPU kept busy.
Kernels are compiled first in parallel worker processes (see triton_variants_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("ADAATTN_TRITON_AUTOTUNE", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import triton_variants_gpu as tv  # noqa: E402  (shapes, inputs, timing, parallel compile pool)

B, H, D, DEVICE = tv.B, tv.H, tv.D, tv.DEVICE
LEVEL_NAMES = {1: "qk8", 2: "fp8"}


def variants():
    from adaattn.backends.triton_attention import KernelConfig as C

    out = []
    for cfg in (C(128, 128, 8, 3), C(128, 64, 8, 3)):
        for e in (0, 2, 4):
            out.append(("exact", 0, cfg, e))
    for level in (1, 2):
        for cfg in (C(128, 64, 8, 3), C(128, 128, 8, 3), C(64, 128, 4, 3)):
            for e in (0, 2, 4):
                out.append(("quant", level, cfg, e))
    return out


def vname(v) -> str:
    kind, level, cfg, e = v
    name = "exact" if kind == "exact" else LEVEL_NAMES[level]
    return f"{name} {cfg.block_m}/{cfg.block_n}/{cfg.num_warps}/{cfg.num_stages} exp_fma={e}"


def run(v, q, k, v_, causal, prepared=None):
    from adaattn.backends import triton_attention as ta
    from adaattn.backends import triton_quant as tq

    kind, level, cfg, e = v
    n = q.shape[2]
    if kind == "exact":
        with ta.forced_configs(fwd=cfg):
            return ta.launch_fwd(q, k, v_, None, None, None, n, n, D ** -0.5, causal, False, -1, -1, exp_fma=e)[0]
    with ta.forced_configs(**{f"quant_{LEVEL_NAMES[level]}": cfg}):
        return tq.quant_attention(q, k, v_, levels=[level], causal=causal, exp_fma=e, prepared=prepared)


def _compile(job):
    idx, causal = job
    t0 = time.time()
    try:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
        q, k, v = tv.inputs(1, 256, 0)
        run(variants()[idx], q, k, v, causal)
        torch.cuda.synchronize()
        return job, time.time() - t0, None
    except Exception as e:
        return job, time.time() - t0, f"{type(e).__name__}: {str(e).strip()[:200]}"


def precompile(workers, timeout_s):
    import multiprocessing as mp

    jobs = [(i, c) for i in range(len(variants())) for c in (False, True)]
    t0, done, errors = time.time(), 0, {}
    pool = mp.get_context("spawn").Pool(workers)
    try:
        it = pool.imap_unordered(_compile, jobs)
        for _ in jobs:
            job, secs, err = it.next(timeout=max(timeout_s - (time.time() - t0), 1))
            done += 1
            if err:
                errors[str(job)] = err
                tv.log(f"  compile {job} FAILED: {err}")
    except Exception as e:
        tv.log(f"  precompile stopped ({type(e).__name__}) with {done}/{len(jobs)} done")
    finally:
        pool.terminate()
    tv.log(f"  {done}/{len(jobs)} compiled in {time.time() - t0:.0f}s")
    return {"jobs": len(jobs), "done": done, "errors": errors, "seconds": time.time() - t0}


def check(vs) -> dict:
    from adaattn.backends.reference import reference_attention

    checks, base = {}, {}
    for causal in (False, True):
        q, k, v = tv.inputs(1, tv.CHECK_N, 7 + causal)
        ref = reference_attention(q.double(), k.double(), v.double(), tv.causal_keep(tv.CHECK_N) if causal else None)
        e_torch = tv.rel_err(F.scaled_dot_product_attention(q, k, v, is_causal=causal), ref)
        for var in vs:
            key = (vname(var), causal)
            try:
                out = run(var, q, k, v, causal)
                e = tv.rel_err(out, ref)
                finite = bool(torch.isfinite(out).all())
                kind, level, cfg, share = var
                if kind == "exact":
                    ok = finite and e <= 2 * e_torch + 1e-6
                else:
                    b = base.setdefault((level, cfg, causal), e if share == 0 else None)
                    ok = finite and (b is None or e <= 1.05 * b + 1e-4)
                checks[key] = {"ok": ok, "err": e, "err_torch": e_torch}
            except Exception as ex:
                checks[key] = {"ok": False, "error": f"{type(ex).__name__}: {str(ex)[:200]}"}
            c = checks[key]
            tv.log(f"  check {key[0]:36s} causal={causal!s:5s} " + ("PASS" if c["ok"] else "FAIL")
                   + (f" err {c['err']:.2e} (sdpa {e_torch:.2e})" if "err" in c else f" {c.get('error')}"))
    return checks


def timings(vs, sizes, checks) -> list:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from adaattn.backends import triton_quant as tq

    rows = []
    for n in sizes:
        for causal in (False, True):
            q, k, v = tv.inputs(B, n, n + causal)
            f = tv.flops(n, causal, False)
            with torch.no_grad():
                for name, be in (("sdpa.cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa.flash", SDPBackend.FLASH_ATTENTION)):
                    def call(be=be):
                        with sdpa_kernel(be):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    ms = tv.bench(call)
                    rows.append({"impl": name, "n": n, "causal": causal, "ms": ms, "tflops": f / ms / 1e9})
                    tv.log(f"  N={n:5d} causal={causal!s:5s} {name:40s} {ms:8.3f} ms {f / ms / 1e9:5.0f} TFLOP/s")
                for var in vs:
                    name = vname(var)
                    row = {"impl": name, "n": n, "causal": causal}
                    if not checks[(name, causal)]["ok"]:
                        rows.append(dict(row, error="failed its float64 check"))
                        continue
                    try:
                        kind, level, cfg, e = var
                        if kind == "exact":
                            out = run(var, q, k, v, causal)
                            row["ms"] = tv.bench(lambda: run(var, q, k, v, causal))
                        else:
                            prepared = tq.Prepared(k, v)
                            out = run(var, q, k, v, causal, prepared)
                            row["ms"] = tv.bench(lambda: run(var, q, k, v, causal, prepared))
                            qk_mode, pv_mode = tq.level_modes(level)
                            row["prepass_ms"] = tv.bench(lambda: tq.Prepared(k, v).get(qk_mode, pv_mode, cfg.block_n))
                            row["call_ms"] = tv.bench(lambda: run(var, q, k, v, causal))
                            row["call_host_us"] = tv.host_us_per_call(lambda: run(var, q, k, v, causal))
                        row["sampled_row_err"] = tv.sampled_rows_err(out, q, k, v, causal)
                        row["tflops"] = f / row["ms"] / 1e9
                    except Exception as ex:
                        row["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
                    rows.append(row)
                    tv.log(f"  N={n:5d} causal={causal!s:5s} {name:40s} "
                           + (f"{row['ms']:8.3f} ms {row['tflops']:5.0f} TFLOP/s err {row['sampled_row_err']:.1e}"
                              + (f" | prepass {row['prepass_ms']:.3f} call {row['call_ms']:.3f} ms host "
                                 f"{row['call_host_us']:.0f} us" if "call_ms" in row else "")
                              if "ms" in row else row["error"]))
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="exp_fma.json")
    ap.add_argument("--commit", default="")
    ap.add_argument("--sizes", default="4096,16384")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = ap.parse_args()
    t0 = time.time()
    vs = variants()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": args.commit,
              "shape": {"b": B, "h": H, "d": D, "dtype": "bfloat16"}}
    import triton

    result["triton"] = triton.__version__
    tv.log(f"{result['gpu']} torch {torch.__version__} triton {triton.__version__}")
    result["precompile"] = precompile(args.workers, 300)
    checks = check(vs)
    result["checks"] = {f"{k[0]} causal={k[1]}": c for k, c in checks.items()}
    result["rows"] = timings(vs, [int(s) for s in args.sizes.split(",")], checks)
    result["wall_s"] = time.time() - t0
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    tv.log("\nratios (cuDNN ms / ours), kernel alone; quantized whole call in brackets")
    for n in sorted({r["n"] for r in result["rows"]}):
        for causal in (False, True):
            rs = [r for r in result["rows"] if r["n"] == n and r["causal"] == causal and "ms" in r]
            cud = next(r["ms"] for r in rs if r["impl"] == "sdpa.cudnn")
            line = " ".join(f"{r['impl']}={cud / r['ms']:.2f}" + (f"[{cud / r['call_ms']:.2f}]" if "call_ms" in r else "")
                            for r in rs if not r["impl"].startswith("sdpa"))
            tv.log(f"N={n} causal={causal}: {line}")
    tv.log(f"wall {result['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
