"""calibrate: every exact runner timed alone on a grid of problems; the times become the cost data
the planner reads (adaattn.costs). `--install` writes them to the user's cache, where later
processes on this machine find them; `--out DIR` also writes them beside the JSON of the run."""

from __future__ import annotations

import contextlib

import torch

from ... import costs, hardware, planner
from ...policy import Policy
from ...problem import validate
from ..cases import Case, Peer
from ..dense import random_qkv
from ..grid import dtype_name
from . import options

NAME = "calibrate"
HELP = ("every exact runner alone (planner.bind), and each quantized runner with every head at one level "
        "(exact/qk8/fp8, steady state), on bf16 B=2 H=16 D 64/128 N 512-16k causal and not, and decode "
        "B=16 Hq=32 Hkv=8 KV 1k-32k (CPU: float32 B=1 H=4 D=64 N 128-1k): the cost data the planner reads; "
        "--install writes it to the user cache (adaattn.costs.user_path()); on CUDA also each runner's host time a "
        "small call (B=1 H=8 N=64 D=64), which predictions add; x the runner adaattn picks")
# Never the fastest on a GPU, and a memory hog at long lengths: not calibrated there.
SKIP_CUDA = ("sdpa.math", "reference")
NEEDS_CUDA = False
PREFILL_CUDA = dict(batch=2, heads=16, kv_heads=16, head_dims=(64, 128), lens=(512, 1024, 2048, 4096, 8192, 16384),
                    dtypes=(torch.bfloat16,))
DECODE_CUDA = dict(batch=16, heads=32, kv_heads=8, head_dims=(128,), lens=(1024, 4096, 16384, 32768),
                   dtypes=(torch.bfloat16,))
PREFILL_CPU = dict(batch=1, heads=4, kv_heads=4, head_dims=(64,), lens=(128, 512, 1024), dtypes=(torch.float32,))


def cases(args, device):
    out = []
    seed = options.seed(args)
    if device.type == "cuda":
        plans = [(PREFILL_CUDA, False), (DECODE_CUDA, True)]
    else:
        plans = [(PREFILL_CPU, False)]
    for spec, decode in plans:
        lens = getattr(args, "seq_lens", None) or spec["lens"]
        for dtype in spec["dtypes"]:
            for d in spec["head_dims"]:
                for causal in ((False,) if decode else (False, True)):
                    for n in lens:
                        out.append(_case(spec, dtype, d, n, causal, decode, device, seed + len(out)))
    return out


def _case(spec, dtype, d, n, causal, decode, device, seed):
    b, hq, hkv = spec["batch"], spec["heads"], spec["kv_heads"]
    nq = 1 if decode else n
    meta = (torch.empty(b, hq, nq, d, dtype=dtype, device="meta"), torch.empty(b, hkv, n, d, dtype=dtype, device="meta"))
    problem = validate(meta[0], meta[1], meta[1], None, 0.0, causal, None, hq != hkv, "bhsd", None)
    problem = _on(problem, device)
    fields = {"batch": b, "heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": dtype_name(dtype), "q_len": nq,
              "kv_len": n, "causal": causal}
    series = f"{'decode' if decode else 'prefill'} B={b} Hq={hq} Hkv={hkv} D={d} {dtype_name(dtype)}" + \
             (" causal" if causal else "")
    baseline = planner.make_plan(problem, Policy()).backend
    arch = hardware.arch(problem.device_type, problem.device_index)

    def make():
        q, k, v = random_qkv(b, hq, hkv, nq, n, d, dtype, device, seed)
        peers = []
        for name in planner.runner_names():
            if not planner.REGISTRY[name].exact or (device.type == "cuda" and name in SKIP_CUDA):
                continue
            try:
                fn = planner.bind(name, problem)
            except (planner.NoBackendError, ValueError):
                continue
            peers.append(Peer(name, forward=lambda fn=fn: fn(q, k, v),
                              info=lambda name=name: {"runner": name, "arch": arch}))
        peers += _level_peers(problem, q, k, v, arch)
        return peers, None

    return Case(NAME, f"{series} N={n}", n, {**fields, "problem": problem}, baseline, "TFLOP/s",
                costs.work(problem) * 2, make, series=series)


