"""Policy(mode="auto"): per-head precision under a measured tolerance.

The guarantee tested here: on the structured set (adaptive/structured.py, including heads of
the shipped model), every head adaattn reports as quantized has an error against float64
(over all of its rows, not only the sampled ones) within the tolerance, and heads whose
quantized error would exceed it are reported at a higher precision. On a machine without
CUDA the kernels run in the Triton interpreter.
"""

from __future__ import annotations

import torch

import pytest

triton = pytest.importorskip("triton")

from dataclasses import replace  # noqa: E402

import adaattn  # noqa: E402
from adaattn import settings, stats  # noqa: E402
from adaattn.adaptive import controller, runner, sites, structured  # noqa: E402
from adaattn.adaptive import quant_launch as tq  # noqa: E402
from adaattn.adaptive import verify_launch  # noqa: E402
from adaattn.backends.triton import runner as ta  # noqa: E402
from adaattn.backends.triton import tuner as triton_tuner  # noqa: E402
from adaattn.backends.reference import reference_attention  # noqa: E402

from helpers import DEVICE, NEEDS_CUDA_OR_INTERPRETER, rel_err  # noqa: E402

pytestmark = NEEDS_CUDA_OR_INTERPRETER

ALL = ("native", "int8", "fp8")
# The runner an auto call without mask or window runs: the warp-specialised kernels where they
# run (Hopper, or the interpreter), the general quantized kernel elsewhere.
QUANT_RUNNER = "triton.quant.ws" if tq.ws_device_ok(torch.device(DEVICE)) else "triton.quant.general"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(triton_tuner.CONFIGS, "tune", False)
    sites.reset()
    with settings.override(poison_outputs=True):
        yield
    sites.reset()


def _head_errors(out, ref):
    return ((out.double() - ref).pow(2).sum((0, 2, 3)).sqrt() / ref.pow(2).sum((0, 2, 3)).sqrt()).tolist()


def _reference(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    return reference_attention(q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1),
                               is_causal=causal)


@pytest.fixture(scope="module")
def structured_cases():
    """Each case with its float64 reference and each level's full per-head error."""
    sites.reset()
    out = []
    for name, q, k, v, causal in structured.cases(n=128, device=DEVICE):
        ref = _reference(q, k, v, causal)
        fp8_qk = tq.fp8_level_uses_fp8_qk(q, None, causal, -1, -1)  # as the controllers' fp8 level runs
        level_err = {tq.LEVELS[lv]: _head_errors(tq.quant_attention(q, k, v, levels=[lv], causal=causal,
                                                                    fp8_qk=fp8_qk), ref)
                     for lv in (tq.LEVEL_QK8, tq.LEVEL_FP8)}
        out.append((name, q, k, v, causal, ref, level_err))
    return out


@pytest.mark.parametrize("tau", [1e-2, 5e-2])
def test_every_head_reported_quantized_meets_the_tolerance(structured_cases, tau):
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=tau)
    seen = set()
    for name, q, k, v, causal, ref, level_err in structured_cases:
        with stats.collect() as recs:
            out = adaattn.attention(q, k, v, is_causal=causal, policy=policy, enable_gqa=q.shape[1] != k.shape[1],
                                    label=f"structured {name}")
        decisions = recs[-1].as_dict()["decisions"]
        levels, measured = decisions["head_levels"], decisions["head_errors"]
        assert recs[-1].backend == QUANT_RUNNER and decisions["verified"]
        errors = _head_errors(out, ref)
        for h, (level, err) in enumerate(zip(levels, errors)):
            seen.add(level)
            assert err <= tau, f"{name} head {h} at {level}: error {err:.4f} > tolerance {tau}"
            assert measured[h] <= tau
            # Heads that cannot meet tau at a cheaper level are reported at a higher one.
            if level_err["fp8"][h] > tau:
                assert level != "fp8", f"{name} head {h}"
            if level_err["qk8"][h] > tau:
                assert level == "exact", f"{name} head {h}: qk8 error {level_err['qk8'][h]:.4f}"
    # The set exercises the choice: at 1e-2 some heads must stay exact and some need not;
    # at 5e-2 both quantized levels serve some heads.
    assert seen >= ({"exact", "qk8"} if tau == 1e-2 else {"qk8", "fp8"})


