"""The fuzzer (tests/fuzz) on the CPU: a few hundred configurations of the default policy, and
the Triton runners under the interpreter, each against its float64 softmax (CUDA: test_gpu_fuzz)."""

from __future__ import annotations

import os

import pytest

from fuzz.sdpa import check, draw, main
import torch

import adaattn


def _run(n, seed, policy, device="cpu"):
    findings = []
    for index in range(n):
        result = check(draw(seed, index, device, policy), device)
        if result["status"] not in ("ok", "declined"):
            findings.append(f"{result['status']}: {result.get('why', '')[:200]} | {result['repro']}")
    return findings


def test_default_policy_meets_the_standard_on_fuzzed_configurations():
    assert _run(200, 20261127, "default") == []


def test_broadcast_leading_dims_meet_the_standard_on_fuzzed_configurations():
    """--broadcast: the key's and value's leading dims of 1 against the query's, as SDPA broadcasts
    them; the plain draw is otherwise untouched (old seeds keep their configurations)."""
    findings, drawn = [], 0
    for index in range(150):
        config = draw(20261129, index, "cpu", "default", broadcast=True)
        drawn += config.kv_batch is not None or config.q_batch is not None
        result = check(config, "cpu")
        if result["status"] != "ok":
            findings.append(f"{result['status']}: {result.get('why', '')[:200]} | {result['repro']}")
    assert findings == [] and drawn > 50
    plain, wide = draw(20261129, 3, "cpu"), draw(20261129, 3, "cpu", broadcast=True)
    assert plain == type(plain)(**{**wide.__dict__, "kv_batch": None, "q_batch": None})
    sides = [draw(20261129, i, "cpu", broadcast=True) for i in range(150)]
    assert any(c.q_batch for c in sides) and any(c.kv_batch for c in sides)  # the query's side too


def test_score_modifiers_meet_the_standard_on_fuzzed_configurations():
    """--modifiers: softcap, sinks and ALiBi slopes (and their gradients) on top of the plain draw,
    against the float64 softmax with them and the models' eager attention at the input dtype."""
    findings = []
    for index in range(150):
        config = draw(20261128, index, "cpu", "default", modifiers=True)
        assert config.modified
        result = check(config, "cpu")
        if result["status"] != "ok":
            findings.append(f"{result['status']}: {result.get('why', '')[:200]} | {result['repro']}")
    assert findings == []
    # The plain draw is untouched by the modifiers' own RNG: old seeds keep their configurations.
    plain, modified = draw(20261128, 7, "cpu"), draw(20261128, 7, "cpu", modifiers=True)
    assert not plain.modified and plain == type(plain)(**{**modified.__dict__, "softcap": None, "sinks": False,
                                                          "alibi": False})


INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the Triton runners need the interpreter here")


@INTERPRETED
def test_triton_runners_meet_the_standard_on_fuzzed_configurations():
    pytest.importorskip("triton")
    findings = _run(80, 20261127, "triton")
    assert findings == []


@INTERPRETED
def test_triton_score_modifiers_meet_the_standard_on_fuzzed_configurations():
    """Soft-capping and sinks in our pointer kernels (ALiBi declined: the default runner takes it)."""
    pytest.importorskip("triton")
    findings, ran = [], 0
    for index in range(60):
        result = check(draw(20261129, index, "cpu", "triton", modifiers=True), "cpu")
        ran += result["status"] == "ok"
        if result["status"] not in ("ok", "declined"):
            findings.append(f"{result['status']}: {result.get('why', '')[:200]} | {result['repro']}")
    assert findings == [] and ran >= 15


@INTERPRETED
@pytest.mark.parametrize("seed,index", [(20261127, 66), (20261128, 528)])
def test_triton_half_gradients_where_torch_runs_math_meet_the_standard(seed, index):
    # bfloat16 (#66, dq 2.13x) and float16 (#528, dk 2.2x) against torch's CPU math (fp32 inside):
    # our backward rounded ds to the input dtype before the dk and dq products, as FA2 and cuDNN
    # do. Where no fused torch kernel takes a call, ds now goes in two roundings (ds_split).
    pytest.importorskip("triton")
    result = check(draw(seed, index, "cpu", "triton"), "cpu")
    assert result["status"] == "ok", result.get("why")


