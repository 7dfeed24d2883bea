"""Every bad input raises a ValueError/TypeError naming the argument, what it got and what is allowed."""

from __future__ import annotations

import pytest
import torch

import adaattn
from adaattn import Policy


def qkv(b=2, hq=4, hk=4, nq=8, nk=8, d=16, dtype=torch.float32):
    return torch.randn(b, hq, nq, d, dtype=dtype), torch.randn(b, hk, nk, d, dtype=dtype), torch.randn(b, hk, nk, d, dtype=dtype)


CASES = [
    ("wrong rank", lambda: adaattn.attention(torch.randn(16), *qkv()[1:]), ValueError,
     r"query must be at least 2-D \(..., seq, head_dim\), got 1-D shape \(16,\)"),
    ("not a tensor", lambda: adaattn.attention([1.0], *qkv()[1:]), TypeError, r"query must be a torch.Tensor, got list"),
    ("batch mismatch", lambda: adaattn.attention(qkv(b=2)[0], *qkv(b=3)[1:]), ValueError,
     r"query, key and value batch dimensions \(2, 4\), \(3, 4\), \(3, 4\) do not broadcast"),
    ("head dim mismatch", lambda: adaattn.attention(qkv(d=16)[0], *qkv(d=32)[1:]), ValueError,
     r"key head_dim must equal query head_dim 16, got 32"),
    ("kv length mismatch", lambda: adaattn.attention(qkv()[0], qkv(nk=8)[1], qkv(nk=9)[2]), ValueError,
     r"value seq length must equal key seq length 8, got 9"),
    ("heads differ without gqa", lambda: adaattn.attention(*qkv(hq=4, hk=2)), ValueError,
     r"key/value heads \(2\) differ from query heads \(4\); pass enable_gqa=True"),
    ("heads not divisible", lambda: adaattn.attention(*qkv(hq=4, hk=3), enable_gqa=True), ValueError,
     r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
    ("dtype mismatch", lambda: adaattn.attention(qkv()[0].half(), *qkv()[1:]), TypeError,
     r"must share one dtype, got torch.float16, torch.float32, torch.float32"),
    ("integer dtype", lambda: adaattn.attention(*(t.long() for t in qkv())), TypeError,
     r"query must have a floating dtype \(float16, bfloat16, float32, float64\), got torch.int64"),
    ("device mismatch", lambda: adaattn.attention(qkv()[0].to("meta"), *qkv()[1:]), ValueError,
     r"must be on one device, got meta, cpu, cpu"),
    ("mask not broadcastable", lambda: adaattn.attention(*qkv(), attn_mask=torch.ones(3, 8, dtype=torch.bool)), ValueError,
     r"attn_mask of shape \(3, 8\) does not broadcast to \(..., heads, q_len, k_len\) = \(2, 4, 8, 8\)"),
    ("mask dtype", lambda: adaattn.attention(*qkv(), attn_mask=torch.ones(8, 8, dtype=torch.int32)), TypeError,
     r"attn_mask must be bool, float32 or the query dtype torch.float32, got torch.int32"),
    ("mask type", lambda: adaattn.attention(*qkv(), attn_mask=[[True]]), TypeError,
     r"attn_mask must be a torch.Tensor or None, got list"),
    ("bad layout", lambda: adaattn.attention(*qkv(), layout="sbhd"), ValueError,
     r"layout must be one of \('bhsd', 'bshd'\), got 'sbhd'"),
    ("bad window", lambda: adaattn.attention(*qkv(), window=(-1, 3)), ValueError,
     r"window must be None or a pair \(left, right\) of non-negative ints or None .* got \(-1, 3\)"),
    ("window not a pair", lambda: adaattn.attention(*qkv(), window=5), ValueError, r"window must be None or a pair.*got 5"),
    ("scale type", lambda: adaattn.attention(*qkv(), scale="0.1"), TypeError,
     r"scale must be a float or None \(a Python or NumPy int or float, or a 0-d tensor, as SDPA takes\), got str$"),
    ("scale value", lambda: adaattn.attention(*qkv(), scale=float("nan")), ValueError,
     r"scale must be a finite float or None, got nan"),
    ("dropout value", lambda: adaattn.attention(*qkv(), dropout_p=1.5), ValueError, r"dropout_p must be in \[0, 1\], got 1.5"),
    ("dropout type", lambda: adaattn.attention(*qkv(), dropout_p="0.1"), TypeError,
     r"dropout_p must be a float in \[0, 1\] \(a Python or NumPy int or float, or a 0-d tensor, as SDPA takes\), got str$"),
    ("scale 1-element tensor", lambda: adaattn.attention(*qkv(), scale=torch.tensor([0.1])), TypeError,
     r"^scale must be a float or None \(a Python or NumPy int or float, or a 0-d tensor, as SDPA takes\), "
     r"got a tensor of shape \(1,\)$"),
    ("scale 0-d tensor value", lambda: adaattn.attention(*qkv(), scale=torch.tensor(float("inf"))), ValueError,
     r"^scale must be a finite float or None, got inf$"),
    ("dropout tensor requiring grad", lambda: adaattn.attention(*qkv(), dropout_p=torch.tensor(0.1, requires_grad=True)),
     TypeError, r"^dropout_p must be a float in \[0, 1\] \(a Python or NumPy int or float, or a 0-d tensor, as SDPA "
     r"takes\), got a tensor that requires grad$"),
    ("dropout 0-d tensor value", lambda: adaattn.attention(*qkv(), dropout_p=torch.tensor(1.5)), ValueError,
     r"^dropout_p must be in \[0, 1\], got 1.5$"),
    ("is_causal type", lambda: adaattn.attention(*qkv(), is_causal=1), TypeError, r"is_causal must be a bool, got int"),
    ("enable_gqa type", lambda: adaattn.attention(*qkv(), enable_gqa="yes"), TypeError, r"enable_gqa must be a bool, got str"),
    ("policy type", lambda: adaattn.attention(*qkv(), policy="auto"), TypeError,
     r"policy must be an adaattn.Policy or None, got str"),
    ("bshd rank", lambda: adaattn.attention(torch.randn(8, 16), *qkv()[1:], layout="bshd"), ValueError,
     r"query must be at least 3-D \(..., seq, heads, head_dim\) for layout='bshd'"),
]


@pytest.mark.parametrize("name,call,error,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(name, call, error, message):
    with pytest.raises(error, match=message):
        call()


POLICY_CASES = [
    (dict(mode="fast"), ValueError, r"Policy.mode must be one of \('exact', 'auto'\), got 'fast'"),
    (dict(tolerance=0), ValueError, r"^Policy.tolerance must be in \(0, 1\) \(a relative error, exclusive\), got 0$"),
    (dict(tolerance=2), ValueError, r"^Policy.tolerance must be in \(0, 1\) \(a relative error, exclusive\), got 2$"),
    (dict(tolerance=1.0), ValueError, r"^Policy.tolerance must be in \(0, 1\) \(a relative error, exclusive\), got 1.0$"),
    (dict(mode="auto", tolerance=float("nan")), ValueError, r"^Policy.tolerance must be in \(0, 1\) .*, got nan$"),
    (dict(tolerance=-1e-3), ValueError, r"^Policy.tolerance must be in \(0, 1\) .*, got -0.001$"),
    (dict(tolerance="1e-2"), TypeError, r"Policy.tolerance must be a float, got str"),
    (dict(mode="auto", precisions=("int4",)), ValueError, r"Policy.precisions entries must be from \('native', 'int8', 'fp8'\), got 'int4'"),
    (dict(mode="auto", approximations=("prune",)), ValueError, r"Policy.approximations entries must be from \('lowrank', 'skip'\), got 'prune'"),
    (dict(precisions=("int8",)), ValueError, r"Policy\(mode='exact'\) allows only precisions=\('native',\)"),
    (dict(verify=2.0), ValueError, r"Policy.verify must be a fraction in \[0, 1\], got 2.0"),
    (dict(verify="often"), TypeError, r"Policy.verify must be a float in \[0, 1\], got str"),
    (dict(backends=()), ValueError, r"Policy.backends must name at least one backend"),
    (dict(backends=(1,)), TypeError, r"Policy.backends must be None or a tuple of backend names, got \(1,\)"),
    (dict(deterministic="yes"), TypeError, r"Policy.deterministic must be a bool, got str"),
]


@pytest.mark.parametrize("kwargs,error,message", POLICY_CASES, ids=[str(c[0]) for c in POLICY_CASES])
def test_bad_policy_raises_on_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        Policy(**kwargs)


def test_policy_tolerance_takes_any_value_inside_zero_one():
    for tol in (1e-9, 0.5, 0.999, 1 - 1e-12):
        assert Policy(mode="auto", tolerance=tol).tolerance == tol


def test_policy_accepts_auto_and_a_single_backend_name():
    p = Policy(mode="auto", precisions=("native", "int8"), approximations=("skip",), backends="sdpa")
    assert p.backends == ("sdpa",)
    assert p.admits("sdpa.cpu") and p.admits("sdpa") and not p.admits("sdpa2") and not p.admits("reference")


def test_backend_restriction_naming_no_backend_lists_reasons():
    q, k, v = qkv()
    with pytest.raises(adaattn.NoBackendError, match=r"no runner can run .*\n  .*sdpa.cpu: excluded by Policy.backends"):
        adaattn.attention(q, k, v, policy=Policy(backends=("sdpa.cudnn",)))


def test_unknown_runner_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"Policy.backends names unknown runners \['nonexistent'\]; known: .*sdpa.cpu"):
        Policy(backends=("nonexistent",))
    assert Policy(backends=("sdpa", "triton")).backends == ("sdpa", "triton")


def test_a_repeated_call_is_still_validated_when_its_arguments_change_type():
    q, k, v = qkv()
    adaattn.attention(q, k, v, is_causal=True)  # cached signature
    with pytest.raises(TypeError, match="is_causal must be a bool, got int"):
        adaattn.attention(q, k, v, is_causal=1)
    adaattn.attention(q, k, v, dropout_p=0.0)
    with pytest.raises(TypeError, match="dropout_p must be a float"):
        adaattn.attention(q, k, v, dropout_p="0.0")


def test_a_repeated_call_checks_window_element_types():
    q, k, v = qkv()
    adaattn.attention(q, k, v, window=(1, 2))
    with pytest.raises(ValueError, match="window must be None or a pair"):
        adaattn.attention(q, k, v, window=(True, 2))