def test_levels_follow_the_tolerance_on_random_inputs():
    q, k, v = structured.make("random", 1, 4, 128, 64, torch.bfloat16, DEVICE, seed=1)
    picked = {}
    for tau in (1e-2, 3e-2, 8e-2):
        with stats.collect() as recs:
            adaattn.attention(q, k, v, policy=adaattn.Policy(mode="auto", precisions=ALL, tolerance=tau),
                              label=f"random {tau}")
        picked[tau] = set(recs[-1].as_dict()["decisions"]["head_levels"])
    assert picked == {1e-2: {"exact"}, 3e-2: {"qk8"}, 8e-2: {"fp8"}}


@pytest.mark.parametrize("verify_kernels", [True, False])
def test_a_head_over_the_tolerance_is_recomputed_one_level_up_and_remembered(monkeypatch, verify_kernels):
    ran = []
    if verify_kernels:  # kernels/verify.py, one launch per stage: record that they ran
        for name in ("exact_rows", "verify_step"):
            real = getattr(verify_launch, name)
            monkeypatch.setattr(verify_launch, name, lambda *a, real=real, name=name: ran.append(
                (name, real(*a))) or ran[-1][1])
    else:  # the torch path of sampled verification (masks, other dtypes)
        monkeypatch.setattr(verify_launch, "exact_rows", lambda *a: None)
        monkeypatch.setattr(verify_launch, "verify_step", lambda *a: False)
    q, k, v = structured.make("large_logits", 1, 4, 128, 64, torch.bfloat16, DEVICE, seed=2)
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=2e-2, verify=1.0)
    adaattn.attention(q, k, v, policy=policy, label="drift")  # warm-up
    ctl = sites.find("drift")
    assert ctl.levels == [0, 0, 0, 0]  # qk8 errs about 3e-2 on these heads
    ctl.levels = [2, 2, 0, 1]  # as if the inputs had drifted since the levels were chosen
    ctl._device_levels.clear()
    with stats.collect() as recs:
        out = adaattn.attention(q, k, v, policy=policy, label="drift")
    d = recs[-1].as_dict()["decisions"]
    assert d["verified"] and d["head_levels"] == ["fp8", "fp8", "exact", "qk8"]
    # Recomputed in the same call: fp8 -> qk8 still over 2e-2 -> exact.
    assert d["head_levels_after_verification"] == ["exact", "exact", "exact", "exact"]
    assert max(_head_errors(out, _reference(q, k, v, False))) <= 2e-2
    ctl.poll(wait=True)
    assert ctl.levels == [0, 0, 0, 0] and ctl.escalations >= 3
    if verify_kernels:
        assert [n for n, r in ran if r is not None and r is not False] == ["exact_rows"] + ["verify_step"] * 3


def test_an_escalated_head_retries_the_cheaper_level_once_after_calm_measurements():
    ctl = controller.PrecisionController("calm", 5e-2, 1.0, (tq.LEVEL_QK8, tq.LEVEL_FP8), 2)
    ctl.levels = [tq.LEVEL_FP8, tq.LEVEL_FP8]
    ctl.predicted = {"exact": [0.001] * 2, "qk8": [0.01] * 2, "fp8": [0.03, 0.06]}
    ctl._apply([2, 2], [1, 1], [0.01, 0.01], [0.045, 0.045])  # one sample over 0.8 tau: both up
    assert ctl.levels == [1, 1] and ctl.escalations == 2
    for _ in range(controller.DOWN_AFTER):
        ctl._apply([1, 1], [1, 1], [0.01, 0.01], [0.01, 0.01])
    # Head 0's fp8 prediction (0.03 <= 0.7 tau) allows a retry; head 1's (0.06) does not.
    assert ctl.levels == [2, 1] and ctl.step_downs == 1
    ctl._apply([2, 1], [1, 1], [0.01, 0.01], [0.05, 0.01])  # the retry fails: up again, for good
    for _ in range(3 * controller.DOWN_AFTER):
        ctl._apply([1, 1], [1, 1], [0.01, 0.01], [0.01, 0.01])
    assert ctl.levels == [1, 1] and ctl.step_downs == 1


