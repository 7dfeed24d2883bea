"""Policies in the ring: each rank's blocks at per-head quantized levels under a measured tolerance.

Under `Policy(mode="auto", precisions=(..., "int8" and/or "fp8"))`, ring_attention runs each
block (this rank's queries against one visiting K/V shard) through the general quantized kernel
(kernels/attention_quant.py), which also writes the block's log-sum-exp, so quantized blocks
merge as exactly as exact ones. Each query head has one level (exact, qk8 or fp8) at a call site,
the same on every rank.

Verified calls (the first two of a site, then one in round(1 / Policy.verify)) run every block
both ways in the same pass over the shards: the exact blocks' merged output is the reference
for every local row (not a sample), and the time of each engine's blocks and merges is
measured with CUDA events, each engine first on alternate verified calls. The squared errors,
reference norms and times are summed over the ranks (one all-reduce), so every rank takes the
same decisions:
- a head whose relative error, ||o - o_exact|| / ||o_exact|| over all ranks' rows, exceeds the
  tolerance takes the exact blocks' output on this call and moves one allowed level up (toward
  exact) from the next;
- a site whose quantized blocks measured slower than PAYS x the exact blocks runs exact
  blocks until the next verified call measures again. A timing counts only when the call's
  levels ran on the previous verified call too, and neither engine took OUTLIER x the other
  (kernels compile on a level set's first call); otherwise, and whenever a head moved, the next
  call is verified again.
Heads never move down a level: a site starts every head at the cheapest allowed level.

The backward is exact: by default inputs that require grad run exact blocks (as
adaattn.attention does); with Policy(train_quantized=True) the forward runs quantized and the
backward recomputes the exact forward (its output and log-sum-exp) over the ring before the
exact backward blocks.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional

import torch

from ..adaptive import controller
from ..adaptive.runner import levels_for
from ..adaptive import quant_launch as tq
from ..backends.ring_blocks import NOT_RECOVERABLE  # errors a fallback cannot help

PAYS = 0.95  # quantized blocks run only while they measure under this fraction of the exact ones
OUTLIER = 4.0  # a verified call where one engine took this many times the other compiled something
UNJUDGED_MAX = 3
_SITES: dict = {}
_MAX_SITES = 1024


def quant_levels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy, kernel: str) -> tuple[tuple[int, ...], list[str]]:
    """(levels beyond exact this call's blocks may run at, reasons none may): the quantized
    runner's (adaptive.runner.levels_for), and what the ring's blocks add."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    levels, reasons = levels_for(q.device.type, q.device.index, needs_grad, policy)
    if kernel == "torch":
        reasons.append("kernel='torch' runs every block in torch math.")
    reasons += tq.quant_can_run(q.device, q.dtype, q.shape[-1], v.shape[-1])
    return (levels if not reasons else ()), reasons


def site_for(key: tuple, policy, levels: tuple[int, ...], q: torch.Tensor) -> "RingSite":
    site = _SITES.get(key)
    if site is None:
        if len(_SITES) >= _MAX_SITES:
            _SITES.clear()
        site = _SITES[key] = RingSite(policy.tolerance, policy.verify, levels, q.shape[1],
                                      tq.fp8_level_uses_fp8_qk(q, None, True, -1, -1))
    return site


def reset() -> None:
    """Forget every ring call site's levels and measurements."""
    _SITES.clear()


class RingSite:
    """One call site's per-head levels, verification schedule and measurements."""

    def __init__(self, tolerance: float, verify: float, allowed: tuple[int, ...], q_heads: int, fp8_qk: bool):
        self.tolerance, self.verify, self.allowed, self.fp8_qk = tolerance, verify, allowed, fp8_qk
        self.levels = [max(allowed)] * q_heads  # the cheapest allowed level
        self.calls = 0
        self.verified = 0
        self._next_verify = 1
        self.runs_exact = False
        self.failed = False
        self.errors: Optional[list[float]] = None
        self.measured: Optional[tuple[float, float]] = None  # (quantized, exact) ms, summed over ranks
        self.why: Optional[str] = None
        self._levels_dev: dict = {}
        self._timed_levels: Optional[tuple] = None  # the levels of the previous timed verified call
        self._unjudged = 0

    def begin(self, device: torch.device) -> str:
        """This call's kind: "verify" (both engines), "quant" or "exact". It must be the same on
        every rank (a verified call all-reduces; a quantized one recomputes the exact forward
        over the ring in the backward), so it depends only on what every rank shares: the call
        count and the decisions taken from sums over the ranks. A rank whose kernel failed
        (`failed`) keeps the kind and runs exact blocks under it (QuantBlocks)."""
        self.calls += 1
        if all(lv == tq.LEVEL_EXACT for lv in self.levels):  # nothing left to verify
            return "exact"
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self.calls >= self._next_verify and not capturing:
            self.verified += 1
            self._next_verify = self.calls + (max(1, round(1.0 / self.verify)) if self.verify > 0 else 1 << 62)
            return "verify"
        return "exact" if self.runs_exact else "quant"

    def present(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.levels)))

    def head_levels(self, device: torch.device) -> Optional[torch.Tensor]:
        """int32 (Hq,) of each head's level on `device`, or None when every head has one level."""
        if len(self.present()) == 1:
            return None
        key = (device, tuple(self.levels))
        got = self._levels_dev.get(key)
        if got is None:
            self._levels_dev = {key: torch.tensor(self.levels, dtype=torch.int32).to(device)}
            got = self._levels_dev[key]
        return got

    def settle(self, err_sq: list[float], ref_sq: list[float], quant_ms: Optional[float],
               exact_ms: Optional[float]) -> list[int]:
        """A verified call's sums over every rank: moves the heads over the tolerance up a level
        and returns them (their output this call is the exact one); judges speed.

        A timing is judged only when this call's levels ran on the previous verified call too
        (else their kernels may have compiled on this one) and neither engine measured OUTLIER
        times the other; otherwise, or when a head moved, the next call is verified again (at
        most UNJUDGED_MAX times in a row before a timing is judged as it is)."""
        used = tuple(self.levels)
        self.errors = [math.sqrt(e / r) if r > 0 else (0.0 if e == 0 else math.inf) for e, r in zip(err_sq, ref_sq)]
        bad = [h for h, e in enumerate(self.errors) if not e <= self.tolerance and self.levels[h] != tq.LEVEL_EXACT]
        for h in bad:
            self.levels[h] = controller._up(self.levels[h], self.allowed)
        judged = False
        if quant_ms is not None and exact_ms is not None:
            self.measured = (quant_ms, exact_ms)
            outlier = quant_ms > OUTLIER * exact_ms or exact_ms > OUTLIER * quant_ms
            if (used == self._timed_levels and not outlier) or self._unjudged >= UNJUDGED_MAX:
                judged, self._unjudged = True, 0
                self.runs_exact = quant_ms > PAYS * exact_ms
                self.why = (f"quantized blocks measured {quant_ms:.3g} ms against the exact blocks' {exact_ms:.3g} ms "
                            f"(summed over ranks) on a verified call: " +
                            ("exact blocks run until the next verified call" if self.runs_exact else "they pay"))
            else:
                self._unjudged += 1
            self._timed_levels = used
        if all(lv == tq.LEVEL_EXACT for lv in self.levels):
            self.why = "every head measured over the tolerance at every allowed level: exact blocks run"
        elif bad or (quant_ms is not None and not judged):
            self._next_verify = self.calls + 1
        return bad

    def fail(self, error: BaseException) -> None:
        if isinstance(error, NOT_RECOVERABLE):
            raise error
        if not self.failed:
            self.failed = True
            self.why = f"the quantized block kernel failed ({type(error).__name__}); exact blocks run"
            warnings.warn(f"adaattn.distributed: the quantized block kernel failed ({type(error).__name__}: "
                          f"{str(error).strip()[:200]}); this call site runs exact blocks from now on",
                          RuntimeWarning, stacklevel=5)

    def describe(self) -> dict:
        return {"head_levels": [tq.LEVELS[x] for x in self.levels], "calls": self.calls, "verified": self.verified,
                "runs_exact": self.runs_exact, "head_errors": self.errors, "measured_ms": self.measured,
                "why": self.why}


