"""AdaAttention against torch.nn.MultiheadAttention with the same weights."""

from __future__ import annotations

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
def test_matches_multihead_attention(batch_first, masks):
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
    expected, _ = mha(q, kv, kv, need_weights=False, **kwargs)
    got, weights = ours(q, kv, kv, **kwargs)
    assert weights is None
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_self_attention_with_distinct_kdim_vdim():
    mha, ours = _pair(32, 4, True, kdim=24, vdim=40)
    q, k, v = torch.randn(2, 9, 32), torch.randn(2, 7, 24), torch.randn(2, 7, 40)
    torch.testing.assert_close(ours(q, k, v)[0], mha(q, k, v, need_weights=False)[0], atol=2e-6, rtol=1e-5)


def test_without_bias_and_unbatched_input():
    mha, ours = _pair(16, 2, False, bias=False)
    x = torch.randn(5, 16)
    torch.testing.assert_close(ours(x, x, x)[0], mha(x, x, x, need_weights=False)[0], atol=2e-6, rtol=1e-5)


def test_gradients_match_multihead_attention():
    mha, ours = _pair(32, 4, True)
    x = torch.randn(2, 10, 32, requires_grad=True)
    mha(x, x, x, need_weights=False)[0].sum().backward()
    gx = x.grad.clone()
    x.grad = None
    ours(x, x, x)[0].sum().backward()
    torch.testing.assert_close(x.grad, gx, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ours.in_proj_weight.grad, mha.in_proj_weight.grad, atol=2e-6, rtol=1e-5)


def test_need_weights_raises_and_says_why():
    _, ours = _pair()
    x = torch.randn(4, 2, 32)
    with pytest.raises(ValueError, match="need_weights=True is not supported: adaattn never forms the attention-weight"):
        ours(x, x, x, need_weights=True)


def test_grouped_query_heads_match_repeated_heads():
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
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(gqa(x, x, x)[0], full(x, x, x)[0], atol=2e-6, rtol=1e-5)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    m = AdaAttention(16, 2, dropout=0.5, batch_first=True)
    x = torch.randn(1, 12, 16)
    m.eval()
    assert torch.equal(m(x, x, x)[0], m(x, x, x)[0])
    m.train()
    assert not torch.equal(m(x, x, x)[0], m(x, x, x)[0])


def test_get_statistics_reports_calls_and_backends():
    m = AdaAttention(16, 2, batch_first=True, label="block3.attn")
    x = torch.randn(1, 6, 16)
    with stats.collect():
        m(x, x, x)
        m(x, x, x, is_causal=True)
        s = m.get_statistics()
    assert s["label"] == "block3.attn" and s["calls"] == 2
    assert s["backends"] == {"sdpa.cpu": 2}


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"embed_dim \(30\) must be divisible by num_heads \(4\)"):
        AdaAttention(30, 4)
    with pytest.raises(ValueError, match=r"num_kv_heads must be a positive divisor of num_heads \(4\), got 3"):
        AdaAttention(32, 4, num_kv_heads=3)
    with pytest.raises(TypeError, match=r"dropout must be a float in \[0, 1\), got str"):
        AdaAttention(32, 4, dropout="0.1")
    with pytest.raises(ValueError, match="kdim must be a positive int or None, got 0"):
        AdaAttention(32, 4, kdim=0)
    with pytest.raises(TypeError, match="policy must be an adaattn.Policy"):
        AdaAttention(32, 4, policy="auto")
    assert isinstance(AdaAttention(32, 4, policy=adaattn.Policy(mode="auto")).policy, adaattn.Policy)
