"""Why a fuzz finding fails: for each configuration, the runner adaattn ran, its error, and the error
of each of torch's SDPA kernels pinned on the same (aligned) inputs, and of each adaattn runner
forced through a policy.

    python -m tests.fuzz.diagnose --device cuda --seed 4601 --indices 10,190,539
    python -m tests.fuzz.diagnose --device cuda --findings results.json   # every fail in a fuzz JSON
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import warnings

import torch

from tests.fuzz import sdpa as fz


def _errors(outs, refs, names, units) -> dict:
    errs = {}
    for name, o, r, unit in zip(names, outs, refs, units):
        if r is None or r.numel() == 0:
            continue
        errs[name] = fz.rel_err(o, r, unit)
    return errs


def diagnose(config: fz.Config, device: str) -> dict:
    import adaattn
    from adaattn import planner, stats
    from torch.nn.attention import SDPBackend

    planner.reset()
    inputs = fz.build(config, device)
    names = ["out"] + [f"d{n}" for n in ("q", "k", "v")[: 3 if config.grad else 0]] + (
        ["dmask"] if config.mask_grad and inputs.mask is not None else [])
    units = [fz._unit(inputs, config, n) for n in names]
    ref_in = fz._as64(inputs)
    ref_out, ref_grads = fz._forward_backward(lambda q, k, v, m, *mods: fz.reference(config, q, k, v, m, *mods), ref_in, config,
                                              fz._wrt(ref_in, config))
    refs = [ref_out] + ref_grads
    row = {"index": config.index, "status": fz.check(config, device)["status"]}

    def ours(policy):
        def call(q, k, v, m):
            return adaattn.attention(q, k, v, attn_mask=m, is_causal=config.causal, scale=config.scale,
                                     enable_gqa=config.enable_gqa, layout=config.layout, window=config.window,
                                     policy=policy)
        return call

    runs = {}
    with stats.collect() as recs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = fz.build(config, device)
        out, grads = fz._forward_backward(ours(fz.policy_of(config.policy)), fresh, config, fz._wrt(fresh, config))
        runs["ours"] = _errors([out] + grads, refs, names, units)
    row["ran"] = [r.backend for r in recs]
    for name in ("sdpa.cudnn", "sdpa.flash", "sdpa.efficient", "sdpa.math", "sdpa.cpu", "triton", "reference"):
        planner.reset()
        fresh = fz.build(config, device)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out, grads = fz._forward_backward(ours(adaattn.Policy(backends=(name,))), fresh, config,
                                                  fz._wrt(fresh, config))
            runs["ours:" + name] = _errors([out] + grads, refs, names, units)
        except Exception as e:  # noqa: BLE001 - declined or raised: say which
            runs["ours:" + name] = f"{type(e).__name__}: {str(e)[:150]}"
    backends = [None, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.MATH]
    for b in backends:
        key = "torch:" + ("default" if b is None else b.name.lower())
        fresh = fz._for_torch(fz.build(config, device), config) if device == "cuda" else fz.build(config, device)
        try:
            out, grads = fz._forward_backward(lambda q, k, v, m: fz.sdpa_yardstick(config, q, k, v, m, b), fresh,
                                              config, fz._wrt(fresh, config))
            runs[key] = _errors([out] + grads, refs, names, units)
        except Exception as e:  # noqa: BLE001
            runs[key] = f"{type(e).__name__}: {str(e)[:150]}"
    if hasattr(torch.backends.cuda, "allow_fp16_bf16_reduction_math_sdp"):
        fresh = fz._for_torch(fz.build(config, device), config) if device == "cuda" else fz.build(config, device)
        try:
            out, grads = fz.half_math(config, fresh, fz._wrt(fresh, config))
            runs["torch:math-half-inside"] = _errors([out] + grads, refs, names, units)
        except Exception as e:  # noqa: BLE001
            runs["torch:math-half-inside"] = f"{type(e).__name__}: {str(e)[:150]}"
    if device == "cuda" and inputs.mask is not None and inputs.mask.dtype != torch.bool:
        # torch's efficient kernel on the mask as the efficient runner floors it (finite_floor)
        from adaattn.backends.sdpa_forms import finite_floor

        fresh = fz._for_torch(fz.build(config, device), config)
        floored = finite_floor(fresh.mask.detach()).contiguous()
        fresh = fz.Inputs(fresh.q, fresh.k, fresh.v, floored, fresh.grad_out)
        try:
            out, grads = fz._forward_backward(
                lambda q, k, v, m: fz.sdpa_yardstick(config, q, k, v, m, SDPBackend.EFFICIENT_ATTENTION), fresh,
                config, fz._wrt(fresh, config)[:3])
            runs["torch:efficient+floor"] = _errors([out] + grads, refs, names, units)
        except Exception as e:  # noqa: BLE001
            runs["torch:efficient+floor"] = f"{type(e).__name__}: {str(e)[:150]}"
    row["errors"] = runs
    return row


def _fmt(errs) -> str:
    if isinstance(errs, str):
        return errs
    return " ".join(f"{k}={v:.2e}" if math.isfinite(v) else f"{k}=inf" for k, v in errs.items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--seed", type=int)
    p.add_argument("--indices", default="")
    p.add_argument("--findings", help="a fuzz JSON: diagnose its fails")
    p.add_argument("--policy", default="default")
    p.add_argument("--max-len", type=int, default=300)
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--json")
    p.add_argument("--modifiers", action="store_true")
    p.add_argument("--broadcast", action="store_true")
    args = p.parse_args(argv)
    todo = []
    if args.findings:
        d = json.load(open(args.findings))
        for f in d["findings"]:
            if f.get("status") == "fail":
                todo.append((d["seed"], f["index"], d.get("policy", "default"), d.get("max_len", 300),
                             bool(d.get("modifiers")), bool(d.get("broadcast"))))
    for i in filter(None, args.indices.split(",")):
        todo.append((args.seed, int(i), args.policy, args.max_len, args.modifiers, args.broadcast))
    rows = []
    for seed, index, policy, max_len, modifiers, broadcast in todo[: args.limit]:
        config = fz.draw(seed, index, args.device, policy, max_len, modifiers, broadcast)
        try:
            row = diagnose(config, args.device)
        except Exception as e:  # noqa: BLE001
            row = {"index": index, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        row["seed"] = seed
        row["repro"] = config.repro(args.device)
        c = config
        row["shape"] = (f"{c.dtype} B={c.batch} H={c.q_heads}/{c.kv_heads} N={c.q_len}/{c.kv_len} "
                        f"D={c.head_dim}/{c.value_dim} causal={c.causal} win={c.window} mask={c.mask} "
                        f"views={c.views} layout={c.layout}")
        rows.append(row)
        print(f"#{index} seed {seed} {row.get('status')} ran={row.get('ran')} {row['shape']}")
        for k, v in row.get("errors", {}).items():
            print(f"    {k:22s} {_fmt(v)}")
        if "error" in row:
            print("    ", row["error"])
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
