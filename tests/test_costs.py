"""Measured costs (adaattn.costs): interpolation, the planner's use of them, and the calibrate suite."""

from __future__ import annotations

import json

import pytest
import torch

import adaattn
from adaattn import costs, planner
from adaattn.problem import validate

from helpers import DEVICE, NEEDS_CUDA_OR_INTERPRETER


def _problem(n, d=64, dtype=torch.float16, causal=False, q_len=None, policy_grad=False):
    q = torch.empty(1, 2, n if q_len is None else q_len, d, dtype=dtype, device=DEVICE)
    k = torch.empty(1, 2, n, d, dtype=dtype, device=DEVICE)
    return validate(q, k, k, None, 0.0, causal, None, False, "bhsd", None)


def test_prediction_interpolates_the_rate_in_log_length_and_scales_by_work(cost_file):
    arch = "cpu"
    p1, p4 = _problem(1024), _problem(4096)
    cost_file([costs.entry("sdpa.cpu", arch, p1, 2.0), costs.entry("sdpa.cpu", arch, p4, 64.0)])
    r1, r4 = 2.0 / costs.work(p1), 64.0 / costs.work(p4)
    p2 = _problem(2048)
    assert costs.predict("sdpa.cpu", arch, p2) == pytest.approx((r1 + r4) / 2 * costs.work(p2))
    assert costs.predict("sdpa.cpu", arch, _problem(512)) == pytest.approx(r1 * costs.work(_problem(512)))
    assert costs.predict("sdpa.cpu", arch, _problem(8192)) == pytest.approx(r4 * costs.work(_problem(8192)))
    assert costs.predict("sdpa.cpu", arch, _problem(1024, causal=True)) is None  # another class: unmeasured
    assert costs.predict("sdpa.cpu", "sm90", p1) is None


def test_a_plain_measurement_predicts_nothing_for_a_modified_call_and_the_sinks_runner_prices_its_kernel(cost_file):
    """A soft-capped or sinks call is a class of its own (its kernel variant is slower than the
    plain one): on an H200 (sm90) a plain triton.ptr entry put the Triton kernel ahead of sinks.cudnn for
    sinks forwards, 1.3x slower. sinks.cudnn, unmeasured itself, is priced as cuDNN's plain call
    times the sink's passes."""
    from dataclasses import replace

    from adaattn.backends.sdpa_sinks import SINK_PASS

    plain = _problem(4096, d=128, dtype=torch.bfloat16, causal=True)
    sinks, capped = replace(plain, sinks=True), replace(plain, softcap=30.0)
    cost_file([costs.entry("triton.ptr", "sm75", plain, 2.0), costs.entry("sdpa.cudnn", "sm75", plain, 1.5),
               costs.entry("triton.ptr", "sm75", capped, 3.0)])
    assert costs.predict("triton.ptr", "sm75", plain) == pytest.approx(2.0)
    assert costs.predict("triton.ptr", "sm75", sinks) is None
    assert costs.predict("triton.ptr", "sm75", capped) == pytest.approx(3.0)
    runner = planner.REGISTRY["sinks.cudnn"]
    cuda_sinks = replace(sinks, device_type="cuda")
    arch = adaattn.hardware.arch
    try:
        adaattn.hardware.arch = lambda device_type, index=None: "sm75"
        assert runner.cost(cuda_sinks) == pytest.approx(1.5 * SINK_PASS)
        assert runner.cost(replace(cuda_sinks, causal=False)) is None  # cuDNN unmeasured there
    finally:
        adaattn.hardware.arch = arch


def test_a_cost_file_of_another_schema_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"schema": "something/0", "entries": []}))
    monkeypatch.setenv("ADAATTN_COSTS", str(path))
    with pytest.raises(ValueError, match="schema"):
        costs.load(force=True)
    monkeypatch.delenv("ADAATTN_COSTS")
    costs.load(force=True)


@NEEDS_CUDA_OR_INTERPRETER
def test_the_planner_runs_the_exact_runner_measured_fastest_and_says_so(cost_file):
    problem = _problem(256)
    arch = "cpu" if DEVICE == "cpu" else adaattn.hardware.arch("cuda", None)
    policy = adaattn.Policy(backends=("triton",))
    first = planner.make_plan(problem, policy)
    slow, fast = first.candidates[0], first.candidates[-1]
    assert slow != fast
    cost_file([costs.entry(n, arch, problem, 5.0 if n != fast else 1.0) for n in first.candidates])
    plan = planner.make_plan(problem, policy)
    assert plan.backend == fast and dict(plan.costs)[fast] == pytest.approx(1.0)
    q = torch.randn(1, 2, 256, 64, dtype=torch.float16, device=DEVICE)
    assert "predicted 1 ms" in str(adaattn.explain(q, q, q, policy=policy))


