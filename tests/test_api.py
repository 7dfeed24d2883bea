"""attention() against the float64 reference and against torch SDPA, on CPU."""

from __future__ import annotations

import decimal
import fractions
import gc
import threading
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import adaattn
from adaattn import planner, stats
from adaattn.planner import REGISTRY
from adaattn.backends.base import Backend
from adaattn.backends.reference import reference_attention
from adaattn.problem import SEQ_BUCKETS

from helpers import NEEDS_CUDA_OR_INTERPRETER, assert_within_standard, rel_err, sdpa_equivalent

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Broadcast patterns for a (B, H, Nq, Nk) mask: which leading dims are kept (1 = broadcast).
MASK_SHAPES = ["bhqk", "b1qk", "1hqk", "qk", "11qk", "b11k", "1qk"]


def _mask_shape(pattern, b, h, nq, nk):
    sizes = {"b": b, "h": h, "q": nq, "k": nk, "1": 1}
    return tuple(sizes[c] for c in pattern)


@st.composite
def problems(draw):
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    hq = hkv * groups
    nq = draw(st.integers(0, 40))
    nk = draw(st.integers(0, 40))
    d = draw(st.sampled_from([8, 16, 24, 32, 64]))
    dv = draw(st.sampled_from([d, d, 16]))
    dtype = draw(st.sampled_from(DTYPES))
    mask_kind = draw(st.sampled_from(["none", "bool", "additive"]))
    mask_pattern = draw(st.sampled_from(MASK_SHAPES))
    causal = draw(st.booleans())
    window = draw(
        st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 8)), st.one_of(st.none(), st.integers(0, 8))))
    )
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(b=b, hkv=hkv, hq=hq, nq=nq, nk=nk, d=d, dv=dv, dtype=dtype, mask_kind=mask_kind,
                mask_pattern=mask_pattern, causal=causal, window=window, layout=layout, scale=scale, seed=seed)


