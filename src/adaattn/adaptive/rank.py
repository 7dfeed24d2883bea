"""The adaptive-rank runner: each (query block, key block) tile exact, summarised or skipped,
per head, under a measured tolerance (blocks.py plans, kernels/attention_rank.py computes).

One call at a site:
1. key-block summaries (mean key and value) and the estimated block masses from sampled
   query rows against them (blocks.estimate), all on the device;
2. a plan from each head's threshold: the mass left to summaries or skips (blocks.make_plan);
3. the tile-plan kernel.
On a verified call (the site's first, then a fraction `verify` of calls) the plan's density is
read back: where it is above BREAK_EVEN the tiles saved do not pay for the analysis, and the
site runs the fastest exact runner until its next verified call. Otherwise sampled rows are
computed exactly and each head's error is measured; a head over VERIFY_MARGIN of the tolerance is
recomputed exact for this call, and every head's threshold moves toward the error it should
give (TARGET of the tolerance). Unverified calls make no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from ..backends.base import ExactAlternative, Runner
from ..backends.reference import relative_from_squares
from ..backends.triton.common import interpreting
from . import analysis, blocks, sites
from .rank_launch import rank_forward

MIN_KEYS = 8192  # below this many keys the analysis does not pay for the tiles it saves
BREAK_EVEN = 0.7  # a plan computing more than this share of the exact tiles runs exact instead
TARGET = 0.75  # thresholds aim at this fraction of the tolerance
VERIFY_MARGIN = 1.0  # a head whose sampled rows measure over tolerance * this is recomputed exact
THETA0 = 0.5  # a site's first thresholds: this fraction of the tolerance
SLOWER = 0.97  # a site whose analysis + kernel measure over this share of the exact time runs exact
EXACT_RETIME = 8  # the exact runner is timed again every this many verified calls
# Sampled rows per verified call: one in ROWS_PER_SAMPLE of the rows, at least SAMPLE_ROWS and
# at most MAX_SAMPLE_ROWS. Errors of trained heads sit in few rows (at 128k, layer 7 of the 32k
# GPT: 0.1% of rows hold 57-65% of the squared error; benchmarks/NOTES.md), so a fixed count sees
# fewer of them as sequences grow: 512 rows at 128k left a head at 1.7x the tolerance (0.0169 at
# 1e-2); 4096 kept every head within it, for 2% more tiles.
SAMPLE_ROWS = 512
ROWS_PER_SAMPLE = 32
MAX_SAMPLE_ROWS = 4096
POOL_DECAY = 0.5  # weight of a verified call's sampled errors at the next one (see _check)
THETA_MIN, THETA_MAX = 1e-5, 0.5


def stratified_rows(n: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` query rows, one drawn in each of `count` equal strata of [0, n) (all rows when
    n <= count): rows early and late in the sequence, where the plans differ most, are always
    both represented."""
    if n <= count:
        return torch.arange(n)
    edges = torch.linspace(0, n, count + 1).long()
    width = (edges[1:] - edges[:-1]).clamp(min=1)
    return (edges[:-1] + (torch.rand(count, generator=generator) * width).long().clamp(max=width - 1)).clamp(max=n - 1)


