"""adaattn.attention takes everything torch.nn.functional.scaled_dot_product_attention takes, with
the same result (issue 13). Each test compares against SDPA on the same fresh random inputs and
holds the output to MEASURING.md's standard (reference: SDPA on the inputs in float64).

SDPA's behaviour on this torch (2.13, CPU), probed before writing these tests:
- inputs of any rank >= 2, (..., L, E): 2-D (L, E), 3-D (H, L, E), 5-D and 6-D all run; 1-D raises.
- leading dims broadcast between query and key/value: K/V batch 1 against Q batch B, Q batch 1
  against K/V batch B (the output takes the broadcast batch), K/V with 1 head against Q's H heads
  even without enable_gqa, and 3-D K/V (H, S, E) against 4-D Q.
- a float32 additive mask with float16/bfloat16 queries is accepted (float64 is refused).
- scale=0.0 runs: uniform attention, the mean of V over the keys.
- dropout_p=1.0 runs and gives exact zeros (and zero gradients); > 1 raises.
- head dim 0: E=0 gives uniform attention (the mean of V, as scale=0), Ev=0 an empty (..., L, 0).
- meta tensors: the output's shape, dtype and device, for every option.
- a 1-D attn_mask broadcasts like any trailing-dims mask: (S,) or (1,) acts as (L, S), in the
  math backend and for 2-D, 3-D and 5-D inputs; only the CPU fused kernel with 4-D inputs raises
  an IndexError on it ("Dimension out of range", a torch limitation, not a documented rule). We
  follow the broadcasting rule, on every path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import adaattn
from adaattn import Policy, stats

from helpers import DEVICE, NEEDS_CUDA_OR_INTERPRETER, assert_within_standard, rel_err

# The exact paths a call can take: the default dispatch (on the CPU: sdpa.cpu), the float64
# reference runner, and our Triton kernels (the interpreter on the CPU).
PATHS = {
    "default": None,
    "reference": Policy(backends=("reference",)),
    "triton": Policy(backends=("triton",)),
}


def _path_params(*names):
    """pytest params for paths (Triton: where it can run)."""
    out = []
    for name in names:
        marks = [NEEDS_CUDA_OR_INTERPRETER] if name == "triton" else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


ALL_PATHS = ("default", "reference", "triton")


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def _to_bhsd(t):
    """(..., N, H, D) -> (..., H, N, D), a view."""
    return t.transpose(-3, -2)


def _sdpa(q, k, v, layout="bhsd", attn_mask=None, **kw):
    """SDPA in q's dtype and in float64, on inputs given in `layout`; results in `layout`."""
    if layout == "bshd":
        q, k, v = _to_bhsd(q), _to_bhsd(k), _to_bhsd(v)
    torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kw)
    m64 = attn_mask.double() if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
    ref64 = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m64, **kw)
    if layout == "bshd":
        torch_out, ref64 = _to_bhsd(torch_out), _to_bhsd(ref64)
    return torch_out, ref64


def _check(ours, q, k, v, layout="bhsd", attn_mask=None, **kw):
    torch_out, ref64 = _sdpa(q, k, v, layout, attn_mask, **kw)
    assert ours.shape == torch_out.shape, f"shape {tuple(ours.shape)} != SDPA's {tuple(torch_out.shape)}"
    assert ours.dtype == torch_out.dtype and ours.device == torch_out.device
    assert not ours.isnan().any(), "NaN in the output"
    assert_within_standard(ours, ref64, torch_out)


def _run(path, q, k, v, layout="bhsd", **kw):
    return adaattn.attention(q, k, v, layout=layout, policy=PATHS[path], **kw)


def _shape(lead, n, h, d, layout):
    """A (*lead, H, N, D) shape, or (*lead, N, H, D) for layout="bshd"."""
    return (*lead, n, h, d) if layout == "bshd" else (*lead, h, n, d)


LAYOUTS = ("bhsd", "bshd")


