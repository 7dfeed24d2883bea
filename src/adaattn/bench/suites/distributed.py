"""distributed: what adaattn.distributed costs on one device (world size 1), against adaattn.attention."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from ... import distributed as cp
from ...policy import Policy
from .. import peers
from ..cases import Case
from ..dense import describe, error_check, random_qkv
from ..grid import CAUSAL, Grid, dtype_name
from ..peers import Call
from . import options

NAME = "distributed"
HELP = ("world size 1 (a process group of one: NCCL on a GPU, gloo on a CPU), causal GQA bf16 Hq=32 Hkv=8 "
        "D=128, fwd and fwd+bwd: ring_attention vs adaattn.attention (what the distributed layer adds), and its "
        "block path (kernel='triton', the per-block code every rank runs) vs our Triton kernels pinned; x adaattn")
NEEDS_CUDA = False
DEFAULT = Grid((4096, 16384, 65536), batch=1, heads=32, kv_heads=8, head_dim=128, dtypes=(torch.bfloat16,),
               causal="yes")
CPU_DEFAULT = Grid((512, 2048), batch=1, heads=4, kv_heads=2, head_dim=64, dtypes=(torch.float32,), causal="yes")
HOW = {
    "ring (world 1)": "adaattn.distributed.ring_attention(q, k, v, group) with an initialized process group of "
    "world size 1 (balance zigzag, kernel auto): the distributed entry point as a model calls it",
    "ring blocks (world 1)": "the same with kernel='triton': the block path (pairs, our Triton forward and "
    "backward with log-sum-exp, the merge) on the rank's own shard, as every rank runs it per visiting shard",
    "ring blocks auto tau=X": "the block path under Policy(mode='auto', precisions=('int8', 'fp8'), tolerance=X): "
    "per-head quantized blocks with their log-sum-exp, verified against the exact blocks on a fraction 0.05 of "
    "calls (each verified call runs both), exact blocks where the quantized ones measure no faster (forward only: "
    "the policy's backward is exact)",
}
POLICY_TOLERANCES = (1e-2, 5e-2)


def _group(device: torch.device) -> None:
    """A process group of world size 1 for the timed calls, made once per process."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, **({"device_id": device} if device.type == "cuda" else {}))


def cases(args, device):
    grid = options.grid(args, DEFAULT if device.type == "cuda" else CPU_DEFAULT)
    kv_heads = grid.kv_heads or grid.heads
    out = []
    # Two peers per case, so each call of a round follows the other: a GPU whose clocks sag
    # after a long cuDNN call would otherwise slow whichever row always comes next.
    parts = [("entry", "adaattn")] + ([("blocks", "triton"), ("policy", "ring blocks (world 1)")]
                                      if device.type == "cuda" else [])
    for dtype in grid.dtypes:
        for causal in CAUSAL[grid.causal]:
            for i, n in enumerate(grid.seq_lens):
                for backward in (False, True):
                    for part, baseline in parts:
                        if part == "policy" and backward:
                            continue
                        what = "fwd+bwd" if backward else "fwd"
                        series = (f"world 1 {part} {describe(grid.batch, grid.heads, kv_heads, grid.head_dim, dtype)} "
                                  f"{'causal' if causal else 'full'} {what}")
                        flops = 4.0 * grid.batch * grid.heads * n * n * grid.head_dim * (0.5 if causal else 1.0)
                        flops *= 3.5 if backward else 1.0
                        fields = {"seq_len": n, "batch": grid.batch, "heads": grid.heads, "kv_heads": kv_heads,
                                  "head_dim": grid.head_dim, "dtype": dtype_name(dtype), "causal": causal,
                                  "pass": what, "world_size": 1, "part": part}
                        make = _maker(part, grid.batch, grid.heads, kv_heads, n, grid.head_dim, dtype, causal,
                                      backward, device, options.seed(args) + i)
                        out.append(Case(NAME, f"{series} N={n}", n, fields, baseline, "TFLOP/s", flops, make,
                                        series=series))
    return out


