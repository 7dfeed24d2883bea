"""The adaptive-precision runners: which levels a policy allows, the custom op, one adaptive call.

    triton.quant.general  the general quantized kernel for every launch (kernels/attention_quant.py)
    triton.quant.ws       the warp-specialised quantized kernels (kernels/attention_quant_ws.py) for
                          a launch where every head is at qk8 or every head at fp8, the general
                          kernel for mixed levels; Hopper, no mask, no sliding window

Policy(backends=("triton.quant",)) admits both (a prefix admits every runner under it).

Both are approximate (`exact = False`): the planner offers them only under Policy(mode="auto").
`supports` answers the planner's question (no device work): the levels the policy allows on
this hardware for this problem, or the reasons none is. `run` executes a planned call through
the call site's controller; under torch.compile the same work is one custom op
(`adaattn::adaptive_fwd`) whose body runs eagerly, so the controller's host-side logic never
becomes part of a graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from .. import hardware
from ..backends.base import ExactAlternative, Runner
from ..backends.triton.common import unsupported_options
from . import choice, controller, sites
from . import quant_launch as tq


# Below this many query rows per key/value head (q_len x GQA group), against at least 4x as many
# keys (decode, chunked prefill against a cache), exact attention is bound by
# reading K and V (its FLOPs per byte of K/V are about 2 x these rows: under an H100's ~230
# FLOP/byte balance point until ~100 rows, and the pre-pass reads K/V once more and writes them
# quantized, so the quantized path cannot win until the kernel's compute dominates). Measured:
# mode="auto" in decode read 0.9 TB/s against cuDNN's 3.0 (NOTES.md, "auto never slower than exact");
# at 4k x 16 heads the quantized kernels still trail cuDNN (results/2026-11-23-prefill-h100.md). The
# planner's measured costs (costs.json) are what decide beyond this bound.
MIN_QUERY_ROWS_PER_KV_HEAD = 1024


@dataclass(frozen=True)
class QuantLaunch:
    """What a planned adaptive call needs: the levels allowed beyond exact and the policy's
    tolerance, verification rate and backward."""

    levels: tuple[int, ...]
    tolerance: float
    verify: float
    train_quantized: bool
    deterministic: bool
    allow_ws: bool
    policy_key: str
    fp8_wanted: bool = False  # the policy allowed fp8 (the notes say why it is not among the levels)
    runner: str = choice.GENERAL  # whose cost entries predict a site's time
    # The fastest exact runner the planner found, run instead where a site's option is no faster.
    exact: Optional[ExactAlternative] = field(default=None, compare=False)


def allowed_levels(problem, policy) -> tuple[tuple[int, ...], list[str]]:
    """(levels beyond exact that may run, reasons none may). Empty levels: the runner declines."""
    return levels_for(problem.device_type, problem.device_index, problem.needs_grad, policy)


def levels_for(device_type: str, device_index, needs_grad: bool, policy) -> tuple[tuple[int, ...], list[str]]:
    """allowed_levels from the facts it reads (for callers without a Problem: the ring's blocks)."""
    wanted = []
    reasons: list[str] = []
    if "int8" in policy.precisions:
        wanted.append(tq.LEVEL_QK8)
    if "fp8" in policy.precisions:
        if device_type == "cuda" and not tq.fp8_supported(torch.device("cuda", device_index or 0)):
            if tq.LEVEL_QK8 not in wanted:
                reasons.append("fp8: FP8 tensor cores need compute capability 8.9 or newer.")
        else:
            wanted.append(tq.LEVEL_FP8)
    if not wanted and not reasons:
        reasons.append("Policy.precisions allows no quantized precision (int8, fp8).")
    if needs_grad and not policy.train_quantized:
        reasons.append("inputs require grad: Policy(train_quantized=True) allows a quantized forward with an "
                       "exact backward.")
    return (tuple(wanted) if not reasons else ()), reasons


def site_key(problem, launch: QuantLaunch, label: Optional[str]) -> str:
    """The controller a call belongs to: its label (an AdaAttention module, say) under this
    policy, head layout and sequence bucket (decode and prefill keep separate levels), or else
    its shape class. A plain string (traceable by dynamo)."""
    head = (f"Hq={problem.q_heads} Hkv={problem.kv_heads} D={problem.head_dim} {problem.dtype} "
            f"causal={problem.causal} window={problem.window} mask={problem.mask_kind} scale={problem.scale} "
            f"{problem.seq_bucket} dev={problem.device_type}:{problem.device_index}")
    who = label if label is not None else f"anonymous {problem.shape_class}"
    return f"{who}|{launch.policy_key}|{head}"


_site_keys: dict = {}


def _site_key_eager(problem, launch: QuantLaunch, label: Optional[str]) -> str:
    """site_key, remembered per (problem, launch, label): the string costs microseconds to build."""
    key = (problem, launch, label)
    site = _site_keys.get(key)
    if site is None:
        if len(_site_keys) > 4096:
            _site_keys.clear()
        site = _site_keys[key] = site_key(problem, launch, label)
    return site


def _controller(site: str, tolerance: float, verify: float, levels, allow_ws: bool, q, attn_mask, causal: bool,
                left: int, right: int) -> controller.PrecisionController:
    """The controller of `site`, made on first use; its fp8 level's Q.K^T precision is chosen
    then (quant_launch.fp8_level_uses_fp8_qk: FP8 on Hopper)."""
    runner = "triton.quant.ws" if allow_ws else choice.GENERAL
    return sites.get(site, lambda: controller.PrecisionController(
        site, tolerance, verify, tuple(levels), q.shape[1],
        fp8_qk=tq.fp8_level_uses_fp8_qk(q, attn_mask, causal, left, right), allow_ws=allow_ws, runner=runner))


@torch.library.custom_op("adaattn::adaptive_fwd", mutates_args=())
def adaptive_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor], scale: float,
                 causal: bool, window_left: int, window_right: int, site: str, tolerance: float, verify: float,
                 levels: list[int], deterministic: bool, allow_ws: bool) -> torch.Tensor:
    """Adaptive-precision attention of one call site; q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D).
    The controller of `site` is made on first use from (tolerance, verify, levels)."""
    ctl = _controller(site, tolerance, verify, levels, allow_ws, q, attn_mask, causal, window_left, window_right)
    out, _ = ctl.run(q, k, v, attn_mask, scale, causal, False, window_left, window_right)
    return out


