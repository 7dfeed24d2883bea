"""Our exact fused attention in Triton: the runners (one per forward variant), the reasons they
decline a call, and `triton_attention`, the function over the same launches.

    triton.ws    warp-specialised forward (kernels/attention_fwd_ws.py, and on Hopper with Gluon
                 kernels/attention_fwd_gluon.py, the tuner keeping the faster): Hopper, dense
                 bf16/fp16, no mask, causal or not, a left window (no right one past the
                 diagonal), head_dim 64/128,
                 TMA-aligned tensors
    triton.tma   tensor-descriptor (TMA) K/V loads: dense, no mask, power-of-two head_dim,
                 TMA-aligned tensors
    triton.ptr   pointer loads (cp.async pipelining): everything the kernels take

All three share the backward (kernels/attention_bwd.py) and the custom ops of ops.py.
The priority data lists triton.ws before triton.ptr; triton.tma runs when named in
Policy.backends (measured slower than both on the H100: benchmarks/NOTES.md).
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import hardware, settings
from ...problem import default_scale, window_sides
from ..base import Runner
from .common import TRITON_FOUND, block_d, interpreting, pointer_ready, unsupported_options
from .forward import launch_fwd
from .launch import AttentionLaunch, launch_id, make_launch

MAX_HEAD_DIM = 256
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ALIGNMENTS = ("top_left", "bottom_right")


def triton_reasons(device_type: str, device_index: Optional[int], dtype: torch.dtype, head_dim: int,
                   value_dim: Optional[int] = None) -> list[str]:
    """Reasons our Triton kernels cannot run on this device/dtype/head dims (empty: they can)."""
    reasons = []
    if not TRITON_FOUND:
        return ["triton is not installed (pip install adaattn[triton])."]
    if device_type != "cuda" and not (device_type == "cpu" and interpreting()):
        reasons.append(f"runs on CUDA tensors only (CPU only under TRITON_INTERPRET=1), got {device_type}.")
    if dtype not in KERNEL_DTYPES:
        reasons.append(f"takes float16, bfloat16 or float32, got {str(dtype).replace('torch.', '')}.")
    value_dim = head_dim if value_dim is None else value_dim
    if max(head_dim, value_dim) > MAX_HEAD_DIM:
        reasons.append(f"head_dim {max(head_dim, value_dim)} exceeds its limit {MAX_HEAD_DIM}.")
    if head_dim == 0 or value_dim == 0:
        reasons.append("head_dim 0 is not implemented.")
    if device_type == "cuda" and not interpreting():
        if not hardware.capability_at_least(device_index, 8, 0):
            reasons.append(f"needs compute capability sm80 or newer, this GPU is {hardware.arch('cuda', device_index)}.")
        if value_dim != head_dim and (head_dim != block_d(head_dim) or value_dim != block_d(value_dim)):
            reasons.append(f"its forward faulted (illegal memory access) with a value head dim unlike the key's where "
                           f"either is padded to its tile (D/Dv 40/8, 216/8, 100/19; 40/16, 40/32 and 64/8 ran: "
                           f"a CUDA fuzzer, H200, triton 3.6; not yet traced), got {head_dim} and {value_dim}.")
    return reasons


def _deterministic(policy) -> bool:
    return bool(policy.deterministic) or torch.are_deterministic_algorithms_enabled()


class TritonRunner(Runner):
    """Our exact fused attention (forward and backward) in Triton, one forward variant."""

    variant = "ptr"

    def __init__(self, variant: str):
        self.variant = variant
        self.name = f"triton.{variant}"
        # The pointer kernels: soft-capping and ALiBi in-tile, forward and backward (kernels/attention_fwd
        # soft_cap, alibi_bias); sinks folded into each row's softmax (ops.modified_attention).
        self.modifiers = frozenset(("softcap", "sinks", "alibi_slopes")) if variant == "ptr" else frozenset()

    def supports(self, problem, policy) -> list[str]:
        reasons = triton_reasons(problem.device_type, problem.device_index, problem.dtype, problem.head_dim,
                                 problem.value_dim)
        reasons += unsupported_options(problem)
        if problem.varlen:
            reasons.append("takes dense (B, H, N, D) tensors; packed sequences go to varlen.triton.")
        if problem.needs_grad and problem.out_lead is not None:
            reasons.append("takes gradients of 4-D calls only: for other ranks torch runs its math kernel, whose "
                           "gradients were 2x more accurate than ours on the flattened call (a CUDA fuzzer, H200).")
        if (problem.needs_grad and problem.device_type == "cuda"
                and (problem.head_dim != block_d(problem.head_dim) or problem.value_dim != block_d(problem.value_dim))):
            reasons.append(f"its backward faulted (illegal memory access) at head dims that are not a power of two "
                           f"(D 40-103 with masks or windows, a CUDA fuzzer, H200, triton 3.6; not yet traced), got "
                           f"{problem.head_dim} and {problem.value_dim}.")
        if (problem.sinks or problem.alibi) and (problem.out_lead is not None or torch.compiler.is_compiling()):
            reasons.append("takes sinks and ALiBi slopes in eager 4-D calls only (an autograd function around its "
                           "kernels).")
        if problem.alibi_grad:
            reasons.append("gives no gradient for alibi_slopes (a sum over every score; mods.torch gives it).")
        if self.variant == "ptr" or reasons:
            return reasons
        # TMA and warp-specialised loads: what a tensor descriptor takes.
        if problem.mask_kind != "none":
            reasons.append("takes no attn_mask (tensor-descriptor loads).")
        if problem.dtype == torch.float32:
            reasons.append("takes float16/bfloat16 (tensor-descriptor loads).")
        if problem.head_dim != block_d(problem.head_dim):
            reasons.append(f"needs a power-of-two head_dim >= 16, got {problem.head_dim}.")
        if problem.value_dim != problem.head_dim:
            reasons.append(f"needs the value head_dim equal to head_dim, got {problem.value_dim} and "
                           f"{problem.head_dim}.")
        if not problem.tma_aligned:
            reasons.append("needs q, k, v with unit last stride and 16-byte aligned base and strides.")
        if not problem.scale > 0:
            reasons.append("needs a positive scale.")
        if self.variant == "ws":
            if not hardware.warp_specialisation_available():
                reasons.append("this triton has no warp specialisation (3.6 or newer).")
            if problem.device_type == "cuda" and not interpreting() and hardware.arch("cuda", problem.device_index) != "sm90":
                reasons.append("warp specialisation of these kernels runs on Hopper (sm90) only.")
            if not problem.causal and problem.window_right > 0:
                reasons.append("takes a left window only (a right window past the diagonal is not implemented).")
            if problem.head_dim not in (64, 128):
                reasons.append(f"takes head_dim 64 or 128, got {problem.head_dim}.")
        return reasons

    def prepare(self, problem, policy) -> AttentionLaunch:
        return make_launch(self.variant, problem.scale, problem.causal, problem.window_left, problem.window_right,
                           problem.bottom_right, _deterministic(policy), problem.softcap,
                           self.variant == "ptr" and torch_runs_math_gradients(problem, policy))

    def run(self, query, key, value, attn_mask, problem, launch, label=None, modifiers=None):
        if modifiers is not None and (modifiers.sinks is not None or modifiers.alibi_slopes is not None):
            from .ops import modified_attention

            return modified_attention(pointer_ready(query), pointer_ready(key), pointer_ready(value), attn_mask,
                                      modifiers.sinks, modifiers.alibi_slopes, launch_id(launch))
        return run_dense(query, key, value, attn_mask, launch)


def run_dense(query, key, value, attn_mask, launch: AttentionLaunch) -> torch.Tensor:
    """The forward of `launch` on (B, H, N, D) tensors, differentiable where needed
    (ops.attention_fwd)."""
    from .ops import attention_fwd

    if _direct_ok(query, key, value, attn_mask):
        out, _ = launch_fwd(query, key, value, attn_mask, None, None, query.shape[2], key.shape[2], launch)
        return out
    out, _, _ = attention_fwd(query, key, value, attn_mask, None, None, query.shape[2], key.shape[2],
                              launch_id(launch))
    return out


def torch_runs_math_gradients(problem, policy) -> bool:
    """Whether torch's SDPA would answer this half-precision call's gradients with its math kernel
    (neither its flash nor its efficient kernel takes the call, problem.torch_fused as the planner
    found it: a scale <= 0, masks with GQA, the CPU, ...). Math
    keeps ds in fp32, and our backward's dk and dq were 2.1-2.3x its error there (fuzzer: float16
    #528, #7381; bfloat16 20261127 #66), so such calls take ds in two roundings (launch.ds_split).
    Where a fused kernel runs, torch rounds ds once as we do, and the second product would cost the
    backward for nothing."""
    if problem.dtype not in (torch.float16, torch.bfloat16) or not problem.needs_grad:
        return False
    want = settings.current().ds_split
    if want != "auto":
        return want == "on"
    return not problem.torch_fused


def triton_runners() -> list[TritonRunner]:
    return [TritonRunner("ws"), TritonRunner("tma"), TritonRunner("ptr")]


def _direct_ok(*tensors) -> bool:
    """Whether a forward may call launch_fwd with no autograd at all: no gradient wanted, and no
    compiler, transform or mode watching (ops.eager_ok)."""
    from .ops import eager_ok

    present = [t for t in tensors if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return False
    return eager_ok(*present)


def check_alignment(causal_alignment: str) -> bool:
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    return causal_alignment == "bottom_right"


def _check_dense(q, k, v, attn_mask) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (B, H, N, D) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"query, key and value must share one dtype among float16, bfloat16, float32; got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}")
    b, hq, _, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"key and value must be (B, Hkv, Nk, D) and (B, Hkv, Nk, Dv) with query's B={b} and D={d}, "
                         f"got key {tuple(k.shape)} and value {tuple(v.shape)}")
    if k.shape[1] == 0 or hq % k.shape[1] != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({k.shape[1]})")
    if max(d, v.shape[3]) > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {max(d, v.shape[3])}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor) or (attn_mask.dtype != torch.bool and not attn_mask.is_floating_point()):
            raise TypeError(f"attn_mask must be a bool or floating tensor, got {attn_mask!r:.80}")
        if attn_mask.dim() < 2:
            raise ValueError(f"attn_mask must be at least 2-D (..., q_len, k_len), got shape {tuple(attn_mask.shape)}")
        try:
            torch.broadcast_shapes(attn_mask.shape, (b, hq, q.shape[2], k.shape[2]))
        except RuntimeError:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                             f"(B, Hq, Nq, Nk) = {(b, hq, q.shape[2], k.shape[2])}") from None


def triton_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[tuple] = None,
    *,
    causal_alignment: str = "top_left",
    deterministic: bool = False,
    variant: str = "ptr",
) -> torch.Tensor:
    """Exact attention with our Triton kernels on (B, H, N, D) tensors; returns (B, Hq, Nq, D).

    query (B, Hq, Nq, D), key/value (B, Hkv, Nk, D), Hq a multiple of Hkv (GQA/MQA read the
    kv head q_head // groups, never repeated in memory); float16, bfloat16 or float32.
    attn_mask: bool (True takes part) or additive, broadcastable to (B, Hq, Nq, Nk); additive
        masks get no gradient.
    is_causal / window (left, right): as SDPA and adaattn.attention, aligned top-left; with
        causal_alignment="bottom_right" query i sits at position i + (Nk - Nq), so key j is
        visible iff j <= i + Nk - Nq (the KV-cache convention); windows shift the same way.
    deterministic: bitwise-reproducible gradients (the backward's atomic-free dq pass).
    variant: the forward ("ptr", "tma", "ws"); adaattn.attention picks it through the planner.
    Rows that see no key give 0. Raises ValueError/TypeError for inconsistent shapes, dtypes
    or devices, head_dim > 256, or a bad causal_alignment.
    """
    _check_dense(query, key, value, attn_mask)
    bottom_right = check_alignment(causal_alignment)
    left, right = window_sides(window)
    launch = make_launch(variant, default_scale(query.shape[-1]) if scale is None else float(scale),
                         bool(is_causal), left, right, bottom_right,
                         bool(deterministic) or torch.are_deterministic_algorithms_enabled())
    return run_dense(query, key, value, attn_mask, launch)
