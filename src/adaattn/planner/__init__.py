"""The planner: the registry of runners, and the choice of one for a problem under a policy
(this module: prefill and training calls); decode steps (planner/decode.py) and ring blocks (below,
with planner/choice.py's chooser) are chosen here too.

Every runner answers the same questions (`supports`, `cost`, `prepare`), so `explain` can say
of any of them why it did or did not run. The order is measured data (priority.json); under
Policy(mode="auto") approximate runners that can take the call go before the exact ones.
"""

from __future__ import annotations

import dataclasses

import json
import os
import threading
import warnings
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from .. import costs, hardware, policy as policy_mod, settings
from ..adaptive.rank import rank_runners
from ..adaptive.runner import adaptive_runners
from ..backends import ExactAlternative, Runner, exact_runners
from ..backends.base import modifier_reasons
from ..backends.sdpa_forms import CUDNN_NAN_KEYS, CUDNN_VERSION, CUDNN_WIDE, HALF
from ..backends.ring_blocks import ring_block_runners
from ..policy import Policy
from ..problem import Problem, default_scale
from .choice import _ORDERS, KINDS, Choice, NoBackendError, RunnerDeclines, choose, register_kind  # noqa: F401 (choose: the public chooser)
from .decode import DECODE_RUNNER_NAMES, explain_decode, plan_decode  # noqa: F401 (the decode entry points)

REGISTRY: dict[str, Runner] = {}


@dataclass(frozen=True)
class Plan:
    """The runner to run, those to fall back to (each with its launch description), and why
    every other runner declined."""

    backend: str
    candidates: tuple[str, ...]
    launches: tuple[Any, ...]  # runner.prepare(...) of each candidate
    order: tuple[str, ...]
    reasons: tuple[tuple[str, tuple[str, ...]], ...]
    notes: tuple[str, ...]
    arch: str
    costs: tuple[tuple[str, float | None], ...] = ()

    @property
    def runner(self) -> Runner:
        return REGISTRY[self.backend]

    @property
    def launch(self) -> Any:
        return self.launches[0]


def register(runner: Runner) -> Runner:
    """Add (or replace) a runner; the priority data decides when it is chosen."""
    REGISTRY[runner.name] = runner
    policy_mod.known_runners.add(runner.name)
    reset()
    return runner


def _load_priority() -> list[dict]:
    text = resources.files("adaattn").joinpath("priority.json").read_text()
    return json.loads(text)["rules"]


PRIORITY_RULES: list[dict] = _load_priority()

_lock = threading.Lock()
_cache: dict[tuple, Plan] = {}
_failed: dict[tuple[str, tuple], str] = {}  # (runner, shape class) -> error
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
    """The ordered runner names the priority data gives for this problem."""
    facts = {
        "device": problem.device_type,
        "arch": arch,
        "dtype": str(problem.dtype).replace("torch.", ""),
        "seq_bucket": problem.seq_bucket,
        "causal": problem.causal,
        "mask": problem.mask_kind,
        "window": problem.window is not None,
        "needs_grad": problem.needs_grad,
        "varlen": problem.varlen,
        "modifiers": bool(problem.modifiers),
    }
    for rule in PRIORITY_RULES:
        if _matches(rule, facts):
            return tuple(rule["order"])
    return ()


def torch_takes_fused(problem: Problem, takes: dict, arch: str = "") -> bool:
    """Whether torch's SDPA, by its own default order, would run a fused kernel on the call, from
    the runners' own answers (`takes`, runner name -> no reasons). Its order is flash, efficient,
    math, then cuDNN (math's acceptance of every call leaves cuDNN unreached), except where it
    prefers cuDNN: from torch 2.11 on Hopper and Blackwell, cuDNN comes first (on an H200 torch's
    own answers equalled its pinned cuDNN kernel's to the bit, where flash's differed: CUDA fuzzer
    seeds 5410-5413). Its efficient kernel takes no GQA (our sdpa.efficient repeats the heads):
    torch runs math there."""
    if takes.get("sdpa.cudnn", False) and _torch_prefers_cudnn(arch):
        return True
    return takes.get("sdpa.flash", False) or (takes.get("sdpa.efficient", False) and not problem.gqa)


TORCH_PREFERS_CUDNN = ("sm90", "sm100", "sm103")
MATH_SCORES = 1 << 26  # the largest score matrix sdpa.math takes first (its float32 weights: 256 MiB)


