"""explain(), warmup() and info(): what a call would run and why, its one-time costs paid ahead."""

from __future__ import annotations

import time

import torch

from .. import planner
from ..planner import Plan
from ..policy import Policy
from ..problem import Problem, check_modifiers, validate
from .run import _check_policy, _runner_form


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

    def priority(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """The order that applies to this problem, in three parts, as the planner walks it:
        (approximate runners tried first under mode="auto", the priority data's list for this
        device, architecture and shape class (planner.priority), the exact runners outside it
        that Policy.backends names, tried after it)."""
        if self.plan is None:
            return (), (), ()
        listed = planner.priority(self.problem, self.plan.arch)
        first = tuple(n for n in self.plan.candidates if not planner.REGISTRY[n].exact)
        named = () if self.policy.backends is None else tuple(
            n for n in self.plan.order
            if n not in listed and planner.REGISTRY[n].exact and self.policy.admits(n))
        return first, listed, named

    def as_dict(self) -> dict:
        first, listed, named = self.priority()
        return {
            "problem": self.problem.describe(),
            "policy": repr(self.policy),
            "chosen": self.chosen,
            "priority": list(first + listed + named) if self.plan else None,
            "order": list(self.plan.order) if self.plan else None,
            "backends": {n: list(r) for n, r in self.plan.reasons} if self.plan else None,
            "costs_ms": dict(self.plan.costs) if self.plan else None,
            "notes": list(self.plan.notes) if self.plan else [],
            "error": self.error,
        }

    def __str__(self) -> str:
        lines = [f"problem: {self.problem.describe()}", f"policy:  {self.policy}"]
        if self.plan is None:
            lines.append(str(self.error))
            return "\n".join(lines)
        p = self.plan
        first, listed, named = self.priority()
        parts = ([f"{' > '.join(first)} (approximate, mode='auto')"] if first else []) + list(listed) + (
            [f"{' > '.join(named)} (named in Policy.backends)"] if named else [])
        lines.append(f"priority ({self.problem.device_type}/{p.arch}, {self.problem.seq_bucket} sequences): "
                     + (" > ".join(parts) or "(none)"))
        width = max(len(n) for n, _ in p.reasons)
        predicted = {n: ms for n, ms in p.costs if ms is not None}
        for name, why in p.reasons:
            if name == p.backend:
                status = "CHOSEN"
            elif not why:
                status = "ok (fallback)"
            else:
                status = "no: " + " ".join(why)
            if name in predicted:
                status += f" (predicted {predicted[name]:.3g} ms)"
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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> Explanation:
    """What `attention` with these arguments would run, and why every other backend declined.

    Takes the same arguments as `attention` (the score modifiers too) and raises the same input
    errors; launches nothing. `str()` of the result is a table; `.as_dict()` gives the same as data.
    """
    problem = validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout, window)
    problem, _ = check_modifiers(problem, softcap, sinks, alibi_slopes)
    return explain_problem(problem, policy)


def warmup(
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
) -> dict:
    """Pay a call's one-time costs now (for a server, at start-up): plan it and compile the
    kernels every runner it may run launches, for each shape class a server will see.

    Takes the same arguments as `attention`, with example tensors of the sizes and dtype to come
    (their values do not matter). Under Policy(mode="auto") that is each allowed quantized level
    of the approximate runners, as a verified call launches them, and the exact runner they would
    hand a call to; no call site's levels or measurements are touched (each site still analyses
    its own first call). Returns {"plan": the chosen runner, "warmed": what was compiled, "ms":
    wall time}.
    """
    t0 = time.perf_counter()
    problem = validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout, window)
    pol = _check_policy(policy)
    plan = planner.get_plan(problem, pol)
    query, key, value, attn_mask = _runner_form(problem, query, key, value, attn_mask)
    warmed: list[str] = []
    with torch.no_grad():
        for name, launch in zip(plan.candidates, plan.launches):
            runner = planner.REGISTRY[name]
            warmed += runner.warm(query, key, value, attn_mask, problem, launch)
            if runner.exact:  # the runner a call lands on: slower fallbacks stay cold
                break
    if query.is_cuda:
        torch.cuda.synchronize(query.device)
    return {"plan": plan.backend, "warmed": warmed, "ms": (time.perf_counter() - t0) * 1e3}


def info() -> dict:
    """Versions, devices (name, capability, SMs, memory, tensor-core precisions) and runners.

    Returns a dict; `adaattn info` prints the same as text.
    """
    return planner.runner_table()