class QuantBlocks:
    """A block through the general quantized kernel at the site's per-head levels, with its
    log-sum-exp; merges (and a kernel failure) go to the exact engine `exact`."""

    name = "triton.quant"

    def __init__(self, site: RingSite, exact):
        self.site, self.exact = site, exact
        self.cdt = torch.float32

    def forward(self, q, k, v, scale, left, right):
        if not self.site.failed:
            try:
                lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
                out = tq.quant_attention(q, k, v, levels=self.site.present(),
                                         head_levels=self.site.head_levels(q.device), scale=scale,
                                         causal=right == 0, window_left=left, window_right=-1 if right == 0 else right,
                                         fp8_qk=self.site.fp8_qk, allow_ws=False, lse=lse)
                return out, lse
            except Exception as e:  # a kernel failure: exact blocks, once, loudly
                self.site.fail(e)
        return self.exact.forward(q, k, v, scale, left, right)

    def merge(self, out, lse, block_out, block_lse) -> None:
        self.exact.merge(out, lse, block_out, block_lse)


class EventTimer:
    """Accumulated GPU time of some engines' work, from CUDA event pairs read at the end."""

    def __init__(self, names: tuple[str, ...], device: torch.device):
        self.on = device.type == "cuda"
        self.marks: dict = {n: [] for n in names}

    @contextlib.contextmanager
    def span(self, name: str):
        """Time the block under `name` (nothing off CUDA)."""
        if not self.on:
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.marks[name].append((start, end))

    def totals(self) -> dict:
        if not self.on:
            return {n: None for n in self.marks}
        out = {}
        for name, marks in self.marks.items():
            if marks:
                marks[-1][1].synchronize()
            out[name] = sum(a.elapsed_time(b) for a, b in marks)
        return out
