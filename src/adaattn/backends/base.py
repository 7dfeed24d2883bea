"""What every runner declares: a name, what it supports (as reasons), its cost, and how it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from .. import costs, hardware

if TYPE_CHECKING:
    from ..policy import Policy
    from ..problem import Problem


class Declined(Exception):
    """A runner's kernel would refuse these very tensors (a check made before any launch, on what
    only the tensors show: strides, alignment, a mask's layout). Not a failure: the next runner
    takes the call, with no warning and nothing remembered for the problem class."""


class Runner:
    """One way to compute attention: an SDPA kernel, one of our Triton kernels, the float64
    reference, the quantized adaptive path. The planner asks every runner the same questions.

    exact: False for approximations (quantized, sparse), which run only under Policy(mode="auto").
    """

    name: str = ""
    exact: bool = True
    # Takes a call that is not plain 4-D in its own rank (the api then does not flatten it): torch's
    # CPU SDPA, whose math kernel runs such calls as they are.
    takes_call_form: bool = False
    # The score modifiers it applies (problem.Modifiers, by argument name: "softcap", "sinks",
    # "alibi_slopes"); the planner declines it for a call with any other. A runner that names one
    # takes run(..., modifiers=Modifiers) on such calls.
    modifiers: frozenset = frozenset()

    def supports(self, problem: Problem, policy: Policy) -> list[str]:
        """Reasons this runner cannot run `problem` under `policy`, each a short sentence naming
        the limit; empty means it can."""
        raise NotImplementedError

    def cost(self, problem: Problem, launch: Any = None) -> Optional[float]:
        """Predicted milliseconds from measurements for this GPU family (adaattn.costs: the
        committed ones and the user's own calibration; kernel time plus the runner's measured host
        time a call, where there is one), or None where there are none. `launch`
        (this runner's prepare(...)) narrows the prediction where it matters (an approximate
        runner's allowed levels, say)."""
        arch = hardware.arch(problem.device_type, problem.device_index)
        kernel = costs.predict(self.name, arch, problem)
        return None if kernel is None else kernel + costs.host_ms(self.name, arch)

    def attach_exact(self, launch: Any, exact: "ExactAlternative") -> Any:
        """The launch description of an approximate runner, told which exact runner the planner
        would run instead (it runs that one where its own option measures no faster). Exact
        runners return `launch` unchanged."""
        return launch

    def prepare(self, problem: Problem, policy: Policy) -> Any:
        """The frozen launch description of a planned call (kernel variant, scale, window sides,
        constexprs), built once per plan; None where the runner needs none."""
        return None

    def notes(self, problem: Problem, launch: Any) -> list[str]:
        """What explain should say about a planned call when this runner is chosen."""
        return []

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attn_mask: Optional[torch.Tensor], problem: Problem, launch: Any,
            label: Optional[str] = None) -> torch.Tensor:
        """Attention on (B, H, N, D) tensors; returns (B, Hq, Nq, Dv) in the input dtype."""
        raise NotImplementedError

    def warm(self, query, key, value, attn_mask, problem: Problem, launch: Any) -> list[str]:
        """Compile and initialise what a call of this problem class runs (adaattn.warmup), leaving
        no state a later call reads besides caches of compiled kernels and plans. Returns what
        it warmed, e.g. the runner's name."""
        self.run(query, key, value, attn_mask, problem, launch)
        return [self.name]

    def run_recorded(self, query, key, value, attn_mask, problem, launch, label=None,
                     **modifiers) -> tuple[torch.Tensor, dict]:
        """(out, decisions): `run` and what it decided, for adaattn.stats."""
        out = self.run(query, key, value, attn_mask, problem, launch, label, **modifiers)
        return out, {"precision": "native", "approximation": "none"}

    def __repr__(self) -> str:
        return f"<runner {self.name}>"


@dataclass(frozen=True)
class ExactAlternative:
    """The fastest exact runner the planner found for a problem: its name, its predicted
    milliseconds (None without cost data), and run(query, key, value, attn_mask) -> out."""

    name: str
    predicted_ms: Optional[float]
    run: Callable[..., torch.Tensor] = field(compare=False, repr=False)


# The earlier name of the interface.
Backend = Runner


def modifier_reasons(runner: Runner, problem: Problem) -> list[str]:
    """Why `runner` cannot apply the call's score modifiers (empty where it applies them all)."""
    missing = [m for m in problem.modifiers if m not in runner.modifiers]
    if not missing:
        return []
    return [f"applies no {' or '.join(missing)} (score modifiers: its kernel has no such term; the mods.torch "
            "runner applies them exactly)."]


class NoKeys(torch.autograd.Function):
    """Attention over no keys: every row is zero, SDPA's math answer, and so is every gradient.
    torch's own kernels are not asked (attention() answers such calls before any runner, and the SDPA
    runners for direct calls): on the CPU they gave NaN for float16 queries of magnitude
    100 and more (torch 2.13, with or without GQA; a CPU fuzzer, seed 5501 #7292). Called through
    no_keys, which passes each tensor once (torch.compile refuses a Function given one twice)."""

    @staticmethod
    def forward(ctx, query, value_dim, *others):
        # others: the inputs the result does not depend on (key, value, mask, score modifiers)
        ctx.like = [(t.shape, t.dtype, t.device) for t in (query, *others)]
        return query.new_zeros(*query.shape[:-1], value_dim)  # (torch's shape for no keys: the query's)

    @staticmethod
    def backward(ctx, grad):
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like]
        return (zeros[0], None, *zeros[1:])


def no_keys(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *others) -> torch.Tensor:
    """Zeros in the query's shape with the value's head dim, and zero gradients for the query, key,
    value and every tensor among `others` (a mask, score modifiers; None and non-tensors skipped)."""
    seen, rest = {id(query)}, []
    for t in (key, value, *others):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            rest.append(t)
    return NoKeys.apply(query, value.shape[-1], *rest)