def _inputs(p):
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(p["b"], p["hq"], p["nq"], p["d"], generator=g).to(p["dtype"])
    k = torch.randn(p["b"], p["hkv"], p["nk"], p["d"], generator=g).to(p["dtype"])
    v = torch.randn(p["b"], p["hkv"], p["nk"], p["dv"], generator=g).to(p["dtype"])
    mask = None
    shape = _mask_shape(p["mask_pattern"], p["b"], p["hq"], p["nq"], p["nk"])
    if p["mask_kind"] == "bool":
        mask = torch.rand(shape, generator=g) > 0.3
    elif p["mask_kind"] == "additive":
        mask = (torch.randn(shape, generator=g) * 2).to(p["dtype"])
        mask = mask.masked_fill(torch.rand(shape, generator=g) < 0.2, float("-inf"))
    return q, k, v, mask


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_attention_matches_reference_and_sdpa_on_random_problems(p):
    q, k, v, mask = _inputs(p)
    gqa = p["hq"] != p["hkv"]
    if p["layout"] == "bshd":
        args = (q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
    else:
        args = (q, k, v)
    out = adaattn.attention(*args, attn_mask=mask, is_causal=p["causal"], scale=p["scale"],
                            enable_gqa=gqa, layout=p["layout"], window=p["window"])
    if p["layout"] == "bshd":
        out = out.transpose(1, 2)
    assert out.shape == (p["b"], p["hq"], p["nq"], p["dv"])
    assert out.dtype == p["dtype"]
    ref = reference_attention(q, k, v, mask, p["causal"], p["scale"], p["window"])
    theirs = sdpa_equivalent(q, k, v, mask, p["causal"], p["scale"], p["window"], enable_gqa=gqa)
    assert_within_standard(out, ref, theirs)
    # Same kernel underneath on CPU: agreement with SDPA is tight, not just within the standard.
    tol = 1e-6 if p["dtype"] == torch.float32 else 1e-2
    assert rel_err(out, theirs) <= tol


def test_reference_gives_zero_rows_where_everything_is_masked():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False
    out = adaattn.attention(q, k, v, attn_mask=mask)
    assert torch.all(out[:, :, 2] == 0)
    ref = reference_attention(q, k, v, mask)
    assert torch.all(ref[:, :, 2] == 0)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("nq,nk", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences_match_sdpa(nq, nk):
    q, k, v = torch.randn(2, 3, nq, 16), torch.randn(2, 3, nk, 16), torch.randn(2, 3, nk, 16)
    out = adaattn.attention(q, k, v)
    theirs = F.scaled_dot_product_attention(q, k, v)
    assert out.shape == theirs.shape == (2, 3, nq, 16)
    assert torch.equal(out, theirs)


def test_dropout_matches_sdpa_under_the_same_seed():
    q, k, v = torch.randn(2, 4, 33, 16), torch.randn(2, 4, 40, 16), torch.randn(2, 4, 40, 16)
    torch.manual_seed(7)
    ours = adaattn.attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    theirs = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert torch.equal(ours, theirs)
    assert not torch.allclose(ours, adaattn.attention(q, k, v))


# What torch's SDPA takes for scale and dropout_p (torch 2.13): Python and NumPy numbers (bools
# too) and 0-d tensors of any real dtype that do not require grad; it refuses one-element tensors
# of more dims, NumPy arrays (0-d too), a tensor that requires grad, str, Fraction and Decimal.
SDPA_SCALES = [
    ("float", lambda: 0.5), ("int", lambda: 2), ("bool", lambda: True), ("numpy float32", lambda: np.float32(0.5)),
    ("numpy float64", lambda: np.float64(0.5)), ("numpy int64", lambda: np.int64(2)), ("numpy bool", lambda: np.bool_(True)),
    ("0-d float32", lambda: torch.tensor(0.5)), ("0-d float64", lambda: torch.tensor(0.5, dtype=torch.float64)),
    ("0-d bfloat16", lambda: torch.tensor(0.5, dtype=torch.bfloat16)), ("0-d int64", lambda: torch.tensor(2)),
    ("0-d bool", lambda: torch.tensor(True)), ("0-d detached", lambda: torch.tensor(0.5, requires_grad=True).detach()),
]
SDPA_REFUSES = [
    ("1-element 1-d", lambda: torch.tensor([0.5])), ("1-element 2-d", lambda: torch.tensor([[0.5]])),
    ("0-d numpy array", lambda: np.array(0.5)), ("1-d numpy array", lambda: np.array([0.5])),
    ("requires grad", lambda: torch.tensor(0.5, requires_grad=True)), ("str", lambda: "0.5"),
    ("Fraction", lambda: fractions.Fraction(1, 2)), ("Decimal", lambda: decimal.Decimal("0.5")), ("complex", lambda: 0.5j),
]


@pytest.mark.parametrize("name,make", SDPA_SCALES, ids=[c[0] for c in SDPA_SCALES])
def test_scale_and_dropout_take_what_sdpa_takes(name, make):
    q, k, v = torch.randn(2, 4, 33, 16), torch.randn(2, 4, 40, 16), torch.randn(2, 4, 40, 16)  # default scale 0.25
    ours = adaattn.attention(q, k, v, scale=make())
    assert torch.equal(ours, F.scaled_dot_product_attention(q, k, v, scale=make()))
    assert not torch.allclose(ours, adaattn.attention(q, k, v))  # the scale was applied
    p = make() * 0.3  # (the same type: 0.6 for the ints, 0.3 for the bools)
    torch.manual_seed(7)
    ours = adaattn.attention(q, k, v, dropout_p=p)
    torch.manual_seed(7)
    assert torch.equal(ours, F.scaled_dot_product_attention(q, k, v, dropout_p=p))
    assert not torch.allclose(ours, adaattn.attention(q, k, v))


@pytest.mark.parametrize("name,make", SDPA_REFUSES, ids=[c[0] for c in SDPA_REFUSES])
def test_scale_and_dropout_refuse_what_sdpa_refuses(name, make):
    q = torch.randn(1, 2, 4, 8)
    for arg in ("scale", "dropout_p"):
        with pytest.raises(TypeError):
            F.scaled_dot_product_attention(q, q, q, **{arg: make()})
        with pytest.raises(TypeError, match=f"^{arg} must be a float"):
            adaattn.attention(q, q, q, **{arg: make()})
    with pytest.raises(TypeError, match="^scale must be a float"):
        adaattn.varlen_attention(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1),
                                 torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4, scale=make())


def test_a_tensor_scale_is_read_once_at_the_entry_and_kept_out_of_the_plan_cache():
    q, k, v = torch.randn(2, 4, 33, 16), torch.randn(2, 4, 40, 16), torch.randn(2, 4, 40, 16)
    want = adaattn.attention(q, k, v, scale=0.5)
    s = torch.tensor(0.5)
    gone = weakref.ref(s)
    for _ in range(3):  # each call a new tensor: one signature, that of scale=0.5
        assert torch.equal(adaattn.attention(q, k, v, scale=torch.tensor(0.5), dropout_p=torch.tensor(0.0)), want)
    assert torch.equal(adaattn.attention(q, k, v, scale=s, dropout_p=torch.tensor(0)), want)
    assert len(planner._calls) == 1
    assert not any(isinstance(x, torch.Tensor) for sig in planner._calls for x in sig)
    del s
    gc.collect()
    assert gone() is None  # the cache holds no reference to the caller's tensor


def test_varlen_attention_takes_a_tensor_scale():
    torch.manual_seed(3)
    q, k, v = torch.randn(20, 2, 16), torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    want = adaattn.varlen_attention(q, k, v, cu, cu, 13, 13, scale=0.5)
    assert not torch.allclose(want, adaattn.varlen_attention(q, k, v, cu, cu, 13, 13))
    for scale in (torch.tensor(0.5), np.float32(0.5), torch.tensor(0.5, dtype=torch.float64)):
        assert torch.equal(adaattn.varlen_attention(q, k, v, cu, cu, 13, 13, scale=scale), want)


def test_causal_is_top_left_for_unequal_lengths():
    q, k, v = torch.randn(1, 2, 7, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    out = adaattn.attention(q, k, v, is_causal=True)
    ref = reference_attention(q, k, v, is_causal=True)
    assert rel_err(out, ref) < 1e-6
    # Top-left: query 0 sees key 0 only.
    assert torch.allclose(out[:, :, 0], v[:, :, 0], atol=1e-6)


def test_causal_combines_with_a_mask():
    q, k, v = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    mask = torch.rand(9, 9) > 0.2
    out = adaattn.attention(q, k, v, attn_mask=mask, is_causal=True)
    ref = reference_attention(q, k, v, mask, is_causal=True)
    assert rel_err(out, ref) < 1e-6


def test_bshd_layout_passes_views_without_copying(monkeypatch):
    seen = {}
    real = REGISTRY["sdpa.cpu"]

    class Spy(Backend):
        name = "sdpa.cpu"

        def supports(self, problem, policy):
            return real.supports(problem, policy)

        def run(self, q, k, v, attn_mask, problem, launch, label=None):
            seen["ptrs"] = (q.data_ptr(), k.data_ptr(), v.data_ptr())
            seen["shape"] = tuple(q.shape)
            return real.run(q, k, v, attn_mask, problem, launch)

    monkeypatch.setitem(REGISTRY, "sdpa.cpu", Spy())
    q, k, v = torch.randn(2, 11, 4, 16), torch.randn(2, 13, 4, 16), torch.randn(2, 13, 4, 16)
    out = adaattn.attention(q, k, v, layout="bshd")
    assert seen["ptrs"] == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert seen["shape"] == (2, 4, 11, 16)
    assert out.shape == (2, 11, 4, 16)
    theirs = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert torch.allclose(out, theirs.transpose(1, 2), atol=1e-6)


def test_gradients_match_reference():
    q = torch.randn(2, 4, 19, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 23, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 23, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(19, 23) > 0.1
    go = torch.randn(2, 4, 19, 16, dtype=torch.float64)
    out = adaattn.attention(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True, window=(5, 2))
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref = reference_attention(q, k, v, mask, True, None, (5, 2))
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-10


def test_policy_can_restrict_to_the_reference_backend():
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    with stats.collect() as recs:
        out = adaattn.attention(q, k, v, policy=adaattn.Policy(backends=("reference",)))
    assert recs[-1].backend == "reference"
    assert rel_err(out, reference_attention(q, k, v)) < 1e-6


def test_unsatisfiable_backend_restriction_lists_every_reason():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(adaattn.NoBackendError) as e:
        adaattn.attention(q, q, q, policy=adaattn.Policy(backends=("sdpa.cudnn",)))
    msg = str(e.value)
    assert "sdpa.cudnn: runs on cuda tensors only" in msg
    assert "sdpa.cpu:" in msg and "excluded by Policy.backends" in msg


class _Broken(Backend):
    name = "broken"

    def __init__(self, error):
        self.error = error
        self.calls = 0

    def supports(self, problem, policy):
        return []

    def run(self, *args):
        self.calls += 1
        raise self.error


def _put_first(monkeypatch, backend):
    monkeypatch.setitem(REGISTRY, backend.name, backend)
    monkeypatch.setattr(planner, "PRIORITY_RULES", [{"device": "cpu", "order": [backend.name, "sdpa.cpu"]}])


def test_backend_failing_at_run_time_falls_back_with_one_warning(monkeypatch):
    broken = _Broken(RuntimeError("compile error in kernel"))
    _put_first(monkeypatch, broken)
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.warns(RuntimeWarning, match="runner broken failed") as caught:
        with stats.collect() as recs:
            outs = [adaattn.attention(q, k, v) for _ in range(3)]
    assert len([w for w in caught if "broken" in str(w.message)]) == 1
    assert broken.calls == 1  # remembered as failed for this problem class
    for out in outs:
        assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    assert [r.backend for r in recs] == ["sdpa.cpu"] * 3
    assert recs[0].fallbacks == ("broken",)
    assert "failed at run time earlier" in str(adaattn.explain(q, k, v))


def test_out_of_memory_is_reraised_with_the_sizes(monkeypatch):
    _put_first(monkeypatch, _Broken(torch.OutOfMemoryError("CUDA out of memory")))
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(torch.OutOfMemoryError, match=r"runner broken .*Nq=8 Nk=8 D=16"):
        adaattn.attention(q, q, q)


def test_explain_lists_every_backend_and_the_choice():
    q = torch.randn(1, 2, 8, 16)
    text = str(adaattn.explain(q, q, q, policy=adaattn.Policy(mode="auto")))
    for name in REGISTRY:
        assert name in text
    assert "chosen: sdpa.cpu" in text
    assert "mode='auto'" in text and "runs exact" in text


def test_explain_gives_the_priority_list_that_applies_as_data():
    q = torch.randn(1, 2, 8, 16)
    exp = adaattn.explain(q, q, q, is_causal=True)
    assert exp.as_dict()["priority"] == ["sdpa.cpu"] and exp.priority() == ((), ("sdpa.cpu",), ())
    assert "\npriority (cpu/cpu, short sequences): sdpa.cpu\n" in str(exp)
    named = adaattn.explain(q, q, q, policy=adaattn.Policy(backends=("reference", "sdpa.cpu")))
    assert named.as_dict()["priority"] == ["sdpa.cpu", "reference"]


def test_stats_off_records_nothing_and_on_records_each_call():
    stats.disable()
    stats.clear()
    q = torch.randn(1, 2, 8, 16)
    adaattn.attention(q, q, q)
    assert stats.records() == []
    with stats.collect(timing=True) as recs:
        adaattn.attention(q, q, q, is_causal=True, label="layer0")
    assert len(recs) == 1
    r = recs[0]
    assert (r.backend, r.label, r.dtype) == ("sdpa.cpu", "layer0", "float32")
    assert "Nq=8" in r.shape and r.wall_ms is not None and r.wall_ms >= 0
    assert "sdpa.cpu" in stats.summary(recs)
    assert not stats.enabled


def test_stats_are_thread_safe():
    q = torch.randn(1, 1, 4, 8)
    with stats.collect() as recs:
        threads = [threading.Thread(target=lambda: [adaattn.attention(q, q, q) for _ in range(50)]) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(recs) == 200


def test_seq_buckets_are_few_and_ordered():
    limits = [lim for lim, _ in SEQ_BUCKETS]
    assert limits == sorted(limits) and len(SEQ_BUCKETS) <= 4


def test_collect_keeps_its_records_when_the_buffer_trims_and_blocks_overlap():
    q = torch.randn(1, 1, 4, 8)
    stats.enable(limit=8)
    try:
        for _ in range(7):
            adaattn.attention(q, q, q)
        with stats.collect() as outer:
            with stats.collect() as inner:
                for _ in range(4):
                    adaattn.attention(q, q, q)
            adaattn.attention(q, q, q)
            assert stats.enabled
    finally:
        stats.disable()
        stats.clear()
    assert len(inner) == 4 and len(outer) == 5
    assert not stats.enabled


def test_cached_plan_is_not_reused_across_equal_and_unequal_lengths(monkeypatch):
    class SquareOnly(Backend):
        name = "square_only"

        def supports(self, problem, policy):
            return ["needs q_len == k_len"] if problem.q_len != problem.kv_len else []

        def run(self, q, k, v, attn_mask, problem, launch, label=None):
            return REGISTRY["sdpa.cpu"].run(q, k, v, attn_mask, problem, launch)

    _put_first(monkeypatch, SquareOnly())
    q, k = torch.randn(1, 2, 30, 16), torch.randn(1, 2, 40, 16)
    with stats.collect() as recs:
        adaattn.attention(q, q, q, is_causal=True)
        adaattn.attention(q, k, k, is_causal=True)
        adaattn.attention(q[:, :, :0], k, k, is_causal=True)
    # An empty query is answered before any runner (attention's no-keys rule: zeros in its own shape).
    assert [r.backend for r in recs] == ["square_only", "sdpa.cpu", "none (no keys)"]


def test_the_last_backend_failing_raises_and_is_not_marked_failed(monkeypatch):
    calls = {"n": 0}
    real = REGISTRY["sdpa.cpu"]

    class Flaky(Backend):
        name = "sdpa.cpu"

        def supports(self, problem, policy):
            return real.supports(problem, policy)

        def run(self, *args):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("transient failure")
            return real.run(*args)

    monkeypatch.setitem(REGISTRY, "sdpa.cpu", Flaky())
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="transient failure"):
        adaattn.attention(q, q, q)
    assert torch.equal(adaattn.attention(q, q, q), F.scaled_dot_product_attention(q, q, q))


def test_cpu_allocation_failure_is_reported_as_out_of_memory(monkeypatch):
    _put_first(monkeypatch, _Broken(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate")))
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(torch.OutOfMemoryError, match=r"runner broken .*Nq=8"):
        adaattn.attention(q, q, q)


def test_position_keep_aligns_bottom_right_for_a_kv_cache():
    from adaattn.backends.masks import position_keep

    from helpers import keep_mask

    top = position_keep(3, 7, True, (2, None), torch.device("cpu"))
    assert torch.equal(top, keep_mask(3, 7, True, (2, None)))
    bottom = position_keep(3, 7, True, (2, None), torch.device("cpu"), bottom_right=True)
    # Query i sits at position i + 4: it sees keys i+2 .. i+4.
    expected = torch.tensor([[j in range(i + 2, i + 5) for j in range(7)] for i in range(3)])
    assert torch.equal(bottom, expected)


def test_priority_data_puts_cudnn_first_for_masks_and_triton_for_windows():
    import dataclasses

    from adaattn import planner
    from adaattn.problem import validate

    q = torch.randn(1, 2, 1024, 64, dtype=torch.bfloat16)
    base = dataclasses.replace(validate(q, q, q, None, 0.0, False, None, False, "bhsd", None),
                               device_type="cuda", device_index=0)
    cases = [
        (dict(mask_kind="bool"), "sdpa.cudnn"),  # torch 2.11's cuDNN takes masks, faster than ours (H200)
        (dict(mask_kind="additive"), "sdpa.cudnn"),
        (dict(window_left=128, window_right=0), "triton.ws"),  # triton.ptr next, where triton.ws declines
        ({}, "sdpa.cudnn"),  # unmasked prefill: cuDNN measured fastest
        (dict(mask_kind="bool", q_len=64, kv_len=64), "sdpa.cudnn"),  # short: SDPA's order
        (dict(dtype=torch.float32, mask_kind="bool"), "sdpa.efficient"),
    ]
    for change, first in cases:
        assert planner.priority(dataclasses.replace(base, **change), "sm90")[0] == first, change


def test_a_mask_that_requires_grad_gets_its_gradient_and_our_kernels_decline_it():
    from adaattn.problem import validate

    q = torch.randn(1, 2, 16, 64)
    bias = torch.zeros(1, 1, 16, 16, requires_grad=True)
    problem = validate(q, q, q, bias, 0.0, False, None, False, "bhsd", None)
    assert problem.mask_grad and problem.needs_grad
    for name in ("triton.ptr", "triton.quant.general"):
        if name in REGISTRY:
            assert any("requires grad" in r for r in REGISTRY[name].supports(problem, adaattn.Policy())), name
    adaattn.attention(q, q, q, attn_mask=bias.detach())  # cached signature without the grad
    out = adaattn.attention(q, q, q, attn_mask=bias)
    out.sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0


@NEEDS_CUDA_OR_INTERPRETER
def test_calls_of_one_shape_class_with_other_scales_and_windows_each_get_their_own_launch():
    """A plan's launch descriptions bake in the scale and window sides: two calls of one shape
    class that differ only there must not share a plan (found by fuzzing: a scale=0 call's plan
    ran a later scale=-0.5 call)."""
    torch.manual_seed(4)
    q, k = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    policy = adaattn.Policy(backends=("triton",))
    for kwargs in (dict(scale=0.0), dict(scale=-0.5), dict(scale=0.3), dict(window=(4, 0)), dict(window=(9, 2)),
                   dict(window=(9, 2), is_causal=True)):
        ours = adaattn.attention(q, k, k, policy=policy, **kwargs)
        ref = reference_attention(q, k, k, None, kwargs.get("is_causal", False), kwargs.get("scale"),
                                  kwargs.get("window"))
        assert rel_err(ours, ref) < 1e-5, kwargs
