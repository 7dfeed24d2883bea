"""mode="auto" takes a quantized option only where it is faster than the fastest exact runner
(issue 14): the planner's choice from cost data (injected here), a call site's choice once it
knows its levels, and what stats record of both."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

import adaattn  # noqa: E402
from adaattn import costs, hardware, planner, stats  # noqa: E402
from adaattn.adaptive import choice, controller, sites, structured  # noqa: E402
from adaattn.backends.triton import tuner as triton_tuner  # noqa: E402
from adaattn.problem import validate  # noqa: E402

from helpers import DEVICE, NEEDS_CUDA_OR_INTERPRETER  # noqa: E402

pytestmark = NEEDS_CUDA_OR_INTERPRETER

ALL = ("native", "int8", "fp8")
QUANT = ("triton.quant.ws", "triton.quant.general")
LEVELS = ("exact", "qk8", "fp8")
SHAPE = (1, 4, 128, 64)  # B, H, N, D: "random" inputs put every head at qk8 under tolerance 3e-2


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(triton_tuner.CONFIGS, "tune", False)
    sites.reset()
    yield
    sites.reset()


@pytest.fixture
def inject(cost_file):
    """Cost data of our own: every exact runner at `exact_ms`, each quantized level at its figure."""

    def write(problem, exact_ms: float, level_ms: dict):
        arch = hardware.arch(problem.device_type, problem.device_index)
        entries = [costs.entry(n, arch, problem, exact_ms) for n, r in planner.REGISTRY.items() if r.exact]
        entries += [costs.entry(f"{n}:{lv}", arch, problem, ms) for n in QUANT for lv, ms in level_ms.items()]
        cost_file(entries)

    return write


def _inputs():
    return structured.make("random", *SHAPE[:2], SHAPE[2], SHAPE[3], torch.bfloat16, DEVICE, seed=7)


def _call(q, k, v, policy, label):
    with stats.collect() as recs:
        out = adaattn.attention(q, k, v, policy=policy, label=label)
    rec = recs[-1].as_dict()
    return out, rec


def _exact_runners():
    q, k, v = _inputs()
    plan = planner.make_plan(validate(q, k, v), adaattn.Policy())
    return plan.candidates


def test_the_planner_chooses_exact_when_the_cost_data_says_the_quantized_level_is_slower(inject):
    q, k, v = _inputs()
    problem = validate(q, k, v)
    inject(problem, exact_ms=1.0, level_ms={"exact": 3.0, "qk8": 2.0, "fp8": 2.0})
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=3e-2)
    exp = adaattn.explain(q, k, v, policy=policy)
    assert not exp.chosen.startswith("triton.quant")
    for name in QUANT:
        assert any("cheapest option measures 2 ms against" in r for r in dict(exp.plan.reasons)[name])
    out, rec = _call(q, k, v, policy, "slower")
    assert rec["backend"] == exp.chosen
    d = rec["decisions"]  # what the stats say of the plan's choice
    assert d["option"] == f"exact ({exp.chosen})" and all(n in d["rejected"] for n in QUANT)
    assert "cheapest option measures 2 ms against" in d["why"] and d["exact_ms"] == pytest.approx(1.0)
    torch.testing.assert_close(out, adaattn.attention(q, k, v), rtol=0, atol=0)  # the exact runner's result


def test_the_planner_chooses_the_quantized_level_when_the_cost_data_says_it_is_faster(inject):
    q, k, v = _inputs()
    problem = validate(q, k, v)
    inject(problem, exact_ms=3.0, level_ms={"exact": 3.5, "qk8": 1.0, "fp8": 0.8})
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=3e-2)
    exp = adaattn.explain(q, k, v, policy=policy)
    assert exp.chosen in QUANT
    for label in ("faster", "faster"):  # the first call (warm-up) and a steady-state one
        _, rec = _call(q, k, v, policy, label)
        d = rec["decisions"]
        assert rec["backend"] in QUANT and set(d["head_levels"]) == {"qk8"}
        assert d["option"] == "qk8:4" and d["rejected"].startswith("exact (")
        assert d["predicted_ms"] == pytest.approx(1.0) and d["exact_ms"] == pytest.approx(3.0)
        assert "is predicted at 1 ms against" in d["why"]


def test_a_site_whose_levels_predict_slower_than_exact_runs_the_exact_runner(inject):
    """The plan keeps the quantized runner (fp8 would be faster), but at 3e-2 this site's heads
    need qk8, which the data says is slower: the site runs the exact runner, and says why."""
    q, k, v = _inputs()
    problem = validate(q, k, v)
    inject(problem, exact_ms=1.0, level_ms={"exact": 3.0, "qk8": 2.0, "fp8": 0.5})
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=3e-2)
    exact = adaattn.attention(q, k, v)
    for _ in range(2):
        out, rec = _call(q, k, v, policy, "site")
        d = rec["decisions"]
        assert d["option"].startswith("exact (") and d["rejected"] == "qk8:4"
        assert "qk8:4 meets the tolerance but is predicted at 2 ms against" in d["why"]
    assert rec["backend"] not in QUANT and not rec["backend"].startswith("triton.quant")
    torch.testing.assert_close(out, exact, rtol=0, atol=0)


def test_every_head_exact_runs_the_fastest_exact_runner_not_the_quantized_kernel(inject):
    q, k, v = _inputs()
    inject(validate(q, k, v), exact_ms=1.0, level_ms={"exact": 1.2, "qk8": 0.5, "fp8": 0.4})
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=1e-6)
    _call(q, k, v, policy, "tight")  # warm-up: every head escalates to exact
    out, rec = _call(q, k, v, policy, "tight")
    assert set(rec["decisions"]["head_levels"]) == {"exact"}
    assert rec["backend"] not in QUANT and "every head needs exact" in rec["decisions"]["why"]


def test_a_measured_time_at_the_site_takes_the_place_of_the_prediction(inject):
    """Verified calls time the site's option; the measurement then decides against the exact
    runner's figure (on the CPU the interpreter is slow, so measured > predicted here)."""
    q, k, v = _inputs()
    inject(validate(q, k, v), exact_ms=1e-3, level_ms={"exact": 1e-3, "qk8": 1e-4, "fp8": 1e-4})
    policy = adaattn.Policy(mode="auto", precisions=("native", "int8"), tolerance=3e-2, verify=1.0)
    _call(q, k, v, policy, "measured")  # warm-up
    ctl = sites.find("measured")
    for _ in range(controller.MEASURED_CALLS):  # verified, timed; the median of them then decides
        _, rec = _call(q, k, v, policy, "measured")
        assert rec["decisions"]["option"] == "qk8:4" and rec["decisions"]["measured_ms"] is None
        ctl.poll(wait=True)
    _, rec = _call(q, k, v, policy, "measured")
    d = rec["decisions"]
    assert d["measured_ms"] is not None and d["measured_ms"] > 1e-3
    # The exact runner was timed beside it on those calls: its figure is measured here too.
    assert d["exact_ms"] != pytest.approx(1e-3) and d["exact_ms"] > 0
    assert d["option"].startswith("exact (") and "measures" in d["why"]


