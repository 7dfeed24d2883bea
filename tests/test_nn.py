"""AdaAttention against torch.nn.MultiheadAttention with the same weights."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import adaattn
from adaattn import AdaAttention, stats


def _pair(e=32, h=4, batch_first=False, kdim=None, vdim=None, bias=True):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(e, h, batch_first=batch_first, kdim=kdim, vdim=vdim, bias=bias).eval()
    ours = AdaAttention(e, h, batch_first=batch_first, kdim=kdim, vdim=vdim, bias=bias).eval()
    missing, unexpected = ours.load_state_dict(mha.state_dict(), strict=True)
    assert not missing and not unexpected
    return mha, ours


def _seq(batch_first, b, n, e):
    return torch.randn(b, n, e) if batch_first else torch.randn(n, b, e)


def _padding(b, s):
    # Every row keeps at least its first key, so no row is fully masked (MHA gives NaN there).
    kpm = torch.zeros(b, s, dtype=torch.bool)
    for i in range(b):
        kpm[i, s - 1 - i * 3:] = True
    kpm[:, 0] = False
    return kpm


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("masks", ["none", "key_padding", "attn_bool", "attn_float", "both", "attn_3d", "causal"])
@pytest.mark.parametrize("weights", ["none", "averaged", "per_head"])
def test_matches_multihead_attention(batch_first, masks, weights):
    e, h, b, L, S = 32, 4, 3, 11, 13
    mha, ours = _pair(e, h, batch_first)
    q = _seq(batch_first, b, L, e)
    kv = _seq(batch_first, b, S, e)
    kwargs = {}
    if masks in ("key_padding", "both"):
        kwargs["key_padding_mask"] = _padding(b, S)
    if masks in ("attn_bool", "both"):
        m = torch.rand(L, S) > 0.7
        m[:, 0] = False
        kwargs["attn_mask"] = m
    if masks == "attn_float":
        kwargs["attn_mask"] = torch.randn(L, S)
    if masks == "attn_3d":
        m = torch.rand(b * h, L, S) > 0.7
        m[..., 0] = False
        kwargs["attn_mask"] = m
    if masks == "causal":
        q, kv, S = q, q, L
        kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L)
        kwargs["is_causal"] = True
    if weights == "none":
        expected, _ = mha(q, kv, kv, need_weights=False, **kwargs)
        got, w = ours(q, kv, kv, need_weights=False, **kwargs)
        assert w is None
    elif weights == "averaged":  # MultiheadAttention's defaults: need_weights=True, averaged over heads
        expected, expected_w = mha(q, kv, kv, **kwargs)
        got, w = ours(q, kv, kv, **kwargs)
    else:
        expected, expected_w = mha(q, kv, kv, need_weights=True, average_attn_weights=False, **kwargs)
        got, w = ours(q, kv, kv, need_weights=True, average_attn_weights=False, **kwargs)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)
    if weights != "none":
        assert w.shape == expected_w.shape == ((b, L, S) if weights == "averaged" else (b, h, L, S))
        torch.testing.assert_close(w, expected_w, atol=2e-6, rtol=1e-5)
        # The weights path gives the output the fast path gives.
        torch.testing.assert_close(got, ours(q, kv, kv, need_weights=False, **kwargs)[0], atol=2e-6, rtol=1e-5)


def test_self_attention_with_distinct_kdim_vdim():
    mha, ours = _pair(32, 4, True, kdim=24, vdim=40)
    q, k, v = torch.randn(2, 9, 32), torch.randn(2, 7, 24), torch.randn(2, 7, 40)
    torch.testing.assert_close(ours(q, k, v, need_weights=False)[0], mha(q, k, v, need_weights=False)[0],
                               atol=2e-6, rtol=1e-5)
    (out, w), (expected, expected_w) = ours(q, k, v), mha(q, k, v)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(w, expected_w, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("average", [True, False])
def test_without_bias_and_unbatched_input(average):
    mha, ours = _pair(16, 2, False, bias=False)
    x = torch.randn(5, 16)
    torch.testing.assert_close(ours(x, x, x, need_weights=False)[0], mha(x, x, x, need_weights=False)[0],
                               atol=2e-6, rtol=1e-5)
    # Unbatched with both masks: key_padding_mask (S,), attn_mask (num_heads, L, S); weights (L, S) or (H, L, S).
    kpm = torch.tensor([False, False, False, True, True])
    am = torch.rand(2, 5, 5) > 0.6
    am[..., 0] = False
    (out, w) = ours(x, x, x, key_padding_mask=kpm, attn_mask=am, average_attn_weights=average)
    (expected, expected_w) = mha(x, x, x, key_padding_mask=kpm, attn_mask=am, average_attn_weights=average)
    assert w.shape == expected_w.shape == ((5, 5) if average else (2, 5, 5))
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(w, expected_w, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_gradients_match_multihead_attention(need_weights):
    mha, ours = _pair(32, 4, True)
    x = torch.randn(2, 10, 32, requires_grad=True)
    mha(x, x, x, need_weights=need_weights)[0].sum().backward()
    gx = x.grad.clone()
    x.grad = None
    ours(x, x, x, need_weights=need_weights)[0].sum().backward()
    torch.testing.assert_close(x.grad, gx, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ours.in_proj_weight.grad, mha.in_proj_weight.grad, atol=2e-6, rtol=1e-5)


def test_default_call_returns_weights_like_multihead_attention():
    # `out, w = attn(x, x, x)` is MultiheadAttention's most common call: w must not be None.
    mha, ours = _pair(32, 4, True)
    x = torch.randn(2, 6, 32)
    out, w = ours(x, x, x)
    expected, expected_w = mha(x, x, x)
    assert w is not None and w.shape == expected_w.shape == (2, 6, 6)
    torch.testing.assert_close(w, expected_w, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 6))
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_weights_in_other_dtypes(dtype):
    mha, ours = _pair(32, 4, False)
    mha, ours = mha.to(dtype), ours.to(dtype)
    x = torch.randn(7, 2, 32, dtype=dtype)
    kpm = _padding(2, 7)
    (out, w), (expected, expected_w) = ours(x, x, x, key_padding_mask=kpm), mha(x, x, x, key_padding_mask=kpm)
    assert out.dtype == w.dtype == dtype
    tol = {"atol": 1e-12, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(w, expected_w, **tol)
    torch.testing.assert_close(out, expected, **tol)


def test_weights_path_output_is_weights_times_values_with_dropout():
    # In training, dropout acts on the weights and the output is formed from the dropped weights (as MHA).
    torch.manual_seed(0)
    m = AdaAttention(16, 2, dropout=0.5, batch_first=True, bias=False).train()
    x = torch.randn(1, 12, 16)
    out, w = m(x, x, x, average_attn_weights=False)
    assert not torch.allclose(w.sum(-1), torch.ones(1, 2, 12))  # dropped and rescaled
    v = torch.nn.functional.linear(x, m.in_proj_weight[32:]).view(1, 12, 2, 8).transpose(1, 2)
    attn = (w @ v).transpose(1, 2).reshape(1, 12, 16)
    torch.testing.assert_close(out, m.out_proj(attn), atol=2e-6, rtol=1e-5)
    m.eval()  # no dropout: rows sum to 1, and repeated calls agree
    out1, w1 = m(x, x, x)
    out2, w2 = m(x, x, x)
    assert torch.equal(out1, out2) and torch.equal(w1, w2)
    torch.testing.assert_close(w1.sum(-1), torch.ones(1, 12))


def test_weights_of_fully_masked_rows_are_zero_and_output_matches_fast_path():
    # MultiheadAttention gives NaN for a query with no key to attend; adaattn gives zero weights and the
    # same output as its need_weights=False path (zero attention, then out_proj).
    _, ours = _pair(32, 4, True)
    x = torch.randn(2, 5, 32)
    am = torch.zeros(5, 5, dtype=torch.bool)
    am[2] = True
    out, w = ours(x, x, x, attn_mask=am)
    assert torch.equal(w[:, 2], torch.zeros(2, 5)) and not w.isnan().any()
    torch.testing.assert_close(out, ours(x, x, x, attn_mask=am, need_weights=False)[0], atol=2e-6, rtol=1e-5)


def test_is_causal_alone_in_the_weights_path():
    # MultiheadAttention needs attn_mask with is_causal; adaattn also takes is_causal alone (top-left aligned).
    mha, ours = _pair(32, 4, True)
    x = torch.randn(2, 6, 32)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    out, w = ours(x, x, x, is_causal=True)
    expected, expected_w = mha(x, x, x, attn_mask=causal, is_causal=True)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(w, expected_w, atol=2e-6, rtol=1e-5)
    assert torch.equal(w.triu(1), torch.zeros_like(w))


def _gqa_and_full():
    torch.manual_seed(0)
    gqa = AdaAttention(32, 4, batch_first=True, num_kv_heads=2).eval()
    full = AdaAttention(32, 4, batch_first=True).eval()
    # Build full-head K/V projections by repeating each KV head's rows for its query heads.
    hd = 8
    with torch.no_grad():
        rep = lambda w: w.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)  # noqa: E731
        full.in_proj_weight.copy_(torch.cat([gqa.q_proj_weight, rep(gqa.k_proj_weight), rep(gqa.v_proj_weight)]))
        bq, bk, bv = gqa.in_proj_bias.split([32, 16, 16])
        full.in_proj_bias.copy_(torch.cat([bq, rep(bk.unsqueeze(1)).squeeze(1), rep(bv.unsqueeze(1)).squeeze(1)]))
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
    return gqa, full


def test_grouped_query_heads_match_repeated_heads():
    gqa, full = _gqa_and_full()
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(gqa(x, x, x, need_weights=False)[0], full(x, x, x, need_weights=False)[0],
                               atol=2e-6, rtol=1e-5)
    kpm = _padding(2, 9)
    (out, w), (expected, expected_w) = (
        m(x, x, x, key_padding_mask=kpm, average_attn_weights=False) for m in (gqa, full))
    assert w.shape == (2, 4, 9, 9)
    torch.testing.assert_close(w, expected_w, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out, gqa(x, x, x, key_padding_mask=kpm, need_weights=False)[0], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_dropout_only_in_training(need_weights):
    torch.manual_seed(0)
    m = AdaAttention(16, 2, dropout=0.5, batch_first=True)
    x = torch.randn(1, 12, 16)
    m.eval()
    assert torch.equal(m(x, x, x, need_weights=need_weights)[0], m(x, x, x, need_weights=need_weights)[0])
    m.train()
    assert not torch.equal(m(x, x, x, need_weights=need_weights)[0], m(x, x, x, need_weights=need_weights)[0])


@pytest.mark.parametrize("dropout", [torch.tensor(0.5), torch.tensor(0.5, dtype=torch.float64)],
                         ids=["0-d float32", "0-d float64"])
def test_dropout_takes_a_0d_tensor_as_sdpa_takes_dropout_p(dropout):
    torch.manual_seed(0)
    want = AdaAttention(16, 2, dropout=0.5, batch_first=True).train()
    m = AdaAttention(16, 2, dropout=dropout, batch_first=True).train()
    m.load_state_dict(want.state_dict())
    assert type(m.dropout) is float and m.dropout == 0.5
    x = torch.randn(1, 12, 16)
    for need_weights in (False, True):
        torch.manual_seed(1)
        ours = m(x, x, x, need_weights=need_weights)[0]
        torch.manual_seed(1)
        assert torch.equal(ours, want(x, x, x, need_weights=need_weights)[0])
    assert AdaAttention(16, 2, dropout=torch.tensor(0)).dropout == 0.0


def test_get_statistics_reports_calls_and_backends():
    m = AdaAttention(16, 2, batch_first=True, label="block3.attn")
    x = torch.randn(1, 6, 16)
    with stats.collect():
        m(x, x, x, need_weights=False)
        m(x, x, x, is_causal=True, need_weights=False)
        m(x, x, x)  # the weights path forms the weights itself: a call, but no backend ran
        s = m.get_statistics()
    assert s["label"] == "block3.attn" and s["calls"] == 3
    assert s["backends"] == {"sdpa.cpu": 2}


def test_has_the_attributes_code_written_for_multihead_attention_reads():
    for kwargs in ({}, {"kdim": 24, "vdim": 40}, {"bias": False}, {"batch_first": True, "dropout": 0.25}):
        mha = nn.MultiheadAttention(32, 4, **kwargs)
        ours = AdaAttention(32, 4, **kwargs)
        for name in ("embed_dim", "num_heads", "head_dim", "kdim", "vdim", "dropout", "batch_first",
                     "_qkv_same_embed_dim", "bias_k", "bias_v", "add_zero_attn"):
            assert getattr(ours, name) == getattr(mha, name), (name, kwargs)
        for name in ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
            a, b = getattr(ours, name), getattr(mha, name)
            assert (a is None) == (b is None) and (a is None or a.shape == b.shape), (name, kwargs)
        assert ours.out_proj.weight.shape == mha.out_proj.weight.shape
        assert (ours.out_proj.bias is None) == (mha.out_proj.bias is None)
    # Both spellings of the MHA-only constructor flags are accepted when off.
    AdaAttention(32, 4, add_bias_kv=False, add_zero_attn=False)


def test_merge_masks_matches_multihead_attention():
    mha, ours = _pair(32, 4, True)
    x = torch.randn(3, 5, 32)
    kpm = _padding(3, 5)
    am = nn.Transformer.generate_square_subsequent_mask(5)
    for a, k in ((None, None), (am, None), (None, kpm.float()), (am, kpm.float().masked_fill(kpm, float("-inf"))),
                 (am.expand(12, 5, 5), None)):
        (m1, t1), (m2, t2) = ours.merge_masks(a, k, x), mha.merge_masks(a, k, x)
        assert t1 == t2 and ((m1 is None and m2 is None) or torch.equal(m1, m2))


# ---- inside torch's Transformer layers (they inspect self_attn for their "fast path") -------------


MODES = ["train", "eval", "no_grad", "inference_mode"]


def _run(mode, module, *args, **kwargs):
    module.train(mode == "train")
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested-tensor prototype warnings from torch
        if ctx is None:
            return module(*args, **kwargs)
        with ctx():
            return module(*args, **kwargs)


def _ada_like(mha):
    ours = AdaAttention(mha.embed_dim, mha.num_heads, dropout=mha.dropout, batch_first=mha.batch_first)
    ours.load_state_dict(mha.state_dict())
    return ours


def _encoder_layers(batch_first, mode, e=32, h=4):
    torch.manual_seed(0)
    # Dropout in train mode would draw different random numbers in the two layers' attention.
    layer = nn.TransformerEncoderLayer(e, h, 64, dropout=0.0 if mode == "train" else 0.1, batch_first=batch_first)
    ours = copy.deepcopy(layer)
    ours.self_attn = _ada_like(layer.self_attn)
    return layer, ours


def _layer_inputs(batch_first, masks, b=3, n=9, e=32):
    x = _seq(batch_first, b, n, e)
    kwargs = {}
    if masks in ("key_padding", "both"):
        kwargs["src_key_padding_mask"] = _padding(b, n)
    if masks in ("causal", "both"):
        kwargs["src_mask"] = nn.Transformer.generate_square_subsequent_mask(n)
        kwargs["is_causal"] = True
    return x, kwargs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("masks", ["none", "key_padding", "causal", "both"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_in_transformer_encoder_layer(batch_first, masks, mode):
    layer, ours = _encoder_layers(batch_first, mode)
    x, kwargs = _layer_inputs(batch_first, masks)
    expected = _run(mode, layer, x, **kwargs)
    with stats.collect() as records:
        got = _run(mode, ours, x, **kwargs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # adaattn's attention ran (torch's fused layer kernel did not replace it).
    assert [r.label for r in records] == [ours.self_attn.label]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("masks", ["none", "key_padding", "causal"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_in_transformer_encoder(batch_first, masks, mode):
    layer, ours = _encoder_layers(batch_first, mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "enable_nested_tensor is True, but ..." for batch_first=False
        enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
        enc_ours = nn.TransformerEncoder(ours, 2, enable_nested_tensor=True)
    x, kwargs = _layer_inputs(batch_first, masks)
    kwargs = {{"src_mask": "mask"}.get(k, k): v for k, v in kwargs.items()}
    expected = _run(mode, enc, x, **kwargs)
    with stats.collect() as records:
        got = _run(mode, enc_ours, x, **kwargs)
    assert not got.is_nested and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert sorted(r.label for r in records) == sorted(m.self_attn.label for m in enc_ours.layers)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch_first", [True, False])
def test_in_transformer_decoder_layer(batch_first, mode):
    torch.manual_seed(0)
    e, h, b, n, m = 32, 4, 3, 7, 9
    layer = nn.TransformerDecoderLayer(e, h, 64, dropout=0.0 if mode == "train" else 0.1, batch_first=batch_first)
    ours = copy.deepcopy(layer)
    ours.self_attn = _ada_like(layer.self_attn)
    ours.multihead_attn = _ada_like(layer.multihead_attn)
    tgt, memory = _seq(batch_first, b, n, e), _seq(batch_first, b, m, e)
    kwargs = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(n), "tgt_is_causal": True,
              "memory_key_padding_mask": _padding(b, m)}
    expected = _run(mode, layer, tgt, memory, **kwargs)
    got = _run(mode, ours, tgt, memory, **kwargs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_nested_tensor_input_like_multihead_attention_fast_path():
    mha, ours = _pair(32, 4, True)
    nt = torch.nested.nested_tensor([torch.randn(7, 32), torch.randn(4, 32)])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (out, w), (expected, expected_w) = ours(nt, nt, nt), mha(nt, nt, nt)
        assert out.is_nested and w.shape == expected_w.shape == (2, 7, 7)
        for a, b in zip(out.unbind(), expected.unbind()):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(w, expected_w, atol=2e-6, rtol=1e-5)
        out, w = ours(nt, nt, nt, need_weights=False)
        assert w is None
        for a, b in zip(out.unbind(), expected.unbind()):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


# ---- argument errors ----------------------------------------------------------------------------------


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"embed_dim \(30\) must be divisible by num_heads \(4\)"):
        AdaAttention(30, 4)
    with pytest.raises(ValueError, match=r"num_kv_heads must be a positive divisor of num_heads \(4\), got 3"):
        AdaAttention(32, 4, num_kv_heads=3)
    with pytest.raises(TypeError, match=r"^dropout must be a float in \[0, 1\) \(a Python or NumPy int or float, "
                                        r"or a 0-d tensor, as SDPA takes\), got str$"):
        AdaAttention(32, 4, dropout="0.1")
    with pytest.raises(TypeError, match=r"^dropout must be a float in \[0, 1\) .*, got a tensor of shape \(1,\)$"):
        AdaAttention(32, 4, dropout=torch.tensor([0.1]))
    with pytest.raises(ValueError, match="kdim must be a positive int or None, got 0"):
        AdaAttention(32, 4, kdim=0)
    with pytest.raises(TypeError, match="policy must be an adaattn.Policy"):
        AdaAttention(32, 4, policy="auto")
    with pytest.raises(ValueError, match="add_bias_kv=True is not supported"):
        AdaAttention(32, 4, add_bias_kv=True)
    with pytest.raises(ValueError, match="add_zero_attn=True is not supported"):
        AdaAttention(32, 4, add_zero_attn=True)
    assert isinstance(AdaAttention(32, 4, policy=adaattn.Policy(mode="auto")).policy, adaattn.Policy)


def test_forward_rejects_bad_inputs():
    _, ours = _pair(32, 4, True)
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match=r"query must be 2-D \(unbatched\) or 3-D, got 4-D"):
        ours(x[None], x[None], x[None])
    with pytest.raises(ValueError, match=r"key must be 3-D like query, got 2-D"):
        ours(x, x[0], x)
    with pytest.raises(ValueError, match=r"query's last dimension must be embed_dim \(32\), got 16"):
        ours(x[..., :16], x, x)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(batch, kv_len\) = \(2, 5\), got \(2, 4\)"):
        ours(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="query must be a torch.Tensor, got list"):
        ours([1.0], x, x)