@NEEDS_CUDA_OR_INTERPRETER
def test_an_approximate_runner_measured_slower_than_exact_never_runs(cost_file):
    problem = _problem(256)
    arch = "cpu" if DEVICE == "cpu" else adaattn.hardware.arch("cuda", None)
    policy = adaattn.Policy(mode="auto", precisions=("native", "int8", "fp8"), backends=("triton",))
    first = planner.make_plan(problem, policy)
    approximate = [n for n in first.candidates if not planner.REGISTRY[n].exact]
    assert approximate, first.reasons
    exact = [n for n in first.candidates if planner.REGISTRY[n].exact]
    levels = [costs.entry(f"{n}:{lv}", arch, problem, 3.0) for n in approximate for lv in ("exact", "qk8", "fp8")]
    cost_file([costs.entry(n, arch, problem, 2.0) for n in exact] + levels)
    plan = planner.make_plan(problem, policy)
    assert plan.backend not in approximate
    for name in approximate:
        assert name not in plan.candidates
        assert any("cheapest option measures 3 ms against" in r for r in dict(plan.reasons)[name]), \
            dict(plan.reasons)[name]
    # The levels' predictions are kernel time: an exact runner's measured host time (here 5 ms, so
    # its cost is 7 ms) does not make a slower quantized kernel look faster than its kernel.
    cost_file([costs.entry(n, arch, problem, 2.0) for n in exact] + levels
              + [costs.host_entry(n, arch, 5000.0) for n in exact])
    plan = planner.make_plan(problem, policy)
    assert plan.backend not in approximate and all(n not in plan.candidates for n in approximate)


def test_calibrate_suite_writes_costs_the_planner_then_reads(tmp_path, monkeypatch):
    from adaattn.cli import main

    user = tmp_path / "user" / "costs.json"
    monkeypatch.setenv("ADAATTN_COSTS", str(user))
    out = tmp_path / "out"
    try:
        assert main(["bench", "--suite", "calibrate", "--device", "cpu", "--seq-lens", "64,128", "--rep-ms", "5",
                     "--warmup-ms", "1", "--out", str(out), "--install", "--no-progress"]) == 0
        written = json.loads((out / "costs.json").read_text())
        assert written["schema"] == costs.SCHEMA
        assert {e["runner"] for e in written["entries"]} >= {"sdpa.cpu"}
        assert {e["n"] for e in written["entries"]} == {64, 128}
        assert user.is_file()
        q = torch.randn(1, 4, 96, 64)
        assert costs.predict("sdpa.cpu", "cpu", validate(q, q, q)) > 0  # between the measured lengths
    finally:
        monkeypatch.delenv("ADAATTN_COSTS")
        costs.load(force=True)


@NEEDS_CUDA_OR_INTERPRETER
def test_a_runner_s_host_time_is_added_to_its_kernel_time_so_a_small_call_runs_the_cheaper_host_path(cost_file,
                                                                                                      tmp_path):
    """Host entries (costs.host_entry) add each runner's measured host time a call to its predicted
    kernel time: a kernel faster by less than its extra host time loses (a small call's time is its
    host path), and a kernel faster by more still wins. Host entries merge by (runner, arch)."""
    problem = _problem(256)
    arch = "cpu" if DEVICE == "cpu" else adaattn.hardware.arch("cuda", None)
    policy = adaattn.Policy(backends=("triton",))
    names = planner.make_plan(problem, policy).candidates
    a, b = names[0], names[-1]
    kernels = [costs.entry(n, arch, problem, 0.010 if n == a else 0.012 if n == b else 1.0) for n in names]
    cost_file(kernels)
    assert planner.make_plan(problem, policy).backend == a
    cost_file(kernels + [costs.host_entry(a, arch, 30.0), costs.host_entry(b, arch, 15.0)])
    plan = planner.make_plan(problem, policy)
    assert plan.backend == b and dict(plan.costs)[b] == pytest.approx(0.012 + 0.015)
    assert planner.REGISTRY[a].cost(problem) == pytest.approx(0.010 + 0.030)
    assert costs.predict(a, arch, problem) == pytest.approx(0.010)  # kernel time alone, as the levels' are
    cost_file([costs.entry(n, arch, problem, 0.010 if n == a else 1.0) for n in names]
              + [costs.host_entry(a, arch, 30.0), costs.host_entry(b, arch, 15.0)])
    assert planner.make_plan(problem, policy).backend == a  # b's kernel at 1 ms: host time does not save it
    path = tmp_path / "merged.json"
    costs.write(path, [costs.host_entry(a, arch, 30.0), costs.entry(a, arch, problem, 0.01)], merge=False)
    costs.write(path, [costs.host_entry(a, arch, 20.0)])
    kept = json.loads(path.read_text())["entries"]
    assert [e["host_us"] for e in kept if "host_us" in e] == [20.0] and len(kept) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_calibrate_measures_each_sdpa_runner_s_host_time_on_cuda():
    from adaattn.bench.suites.calibrate import host_entries

    rows = host_entries(torch.device("cuda", torch.cuda.current_device()))
    by = {e["runner"]: e["host_us"] for e in rows}
    assert {"sdpa.flash", "sdpa.cudnn", "sdpa.efficient"} <= set(by), by
    assert all(0 < us < 5000 for us in by.values()), by
    assert all(e["arch"] == adaattn.hardware.arch("cuda", None) for e in rows)