@INTERPRETED
def test_ds_in_two_roundings_is_closer_to_float64_than_ds_rounded_once():
    """The same float16 backward (#528's tensors) with ds rounded once (settings ds_split "off", what
    runs where a fused torch kernel would) and in two roundings ("on"): both near float64, the
    second nearer; dv takes p in two roundings alongside (#170) and is no farther."""
    pytest.importorskip("triton")
    from adaattn import settings
    from adaattn.backends.reference import reference_attention, relative_errors

    g = torch.Generator().manual_seed(528)
    q, k, v = (torch.randn(2, 1, n, 8, generator=g, dtype=torch.float64) for n in (18, 30, 30))
    q = q * 10
    t16 = [x.half().requires_grad_() for x in (q, k, v)]
    t64 = [x.half().double().requires_grad_() for x in (q, k, v)]
    go = torch.randn(2, 1, 18, 8, generator=g, dtype=torch.float64)
    exact = torch.autograd.grad(reference_attention(*t64), t64, go)
    errs = {}
    for mode in ("off", "on"):
        with settings.override(ds_split=mode):
            out = adaattn.attention(*t16, policy=adaattn.Policy(backends=("triton.ptr",)))
            got = torch.autograd.grad(out, t16, go.half())
        errs[mode] = [relative_errors(a, b).item() for a, b in zip(got, exact)]
    assert all(e < 5e-3 for e in errs["off"] + errs["on"]), errs
    assert errs["on"][0] < errs["off"][0] and errs["on"][1] < errs["off"][1], errs
    assert errs["on"][2] < errs["off"][2], errs


def test_the_backward_takes_ds_in_two_roundings_only_where_torch_runs_math(monkeypatch):
    import dataclasses

    from adaattn import planner, settings
    from adaattn.backends.triton import runner
    from adaattn.problem import validate

    q = torch.randn(1, 2, 8, 64, dtype=torch.float16, requires_grad=True)
    problem, policy = validate(q, q, q), adaattn.Policy(backends=("triton.ptr",))
    fused = dataclasses.replace(problem, torch_fused=True)
    unfused = dataclasses.replace(problem, torch_fused=False)
    assert runner.torch_runs_math_gradients(unfused, policy)
    assert not runner.torch_runs_math_gradients(fused, policy)
    assert not runner.torch_runs_math_gradients(dataclasses.replace(unfused, dtype=torch.float32), policy)
    assert not runner.torch_runs_math_gradients(dataclasses.replace(unfused, needs_grad=False), policy)
    with settings.override(ds_split="on"):
        assert runner.torch_runs_math_gradients(fused, policy)
    with settings.override(ds_split="off"):
        assert not runner.torch_runs_math_gradients(unfused, policy)
    # torch's own order: flash, then efficient (no GQA there), then math, which leaves cuDNN unreached,
    # except where torch prefers cuDNN (2.11 on Hopper and Blackwell: cuDNN first).
    gqa = dataclasses.replace(problem, gqa=True)
    assert planner.torch_takes_fused(problem, {"sdpa.flash": True})
    assert planner.torch_takes_fused(problem, {"sdpa.efficient": True})
    assert not planner.torch_takes_fused(gqa, {"sdpa.efficient": True, "sdpa.cudnn": True}, "sm80")
    assert not planner.torch_takes_fused(problem, {"sdpa.cudnn": True}, "sm80")
    from adaattn.backends.sdpa_forms import CUDNN_WIDE
    prefers = CUDNN_WIDE and torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90900
    assert planner.torch_takes_fused(gqa, {"sdpa.efficient": True, "sdpa.cudnn": True}, "sm90") == prefers
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert not planner.torch_takes_fused(gqa, {"sdpa.efficient": True, "sdpa.cudnn": True}, "sm90")
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    # The planner sets torch_fused from torch's fused runners' own answers (here: none, on the CPU).
    assert planner.make_plan(problem, policy).launches[0].ds_split
    monkeypatch.setattr(planner.REGISTRY["sdpa.flash"], "supports", lambda p, pol: [])
    assert not planner.make_plan(problem, policy).launches[0].ds_split