@adaptive_fwd.register_fake
def _adaptive_fwd_fake(q, k, v, attn_mask, scale, causal, window_left, window_right, site, tolerance, verify, levels,
                       deterministic, allow_ws):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def _setup(ctx, inputs, output):
    q, k, v, attn_mask, scale, causal, window_left, window_right = inputs[:8]
    ctx.save_for_backward(q, k, v, attn_mask)
    ctx.options = (scale, causal, window_left, window_right, inputs[12])


def _backward(ctx, dout):
    """Exact gradients: the exact forward is recomputed for its log-sum-exp, then the exact
    backward kernels run (the quantized forward's output is not differentiated)."""
    from ..backends.triton.launch import launch_id, make_launch
    from ..backends.triton.ops import triton_bwd, triton_fwd

    q, k, v, attn_mask = ctx.saved_tensors
    scale, causal, left, right, deterministic = ctx.options
    launch = launch_id(make_launch("ptr", scale, causal, left, right, False,
                                   deterministic or torch.are_deterministic_algorithms_enabled()))
    out, lse, stats = triton_fwd(q, k, v, attn_mask, None, None, q.shape[2], k.shape[2], launch)
    dq, dk, dv = triton_bwd(dout, q, k, v, out, lse, attn_mask, None, None, q.shape[2], k.shape[2], launch, stats)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


adaptive_fwd.register_autograd(_backward, setup_context=_setup)


