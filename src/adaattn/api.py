"""attention(): the one entry point, SDPA-compatible."""

from __future__ import annotations

import torch

from . import planner, stats
from .backends import REGISTRY
from .planner import Plan
from .policy import EXACT, Policy
from .problem import Problem, validate

QUANT = planner.QUANT


class _LevelNames:
    """Per-head levels held on the device until a stats reader asks for them."""

    def __init__(self, levels: torch.Tensor):
        self.levels = levels

    def resolve(self) -> list[str]:
        from .backends.triton_quant import LEVELS

        return [LEVELS[int(x)] for x in self.levels.tolist()]


def adaptive_run(*args, **kwargs):
    from .adaptive.runner import run

    return run(*args, **kwargs)


def _check_policy(policy: object) -> Policy:
    if policy is None:
        return EXACT
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an adaattn.Policy or None, got {type(policy).__name__}")
    return policy


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    layout: str = "bhsd",
    window: tuple[int | None, int | None] | None = None,
    policy: Policy | None = None,
    label: str | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention, a drop-in for torch.nn.functional.scaled_dot_product_attention.

    Shapes with layout="bhsd" (default): query (B, Hq, Nq, D), key (B, Hkv, Nk, D),
    value (B, Hkv, Nk, Dv) -> (B, Hq, Nq, Dv). With layout="bshd" every tensor is
    (B, N, H, D) instead, and the result is a (B, Nq, Hq, Dv) view; no copies are made.
    dtypes: float16, bfloat16, float32 (and float64), all three the same.

    attn_mask: bool (True = takes part) or additive in the query dtype, broadcastable to
        (B, Hq, Nq, Nk); it is always in (B, H, Nq, Nk) order, whatever the layout.
    is_causal: top-left aligned causal mask, as SDPA; may be combined with attn_mask.
    window: (left, right) sliding window: query i attends keys i-left .. i+right
        (None on a side = unbounded); combines with is_causal and attn_mask.
    enable_gqa: allow Hq a multiple of Hkv (grouped-query / multi-query attention).
    dropout_p: applied whenever > 0, as SDPA (pass 0.0 in eval).
    policy: what may be approximated; None means exact.
    label: a name recorded in adaattn.stats for this call (a layer name, say).

    A row with no key to attend (fully masked) gives zeros, as SDPA's math backend.
    Raises TypeError/ValueError on bad arguments, NoBackendError (a ValueError) when no
    backend can run the call under the policy.
    """
    compiling = _compiling()
    hit = None if compiling else _cached(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout, window, policy)
    if hit is None:
        problem = validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout, window)
        pol = _check_policy(policy)
        plan = planner.get_plan(problem, pol, compiling)
        if not compiling:
            planner.remember_call(_signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                             layout, window, policy), (problem, pol, plan))
    else:
        problem, pol, plan = hit
    if problem.layout == "bshd":
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if compiling:
        if plan.backend == QUANT:
            out, _ = adaptive_run(query, key, value, attn_mask, problem, plan, pol, label, compiling=True)
        else:
            out = REGISTRY[plan.backend].run(query, key, value, attn_mask, problem, plan)
    elif stats.enabled:
        out = _run_recorded(query, key, value, attn_mask, problem, plan, pol, label)
    else:
        out, _, _ = _run(query, key, value, attn_mask, problem, plan, pol, label)
    if problem.layout == "bshd":
        out = out.transpose(1, 2)
    return out


def _signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout, window, policy):
    """Everything validation depends on: calls with equal signatures have equal Problems."""
    return (
        query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype,
        query.device, key.device, value.device,
        None if attn_mask is None else (attn_mask.shape, attn_mask.dtype, attn_mask.device),
        dropout_p, is_causal, scale, enable_gqa, layout,
        None if window is None else tuple((w, type(w)) for w in window), policy,
        type(dropout_p), type(is_causal), type(scale), type(enable_gqa),
        torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad),
        torch.is_grad_enabled() and attn_mask is not None and getattr(attn_mask, "requires_grad", False),
    )


def _cached(*args):
    """The (problem, policy, plan) of an earlier call with the same signature, if any.

    Validation and planning cost more than a short kernel; a repeated call skips both.
    """
    try:
        return planner.recall_call(_signature(*args))
    except (AttributeError, TypeError):  # not tensors, or unhashable arguments: validate() says why
        return None


def _run(q, k, v, attn_mask, problem: Problem, plan: Plan, policy: Policy = EXACT,
         label: str | None = None) -> tuple[torch.Tensor, tuple[str, ...], dict | None]:
    """Run the first candidate; a backend that raises is marked failed and the next one runs.
    Returns (out, failed backends, per-head decisions of an adaptive run or None)."""
    failed: list[str] = []
    last = len(plan.candidates) - 1
    for i, name in enumerate(plan.candidates):
        try:
            if name == QUANT:
                out, info = adaptive_run(q, k, v, attn_mask, problem, plan, policy, label)
                return out, tuple(failed), info
            return REGISTRY[name].run(q, k, v, attn_mask, problem, plan), tuple(failed), None
        except Exception as e:
            if isinstance(e, torch.OutOfMemoryError) or "not enough memory" in str(e) or "out of memory" in str(e):
                raise torch.OutOfMemoryError(
                    f"adaattn: out of memory in backend {name} for {problem.describe()}: {e}"
                ) from e
            if i == last:
                # Nothing slower is left to fall back to: the error is the caller's to see, and
                # the backend is not marked failed for calls that may well succeed.
                raise
            planner.mark_failed(name, problem, e)  # a kernel failure: fall back to a slower path
            failed.append(name)
    raise AssertionError("unreachable: a plan always has a candidate")


def _run_recorded(q, k, v, attn_mask, problem, plan, policy, label):
    if stats.timing():
        with stats.Timer(q.device) as t:
            out, failed, info = _run(q, k, v, attn_mask, problem, plan, policy, label)
        wall = t.ms
    else:
        out, failed, info = _run(q, k, v, attn_mask, problem, plan, policy, label)
        wall = None
    ran = next(n for n in plan.candidates if n not in failed)
    if info is not None:
        decisions = {"precision": "per head", "head_levels": info.get("levels"),
                     "head_errors": info.get("errors"), "verified": info.get("verified", False),
                     "errors_measured_on": info.get("errors_measured_on"), "tolerance": policy.tolerance,
                     "approximation": "none", "notes": list(plan.notes)}
        if info.get("levels_after") is not None:
            decisions["head_levels_after_verification"] = _LevelNames(info["levels_after"])
        if info.get("note"):
            decisions["notes"].append(info["note"])
    else:
        decisions = {"precision": "native", "approximation": "none", "notes": list(plan.notes)}
    stats.add(
        stats.CallRecord(
            backend=ran,
            shape=f"B={problem.batch} Hq={problem.q_heads} Hkv={problem.kv_heads} "
            f"Nq={problem.q_len} Nk={problem.kv_len} D={problem.head_dim}",
            dtype=str(problem.dtype).replace("torch.", ""),
            device=f"{problem.device_type}/{plan.arch}",
            mode=policy.mode,
            decisions=decisions,
            fallbacks=failed,
            label=label,
            wall_ms=wall,
        )
    )
    return out


class Explanation:
    """What `attention` would do for a problem: every backend, its reasons, and the choice."""

    def __init__(self, problem: Problem, policy: Policy, plan: Plan | None, error: str | None):
        self.problem = problem
        self.policy = policy
        self.plan = plan
        self.error = error

    @property
    def chosen(self) -> str | None:
        return None if self.plan is None else self.plan.backend

    def as_dict(self) -> dict:
        return {
            "problem": self.problem.describe(),
            "policy": repr(self.policy),
            "chosen": self.chosen,
            "order": list(self.plan.order) if self.plan else None,
            "backends": {n: list(r) for n, r in self.plan.reasons} if self.plan else None,
            "notes": list(self.plan.notes) if self.plan else [],
            "error": self.error,
        }

    def __str__(self) -> str:
        lines = [f"problem: {self.problem.describe()}", f"policy:  {self.policy}"]
        if self.plan is None:
            lines.append(str(self.error))
            return "\n".join(lines)
        p = self.plan
        lines.append(f"priority ({self.problem.device_type}/{p.arch}, {self.problem.seq_bucket} sequences): "
                     + (" > ".join(p.order) or "(none)"))
        width = max(len(n) for n, _ in p.reasons)
        for name, why in p.reasons:
            if name == p.backend:
                status = "CHOSEN"
            elif not why:
                status = "ok (fallback)"
            else:
                status = "no: " + " ".join(why)
            lines.append(f"  {name:<{width}}  {status}")
        lines.append(f"chosen: {p.backend}")
        lines += [f"note: {n}" for n in p.notes]
        return "\n".join(lines)

    __repr__ = __str__


def explain_problem(problem: Problem, policy: Policy | None = None) -> Explanation:
    pol = _check_policy(policy)
    try:
        plan = planner.make_plan(problem, pol)
        return Explanation(problem, pol, plan, None)
    except planner.NoBackendError as e:
        return Explanation(problem, pol, None, str(e))


def explain(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    layout: str = "bhsd",
    window: tuple[int | None, int | None] | None = None,
    policy: Policy | None = None,
) -> Explanation:
    """What `attention` with these arguments would run, and why every other backend declined.

    Takes the same arguments as `attention` and raises the same input errors; launches nothing.
    `str()` of the result is a table; `.as_dict()` gives the same as data.
    """
    problem = validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout, window)
    return explain_problem(problem, policy)
