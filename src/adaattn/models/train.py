"""Train the byte-level GPT of adaattn.models on this Python's standard library sources (the
recipe of the shipped weights; it once lived at benchmarks/train_gpt.py, the name the weights' record gives).

    python3 -m adaattn.models.train --both --out OUT      # the shipped run (GPU)
    python3 -m adaattn.models.train --attn sdpa --steps 2000 --out OUT

--both trains two models of the same config and seed on the same batches in one process, one
with adaattn's exact attention (our Triton kernels where they run, else adaattn's dispatch) and
one with torch SDPA, and compares their held-out bits per byte. Without --steps each run gets
--minutes of training: a few timed steps of each kind first set one step count that both fit.
OUT receives (at most 8 files, none in sub-folders):
  train_log.json       config, corpus, environment, each run's loss log and held-out results
  loss_curves.png      train and held-out loss of every run
  gpt_stdlib.pt        the first run's weights (int8, one scale per row), for
                       src/adaattn/models/weights/
  eval.json            `adaattn eval` of those stored weights at --eval-context: held-out bits
                       per byte, per-layer error of exact attention, attention entropy per head
  attention_heads.png  a few heads of that evaluation
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from .. import stats as ada_stats  # noqa: E402
from ..hardware import triton_version  # noqa: E402
from ..planner import REGISTRY, NoBackendError, make_plan  # noqa: E402
from ..policy import Policy  # noqa: E402
from ..version import git_commit  # noqa: E402
from . import evaluate as ev  # noqa: E402
from . import pretrained  # noqa: E402
from .data import load_corpus, random_batch, unigram_bits_per_byte  # noqa: E402
from .gpt import GPT, GPTConfig, parse_attention  # noqa: E402

try:
    from tqdm import tqdm
except Exception:  # no tqdm: a plain line every few seconds
    tqdm = None


# ---- what one run is ---------------------------------------------------------------------


def our_kernels(device: torch.device) -> str:
    """'adaattn:triton' where our Triton runners run here, else 'adaattn'."""
    if device.type != "cuda":
        return "adaattn"
    from ..problem import validate

    q = torch.empty(1, 2, 16, 64, device=device, dtype=torch.bfloat16)
    problem = validate(q, q, q, None, 0.0, True, None, False)
    try:  # the planner answers whether a Triton runner takes a plain training call here
        runs = any(REGISTRY[n].exact for n in make_plan(problem, Policy(backends=("triton",))).candidates)
    except NoBackendError:
        runs = False
    return "adaattn:triton" if runs else "adaattn"


def lr_at(step: int, steps: int, peak: float, warmup: int, floor_ratio: float) -> float:
    """Linear warm-up to `peak`, then cosine down to floor_ratio * peak at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