class QuantizedRunner(Runner):
    """Quantized attention forward, per-head levels exact / qk8 / fp8 under a measured tolerance."""

    exact = False

    def __init__(self, warp_specialised: bool):
        self.warp_specialised = warp_specialised
        self.name = "triton.quant.ws" if warp_specialised else "triton.quant.general"

    def supports(self, problem, policy) -> list[str]:
        device = torch.device(problem.device_type, problem.device_index)
        reasons = tq.quant_can_run(device, problem.dtype, problem.head_dim, problem.value_dim)
        reasons += [r for r in unsupported_options(problem) if "value head_dim" not in r]
        if problem.varlen:
            reasons.append("takes dense (B, H, N, D) tensors, not packed sequences.")
        if problem.bottom_right:
            reasons.append("aligns causal masks top-left only.")
        if policy.mode == "auto":
            reasons += allowed_levels(problem, policy)[1]
        # (Keys against queries first: under torch.compile(dynamic=True) a square call then guards
        # on that alone, never on the row count, so prefill lengths do not recompile.)
        rows = problem.q_len * problem.gqa_groups
        if problem.kv_len >= 4 * problem.q_len and rows < MIN_QUERY_ROWS_PER_KV_HEAD:
            reasons.append(f"few query rows against the keys ({problem.q_len} x {problem.gqa_groups} per key/value head, "
                           f"under {MIN_QUERY_ROWS_PER_KV_HEAD}, with at least 4x as many keys): exact attention is bound by reading K and V there, and "
                           "quantizing them per call reads them again (a quantized KV cache does it once, at append).")
        if self.warp_specialised and not reasons:
            if not tq.ws_device_ok(device):
                reasons.append("warp-specialised quantized kernels run on Hopper (sm90) with triton 3.6+ only.")
            if problem.mask_kind != "none":
                reasons.append("takes no attn_mask.")
            if problem.window_left >= 0 or problem.window_right >= 0:
                reasons.append("has no sliding window (causal is fine).")
            if not problem.tma_aligned:
                reasons.append("needs q, k, v with unit last stride and 16-byte aligned base and strides.")
            if not problem.scale > 0:
                reasons.append("needs a positive scale.")
        return reasons

    def prepare(self, problem, policy) -> QuantLaunch:
        levels, _ = allowed_levels(problem, policy)
        key = (f"tolerance={policy.tolerance} precisions={policy.precisions} verify={policy.verify} "
               f"train_quantized={policy.train_quantized} runner={self.name}")
        return QuantLaunch(levels, policy.tolerance, policy.verify, policy.train_quantized,
                           bool(policy.deterministic), self.warp_specialised, key, "fp8" in policy.precisions,
                           self.name)

    def cost(self, problem, launch: Optional[QuantLaunch] = None) -> Optional[float]:
        """The predicted time of the cheapest level the launch allows, every head at it (the best
        a call site can do; a site's own levels are predicted once it has them)."""
        levels = launch.levels if launch is not None else (tq.LEVEL_QK8, tq.LEVEL_FP8)
        return choice.cheapest(self.name, hardware.arch(problem.device_type, problem.device_index), problem, levels)

    def attach_exact(self, launch: QuantLaunch, exact: ExactAlternative) -> QuantLaunch:
        return replace(launch, exact=exact)

    def notes(self, problem, launch: QuantLaunch) -> list[str]:
        names = ", ".join(tq.LEVELS[x] for x in (tq.LEVEL_EXACT, *launch.levels))
        dropped = []
        if launch.fp8_wanted and tq.LEVEL_FP8 not in launch.levels:
            dropped.append("fp8: FP8 tensor cores need compute capability 8.9 or newer; this GPU lacks them, so "
                           "qk8 (INT8 Q.K^T, P.V in the input dtype) is the cheapest level here.")
        return dropped + [f"mode='auto': each head runs at one of ({names}) under tolerance {launch.tolerance:g}: it starts "
                f"at the cheapest level predicted to meet it, sampled rows check it (on every first call, then on "
                f"a fraction {launch.verify:g} of calls), and heads over it are recomputed one level up."
                + (" The backward is exact." if problem.needs_grad else "")]

    def run(self, query, key, value, attn_mask, problem, launch, label=None):
        return self._run(query, key, value, attn_mask, problem, launch, label)[0]

    def warm(self, query, key, value, attn_mask, problem, launch: QuantLaunch) -> list[str]:
        """Each allowed level's kernels, as a first call and as a verified call would launch them
        (pre-pass, kernel, sampled exact rows, verification steps), on a throwaway controller per
        level: no call site's levels or measurements are touched."""
        warmed = []
        fp8_qk = tq.fp8_level_uses_fp8_qk(query, attn_mask, problem.causal, problem.window_left, problem.window_right)
        args = (query, key, value, attn_mask, problem.scale, problem.causal, False, problem.window_left,
                problem.window_right)
        # A first call's analysis (sampled exact rows, statistics, predictions): measured on the
        # H100, a site's first call took 614 ms after the kernels were warmed and 13 ms for the
        # next site, the difference being these first uses.
        controller.PrecisionController(f"adaattn.warmup|{self.name}|first|{problem.shape_class}", launch.tolerance,
                                       1.0, launch.levels, query.shape[1], fp8_qk=fp8_qk, allow_ws=launch.allow_ws,
                                       runner=self.name).run(*args)
        warmed.append(f"{self.name}:first call")
        for level in (tq.LEVEL_EXACT, *launch.levels):
            ctl = controller.held_at(f"adaattn.warmup|{self.name}|{tq.LEVELS[level]}|{problem.shape_class}", level,
                                     query.shape[1], tolerance=launch.tolerance, verify=1.0, fp8_qk=fp8_qk,
                                     allow_ws=launch.allow_ws, runner=self.name)
            ctl.run(*args)  # a verified steady-state call: every kernel such a call launches
            ctl.poll(wait=True)
            warmed.append(f"{self.name}:{tq.LEVELS[level]}")
        return warmed

    def run_recorded(self, query, key, value, attn_mask, problem, launch, label=None):
        out, info = self._run(query, key, value, attn_mask, problem, launch, label)
        decisions = {"precision": "per head", "approximation": "none", "tolerance": launch.tolerance,
                     "head_levels": info.get("levels"), "head_errors": info.get("errors"),
                     "verified": info.get("verified", False), "errors_measured_on": info.get("errors_measured_on")}
        if info.get("levels_after") is not None:
            decisions["head_levels_after_verification"] = LevelNames(info["levels_after"])
        if info.get("note"):
            decisions["note"] = info["note"]
        for k in ("option", "rejected", "predicted_ms", "exact_ms", "measured_ms", "why", "ran"):
            if k in info:
                decisions[k] = info[k]
        return out, decisions

    def _run(self, q, k, v, attn_mask, problem, launch: QuantLaunch, label):
        compiling = torch.compiler.is_compiling()
        site = site_key(problem, launch, label) if compiling else _site_key_eager(problem, launch, label)
        scale, left, right = problem.scale, problem.window_left, problem.window_right
        if compiling:
            out = adaptive_fwd(q, k, v, attn_mask, scale, problem.causal, left, right, site, launch.tolerance,
                               launch.verify, list(launch.levels), launch.deterministic, launch.allow_ws)
            return out, {}
        ctl = _controller(site, launch.tolerance, launch.verify, launch.levels, launch.allow_ws, q, attn_mask,
                          problem.causal, left, right)
        if problem.needs_grad:
            # A site that settled on exact runs the exact runner with its own backward; otherwise
            # the quantized forward with an exact backward (the custom op's autograd).
            picked = ctl.choose(problem, launch.exact) if ctl.levels is not None and launch.exact else None
            if picked is not None and not picked.quantized:
                return (launch.exact.run(q, k, v, attn_mask, problem, label),
                        ctl.exact_info(picked, launch.exact, "an earlier call"))
            out = adaptive_fwd(q, k, v, attn_mask, scale, problem.causal, left, right, site, launch.tolerance,
                               launch.verify, list(launch.levels), launch.deterministic, launch.allow_ws)
            info = {"levels": ctl.describe()["levels"], "errors": list(ctl.errors),
                    "note": "quantized forward, exact backward"}
            return out, ({**info, **picked.as_dict()} if picked is not None else info)
        return ctl.run(q, k, v, attn_mask, scale, problem.causal, False, left, right, exact=launch.exact,
                       problem=problem)


class LevelNames:
    """Per-head levels held on the device until a stats reader asks for them."""

    def __init__(self, levels: torch.Tensor):
        self.levels = levels

    def resolve(self) -> list[str]:
        return [tq.LEVELS[int(x)] for x in self.levels.tolist()]


def adaptive_runners() -> list[Runner]:
    return [QuantizedRunner(warp_specialised=True), QuantizedRunner(warp_specialised=False)]