def _torch_prefers_cudnn(arch: str) -> bool:
    """torch's check for putting cuDNN first: torch >= 2.11 (what was measured), Hopper or Blackwell,
    a cuDNN of 9.9 or later, and TORCH_CUDNN_SDPA_DEPRIORITIZED unset (newer torch asks for a newer
    cuDNN still: there our answer says fused where torch may run math, the faster side). The cuDNN
    version is read once, at import: torch.compile cannot trace torch.backends.cudnn.version()."""
    if not (CUDNN_WIDE and arch in TORCH_PREFERS_CUDNN) or os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED"):
        return False
    return CUDNN_VERSION is not None and CUDNN_VERSION >= 90900


def _math_where_torch_runs_math(problem: Problem, candidates: list[str], notes: list[str]) -> list[str]:
    """Half-precision gradients of a call torch's SDPA answers with its math kernel (no fused kernel
    of its takes the call: problem.torch_fused False) are math's float32 ones, which a fused
    kernel's half-precision backward misses by 2x and more (our Triton backward's dq 2.1x, seed 5300
    #7381, H200, even with ds rounded twice): there sdpa.math runs first, as torch's does."""
    if (problem.torch_fused or not problem.needs_grad or problem.device_type != "cuda"
            or problem.dtype not in (torch.float16, torch.bfloat16) or "sdpa.math" not in candidates
            or candidates[0] == "sdpa.math" or not REGISTRY[candidates[0]].exact
            or problem.scores > MATH_SCORES):
        # Larger calls keep the fused kernel: math's float32 weights are B x H x N^2 (17 GB a layer
        # at B2 H32 N8192), which a training step cannot spare.
        return candidates
    notes.append(f"torch's SDPA runs its math kernel on this call (none of its fused kernels takes it); its "
                 f"float32 gradients are the standard, which {candidates[0]}'s half-precision backward misses: "
                 "sdpa.math runs, as torch's does.")
    return _math_first(problem, candidates)


def _math_where_cudnn_nans(problem: Problem, candidates: list[str], notes: list[str], arch: str) -> list[str]:
    """Half-precision gradients at the key count where cuDNN's backward gives NaN (sdpa.CUDNN_NAN_KEYS,
    which sdpa.cudnn declines): torch's own choice there is cuDNN, so on its NaN rows the standard is
    math's. sdpa.math runs first (these calls have 64 keys: math holds any but the largest). The
    fused kernels miss it there: the efficient kernel's half backward is up to 2.9x cuDNN's elsewhere
    (seed 5200 #3423), and flash's bfloat16 dq on rows of scores near -200 against nearly parallel keys
    was 108x math's (1.5e-2, H200, session 45). Only where torch's choice is cuDNN (_torch_prefers_cudnn):
    elsewhere torch's own fused choice stays the standard, and the order stands."""
    if (not problem.needs_grad or problem.device_type != "cuda" or problem.kv_len != CUDNN_NAN_KEYS
            or problem.dtype not in HALF or not candidates or not REGISTRY[candidates[0]].exact
            or not _torch_prefers_cudnn(arch)):
        return candidates
    moved = _math_first(problem, candidates)  # (unchanged where math is absent or cannot hold the call)
    if moved != candidates:
        notes.append(f"cuDNN's backward gives NaN on low rows at exactly {CUDNN_NAN_KEYS} keys (torch's own choice "
                     "here): sdpa.math runs, whose gradients meet what cuDNN's finite ones would.")
    return moved


def _math_first(problem: Problem, names: list[str]) -> list[str]:
    """`names` with sdpa.math first where it is among them and can hold the call (MATH_SCORES)."""
    if "sdpa.math" not in names or problem.scores > MATH_SCORES:
        return list(names)
    return ["sdpa.math"] + [c for c in names if c != "sdpa.math"]


TORCH_FUSED_RUNNERS = ("sdpa.cudnn", "sdpa.flash", "sdpa.efficient")