def test_runners_behind_torch_s_own_fused_choice_give_math_grade_gradients():
    """A runner behind torch's own fused choice runs only where that one refused the tensors or
    failed, where torch's SDPA runs math: sdpa.math moves up behind it and triton.ptr's launch takes
    the math-grade backward (seed 5300 #16237: cuDNN refused the views, triton.ptr's dk 3.7x math's)."""
    import dataclasses

    from adaattn import planner
    from adaattn.problem import validate

    q = torch.randn(1, 4, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    policy = adaattn.Policy()
    gqa = validate(q, k, k, enable_gqa=True)
    gqa = dataclasses.replace(gqa, device_type="cuda", torch_fused=True)
    takes = {"sdpa.cudnn": True, "sdpa.flash": False, "sdpa.efficient": True}

    def plan(problem, order):
        launches = {n: planner.REGISTRY[n].prepare(problem, policy) for n in order if n != "sdpa.cudnn"}
        assert not launches["triton.ptr"].ds_split
        return planner._behind_torch_fused(problem, list(order), launches, takes, "sm90", policy), launches

    order, launches = plan(gqa, ("sdpa.cudnn", "triton.ptr", "sdpa.math"))
    assert order == ["sdpa.cudnn", "sdpa.math", "triton.ptr"] and launches["triton.ptr"].ds_split
    order, launches = plan(gqa, ("triton.ptr", "sdpa.cudnn", "sdpa.math"))  # ahead of it: unchanged
    assert order == ["triton.ptr", "sdpa.cudnn", "sdpa.math"] and not launches["triton.ptr"].ds_split
    # Without GQA torch's efficient kernel takes the call after cuDNN: nothing moves.
    plain = validate(q, q, q)
    plain = dataclasses.replace(plain, device_type="cuda", torch_fused=True)
    order, launches = plan(plain, ("sdpa.cudnn", "triton.ptr", "sdpa.math"))
    assert order == ["sdpa.cudnn", "triton.ptr", "sdpa.math"] and not launches["triton.ptr"].ds_split
    # Behind the efficient kernel too, it does.
    order, launches = plan(plain, ("sdpa.cudnn", "sdpa.efficient", "triton.ptr", "sdpa.math"))
    assert order == ["sdpa.cudnn", "sdpa.efficient", "sdpa.math", "triton.ptr"] and launches["triton.ptr"].ds_split
    # float32, or no gradients: unchanged.
    for problem in (dataclasses.replace(gqa, needs_grad=False), dataclasses.replace(gqa, dtype=torch.float32)):
        assert planner._behind_torch_fused(problem, ["sdpa.cudnn", "triton.ptr"], {}, takes, "sm90",
                                           policy) == ["sdpa.cudnn", "triton.ptr"]
    # A failed runner is not torch's choice (make_plan), and a call sdpa.math cannot hold has its own plan.
    small = dataclasses.replace(gqa, device_type="cpu")
    assert planner.plan_key(small, policy)[-1] and not planner.plan_key(dataclasses.replace(small, batch=1 << 20),
                                                                        policy)[-1]


@INTERPRETED
def test_exact_delta_at_every_length_where_torch_runs_math():
    # seed 5300 #16237 (H200): bfloat16, GQA 2/1, Nq=Nk=674, D=128, Dv=16, causal + a bool mask with
    # dead rows, logits x30, under gradients: dk 6.0e-3 against math's 1.6e-3, with ds in two
    # roundings or not. rowsum(dO * O) from the rounded O missed the delta of peaked rows; under
    # ds_split the delta is now rowsum(p dp) at every length (backward.exact_delta_keys). 674 keys
    # under the interpreter: here at the same logits and dims with 160 keys.
    pytest.importorskip("triton")
    from adaattn.backends.reference import reference_attention, relative_errors
    from adaattn import settings

    g = torch.Generator().manual_seed(16237)
    n = 160
    q = torch.randn(1, 2, n, 128, generator=g, dtype=torch.float64) * 30
    k = torch.randn(1, 1, n, 128, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, n, 16, generator=g, dtype=torch.float64)
    go = torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64)
    t16 = [x.bfloat16().requires_grad_() for x in (q, k, v)]
    t64 = [x.bfloat16().double().requires_grad_() for x in (q, k, v)]
    exact = torch.autograd.grad(reference_attention(*t64, is_causal=True), t64, go)
    leaves = [t.detach().requires_grad_() for t in t16]
    math_grads = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
        *leaves, is_causal=True, enable_gqa=True), leaves, go.bfloat16())
    with settings.override(ds_split="on"):
        out = adaattn.attention(*t16, is_causal=True, enable_gqa=True, policy=adaattn.Policy(backends=("triton.ptr",)))
        ours = torch.autograd.grad(out, t16, go.bfloat16())
    for name, a, b, r in zip(("dq", "dk", "dv"), ours, math_grads, exact):
        # math's error to 0.1% with the exact delta; 2.1-2.7x with rowsum(dO * O) (dq, dk)
        e_ours, e_math = relative_errors(a, r).item(), relative_errors(b, r).item()
        assert e_ours <= 1.25 * e_math + 1e-6, (name, e_ours, e_math)


