"""Whether a call site's quantized levels are worth running: predicted and measured times of its
option against the fastest exact runner's.

The quantized runners are calibrated per level (`adaattn bench --suite calibrate` times each
runner with every head at one level, entries named "<runner>:<level>", e.g.
"triton.quant.ws:fp8"). A site whose heads sit at several levels launches the general kernel
once per level present, each launch skipping the heads of the other levels, so its predicted
time is the head-weighted sum of the general kernel's per-level times.

A site's option runs only where it is predicted (after correction by the site's own
measurements) at most KEEP times the exact runner's time; otherwise the site runs the exact
runner, and says why with the figures.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from .. import costs
from . import quant_launch as tq

# A quantized option runs only where it costs at most this fraction of the exact runner's time:
# the margin covers verification (a fraction Policy.verify of calls check sampled rows) and
# the prediction's own error. On an H100 held at full load, peers' medians move by several
# percent with clocks and temperature (benchmarks/NOTES.md, seventh session): an option within
# 8% of exact is not reliably faster.
KEEP = 0.92
GENERAL = "triton.quant.general"


def level_entry(runner: str, level: int) -> str:
    """The name of a quantized runner's cost entries at one level."""
    return f"{runner}:{tq.LEVELS[level]}"


def option_name(levels: list[int]) -> str:
    """'fp8:16' or 'exact:2 qk8:14': the levels a site runs, with head counts."""
    counts = Counter(levels)
    return " ".join(f"{tq.LEVELS[lv]}:{counts[lv]}" for lv in sorted(counts, reverse=True))


def predict_levels(runner: str, arch: str, problem, levels: list[int]) -> Optional[float]:
    """Predicted milliseconds of `runner` with each head at its level, or None without data."""
    counts = Counter(levels)
    if len(counts) == 1:
        return costs.predict(level_entry(runner, next(iter(counts))), arch, problem)
    total = 0.0
    for level, n in counts.items():
        t = costs.predict(level_entry(GENERAL, level), arch, problem)
        if t is None:
            return None
        total += t * n / len(levels)
    return total


def cheapest(runner: str, arch: str, problem, allowed: tuple[int, ...]) -> Optional[float]:
    """The predicted time of the cheapest level among `allowed` (every head at it), or None."""
    times = [t for t in (costs.predict(level_entry(runner, lv), arch, problem) for lv in allowed) if t is not None]
    return min(times) if times else None


@dataclass(frozen=True)
class Choice:
    """What a site runs for one problem size, and why (figures in milliseconds)."""

    quantized: bool
    option: str  # the site's levels, e.g. "qk8:16"
    exact_runner: Optional[str]
    predicted_ms: Optional[float]  # the quantized option, corrected by the site's measurements
    exact_ms: Optional[float]  # the exact runner, predicted or measured at the site
    measured_ms: Optional[float]  # the quantized option measured at this site, if it was
    reason: str

    def as_dict(self) -> dict:
        ran = self.option if self.quantized else f"exact ({self.exact_runner})"
        rejected = (f"exact ({self.exact_runner})" if self.quantized else self.option) if self.exact_runner else None
        return {"option": ran, "rejected": rejected, "predicted_ms": self.predicted_ms, "exact_ms": self.exact_ms,
                "measured_ms": self.measured_ms, "why": self.reason}


def decide(levels: list[int], predicted: Optional[float], measured: Optional[float], exact_name: Optional[str],
           exact_ms: Optional[float], ratio: Optional[float] = None) -> Choice:
    """Quantized or exact for a site at `levels`: the quantized option's time (measured at the
    site where it was, else predicted) against the exact runner's; without figures for this size,
    the ratio of the two the site measured at another size (`ratio`), if any."""
    option = option_name(levels)
    if exact_name is None:
        return Choice(True, option, None, predicted, None, measured, "no exact runner to compare with")
    if all(lv == tq.LEVEL_EXACT for lv in levels):
        return Choice(False, option, exact_name, predicted, exact_ms, measured,
                      f"every head needs exact at this tolerance: {exact_name} runs them")
    mine = measured if measured is not None else predicted
    if mine is None or exact_ms is None:
        if ratio is not None:
            keep = ratio <= KEEP
            return Choice(keep, option, exact_name, predicted, exact_ms, measured,
                          f"{option} measured {ratio:.3g}x {exact_name}'s time at this site's first size (it must "
                          f"be at most {KEEP:g}x): {option if keep else exact_name} runs")
        return Choice(True, option, exact_name, predicted, exact_ms, measured,
                      "no cost data or site measurement to compare with: the quantized option runs")
    how = "measures" if measured is not None else "is predicted at"
    if mine <= KEEP * exact_ms:
        return Choice(True, option, exact_name, predicted, exact_ms, measured,
                      f"{option} {how} {mine:.3g} ms against {exact_name}'s {exact_ms:.3g} ms here")
    return Choice(False, option, exact_name, predicted, exact_ms, measured,
                  f"{option} meets the tolerance but {how} {mine:.3g} ms against {exact_name}'s {exact_ms:.3g} ms "
                  f"here (it must be at most {KEEP:g}x): {exact_name} runs")
