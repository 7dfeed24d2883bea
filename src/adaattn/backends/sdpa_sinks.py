"""`sinks.<kernel>`: attention sinks (gpt-oss's s_aux) on torch's fused kernels, through their
log-sum-exp.

A sink z[h] joins each row's softmax as one more logit with no value, so the row's output is the
plain attention output O times w = exp(lse) / (exp(lse) + exp(z)) = sigmoid(lse - z), lse the row's
log-sum-exp over its keys. The fused kernels return lse beside O, so the sink costs one elementwise
pass over the output.

The gradient: with O' = w O and g = dL/dO', the scores' gradient is the plain backward's with
dO = w g and the output O' in place of O (its delta, rowsum(dO * O'), is w^2 rowsum(g * O): the
plain term w rowsum(g * O) less the lse path's w (1 - w) rowsum(g * O)). The kernel's own backward
node runs it: its saved output is scaled to O' in place (through .data, which the node's version
check does not see) and a thin autograd function hands it w g; d z = -sum over rows of
(1 - w) rowsum(g * O'). torch's backward ops cannot be called from Python without a mask tensor
(cuDNN) or sequence offsets (flash), which is why the node is reused rather than called.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.autograd.function import once_differentiable

from .. import costs, hardware
from .base import Runner
from .modifiers import modified_attention, sink_backward, sink_margin
from .sdpa_forms import ALIGN_DIM, CUDNN_NAN_KEYS, CUDNN_NAN_REASON, CUDNN_WIDE, HALF, fused_ready


# The sink's passes over the output (scale it; in the backward, w g and d sinks) against the
# plain kernel: sinks.cudnn's forward+backward took 14.80 ms to cuDNN's plain 13.22 ms at 16k
# causal (B2 H16 D128 bf16, H200; benchmarks/results/2026-11-28-modifiers-sinks-cudnn-h200.json).
SINK_PASS = 1.12


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are set (torch.autograd.graph.saved_tensors_hooks, save_on_cpu,
    checkpointing): a hook that copies the kernel's saved output packs it before it is scaled in
    place, and its backward would read O instead of O' (dq and dk 0.4 off, a review's repro). A
    torch without the query counts as hooks set."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    try:
        return top(False) is not None
    except TypeError:
        return True


class _SinkWeights(torch.autograd.Function):
    """out (O', scaled in place already) -> out; backward: w g to the kernel's node, d sinks.
    Once differentiable: margin is detached, so a second derivative through d sinks would be wrong."""

    @staticmethod
    def forward(ctx, out, sinks, margin):
        ctx.save_for_backward(out, margin)
        ctx.sinks_dtype = sinks.dtype
        return out.view_as(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        out, margin = ctx.saved_tensors
        dout, dsinks = sink_backward(grad, out, margin)
        return dout.to(grad.dtype), dsinks.to(ctx.sinks_dtype) if ctx.needs_input_grad[1] else None, None


def _cudnn(q, k, v, causal, scale, grad):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                  scale=scale)[:2]
    return out, lse


def _flash(q, k, v, causal, scale, grad):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]


def _cpu(q, k, v, causal, scale, grad):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


class SdpaSinksRunner(Runner):
    """One fused torch kernel that returns its log-sum-exp, with attention sinks applied from it."""

    modifiers = frozenset(("sinks",))

    def __init__(self, kernel: str, device_type: str, dtypes: tuple, max_head_dim: int, op, min_capability=(8, 0)):
        self.name = f"sinks.{kernel}"
        self.kernel = kernel
        self.device_type = device_type
        self.dtypes = dtypes
        self.max_head_dim = max_head_dim
        self.op = op
        self.min_capability = min_capability

    def cost(self, problem, launch=None):
        """Its own calibration where there is one; else the plain kernel's measured cost on the
        call without the sink, times SINK_PASS (the sink's elementwise passes over the output)."""
        own = super().cost(problem, launch)
        if own is not None or self.device_type != "cuda":
            return own
        arch = hardware.arch(problem.device_type, problem.device_index)
        plain = costs.predict(f"sdpa.{self.kernel}", arch, replace(problem, sinks=False))
        if plain is None:
            return None
        # the kernel's time scales; the host time is the sinks runner's own where measured
        return plain * SINK_PASS + (costs.host_ms(self.name, arch) or costs.host_ms(f"sdpa.{self.kernel}", arch))

    def supports(self, problem, policy) -> list[str]:
        reasons = []
        if problem.device_type != self.device_type:
            return [f"runs on {self.device_type} tensors only, got {problem.device_type}."]
        if not problem.sinks:
            reasons.append("runs calls with sinks only (the plain kernel takes the others).")
        if problem.dtype not in self.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            reasons.append(f"dtype {str(problem.dtype).replace('torch.', '')} not supported (takes {names}).")
        if self.device_type == "cuda" and not hardware.capability_at_least(problem.device_index,
                                                                            *self.min_capability):
            reasons.append("needs compute capability sm{}{} or newer.".format(*self.min_capability))
        if problem.head_dim != problem.value_dim or problem.head_dim % ALIGN_DIM or not 0 < problem.head_dim <= \
                self.max_head_dim:
            reasons.append(f"takes equal query and value head dims, multiples of {ALIGN_DIM} up to "
                           f"{self.max_head_dim}, got {problem.head_dim} and {problem.value_dim}.")
        if problem.mask_kind != "none" or problem.window is not None:
            reasons.append("takes no attn_mask or window (its kernel's call without a bias).")
        if problem.causal and problem.q_len != problem.kv_len:
            reasons.append("takes causal calls with q_len == k_len only (alignment).")
        if problem.dropout_p > 0:
            reasons.append("does not implement dropout.")
        if problem.out_lead is not None or problem.varlen:
            reasons.append("takes 4-D (B, H, N, D) tensors.")
        if problem.q_len == 0 or problem.kv_len == 0:
            reasons.append("does not take empty sequences.")
        if not problem.scale > 0:
            reasons.append("needs a positive scale.")
        if torch.compiler.is_compiling():
            reasons.append("runs eager calls only (it scales its kernel's saved output in place).")
        if self.kernel == "cudnn" and problem.needs_grad and problem.kv_len == CUDNN_NAN_KEYS:
            reasons.append(CUDNN_NAN_REASON)
        return reasons

    def run(self, query, key, value, attn_mask, problem, launch, label=None, modifiers=None):
        sinks = modifiers.sinks
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, sinks))
        if grad and _saved_tensor_hooks_active():  # (the in-place scaling would not reach a packed copy)
            return modified_attention(query, key, value, None, problem, modifiers)
        if self.device_type == "cuda":  # rows the kernel loads as they are: 16-byte aligned, unit stride
            # (a fresh copy: .contiguous() keeps a contiguous tensor whose base is misaligned)
            query, key, value = (t if fused_ready(t) else t.clone(memory_format=torch.contiguous_format)
                                 for t in (query, key, value))
        if problem.gqa:  # each query head's keys (the raw ops' GQA is not relied on; autograd sums back)
            key = key.repeat_interleave(problem.gqa_groups, dim=1)
            value = value.repeat_interleave(problem.gqa_groups, dim=1)
        out, lse = self.op(query, key, value, problem.causal, problem.scale, grad)
        b, h, n = out.shape[:3]
        compute = torch.float64 if out.dtype == torch.float64 else torch.float32
        margin = sink_margin(lse.reshape(b, h, n), sinks, compute)
        w = torch.sigmoid(margin)[..., None]
        if not grad:
            return (out.to(compute) * w).to(out.dtype)
        out.data.mul_(w)  # the kernel node's saved output becomes O' (module docstring)
        return _SinkWeights.apply(out, sinks, margin)


def sinks_runners() -> list[SdpaSinksRunner]:
    return [
        SdpaSinksRunner("cudnn", "cuda", HALF, 256 if CUDNN_WIDE else 128, _cudnn),
        SdpaSinksRunner("flash", "cuda", HALF, 256, _flash),
        SdpaSinksRunner("cpu", "cpu", (torch.float32, torch.float64), 256, _cpu),
    ]