def verification_rows(n: int) -> int:
    """Query rows a verified call samples at sequence length n (all of them when n is smaller)."""
    return min(MAX_SAMPLE_ROWS, max(SAMPLE_ROWS, n // ROWS_PER_SAMPLE))


@dataclass(frozen=True)
class RankLaunch:
    tolerance: float
    verify: float
    summaries: bool  # "lowrank" allowed: blocks not exact are summarised; else skipped
    policy_key: str
    exact: Optional[ExactAlternative] = field(default=None, compare=False)


class RankController:
    """Per-site state: each head's threshold (a device tensor), the last measured density and
    errors, and whether the site currently runs exact."""

    def __init__(self, site: str, tolerance: float, verify: float, q_heads: int, device: torch.device):
        self.site = site
        self.tolerance = tolerance
        self.verify = verify
        self.theta = torch.full((q_heads,), THETA0 * tolerance, dtype=torch.float32, device=device)
        self.calls = 0
        self.verified = 0
        self.runs_exact = False
        self.density: Optional[list[float]] = None
        self.errors: Optional[list[float]] = None
        self._next_verify = 1  # the first call is verified
        self.exact_ms: Optional[float] = None  # the exact runner's time, measured on verified calls
        self.rank_ms: Optional[float] = None  # analysis + kernel, measured on verified calls
        self.slower: Optional[tuple] = None
        self._pool: Optional[tuple] = None  # per head: pooled squared error and reference norms

    def _verify_now(self) -> bool:
        """The first call, then one call in round(1 / verify) (none more with verify = 0)."""
        if self.calls < self._next_verify:
            return False
        self._next_verify = self.calls + (max(1, round(1.0 / self.verify)) if self.verify > 0 else 1 << 62)
        return True

    def run(self, q, k, v, scale: float, causal: bool, summaries: bool, exact: Optional[ExactAlternative],
            problem, label=None) -> tuple[torch.Tensor, dict]:
        self.calls += 1
        verify = self._verify_now() and not (q.is_cuda and torch.cuda.is_current_stream_capturing())
        if self.runs_exact and not verify and exact is not None:
            return exact.run(q, k, v, None, problem, label), self._info_exact(exact, "an earlier verified call")
        n = q.shape[2]
        timed = verify and q.is_cuda
        if timed:  # analysis and kernel timed apart: the read-back between them idles the GPU
            start, planned, launch, end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            start.record()
        s = blocks.summarize(k, v)
        est = blocks.estimate(q, k, s, scale, causal, per_block=blocks.rows_per_block(n), spread=True)
        plan = blocks.make_plan(est, self.theta, n, causal, summaries=summaries)
        if timed:
            planned.record()
        if verify:
            self.verified += 1
            self.density = plan.density.tolist()
            self.runs_exact = exact is not None and sum(self.density) / len(self.density) > BREAK_EVEN
            if self.runs_exact:
                return exact.run(q, k, v, None, problem, label), self._info_exact(exact, "this call")
        if timed:
            launch.record()
        out = rank_forward(q, k, v, plan, s if summaries else None, scale)
        info = {"density": plan.density, "summarised": plan.summarised, "entropy_bits": est.entropy,
                "thresholds": self.theta.clone(), "verified": verify}
        if timed:
            end.record()
        redo = None
        if timed and exact is not None and (self.exact_ms is None or self.verified == 2
                                          or self.verified % EXACT_RETIME == 0):
            # The exact runner, timed on this call (its output serves the redo of heads over tolerance).
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            redo = exact.run(q, k, v, None, problem, label)
            e1.record()
            e1.synchronize()
            self.exact_ms = e0.elapsed_time(e1)
        if verify:
            info.update(self._check(q, k, v, out, scale, causal, exact, problem, label, redo))
        if timed:
            end.synchronize()
            self.rank_ms = start.elapsed_time(planned) + launch.elapsed_time(end)
            info["measured_ms"], info["exact_ms"] = self.rank_ms, self.exact_ms
            if self.exact_ms is not None and self.rank_ms > SLOWER * self.exact_ms:
                # Analysis and kernel together measure no faster than exact here: exact runs
                # until the next verified call measures again. The site's first timing may include
                # compiling the kernels for this shape, so then the next call measures again.
                self.runs_exact = True
                self.slower = (self.rank_ms, self.exact_ms)
                if self.verified == 1:
                    self._next_verify = self.calls + 1
            else:
                self.slower = None
        return out, info

    def _check(self, q, k, v, out, scale, causal, exact, problem, label, redo=None) -> dict:
        """Sampled exact rows: per-head errors, redo of heads over the tolerance, new thresholds."""
        n = q.shape[2]
        g = torch.Generator(device="cpu").manual_seed(self.verified)
        rows = stratified_rows(n, verification_rows(n), g).to(q.device)
        ref, _ = analysis.exact_rows(q, k, v, rows, None, scale, causal, need_p=False)
        d2 = (out.index_select(2, rows).float() - ref).pow(2).sum((0, 2, 3))
        r2 = ref.pow(2).sum((0, 2, 3))
        errors = relative_from_squares(d2, r2)
        self.errors = errors.tolist()
        # Thresholds follow the errors pooled over verified calls (other rows each time; the
        # error of trained heads sits in few rows), the earlier calls' scaled to the threshold
        # now (error taken as proportional to it) and weighted POOL_DECAY per call.
        if self._pool is not None:
            d2 = d2 + POOL_DECAY * self._pool[0]
            r2 = r2 + POOL_DECAY * self._pool[1]
        pooled = relative_from_squares(d2, r2)
        bad = [h for h, e in enumerate(self.errors) if not e <= VERIFY_MARGIN * self.tolerance]
        if bad:
            if redo is None and exact is not None:
                redo = exact.run(q, k, v, None, problem, label)
            elif redo is None:
                redo = rank_forward(q, k, v, blocks.dense_plan(q.shape[0], q.shape[1], n, causal, q.device), None,
                                    scale)
            heads = torch.tensor(bad, device=q.device)
            out.index_copy_(1, heads, redo.index_select(1, heads))
        err = pooled.to(self.theta.device).clamp_min(1e-12)
        theta = (self.theta * (TARGET * self.tolerance / err).clamp(0.25, 2.0)).clamp(THETA_MIN, THETA_MAX)
        moved = (theta / self.theta).to(d2.device)
        self._pool = (d2 * moved * moved, r2)
        self.theta = theta
        return {"head_errors": list(self.errors), "pooled_errors": pooled.tolist(), "heads_redone_exact": bad,
                "errors_measured_on": f"{rows.numel()} sampled rows per head"}

    def _info_exact(self, exact: ExactAlternative, when: str) -> dict:
        mean = sum(self.density) / len(self.density) if self.density else float("nan")
        # density: what ran (every tile exact); plan_density: what the rank plan would have computed.
        info = {"ran": exact.name, "option": f"exact ({exact.name})", "rejected": "triton.rank",
                "density": [1.0] * len(self.density or []), "plan_density": list(self.density or []),
                "measured_ms": self.rank_ms, "exact_ms": self.exact_ms}
        if self.slower is not None and mean <= BREAK_EVEN:
            info["why"] = (f"triton.rank's analysis and kernel measured {self.slower[0]:.3g} ms on {when} against "
                           f"{exact.name}'s {self.slower[1]:.3g} ms (plan density {mean:.2f})")
        else:
            info["why"] = (f"the plan measured on {when} computes {mean:.2f} of the exact tiles, above the "
                           f"break-even {BREAK_EVEN}: the fastest exact runner is faster")
        return info

    def describe(self) -> dict:
        return {"site": self.site, "calls": self.calls, "verified": self.verified, "runs_exact": self.runs_exact,
                "thresholds": self.theta.tolist(), "density": self.density, "errors": self.errors}


class RankRunner(Runner):
    """Adaptive rank (exact / summarised / skipped tiles per head) for causal or bidirectional
    self-attention at long context, forward."""

    name = "triton.rank"
    exact = False

    def supports(self, problem, policy) -> list[str]:
        if not policy.approximations:  # (then no length is read: no guards under torch.compile(dynamic=True))
            return ["Policy.approximations allows neither 'lowrank' nor 'skip'."]
        reasons = []
        if problem.device_type == "cuda":
            from ..hardware import triton_version

            if triton_version() is None:
                reasons.append("needs triton.")
        elif not (problem.device_type == "cpu" and interpreting()):
            reasons.append(f"runs on CUDA GPUs (or the Triton interpreter), not {problem.device_type}.")
        if problem.dtype not in (torch.bfloat16, torch.float16):
            reasons.append(f"takes bfloat16 or float16, not {problem.dtype}.")
        if problem.head_dim > 128 or problem.value_dim > 128:
            reasons.append("head dims up to 128.")
        if problem.varlen:
            reasons.append("takes dense (B, H, N, D) tensors, not packed sequences.")
        if problem.q_len != problem.kv_len:
            reasons.append("self-attention only (query length == key length).")
        if problem.bottom_right:
            reasons.append("aligns causal masks top-left only.")
        if problem.mask_kind != "none":
            reasons.append("takes no attn_mask.")
        if problem.window_left >= 0 or problem.window_right >= 0:
            reasons.append("has no sliding window.")
        if problem.dropout_p:
            reasons.append("has no dropout.")
        if not problem.scale > 0:
            reasons.append("needs a positive scale.")
        if problem.needs_grad:
            reasons.append("forward only: inputs that require grad run exact.")
        if problem.kv_len < MIN_KEYS:
            reasons.append(f"{problem.kv_len} keys: under {MIN_KEYS} the block analysis does not pay for the tiles "
                           "it saves.")
        return reasons

    def prepare(self, problem, policy) -> RankLaunch:
        key = f"rank tolerance={policy.tolerance} approximations={policy.approximations} verify={policy.verify}"
        return RankLaunch(policy.tolerance, policy.verify, "lowrank" in policy.approximations, key)

    def cost(self, problem, launch=None) -> Optional[float]:
        return None  # decided per call site from the measured density (BREAK_EVEN)

    def attach_exact(self, launch: RankLaunch, exact: ExactAlternative) -> RankLaunch:
        return replace(launch, exact=exact)

    def notes(self, problem, launch: RankLaunch) -> list[str]:
        rest = "summarised (mean key with a log-count bias, mean value)" if launch.summaries else "skipped"
        return [f"mode='auto': per head and query block, key blocks run exact in descending estimated error of "
                f"leaving them out, until what is left is under the head's threshold; the rest are {rest}. Sampled "
                f"rows check each head's error against tolerance {launch.tolerance:g} (first call, then a fraction "
                f"{launch.verify:g}); a head over {VERIFY_MARGIN} of it is recomputed exact. A site whose plan computes "
                f"more than {BREAK_EVEN} of the tiles, or whose analysis and kernel measure over {SLOWER} of the "
                f"exact runner's time, runs the exact runner until its next verified call. Tiles run at the input "
                f"precision."]

    def _controller(self, problem, launch: RankLaunch, label, device) -> RankController:
        who = label if label is not None else f"anonymous {problem.shape_class}"
        site = (f"{who}|{launch.policy_key}|Hq={problem.q_heads} Hkv={problem.kv_heads} D={problem.head_dim} "
                f"{problem.dtype} causal={problem.causal} {problem.seq_bucket} dev={device}")
        return sites.get(site, lambda: RankController(site, launch.tolerance, launch.verify, problem.q_heads, device))

    def run_recorded(self, query, key, value, attn_mask, problem, launch: RankLaunch, label=None):
        ctl = self._controller(problem, launch, label, query.device)
        out, info = ctl.run(query, key, value, problem.scale, problem.causal, launch.summaries, launch.exact,
                            problem, label)
        decisions = {"precision": "native", "approximation": "rank", "tolerance": launch.tolerance, **info}
        return out, decisions

    def run(self, query, key, value, attn_mask, problem, launch: RankLaunch, label=None):
        return self.run_recorded(query, key, value, attn_mask, problem, launch, label)[0]

    def warm(self, query, key, value, attn_mask, problem, launch: RankLaunch) -> list[str]:
        ctl = RankController("adaattn.warmup|rank", launch.tolerance, 1.0, problem.q_heads, query.device)
        ctl.run(query, key, value, problem.scale, problem.causal, launch.summaries, None, problem)
        return [self.name]


def rank_runners() -> list[Runner]:
    return [RankRunner()]


__all__ = ["RankRunner", "RankController", "rank_runners", "stratified_rows", "MIN_KEYS", "BREAK_EVEN"]
