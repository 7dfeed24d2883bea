"""Where the quantized calls' time goes (GPU): the pieces of the fp8 level, its kernel's configs,
qk8's configs at 16k, and the host time of mode="auto" (with a profile of where it goes).

    PYTHONPATH=src python3 benchmarks/quant_breakdown_gpu.py [--out FILE] [--sections pieces,qk8,host]

Sections:
  pieces   bf16 B=2 H=16 D=128, N 4096/16384, not causal: cuDNN, the whole fp8 call (FP8 Q.K^T,
           warp-specialised), its K/V pre-pass, its Q pre-pass, and the attention kernel alone
           under each warp-specialised config, with its error. (The exp2-on-FMA variants of
           results/...-fp8-ws-exp-fma-h100.json ran in an earlier version of this section.)
  qk8      qk8 at N=16384, causal and not, under each candidate config.
  prepass  the K/V pre-pass alone, per key block (at 4k these are host times).
  gpu      eager time against CUDA-graph replay (GPU time alone) of cuDNN, our exact kernel,
           qk8 (general and warp-specialised, each config) and fp8, N 4096/16384, causal or not.
  host     host time per call (GPU kept busy) of the fp8/qk8 calls and of mode="auto" at
           tau 3e-2 / 8e-2, with the policy's verify rate and with verify=0, at N=4096; and the
           20 functions with the most own time in 100 auto calls (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
import triton.testing  # noqa: E402

import adaattn  # noqa: E402
from adaattn.backends import triton_attention as ta  # noqa: E402
from adaattn.backends import triton_quant as tq  # noqa: E402
from gpu_timing import graph_ms, host_us_per_call, section_runner  # noqa: E402

DEVICE = "cuda"
B, H, D = 2, 16, 128


def log(msg: str) -> None:
    print(msg, flush=True)


def bench(fn, rep=60) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def inputs(n, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed + n)
    return tuple(torch.randn(B, H, n, D, device=DEVICE, generator=g, dtype=torch.bfloat16) for _ in range(3))


def cudnn(q, k, v, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def pieces(rows):
    qk_mode, pv_mode = tq.level_modes(tq.LEVEL_FP8, True)
    for n in (4096, 16384):
        q, k, v = inputs(n)
        flops = 4 * B * H * n * n * D
        base = bench(lambda: cudnn(q, k, v, False))
        rows.append({"piece": "sdpa.cudnn", "n": n, "ms": base})
        whole = bench(lambda: tq.quant_attention(q, k, v, levels=[tq.LEVEL_FP8], fp8_qk=True))
        rows.append({"piece": "fp8 whole call", "n": n, "ms": whole, "vs_cudnn": base / whole})
        kv = bench(lambda: tq.Prepared(k, v).get(qk_mode, pv_mode, 128))
        rows.append({"piece": "K/V pre-pass", "n": n, "ms": kv})
        qq = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
        qs = torch.empty((B * H, n), dtype=torch.float32, device=DEVICE)

        def qpass():
            tq.quantize_q_kernel[(triton.cdiv(n, 64), B * H)](
                q, qq, qs, q.stride(0), q.stride(1), q.stride(2), H, n, n, HEAD_DIM=D, BLOCK_M=64, EMULATE=False,
                num_warps=4, num_stages=1)
        qms = bench(qpass)
        rows.append({"piece": "Q pre-pass", "n": n, "ms": qms})
        log(f"N={n}: cuDNN {base:.3f} ms, fp8 whole {whole:.3f} ({base / whole:.2f}x), K/V pre-pass {kv:.3f}, "
            f"Q pre-pass {qms:.3f}")
        prepared = tq.Prepared(k, v)
        out = torch.empty_like(q)
        idx = torch.randperm(n, device=DEVICE)[:256].sort().values
        s64 = (q[:, :, idx].double() @ k.double().transpose(-1, -2)) * D ** -0.5
        ref = torch.softmax(s64, -1) @ v.double()
        del s64
        for cfg in (ta.KernelConfig(128, 256, 4, 2), ta.KernelConfig(128, 128, 4, 2), ta.KernelConfig(128, 64, 4, 2)):
            row = {"piece": "fp8 ws kernel + Q pre-pass", "config": str(cfg), "n": n}
            try:
                with ta.forced_configs(quant_fp8_ws=cfg):
                    prepared.get(qk_mode, pv_mode, cfg.block_n)
                    ms = bench(lambda: tq._launch_quant_ws(tq.LEVEL_FP8, q, v, prepared, out, D ** -0.5, False, False))
                    whole_cfg = bench(lambda: tq.quant_attention(q, k, v, levels=[tq.LEVEL_FP8], fp8_qk=True))
                    o = tq.quant_attention(q, k, v, levels=[tq.LEVEL_FP8], fp8_qk=True)
                err = ((o[:, :, idx].double() - ref).norm() / ref.norm()).item()
                row.update(ms=ms, kernel_ms=ms - qms, kernel_tflops=flops / (ms - qms) / 1e9,
                           kernel_vs_cudnn=base / (ms - qms), whole_ms=whole_cfg, whole_vs_cudnn=base / whole_cfg,
                           err=err)
                log(f"  {cfg}: kernel {ms - qms:.3f} ms ({flops / (ms - qms) / 1e9:.0f} TFLOP/s, "
                    f"{base / (ms - qms):.2f}x cuDNN), whole call {whole_cfg:.3f} ms ({base / whole_cfg:.2f}x), "
                    f"err {err:.4f}")
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"  {cfg}: {row['error']}")
            rows.append(row)
        del q, k, v, prepared, out
        torch.cuda.empty_cache()


def prepass(rows):
    """The K/V pre-pass: the means alone, and the means + quantization per key block (at 4k
    the pre-pass alone is host-bound: these are then host times)."""
    qk_mode, pv_mode = tq.level_modes(tq.LEVEL_FP8, True)
    for n in (4096, 16384):
        q, k, v = inputs(n)
        stats = bench(lambda: tq.Prepared(k, v).v_mean())
        rows.append({"piece": "V mean alone (means-only launch)", "n": n, "ms": stats})
        log(f"N={n}: V mean {stats:.3f} ms")
        for block_n in (64, 128, 256):
            ms = bench(lambda: tq.Prepared(k, v).get(qk_mode, pv_mode, block_n))
            ms8 = bench(lambda: tq.Prepared(k, v).get(*tq.level_modes(tq.LEVEL_QK8), block_n))
            rows.append({"piece": "K/V pre-pass", "n": n, "block_n": block_n, "fp8_ms": ms, "qk8_ms": ms8})
            log(f"  block {block_n}: fp8 pre-pass {ms:.3f} ms, qk8 {ms8:.3f} ms")
        del q, k, v
        torch.cuda.empty_cache()


def gpu_vs_eager(rows):
    """Each call eager (what a caller sees, host time included where it exceeds the GPU's) and
    replayed from a CUDA graph (GPU time only), not causal and causal, N 4096 and 16384; the
    warp-specialised qk8 kernel under each of its configs."""
    for n in (4096, 16384):
        q, k, v = inputs(n)
        for causal in (False, True):
            fns = {
                "sdpa.cudnn": lambda: cudnn(q, k, v, causal),
                "triton.exact": lambda: ta.triton_attention(q, k, v, is_causal=causal),
                "quant.qk8 (general kernel)": lambda: _general(
                    lambda: tq.quant_attention(q, k, v, levels=[tq.LEVEL_QK8], causal=causal)),
                "quant.fp8_fp8qk": lambda: tq.quant_attention(q, k, v, levels=[tq.LEVEL_FP8], causal=causal,
                                                              fp8_qk=True),
            }
            for cfg in tq.QK8_WS_CONFIGS:
                fns[f"quant.qk8 ws {cfg}"] = (lambda cfg=cfg: _forced(
                    cfg, lambda: tq.quant_attention(q, k, v, levels=[tq.LEVEL_QK8], causal=causal)))
            with torch.no_grad():
                for name, fn in fns.items():
                    row = {"piece": "gpu vs eager", "impl": name, "n": n, "causal": causal}
                    try:
                        fn()
                        torch.cuda.synchronize()
                        row["eager_ms"] = bench(fn)
                        row["graph_ms"] = graph_ms(fn)
                        log(f"N={n} causal={causal} {name:40s} eager {row['eager_ms']:.3f} ms, "
                            f"GPU (graph) {row['graph_ms']:.3f} ms")
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                        log(f"N={n} causal={causal} {name:40s} {row['error']}")
                    rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()


def _general(fn):
    with ta.kernel_variants(fwd="ptr"):
        return fn()


def _forced(cfg, fn):
    with ta.forced_configs(quant_qk8_ws=cfg):
        return fn()


def qk8_configs(rows):
    n = 16384
    q, k, v = inputs(n)
    for causal in (False, True):
        base = bench(lambda: cudnn(q, k, v, causal), rep=40)
        exact = bench(lambda: ta.triton_attention(q, k, v, is_causal=causal), rep=40)
        log(f"N={n} causal={causal}: cuDNN {base:.3f} ms, exact {exact:.3f} ms")
        rows.append({"piece": "sdpa.cudnn", "n": n, "causal": causal, "ms": base})
        rows.append({"piece": "triton.exact", "n": n, "causal": causal, "ms": exact})
        for cfg in tq.QUANT_CONFIGS[D]:
            row = {"piece": "qk8", "config": str(cfg), "n": n, "causal": causal}
            try:
                with ta.forced_configs(quant_qk8=cfg):
                    ms = bench(lambda: tq.quant_attention(q, k, v, levels=[tq.LEVEL_QK8], causal=causal), rep=40)
                row.update(ms=ms, vs_exact=exact / ms)
                log(f"  qk8 {cfg}: {ms:.3f} ms ({exact / ms:.2f}x exact)")
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"  qk8 {cfg}: {row['error']}")
            rows.append(row)


def host(rows, result):
    n = 4096
    q, k, v = inputs(n)
    for causal in (False, True):
        fns = {
            "quant.qk8": lambda: tq.quant_attention(q, k, v, levels=[tq.LEVEL_QK8], causal=causal),
            "quant.fp8 (auto Q.K^T)": lambda: tq.quant_attention(
                q, k, v, levels=[tq.LEVEL_FP8], causal=causal, fp8_qk=tq.fp8_level_uses_fp8_qk(q, None, causal, -1, -1)),
            "sdpa.cudnn": lambda: cudnn(q, k, v, causal),
        }
        for tau in (3e-2, 8e-2):
            for verify in (0.05, 0.0):
                pol = adaattn.Policy(mode="auto", precisions=("native", "int8", "fp8"), tolerance=tau, verify=verify)
                label = f"host-{tau}-{verify}-{causal}"
                fns[f"auto tau={tau:g} verify={verify:g}"] = (
                    lambda pol=pol, label=label: adaattn.attention(q, k, v, is_causal=causal, policy=pol, label=label))
        with torch.no_grad():
            for name, fn in fns.items():
                for _ in range(30):
                    fn()
                torch.cuda.synchronize()
                gpu = bench(fn)
                hosts = sorted(host_us_per_call(fn, calls=100, sleep_cycles=400_000_000) for _ in range(3))
                rows.append({"piece": "host", "impl": name, "n": n, "causal": causal, "ms": gpu, "host_us": hosts[1]})
                log(f"N={n} causal={causal} {name:30s} {gpu:.3f} ms, host {hosts[1]:.0f} us/call ({hosts})")
            for name in ("auto tau=0.08 verify=0.05", "auto tau=0.03 verify=0.05"):
                fn = fns[name]
                torch.cuda.synchronize()
                torch.cuda._sleep(600_000_000)
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(100):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
                text = s.getvalue()
                result.setdefault("profiles", {})[f"{name} causal={causal}"] = text
                log(f"--- profile {name} causal={causal}\n{text[:6000]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "quant_breakdown.json"))
    ap.add_argument("--sections", default="pieces,qk8,host")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": args.commit, "shape": f"bf16 B={B} H={H} D={D}", "rows": [], "errors": []}
    section = section_runner(result, log, time.time())
    for name in args.sections.split(","):
        section(name, lambda name=name: {"pieces": pieces, "qk8": qk8_configs, "prepass": prepass, "gpu": gpu_vs_eager}.get(name, None)(result["rows"])
                if name != "host" else host(result["rows"], result))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
