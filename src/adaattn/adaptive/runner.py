"""The adaptive-precision call: which levels a problem may use, the custom op, and the run.

`allowed_levels` is the planner's question (no device work): the levels a policy allows on
this hardware for this problem, with a note for every level or reason that was dropped.
`run` executes a planned call through the call site's controller; under torch.compile the
same work is one custom op (`adaattn::adaptive_fwd`) whose body runs eagerly, so the
controller's host-side logic never becomes part of a graph.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..backends import triton_quant as tq
from . import controller



def allowed_levels(problem, policy, quant_reasons: list[str]) -> tuple[tuple[int, ...], list[str]]:
    """(levels beyond exact that may run, notes). Empty levels: the call runs exact, and the
    notes say why."""
    notes: list[str] = []
    wanted = []
    if "int8" in policy.precisions:
        wanted.append(tq.LEVEL_QK8)
    if "fp8" in policy.precisions:
        if problem.device_type == "cuda" and not tq.fp8_supported(torch.device("cuda", problem.device_index or 0)):
            notes.append("fp8: FP8 tensor cores need compute capability 8.9 or newer; this GPU lacks them, so "
                         "qk8 (INT8 Q.K^T, P.V in the input dtype) is the cheapest level here.")
        else:
            wanted.append(tq.LEVEL_FP8)
    if policy.approximations:
        notes.append(f"approximations {policy.approximations}: not implemented in this version; no tile is "
                     "approximated.")
    if not wanted:
        notes.append("mode='auto' with no quantized precision allowed (or available): every head runs exact.")
        return (), notes
    if problem.needs_grad and not policy.train_quantized:
        notes.append("inputs require grad: the exact kernels run. Policy(train_quantized=True) allows a "
                     "quantized forward with an exact backward.")
        return (), notes
    if problem.dropout_p > 0:
        notes.append("dropout_p > 0: the quantized kernels have no dropout; the exact kernels run.")
        return (), notes
    if quant_reasons:
        where = "on the CPU" if problem.device_type == "cpu" else "this problem"
        notes.append(f"quantized kernels cannot run {where} ({' '.join(quant_reasons)}); the exact kernels run.")
        return (), notes
    names = ", ".join(tq.LEVELS[x] for x in (tq.LEVEL_EXACT, *wanted))
    notes.append(
        f"mode='auto': each head runs at one of ({names}) under tolerance {policy.tolerance:g}: it starts at "
        f"the cheapest level predicted to meet it, sampled rows check it (on every first call, then on a "
        f"fraction {policy.verify:g} of calls), and heads over it are recomputed one level up."
        + (" The backward is exact." if problem.needs_grad else ""))
    return tuple(wanted), notes


def site_key(problem, policy, label: Optional[str]) -> str:
    """The controller a call belongs to: its label (an AdaAttention module, say) under this
    policy, head layout and sequence bucket (decode and prefill keep separate levels), or else
    its shape class. A plain string (traceable by dynamo)."""
    head = (f"Hq={problem.q_heads} Hkv={problem.kv_heads} D={problem.head_dim} {problem.dtype} "
            f"causal={problem.causal} window={problem.window} mask={problem.mask_kind} scale={problem.scale} "
            f"{problem.seq_bucket} dev={problem.device_type}:{problem.device_index}")
    pol = (f"tolerance={policy.tolerance} precisions={policy.precisions} verify={policy.verify} "
           f"train_quantized={policy.train_quantized}")
    who = label if label is not None else f"anonymous {problem.shape_class}"
    return f"{who}|{pol}|{head}"


_site_keys: dict = {}


def _site_key_eager(problem, policy, label: Optional[str]) -> str:
    """site_key, remembered per (problem, policy, label): the string costs microseconds to build."""
    key = (problem, policy, label)
    site = _site_keys.get(key)
    if site is None:
        if len(_site_keys) > 4096:
            _site_keys.clear()
        site = _site_keys[key] = site_key(problem, policy, label)
    return site


def _controller(site: str, tolerance: float, verify: float, levels, q, attn_mask, causal: bool, left: int,
                right: int) -> controller.PrecisionController:
    """The controller of `site`, made on first use; its fp8 level's Q.K^T precision is chosen
    then (triton_quant.fp8_level_uses_fp8_qk: FP8 on Hopper)."""
    return controller.get(site, lambda: controller.PrecisionController(
        site, tolerance, verify, tuple(levels), q.shape[1],
        fp8_qk=tq.fp8_level_uses_fp8_qk(q, attn_mask, causal, left, right)))


def _window(problem) -> tuple[int, int]:
    if problem.window is None:
        return -1, -1
    left, right = problem.window
    return (-1 if left is None else int(left)), (-1 if right is None else int(right))


@torch.library.custom_op("adaattn::adaptive_fwd", mutates_args=())
def adaptive_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor], scale: float,
                 causal: bool, window_left: int, window_right: int, site: str, tolerance: float, verify: float,
                 levels: list[int], deterministic: bool) -> torch.Tensor:
    """Adaptive-precision attention of one call site; q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D).
    The controller of `site` is made on first use from (tolerance, verify, levels)."""
    ctl = _controller(site, tolerance, verify, levels, q, attn_mask, causal, window_left, window_right)
    out, _ = ctl.run(q, k, v, attn_mask, scale, causal, False, window_left, window_right)
    return out


@adaptive_fwd.register_fake
def _adaptive_fwd_fake(q, k, v, attn_mask, scale, causal, window_left, window_right, site, tolerance, verify, levels,
                       deterministic):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def _setup(ctx, inputs, output):
    q, k, v, attn_mask, scale, causal, window_left, window_right = inputs[:8]
    ctx.save_for_backward(q, k, v, attn_mask)
    ctx.options = (scale, causal, window_left, window_right, inputs[-1])


def _backward(ctx, dout):
    """Exact gradients: the exact forward is recomputed for its log-sum-exp, then the exact
    backward kernels run (the quantized forward's output is not differentiated)."""
    from ..backends.triton_attention import flash_bwd, flash_fwd

    q, k, v, attn_mask = ctx.saved_tensors
    scale, causal, left, right, deterministic = ctx.options
    args = (attn_mask, None, None, q.shape[2], k.shape[2], scale, causal, False, left, right,
            deterministic or torch.are_deterministic_algorithms_enabled())
    out, lse = flash_fwd(q, k, v, *args)
    dq, dk, dv = flash_bwd(dout, q, k, v, out, lse, *args)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


adaptive_fwd.register_autograd(_backward, setup_context=_setup)


def run(q, k, v, attn_mask, problem, plan, policy, label, compiling: bool = False):
    """(out, info) for a call the planner gave to "triton.quant"; info is None when compiling."""
    site = site_key(problem, policy, label) if compiling else _site_key_eager(problem, policy, label)
    scale = problem.scale if problem.scale is not None else 1.0 / math.sqrt(problem.head_dim)
    left, right = _window(problem)
    if compiling or problem.needs_grad:
        out = adaptive_fwd(q, k, v, attn_mask, scale, problem.causal, left, right, site, policy.tolerance,
                           policy.verify, list(plan.levels), plan.deterministic)
        if compiling:
            return out, None
        ctl = _controller(site, policy.tolerance, policy.verify, plan.levels, q, attn_mask, problem.causal, left, right)
        return out, {"levels": ctl.describe()["levels"], "errors": list(ctl.errors),
                     "note": "quantized forward, exact backward"}
    ctl = _controller(site, policy.tolerance, policy.verify, plan.levels, q, attn_mask, problem.causal, left, right)
    return ctl.run(q, k, v, attn_mask, scale, problem.causal, False, left, right)