@INTERPRETED
def test_triton_float32_forward_on_low_rows_meets_the_standard():
    # seed 5840 #511, 1,000 interpreted configurations (session 43, at a2025e6): float32, GQA 2/1,
    # Nq=Nk=2, D=64, window (0, 1), a transposed float32 (1, 2, 2, 2) mask of -1e4 with dead rows, no
    # gradients: out 5.0e-5 against torch's 2.2e-5. At |mask| ~ 1e4 fp32 keeps a score to ~1e-3,
    # torch's rounding and ours alike; which is closer is luck. The kernels now carry the sum's
    # residual (apply_masks_lo): out 7e-7.
    pytest.importorskip("triton")
    result = check(draw(5840, 511, "cpu", "triton"), "cpu")
    assert result["status"] == "ok", result.get("why")


@INTERPRETED
def test_triton_half_dv_where_torch_runs_math_meets_the_standard():
    # seed 5837 #170, 1,000 interpreted configurations (session 42, at e886178): float16, Nq=1, Nk=6,
    # D=128, Dv=40, a bool (3, 1, 1, 6) mask, under gradients: dv 2.9e-4 against torch's math 1.1e-4
    # (out, dq, dk equal to torch's). The dv product takes p rounded to float16 (FA2 and cuDNN do);
    # math keeps it in float32. Under ds_split p now has two roundings for dv as ds has for dk, dq.
    pytest.importorskip("triton")
    result = check(draw(5837, 170, "cpu", "triton"), "cpu")
    assert result["status"] == "ok", result.get("why")


@INTERPRETED
def test_triton_half_gradients_at_scores_of_hundreds_meet_the_standard():
    # seed 5832 #382, 1,000 interpreted configurations (session 42): float16, D=112, Dv=16, Nq=Nk=36,
    # no mask, scores to +-800, every row peaked (max p >= 0.9985). dq/dk were 0.13/0.12 against
    # torch's math 2.6e-11/2.8e-4: p recomputed to ~1e-4 at such scores left rowsum(p) off 1, and a
    # peaked row's dp_1 - delta carried dp_1 (1 - rowsum(p)). The exact delta is now divided by
    # rowsum(p) (kernels/attention_bwd.py, exact_delta).
    pytest.importorskip("triton")
    result = check(draw(5832, 382, "cpu", "triton"), "cpu")
    assert result["status"] == "ok", result.get("why")