def _level_peers(problem, q, k, v, arch) -> list:
    """Each quantized runner that takes the problem under mode="auto", with every head held at
    one level (no verification): the steady state of a call site at that level. Entries are
    named "<runner>:<level>" (adaptive/choice.py reads them)."""
    from ...adaptive import choice, controller
    from ...adaptive import quant_launch as tq

    if problem.device_type == "cpu":
        return []  # the interpreter: a correctness path, never timed
    policy = Policy(mode="auto", precisions=("native", "int8", "fp8"))
    out = []
    for name, runner in planner.REGISTRY.items():
        if runner.exact or runner.supports(problem, policy):
            continue
        launch = runner.prepare(problem, policy)
        fp8_qk = tq.fp8_level_uses_fp8_qk(q, None, problem.causal, -1, -1)
        for level in (tq.LEVEL_EXACT, *launch.levels):
            ctl = controller.held_at(f"calibrate {name} {level}", level, problem.q_heads, fp8_qk=fp8_qk,
                                     allow_ws=launch.allow_ws, runner=name)
            entry = choice.level_entry(name, level)

            def forward(ctl=ctl):
                return ctl.run(q, k, v, None, problem.scale, problem.causal, False, -1, -1)[0]

            out.append(Peer(entry, forward=forward, info=lambda entry=entry: {"runner": entry, "arch": arch}))
    return out


def _on(problem, device):
    """The problem as it will be on `device` (made from meta tensors, so nothing is allocated)."""
    from dataclasses import replace

    return replace(problem, device_type=device.type, device_index=device.index, tma_aligned=True)


# A small call (its time is host time): each exact runner's host time a forward call, on CUDA.
HOST_CALL = dict(batch=1, heads=8, kv_heads=8, q_len=64, kv_len=64, head_dim=64, dtype=torch.bfloat16)


def host_entries(device: torch.device, seed: int = 0) -> list[dict]:
    """Each exact runner's host time a call (planner.bind: the runner alone, no dispatch) on
    HOST_CALL, issued while the GPU sleeps (bench/suites/host.py's method): costs.host_entry rows."""
    from .host import _cycles_per_ms, _host_us

    c = HOST_CALL
    q, k, v = random_qkv(c["batch"], c["heads"], c["kv_heads"], c["q_len"], c["kv_len"], c["head_dim"], c["dtype"],
                         device, seed)
    problem = validate(q, k, v, None, 0.0, False, None, False, "bhsd", None)
    arch = hardware.arch(problem.device_type, problem.device_index)
    cycles = int(_cycles_per_ms() * 60)
    out = []
    for name in planner.runner_names():
        if not planner.REGISTRY[name].exact or name in SKIP_CUDA:
            continue
        try:
            fn = planner.bind(name, problem)
            for _ in range(3):
                fn(q, k, v)
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a runner that cannot take the call has no host figure
            continue
        out.append(costs.host_entry(name, arch, round(_host_us(lambda fn=fn: fn(q, k, v), contextlib.nullcontext,
                                                               cycles), 2)))
    return out


def finish(args, rows) -> list[str]:
    """Turn the timed rows into cost entries (and, on CUDA, each runner's host time a call:
    host_entries); write them where asked. Returns what was written."""
    entries = []
    cuda = False
    for r in rows:
        problem = r.pop("problem", None)
        if problem is None or r.get("ms") is None or r.get("runner") is None:
            continue
        cuda = cuda or problem.device_type == "cuda"
        entries.append(costs.entry(r["runner"], r["arch"], problem, r["ms"]))
    written = []
    if cuda and (getattr(args, "out", None) is not None or getattr(args, "install", False)):
        entries += host_entries(torch.device("cuda", torch.cuda.current_device()))
    if getattr(args, "out", None) is not None:
        written.append(str(costs.write(args.out / "costs.json", entries, merge=False)))
    if getattr(args, "install", False):
        written.append(str(costs.write(costs.user_path(), entries)))
        costs.load(force=True)
    return written