def _behind_torch_fused(problem: Problem, candidates: list[str], launches: dict, takes: dict, arch: str,
                        policy: Policy, notes: list[str] | None = None) -> list[str]:
    """The candidates behind the last of torch's own fused choices for the call run only where that
    one refused these tensors at run time (torch's own checks: views, alignment) or failed, which
    torch's SDPA, given the same tensors, meets alike and answers with its math kernel (where no other
    fused kernel of its takes the call). So half-precision gradients there are math's: sdpa.math right
    behind it (for calls it can hold, as _math_where_torch_runs_math) and the others prepared as for a
    call torch answers with math (triton.ptr's math-grade backward). cuDNN refused the views of a
    bfloat16 GQA call with a bool mask; triton.ptr behind it gave dk 3.7x math's (seed 5300 #16237,
    H200). Updates `launches` in place; returns the candidates in their order."""
    if (not problem.torch_fused or not problem.needs_grad or problem.device_type != "cuda"
            or problem.dtype not in (torch.float16, torch.bfloat16)):
        return candidates
    for i, name in enumerate(candidates):
        if name not in TORCH_FUSED_RUNNERS or not takes.get(name, False):
            continue
        ahead = set(candidates[: i + 1])
        if torch_takes_fused(problem, {n: t for n, t in takes.items() if n not in ahead}, arch):
            continue
        behind = dataclasses.replace(problem, torch_fused=False)
        tail = _math_first(problem, candidates[i + 1:])
        for n in tail:
            launches[n] = REGISTRY[n].prepare(behind, policy)
        if tail and notes is not None:
            notes.append(f"behind {name} (torch's own choice here), the fallbacks give math's gradients: where "
                         f"{name} refuses these tensors or fails, torch's SDPA runs its math kernel.")
        return candidates[: i + 1] + tail
    return candidates


def make_plan(problem: Problem, policy: Policy) -> Plan:
    """Ask every registered runner; the first in order with no reasons runs, the rest of those
    with none are its fallbacks."""
    arch = hardware.arch(problem.device_type, problem.device_index)
    order = priority(problem, arch)
    if policy.backends is not None:
        # Named runners absent from the list (reference, say) go last, in the order named.
        extra = [n for b in policy.backends for n in REGISTRY
                 if n not in order and (n == b or n.startswith(b + "."))]
        order = order + tuple(dict.fromkeys(extra))
    reasons: dict[str, list[str]] = {}
    takes: dict[str, bool] = {}  # each runner's own answer, before modifiers and the policy
    for name, runner in REGISTRY.items():
        why = list(runner.supports(problem, policy))
        takes[name] = not why
        why += modifier_reasons(runner, problem)
        if not runner.exact and policy.mode != "auto":
            why.append("approximate: runs only under Policy(mode='auto').")
        elif name not in order and runner.exact and policy.admits(name):
            why.append(f"not in the priority list for {problem.device_type}/{arch}; used only when named in "
                       "Policy.backends.")
        if not policy.admits(name):
            why.append(f"excluded by Policy.backends={policy.backends}.")
        failed = _failed.get((name, problem.shape_class))
        if failed is not None:
            why.append(f"failed at run time earlier for this problem class ({failed}).")
            takes[name] = False  # torch's own kernel, given such calls, fails alike: not torch's choice
        reasons[name] = why
    approximate = [n for n, r in REGISTRY.items() if not r.exact and not reasons[n]]
    names = approximate + [n for n in order if n in REGISTRY] + [n for n in REGISTRY if n not in order]
    names = list(dict.fromkeys(names))
    candidates = [n for n in names if not reasons[n]]
    notes = []
    if policy.mode == "auto" and not approximate:
        notes.append("mode='auto': no approximate runner can take this call (their reasons are listed); it runs "
                     "exact.")
    if policy.approximations and reasons.get("triton.rank"):
        notes.append(f"approximations {policy.approximations}: triton.rank declines this call "
                     f"({' '.join(reasons['triton.rank'])}); no tile is approximated.")
    if not candidates:
        lines = [f"no runner can run {problem.describe()} under {policy}:"]
        lines += [f"  {n}: {' '.join(reasons[n])}" for n in names]
        raise NoBackendError("\n".join(lines))
    # What torch's own SDPA would run (problem.torch_fused): some runners match its accuracy.
    fused = torch_takes_fused(problem, takes, arch)
    if fused != problem.torch_fused:
        problem = dataclasses.replace(problem, torch_fused=fused)
    launches = {n: REGISTRY[n].prepare(problem, policy) for n in candidates}
    candidates, timed = _by_cost(problem, candidates, launches, reasons)
    candidates = _math_where_torch_runs_math(problem, candidates, notes)
    candidates = _math_where_cudnn_nans(problem, candidates, notes, arch)
    if not candidates:
        lines = [f"no runner can run {problem.describe()} under {policy}:"]
        lines += [f"  {n}: {' '.join(reasons[n])}" for n in names]
        raise NoBackendError("\n".join(lines))
    candidates = _behind_torch_fused(problem, candidates, launches, takes, arch, policy, notes)
    launches = _with_exact_alternative(problem, candidates, launches, timed)
    notes = REGISTRY[candidates[0]].notes(problem, launches[0]) + notes
    return Plan(
        backend=candidates[0],
        candidates=tuple(candidates),
        launches=launches,
        order=tuple(names),
        reasons=tuple((n, tuple(reasons[n])) for n in names),
        notes=tuple(notes),
        arch=arch,
        costs=tuple((n, timed.get(n)) for n in candidates),
    )