def test_no_verification_when_verify_is_zero_after_warm_up():
    q, k, v = structured.make("random", 1, 2, 64, 64, torch.bfloat16, DEVICE, seed=3)
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=8e-2, verify=0.0)
    with stats.collect() as recs:
        for _ in range(3):
            adaattn.attention(q, k, v, policy=policy)
    flags = [r.as_dict()["decisions"]["verified"] for r in recs]
    assert flags == [True, False, False]  # the warm-up always checks


def test_gradients_run_exact_unless_the_policy_allows_a_quantized_forward():
    q, k, v = (t.requires_grad_() for t in structured.make("random", 1, 2, 64, 64, torch.bfloat16, DEVICE, 4))
    auto = adaattn.Policy(mode="auto", precisions=ALL, tolerance=8e-2)
    text = str(adaattn.explain(q, k, v, policy=auto))
    assert "inputs require grad" in text and "chosen: triton.quant" not in text
    trainable = adaattn.Policy(mode="auto", precisions=ALL, tolerance=8e-2, train_quantized=True)
    assert "chosen: triton.quant" in str(adaattn.explain(q, k, v, policy=trainable))
    out = adaattn.attention(q, k, v, policy=trainable)
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = [t.grad.clone() for t in (q, k, v)]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64)
    ref.backward(dout.double())
    assert rel_err(out.detach(), ref.detach()) <= 8e-2
    assert rel_err(out.detach(), ref.detach()) > 1e-2  # the forward was quantized
    for g, r in zip(grads, (q64.grad, k64.grad, v64.grad)):
        assert rel_err(g, r) <= 2e-2  # the backward is exact (bf16 kernels)


def test_strided_key_and_value_are_read_correctly():
    q, k, v = structured.make("random", 1, 2, 64, 64, torch.bfloat16, DEVICE, seed=8)
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=8e-2, verify=0.0)
    adaattn.attention(q, k, v, policy=policy, label="strided")  # warm-up on contiguous inputs
    ks = torch.empty(k.shape[:-1] + (2 * k.shape[-1],), dtype=k.dtype, device=DEVICE)[..., ::2]
    vs = torch.empty_like(ks)
    ks.copy_(k)
    vs.copy_(v)
    assert ks.stride(-1) == 2
    out = adaattn.attention(q, ks, vs, policy=policy, label="strided")
    assert max(_head_errors(out, _reference(q, k, v, False))) <= 8e-2


@pytest.mark.parametrize("shape", [(0, 2, 16, 16), (1, 2, 16, 0)])
def test_empty_inputs_run_exact_and_do_not_pin_the_site(shape):
    b, h, nq, nk = shape
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=8e-2)
    q = torch.randn(b, h, nq, 64, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(b, h, nk, 64, dtype=torch.bfloat16, device=DEVICE)
    out = adaattn.attention(q, k, k, policy=policy, label="empty")
    assert out.shape == q.shape and (out == 0).all()
    # The same site (and, for B=0, the same shape class) must still warm up on real data.
    q, k, v = structured.make("random", 1, 2, 16, 64, torch.bfloat16, DEVICE, seed=9)
    with stats.collect() as recs:
        adaattn.attention(q, k, v, policy=policy, label="empty")
    assert recs[-1].backend == QUANT_RUNNER
    assert "fp8" in recs[-1].as_dict()["decisions"]["head_levels"]


def test_fully_masked_rows_with_the_dtype_minimum_match_sdpa():
    # Hugging Face masks with finfo(dtype).min, not -inf: such a row is the mean of V in SDPA.
    q, k, v = structured.make("random", 1, 2, 32, 64, torch.bfloat16, DEVICE, seed=10)
    mask = torch.zeros(1, 1, 32, 32, dtype=torch.bfloat16, device=DEVICE)
    mask[..., 5, :] = torch.finfo(torch.bfloat16).min
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask.double())
    exact = ta.triton_attention(q, k, v, mask)
    assert rel_err(exact[:, :, 5], ref[:, :, 5]) <= 1e-2
    quant = tq.quant_attention(q, k, v, mask, levels=[tq.LEVEL_QK8])
    assert rel_err(quant[:, :, 5], ref[:, :, 5]) <= 2e-2


