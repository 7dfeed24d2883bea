"""Packed sequences of different lengths (varlen_attention): the input checks and two runners.

    varlen.triton  our Triton kernels over the packed tensors: no padding, no host sync
    varlen.sdpa    torch SDPA per sequence: reads the offsets on the host; any device and dtype

A varlen runner takes the offsets through `run_varlen`; dense runners decline packed problems.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .base import Runner
from .masks import position_keep
from .sdpa_forms import CUDNN_NAN_KEYS, HALF
from .triton.common import unsupported_options
from .triton.launch import AttentionLaunch, launch_id, make_launch
from .triton.runner import triton_reasons

OFFSET_DTYPES = (torch.int32, torch.int64)


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_offsets: bool) -> None:
    """Shapes, dtypes and devices of a varlen call; with check_offsets also the offsets' values
    (one host read of a flag: start at 0, never decrease, stay within the packed tensors)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a packed 3-D tensor (total_tokens, heads, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(f"q, k and v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:2] != v.shape[:2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k and v must be (total_k, Hkv, D) and (total_k, Hkv, Dv) with q's head_dim, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a 1-D int32 or int64 tensor of batch + 1 offsets, got "
                            f"{type(cu).__name__}")
        if cu.dtype not in OFFSET_DTYPES:
            raise TypeError(f"{name} must be an int32 or int64 tensor, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D with batch + 1 offsets, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise TypeError(f"{name} must be a non-negative int, got {m!r}")
    if not check_offsets or q.device.type == "meta":
        return
    sides = [(name, cu, total, longest) for name, cu, total, longest in
             (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
              ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)) if not _checked(cu, total, longest)]
    if not sides:
        return
    flags = torch.stack([_offsets_bad(cu, total, longest) for _, cu, total, longest in sides]).tolist()
    for (name, cu, total, longest), bad in zip(sides, flags):  # (one host read above, for both tensors)
        if any(bad):
            _refuse_offsets(name, cu, total, longest, bad)
    for _, cu, total, longest in sides:
        _remember(cu, total, longest)


def _offsets_bad(cu: torch.Tensor, total: int, longest: int) -> torch.Tensor:
    """A (4,) bool tensor on cu's device, a flag per rule cu breaks, in this order: it does not start
    at 0, it decreases, it ends past total, it holds a sequence longer than longest."""
    lengths = cu.diff()
    return torch.stack([cu[0] != 0, (lengths < 0).any(), cu[-1] > total, (lengths > longest).any()])


def _refuse_offsets(name: str, cu: torch.Tensor, total: int, longest: int, bad: list[bool]) -> None:
    """The ValueError for offsets that broke the rules flagged in `bad` (the error path reads the
    offsets' values back to quote them)."""
    values = cu.tolist()
    lengths = [b - a for a, b in zip(values, values[1:])]
    side = name[-1]
    broken = []
    if bad[0]:
        broken.append(f"must start at 0, got {name}[0]={values[0]}")
    if bad[1]:
        i = next(i for i, n in enumerate(lengths) if n < 0)
        broken.append(f"must never decrease, got {name}[{i}]={values[i]} > {name}[{i + 1}]={values[i + 1]}")
    if bad[2]:
        broken.append(f"must end at most at the packed length {total} ({side}.shape[0]), got {name}[-1]={values[-1]}")
    if bad[3]:
        i = max(range(len(lengths)), key=lengths.__getitem__)
        broken.append(f"must hold no sequence longer than max_seqlen_{side}={longest}, got sequence {i} of "
                      f"{lengths[i]} tokens")
    shown = values if len(values) <= 16 else values[:16] + ["..."]
    raise ValueError(f"{name} {'; and '.join(broken)} ({name}={shown})")


# Offsets tensors whose values passed the check: id -> (weak reference, version counter, the
# (total, longest) bounds they passed). A model passes one cu_seqlens tensor to every layer of a
# step, so its values are read back once, not once per layer. An in-place change bumps the
# tensor's version and checks it again; a tensor that dies drops out.
_CHECKED: dict = {}
_CHECKED_MAX = 256


def _checked(cu: torch.Tensor, total: int, longest: int) -> bool:
    if cu.is_inference():
        return False
    entry = _CHECKED.get(id(cu))
    return (entry is not None and entry[0]() is cu and entry[1] == cu._version
            and (total, longest) in entry[2])


def _remember(cu: torch.Tensor, total: int, longest: int) -> None:
    import weakref

    if cu.is_inference():  # inference tensors have no version counter
        return
    key = id(cu)
    entry = _CHECKED.get(key)
    if entry is not None and entry[0]() is cu and entry[1] == cu._version:
        entry[2].add((total, longest))
        return
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()
    _CHECKED[key] = (weakref.ref(cu, lambda _, key=key: _CHECKED.pop(key, None)), cu._version, {(total, longest)})


class VarlenTritonRunner(Runner):
    name = "varlen.triton"

    def supports(self, problem, policy) -> list[str]:
        if not problem.varlen:
            return ["takes packed sequences (varlen_attention) only."]
        return triton_reasons(problem.device_type, problem.device_index, problem.dtype, problem.head_dim,
                              problem.value_dim) + unsupported_options(problem)

    def prepare(self, problem, policy) -> AttentionLaunch:
        return make_launch("ptr", problem.scale, problem.causal, problem.window_left, problem.window_right,
                           problem.bottom_right,
                           bool(policy.deterministic) or torch.are_deterministic_algorithms_enabled())

    def run_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, problem, launch):
        from .triton.ops import attention_fwd

        cu_q = cu_seqlens_q.to(torch.int32)
        cu_k = cu_seqlens_k.to(torch.int32)
        out, _, _ = attention_fwd(q, k, v, None, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), launch_id(launch))
        return out