def _by_cost(problem: Problem, candidates: list[str], launches: dict, reasons: dict) -> tuple[list[str], dict]:
    """Candidates ordered by measured cost where it is known: the measured exact runners fastest
    first (the others after them, in priority order), and an approximate runner dropped (with its reason) when
    even its cheapest allowed option measures no faster than the fastest exact one. Under
    torch.compile costs are not read."""
    if torch.compiler.is_compiling():
        return candidates, {}
    timed = {n: REGISTRY[n].cost(problem, launches[n]) for n in candidates}
    exact = [n for n in candidates if REGISTRY[n].exact]
    # Measured runners first, fastest first; unmeasured ones after them in priority order
    # (sdpa.math, say, which calibration leaves out on a GPU). Without any measurement the
    # priority order stands.
    exact.sort(key=lambda n: (timed[n] is None, timed[n] or 0.0))
    approximate = []
    for n in (n for n in candidates if not REGISTRY[n].exact):
        best = exact[0] if exact else None
        kernel = _kernel_ms(best, problem, timed.get(best))  # the levels' predictions are kernel time
        if best is not None and timed[n] is not None and kernel is not None and timed[n] >= kernel:
            reasons[n].append(f"meets the policy but its cheapest option measures {timed[n]:.3g} ms against "
                              f"{best}'s {kernel:.3g} ms here.")
        else:
            approximate.append(n)
    return approximate + exact, timed


def _kernel_ms(name: str | None, problem: Problem, predicted: float | None) -> float | None:
    """An exact runner's predicted kernel time: its cost less its measured host time, as the
    approximate runners' level predictions are (they have no host entries)."""
    if name is None or predicted is None:
        return predicted
    return predicted - costs.host_ms(name, hardware.arch(problem.device_type, problem.device_index))


def _with_exact_alternative(problem: Problem, candidates: list[str], launches: dict, timed: dict) -> tuple:
    """The candidates' launch descriptions in order, each approximate one told the fastest exact
    candidate (which it runs instead where its own option measures no faster at a call site)."""
    exact = next((n for n in candidates if REGISTRY[n].exact), None)
    out = []
    for n in candidates:
        launch = launches[n]
        if exact is not None and not REGISTRY[n].exact:
            runner, exact_launch = REGISTRY[exact], launches[exact]

            def run(q, k, v, attn_mask, problem, label=None, runner=runner, exact_launch=exact_launch):
                return runner.run(q, k, v, attn_mask, problem, exact_launch, label)

            launch = REGISTRY[n].attach_exact(launch, ExactAlternative(exact, _kernel_ms(exact, problem,
                                                                                         timed.get(exact)), run))
        out.append(launch)
    return tuple(out)


def plan_key(problem: Problem, policy: Policy) -> tuple:
    """What a plan depends on: the problem's shape class and the values its launch descriptions
    bake in (scale, window sides), the policy, the settings, determinism, and whether sdpa.math may
    hold the call (the shape class's length buckets span calls on both sides of MATH_SCORES), and
    whether a call with gradients has exactly CUDNN_NAN_KEYS keys (sdpa.cudnn declines those; the
    bucket holds lengths on both sides)."""
    return (problem.shape_class, problem.scale, problem.window_left, problem.window_right, problem.device_index,
            policy, settings.current(), torch.are_deterministic_algorithms_enabled(),
            problem.needs_grad and problem.kv_len == CUDNN_NAN_KEYS,  # (sdpa.cudnn's decline, _math_where_cudnn_nans)
            problem.scores <= MATH_SCORES)  # (sdpa.math's place: _math_where_torch_runs_math, _behind_torch_fused)


def get_plan(problem: Problem, policy: Policy, compiling: bool = False) -> Plan:
    """The cached plan for this problem class and policy (computed fresh under torch.compile)."""
    if compiling:
        return make_plan(problem, policy)
    key = plan_key(problem, policy)
    plan = _cache.get(key)
    if plan is None:
        plan = make_plan(problem, policy)
        with _lock:
            _cache[key] = plan
    return plan


def recall_call(signature: tuple):
    return _calls.get(signature)