def test_gqa_bshd_window_and_mask_through_the_auto_path():
    g = torch.Generator(device="cpu").manual_seed(12)
    q = torch.randn(2, 70, 4, 64, generator=g).to(torch.bfloat16).to(DEVICE)  # (B, N, H, D)
    k = torch.randn(2, 90, 2, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(2, 90, 2, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    keep = (torch.rand(2, 1, 70, 90, generator=g) > 0.2).to(DEVICE)
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=5e-2)
    with stats.collect() as recs:
        out = adaattn.attention(q, k, v, keep, enable_gqa=True, layout="bshd", window=(40, 10), policy=policy)
    # (a mask and a window: the general quantized kernel's runner)
    assert recs[-1].backend == "triton.quant.general" and out.shape == (2, 70, 4, 64)
    qh, kh, vh = (t.transpose(1, 2).double() for t in (q, k, v))
    i = torch.arange(70)[:, None]
    j = torch.arange(90)[None, :]
    full = keep.cpu() & (j >= i - 40) & (j <= i + 10)
    ref = reference_attention(qh.cpu(), kh.cpu().repeat_interleave(2, 1), vh.cpu().repeat_interleave(2, 1), full)
    assert max(_head_errors(out.transpose(1, 2).cpu(), ref)) <= 5e-2


def test_a_readback_applied_during_a_call_leaves_no_head_unwritten(monkeypatch):
    # Another thread may apply a verification readback while a call is between choosing its
    # levels and launching; the call must launch one consistent snapshot of them.
    q, k, v = structured.make("random", 1, 4, 48, 64, torch.bfloat16, DEVICE, seed=13)
    ctl = controller.PrecisionController("race", 8e-2, 0.0, (tq.LEVEL_QK8, tq.LEVEL_FP8), 4)
    ctl.levels = [tq.LEVEL_FP8] * 4
    real = tq.quant_attention

    def racing(*args, **kwargs):
        ctl._apply([2, 2, 2, 2], [tq.LEVEL_QK8, 2, 2, 2], [0.01] * 4, [0.01] * 4)  # head 0 moves up mid-call
        return real(*args, **kwargs)

    monkeypatch.setattr(tq, "quant_attention", racing)
    out, info = ctl.run(q, k, v, None, 0.125, False, False, -1, -1)
    assert torch.isfinite(out).all()  # poisoned outputs: a stranded head would be NaN
    assert info["levels"] == ["fp8"] * 4 and ctl.levels == [tq.LEVEL_QK8, 2, 2, 2]


def test_cpu_without_the_interpreter_stays_exact(monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("CPU behaviour")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    e = adaattn.explain(q, q, q, policy=adaattn.Policy(mode="auto", precisions=ALL, tolerance=5e-2))
    assert e.chosen == "sdpa.cpu"
    assert any("no approximate runner can take this call" in n for n in e.plan.notes)
    reasons = dict(e.plan.reasons)
    for name in ("triton.quant.ws", "triton.quant.general"):
        assert any("CPU only under TRITON_INTERPRET=1" in r for r in reasons[name]), reasons[name]


def _cuda_problem(monkeypatch):
    """A plain bf16 problem as on a GPU whose tensor cores have INT8 but no FP8."""
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    problem = adaattn.problem.validate(q, q, q, None, 0.0, False, None, False, "bhsd", None)
    monkeypatch.setattr(tq, "fp8_supported", lambda device: False)
    monkeypatch.setattr(tq, "int8_supported", lambda device: True)
    return replace(problem, device_type="cuda", device_index=0)


def test_auto_alone_allows_every_precision_and_approximation_under_the_default_tolerance():
    from adaattn.planner import REGISTRY

    auto = adaattn.Policy(mode="auto")
    assert auto.tolerance == adaattn.Policy().tolerance == 1e-2
    assert auto.precisions == ALL and auto.approximations == ("lowrank", "skip")
    assert auto == adaattn.Policy(mode="auto", precisions=ALL, approximations=("lowrank", "skip"))
    assert adaattn.Policy(mode="auto", tolerance=5e-2, verify=1.0).approximations == ("lowrank", "skip")
    # Naming a list allows exactly what the lists name; exact allows nothing.
    assert adaattn.Policy(mode="auto", precisions=ALL).approximations == ()
    assert adaattn.Policy(mode="auto", approximations=("skip",)).precisions == ("native",)
    assert (adaattn.Policy().precisions, adaattn.Policy().approximations) == (("native",), ())
    # No approximate runner is stopped by Policy(mode="auto") (what they decline for here is the
    # call's, not the policy's); a policy naming only "native" stops every one of them.
    q = torch.randn(1, 4, 8192, 64, dtype=torch.bfloat16)
    approximate = {name for name, r in REGISTRY.items() if not r.exact}
    assert {"triton.rank", "triton.quant.ws", "triton.quant.general"} <= approximate
    for policy, stopped in ((auto, set()), (adaattn.Policy(mode="auto", precisions=("native",)), approximate)):
        reasons = adaattn.explain(q, q, q, is_causal=True, policy=policy).as_dict()["backends"]
        assert {n for n in approximate if any(("Policy.precisions" in r or "Policy.approximations" in r)
                                              for r in reasons[n])} == stopped, reasons


def test_fp8_is_dropped_where_tensor_cores_lack_it(monkeypatch):
    problem = _cuda_problem(monkeypatch)
    levels, reasons = runner.allowed_levels(problem, adaattn.Policy(mode="auto", precisions=ALL))
    assert levels == (tq.LEVEL_QK8,) and reasons == []
    # With fp8 the only quantized precision allowed, nothing is left: the reason says why.
    levels, reasons = runner.allowed_levels(problem, adaattn.Policy(mode="auto", precisions=("native", "fp8")))
    assert levels == () and any("8.9" in r for r in reasons)


def test_dropping_fp8_is_explained(monkeypatch):
    problem = _cuda_problem(monkeypatch)
    e = adaattn.api.explain_problem(problem, adaattn.Policy(mode="auto", precisions=ALL))
    assert e.chosen == "triton.quant.general" and e.plan.launch.levels == (tq.LEVEL_QK8,)
    assert any("8.9" in n for n in e.plan.notes), e.plan.notes


def test_compiles_with_fullgraph_and_matches_eager():
    q, k, v = structured.make("random", 1, 2, 64, 64, torch.bfloat16, DEVICE, seed=5)
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=8e-2, verify=0.0)

    def f(q, k, v):
        return adaattn.attention(q, k, v, is_causal=True, policy=policy, label="compiled")

    eager = f(q, k, v)  # warms the controller up
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    assert torch.equal(compiled, eager)


def test_each_adaattention_module_has_its_own_controller():
    torch.manual_seed(0)
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=8e-2)
    a = adaattn.AdaAttention(128, 2, policy=policy, batch_first=True).to(DEVICE, torch.bfloat16)
    b = adaattn.AdaAttention(128, 2, policy=policy, batch_first=True).to(DEVICE, torch.bfloat16)
    x = torch.randn(1, 64, 128, dtype=torch.bfloat16, device=DEVICE)
    with stats.collect() as recs, torch.no_grad():
        a(x, x, x, need_weights=False)  # (need_weights=True forms MHA's weights, not adaattn.attention)
        b(x, x, x, need_weights=False)
    assert {r.label for r in recs} == {a.label, b.label}
    assert sites.find(a.label) is not sites.find(b.label)
    assert all(r.backend == QUANT_RUNNER for r in recs)
    label = a.label
    del a
    import gc

    gc.collect()
    assert sites.find(label) is None  # a collected module takes its controllers with it