class Trainer:
    """One model, optimizer and data stream; `step()` runs one optimizer step on one batch."""

    def __init__(self, args, config: GPTConfig, spec: str, train_data: torch.Tensor, device: torch.device):
        self.args, self.spec, self.device = args, spec, device
        kind, policy = parse_attention(spec)
        torch.manual_seed(args.seed)  # the same initial weights for every run
        self.model = GPT(config, policy=policy, attention=kind, checkpoint=args.checkpoint).to(device)
        self.forward = torch.compile(self.model) if args.compile else self.model
        self.opt = self.model.optimizer(args.lr, args.weight_decay, fused=device.type == "cuda" or None)
        self.data = train_data.to(device)
        self.gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda"
                         else contextlib.nullcontext())

    def step(self, i: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        args = self.args
        lr = lr_at(i, steps, args.lr, min(args.warmup, max(1, steps // 10)), args.min_lr_ratio)
        for group in self.opt.param_groups:
            group["lr"] = lr
        x, y = random_batch(self.data, args.seq_len, args.batch, self.gen)
        with self.autocast:
            _, loss = self.forward(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach(), norm.detach()


def backends_used(trainer: Trainer) -> list[str]:
    """Which adaattn backends ran for this model's attention (one short forward, recorded)."""
    if trainer.model.attention == "sdpa":
        return ["torch.nn.functional.scaled_dot_product_attention"]
    x = torch.zeros(1, trainer.args.seq_len, dtype=torch.long, device=trainer.device)
    with ada_stats.collect() as records, torch.no_grad(), trainer.autocast:
        trainer.model(x)
    return sorted({r.backend for r in records})


def time_steps(args, config, spec, train_data, device) -> float:
    """Seconds per step of one run kind after warm-up (first-call compilation and autotuning)."""
    t = Trainer(args, config, spec, train_data, device)
    try:
        for i in range(args.calibration_warmup):
            t.step(i, 1000)
        sync(device)
        t0 = time.perf_counter()
        for i in range(args.calibration_steps):
            t.step(i, 1000)
        sync(device)
        return (time.perf_counter() - t0) / args.calibration_steps
    finally:
        del t
        if device.type == "cuda":
            torch.cuda.empty_cache()


def calibrate(args, config, specs, train_data, device, log) -> tuple[dict, list[str]]:
    """Seconds per step of each run kind; a pinned adaattn backend that fails gives way to dispatch."""
    timings, kept = {}, []
    for spec in specs:
        try:
            timings[spec] = time_steps(args, config, spec, train_data, device)
        except Exception as e:
            if not spec.startswith("adaattn:"):
                raise
            log(f"calibration: {spec} failed ({type(e).__name__}: {str(e)[:200]}); using adaattn's dispatch")
            spec = "adaattn"
            timings[spec] = time_steps(args, config, spec, train_data, device)
        kept.append(spec)
        log(f"calibration: {spec}: {timings[spec] * 1e3:.1f} ms/step")
    return timings, kept


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_run(args, config, spec, corpus, heldout_eval, steps, deadline, device, log) -> tuple[dict, Trainer]:
    trainer = Trainer(args, config, spec, corpus.train, device)
    used = backends_used(trainer)
    log(f"\n== run {spec}: {steps} steps of {args.batch} x {args.seq_len} bytes; attention runs on {', '.join(used)}")
    eval_every = args.eval_every or max(1, steps // 10)
    log_every = max(1, args.log_every)
    record = {"attention": spec, "backends": used, "steps_planned": steps, "log": [], "heldout": []}
    acc = torch.zeros((), device=device)
    acc_n = 0
    bar = tqdm(total=steps, desc=spec, mininterval=1.0 if sys.stderr.isatty() else 15.0, file=sys.stderr,
               dynamic_ncols=True) if tqdm and not args.no_progress else None
    t_train = 0.0
    t0 = time.perf_counter()
    done = 0
    for i in range(steps):
        if time.perf_counter() > deadline:
            log(f"deadline reached: stopping {spec} at step {i} of {steps}")
            record["stopped_at_deadline"] = True
            break
        loss, norm = trainer.step(i, steps)
        acc += loss
        acc_n += 1
        done = i + 1
        if done % log_every == 0 or done == steps:
            mean = float(acc) / acc_n  # one host sync per log line
            if not math.isfinite(mean):
                raise FloatingPointError(f"{spec}: training loss is {mean} at step {done}")
            acc.zero_()
            acc_n = 0
            record["log"].append({"step": done, "loss": mean, "bits_per_byte": mean / math.log(2),
                                  "lr": trainer.opt.param_groups[0]["lr"], "grad_norm": float(norm),
                                  "tokens": done * args.batch * args.seq_len,
                                  "elapsed_s": round(t_train + time.perf_counter() - t0, 2)})
            if bar is not None:
                bar.set_postfix(bits_per_byte=f"{mean / math.log(2):.3f}", refresh=False)
        if bar is not None:
            bar.update(1)
        elif done % max(1, steps // 20) == 0:
            last = record["log"][-1]["bits_per_byte"] if record["log"] else float("nan")
            log(f"{spec}: step {done}/{steps}: train {last:.4f} bits/byte")
        if done % eval_every == 0 and done != steps:
            sync(device)
            t_train += time.perf_counter() - t0
            h = ev.score_windows(trainer.model, heldout_eval, args.eval_batch)
            record["heldout"].append({"step": done, "bits_per_byte": h["bits_per_byte"]})
            msg = f"{spec}: step {done}: held-out {h['bits_per_byte']:.4f} bits/byte"
            (bar.write if bar is not None else log)(msg)
            t0 = time.perf_counter()
    sync(device)
    t_train += time.perf_counter() - t0
    if bar is not None:
        bar.close()
    record["steps"] = done
    record["train_s"] = round(t_train, 2)
    record["tokens_per_s"] = done * args.batch * args.seq_len / max(t_train, 1e-9)
    h = ev.score_windows(trainer.model, heldout_eval, args.eval_batch)
    record["heldout"].append({"step": done, "bits_per_byte": h["bits_per_byte"]})
    final = ev.heldout_bits_per_byte(trainer.model, args.seq_len, batch=args.eval_batch,
                                     max_windows=args.final_eval_windows)
    record["final_heldout"] = final
    log(f"{spec}: {done} steps in {t_train:.1f} s ({record['tokens_per_s']:,.0f} tokens/s); held-out "
        f"{final['bits_per_byte']:.4f} bits/byte over {final['windows']} windows of {args.seq_len}")
    return record, trainer


# ---- outputs ------------------------------------------------------------------------------


def plot_curves(runs: list[dict], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("train_gpt: matplotlib is not installed; skipping the plot", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in runs:
        steps = [p["step"] for p in run["log"]]
        line, = ax.plot(steps, [p["bits_per_byte"] for p in run["log"]], lw=1, alpha=0.8,
                        label=f"{run['attention']} train")
        ax.plot([p["step"] for p in run["heldout"]], [p["bits_per_byte"] for p in run["heldout"]], "o--",
                color=line.get_color(), ms=4,
                label=f"{run['attention']} held-out (final {run['final_heldout']['bits_per_byte']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_ylim(bottom=0)
    top = max((p["bits_per_byte"] for r in runs for p in r["log"][len(r["log"]) // 20:]), default=8)
    ax.set_ylim(0, min(8.5, top * 1.1))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def environment(device: torch.device) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "cuda": torch.version.cuda,
        "git_commit": git_commit(),
    }


# ---- main ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the log, plots and weights")
    p.add_argument("--attn", default="adaattn", help="sdpa, adaattn or adaattn:BACKEND (default adaattn)")
    p.add_argument("--both", action="store_true",
                   help="two runs: our kernels (adaattn:triton where it runs, else adaattn) then sdpa")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: from --minutes)")
    p.add_argument("--minutes", type=float, default=3.5, help="training time per run when --steps is not given")
    p.add_argument("--deadline-minutes", type=float, default=8.5,
                   help="the whole command stops training (and still writes everything) past this")
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--d-model", type=int, default=384)
    g.add_argument("--heads", type=int, default=6)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (compile time is counted)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--seq-len", type=int, default=8192)
    g.add_argument("--batch", type=int, default=8, help="sequences per step")
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--warmup", type=int, default=150, help="warm-up steps (at most a tenth of the run)")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval-every", type=int, default=None, help="held-out check every N steps (default: a tenth)")
    g.add_argument("--eval-windows", type=int, default=16, help="held-out windows for the periodic check")
    g.add_argument("--final-eval-windows", type=int, default=None, help="held-out windows at the end (default all)")
    g.add_argument("--eval-batch", type=int, default=8)
    g.add_argument("--eval-context", type=int, default=8192, help="context of the closing `adaattn eval`")
    g.add_argument("--log-every", type=int, default=10, help="steps per loss-log entry")
    g.add_argument("--calibration-warmup", type=int, default=3)
    g.add_argument("--calibration-steps", type=int, default=5)
    g.add_argument("--storage", choices=pretrained.STORAGE, default="int8", help="how the weights are stored")
    g.add_argument("--device", default=None)
    g.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    deadline = started + args.deadline_minutes * 60
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)

    def log(msg=""):
        print(msg, flush=True)

    config = GPTConfig(n_layer=args.layers, n_head=args.heads, n_kv_head=args.kv_heads, d_model=args.d_model,
                       train_seq_len=args.seq_len)
    specs = [our_kernels(device), "sdpa"] if args.both else [args.attn]
    for s in specs:
        parse_attention(s)
    command = "python3 -m adaattn.models.train " + shlex.join(argv if argv is not None else sys.argv[1:])
    env = environment(device)
    corpus = load_corpus()
    unigram = unigram_bits_per_byte(corpus.train, corpus.heldout)
    log(f"train_gpt on {env['device']}: torch {env['torch']}, triton {env['triton']}, commit {(env['git_commit'] or '?')[:12]}")
    log(f"corpus: Python {corpus.info['python']} stdlib at {corpus.info['stdlib_root']}: "
        f"{corpus.info['train_files']} train files ({corpus.info['train_bytes']:,} bytes), "
        f"{corpus.info['heldout_files']} held-out ({corpus.info['heldout_bytes']:,} bytes); "
        f"unigram baseline {unigram:.3f} bits/byte")
    n_params = GPT(config).num_params()
    log(f"model: {config} ({n_params / 1e6:.2f}M parameters); runs: {', '.join(specs)}")
    train_data = corpus.train.to(device)
    # The periodic check: eval_windows windows spread over the held-out text, the same for every run.
    heldout_eval = ev.heldout_windows(args.seq_len, args.eval_windows).to(device)

    timings = {}
    if args.steps is None:
        timings, specs = calibrate(args, config, specs, train_data, device, log)
        slowest = max(timings.values())
        steps = max(1, int(args.minutes * 60 / slowest * 0.97))
        log(f"{steps} steps per run: {args.minutes} min at the slowest kind's {slowest * 1e3:.1f} ms/step "
            f"(the same command with --steps {steps} repeats it)")
    else:
        steps = args.steps

    runs, failed = [], []
    first_trainer = None
    for spec in specs:
        try:
            record, trainer = train_run(args, config, spec, corpus, heldout_eval, steps, deadline, device, log)
        except Exception as e:  # one run failing must not lose the other
            msg = f"{type(e).__name__}: {str(e).strip()[:500]}"
            log(f"run {spec} FAILED: {msg}")
            failed.append({"attention": spec, "error": msg})
            trainer = None
        else:
            runs.append(record)
            if first_trainer is None:
                first_trainer = trainer
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not runs:
        log("every run failed")
        (args.out / "train_log.json").write_text(json.dumps({"command": command, "failed": failed}, indent=1) + "\n")
        return 1

    summary = {}
    if len(runs) == 2:
        a, b = (r["final_heldout"]["bits_per_byte"] for r in runs)
        summary = {"runs": [r["attention"] for r in runs], "heldout_bits_per_byte": [a, b],
                   "relative_difference": abs(a - b) / b, "within_1_percent": abs(a - b) / b <= 0.01}
        log(f"\nheld-out bits/byte: {runs[0]['attention']} {a:.4f} vs {runs[1]['attention']} {b:.4f}: "
            f"{100 * abs(a - b) / b:.2f}% apart ({'within' if abs(a - b) / b <= 0.01 else 'NOT within'} 1%)")

    weights_path = args.out / pretrained.DEFAULT_WEIGHTS.name
    meta = {
        "command": command, "steps": runs[0]["steps"], "attention": runs[0]["attention"],
        "seq_len": args.seq_len, "batch": args.batch, "seed": args.seed,
        "corpus": corpus.info, "environment": env,
        "heldout_bits_per_byte_float32": runs[0]["final_heldout"]["bits_per_byte"],
    }
    pretrained.save(first_trainer.model, weights_path, args.storage, meta)
    log(f"wrote {weights_path} ({weights_path.stat().st_size / 2**20:.2f} MiB, {args.storage}) from run {runs[0]['attention']}")
    del first_trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()

    record = {
        "schema": "adaattn-train-gpt/1", "command": command, "environment": env, "corpus": corpus.info,
        "unigram_bits_per_byte": unigram, "config": config.as_dict(), "parameters": n_params,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "steps": steps, "calibration_s_per_step": timings, "runs": runs, "failed": failed, "comparison": summary,
    }
    (args.out / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")
    title = (f"byte GPT {n_params / 1e6:.1f}M, {args.layers}x{args.d_model}, {args.batch}x{args.seq_len} bytes/step, "
             f"Python {corpus.info['python']} stdlib, {env['device']}")
    png = plot_curves(runs, args.out / "loss_curves.png", title)
    log(f"wrote {args.out / 'train_log.json'}" + (f" and {png}" if png else ""))

    # The closing evaluation runs on the stored (quantised) weights, as a user would load them.
    model = pretrained.load(weights_path, device)
    log(f"\n== adaattn eval of {weights_path.name} ({args.storage}) at context {args.eval_context}")
    result = ev.evaluate(model, args.eval_context, None, batch=args.eval_batch, max_windows=args.final_eval_windows,
                         plot=args.out / "attention_heads.png", log=log)
    result["weights"] = weights_path.name
    result["command"] = command
    (args.out / "eval.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    meta["heldout_bits_per_byte"] = result["heldout"]["bits_per_byte"]
    meta["heldout_context"] = args.eval_context
    pretrained.update_meta(weights_path, meta)
    log(f"wrote {args.out / 'eval.json'}")
    log("\nsummary:")
    for r in runs:
        log(f"  {r['attention']:<16} {r['steps']} steps, {r['tokens_per_s']:,.0f} tokens/s, held-out "
            f"{r['final_heldout']['bits_per_byte']:.4f} bits/byte (float32 weights, context {args.seq_len})")
    for f in failed:
        log(f"  {f['attention']:<16} FAILED: {f['error'][:200]}")
    if summary:
        log(f"  difference {100 * summary['relative_difference']:.2f}% "
            f"({'within' if summary['within_1_percent'] else 'NOT within'} 1%)")
    log(f"  stored {args.storage} weights {weights_path.stat().st_size / 2**20:.2f} MiB: held-out "
        f"{result['heldout']['bits_per_byte']:.4f} bits/byte at context {args.eval_context} "
        f"(unigram {unigram:.3f}); total {time.perf_counter() - started:.0f} s")
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