# ------------------------------------------------------------------ inputs of other ranks


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_two_dim_inputs_without_heads_or_batch_match_sdpa(path, causal):
    torch.manual_seed(1)
    q, k, v = _rand(17, 16), _rand(17, 16), _rand(17, 16)
    _check(_run(path, q, k, v, is_causal=causal), q, k, v, is_causal=causal)


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_three_dim_inputs_without_batch_match_sdpa(path, layout):
    torch.manual_seed(2)
    q = _rand(*_shape((), 9, 4, 16, layout))
    k, v = _rand(*_shape((), 13, 4, 16, layout)), _rand(*_shape((), 13, 4, 16, layout))
    _check(_run(path, q, k, v, layout), q, k, v, layout)


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_three_dim_gqa_inputs_match_sdpa(path, layout):
    torch.manual_seed(3)
    q = _rand(*_shape((), 11, 4, 16, layout))
    k, v = _rand(*_shape((), 11, 2, 16, layout)), _rand(*_shape((), 11, 2, 16, layout))
    ours = _run(path, q, k, v, layout, is_causal=True, enable_gqa=True)
    _check(ours, q, k, v, layout, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_five_dim_inputs_match_sdpa(path, layout):
    torch.manual_seed(4)
    q = _rand(*_shape((2, 3), 9, 2, 16, layout))
    k, v = _rand(*_shape((2, 3), 12, 2, 16, layout)), _rand(*_shape((2, 3), 12, 2, 16, layout))
    mask = torch.rand(3, 1, 9, 12, device=DEVICE) > 0.3  # broadcast over B1 and heads
    _check(_run(path, q, k, v, layout, attn_mask=mask), q, k, v, layout, attn_mask=mask)


def test_six_dim_inputs_match_sdpa():
    torch.manual_seed(5)
    q, k, v = _rand(1, 2, 2, 2, 7, 8), _rand(1, 2, 2, 2, 5, 8), _rand(1, 2, 2, 2, 5, 8)
    _check(adaattn.attention(q, k, v), q, k, v)


def test_one_dim_inputs_are_refused_as_sdpa_refuses_them():
    q = _rand(16)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, q, q)
    with pytest.raises(ValueError, match="query"):
        adaattn.attention(q, q, q)


