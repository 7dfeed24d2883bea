"""Our Triton attention on one GPU: correctness, speed against SDPA, and config variants.

    PYTHONPATH=src python3 benchmarks/triton_attention_gpu.py --out $OUT/triton_attention.json

1. Correctness (MEASURING.md): forward and gradients at a few medium sizes against the
   float64 reference, err(ours) <= 2 * err(torch SDPA in the same dtype) + 1e-6; and a
   sampled-row float64 check of the forward at every timed size.
2. Speed: bf16 B=2, H=16, D=128, N in {4096, 16384}, causal and not; forward and
   forward+backward; ours (configs timed per shape class on first use) against SDPA's
   FLASH_ATTENTION and CUDNN_ATTENTION kernels in the same run, do_bench median.
3. Config variants at N=16384 (forward, dk/dv and dq kernels one at a time), fastest first.
The table comes last; JSON (rows, variants, chosen configs, versions, commit) goes to --out
(default $OUT/triton_attention.json when OUT is set). Every section survives a failure of
another and says what failed. Sized to finish in about five minutes on an H100.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from adaattn.backends import triton_attention as ta
from adaattn.backends.reference import reference_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import section_runner  # noqa: E402

DEVICE = "cuda"


def flops(b, h, nq, nk, d, causal, backward):
    f = 4 * b * h * nq * nk * d * (0.5 if causal and nq == nk else 1.0)
    return f * (3.5 if backward else 1.0)


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den else (0.0 if num == 0 else float("inf"))


def git_commit() -> str | None:
    try:
        from adaattn.bench.report import git_commit as commit  # reads .git files where git is absent

        return commit()
    except Exception:
        return None


def log(msg: str) -> None:
    print(msg, flush=True)


CORRECTNESS = [
    # b, hq, hkv, nq, nk, d, dtype, causal, window, mask
    (2, 8, 8, 1024, 1024, 128, torch.bfloat16, True, None, None),
    (1, 8, 2, 1000, 1537, 64, torch.float16, False, None, None),
    (1, 4, 4, 777, 777, 256, torch.bfloat16, True, None, None),
    (1, 4, 1, 600, 900, 80, torch.bfloat16, False, (128, 16), "bool"),
    (1, 4, 4, 513, 513, 128, torch.float32, True, None, None),
]


def check_correctness(case) -> dict:
    b, hq, hkv, nq, nk, d, dtype, causal, window, mask_kind = case
    g = torch.Generator(device=DEVICE).manual_seed(nq + d)
    q = torch.randn(b, hq, nq, d, device=DEVICE, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, hkv, nk, d, device=DEVICE, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, hkv, nk, d, device=DEVICE, generator=g).to(dtype).requires_grad_()
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, nq, nk, device=DEVICE, generator=g) > 0.2
    out = ta.triton_attention(q, k, v, mask, causal, None, window)
    dout = torch.randn(out.shape, device=DEVICE, generator=g).to(dtype)
    out.backward(dout)
    ours = [out, q.grad, k.grad, v.grad]

    # The same problem as one explicit mask for the reference and SDPA.
    full = mask
    if causal or window is not None:
        i = torch.arange(nq, device=DEVICE)[:, None]
        j = torch.arange(nk, device=DEVICE)[None, :]
        keep = torch.ones(nq, nk, dtype=torch.bool, device=DEVICE)
        if causal:
            keep &= j <= i
        if window is not None:
            if window[0] is not None:
                keep &= j >= i - window[0]
            if window[1] is not None:
                keep &= j <= i + window[1]
        full = keep if mask is None else mask & keep
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, full)
    ref.backward(dout.double())
    refs = [ref, q64.grad, k64.grad, v64.grad]
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
    peer = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=full, enable_gqa=hq != hkv)
    peer.backward(dout)
    peers = [torch.nan_to_num(t) for t in (peer, qt.grad, kt.grad, vt.grad)]
    row = {"case": f"B={b} Hq={hq} Hkv={hkv} Nq={nq} Nk={nk} D={d} {str(dtype)[6:]}"
                   f"{' causal' if causal else ''}{f' window={window}' if window else ''}"
                   f"{' bool mask' if mask_kind else ''}", "ok": True}
    for name, o, r, p in zip(("out", "dq", "dk", "dv"), ours, refs, peers):
        e_ours, e_torch = rel_err(o, r), rel_err(p, r)
        ok = bool(torch.isfinite(o).all()) and e_ours <= 2 * e_torch + 1e-6
        row[name] = {"err_ours": e_ours, "err_torch": e_torch, "ok": ok}
        row["ok"] &= ok
    return row


def sampled_rows_check(out, q, k, v, causal, rows=(0, 1, 1000, -1)) -> float:
    """Relative error of a few query rows of the forward against float64, all keys."""
    n, d = q.shape[2], q.shape[3]
    idx = torch.tensor([r % n for r in rows], device=DEVICE)
    s = (q[:, :, idx].double() @ k.double().transpose(-1, -2)) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.arange(k.shape[2], device=DEVICE)[None, None, None, :] > idx[None, None, :, None],
                          float("-inf"))
    ref = torch.softmax(s, -1) @ v.double()
    return rel_err(out[:, :, idx], ref)


def bench(fn, backward, inputs, out_like):
    if backward:
        grad = torch.randn_like(out_like)

        def step():
            for t in inputs:
                t.grad = None
            fn().backward(grad)

        return triton.testing.do_bench(step, warmup=10, rep=60, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def impls(q, k, v, causal):
    def ours():
        return ta.triton_attention(q, k, v, is_causal=causal)

    def pinned(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    return {"triton": ours, "sdpa.flash": pinned(SDPBackend.FLASH_ATTENTION),
            "sdpa.cudnn": pinned(SDPBackend.CUDNN_ATTENTION)}


def speed_rows(b, h, d, sizes) -> list:
    rows = []
    for n in sizes:
        for causal in (False, True):
            q, k, v = (torch.randn(b, h, n, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            t0 = time.time()
            with torch.no_grad():
                out = ta.triton_attention(q, k, v, is_causal=causal)  # chooses configs for this class
            torch.cuda.synchronize()
            check = sampled_rows_check(out, q, k, v, causal)
            log(f"  N={n} causal={causal}: forward configs chosen in {time.time() - t0:.1f}s, "
                f"sampled-row err {check:.2e}")
            for name, fn in impls(q, k, v, causal).items():
                for backward in (False, True):
                    row = {"impl": name, "n": n, "causal": causal, "pass": "fwd+bwd" if backward else "fwd",
                           "b": b, "h": h, "d": d, "dtype": "bfloat16"}
                    try:
                        t0 = time.time()
                        with torch.enable_grad() if backward else torch.no_grad():
                            ms = bench(fn, backward, (q, k, v), out)
                        row["ms"] = ms
                        row["tflops"] = flops(b, h, n, n, d, causal, backward) / ms / 1e9
                        if name == "triton":
                            row["sampled_row_err"] = check
                            row["setup_s"] = time.time() - t0
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    rows.append(row)
                    log(f"    {name:11s} {row['pass']:8s} " + (f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s"
                                                              if "ms" in row else row["error"]))
            del q, k, v, out
            torch.cuda.empty_cache()
    return rows


FWD_VARIANTS = [ta.KernelConfig(128, 64, 8, 3), ta.KernelConfig(128, 128, 8, 3), ta.KernelConfig(128, 64, 8, 4),
                ta.KernelConfig(128, 128, 8, 2), ta.KernelConfig(128, 64, 4, 3), ta.KernelConfig(64, 64, 4, 3)]
DKDV_VARIANTS = [ta.KernelConfig(16, 128, 8, 2), ta.KernelConfig(32, 128, 8, 2), ta.KernelConfig(32, 128, 8, 1),
                 ta.KernelConfig(64, 128, 8, 2), ta.KernelConfig(32, 64, 4, 1), ta.KernelConfig(16, 128, 8, 3)]
DQ_VARIANTS = [ta.KernelConfig(128, 64, 8, 2), ta.KernelConfig(128, 64, 8, 3), ta.KernelConfig(128, 32, 8, 3),
               ta.KernelConfig(128, 128, 8, 2), ta.KernelConfig(64, 32, 4, 2)]


def variant_rows(b, h, n, d, causal) -> list:
    """Each kernel on its own, under each forced config (the other kernels keep theirs)."""
    q, k, v = (torch.randn(b, h, n, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    scale = d ** -0.5
    args = (q, k, v, None, None, None, n, n, scale, causal, False, -1, -1, False)
    out, lse = ta.launch_fwd(*args[:-1])
    dout = torch.randn_like(out)
    bwd_args = (dout, q, k, v, out, lse, None, None, None, n, n, scale, causal, False, -1, -1)
    rows = []
    for kind, variants in (("fwd", FWD_VARIANTS), ("dkdv", DKDV_VARIANTS), ("dq", DQ_VARIANTS)):
        for cfg in variants:
            row = {"kernel": kind, "config": str(cfg), "n": n, "causal": causal}
            try:
                with ta.forced_configs(**{kind: cfg}):
                    if kind == "fwd":
                        ms = triton.testing.do_bench(lambda: ta.launch_fwd(*args[:-1]), warmup=5, rep=30,
                                                     return_mode="median")
                    else:
                        # The backward with this kernel forced; the other kernel's time is in too.
                        ms = triton.testing.do_bench(lambda: ta.launch_bwd(*bwd_args), warmup=5, rep=30,
                                                     return_mode="median")
                row["ms"] = ms
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            log(f"    {kind:5s} {str(cfg):18s} " + (f"{row['ms']:.3f} ms" if "ms" in row else row["error"]))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = os.path.join(os.environ["OUT"], "triton_attention.json") if os.environ.get("OUT") else None
    ap.add_argument("--out", default=default_out, help="JSON path (default $OUT/triton_attention.json)")
    ap.add_argument("--sizes", default="4096,16384", help="sequence lengths to time")
    ap.add_argument("--skip-variants", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.time()
    props = torch.cuda.get_device_properties(0)
    result = {
        "gpu": props.name, "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
        "triton": triton.__version__, "commit": git_commit(),
        "max_shared_mem": ta.max_shared_memory(torch.device("cuda", 0)),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "errors": [],
    }
    log(f"{props.name} (sm{props.major}{props.minor}), torch {torch.__version__}, triton {triton.__version__}, "
        f"shared memory per block {result['max_shared_mem']} B")

    section = section_runner(result, log)

    def correctness():
        rows = []
        # Correctness cases use the first fitting config, not timed choices, to save minutes.
        ta.CONFIGS.tune = False
        try:
            for case in CORRECTNESS:
                try:
                    row = check_correctness(case)
                except Exception as e:
                    row = {"case": str(case[:8]), "ok": False,
                           "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                rows.append(row)
                errs = " ".join(f"{k}={row[k]['err_ours']:.1e}/{row[k]['err_torch']:.1e}"
                                for k in ("out", "dq", "dk", "dv") if k in row)
                log(f"  {'PASS' if row['ok'] else 'FAIL'} {row['case']}  {errs or row.get('error')}")
        finally:
            ta.CONFIGS.tune = True
        return rows

    sizes = [int(s) for s in args.sizes.split(",")]
    result["correctness"] = section("correctness vs float64 (ours/torch error)", correctness)
    result["speed"] = section("speed, bf16 B=2 H=16 D=128", lambda: speed_rows(2, 16, 128, sizes))
    if not args.skip_variants:
        result["variants"] = section(
            f"config variants, bf16 B=2 H=16 D=128 N={max(sizes)}",
            lambda: variant_rows(2, 16, max(sizes), 128, False) + variant_rows(2, 16, max(sizes), 128, True))
    result["chosen_configs"] = {f"{kind} {key}": str(cfg) for (kind, key), cfg in ta.CONFIGS.chosen.items()}
    result["config_timings_ms"] = {f"{kind} {key}": t for (kind, key), t in ta.CONFIGS.timings.items()}
    result["wall_s"] = time.time() - t_start

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)

    # The short table, last.
    log("")
    log(f"configs chosen (kernel, causal, length bucket):")
    for (kind, key), cfg in ta.CONFIGS.chosen.items():
        log(f"  {kind:5s} causal={key[5]!s:5s} bucket={key[-1]:<6d} {cfg}")
    if result.get("variants"):
        log("fastest variant per kernel (N={}):".format(max(sizes)))
        for causal in (False, True):
            for kind in ("fwd", "dkdv", "dq"):
                timed = [r for r in result["variants"] if r["kernel"] == kind and r["causal"] == causal and "ms" in r]
                if timed:
                    best = min(timed, key=lambda r: r["ms"])
                    worst = max(timed, key=lambda r: r["ms"])
                    log(f"  {kind:5s} causal={causal!s:5s} best {best['config']} {best['ms']:.3f} ms "
                        f"(worst {worst['config']} {worst['ms']:.3f} ms)")
    if result.get("correctness"):
        bad = [r["case"] for r in result["correctness"] if not r["ok"]]
        log(f"correctness: {len(result['correctness']) - len(bad)}/{len(result['correctness'])} pass"
            + (f"; FAIL: {bad}" if bad else ""))
    if result.get("speed"):
        log(f"{'N':>6s} {'causal':6s} {'pass':8s} {'triton':>16s} {'sdpa.flash':>16s} {'sdpa.cudnn':>16s} "
            f"{'vs flash':>8s} {'vs cudnn':>8s}")
        for n in sizes:
            for causal in (False, True):
                for p in ("fwd", "fwd+bwd"):
                    got = {r["impl"]: r for r in result["speed"] if r["n"] == n and r["causal"] == causal and r["pass"] == p}

                    def cell(name):
                        r = got.get(name)
                        return f"{r['ms']:7.2f}ms {r['tflops']:5.0f}T" if r and "ms" in r else f"{'-':>16s}"

                    def ratio(name):
                        a, b = got.get("triton"), got.get(name)
                        return f"{b['ms'] / a['ms']:8.2f}" if a and b and "ms" in a and "ms" in b else f"{'-':>8s}"

                    log(f"{n:6d} {causal!s:6s} {p:8s} {cell('triton')} {cell('sdpa.flash')} {cell('sdpa.cudnn')} "
                        f"{ratio('sdpa.flash')} {ratio('sdpa.cudnn')}")
        log("ratios are peer time / triton time: above 1 means ours is faster.")
    for e in result["errors"]:
        log(f"ERROR {e}")
    log(f"total {result['wall_s']:.0f}s" + (f", JSON in {args.out}" if args.out else ""))
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