# ---- on the GPU -------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@needs_cuda
def test_gpu_steady_state_makes_no_host_sync_and_replays_from_a_cuda_graph():
    q, k, v = structured.make("random", 2, 8, 2048, 128, torch.bfloat16, "cuda", seed=6)
    # Pinned to the quantized runners: at this size the H100's cost data would send the call to cuDNN.
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=8e-2, verify=0.5, backends=("triton.quant",))
    adaattn.attention(q, k, v, is_causal=True, policy=policy, label="graph")  # warm-up: may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation now raises
    try:
        for _ in range(6):  # verified and unverified calls alike
            adaattn.attention(q, k, v, is_causal=True, policy=policy, label="graph")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ctl = sites.find("graph")
    ctl.poll(wait=True)
    assert ctl.verified_calls >= 2 and set(ctl.levels) == {tq.LEVEL_FP8}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        adaattn.attention(q, k, v, is_causal=True, policy=policy, label="graph")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = adaattn.attention(q, k, v, is_causal=True, policy=policy, label="graph")
    graph.replay()
    torch.cuda.synchronize()
    unverified = tq.quant_attention(q, k, v, levels=[tq.LEVEL_FP8], causal=True, fp8_qk=ctl.fp8_qk)
    assert torch.equal(captured, unverified)
    # Eager calls verify and apply readbacks after the capture; the graph's tensors stay valid.
    before = sites.find("graph").verified_calls
    for _ in range(8):
        adaattn.attention(q, k, v, is_causal=True, policy=policy, label="graph")
    sites.find("graph").poll(wait=True)
    assert sites.find("graph").verified_calls > before
    torch.cuda.empty_cache()
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, unverified)
    ref = _reference(q, k, v, True)
    assert max(_head_errors(captured, ref)) <= 8e-2