def remember_call(signature: tuple, entry: tuple) -> None:
    """Keep a call's (problem, policy, plan) under its signature (recall_call hashed it already)."""
    with _lock:
        if len(_calls) >= _CALLS_LIMIT:
            _calls.clear()
        _calls[signature] = entry


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
            f"adaattn: runner {name} failed for {problem.describe()} ({summary}); "
            "falling back to the next runner for this problem class.",
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
    if name not in plan.candidates:
        why = dict(plan.reasons).get(name, ())
        raise NoBackendError(f"runner {name} declines {problem.describe()}: {' '.join(why)}")
    runner = REGISTRY[name]
    launch = plan.launches[plan.candidates.index(name)]

    def fn(query, key, value, attn_mask=None):
        return runner.run(query, key, value, attn_mask, problem, launch)

    return fn


def runner_table() -> dict:
    """Versions, devices (hardware.detect) and which runners can take a plain probe call here."""
    hw = hardware.detect()
    out = hw.as_dict()
    table = {}
    for device_type in ("cpu", "cuda"):
        if device_type == "cuda" and not hw.devices:
            continue
        # A plain bf16/fp32 problem per device shows what each runner needs beyond the shape.
        for dtype in ((torch.float32,) if device_type == "cpu" else (torch.bfloat16, torch.float32)):
            probe = Problem(
                batch=1, q_heads=8, kv_heads=8, q_len=1024, kv_len=1024, head_dim=128, value_dim=128,
                dtype=dtype, device_type=device_type, device_index=0 if device_type == "cuda" else None,
                causal=False, window_left=-1, window_right=-1, mask_kind="none", dropout_p=0.0,
                scale=default_scale(128), needs_grad=False, tma_aligned=True,
            )
            key = f"{device_type}/{str(dtype).replace('torch.', '')}"
            table[key] = {name: r.supports(probe, Policy()) for name, r in REGISTRY.items()}
    out["backends"] = table
    return out


# ---- ring blocks
#
# The ring's block engines (backends/ring_blocks.py) are runners of kind "ring_block":
# distributed/ asks choose("ring_block", problem, policy, runner=...) for one, as api/ asks for a
# plan, and ring_block_engine(choice) for the engine it drives. What those runners need to know of
# this registry's own runners (sdpa.cudnn's limits, which Triton forward variant takes a band) is
# asked here and handed to them.


def _ring_block_order(problem, names: tuple) -> tuple:
    """kernel="auto": torch math first off CUDA or where our Triton kernels decline; on CUDA cuDNN
    first where this planner's own plan for a dense shard-sized call runs sdpa.cudnn, else Triton
    (choose passes over a runner with reasons, so cuDNN's own limits need no asking here). The plan
    is read each call (its cache, which reset() clears)."""
    if problem.device_type != "cuda" or problem.triton_reasons:
        order = ("ring.torch", "ring.triton", "ring.cudnn")
    elif _plans_cudnn(problem.shard()):
        order = ("ring.cudnn", "ring.triton", "ring.torch")
    else:
        order = ("ring.triton", "ring.cudnn", "ring.torch")
    return tuple(n for n in order if n in names)


def _plans_cudnn(shard: Problem) -> bool:
    try:
        return get_plan(shard, policy_mod.EXACT).backend == "sdpa.cudnn"
    except Exception:  # no runner takes it: the Triton blocks decide for themselves
        return False


def _sdpa_cudnn_reasons(problem: Problem) -> list[str]:
    """The sdpa.cudnn runner's reasons for `problem` (the ring's cuDNN blocks call the same op)."""
    runner = REGISTRY.get("sdpa.cudnn")
    return ["is not here."] if runner is None else list(runner.supports(problem, policy_mod.EXACT))


def _triton_variant(band: Problem) -> str:
    """The first of our Triton forward variants (warp-specialised, TMA, pointers) that takes a band."""
    for variant in ("ws", "tma", "ptr"):
        runner = REGISTRY.get(f"triton.{variant}")
        if runner is not None and not runner.supports(band, Policy()):
            return variant
    return "ptr"


def ring_block_engine(choice: Choice):
    """The block engine of the ring-block runner `choice` names, for its problem."""
    return KINDS["ring_block"][choice.runner].engine(choice.problem)


for _runner in ring_block_runners(_sdpa_cudnn_reasons, _triton_variant):
    register_kind("ring_block", _runner)
_ORDERS["ring_block"] = _ring_block_order


for _runner in (*exact_runners(), *rank_runners(), *adaptive_runners()):
    register(_runner)