@INTERPRETED
@pytest.mark.parametrize("index", [46, 652, 746, 905])
def test_triton_float32_gradients_at_large_logits_meet_the_standard(index):
    # seed 20261128, 1,000 interpreted configurations: float32 gradients at logits x30-100 were
    # 5-18x torch's math error: the backward recomputed p from a float32 lse, which keeps log2(sum)
    # only to 2^-17 of the row max. float32 now saves and reads the split row statistics.
    pytest.importorskip("triton")
    result = check(draw(20261128, index, "cpu", "triton"), "cpu")
    assert result["status"] == "ok", result.get("why")


def test_a_configuration_is_the_same_from_its_seed_and_index():
    assert draw(3, 17, "cpu") == draw(3, 17, "cpu")
    assert draw(3, 17, "cpu") != draw(3, 18, "cpu")


def test_only_prints_the_result_and_fails_on_a_finding(capsys, monkeypatch):
    import fuzz.sdpa as sdpa

    assert main(["--device", "cpu", "--seed", "1", "--only", "4"]) == 0
    assert '"status": "ok"' in capsys.readouterr().out
    import adaattn

    real = adaattn.attention
    monkeypatch.setattr(adaattn, "attention", lambda *a, **k: real(*a, **k) * 1.5)  # a 50% error
    index = next(i for i in range(50) if draw(1, i, "cpu").q_len > 0 and draw(1, i, "cpu").kv_len > 0
                 and draw(1, i, "cpu").mask == "none")
    assert main(["--device", "cpu", "--seed", "1", "--only", str(index)]) == 1
    assert "over the standard: out" in capsys.readouterr().out


@pytest.mark.parametrize("seed,index,max_len", [(101, 1888, 300), (4600, 39326, 64), (4600, 74206, 64),
                                               (4600, 91235, 64), (4700, 51284, 64), (5833, 64792, 300),
                                               (5910, 90046, 300)])
def test_configurations_the_cpu_fuzzer_found_meet_the_standard(seed, index, max_len):
    # (101, 1888): float16, causal at scale -0.5, gradients: torch's fused CPU kernel gives NaN
    # there, its math kernel 2.1e-4; ours ran the fused kernel on a folded mask (5.5e-4).
    # (4600, ...): a half-precision mask's gradient on 5-D calls, summed over its broadcast dims
    # in half precision after the call was flattened (2-8x torch's error).
    # (4700, 51284): float32, causal with a bool mask at scale -0.5: torch folds causal into the mask
    # and runs its fused kernel; ours ran math as for causal alone (dk 2.4x).
    # (5910, 90046): float16, a finfo.min row under causal at scale -0.5, logits x30: torch's fused
    # kernel gives NaN; on the shifted mask it was finite but dq 2.1x its math kernel's (3.6e-3).
    result = check(draw(seed, index, "cpu", max_len=max_len), "cpu")
    assert result["status"] == "ok", result.get("why")


@pytest.mark.parametrize("shape_q,shape_kv", [((2, 80), (2, 80)), ((10, 8), (3, 8)), ((3, 5, 16), (3, 7, 16)),
                                              ((2, 3, 4, 5, 16), (2, 3, 4, 6, 16))])
def test_cpu_calls_that_are_not_plain_4d_are_torchs_math_call_to_the_bit(shape_q, shape_kv):
    # seed 4600 #17340 and #97362 (100,000 CPU configurations): 2-D float32 calls flattened to 4-D
    # ran torch's math kernel on batched products, whose gradients were 3-5x torch's own on the 2-D
    # call; such calls now reach torch in their own rank.
    import adaattn

    g = torch.Generator().manual_seed(3)
    q = torch.randn(*shape_q, generator=g, requires_grad=True)
    k = torch.randn(*shape_kv, generator=g, requires_grad=True)
    v = torch.randn(*shape_kv, generator=g, requires_grad=True)
    grad = torch.randn(*shape_q[:-1], shape_kv[-1], generator=g)
    ours = adaattn.attention(q, k, v, scale=1.875)
    mine = torch.autograd.grad(ours, (q, k, v), grad)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.875)
    ref = torch.autograd.grad(theirs, (q, k, v), grad)
    assert torch.equal(ours, theirs)
    assert all(torch.equal(a, b) for a, b in zip(mine, ref))