@gpu
@needs_cuda
def test_gpu_compiled_auto_call_matches_eager():
    q, k, v = structured.make("random", 1, 8, 4096, 128, torch.bfloat16, "cuda", seed=7)
    # Pinned to the general quantized runner: eagerly the cost data would pick cuDNN at this size
    # (under torch.compile costs are not read), and triton.quant.ws needs 16-byte aligned data
    # pointers, which tracing cannot see (so it declines there and runs eagerly).
    policy = adaattn.Policy(mode="auto", precisions=ALL, tolerance=3e-2, verify=0.0,
                            backends=("triton.quant.general",))

    def f(q, k, v):
        return adaattn.attention(q, k, v, policy=policy, label="compiled-gpu")

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    assert torch.equal(compiled, eager)
    assert set(sites.find("compiled-gpu").levels) == {tq.LEVEL_QK8}


def test_auto_does_not_quantize_keys_and_values_per_call_in_decode():
    """Issue 14, item 2: with few query rows against many keys, exact attention is bound by
    reading K/V, and the quantized runners (whose pre-pass reads and writes them again) decline."""
    q = torch.randn(1, 8, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(1, 2, 4096, 64, dtype=torch.bfloat16, device=DEVICE)
    exp = adaattn.explain(q, k, k, enable_gqa=True, policy=adaattn.Policy(mode="auto", precisions=ALL))
    assert not exp.chosen.startswith("triton.quant")
    for name in ("triton.quant.general", "triton.quant.ws"):
        assert any("few query rows against the keys" in r for r in dict(exp.plan.reasons)[name]), name
    square = torch.randn(1, 8, 64, 64, dtype=torch.bfloat16, device=DEVICE)  # prefill: still offered
    exp = adaattn.explain(square, square, square, policy=adaattn.Policy(mode="auto", precisions=ALL))
    assert not any("few query rows" in r for r in dict(exp.plan.reasons)["triton.quant.general"])
