"""Tokens per second of a GPT training step (forward + backward, bf16) with adaattn and with SDPA.

    PYTHONPATH=src python3 benchmarks/gpt_step.py --out OUT

A GPT-2-medium-sized model of adaattn.models.gpt (24 layers, d=1024, 16 heads of 64, SwiGLU
of the same parameter count as GPT-2's 4x MLP, byte vocabulary) at sequence length 8192,
float32 weights under bf16 autocast. The batch is the largest that fits for every attention
kind (estimated from the memory of one sequence, then tried downwards); where not even one
sequence fits, activation checkpointing is switched on. The same weights and batch are timed
with each kind in interleaved rounds; the figure is the median round. Prints a table and
writes gpt_step-<date>-<gpu>.json to --out.

Kinds: sdpa (torch.nn.functional.scaled_dot_product_attention), adaattn (adaattn.attention,
its own dispatch), adaattn:NAME (adaattn.attention pinned to backend NAME, e.g. triton).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from adaattn import stats as ada_stats  # noqa: E402
from adaattn.backends import REGISTRY  # noqa: E402
from adaattn.bench.report import git_commit, slug  # noqa: E402
from adaattn.hardware import triton_version  # noqa: E402
from adaattn.models.gpt import GPT, GPTConfig, parse_attention  # noqa: E402


def default_kinds() -> list[str]:
    kinds = ["sdpa", "adaattn"]
    if "triton" in REGISTRY:
        kinds.insert(1, "adaattn:triton")
    return kinds


def flops_per_step(config: GPTConfig, params: int, batch: int, seq_len: int, checkpoint: bool) -> float:
    """Model FLOPs of forward + backward: 6 per parameter per token for the matrices, and
    attention as MEASURING.md counts it (causal forward 2*B*H*N^2*D, forward + backward 3.5x).
    Recomputation under checkpointing is not counted (it is work the model does not need)."""
    del checkpoint
    matmul = 6.0 * params * batch * seq_len
    attn = 3.5 * 2.0 * batch * config.n_head * seq_len * seq_len * config.head_dim * config.n_layer
    return matmul + attn


class Runner:
    """One batch of random bytes; `step()` is forward, backward and (with `opt`) an optimizer step."""

    def __init__(self, model: GPT, batch: int, seq_len: int, device, opt, seed: int):
        self.model = model
        gen = torch.Generator(device=device).manual_seed(seed)
        self.x = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen, device=device)
        self.y = torch.roll(self.x, -1, dims=1)
        self.opt = opt

    def step(self) -> torch.Tensor:
        with torch.autocast(self.x.device.type, dtype=torch.bfloat16):
            _, loss = self.model(self.x, self.y)
        loss.backward()
        if self.opt is not None:
            self.opt.step()
        self.model.zero_grad(set_to_none=True)
        return loss.detach()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def try_batch(model, kinds, batch, args, device, log) -> tuple[dict, dict]:
    """One step of every kind at `batch`: ({kind: peak MiB}, {kind: error}); raises OutOfMemoryError."""
    peaks, errors = {}, {}
    for kind in kinds:
        model.set_attention(*parse_attention(kind))
        runner = None
        try:
            free_memory()
            cuda = device.type == "cuda"
            base = torch.cuda.memory_allocated(device) if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            runner = Runner(model, batch, args.seq_len, device, args.opt, args.seed)
            runner.step()
            sync(device)
            peaks[kind] = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if cuda else None
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # a kernel that fails: report it and time the others
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:600] if str(e).strip() else ''}"
            errors[kind] = msg
            log(f"  {kind} failed at batch {batch}: {msg}")
        finally:
            del runner
            model.zero_grad(set_to_none=True)
    return peaks, errors


def find_batch(model, kinds, args, device, log) -> tuple[int, bool, dict, dict]:
    """The largest batch <= --max-batch at which every working kind runs a step, with or without
    activation checkpointing; returns (batch, checkpoint, peaks MiB at that batch, errors)."""
    total = torch.cuda.get_device_properties(device).total_memory
    modes = {"no": [False], "yes": [True], "auto": [False, True]}[args.checkpoint]
    errors: dict = {}
    if args.opt is not None:  # allocate the optimizer state before anything is measured
        try_batch(model, kinds[:1], 1, args, device, lambda *_: None)
    for ckpt in modes:
        model.checkpoint = ckpt
        try:
            free_memory()
            static = torch.cuda.memory_allocated(device)
            peaks, errs = try_batch(model, kinds, 1, args, device, log)
        except torch.OutOfMemoryError:
            log(f"batch 1 does not fit{' with checkpointing' if ckpt else ''}")
            continue
        errors.update(errs)
        kinds = [k for k in kinds if k not in errs]
        if not kinds:
            break
        grads = sum(p.numel() * 4 for p in model.parameters())
        per_seq = max(peaks.values()) * 2**20 - grads  # the peak holds the gradients once
        room = total * 0.92 - static - grads
        estimate = max(1, min(args.max_batch, int(room // per_seq)))
        log(f"checkpointing {'on' if ckpt else 'off'}: one sequence needs {per_seq / 2**30:.1f} GiB; "
            f"trying batch {estimate} and down")
        if estimate == 1 and ckpt is False and len(modes) > 1 and args.max_batch > 1:
            continue  # one sequence only: checkpointing is likely the better trade
        for batch in range(estimate, 0, -1):
            try:
                peaks_b, errs = try_batch(model, kinds, batch, args, device, log)
            except torch.OutOfMemoryError:
                log(f"  batch {batch}: out of memory")
                free_memory()
                continue
            errors.update(errs)
            return batch, ckpt, peaks_b, errors
    raise SystemExit("gpt_step: not even one sequence fits with any kind")


def time_kinds(model, kinds, batch, args, device, log) -> dict:
    """Interleaved rounds of --steps steps per kind; ms per step per round."""
    runners, results, losses = {}, {k: [] for k in kinds}, {}
    for kind in kinds:
        model.set_attention(*parse_attention(kind))
        runners[kind] = Runner(model, batch, args.seq_len, device, args.opt, args.seed)
        for _ in range(args.warmup):
            loss = runners[kind].step()
        losses[kind] = float(loss)
    backends = {}
    for kind in kinds:
        model.set_attention(*parse_attention(kind))
        if kind == "sdpa":
            backends[kind] = ["torch sdpa"]
            continue
        with ada_stats.collect() as records, torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            model(runners[kind].x[:1])
        backends[kind] = sorted({r.backend for r in records})
    for r in range(args.rounds):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        for kind in order:
            model.set_attention(*parse_attention(kind))
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                runners[kind].step()
            sync(device)
            results[kind].append((time.perf_counter() - t0) / args.steps * 1e3)
        log(f"  round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {results[k][-1]:.1f} ms" for k in kinds))
    return {"ms_per_round": results, "loss_after_warmup": losses, "backends": backends}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write gpt_step-<date>-<gpu>.json here")
    p.add_argument("--attn", default=None, help="comma-separated kinds (default: sdpa, adaattn:triton, adaattn)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--mlp-hidden", type=int, default=2752,
                   help="SwiGLU width; 2752 ~ GPT-2's 4x GELU MLP in parameters (default)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=None, help="fixed batch (default: the largest that fits)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--checkpoint", choices=("auto", "yes", "no"), default="auto",
                   help="activation checkpointing: auto = only where one sequence does not fit otherwise")
    p.add_argument("--optimizer", action="store_true", help="include a fused AdamW step in each step")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per kind")
    p.add_argument("--steps", type=int, default=5, help="timed steps per kind per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda (default) or cpu (a smoke test: needs --batch)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" and args.batch is None:
        print("gpt_step: on the CPU give --batch (the batch search measures CUDA memory)", file=sys.stderr)
        return 2
    kinds = args.attn.split(",") if args.attn else default_kinds()
    for k in kinds:
        parse_attention(k)
    started = time.perf_counter()

    def log(msg=""):
        print(msg, flush=True)

    config = GPTConfig(n_layer=args.layers, n_head=args.heads, n_kv_head=args.kv_heads or args.heads, d_model=args.d_model,
                       mlp_hidden=args.mlp_hidden, train_seq_len=args.seq_len)
    torch.manual_seed(args.seed)
    model = GPT(config).to(device)
    params = model.num_params()
    # One optimizer for every kind (its state is allocated by the first step, before the batch search measures).
    args.opt = (torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda" or None)
                if args.optimizer else None)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {platform.machine()}"
    log(f"gpt_step on {gpu}: torch {torch.__version__}, triton {triton_version()}, commit {(git_commit() or '?')[:12]}")
    log(f"model: {args.layers} layers, d={args.d_model}, {args.heads} heads ({config.n_kv_head} kv) of "
        f"{config.head_dim}, MLP {config.hidden}, {params / 1e6:.0f}M parameters, seq {args.seq_len}, "
        f"bf16 autocast, {'fwd+bwd+AdamW' if args.optimizer else 'fwd+bwd'}; kinds: {', '.join(kinds)}")

    errors: dict = {}
    if args.batch is None:
        batch, ckpt, peaks, errors = find_batch(model, kinds, args, device, log)
    else:
        batch, ckpt = args.batch, args.checkpoint == "yes"
        model.checkpoint = ckpt
        peaks, errors = try_batch(model, kinds, batch, args, device, log)
    kinds = [k for k in kinds if k not in errors]
    log(f"batch {batch} x {args.seq_len} tokens, activation checkpointing {'on' if ckpt else 'off'}")
    timed = time_kinds(model, kinds, batch, args, device, log)

    tokens = batch * args.seq_len
    flops = flops_per_step(config, params, batch, args.seq_len, ckpt)
    rows = []
    for kind in kinds:
        ms = statistics.median(timed["ms_per_round"][kind])
        rows.append({"attention": kind, "backends": timed["backends"][kind], "ms_per_step": ms,
                     "tokens_per_s": tokens / (ms * 1e-3), "model_tflops": flops / (ms * 1e-3) / 1e12,
                     "peak_mib": peaks.get(kind), "ms_per_round": timed["ms_per_round"][kind],
                     "loss_after_warmup": timed["loss_after_warmup"][kind]})
    peer = next((r for r in rows if r["attention"] == "sdpa"), None)
    for r in rows:
        r["x_sdpa"] = None if peer is None else r["tokens_per_s"] / peer["tokens_per_s"]

    log(f"\n{'attention':<16} {'ran on':<14} {'ms/step':>9} {'tokens/s':>11} {'x sdpa':>7} {'TFLOP/s':>8} "
        f"{'peak GiB':>9} {'loss':>8}")
    for r in rows:
        log(f"{r['attention']:<16} {','.join(r['backends'])[:14]:<14} {r['ms_per_step']:>9.1f} "
            f"{r['tokens_per_s']:>11,.0f} {r['x_sdpa'] if r['x_sdpa'] is not None else float('nan'):>7.3f} "
            f"{r['model_tflops']:>8.1f} {(r['peak_mib'] or 0) / 1024:>9.1f} {r['loss_after_warmup']:>8.4f}")
    for k, e in errors.items():
        log(f"not timed: {k}: {e}")
    if args.out is not None:
        when = datetime.datetime.now(datetime.timezone.utc)
        record = {
            "schema": "adaattn-gpt-step/1", "date": when.isoformat(timespec="seconds"), "gpu": gpu,
            "python": platform.python_version(), "torch": torch.__version__, "triton": triton_version(),
            "cuda": torch.version.cuda, "git_commit": git_commit(),
            "command": "PYTHONPATH=src python3 benchmarks/gpt_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "config": config.as_dict(), "parameters": params, "batch": batch, "seq_len": args.seq_len,
            "tokens_per_step": tokens, "activation_checkpointing": ckpt, "optimizer_step": args.optimizer,
            "method": (f"median over {args.rounds} interleaved rounds of {args.steps} steps (after {args.warmup} "
                       "warm-up steps per kind) of wall time with a CUDA synchronize around each round; "
                       "model TFLOP/s counts 6 FLOPs per parameter per token plus causal attention "
                       "2*B*H*N^2*D forward x3.5, no recomputation"),
            "rows": rows, "errors": errors, "wall_s": round(time.perf_counter() - started, 1),
        }
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"gpt_step-{when.strftime('%Y%m%d-%H%M%S')}-{slug(gpu)}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        log(f"wrote {path}")
    log(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