def test_relative_errors_of_huge_values_do_not_overflow_to_infinity():
    """seed 5502 #62159: gradients of 1e277, ours equal to SDPA's, read as an infinite error because
    the norm of the difference overflowed float64."""
    from fuzz.sdpa import rel_err

    ref = torch.full((3, 4), 1e277, dtype=torch.float64)
    assert rel_err(ref.clone(), ref, 1.0) == 0.0
    assert abs(rel_err(ref * 1.5, ref, 1.0) - 0.5) < 1e-12


def test_half_gradients_where_torch_runs_math_run_math_first():
    """seed 5300 #7381 (H200): float16 GQA, a bool mask, scale -0.5, with gradients: none of torch's
    fused kernels takes it, so torch's answer is its math kernel's (float32 inside), and our Triton
    backward's dq was 2.1x its error. There sdpa.math runs first; elsewhere the order stands."""
    from adaattn import planner
    from adaattn.problem import Problem

    base = dict(batch=3, q_heads=4, kv_heads=1, q_len=983, kv_len=983, head_dim=128, value_dim=128,
                dtype=torch.float16, device_type="cuda", device_index=0, causal=False, window_left=-1,
                window_right=-1, mask_kind="bool", dropout_p=0.0, scale=-0.5, needs_grad=True, gqa=True,
                torch_fused=False)
    order = ["triton.ptr", "sdpa.math"]
    notes = []
    assert planner._math_where_torch_runs_math(Problem(**base), order, notes) == ["sdpa.math", "triton.ptr"]
    assert notes and "math kernel" in notes[0]
    for change in (dict(torch_fused=True), dict(dtype=torch.float32), dict(needs_grad=False), dict(device_type="cpu")):
        assert planner._math_where_torch_runs_math(Problem(**{**base, **change}), order, []) == order
    assert planner._math_where_torch_runs_math(Problem(**base), ["triton.ptr"], []) == ["triton.ptr"]
    # A training-sized call keeps its fused kernel: math's weights would be B x H x N^2 float32.
    big = Problem(**{**base, "q_len": 8192, "kv_len": 8192})
    assert planner._math_where_torch_runs_math(big, order, []) == order


def test_yardstick_where_torch_gives_no_finite_answer_is_math_at_the_input_dtype_unless_broken(monkeypatch):
    """Where torch's default is not finite the yardstick is its math kernel reduced in the input
    dtype (MEASURING.md's sdpa(inputs in T)); where that answer is itself broken (output error over
    HALF_MATH_SOUND: -1e4 biases swallow bfloat16 scores, seed 20261129 #132) math as it runs by
    default (float32 inside) is taken instead."""
    import fuzz.sdpa as fz
    from torch.nn.attention import SDPBackend

    config = next(c for c in (draw(5809, i, "cpu") for i in range(200))
                  if c.dtype == "bfloat16" and not c.modified and c.q_len and c.kv_len and c.mask == "none")
    inputs = fz.build(config, "cpu")
    original = fz.sdpa_yardstick

    def fake(config, q, k, v, mask, backend=None):
        out = original(config, q, k, v, mask, SDPBackend.MATH)
        if backend is None:
            return out * float("nan")  # torch's default: no finite answer
        return out * (3.0 if torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed() else 2.0)

    monkeypatch.setattr(fz, "sdpa_yardstick", fake)
    plain = original(config, inputs.q, inputs.k, inputs.v, inputs.mask, SDPBackend.MATH)
    sound, _ = fz._torch_side(config, inputs, fz._wrt(inputs, config), "cpu", judge=lambda out: 0.0)
    broken, _ = fz._torch_side(config, inputs, fz._wrt(inputs, config), "cpu", judge=lambda out: 1.0)
    assert torch.allclose(sound, 3.0 * plain) and torch.allclose(broken, 2.0 * plain)
    assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()  # the flag is put back