class VarlenSdpaRunner(Runner):
    name = "varlen.sdpa"

    def supports(self, problem, policy) -> list[str]:
        if not problem.varlen:
            return ["takes packed sequences (varlen_attention) only."]
        reasons = []
        if problem.dropout_p > 0:
            reasons.append("dropout is not offered for packed sequences.")
        if problem.device_type == "meta":
            reasons.append("reads the offsets on the host; meta tensors have none.")
        return reasons

    def run_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, problem, launch):
        """Per-sequence torch SDPA (reads the offsets on the host)."""
        cu_q = cu_seqlens_q.tolist()
        cu_k = cu_seqlens_k.tolist()
        groups = q.shape[1] // k.shape[1]
        bottom_right = problem.bottom_right
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        wrote = False
        for b in range(len(cu_q) - 1):
            qs = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)
            ks = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(groups, dim=0)
            vs = v[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(groups, dim=0)
            nq, nk = qs.shape[1], ks.shape[1]
            if nq == 0 or nk == 0:
                continue
            keep = position_keep(nq, nk, problem.causal, problem.window, q.device, bottom_right)
            with sdpa_kernel(SDPBackend.MATH) if math_only(nk, q.dtype, q.device.type, grad) else nullcontext():
                if keep is None:
                    o = F.scaled_dot_product_attention(qs, ks, vs, scale=problem.scale)
                else:
                    # Fully masked rows: SDPA's math gives NaN on some versions; define them as 0.
                    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=keep, scale=problem.scale)
                    o = torch.where(keep.any(-1, keepdim=True), o, torch.zeros_like(o))
            out[cu_q[b]:cu_q[b + 1]] = o.transpose(0, 1)
            wrote = True
        if not wrote and grad:
            # No sequence had both rows and keys: still differentiable (every gradient 0, as
            # SDPA's), through a zero that depends on q, k and v, exact whatever their values.
            link = torch.where(torch.zeros((), dtype=torch.bool, device=q.device), q.sum() + k.sum() + v.sum(), 0.0)
            out = out + link.to(out.dtype)
        return out


def math_only(keys: int, dtype: torch.dtype, device_type: str, grad: bool) -> bool:
    """Whether a document's SDPA call under gradients runs torch's math kernel: at exactly
    CUDNN_NAN_KEYS keys, where torch's choice (cuDNN on Hopper) gave NaN dq on rows of a low
    log-sum-exp (sdpa_forms; sdpa.cudnn declines such calls and the planner runs sdpa.math)."""
    return grad and device_type == "cuda" and keys == CUDNN_NAN_KEYS and dtype in HALF


def varlen_runners() -> list[Runner]:
    return [VarlenTritonRunner(), VarlenSdpaRunner()]
