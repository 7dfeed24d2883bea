"""Plan: which backend runs a problem, chosen by walking a measured priority list."""

from __future__ import annotations

import json
import threading
import warnings
from dataclasses import dataclass
from importlib import resources

from . import hardware
from .backends import REGISTRY
from .policy import Policy
from .problem import Problem


@dataclass(frozen=True)
class Plan:
    """The backend to run, those to fall back to, and why every other backend declined."""

    backend: str
    candidates: tuple[str, ...]
    order: tuple[str, ...]
    reasons: tuple[tuple[str, tuple[str, ...]], ...]
    notes: tuple[str, ...]
    arch: str
    levels: tuple[int, ...] = ()  # quantized levels allowed to "triton.quant" (mode="auto")
    deterministic: bool = False  # Policy.deterministic: backends with a choice take the reproducible path


class NoBackendError(ValueError):
    """No backend can run the problem under the policy; the message lists each one's reasons."""


def _load_priority() -> list[dict]:
    text = resources.files("adaattn").joinpath("priority.json").read_text()
    return json.loads(text)["rules"]


PRIORITY_RULES: list[dict] = _load_priority()

_lock = threading.Lock()
_cache: dict[tuple, Plan] = {}
_failed: dict[tuple[str, tuple], str] = {}  # (backend, shape class) -> error
_calls: dict[tuple, tuple] = {}  # call signature -> (problem, policy, plan), see api._signature
_CALLS_LIMIT = 4096


def _matches(rule: dict, facts: dict) -> bool:
    for field, want in rule.items():
        if field == "order":
            continue
        have = facts[field]
        if isinstance(want, list):
            if have not in want:
                return False
        elif have != want:
            return False
    return True


def priority(problem: Problem, arch: str) -> tuple[str, ...]:
    """The ordered backend names the priority data gives for this problem."""
    facts = {
        "device": problem.device_type,
        "arch": arch,
        "dtype": str(problem.dtype).replace("torch.", ""),
        "seq_bucket": problem.seq_bucket,
        "causal": problem.causal,
        "mask": problem.mask_kind,
        "window": problem.window is not None,
        "needs_grad": problem.needs_grad,
    }
    for rule in PRIORITY_RULES:
        if _matches(rule, facts):
            return tuple(rule["order"])
    return ()


def make_plan(problem: Problem, policy: Policy) -> Plan:
    """Walk the priority list; every registered backend gets its reasons recorded."""
    arch = hardware.arch(problem.device_type, problem.device_index)
    order = priority(problem, arch)
    notes = []
    levels: tuple[int, ...] = ()
    if policy.mode == "auto":
        levels, notes = _adaptive(problem, policy)
        if levels:
            order = (QUANT,) + order
    if policy.backends is not None:
        # Named backends absent from the list (reference, say) go last, in the order named.
        extra = [n for b in policy.backends for n in REGISTRY if n not in order and policy.admits(n) and (n == b or n.startswith(b + "."))]
        order = order + tuple(dict.fromkeys(extra))
    names = list(order) + [n for n in REGISTRY if n not in order]
    reasons = []
    candidates = []
    shape_class = problem.shape_class
    for name in names:
        backend = REGISTRY[name]
        why = list(backend.supports(problem))
        if name == QUANT and name not in order:
            why.append("approximate (quantized): runs only under Policy(mode='auto') with precisions beyond "
                       "'native', where the notes below say why not." if policy.mode == "auto" else
                       "approximate (quantized): runs only under Policy(mode='auto').")
        elif name not in order:
            why.append(f"not in the priority list for {problem.device_type}/{arch}; used only when named in Policy.backends.")
        if not policy.admits(name):
            why.append(f"excluded by Policy.backends={policy.backends}.")
        failed = _failed.get((name, shape_class))
        if failed is not None:
            why.append(f"failed at run time earlier for this problem class ({failed}).")
        reasons.append((name, tuple(why)))
        if not why:
            candidates.append(name)
    if not candidates:
        lines = [f"no backend can run {problem.describe()} under {policy}:"]
        lines += [f"  {n}: {' '.join(r)}" for n, r in reasons]
        raise NoBackendError("\n".join(lines))
    return Plan(
        backend=candidates[0],
        candidates=tuple(candidates),
        order=order,
        reasons=tuple(reasons),
        notes=tuple(notes),
        arch=arch,
        levels=levels if candidates[0] == QUANT else (),
        deterministic=policy.deterministic,
    )


QUANT = "triton.quant"


def _adaptive(problem: Problem, policy: Policy) -> tuple[tuple[int, ...], list[str]]:
    """Quantized levels this call may use under an auto policy, and notes on what was dropped."""
    from .adaptive.runner import allowed_levels

    if QUANT not in REGISTRY:
        return (), ["mode='auto': the quantized kernels need triton, which does not import here; "
                    "the call runs exact."]
    if not policy.admits(QUANT):
        return (), [f"mode='auto': Policy.backends={policy.backends} excludes {QUANT}; the call runs exact."]
    return allowed_levels(problem, policy, REGISTRY[QUANT].supports(problem))


def get_plan(problem: Problem, policy: Policy, compiling: bool = False) -> Plan:
    """The cached plan for this problem class and policy (computed fresh under torch.compile)."""
    if compiling:
        return make_plan(problem, policy)
    key = (problem.shape_class, problem.device_index, policy)
    plan = _cache.get(key)
    if plan is None:
        plan = make_plan(problem, policy)
        with _lock:
            _cache[key] = plan
    return plan


def recall_call(signature: tuple):
    return _calls.get(signature)


def remember_call(signature: tuple, entry: tuple) -> None:
    try:
        with _lock:
            if len(_calls) >= _CALLS_LIMIT:
                _calls.clear()
            _calls[signature] = entry
    except TypeError:  # an unhashable argument: such calls are simply not cached
        pass


def mark_failed(name: str, problem: Problem, error: BaseException) -> None:
    """Remember that `name` failed for this problem class, and say so once."""
    summary = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}"
    with _lock:
        first = (name, problem.shape_class) not in _failed
        _failed[(name, problem.shape_class)] = summary
        _cache.clear()
        _calls.clear()
    if first:
        warnings.warn(
            f"adaattn: backend {name} failed for {problem.describe()} ({summary}); "
            "falling back to the next backend for this problem class.",
            RuntimeWarning,
            stacklevel=4,
        )


def reset() -> None:
    """Forget cached plans and remembered failures (for tests, or after changing the environment)."""
    with _lock:
        _cache.clear()
        _calls.clear()
        _failed.clear()


def runner_names() -> tuple[str, ...]:
    """Every registered runner's name, in registration order."""
    return tuple(REGISTRY)


def bind(name: str, problem: Problem, policy: Policy | None = None):
    """fn(query, key, value, attn_mask=None) -> out: runner `name` alone on calls described by
    `problem` (no dispatch, no fallback), for benchmarks that time one runner against another.
    Raises NoBackendError when that runner declines the problem, with its reasons."""
    if name not in REGISTRY:
        raise ValueError(f"runner must be one of {', '.join(REGISTRY)}, got {name!r}")
    pol = policy if policy is not None else Policy(backends=(name,))
    plan = make_plan(problem, pol)
    if plan.backend != name:
        why = dict(plan.reasons).get(name, ())
        raise NoBackendError(f"runner {name} declines {problem.describe()}: {' '.join(why)}")
    runner = REGISTRY[name]

    def fn(query, key, value, attn_mask=None):
        return runner.run(query, key, value, attn_mask, problem, plan)

    return fn
