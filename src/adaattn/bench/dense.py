"""A case over one attention shape: fresh random inputs, a float64 error check, the suite's peers."""

from __future__ import annotations

from typing import Callable

import torch

from ..backends.reference import relative_errors
from . import accuracy
from .cases import Case, Peer
from .grid import Shape, dtype_name
from .peers import Call

ERROR_ROWS = 256


def error_check(call: Call, rows: int = ERROR_ROWS, per_head: bool = False) -> Callable[[torch.Tensor], object]:
    """out (B, H, N, D) -> relative error against float64 on up to `rows` sampled query rows;
    with per_head, (that error, {"head_errors": each query head's relative L2 error over the
    batch and the sampled rows, "max_head_error": the largest}), the measure Policy.tolerance
    bounds."""
    idx = accuracy.sample_rows(call.q.shape[2], rows)
    with torch.no_grad():
        ref = accuracy.sampled_reference(call.q.detach(), call.k.detach(), call.v.detach(), idx, call.causal,
                                         window=call.window)
    if not per_head:
        return lambda out: accuracy.relative_error(out, ref, idx)

    def check(out):
        heads = head_errors(out, ref, idx)
        return accuracy.relative_error(out, ref, idx), {"head_errors": heads, "max_head_error": max(heads)}

    return check


def head_errors(out: torch.Tensor, ref: torch.Tensor, idx: torch.Tensor) -> list[float]:
    """Each query head's relative L2 error over the batch and the sampled rows `idx` of `out`,
    against their float64 reference `ref` (B, H, len(idx), D)."""
    got = out.detach().index_select(2, idx.to(out.device))
    return [float(x) for x in relative_errors(got, ref.to(got.device), (0, 2, 3)).tolist()]


def random_qkv(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int, dtype: torch.dtype,
               device: torch.device, seed: int, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    """torch.randn query (B, H, Nq, D), key and value (B, Hkv, Nk, D), reproducible from `seed`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for h, n in ((heads, q_len), (kv_heads, kv_len), (kv_heads, kv_len)):
        t = torch.randn(batch, h, n, head_dim, generator=gen, device=device)
        out.append(t.to(dtype).requires_grad_(requires_grad))
    return tuple(out)


def shape_case(suite: str, shape: Shape, device: torch.device, peers: Callable[[Call], list[Peer]], baseline: str,
               backward: bool = False, seed: int = 0, error_rows: int = ERROR_ROWS,
               inputs: Callable[[bool], tuple[torch.Tensor, ...]] | None = None, fields: dict | None = None,
               also: tuple[str, ...] = (), per_head: bool = False) -> Case:
    """One case of `shape` (Nq = Nk), TFLOP/s as MEASURING.md counts them (x3.5 with backward).

    inputs: requires_grad -> (q, k, v) of the shape on `device`; default fresh torch.randn from `seed`.
    fields: added to the case's rows (and its label).
    """
    what = "fwd+bwd" if backward else "fwd"
    extra = " ".join(f"{k}={v}" for k, v in (fields or {}).items())
    label = f"{shape.label()} {what}{' ' + extra if extra else ''}"

    def make():
        if inputs is not None:
            q, k, v = inputs(backward)
        else:
            q, k, v = random_qkv(shape.batch, shape.heads, shape.kv_heads, shape.seq_len, shape.seq_len,
                                 shape.head_dim, shape.dtype, device, seed, requires_grad=backward)
        call = Call(q, k, v, causal=shape.causal, backward=backward)
        return peers(call), error_check(call, error_rows, per_head)

    series = label.replace(f"N={shape.seq_len} ", "")
    return Case(suite, label, shape.seq_len, {**shape.as_dict(), "pass": what, **(fields or {})}, baseline, "TFLOP/s",
                shape.flops(backward), make, series=series, also=also)


def window_pairs(n: int, left: int) -> int:
    """Query-key pairs of a causal sliding window: row i sees keys max(0, i - left) .. i."""
    w = min(left, n - 1)
    return w * (w + 1) // 2 + (n - w) * (w + 1)


def describe(batch: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> str:
    kv = f"/{kv_heads}" if kv_heads != heads else ""
    return f"B={batch} H={heads}{kv} D={head_dim} {dtype_name(dtype)}"
