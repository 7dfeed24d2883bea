"""Measured costs: a runner's predicted milliseconds on a problem, from measurements kept as data.

Entries come from `adaattn bench --suite calibrate` (committed per GPU family in the package's
costs.json, and a user's own in their cache directory, which wins where both measured the same
point). Each entry is one timed call: runner, GPU family, the problem's class (dtype, head dims,
causal, mask kind, window, grad, decode, score modifiers) and its lengths. A prediction scales the measured
milliseconds per unit of work (B x Hq x Nq x Nk x (D + Dv), halved for square causal calls) to the
problem's work, interpolating that rate linearly in log2 of the length between the two nearest
measured lengths (the nearest one outside their range). No entry for the class: None.

Host entries ({"runner", "arch", "host_us"}, CUDA only) say what a runner's call costs the host
before its kernels start (the GPU held busy meanwhile). A one-call-at-a-time latency is host plus
kernel time, and small calls are host time: an exact runner's cost (backends/base.Runner.cost) adds
its host time where one is measured, so a kernel faster by less than its extra host cost does not
win. predict() is kernel time alone (the quantized levels have no host entries: the planner
compares them with an exact runner's kernel time).
"""

from __future__ import annotations

import json
import math
import os
import threading
from importlib import resources
from pathlib import Path

SCHEMA = "adaattn-costs/1"
PACKAGE_FILE = "costs.json"

_lock = threading.Lock()
_table: dict[tuple, list[tuple[float, float]]] | None = None
_hosts: dict[tuple[str, str], float] = {}  # (runner, arch) -> host us a call


def user_path() -> Path:
    """Where a user's own calibration lives: $ADAATTN_COSTS, else <cache dir>/adaattn/costs.json."""
    explicit = os.environ.get("ADAATTN_COSTS")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "adaattn" / "costs.json"


def problem_class(problem) -> tuple:
    """The facts of a problem a cost is measured per (its lengths and counts aside). The score
    modifiers are part of it: a kernel that caps or biases its scores is slower than its plain
    call (soft-capping ran our forward at 0.56x of it on an H200), so a plain measurement says
    nothing about a modified call."""
    return (str(problem.dtype).replace("torch.", ""), problem.head_dim, problem.value_dim, problem.causal,
            problem.mask_kind, problem.window is not None, problem.needs_grad, problem.q_len <= 16,
            ",".join(problem.modifiers))


def work(problem) -> float:
    """What a call does, in units its time scales with (multiply-adds of both products)."""
    w = problem.batch * problem.q_heads * max(problem.q_len, 1) * max(problem.kv_len, 1)
    w *= max(problem.head_dim + problem.value_dim, 1)
    if problem.causal and problem.q_len == problem.kv_len:
        w /= 2
    return float(w)


def entry(runner: str, arch: str, problem, ms: float) -> dict:
    """One measurement as the cost files keep it."""
    dtype, d, dv, causal, mask, window, grad, decode, modifiers = problem_class(problem)
    return {"runner": runner, "arch": arch, "dtype": dtype, "head_dim": d, "value_dim": dv, "causal": causal,
            "mask": mask, "window": window, "grad": grad, "decode": decode, "modifiers": modifiers,
            "n": max(problem.q_len, problem.kv_len), "ms": ms, "work": work(problem)}


def host_entry(runner: str, arch: str, host_us: float) -> dict:
    """One measurement of a runner's host time a call (microseconds), as the cost files keep it."""
    return {"runner": runner, "arch": arch, "host_us": float(host_us)}


def _is_host(e: dict) -> bool:
    return "host_us" in e


def _key(e: dict) -> tuple:
    if _is_host(e):
        return ("host", e["runner"], e["arch"])
    return (e["runner"], e["arch"], e["dtype"], e["head_dim"], e["value_dim"], e["causal"], e["mask"], e["window"],
            e["grad"], e["decode"], e.get("modifiers", ""))  # (entries before modifiers: plain calls)


def _read(text: str) -> list[dict]:
    data = json.loads(text)
    if data.get("schema") != SCHEMA:
        raise ValueError(f"a cost file must have schema {SCHEMA!r}, got {data.get('schema')!r}")
    return list(data.get("entries", ()))


def _build_hosts(*sources: list[dict]) -> dict:
    hosts: dict[tuple[str, str], float] = {}
    for entries in sources:  # later sources win
        for e in entries:
            if _is_host(e) and e.get("host_us") is not None and e["host_us"] >= 0:
                hosts[(e["runner"], e["arch"])] = float(e["host_us"])
    return hosts


def _build(*sources: list[dict]) -> dict:
    points: dict[tuple, dict[float, float]] = {}
    for entries in sources:  # later sources win at equal points
        for e in entries:
            if _is_host(e):
                continue
            if e.get("ms") and e.get("work"):
                points.setdefault(_key(e), {})[float(e["n"])] = float(e["ms"]) / float(e["work"])
    return {k: sorted(v.items()) for k, v in points.items()}


def load(force: bool = False) -> dict:
    """The table (read once): the package's committed costs, then the user's."""
    global _table
    if _table is not None and not force:
        return _table
    package: list[dict] = []
    try:
        package = _read(resources.files("adaattn").joinpath(PACKAGE_FILE).read_text())
    except FileNotFoundError:
        pass
    user: list[dict] = []
    path = user_path()
    if path.is_file():
        user = _read(path.read_text())
    global _hosts
    with _lock:
        _table = _build(package, user)
        _hosts = _build_hosts(package, user)
    return _table


def host_ms(runner: str, arch: str) -> float:
    """A runner's measured host time a call on a GPU of family `arch`, in ms (0 where unmeasured)."""
    load()
    return _hosts.get((runner, arch), 0.0) / 1e3


def predict(runner: str, arch: str, problem) -> float | None:
    """Predicted milliseconds of `runner` on `problem` on a GPU of family `arch`, or None."""
    points = load().get((runner, arch, *problem_class(problem)))
    if not points:
        return None
    n = max(problem.q_len, problem.kv_len, 1)
    x = math.log2(n)
    below = [(m, r) for m, r in points if m <= n]
    above = [(m, r) for m, r in points if m >= n]
    if not below:
        rate = above[0][1]
    elif not above:
        rate = below[-1][1]
    else:
        (n0, r0), (n1, r1) = below[-1], above[0]
        t = 0.0 if n1 == n0 else (x - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
        rate = r0 + t * (r1 - r0)
    return rate * work(problem)


def write(path: Path, entries: list[dict], merge: bool = True) -> Path:
    """Write entries as a cost file (merged over what `path` holds, new points winning)."""
    old: list[dict] = _read(path.read_text()) if merge and path.is_file() else []
    fresh = {(_key(e), e.get("n")) for e in entries}
    kept = [e for e in old if (_key(e), e.get("n")) not in fresh]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": SCHEMA, "entries": kept + entries}, indent=1) + "\n")
    return path
