"""What every entry point shares: the policy check, the tensors in the form runners take, the
call signature, running a plan with its fallbacks, and the record of what ran."""

from __future__ import annotations

from typing import Optional

import torch

from .. import planner, settings, stats
from ..backends import Declined
from ..planner import Plan
from ..policy import EXACT, Policy
from ..problem import Problem, to_internal


def _check_policy(policy: object) -> Policy:
    if policy is None:
        return EXACT
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an adaattn.Policy or None, got {type(policy).__name__}")
    return policy


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _runner_form(problem: Problem, query, key, value, attn_mask, call_form: bool = False):
    """The tensors as runners take them: (B, H, N, D), leading dims broadcast and flattened
    (`call_form`: in the call's own rank, only bshd turned to bhsd)."""
    if problem.layout == "bshd":
        query, key, value = query.transpose(-3, -2), key.transpose(-3, -2), value.transpose(-3, -2)
    if problem.out_lead is not None and not call_form:
        query, key, value, attn_mask = to_internal(problem, query, key, value, attn_mask)
    return query, key, value, attn_mask


def _signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout, window, policy):
    """Everything validation depends on: calls with equal signatures have equal Problems."""
    return (
        query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype,
        query.stride(), key.stride(), value.stride(),
        query.data_ptr() % 16, key.data_ptr() % 16, value.data_ptr() % 16,
        query.device, key.device, value.device,
        None if attn_mask is None else (attn_mask.shape, attn_mask.dtype, attn_mask.device),
        dropout_p, is_causal, scale, enable_gqa, layout,
        None if window is None else tuple((w, type(w)) for w in window), policy,
        type(dropout_p), type(is_causal), type(scale), type(enable_gqa),
        torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad),
        torch.is_grad_enabled() and attn_mask is not None and getattr(attn_mask, "requires_grad", False),
        settings.current(), torch.are_deterministic_algorithms_enabled(),
    )


def _modifier_key(softcap, sinks, alibi_slopes):
    """What check_modifiers depends on, for the call's signature: the cap's value, and each tensor's
    shape, dtype, device and whether it wants a gradient (None where one cannot be made: the call
    is then validated every time)."""
    if softcap is not None and type(softcap) is not float:
        return None
    key = [softcap]
    for t in (sinks, alibi_slopes):
        if t is not None and not isinstance(t, torch.Tensor):
            return None
        key.append(None if t is None else (t.shape, t.dtype, t.device, torch.is_grad_enabled() and t.requires_grad))
    return tuple(key)


def _signature_or_none(*args):
    """The call's signature, the key of its (problem, policy, plan): validation and planning cost
    more than a short kernel, and a repeated call skips both. None where it cannot be made."""
    try:
        return _signature(*args)
    except (AttributeError, TypeError):  # not tensors, or unhashable arguments: validate() says why
        return None


def _first_that_runs(problem: Problem, plan: Plan, call, first_error: Optional[Exception] = None
                     ) -> tuple[object, tuple[str, ...]]:
    """call(runner, launch) on the first candidate; a runner that raises is marked failed and
    the next one runs. Returns (what call returned, the runners that failed). first_error: what
    the first candidate raised where the caller ran it already (_run's steady path)."""
    failed: list[str] = []
    last = len(plan.candidates) - 1
    for i, (name, launch) in enumerate(zip(plan.candidates, plan.launches)):
        try:
            if first_error is not None and i == 0:
                raise first_error
            return call(planner.REGISTRY[name], launch), tuple(failed)
        except Declined:
            if i == last:
                raise
            failed.append(name)  # its kernel's own check refused these tensors: no warning
        except Exception as e:
            _raise_if_oom(e, name, problem)
            if i == last:
                # Nothing slower is left to fall back to: the error is the caller's to see, and
                # the runner is not marked failed for calls that may well succeed.
                raise
            planner.mark_failed(name, problem, e)  # a kernel failure: fall back to a slower path
            failed.append(name)
    raise AssertionError("unreachable: a plan always has a candidate")


def _run(q, k, v, attn_mask, problem: Problem, plan: Plan, label: Optional[str] = None,
         recorded: bool = False, modifiers=None) -> tuple[torch.Tensor, tuple[str, ...], Optional[dict]]:
    """Run the plan (see _first_that_runs). Returns (out, failed runners, the decisions of the
    runner that ran when `recorded`). modifiers: the call's problem.Modifiers (None without any),
    handed to the runner, which the planner chose for applying them."""
    if recorded:
        kw = {} if modifiers is None else {"modifiers": modifiers}
        (out, decisions), failed = _first_that_runs(
            problem, plan, lambda r, launch: r.run_recorded(q, k, v, attn_mask, problem, launch, label, **kw))
        return out, failed, decisions
    if modifiers is None:  # (no keyword to pass: most calls)
        def call(r, launch):
            return r.run(q, k, v, attn_mask, problem, launch, label)
    else:
        def call(r, launch):
            return r.run(q, k, v, attn_mask, problem, launch, label, modifiers=modifiers)
    # The steady path: the first candidate, called as it is (most calls end here); what it raises
    # goes to _first_that_runs as that candidate's outcome, so no runner runs twice.
    try:
        return call(plan.runner, plan.launches[0]), (), None
    except Exception as e:  # (Declined included)
        first_error = e
    out, failed = _first_that_runs(problem, plan, call, first_error)
    return out, failed, None


def _raise_if_oom(e: BaseException, name: str, problem: Problem) -> None:
    if isinstance(e, torch.OutOfMemoryError) or "not enough memory" in str(e) or "out of memory" in str(e):
        raise torch.OutOfMemoryError(f"adaattn: out of memory in runner {name} for {problem.describe()}: {e}") from e


def _run_recorded(q, k, v, attn_mask, problem, plan, policy, label, modifiers=None):
    if stats.timing():
        with stats.Timer(q.device) as t:
            out, failed, decisions = _run(q, k, v, attn_mask, problem, plan, label, True, modifiers)
        wall = t.ms
    else:
        out, failed, decisions = _run(q, k, v, attn_mask, problem, plan, label, True, modifiers)
        wall = None
    _record(problem, plan, policy, label, failed, decisions, wall)
    return out


def _record(problem, plan, policy, label, failed, decisions, wall) -> None:
    decisions = dict(decisions or {})
    ran = decisions.pop("ran", None) or next(n for n in plan.candidates if n not in failed)
    if policy.mode == "auto" and "option" not in decisions:
        _plan_choice(plan, ran, decisions)
    notes = list(plan.notes)
    note = decisions.pop("note", None)
    if note:
        notes.append(note)
    decisions["notes"] = notes
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


def _plan_choice(plan: Plan, ran: str, decisions: dict) -> None:
    """An auto call the plan sent to an exact runner: the option that ran, the approximate runners
    it rejected and why (their predicted times against the exact runner's, where the cost data
    decided), and the prediction of the one that ran (its measured time is the record's wall_ms
    under stats timing)."""
    predicted = dict(plan.costs)
    approximate = [n for n in plan.order if not planner.REGISTRY[n].exact]
    why = {n: r for n, r in plan.reasons if n in approximate and r}
    decisions["option"] = f"exact ({ran})"
    decisions["rejected"] = ", ".join(approximate) if approximate else None
    decisions["predicted_ms"] = None
    decisions["exact_ms"] = predicted.get(ran)
    decisions["measured_ms"] = None
    decisions["why"] = " ".join(f"{n}: {r[-1]}" for n, r in why.items()) or None