# ------------------------------------------------------------------ broadcast leading dims


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_key_value_batch_one_broadcasts_against_query_batch(path, layout):
    torch.manual_seed(6)
    q = _rand(*_shape((3,), 9, 4, 16, layout))
    k, v = _rand(*_shape((1,), 14, 4, 16, layout)), _rand(*_shape((1,), 14, 4, 16, layout))
    _check(_run(path, q, k, v, layout), q, k, v, layout)


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_key_value_batch_one_broadcasts_with_gqa_and_causal(path, layout):
    torch.manual_seed(7)
    q = _rand(*_shape((2,), 10, 4, 16, layout))
    k, v = _rand(*_shape((1,), 10, 2, 16, layout)), _rand(*_shape((1,), 10, 2, 16, layout))
    ours = _run(path, q, k, v, layout, is_causal=True, enable_gqa=True)
    _check(ours, q, k, v, layout, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_query_batch_one_broadcasts_against_key_value_batch(path, layout):
    torch.manual_seed(8)
    q = _rand(*_shape((1,), 9, 4, 16, layout))
    k, v = _rand(*_shape((3,), 14, 4, 16, layout)), _rand(*_shape((3,), 14, 4, 16, layout))
    _check(_run(path, q, k, v, layout), q, k, v, layout)


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_key_value_single_head_broadcasts_without_enable_gqa(path, layout):
    torch.manual_seed(9)
    q = _rand(*_shape((2,), 9, 4, 16, layout))
    k, v = _rand(*_shape((2,), 14, 1, 16, layout)), _rand(*_shape((2,), 14, 1, 16, layout))
    _check(_run(path, q, k, v, layout), q, k, v, layout)


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lower_rank_key_value_broadcast_against_query(path, layout):
    torch.manual_seed(10)
    q = _rand(*_shape((2,), 9, 4, 16, layout))
    k, v = _rand(*_shape((), 14, 4, 16, layout)), _rand(*_shape((), 14, 4, 16, layout))
    _check(_run(path, q, k, v, layout), q, k, v, layout)


# ------------------------------------------------------------------ mask dtype


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_float32_additive_mask_with_half_queries_matches_sdpa(path, layout, dtype):
    torch.manual_seed(11)
    q = _rand(*_shape((2,), 17, 2, 32, layout), dtype=dtype)
    k = _rand(*_shape((2,), 24, 2, 32, layout), dtype=dtype)
    v = _rand(*_shape((2,), 24, 2, 32, layout), dtype=dtype)
    mask = torch.randn(2, 1, 17, 24, device=DEVICE)  # float32
    mask[..., 3] = float("-inf")
    _check(_run(path, q, k, v, layout, attn_mask=mask), q, k, v, layout, attn_mask=mask)


def test_float64_additive_mask_with_half_queries_is_refused_as_sdpa_refuses_it():
    q = _rand(1, 2, 8, 16, dtype=torch.float16)
    mask = torch.randn(8, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    with pytest.raises(TypeError, match="attn_mask"):
        adaattn.attention(q, q, q, attn_mask=mask)


# ------------------------------------------------------------------ scale, dropout, head dim 0


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scale_zero_gives_uniform_attention_as_sdpa(path, layout):
    torch.manual_seed(12)
    q = _rand(*_shape((2,), 9, 2, 16, layout))
    k, v = _rand(*_shape((2,), 14, 2, 16, layout)), _rand(*_shape((2,), 14, 2, 16, layout))
    ours = _run(path, q, k, v, layout, scale=0.0)
    _check(ours, q, k, v, layout, scale=0.0)
    seq_dim = -3 if layout == "bshd" else -2
    uniform = v.double().mean(seq_dim, keepdim=True).expand(ours.shape)
    torch.testing.assert_close(ours.double(), uniform, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dropout_one_gives_zeros_and_zero_gradients_as_sdpa(layout):
    torch.manual_seed(13)
    q = _rand(*_shape((2,), 9, 2, 16, layout)).requires_grad_()
    k = _rand(*_shape((2,), 14, 2, 16, layout)).requires_grad_()
    v = _rand(*_shape((2,), 14, 2, 16, layout)).requires_grad_()
    torch.manual_seed(99)
    ours = adaattn.attention(q, k, v, dropout_p=1.0, layout=layout)
    qs, ks, vs = (_to_bhsd(t) for t in (q, k, v)) if layout == "bshd" else (q, k, v)
    torch.manual_seed(99)
    theirs = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=1.0)
    if layout == "bshd":
        theirs = _to_bhsd(theirs)
    assert ours.shape == theirs.shape
    assert torch.equal(theirs, torch.zeros_like(theirs))  # what SDPA does
    assert torch.equal(ours, theirs)
    ours.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


@pytest.mark.parametrize("path", _path_params("default", "reference"))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dims", [(0, 16), (16, 0), (0, 0)], ids=["E0", "Ev0", "E0-Ev0"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_zero_head_dim_matches_sdpa(path, layout, dims, causal):
    e, ev = dims
    torch.manual_seed(14)
    q = _rand(*_shape((2,), 9, 2, e, layout))
    k, v = _rand(*_shape((2,), 9, 2, e, layout)), _rand(*_shape((2,), 9, 2, ev, layout))
    ours = _run(path, q, k, v, layout, is_causal=causal)
    _check(ours, q, k, v, layout, is_causal=causal)
    if e == 0 and ev > 0 and not causal:  # no scores: uniform attention, as SDPA
        seq_dim = -3 if layout == "bshd" else -2
        uniform = v.double().mean(seq_dim, keepdim=True).expand(ours.shape)
        torch.testing.assert_close(ours.double(), uniform, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ meta tensors

META_CASES = {
    "plain": dict(q=(2, 4, 9, 16), kv=(2, 4, 13, 16)),
    "causal": dict(q=(2, 4, 9, 16), kv=(2, 4, 13, 16), kw=dict(is_causal=True)),
    "gqa": dict(q=(2, 4, 9, 16), kv=(2, 2, 13, 16), kw=dict(enable_gqa=True)),
    "value_dim": dict(q=(2, 4, 9, 48), kv=(2, 4, 13, 48), dv=32),
    "bool_mask": dict(q=(2, 4, 9, 16), kv=(2, 4, 13, 16), mask=((9, 13), torch.bool)),
    "additive_mask": dict(q=(2, 4, 9, 16), kv=(2, 4, 13, 16), mask=((1, 4, 9, 13), None)),
    "three_dim": dict(q=(4, 9, 16), kv=(4, 13, 16)),
    "grad": dict(q=(2, 4, 9, 16), kv=(2, 4, 13, 16), grad=True),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(META_CASES))
def test_meta_tensors_give_the_output_shape_dtype_and_device(case, dtype, layout):
    c = META_CASES[case]
    if layout == "bshd" and len(c["q"]) < 3:
        pytest.skip("bshd needs heads")

    def shaped(s, last=None):
        s = tuple(s[:-1]) + ((s[-1] if last is None else last),)
        return s[:-3] + (s[-2], s[-3], s[-1]) if layout == "bshd" else s

    q = torch.empty(shaped(c["q"]), dtype=dtype, device="meta", requires_grad=c.get("grad", False))
    k = torch.empty(shaped(c["kv"]), dtype=dtype, device="meta")
    v = torch.empty(shaped(c["kv"], c.get("dv")), dtype=dtype, device="meta")
    kw = dict(c.get("kw", {}))
    if "mask" in c:
        mshape, mdtype = c["mask"]
        kw["attn_mask"] = torch.empty(mshape, dtype=mdtype or dtype, device="meta")
    ours = adaattn.attention(q, k, v, layout=layout, **kw)
    qs, ks, vs = (_to_bhsd(t) for t in (q, k, v)) if layout == "bshd" else (q, k, v)
    theirs = F.scaled_dot_product_attention(qs, ks, vs, **kw)
    if layout == "bshd":
        theirs = _to_bhsd(theirs)
    assert ours.device.type == "meta"
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype


def test_meta_tensors_take_a_float32_mask_with_half_queries():
    q = torch.empty(2, 4, 9, 16, dtype=torch.float16, device="meta")
    mask = torch.empty(9, 9, dtype=torch.float32, device="meta")
    ours = adaattn.attention(q, q, q, attn_mask=mask)
    assert ours.device.type == "meta" and ours.shape == q.shape and ours.dtype == torch.float16


def test_ada_attention_module_runs_on_meta_as_hf_meta_init_needs():
    """Built under torch.device("meta") (as HF builds models before loading weights) and called on
    meta inputs: the output's shape, dtype and device, as torch.nn.MultiheadAttention gives them.
    (need_weights=True is refused by AdaAttention on purpose: it never forms the weights.)"""
    with torch.device("meta"):
        mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        ours = adaattn.AdaAttention(32, 4, batch_first=True)
    x = torch.empty(2, 9, 32, device="meta")
    out, w = ours(x, x, x, need_weights=False)
    ref, _ = mha(x, x, x, need_weights=False)
    assert out.device.type == "meta" and out.shape == ref.shape and out.dtype == ref.dtype
    assert w is None


# ------------------------------------------------------------------ 1-D masks


def _one_dim_cases():
    out = []
    for path in ALL_PATHS:
        for layout in LAYOUTS:
            for kind in ("additive", "bool"):
                for length in ("Nk", "1"):
                    marks = [NEEDS_CUDA_OR_INTERPRETER] if path == "triton" else []
                    out.append(pytest.param(path, layout, kind, length, marks=marks,
                                            id=f"{path}-{layout}-{kind}-{length}"))
    return out


@pytest.mark.parametrize("path,layout,kind,length", _one_dim_cases())
def test_one_dim_mask_raises_a_clear_error_on_every_path(path, layout, kind, length):
    """SDPA answers a 1-D mask with an IndexError from its fused CPU kernel on 4-D inputs and a
    result elsewhere; issue 13 asks for one clear error everywhere, naming attn_mask."""
    torch.manual_seed(15)
    nq, nk = 9, 14
    q = _rand(*_shape((2,), nq, 2, 16, layout))
    k, v = _rand(*_shape((2,), nk, 2, 16, layout)), _rand(*_shape((2,), nk, 2, 16, layout))
    n = nk if length == "Nk" else 1
    mask = (torch.rand(n, device=DEVICE) > 0.3) if kind == "bool" else torch.randn(n, device=DEVICE)
    with pytest.raises(ValueError, match=r"attn_mask must be at least 2-D"):
        _run(path, q, k, v, layout, attn_mask=mask)


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS))
def test_one_dim_mask_with_two_dim_inputs_raises_a_clear_error(path):
    q, k, v = _rand(9, 16), _rand(14, 16), _rand(14, 16)
    with pytest.raises(ValueError, match=r"attn_mask must be at least 2-D"):
        _run(path, q, k, v, attn_mask=torch.randn(14, device=DEVICE))


def test_explain_refuses_a_one_dim_mask_naming_it():
    q = _rand(2, 2, 9, 16)
    k = _rand(2, 2, 14, 16)
    with pytest.raises(ValueError, match=r"attn_mask must be at least 2-D"):
        adaattn.explain(q, k, k, attn_mask=torch.randn(14, device=DEVICE))


def _bad_mask_call(path, mask, layout="bhsd"):
    q = _rand(*_shape((2,), 9, 2, 16, layout))
    k = _rand(*_shape((2,), 14, 2, 16, layout))
    if path == "explain":
        return adaattn.explain(q, k, k, attn_mask=mask, layout=layout)
    return _run(path, q, k, k, layout, attn_mask=mask)


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS) + ["explain"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bad", ["length", "two_dim_rows"])
def test_mask_that_does_not_broadcast_raises_value_error_naming_attn_mask(path, layout, bad):
    """A 1-D mask whose length is neither Nk nor 1 (or a 2-D one with the wrong row count): SDPA
    raises a RuntimeError; we raise a ValueError naming attn_mask, on every path, before any kernel."""
    mask = torch.randn(7, device=DEVICE) if bad == "length" else torch.randn(5, 14, device=DEVICE)
    with pytest.raises(ValueError, match="attn_mask"):
        _bad_mask_call(path, mask, layout)


# ------------------------------------------------------------------ value head dim != query head dim


def _dv_cases():
    out = []
    for variant in ("plain", "causal", "gqa", "gqa_causal", "causal_unequal", "bool_mask"):
        for layout in LAYOUTS:
            for dtype in (torch.float16, torch.float32):
                out.append(pytest.param(variant, layout, dtype, id=f"{variant}-{layout}-{str(dtype)[6:]}"))
    return out


@NEEDS_CUDA_OR_INTERPRETER
@pytest.mark.parametrize("variant,layout,dtype", _dv_cases())
def test_value_head_dim_differing_from_query_head_dim_runs_on_triton(variant, layout, dtype):
    """DeepSeek-MLA-like: D=48 for query/key, Dv=32 for value, through our Triton kernels."""
    torch.manual_seed(17)
    hq, hkv = (4, 2) if "gqa" in variant else (2, 2)
    nq, nk = (10, 23) if variant == "causal_unequal" else (19, 19)
    q = _rand(*_shape((2,), nq, hq, 48, layout), dtype=dtype)
    k = _rand(*_shape((2,), nk, hkv, 48, layout), dtype=dtype)
    v = _rand(*_shape((2,), nk, hkv, 32, layout), dtype=dtype)
    kw = dict(is_causal="causal" in variant, enable_gqa="gqa" in variant)
    if variant == "bool_mask":
        kw["attn_mask"] = torch.rand(nq, nk, device=DEVICE) > 0.3
    with stats.collect() as recs:
        ours = _run("triton", q, k, v, layout, **kw)
    assert [r.backend for r in recs] == ["triton.ptr"] and not recs[0].fallbacks
    _check(ours, q, k, v, layout, **kw)


@pytest.mark.parametrize("path", _path_params(*ALL_PATHS))
@pytest.mark.parametrize("scale", [0.0, -0.5], ids=["zero", "negative"])
def test_causal_with_a_non_positive_scale_matches_float64(path, scale):
    """SDPA itself returns NaN here (is_causal with scale <= 0, torch 2.13 CPU, math and fused
    kernels); we give the float64 result (found by fuzzing)."""
    torch.manual_seed(21)
    q, k = _rand(1, 2, 5, 16), _rand(1, 2, 17, 16)
    ours = _run(path, q, k, k, is_causal=True, scale=scale)
    keep = torch.ones(5, 17, dtype=torch.bool, device=DEVICE).tril()
    ref = F.scaled_dot_product_attention(q.double(), k.double(), k.double(), attn_mask=keep, scale=scale)
    assert not ours.isnan().any()
    assert rel_err(ours, ref) < 1e-5
