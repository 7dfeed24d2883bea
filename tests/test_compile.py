"""attention under torch.compile: no graph break, and recompiles only per dispatch bucket."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

import adaattn
from adaattn.problem import SEQ_BUCKETS


def _bucket(n: int) -> str:
    for limit, name in SEQ_BUCKETS[1:]:
        if n <= limit:
            return name
    return "long"


def _block(q, k, v, mask):
    out = adaattn.attention(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True, window=(64, 0))
    return out.relu() * 2


def test_fullgraph_compile_matches_eager():
    torch._dynamo.reset()
    q, k, v = torch.randn(2, 4, 70, 32), torch.randn(2, 2, 70, 32), torch.randn(2, 2, 70, 32)
    mask = torch.rand(70, 70) > 0.1
    compiled = torch.compile(_block, fullgraph=True)
    assert torch.allclose(compiled(q, k, v, mask), _block(q, k, v, mask), atol=1e-5)


def test_planning_under_compile_traces_no_cached_device_query():
    """Planning runs inside the traced region; device facts (capability, warp specialisation)
    must be evaluated, not traced: dynamo tracing into a functools.lru_cache wrapper that
    imports triton failed on torch 2.11 (InternalTorchDynamoError on an H100)."""
    import warnings

    torch._dynamo.reset()
    q = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for policy in (None, adaattn.Policy(backends=("triton",)),
                       adaattn.Policy(mode="auto", precisions=("native", "int8", "fp8"))):
            torch._dynamo.reset()
            torch.compile(lambda q: adaattn.explain(q, q, q, policy=policy).plan.backend, fullgraph=False)(q)
            torch.compile(lambda q: adaattn.attention(q, q, q, is_causal=True, policy=policy), fullgraph=True)(q)
    traced_caches = [str(w.message) for w in caught if "lru_cache" in str(w.message)]
    assert not traced_caches, traced_caches


def test_torch_order_for_an_sm90_call_traces_under_fullgraph_compile():
    """The planner's reading of torch's order (cuDNN first on Hopper) runs inside the traced region:
    it read torch.backends.cudnn.version() per call, which dynamo cannot trace ('torch.* op returned
    non-Tensor': every fullgraph-compiled call on an H200 failed). It reads a constant now."""
    from adaattn import planner
    from adaattn.backends.sdpa_forms import CUDNN_VERSION, CUDNN_WIDE

    torch._dynamo.reset()
    q = torch.randn(1, 2, 8, 16)
    compiled = torch.compile(lambda q: q * planner._torch_prefers_cudnn("sm90"), fullgraph=True)
    expected = bool(CUDNN_WIDE and CUDNN_VERSION is not None and CUDNN_VERSION >= 90900)
    assert torch.equal(compiled(q), q * expected)


def test_compiled_gradients_match_eager():
    torch._dynamo.reset()
    f = lambda q, k, v: adaattn.attention(q, k, v, is_causal=True).square().sum()  # noqa: E731
    inputs = [torch.randn(1, 2, 50, 16, requires_grad=True) for _ in range(3)]
    g_eager = torch.autograd.grad(f(*inputs), inputs)
    g_comp = torch.autograd.grad(torch.compile(f, fullgraph=True)(*inputs), inputs)
    for a, b in zip(g_eager, g_comp):
        assert torch.allclose(a, b, atol=1e-5)


def test_dynamic_lengths_recompile_at_most_once_per_bucket():
    torch._dynamo.reset()
    counter = CompileCounter()
    f = lambda q, k, v: adaattn.attention(q, k, v, is_causal=True) * 2  # noqa: E731
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    lengths = [100, 300, 1000, 2500, 4000]
    for n in lengths:
        q = torch.randn(1, 2, n, 16)
        assert torch.allclose(compiled(q, q, q), f(q, q, q), atol=1e-5)
    buckets = {_bucket(n) for n in lengths}
    assert buckets == {"short", "medium"}
    assert counter.frame_count <= len(buckets), f"{counter.frame_count} compilations for buckets {buckets}"


def test_module_compiles_without_graph_break():
    torch._dynamo.reset()
    m = adaattn.AdaAttention(32, 4, batch_first=True, num_kv_heads=2).eval()
    x = torch.randn(2, 20, 32)
    compiled = torch.compile(m, fullgraph=True)
    # need_weights=False: the adaattn.attention path (True forms MultiheadAttention's weights).
    got = compiled(x, x, x, is_causal=True, need_weights=False)[0]
    assert torch.allclose(got, m(x, x, x, is_causal=True, need_weights=False)[0], atol=1e-5)


def test_no_keys_compile_with_one_tensor_as_key_and_value():
    """A call with no key answers before any runner (base.no_keys); under torch.compile(fullgraph)
    a tensor passed as both key and value goes in once (a Function given one twice is refused)."""
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    k = torch.randn(1, 2, 0, 4, requires_grad=True)
    out = torch.compile(lambda q, k: adaattn.attention(q, k, k), fullgraph=True, backend="aot_eager")(q, k)
    dq, dk = torch.autograd.grad(out.sum(), (q, k))
    assert out.shape == (1, 2, 3, 4) and not out.any() and not dq.any() and dk.shape == k.shape