def _maker(part, batch, heads, kv_heads, n, head_dim, dtype, causal, backward, device, seed):
    def make():
        _group(device)
        q, k, v = random_qkv(batch, heads, kv_heads, n, n, head_dim, dtype, device, seed, requires_grad=backward)
        call = Call(q, k, v, causal=causal, backward=backward)
        gqa = heads != kv_heads
        if part == "entry":
            rows = [peers.adaattn(call),
                    call.peer("ring (world 1)", lambda: cp.ring_attention(q, k, v, is_causal=causal, enable_gqa=gqa))]
        elif part == "blocks":
            rows = [peers.triton(call),
                    call.peer("ring blocks (world 1)",
                              lambda: cp.ring_attention(q, k, v, is_causal=causal, enable_gqa=gqa, kernel="triton"))]
        else:
            rows = [call.peer("ring blocks (world 1)",
                              lambda: cp.ring_attention(q, k, v, is_causal=causal, enable_gqa=gqa, kernel="triton"))]
            for tol in POLICY_TOLERANCES:
                pol = Policy(mode="auto", precisions=("int8", "fp8"), tolerance=tol)
                label = f"bench ring policy {tol:g} N={n}"
                rows.append(call.peer(f"ring blocks auto tau={tol:g}", lambda pol=pol, label=label: cp.ring_attention(
                    q, k, v, is_causal=causal, enable_gqa=gqa, kernel="triton", policy=pol, label=label)))
        return rows, error_check(Call(q.detach(), k.detach(), v.detach(), causal=causal))

    return make


def summarize(rows: list[dict]) -> tuple[dict, str]:
    """What world size 1 adds: ring's time over adaattn's, per case, from the paired ratio
    (each round's two calls side by side; the medians' ratio is given too), and the block
    path's (paired) over Triton pinned; the largest of the first. Under a policy: the quantized
    blocks' time over the exact blocks' (paired)."""
    by = {}
    for r in rows:
        if r.get("ms") is not None:
            by[(r["seq_len"], r["causal"], r["pass"], r.get("part"), r["peer"])] = r
    entries, lines = [], []
    for n, causal, what in sorted({key[:3] for key in by}):
        base, ring = by.get((n, causal, what, "entry", "adaattn")), by.get((n, causal, what, "entry", "ring (world 1)"))
        blocks = by.get((n, causal, what, "blocks", "ring blocks (world 1)"))
        blocks_paired = None if blocks is None else blocks.get("x_baseline_paired")
        paired = None if ring is None else ring.get("x_baseline_paired")
        pol = {}
        for t in POLICY_TOLERANCES:
            x = by.get((n, causal, what, "policy", f"ring blocks auto tau={t:g}"), {}).get("x_baseline_paired")
            pol[f"auto_{t:g}_over_blocks"] = None if not x else 1.0 / x
        e = {"seq_len": n, "causal": causal, "pass": what, **pol,
             "ring_over_adaattn": None if not paired else 1.0 / paired - 1.0,
             "ring_over_adaattn_medians": None if not (base and ring) else ring["ms"] / base["ms"] - 1.0,
             "blocks_over_triton": None if not blocks_paired else 1.0 / blocks_paired - 1.0}
        entries.append(e)
        parts = [f"N={n} {'causal' if causal else 'full'} {what}:"]
        if e["ring_over_adaattn"] is not None:
            parts.append(f"ring (world 1) {100 * e['ring_over_adaattn']:+.1f}% over adaattn (paired; medians "
                         f"{100 * e['ring_over_adaattn_medians']:+.1f}%)")
        if e["blocks_over_triton"] is not None:
            parts.append(f"block path {100 * e['blocks_over_triton']:+.1f}% over triton")
        for t in POLICY_TOLERANCES:
            x = e[f"auto_{t:g}_over_blocks"]
            if x is not None:
                parts.append(f"blocks auto tau={t:g}: {1.0 / x:.3f}x the exact blocks' speed")
        lines.append(" ".join(parts))
    worst = [e["ring_over_adaattn"] for e in entries if e["ring_over_adaattn"] is not None]
    summary = {"how": HOW, "cases": entries, "max_ring_over_adaattn": max(worst) if worst else None,
               "within_2_percent": None if not worst else max(worst) <= 0.02}
    if worst:
        lines.append(f"largest: ring (world 1) {100 * max(worst):+.1f}% over adaattn.attention (paired)")
    return summary, "\n".join(lines)