def test_decide_keeps_a_margin_and_names_the_figures():
    qk8 = [1] * 4
    assert choice.decide(qk8, 0.9, None, "sdpa.cudnn", 1.0).quantized
    assert not choice.decide(qk8, 0.94, None, "sdpa.cudnn", 1.0).quantized  # within the margin: exact
    assert not choice.decide(qk8, 0.5, 1.2, "sdpa.cudnn", 1.0).quantized  # a measurement beats the prediction
    c = choice.decide([2, 2, 1, 0], None, None, "sdpa.cudnn", None, ratio=0.6)
    assert c.quantized and "0.6x" in c.reason
    assert choice.option_name([2, 2, 1, 0]) == "fp8:2 qk8:1 exact:1"


def test_warmup_compiles_every_level_and_the_exact_runner_without_touching_a_call_site():
    q, k, v = _inputs()
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=3e-2)
    done = adaattn.warmup(q, k, v, policy=policy)
    runner = done["plan"]
    assert runner in QUANT
    assert {f"{runner}:{lv}" for lv in LEVELS} <= set(done["warmed"])
    assert any(planner.REGISTRY[n].exact for n in done["warmed"] if n in planner.REGISTRY)  # the exact runner too
    assert sites.controllers() == {}  # no site's levels were set
    _, rec = _call(q, k, v, policy, "after-warmup")  # the site still analyses its own first call
    assert rec["decisions"]["head_levels"] == ["qk8"] * SHAPE[1] and rec["decisions"]["verified"]
    exact = adaattn.warmup(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, layout="bshd")
    assert planner.REGISTRY[exact["plan"]].exact and exact["warmed"] == [exact["plan"]]
