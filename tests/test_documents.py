"""Document masking: adaattn.documents(ids) and attention(..., documents=...) against float64.

FlexAttention's document mask, `document_id[q_idx] == document_id[kv_idx]` (and `q_idx >= kv_idx`
under causal), is the reference semantics: the mask is built here from the ids alone and the
float64 reference and torch SDPA run with it. On a machine without CUDA the Triton kernels run
in the interpreter at small sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import adaattn
from adaattn.backends.reference import reference_attention

from helpers import DEVICE, NEEDS_CUDA_OR_INTERPRETER, assert_within_standard, keep_mask

pytestmark = NEEDS_CUDA_OR_INTERPRETER


def _ids(lengths, start_id=0, step=1):
    return torch.cat([torch.full((n,), start_id + i * step, dtype=torch.long) for i, n in enumerate(lengths)])


def document_keep(ids, causal, window):
    """(B, 1, N, N) bool: same document, then causal/window on global positions."""
    ids = ids if ids.dim() == 2 else ids[None]
    same = ids[:, :, None] == ids[:, None, :]
    return (same & keep_mask(ids.shape[1], ids.shape[1], causal, window, ids.device))[:, None]


def _run_case(ids, b=1, hq=2, hkv=2, d=16, dtype=torch.float32, causal=True, window=None, layout="bhsd",
              prebuilt=True, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    n = ids.shape[-1]

    def rnd(h):
        shape = (b, h, n, d) if layout == "bhsd" else (b, n, h, d)
        return torch.randn(shape, generator=g, device=DEVICE).to(dtype).requires_grad_()

    q, k, v = rnd(hq), rnd(hkv), rnd(hkv)
    dout = torch.randn(q.shape, generator=g, device=DEVICE).to(dtype)
    ids = ids.to(DEVICE)
    docs = adaattn.documents(ids) if prebuilt else ids
    out = adaattn.attention(q, k, v, is_causal=causal, window=window, enable_gqa=hq != hkv, layout=layout,
                            documents=docs)
    assert out.shape == q.shape and out.dtype == dtype
    out.backward(dout)

    def bhsd(t):
        return t if layout == "bhsd" else t.transpose(1, 2)

    keep = document_keep(ids, causal, window)
    q64, k64, v64 = (bhsd(t).detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, keep)
    ref.backward(bhsd(dout).double())
    qt, kt, vt = (bhsd(t).detach().clone().requires_grad_() for t in (q, k, v))
    peer = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep, enable_gqa=hq != hkv)
    peer.backward(bhsd(dout))
    assert_within_standard(bhsd(out), ref, torch.nan_to_num(peer), "output")
    for name, ours, r, p in (("dq", q.grad, q64.grad, qt.grad), ("dk", k.grad, k64.grad, kt.grad),
                             ("dv", v.grad, v64.grad, vt.grad)):
        assert_within_standard(bhsd(ours), r, torch.nan_to_num(p), name)


CASES = {
    "causal, four documents": dict(ids=_ids([5, 9, 3, 7])),
    "not causal": dict(ids=_ids([6, 1, 10]), causal=False),
    "ids unsorted and not from 0": dict(ids=_ids([4, 12, 8], start_id=9, step=-3)),
    "window inside documents": dict(ids=_ids([11, 13]), window=(4, 0)),
    "gqa, bf16": dict(ids=_ids([7, 17]), hq=4, hkv=2, dtype=torch.bfloat16),
    "bshd layout": dict(ids=_ids([9, 9, 6]), layout="bshd"),
    "ids passed as a tensor": dict(ids=_ids([3, 20]), prebuilt=False),
    "one id for the batch": dict(ids=_ids([10, 14]), b=3),
    "ids per batch row": dict(ids=torch.stack([_ids([10, 14]), _ids([2, 20, 2])]), b=2),
    "ids per batch row, bshd, fp16": dict(ids=torch.stack([_ids([24]), _ids([1, 23])]), b=2, layout="bshd",
                                          dtype=torch.float16, d=32),
    "head dim 80": dict(ids=_ids([13, 8]), d=80),
}


@pytest.mark.parametrize("case", list(CASES))
def test_document_masked_attention_matches_float64(case):
    _run_case(**CASES[case])


def test_documents_reads_runs_and_lengths():
    docs = adaattn.documents(torch.tensor([[4, 4, 4, 2, 2], [1, 1, 1, 1, 1]]))
    assert docs.cu_seqlens.tolist() == [0, 3, 5, 10] and docs.max_seqlen == 5
    assert (docs.batch, docs.length) == (2, 5)
    repeated = adaattn.documents([0, 0, 1]).for_batch(3)
    assert repeated.cu_seqlens.tolist() == [0, 2, 3, 5, 6, 8, 9] and repeated.max_seqlen == 2


def test_three_dimensional_tensors_and_empty_sequences():
    g = torch.Generator(device=DEVICE).manual_seed(3)
    q, k, v = (torch.randn(2, 12, 16, generator=g, device=DEVICE) for _ in range(3))
    ids = _ids([5, 7]).to(DEVICE)
    out = adaattn.attention(q, k, v, is_causal=True, documents=ids)
    ref = reference_attention(q[None], k[None], v[None], document_keep(ids, True, None))[0]
    assert torch.allclose(out.double(), ref, atol=1e-5)
    empty = torch.randn(1, 2, 0, 16, device=DEVICE)
    assert adaattn.attention(empty, empty, empty, documents=torch.zeros(0, dtype=torch.long)).shape == (1, 2, 0, 16)


def test_bad_documents_are_refused_with_the_argument_named():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one contiguous run"):
        adaattn.documents(torch.tensor([0, 0, 1, 1, 0, 0, 2, 2]))
    with pytest.raises(TypeError, match="document_ids must be an integer tensor"):
        adaattn.documents(torch.zeros(8))
    with pytest.raises(ValueError, match=r"\(N,\) or \(B, N\)"):
        adaattn.documents(torch.zeros(1, 2, 8, dtype=torch.long))
    ids = torch.zeros(8, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="attn_mask cannot be combined"):
        adaattn.attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool, device=DEVICE), documents=ids)
    with pytest.raises(ValueError, match="dropout_p"):
        adaattn.attention(q, q, q, dropout_p=0.1, documents=ids)
    with pytest.raises(ValueError, match="length 6"):
        adaattn.attention(q, q, q, documents=ids[:6])
    with pytest.raises(ValueError, match="self-attention"):
        adaattn.attention(q, q[:, :, :4], q[:, :, :4], documents=ids)
    with pytest.raises(ValueError, match="enable_gqa"):
        adaattn.attention(q, q[:, :1], q[:, :1], documents=ids)
    with pytest.raises(ValueError, match="batch of 2"):
        adaattn.attention(q, q, q, documents=torch.zeros(2, 8, dtype=torch.long))
