"""The chooser for decode steps and ring blocks: runners of a kind (kv/runners.py,
backends/ring_blocks.py) each have a `name`, `supports(problem, policy) -> reasons` (empty = yes)
and `why(problem)`, the sentence said when it is chosen. The first in `_ORDERS[kind](problem,
names)` (registration order where none is set) with no reasons runs; `Choice` lists every one with
its reasons, for explain."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..policy import Policy


class NoBackendError(ValueError):
    """No runner can run the problem under the policy; the message lists each one's reasons."""



KINDS: dict[str, dict[str, Any]] = {"decode": {}, "ring_block": {}}
# Per kind, an order other than registration order (a function of the problem), where one is set.
_ORDERS: dict[str, Any] = {}


@dataclass(frozen=True)
class Choice:
    """The runner chosen for a decode step or a ring block, why, and every runner's reasons."""

    kind: str
    runner: str
    why: str
    reasons: tuple[tuple[str, tuple[str, ...]], ...]
    problem: Any = None

    def __str__(self) -> str:
        lines = [f"{self.kind}: {self.problem.describe() if hasattr(self.problem, 'describe') else self.problem}",
                 f"runs: {self.runner} ({self.why})"]
        for name, why in self.reasons:
            mark = "*" if name == self.runner else ("ok" if not why else "no")
            lines.append(f"  {mark:>2} {name:<18} {' '.join(why) if why else 'can run'}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "runner": self.runner, "why": self.why,
                "reasons": {n: list(w) for n, w in self.reasons}}


class RunnerDeclines(ValueError):
    """A runner named to `choose` cannot take the call: `runner` and its `reasons`."""

    def __init__(self, runner: str, reasons: tuple[str, ...]):
        super().__init__(f"runner={runner!r} cannot take this call: {' '.join(reasons)}")
        self.runner, self.reasons = runner, reasons


def register_kind(kind: str, runner: Any) -> Any:
    """Add a decode or ring-block runner (see KINDS)."""
    KINDS[kind][runner.name] = runner
    return runner


def choose(kind: str, problem: Any, policy: Policy | None = None, runner: str | None = None) -> Choice:
    """The runner of `kind` for `problem`: `runner` where named (RunnerDeclines, a ValueError with
    its reasons, where it declines), else the first in order with no reasons (NoBackendError where
    none can run)."""
    runners = KINDS[kind]
    if runner is not None and runner not in runners:
        raise ValueError(f"runner must be one of {tuple(runners)} or None, got {runner!r}")
    names = list(_ORDERS[kind](problem, tuple(runners))) if kind in _ORDERS else list(runners)
    names += [n for n in runners if n not in names]
    reasons = {n: tuple(runners[n].supports(problem, policy)) for n in names}
    table = tuple((n, reasons[n]) for n in names)
    if runner is not None:
        if reasons[runner]:
            raise RunnerDeclines(runner, reasons[runner])
        return Choice(kind, runner, "asked for", table, problem)
    for n in names:
        if not reasons[n]:
            return Choice(kind, n, runners[n].why(problem), table, problem)
    lines = [f"no {kind} runner can run {problem}:"] + [f"  {n}: {' '.join(w)}" for n, w in table]
    raise NoBackendError("\n".join(lines))
