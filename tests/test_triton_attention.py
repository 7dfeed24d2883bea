"""Our Triton attention kernels (forward and backward) against the float64 reference.

On a machine without CUDA the kernels run in the Triton interpreter (TRITON_INTERPRET=1,
set here before triton imports) at small sizes; tests marked `gpu` run on the GPU machine
(`pytest -m gpu tests/test_triton_attention.py`). Every output is poisoned with NaN before
the kernels run, so an element they fail to write fails the comparison.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import math  # noqa: E402
import warnings  # noqa: E402
from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

triton = pytest.importorskip("triton")

import adaattn  # noqa: E402
from adaattn import hardware, planner, settings, stats  # noqa: E402
from adaattn.backends import varlen  # noqa: E402
from adaattn.backends.triton import backward as tl_backward  # noqa: E402
from adaattn.backends.triton import common  # noqa: E402
from adaattn.backends.triton import configs as tc  # noqa: E402
from adaattn.backends.triton import forward as tl_forward  # noqa: E402
from adaattn.backends.triton import launch as tl_launch  # noqa: E402
from adaattn.backends.triton import ops as triton_ops  # noqa: E402
from adaattn.backends.triton import runner as ta  # noqa: E402
from adaattn.backends.triton import tuner as triton_tuner  # noqa: E402
from adaattn.backends.reference import reference_attention  # noqa: E402
from adaattn.backends.triton.common import KernelConfig  # noqa: E402
from adaattn.backends.triton.launch import launch_id, make_launch  # noqa: E402
from adaattn.kernels import attention_bwd as bwd_kernels  # noqa: E402
from adaattn.kernels import attention_fwd as fwd_kernels  # noqa: E402
from adaattn.problem import Problem, validate  # noqa: E402

from helpers import break_gluon, gluon_here, keep_mask, rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    # On a GPU the first fitting config runs: minutes of timing every candidate buy nothing
    # here; benchmarks/triton_attention_gpu.py checks the timed choices.
    monkeypatch.setattr(triton_tuner.CONFIGS, "tune", False)
    with settings.override(poison_outputs=True):
        yield


def emulate_gpu_glue(monkeypatch, smem=232448):
    """The launch glue as it runs on a GPU (config tables, shared-memory fit, timing, caching)
    with the kernels still interpreted: a fresh config chooser that times (do_bench returns 1)."""
    for module in (common, triton_tuner, tl_launch, tl_forward, tl_backward):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    monkeypatch.setattr(hardware, "max_shared_memory", lambda index: smem)
    chooser = triton_tuner.ConfigChooser()
    monkeypatch.setattr(triton_tuner, "CONFIGS", chooser)
    monkeypatch.setattr(tl_forward, "CONFIGS", chooser)
    monkeypatch.setattr(tl_backward, "CONFIGS", chooser)
    return chooser


def _randn(shape, dtype, gen, mult=1.0):
    return (torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.float32) * mult).to(dtype)


def _gen(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def bottom_right_keep(nq, nk, causal, window, device=DEVICE):
    """Written independently of the backend: query i sits at position i + nk - nq."""
    i = torch.arange(nq, device=device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=device)[None, :]
    keep = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if causal:
        keep = keep & (j <= i)
    if window is not None:
        if window[0] is not None:
            keep = keep & (j >= i - window[0])
        if window[1] is not None:
            keep = keep & (j <= i + window[1])
    return keep


def explicit_mask(nq, nk, causal, window, attn_mask, align):
    """The user mask with causal/window folded in, as a bool or additive SDPA mask."""
    if not causal and window is None:
        return attn_mask
    if align == "bottom_right":
        keep = bottom_right_keep(nq, nk, causal, window)
    else:
        keep = keep_mask(nq, nk, causal, window, DEVICE)
    if attn_mask is None:
        return keep
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


def sdpa_grads(q, k, v, mask, scale, dout, math_only=False):
    """torch SDPA in the inputs' dtype: output and (dq, dk, dv); NaN rows count as 0.
    math_only: torch's math backend (the precision issues name it as the peer)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    with sdpa_kernel(SDPBackend.MATH) if math_only else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    out.backward(dout)
    return [torch.nan_to_num(t) for t in (out, q.grad, k.grad, v.grad)]


def reference_grads(q, k, v, mask, scale, dout):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, mask, scale=scale)
    out.backward(dout.double())
    return [out, q.grad, k.grad, v.grad]


def assert_standard(ours, ref64, torch_out, what):
    """MEASURING.md: err(ours) <= 2 * err(torch in the same dtype) + 1e-6 against float64."""
    assert torch.isfinite(ours).all(), f"{what}: non-finite values (unwritten or overflowed)"
    e_ours, e_torch = rel_err(ours, ref64), rel_err(torch_out, ref64)
    assert e_ours <= 2 * e_torch + 1e-6, f"{what}: err(ours)={e_ours:.3e} > 2*err(torch)={2 * e_torch:.3e} + 1e-6"


def run_ours(q, k, v, attn_mask, causal, scale, window, align, variant="ptr", policy=None, ran=None):
    """Our attention: triton_attention with the forward `variant`, or, given a policy, the runner
    the planner picks under it (its name appended to `ran`): through adaattn.attention, read
    from adaattn.stats, for top-left calls; through the planner and the runner for bottom-right
    ones (adaattn.attention aligns top-left only, as SDPA)."""
    if policy is None:
        return ta.triton_attention(q, k, v, attn_mask, causal, scale, window, causal_alignment=align,
                                   variant=variant)
    gqa = q.shape[1] != k.shape[1]
    if align == "top_left":
        with stats.collect() as recs:
            out = adaattn.attention(q, k, v, attn_mask, is_causal=causal, scale=scale, enable_gqa=gqa, window=window,
                                    policy=policy)
        assert len(recs) == 1 and recs[0].fallbacks == (), recs
        ran.append(recs[0].backend)
        return out
    problem = replace(validate(q, k, v, attn_mask, 0.0, causal, scale, gqa, "bhsd", window), bottom_right=True)
    plan = planner.make_plan(problem, policy)
    ran.append(plan.backend)
    return plan.runner.run(q, k, v, attn_mask, problem, plan.launch)


def check_case(b=1, hq=2, hkv=None, nq=33, nk=None, d=32, dtype=torch.bfloat16, causal=False, window=None,
               attn_mask=None, align="top_left", scale=None, grad=True, seed=0, qk_mult=1.0, v_mult=1.0,
               variant="ptr", policy=None, ran=None, math_peer=False):
    """Run ours, torch SDPA (its math backend with math_peer) and the float64 reference on one
    problem and hold ours to the standard."""
    hkv = hq if hkv is None else hkv
    nk = nq if nk is None else nk
    g = _gen(seed)
    q = _randn((b, hq, nq, d), dtype, g, qk_mult).requires_grad_(grad)
    k = _randn((b, hkv, nk, d), dtype, g, qk_mult).requires_grad_(grad)
    v = _randn((b, hkv, nk, d), dtype, g, v_mult).requires_grad_(grad)
    out = run_ours(q, k, v, attn_mask, causal, scale, window, align, variant, policy, ran)
    assert out.shape == (b, hq, nq, d) and out.dtype == dtype
    mask = explicit_mask(nq, nk, causal, window, attn_mask, align)
    dout = _randn(out.shape, dtype, g)
    ref = reference_grads(q, k, v, mask, scale, dout)
    peer = sdpa_grads(q, k, v, mask, scale, dout, math_peer)
    assert_standard(out, ref[0], peer[0], "output")
    if grad:
        out.backward(dout)
        for name, ours, r, p in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref[1:], peer[1:]):
            assert_standard(ours, r, p, name)
    return out, q, k, v


@pytest.mark.parametrize(
    "nq,nk,d,dtype",
    [
        (1, 1, 16, torch.float32),
        (1, 77, 64, torch.bfloat16),
        (17, 17, 16, torch.float16),
        (17, 40, 40, torch.bfloat16),
        (127, 127, 64, torch.bfloat16),
        (127, 60, 80, torch.float32),
        (60, 127, 128, torch.float16),
        (200, 200, 48, torch.bfloat16),
    ],
)
def test_forward_and_gradients_match_reference(nq, nk, d, dtype):
    check_case(nq=nq, nk=nk, d=d, dtype=dtype, seed=nq * 1000 + nk + d)


def test_head_dim_256():
    check_case(hq=1, nq=40, nk=50, d=256, dtype=torch.bfloat16, causal=True, seed=256)


def test_head_dim_below_16_is_padded():
    check_case(hq=1, nq=20, nk=20, d=8, dtype=torch.float32, seed=8)


def test_several_batches_and_explicit_scale():
    check_case(b=3, hq=2, nq=45, nk=45, d=32, dtype=torch.float16, scale=0.3, seed=3)


@pytest.mark.parametrize("hq,hkv,causal", [(4, 2, False), (4, 1, True)])
def test_grouped_and_multi_query_attention(hq, hkv, causal):
    check_case(b=2, hq=hq, hkv=hkv, nq=37, nk=52, d=32, dtype=torch.bfloat16, causal=causal, seed=hq + hkv)


@pytest.mark.parametrize("nq,nk", [(17, 17), (50, 90), (90, 50), (127, 127)])
def test_causal_top_left_matches_sdpa(nq, nk):
    out, q, k, v = check_case(nq=nq, nk=nk, d=32, dtype=torch.float32, causal=True, seed=nq + 7 * nk)
    with torch.no_grad():
        peer = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_err(out, peer) < 1e-5


@pytest.mark.parametrize("nq,nk", [(1, 77), (20, 77), (77, 40), (64, 64)])
def test_causal_bottom_right_follows_kv_cache_convention(nq, nk):
    check_case(nq=nq, nk=nk, d=32, dtype=torch.bfloat16, causal=True, align="bottom_right", seed=nq + nk)


def test_bottom_right_equals_top_left_for_equal_lengths():
    g = _gen(11)
    q, k, v = (_randn((1, 2, 50, 32), torch.float32, g) for _ in range(3))
    a = ta.triton_attention(q, k, v, is_causal=True)
    b = ta.triton_attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "nq,nk,causal,window",
    [
        (100, 100, True, (8, None)),
        (90, 120, False, (16, 4)),
        (120, 90, False, (None, 3)),
        (70, 70, False, (5, None)),
        (64, 64, False, (0, 0)),
    ],
)
def test_sliding_window(nq, nk, causal, window):
    check_case(nq=nq, nk=nk, d=32, dtype=torch.bfloat16, causal=causal, window=window, seed=nq + nk)


def test_window_with_bottom_right_alignment():
    check_case(nq=30, nk=100, d=32, dtype=torch.float32, causal=True, window=(10, None),
               align="bottom_right", seed=5)


# Mask shapes broadcast over (B, H, Nq, Nk): batch/head/query dims may be 1 or absent.
MASK_SHAPES = [(2, 2, 33, 47), (2, 1, 33, 47), (1, 2, 33, 47), (33, 47), (2, 1, 1, 47), (1, 47)]


@pytest.mark.parametrize("shape", MASK_SHAPES)
def test_bool_mask_broadcast(shape):
    g = _gen(len(shape) * 10 + shape[0])
    mask = torch.rand(shape, generator=g, device=DEVICE) > 0.3
    check_case(b=2, hq=2, nq=33, nk=47, d=32, dtype=torch.bfloat16, attn_mask=mask, seed=1)


@pytest.mark.parametrize("shape", [(2, 1, 33, 47), (33, 47), (1, 2, 1, 47)])
def test_additive_mask_broadcast(shape):
    g = _gen(len(shape) + 100)
    mask = (torch.randn(shape, generator=g, device=DEVICE) * 2).to(torch.float16)
    check_case(b=2, hq=2, nq=33, nk=47, d=32, dtype=torch.float16, attn_mask=mask, seed=2)


def test_mask_combined_with_causal_and_gqa():
    g = _gen(4)
    mask = torch.rand((1, 4, 40, 40), generator=g, device=DEVICE) > 0.2
    check_case(b=1, hq=4, hkv=2, nq=40, d=32, dtype=torch.float32, causal=True, attn_mask=mask, seed=4)


def test_fully_masked_rows_give_zero_and_finite_gradients():
    nq, nk = 40, 50
    mask = torch.rand((nq, nk), generator=_gen(9), device=DEVICE) > 0.4
    mask[[0, 7, 31, 39]] = False
    out, q, k, v = check_case(nq=nq, nk=nk, d=32, dtype=torch.bfloat16, attn_mask=mask, seed=9)
    assert (out[:, :, [0, 7, 31, 39]] == 0).all()
    assert (q.grad[:, :, [0, 7, 31, 39]] == 0).all()


def test_fully_masked_rows_from_additive_minus_inf():
    nq, nk = 33, 20
    mask = torch.randn((nq, nk), generator=_gen(10), device=DEVICE)
    mask[5] = float("-inf")
    mask[:, 3] = float("-inf")
    out, *_ = check_case(nq=nq, nk=nk, d=16, dtype=torch.float32, attn_mask=mask, seed=10)
    assert (out[:, :, 5] == 0).all()


def test_rows_before_the_first_key_under_bottom_right_are_zero():
    out, *_ = check_case(nq=50, nk=20, d=32, dtype=torch.float32, causal=True, align="bottom_right", seed=12)
    assert (out[:, :, :30] == 0).all()


def test_invisible_tiles_are_skipped_not_just_masked():
    # NaN values in keys no query block can see: a kernel that loaded those tiles and only
    # masked them would turn 0 * NaN into NaN; one that skips them structurally stays finite.
    g = _gen(26)
    q, k, v = (_randn((1, 2, 128, 32), torch.float32, g) for _ in range(3))
    with triton_tuner.forced_configs(fwd=KernelConfig(32, 16, 4, 1)):
        v_late = v.clone()
        v_late[:, :, 96:] = float("nan")  # only the query block [96, 128) sees keys >= 96
        out = ta.triton_attention(q, k, v_late, is_causal=True)
        assert torch.isfinite(out[:, :, :96]).all()
        v_early = v.clone()
        v_early[:, :, :16] = float("nan")  # with a window of 8, only queries < 32 see keys < 16
        out = ta.triton_attention(q, k, v_early, window=(8, 0))
        assert torch.isfinite(out[:, :, 32:]).all()
        ref = reference_attention(q, k, v, window=(8, 0))
        assert rel_err(out[:, :, 32:], ref[:, :, 32:]) < 1e-5


@pytest.mark.xfail(DEVICE == "cpu", strict=False, reason=(
    "not strict: a clean-clone CI run at 12775f8 passed it (XPASS) where three before failed it; "
    "fails before the runner refactor too (2e4aa85): fp32 dv err 3.6e-5 > 2*err(torch) 7.6e-6 under the interpreter; "
    "the backward recomputes p = exp2(s*scale*log2e - lse*log2e) from the natural-log lse the forward stored as "
    "(m2 + log2 l)*ln2: the round trip of a |lse| ~ 1e2 value costs ~1e-5 relative in p"))
def test_large_logits():
    # |q . k| ~ 1e4: the online softmax must not overflow or lose the maximum.
    check_case(nq=45, nk=60, d=64, dtype=torch.float32, qk_mult=12.0, seed=13)
    check_case(nq=45, nk=60, d=64, dtype=torch.bfloat16, qk_mult=12.0, causal=True, seed=14)


def test_float16_near_overflow():
    # q . k sums past the fp16 range (fp32 accumulation needed) and values near its limit.
    check_case(nq=40, nk=40, d=64, dtype=torch.float16, qk_mult=25.0, v_mult=1e4, scale=1e-3, seed=15)


def test_empty_sequences():
    g = _gen(16)
    q = _randn((1, 2, 5, 16), torch.float32, g).requires_grad_()
    k = _randn((1, 2, 0, 16), torch.float32, g).requires_grad_()
    v = _randn((1, 2, 0, 16), torch.float32, g).requires_grad_()
    out = ta.triton_attention(q, k, v)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    q0 = _randn((1, 2, 0, 16), torch.float32, g)
    assert ta.triton_attention(q0, q0, q0).shape == (1, 2, 0, 16)


def test_non_contiguous_bshd_views():
    g = _gen(17)
    q, k, v = (_randn((2, 30, 2, 32), torch.bfloat16, g).transpose(1, 2) for _ in range(3))
    out = ta.triton_attention(q, k, v, is_causal=True)
    ref = reference_attention(q, k, v, is_causal=True)
    peer = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_standard(out, ref, peer, "output")


def test_log_sum_exp_is_saved_per_row():
    g = _gen(18)
    q, k, v = (_randn((1, 2, 37, 32), torch.float32, g) for _ in range(3))
    mask = torch.ones(37, 37, dtype=torch.bool, device=DEVICE)
    mask[3] = False
    _, lse, _ = triton_ops.triton_fwd(q, k, v, mask, None, None, 37, 37, launch_id(make_launch("ptr", 0.2, True)))
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.2
    s = s.masked_fill(~(mask & keep_mask(37, 37, True, None, DEVICE)), float("-inf"))
    expect = torch.logsumexp(s, -1)
    assert torch.isneginf(lse[:, :, 3]).all()
    finite = torch.isfinite(expect)
    assert torch.allclose(lse[finite].double(), expect[finite], atol=1e-5, rtol=1e-5)


def test_block_m_smaller_than_block_n():
    cfg = dict(fwd=KernelConfig(16, 32, 4, 1), dkdv=KernelConfig(32, 16, 4, 1), dkdv_atomic=KernelConfig(32, 16, 4, 1),
               dq=KernelConfig(16, 32, 4, 1))
    with triton_tuner.forced_configs(**cfg):
        for dq in ("atomic", "separate"):
            with settings.override(dq=dq):
                check_case(nq=70, nk=90, d=32, dtype=torch.bfloat16, causal=True, window=(20, None), seed=19)
                check_case(nq=70, nk=90, d=32, dtype=torch.float32, causal=True, align="bottom_right", seed=20)


@pytest.mark.parametrize("smem", [232448, 101376, 49152])  # H100, sm86/sm89, 48 KiB
def test_configs_fit_the_device_shared_memory(monkeypatch, smem):
    monkeypatch.setattr(hardware, "max_shared_memory", lambda index: smem)
    for kind in ("fwd", "dkdv", "dkdv_atomic", "dq"):
        for dtype in (torch.bfloat16, torch.float32):
            for d in (16, 40, 64, 128, 256):
                block_d = common.block_d(d)
                for mask_elem in (0, 1):
                    fit = tc.fitting_configs(kind, block_d, dtype, torch.device("cpu"), mask_elem)
                    assert fit, (kind, dtype, d)
                    elem = torch.empty((), dtype=dtype).element_size()
                    need = tc.shared_memory_estimate(kind, fit[0], block_d, elem, mask_elem)
                    assert need <= smem or fit[0].block_m == 16 or fit[0].block_n == 16
    # On Hopper the bf16 head_dim 128 forward keeps its large tiles.
    monkeypatch.setattr(hardware, "max_shared_memory", lambda index: 232448)
    assert tc.fitting_configs("fwd", 128, torch.bfloat16, torch.device("cpu"))[0] == KernelConfig(128, 128, 8, 3)


def test_padded_large_head_dims_leave_out_the_forward_configs_that_faulted(monkeypatch):
    # BM128/BN32/w8/s2 faulted at D 144-192 (BLOCK_D 256) under GQA (triton 3.6, H200; seed 5902
    # #17, #2777 under the Triton policy): padded large head dims take the other candidates.
    monkeypatch.setattr(hardware, "max_shared_memory", lambda index: 232448)
    cpu = torch.device("cpu")
    for dtype in (torch.float16, torch.bfloat16):
        whole = tc.fitting_configs("fwd", 256, dtype, cpu)
        assert whole[0] == KernelConfig(128, 32, 8, 2)
        padded = tc.fitting_configs("fwd", 256, dtype, cpu, padded=True)
        assert padded and padded == [c for c in whole if not (c.block_m == 128 and c.num_warps == 8)]
        assert padded != whole
        # Smaller classes and float32 keep their tables.
        assert tc.fitting_configs("fwd", 128, dtype, cpu, padded=True) == tc.fitting_configs("fwd", 128, dtype, cpu)
    assert tc.fitting_configs("fwd", 256, torch.float32, cpu, padded=True) == tc.fitting_configs("fwd", 256, torch.float32, cpu)


@pytest.mark.parametrize("d,dv,padded", [(160, 160, True), (256, 192, True), (256, 256, False)])
def test_the_forward_launch_offers_the_padded_candidate_list(monkeypatch, d, dv, padded):
    """The launch, not only fitting_configs: a padded large head dim's candidates leave out BM128/w8."""
    monkeypatch.setattr(hardware, "max_shared_memory", lambda index: 232448)
    offered = []

    class Recorder:
        def pick(self, kind, key, candidates, launch, output=None):
            offered.append(candidates() if callable(candidates) else candidates)
            return tc.INTERPRET_CONFIGS[kind]

    monkeypatch.setattr(tl_forward, "CONFIGS", Recorder())
    q = torch.randn(1, 4, 8, d, dtype=torch.float16)
    k = torch.randn(1, 2, 8, d, dtype=torch.float16)
    v = torch.randn(1, 2, 8, dv, dtype=torch.float16)
    launch = tl_launch.make_launch("ptr", d ** -0.5, False, -1, -1, False, False)
    out, _ = tl_forward.launch_fwd(q, k, v, None, None, None, 8, 8, launch)
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1))
    assert (out.float() - ref).abs().max() < 1e-2
    assert len(offered) == 1 and offered[0]
    has_w8 = any(c.block_m == 128 and c.num_warps == 8 for c in offered[0])
    assert has_w8 == (not padded)


def test_config_chooser_times_candidates_once_and_skips_failures(monkeypatch):
    chooser = triton_tuner.ConfigChooser()
    a, b, c = KernelConfig(64, 64), KernelConfig(128, 64), KernelConfig(128, 128)
    cost = {a: 2.0, c: 1.0}
    calls = []

    def launch(cfg):
        calls.append(cfg)
        if cfg == b:
            raise RuntimeError("out of resources")
        return cost[cfg]

    monkeypatch.setattr(triton_tuner, "interpreting", lambda: False)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn())
    assert chooser.pick("fwd", ("k",), [a, b, c], launch) == c
    assert chooser.pick("fwd", ("k",), [a, b, c], launch) == c
    assert calls == [a, b, c, c, a]  # each once, then the two fastest again; nothing on the second pick
    assert "RuntimeError" in chooser.timings[("fwd", ("k",))][str(b)]
    chooser.tune = False
    assert chooser.pick("fwd", ("other",), [a, b, c], launch) == a


def test_config_chooser_drops_a_config_that_writes_nan_where_another_does_not(monkeypatch):
    # A miscompiled config (triton 3.6 wrote NaN for one on an H100) must not win on speed.
    chooser = triton_tuner.ConfigChooser()
    a, b, c = KernelConfig(64, 64), KernelConfig(128, 64), KernelConfig(128, 128)
    cost = {a: 2.0, b: 1.5, c: 1.0}
    out = torch.zeros(4)

    def launch(cfg):
        out.fill_(float("nan") if cfg == c else 1.0)  # the fastest one is wrong
        return cost[cfg]

    monkeypatch.setattr(triton_tuner, "interpreting", lambda: False)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn())
    with pytest.warns(RuntimeWarning, match="wrote NaN or infinity"):
        assert chooser.pick("fwd", ("k",), [a, b, c], launch, lambda: out) == b
    assert "NaN" in chooser.timings[("fwd", ("k",))][str(c)]
    # Non-finite from every config (the inputs hold NaN): nothing to tell apart, speed decides.
    monkeypatch.setattr(torch, "isfinite", lambda t: torch.zeros_like(t, dtype=torch.bool))
    assert chooser.pick("fwd", ("nan inputs",), [a, b, c], launch, lambda: out) == c


@pytest.mark.skipif(DEVICE == "cuda", reason="emulates the GPU launch path on the CPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_launch_path_runs_under_the_interpreter(monkeypatch, dtype):
    # The glue as it runs on a GPU (config tables, shared-memory fit, timing, caching),
    # with the kernels still interpreted; bf16 is left out as the interpreter needs its
    # own dot for it.
    chooser = emulate_gpu_glue(monkeypatch)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    check_case(hq=2, hkv=1, nq=70, nk=150, d=64, dtype=dtype, causal=True, seed=27)
    kinds = {kind for kind, _ in chooser.chosen}
    assert kinds == {"fwd", "dkdv_atomic"}  # the default backward adds dq atomically
    with settings.override(dq="separate"):
        check_case(hq=2, hkv=1, nq=70, nk=150, d=64, dtype=dtype, causal=True, seed=28)
    assert {kind for kind, _ in chooser.chosen} == {"fwd", "dkdv_atomic", "dkdv", "dq"}


SM90_COMPILE = r"""
import json, re
from adaattn.backends.triton import configs as tc
from adaattn.kernels.attention_bwd import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel
from adaattn.kernels.attention_fwd import attention_fwd_kernel
from sm90 import compile_for_sm90 as compile_sm90

def compile_for_sm90(kernel, kind, d=128, tma=False, softcap=0.0, sinks=False, alibi=False, ds_split=False):
    cfg = tc.HALF_CONFIGS[kind][tc.d_class(d)][0]
    consts = dict(HEAD_DIM=d, BLOCK_D=d, HEAD_DIM_V=d, BLOCK_DV=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, IS_VARLEN=False,
                  BOTTOM_RIGHT=False, HAS_LEFT=False, HAS_RIGHT=True, MASK_KIND=0, DOT_PRECISION="tf32",
                  ATOMIC_DQ=kind == "dkdv_atomic", ROTATE=False, USE_TMA=tma, HEAD_MAJOR=False,
                  SCALE_POSITIVE=True, EXP_FMA=0, SOFTCAP=softcap, HAS_SINKS=sinks, HAS_ALIBI=alibi,
                  Stats=None, Flags=None, STORE_STATS=False, SPLIT_STATS=False,  # no split statistics
                  DS_SPLIT=ds_split)
    if not sinks:
        consts.update(Sinks=None)
    if not alibi:
        consts.update(Slopes=None)
    if not tma:
        consts.update(KDesc=None, VDesc=None)

    def types(name):
        if name.endswith("Desc"):  # a host tensor descriptor's (B, Hkv, Nk, D) box
            return f"tensordesc<bf16[1, 1, {cfg.block_n}, {d}]>"
        if name in ("LSE", "Delta", "DQAcc", "Sinks", "Slopes"):
            return "*fp32"
        if name.startswith("CuSeqlens"):
            return "*i32"
        if name[0].isupper():
            return "*bf16"
        return "fp32" if name.startswith("scale") else "i32"

    # Pointers and row strides as the launcher sees them for contiguous tensors.
    def divisible(name, ty):
        return ty[0] == "*" or re.fullmatch(r"stride_(q|k|v|o|do|dq|dk|dv)[bhmn]", name) is not None

    c = compile_sm90(kernel, consts, types, divisible, cfg.num_warps, cfg.num_stages)
    ptx = c["ptx"]
    return {"kind": kind + ("_tma" if tma else "") + ("_softcap" if softcap else "") + ("_sinks" if sinks else "")
            + ("_alibi" if alibi else "") + ("_ds_split" if ds_split else ""),
            "smem": c["smem"], "wgmma": "wgmma" in ptx,
            "stack": c["stack"], "tma": "cp.async.bulk.tensor" in ptx,
            "mma_sync": "mma.sync" in ptx,
            "vector_red": bool(re.search(r"red\.global\.gpu\.relaxed\.add\.v[24]\.f32", ptx)),
            "atom": bool(re.search(r"\batom\.global", ptx))}

print(json.dumps([compile_for_sm90(attention_fwd_kernel, "fwd"),
                  compile_for_sm90(attention_bwd_dkdv_kernel, "dkdv"),
                  compile_for_sm90(attention_bwd_dq_kernel, "dq"),
                  compile_for_sm90(attention_bwd_dkdv_kernel, "dkdv_atomic"),
                  compile_for_sm90(attention_fwd_kernel, "fwd", tma=True),
                  # score modifiers: soft-capping in every kernel that recomputes scores, sinks in the forward
                  compile_for_sm90(attention_fwd_kernel, "fwd", softcap=50.0 * 1.4426950408889634, sinks=True),
                  compile_for_sm90(attention_bwd_dkdv_kernel, "dkdv_atomic", softcap=50.0 * 1.4426950408889634),
                  compile_for_sm90(attention_bwd_dq_kernel, "dq", softcap=50.0 * 1.4426950408889634),
                  compile_for_sm90(attention_fwd_kernel, "fwd", alibi=True),
                  compile_for_sm90(attention_bwd_dkdv_kernel, "dkdv_atomic", alibi=True),
                  compile_for_sm90(attention_bwd_dq_kernel, "dq", alibi=True),
                  # ds in two roundings (calls torch answers with its math kernel)
                  compile_for_sm90(attention_bwd_dkdv_kernel, "dkdv_atomic", ds_split=True),
                  compile_for_sm90(attention_bwd_dq_kernel, "dq", ds_split=True)]))
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU tests compile for the real device")
def test_kernels_compile_for_hopper_without_spills():
    # Compiled (not interpreted) for sm90 with the ptxas shipped in triton, no GPU needed:
    # the first config of each kernel must use wgmma, fit shared memory and not spill.
    pytest.importorskip("triton.compiler")
    import sm90

    for r in sm90.run_json(SM90_COMPILE):
        assert r["wgmma"] and not r["mma_sync"], r
        assert r["smem"] <= 232448, r
        if r["kind"].startswith("dkdv_atomic"):
            # One product more than dkdv: a small spill is the price (triton 3.9, first config
            # 64/128/8/2: 856 bytes; it still measured fastest on the H100 with triton 3.6, see
            # results/2026-11-22-triton-variants-h100.json); dq goes out as vectorised
            # fire-and-forget reductions, never as atomics that return a value.
            # Soft-capped, the tanh tile stays live until ds (the chain factor): 1064 bytes (triton 3.9);
            # what that costs is for the GPU timing of the softcap line (issue 49).
            assert r["stack"] is None or r["stack"] <= (1536 if "softcap" in r["kind"] else 1024), r
            assert r["vector_red"] and not r["atom"], r
        else:
            assert r["atom"] is False and r["stack"] in (0, None), r
        # The "tma" forward loads K/V with bulk tensor copies; the others never do.
        assert r["tma"] == r["kind"].endswith("_tma"), r


def test_config_choice_keys_on_length_buckets():
    assert common.length_bucket(1) == 1
    assert common.length_bucket(1000) == common.length_bucket(1024) == 1024
    assert common.length_bucket(10**6) == 16384


def assert_bitwise_deterministic_gradients(q, k, v, dout):
    """Two backward runs with deterministic=True give bitwise-equal dq, dk, dv."""
    grads = []
    for _ in range(2):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        ta.triton_attention(qq, kk, vv, is_causal=True, deterministic=True).backward(dout)
        grads.append((qq.grad, kk.grad, vv.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_gradients_are_bitwise_deterministic():
    g = _gen(21)
    q, k, v = (_randn((1, 4, 70, 32), torch.bfloat16, g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    assert_bitwise_deterministic_gradients(q, k, v, _randn((1, 4, 70, 32), torch.bfloat16, g))


def spy_launches(monkeypatch, name):
    """Grids of every launch of backward kernel `name` (launch_bwd imports it from
    kernels/attention_bwd.py when it runs)."""
    calls = []
    kernel = getattr(bwd_kernels, name)

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

    monkeypatch.setattr(bwd_kernels, name, Spy())
    return calls


@pytest.fixture
def dq_mode(request):
    """Run the test under settings.override(dq=<the parameter>)."""
    with settings.override(dq=request.param):
        yield request.param


def _fully_masked_row_mask(nq, nk, seed):
    m = torch.rand(1, 1, nq, nk, generator=_gen(seed), device=DEVICE) > 0.3
    m[..., 5, :] = False
    return m


ATOMIC_DQ_CASES = {
    "causal": dict(nq=70, d=32, causal=True, seed=40),
    "fp16 short q long k": dict(nq=17, nk=127, d=64, dtype=torch.float16, seed=41),
    "gqa bottom-right causal": dict(hq=4, hkv=2, nq=127, nk=100, d=48, causal=True, align="bottom_right", seed=42),
    "fp32 window": dict(nq=90, d=16, dtype=torch.float32, window=(20, 5), seed=43),
    "bool mask, fully masked row": dict(nq=60, nk=80, d=32, attn_mask=_fully_masked_row_mask(60, 80, 44), seed=44),
    "one query one key": dict(nq=1, nk=1, d=16, seed=45),
    "head dim 80, two batches": dict(b=2, nq=33, nk=65, d=80, causal=True, seed=46),
}


@pytest.mark.parametrize("dq_mode", ["atomic", "atomic_rotate"], indirect=True)
@pytest.mark.parametrize("case", list(ATOMIC_DQ_CASES))
def test_atomic_dq_mode_matches_reference(monkeypatch, dq_mode, case):
    # dq added with atomics inside the dk/dv pass (no dq kernel) meets the standard, with dq,
    # dk, dv and the fp32 accumulator all poisoned before the kernels run.
    dq_launches = spy_launches(monkeypatch, "attention_bwd_dq_kernel")
    dkdv_launches = spy_launches(monkeypatch, "attention_bwd_dkdv_kernel")
    check_case(**ATOMIC_DQ_CASES[case])
    assert dq_launches == [] and len(dkdv_launches) == 1


@pytest.mark.parametrize("fill", ["finfo.min", -200.0])
@pytest.mark.parametrize("dq_mode", ["atomic", "separate"], indirect=True)
def test_rows_masked_with_large_negative_biases_get_finite_exact_gradients(dq_mode, fill):
    # Nk = 20 is not a multiple of BLOCK_N, so the last key block is partial; a row whose
    # scores are all very negative (the Hugging Face padding mask) once made the atomic dq NaN.
    g = _gen(48)
    q, k, v = (_randn((1, 1, n, 16), torch.float32, g) for n in (16, 20, 20))
    m = torch.zeros(1, 1, 16, 20, device=DEVICE)
    m[..., 3, :] = torch.finfo(torch.float32).min if fill == "finfo.min" else fill
    dout = _randn((1, 1, 16, 16), torch.float32, g)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    ta.triton_attention(qq, kk, vv, attn_mask=m).backward(dout)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    # The float64 reference, not SDPA in float64: torch's CPU flash kernel, which SDPA picks
    # there, has the lse bug the split row statistics fixed (p = 1 on the fully masked row).
    reference_attention(q64, k64, v64, m.double()).backward(dout.double())
    for ours, ref in ((qq.grad, q64.grad), (kk.grad, k64.grad), (vv.grad, v64.grad)):
        assert torch.isfinite(ours).all()
        assert rel_err(ours, ref) <= 1e-5


BIAS_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dq_mode", ["atomic", "separate"], indirect=True)
@pytest.mark.parametrize("dtype", BIAS_DTYPES)
def test_large_constant_bias_gradients_meet_the_standard(dq_mode, dtype):
    # A constant -1e4 bias leaves softmax unchanged but puts every score near -1.4e4 (log2
    # domain), where an fp32 lse keeps only ~1e-3 of log2(sum): every recomputed p of the
    # row was scaled (gradient errors 2-3x SDPA's). Split row statistics keep them exact.
    mask = torch.full((40, 48), -1e4, dtype=dtype, device=DEVICE)
    check_case(hq=2, nq=40, nk=48, d=32, dtype=dtype, attn_mask=mask, causal=True, seed=51, math_peer=True)


@pytest.mark.parametrize("dq_mode", ["atomic", "separate"], indirect=True)
def test_float16_finfo_min_masks_meet_the_standard(dq_mode):
    # Hugging Face's padding mask in fp16: masked keys at finfo(fp16).min (-65504), two rows
    # masked entirely (they give the mean of V, and their gradients are those of uniform p).
    g = _gen(51)
    mask = torch.zeros(1, 2, 36, 44, dtype=torch.float16, device=DEVICE)
    mask.masked_fill_(torch.rand(1, 2, 36, 44, generator=g, device=DEVICE) > 0.6, torch.finfo(torch.float16).min)
    mask[..., [4, 30], :] = torch.finfo(torch.float16).min
    check_case(hq=2, nq=36, nk=44, d=32, dtype=torch.float16, attn_mask=mask, seed=51, math_peer=True)


@pytest.mark.parametrize("dq_mode", ["atomic", "separate"], indirect=True)
def test_scores_next_to_a_large_bias_keep_float64_precision(dq_mode):
    # A -1e4 bias that varies per key (and a window): fp32 keeps a score added to it to ~1e-3 in
    # one rounding, which left out and gradients ~1e-4 off float64 (torch's own error is of that
    # size; seed 5840 #511 was ours 2.3x torch's by luck). The kernels carry the sum's residual.
    g = _gen(55)
    q, k, v = (_randn((1, 2, n, 32), torch.float32, g) for n in (40, 48, 48))
    mask = -1e4 + torch.randn(1, 2, 40, 48, generator=g, device=DEVICE)
    mask[..., 7, :] = float("-inf")  # a row masked with -inf everywhere: zeros
    dout = _randn((1, 2, 40, 32), torch.float32, g)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = ta.triton_attention(qq, kk, vv, attn_mask=mask, window=(30, 4))
    out.backward(dout)
    keep = torch.ones(40, 48, dtype=torch.bool, device=DEVICE).tril(4).triu(-30)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, mask.double().masked_fill(~keep, float("-inf")))
    ref.backward(dout.double())
    assert rel_err(out, ref) <= 2e-6
    for ours, exact in ((qq.grad, q64.grad), (kk.grad, k64.grad), (vv.grad, v64.grad)):
        assert rel_err(ours, exact) <= 5e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_query_seeing_one_key_under_a_large_bias_gets_dv_equal_to_do(dtype):
    # Each query sees exactly one key (its own), under a constant -1e4 bias: p = 1 exactly, so
    # dv = do. Before split row statistics p was 1 +- 7e-4 (torch's math path is exact).
    n = 40
    mask = torch.full((n, n), float("-inf"), device=DEVICE)
    mask.fill_diagonal_(-1e4)
    g = _gen(52)
    q, k, v = (_randn((1, 2, n, 32), dtype, g).requires_grad_() for _ in range(3))
    dout = _randn((1, 2, n, 32), dtype, g)
    out = ta.triton_attention(q, k, v, attn_mask=mask.to(dtype))
    out.backward(dout)
    if dtype == torch.float16:
        assert torch.equal(out, v.detach())
        assert torch.equal(v.grad, dout)
    else:  # float32 carries the scores' residual past -1e4: p = exp2(lo) / exp2(lo), within an ulp of 1
        assert rel_err(out, v.detach()) <= 2e-7 and rel_err(v.grad, dout) <= 2e-7


@pytest.mark.parametrize("dq_mode", ["atomic", "separate"], indirect=True)
@pytest.mark.parametrize("dtype", BIAS_DTYPES)
def test_rows_masked_entirely_with_finfo_min_get_float64_gradients(dq_mode, dtype):
    # SDPA (and float64) give such a row the mean of V: uniform p = 1/Nk, and gradients through
    # it. The fp32 lse of (-2.9e38 + log2 Nk) kept no trace of Nk, so the backward used p = 1.
    nq, nk = 24, 20
    mask = torch.zeros(1, 1, nq, nk, dtype=dtype, device=DEVICE)
    mask[..., [3, 17], :] = torch.finfo(dtype).min
    mask[..., 9, :5] = torch.finfo(dtype).min
    out, q, k, v = check_case(hq=2, nq=nq, nk=nk, d=16, dtype=dtype, attn_mask=mask, seed=53, math_peer=True)
    if dtype != torch.float16:  # -3.4e38 absorbs q . k: the row is the mean of V (fp16's -65504 does not)
        mean_v = v.detach().double().mean(2)
        assert torch.allclose(out[:, :, 3].double(), mean_v, atol=1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dq_mode", ["atomic", "separate"], indirect=True)
def test_split_statistics_only_where_a_head_needs_them(dq_mode):
    # GQA 4/2: only query head 1 holds rows masked with finfo.min (its flag goes up, the split
    # form runs there); the others keep the one-subtraction form. Both must meet the standard.
    mask = torch.randn(1, 4, 30, 34, generator=_gen(54), device=DEVICE)
    mask[0, 1, [2, 11, 29]] = torch.finfo(torch.float32).min
    out, q, k, v = check_case(hq=4, hkv=2, nq=30, nk=34, d=16, dtype=torch.float32, attn_mask=mask, seed=54,
                              math_peer=True)
    assert torch.allclose(out[0, 1, 11].double(), v.detach()[0, 0].double().mean(0), atol=1e-6)


@pytest.mark.parametrize("dq_mode", ["atomic"], indirect=True)
def test_deterministic_follows_torch_use_deterministic_algorithms(monkeypatch, dq_mode):
    dq_launches = spy_launches(monkeypatch, "attention_bwd_dq_kernel")
    g = _gen(49)
    q, k, v = (_randn((1, 2, 40, 32), torch.bfloat16, g).requires_grad_() for _ in range(3))
    torch.use_deterministic_algorithms(True)
    try:
        ta.triton_attention(q, k, v, is_causal=True).backward(torch.ones(1, 2, 40, 32, dtype=torch.bfloat16,
                                                                          device=DEVICE))
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(dq_launches) == 1  # the atomic-free dq pass ran


def test_deterministic_ignores_the_atomic_dq_mode(monkeypatch):
    g = _gen(47)
    q, k, v = (_randn((1, 2, 50, 32), torch.bfloat16, g) for _ in range(3))
    dout = _randn((1, 2, 50, 32), torch.bfloat16, g)

    def grads(mode, deterministic):
        with settings.override(dq=mode):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            ta.triton_attention(qq, kk, vv, is_causal=True, deterministic=deterministic).backward(dout)
        return qq.grad, kk.grad, vv.grad

    separate = grads("separate", False)
    dq_launches = spy_launches(monkeypatch, "attention_bwd_dq_kernel")
    for a, b in zip(grads("atomic", True), separate):
        assert torch.equal(a, b)
    assert len(dq_launches) == 1
    grads("atomic", False)
    assert len(dq_launches) == 1
    with pytest.raises(ValueError, match="dq must be one of"):
        grads("sideways", False)


@pytest.mark.skipif(DEVICE == "cuda", reason="emulates the GPU launch path on the CPU")
@pytest.mark.parametrize("dq_mode", ["atomic"], indirect=True)
def test_atomic_dq_config_timing_does_not_add_twice(monkeypatch, dq_mode):
    # The config chooser runs the atomic dk/dv kernel several times while timing it; each
    # run adds into the dq accumulator, which must be zeroed again before the next.
    chooser = emulate_gpu_glue(monkeypatch)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), fn(), 1.0)[2])
    check_case(hq=2, hkv=1, nq=70, nk=150, d=64, dtype=torch.float16, causal=True, seed=48)
    check_case(hq=2, hkv=1, nq=70, nk=150, d=64, dtype=torch.float32, causal=True, seed=49)
    assert {kind for kind, _ in chooser.chosen} == {"fwd", "dkdv_atomic"}


def spy_fwd_launches(monkeypatch):
    """(grid, USE_TMA, HEAD_MAJOR) of every forward kernel launch."""
    calls = []
    kernel = fwd_kernels.attention_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append((grid, kwargs.get("USE_TMA", False), kwargs.get("HEAD_MAJOR", False)))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(fwd_kernels, "attention_fwd_kernel", Spy())
    return calls


FWD_VARIANT_CASES = {
    # name: (check_case arguments, whether the "tma" variant may use descriptors there)
    "causal bf16": (dict(nq=70, d=32, causal=True, seed=50), True),
    "fp16 odd lengths": (dict(nq=127, nk=60, d=64, dtype=torch.float16, seed=51), True),
    "gqa bottom-right": (dict(hq=4, hkv=2, nq=40, nk=90, d=32, causal=True, align="bottom_right", seed=52), True),
    "window": (dict(nq=90, d=16, window=(20, 5), seed=53), True),
    "one key": (dict(nq=5, nk=1, d=16, seed=54), True),
    "bool mask: pointers": (dict(nq=60, nk=80, d=32, attn_mask=_fully_masked_row_mask(60, 80, 55), seed=55), False),
    "fp32: pointers": (dict(nq=50, d=32, dtype=torch.float32, causal=True, seed=56), False),
    "head dim 80: pointers": (dict(nq=50, d=80, causal=True, seed=57), False),
    "negative scale: pointers": (dict(nq=40, d=32, scale=-0.2, seed=58), False),
}


# adaattn.attention aligns causal masks top-left (as SDPA); bottom-right cases go to the
# runner through the planner (run_ours).


def _runner_cases(cases):
    return list(cases)


@pytest.mark.parametrize("fwd,grid_order", [("tma", "query_major"), ("ptr", "head_major"), ("tma", "head_major")])
@pytest.mark.parametrize("case", _runner_cases(FWD_VARIANT_CASES))
def test_forward_variants_match_reference(monkeypatch, fwd, grid_order, case):
    # Each forward runner meets the standard (gradients too, which run from its output and
    # lse); the planner runs triton.tma (K/V through tensor descriptors) where it takes the call
    # and triton.ptr (pointer loads) elsewhere; "head_major" swaps the grid axes.
    args, tma_possible = FWD_VARIANT_CASES[case]
    calls = spy_fwd_launches(monkeypatch)
    ran = []
    with settings.override(fwd_grid=grid_order):
        check_case(**args, policy=adaattn.Policy(backends=(f"triton.{fwd}", "triton.ptr")), ran=ran)
    assert ran == ["triton.tma" if fwd == "tma" and tma_possible else "triton.ptr"]
    assert len(calls) == 1
    grid, use_tma, head_major = calls[0]
    assert use_tma == (fwd == "tma" and tma_possible)
    assert head_major == (grid_order == "head_major")
    b, hq = args.get("b", 1), args.get("hq", 2)
    assert (grid[0] if head_major else grid[1]) == b * hq


WS_CASES = {
    # name: (check_case arguments, whether the warp-specialised forward may run it)
    "causal bf16": (dict(nq=70, d=64, causal=True, seed=60), True),
    "fp16 odd lengths": (dict(nq=127, nk=60, d=64, dtype=torch.float16, seed=61), True),
    "gqa bottom-right": (dict(hq=4, hkv=2, nq=40, nk=90, d=64, causal=True, align="bottom_right", seed=62), True),
    "rows before the first key": (dict(nq=90, nk=40, d=64, causal=True, align="bottom_right", seed=63), True),
    "head dim 128, two batches": (dict(b=2, nq=50, nk=70, d=128, seed=64), True),
    "one key": (dict(nq=5, nk=1, d=64, seed=65), True),
    "left window": (dict(nq=90, d=64, window=(20, 0), seed=66), True),
    "left window, causal, gqa bottom-right": (dict(hq=4, hkv=2, nq=40, nk=90, d=64, causal=True, window=(17, 0),
                                                   align="bottom_right", seed=71), True),
    "left window, rows before the first key": (dict(nq=90, nk=40, d=128, causal=True, window=(9, 0),
                                                    align="bottom_right", seed=72), True),
    "left window, no right bound": (dict(nq=70, nk=100, d=64, window=(30, None), seed=73), True),
    "right window: general kernel": (dict(nq=90, d=64, window=(20, 5), seed=74), False),
    "bool mask: general kernel": (dict(nq=60, nk=80, d=64, attn_mask=_fully_masked_row_mask(60, 80, 67), seed=67),
                                  False),
    "fp32: general kernel": (dict(nq=50, d=64, dtype=torch.float32, causal=True, seed=68), False),
    "head dim 32: general kernel": (dict(nq=50, d=32, causal=True, seed=69), False),
    "negative scale: general kernel": (dict(nq=40, d=64, scale=-0.2, seed=70), False),
}


def spy_launch(monkeypatch, module, name):
    """Count the calls of module.<name>, which still runs."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    return calls


def spy_ws_launches(monkeypatch):
    return spy_launch(monkeypatch, tl_forward, "_launch_fwd_ws")


@pytest.mark.parametrize("case", _runner_cases(WS_CASES))
def test_warp_specialised_forward_matches_reference(monkeypatch, case):
    # kernels/attention_fwd_ws.py (tensor-descriptor loads, one branch-free key loop, masks as
    # selects) meets the standard where the triton.ws runner takes the call, gradients included
    # (they use its lse); calls outside its scope run the general kernel (triton.ptr).
    args, ws_possible = WS_CASES[case]
    ws_calls = spy_ws_launches(monkeypatch)
    general = spy_fwd_launches(monkeypatch)
    ran = []
    check_case(**args, policy=adaattn.Policy(backends=("triton.ws", "triton.ptr")), ran=ran)
    assert ran == ["triton.ws" if ws_possible else "triton.ptr"]
    assert (len(ws_calls), len(general)) == ((1, 0) if ws_possible else (0, 1))


@pytest.mark.parametrize("variant,d", [("tma", 32), ("ws", 64)])
@pytest.mark.parametrize("nq,nk", [(40, 90), (90, 40)])
def test_descriptor_forwards_align_bottom_right(monkeypatch, variant, d, nq, nk):
    # The descriptor kernels themselves (triton_attention's variant), bottom-right aligned with
    # grouped heads, and rows before the first key: what the runner cases above cannot reach.
    ws_calls = spy_ws_launches(monkeypatch)
    general = spy_fwd_launches(monkeypatch)
    out, *_ = check_case(hq=4, hkv=2, nq=nq, nk=nk, d=d, causal=True, align="bottom_right", variant=variant,
                         seed=nq + nk + d)
    if variant == "ws":
        assert (len(ws_calls), len(general)) == (1, 0)
    else:
        assert ws_calls == [] and [c[1] for c in general] == [True]
    if nq > nk:
        assert (out[:, :, :nq - nk] == 0).all()


SM90_WS_COMPILE = r"""
import json
from adaattn.backends.triton import configs as tc
from adaattn.kernels.attention_fwd_ws import attention_fwd_ws_kernel as kernel
from sm90 import ws_kernel_rows

def types_for(d, cfg):
    def types(name):
        if name.endswith("Desc"):
            return f"tensordesc<bf16[1, 1, {cfg.block_n}, {d}]>"
        if name == "LSE":
            return "*fp32"
        if name[0].isupper():
            return "*bf16"
        return "fp32" if name.startswith("scale") else "i32"
    return types

# Without a window and with a left one (a runtime flag would fail to compile: HAS_LEFT is constexpr).
print(json.dumps([row for left in (False, True)
                  for row in ws_kernel_rows(kernel, lambda d: tc.HALF_CONFIGS["fwd_ws"][tc.d_class(d)][0], types_for,
                                            {"HAS_LEFT": left}, {"tma": "cp.async.bulk.tensor", "wgmma": "wgmma"})]))
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU tests compile for the real device")
def test_warp_specialised_forward_compiles_for_hopper_with_producer_and_two_consumer_groups():
    # The pass is picky (an early return, a branch in the loop or a pointer load of Q turns it
    # off or crashes it): the first config must come out specialised, 3 warp groups of 4 warps
    # (a TMA producer and two consumers), on wgmma, within shared memory, without spills; with
    # and without a left window.
    pytest.importorskip("triton.compiler")
    import sm90

    if not hardware.warp_specialisation_available():
        pytest.skip("this triton has no warp_specialize")
    rows = sm90.run_json(SM90_WS_COMPILE)
    assert len(rows) == 8
    sm90.assert_warp_specialised(rows, ("tma", "wgmma"))


BWD_WS_CASES = {
    # name: (check_case arguments, whether the warp-specialised backward takes it)
    "causal bf16": (dict(nq=70, d=64, causal=True, seed=80), True),
    "fp16 odd lengths, not causal": (dict(nq=127, nk=60, d=64, dtype=torch.float16, seed=81), True),
    "gqa bottom-right": (dict(hq=4, hkv=2, nq=40, nk=90, d=64, causal=True, align="bottom_right", seed=82), True),
    "rows before the first key": (dict(nq=90, nk=40, d=64, causal=True, align="bottom_right", seed=83), True),
    "head dim 128, two batches": (dict(b=2, nq=50, nk=70, d=128, seed=84), True),
    "one key": (dict(nq=5, nk=1, d=64, seed=85), True),
    "causal window": (dict(hq=4, hkv=2, nq=90, d=64, window=(20, 0), seed=86), True),
    "causal window, bottom-right": (dict(nq=40, nk=100, d=128, window=(7, 0), align="bottom_right", seed=87), True),
    "band window: general kernels": (dict(nq=60, d=64, window=(9, 4), seed=88), False),
    "bool mask: general kernels": (dict(nq=60, nk=80, d=64, attn_mask=_fully_masked_row_mask(60, 80, 89), seed=89),
                                   False),
    "fp32: general kernels": (dict(nq=50, d=64, dtype=torch.float32, causal=True, seed=90), False),
    "head dim 32: general kernels": (dict(nq=50, d=32, causal=True, seed=91), False),
    "negative scale: general kernels": (dict(nq=40, d=64, scale=-0.2, seed=92), False),
}


def spy_bwd_ws(monkeypatch):
    return spy_launch(monkeypatch, tl_backward, "_launch_bwd_ws")


@pytest.mark.parametrize("case", _runner_cases(BWD_WS_CASES))
def test_warp_specialised_backward_matches_reference(monkeypatch, case):
    # kernels/attention_bwd_ws.py (dk/dv and dq passes, tensor-descriptor loads, one branch-free
    # loop each, masks as selects) meets the standard wherever it takes the backward; calls
    # outside its scope run the general kernels.
    args, ws_possible = BWD_WS_CASES[case]
    calls = spy_bwd_ws(monkeypatch)
    ran = []
    with settings.override(bwd_ws="on"):
        check_case(**args, policy=adaattn.Policy(backends=("triton.ptr",)), ran=ran)
    assert ran == ["triton.ptr"] and len(calls) == (1 if ws_possible else 0)


@pytest.mark.parametrize("dq_mode", ["atomic", "separate"])
def test_warp_specialised_backward_is_bitwise_reproducible_and_follows_the_setting(monkeypatch, dq_mode):
    # No atomics: every gradient element is written by one program in a fixed order. "off" and
    # "auto" off Hopper run the general kernels (which agree to rounding).
    calls = spy_bwd_ws(monkeypatch)
    g = _gen(93)
    q, k, v = (_randn((1, 4, 70, 64), torch.bfloat16, g).requires_grad_() for _ in range(3))
    dout = _randn((1, 4, 70, 64), torch.bfloat16, g)
    pol = adaattn.Policy(backends=("triton.ptr",))

    def grads(**over):
        with settings.override(dq=dq_mode, **over):
            out = adaattn.attention(q, k, v, is_causal=True, policy=pol)
            return torch.autograd.grad(out, (q, k, v), dout)

    first, second = grads(bwd_ws="on"), grads(bwd_ws="on")
    assert len(calls) == 2 and all(torch.equal(a, b) for a, b in zip(first, second))
    general = grads(bwd_ws="off")
    if DEVICE != "cuda":  # "auto" takes the warp-specialised kernels on Hopper only
        assert all(torch.equal(a, b) for a, b in zip(grads(bwd_ws="auto"), general))
    assert len(calls) == 2
    for a, b in zip(first, general):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


SM90_BWD_WS_COMPILE = r"""
import json
from adaattn.backends.triton import configs as tc
from adaattn.kernels import attention_bwd_ws as m
from sm90 import ws_kernel_rows

def types_for(varlen):
    def for_d(d, cfg):
        def types(name):
            # Packed (varlen) Q/dO/K/V go as tensors: the kernels make their descriptors.
            if name in ("QDesc", "DODesc"):
                return "*bf16" if varlen else f"tensordesc<bf16[1, 1, {cfg.block_m}, {d}]>"
            if name in ("KDesc", "VDesc"):
                return "*bf16" if varlen else f"tensordesc<bf16[1, 1, {cfg.block_n}, {d}]>"
            if name == "StatDesc":
                return f"tensordesc<fp32[{cfg.block_m}]>"
            if name == "Stat":
                return "*fp32"
            if name in ("CuQ", "CuK"):
                return "*i32"
            if name[0].isupper():
                return "*bf16"
            return "fp32" if name.startswith("scale") else "i32"
        return types
    return for_d

rows = {}
for kind, kernel in (("dkdv_ws", m.attention_bwd_dkdv_ws_kernel), ("dq_ws", m.attention_bwd_dq_ws_kernel)):
    rows[kind] = [row for varlen in (False, True)
                  for row in ws_kernel_rows(kernel, lambda d, kind=kind: tc.HALF_CONFIGS[kind][tc.d_class(d)][0],
                                            types_for(varlen), {"HAS_LEFT": False, "IS_VARLEN": varlen,
                                                                "DS_SPLIT": False},
                                            {"tma": "cp.async.bulk.tensor", "wgmma": "wgmma"})]
print(json.dumps(rows))
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU tests compile for the real device")
def test_warp_specialised_backward_compiles_for_hopper_with_producer_and_two_consumer_groups():
    # As the forward: each kernel's first config comes out specialised (a TMA producer and two
    # consumer groups of 4 warps), on wgmma, within shared memory, without spills. (Pointer loads
    # of the row statistics, or a host descriptor with a (BLOCK_M,) box, crash the pass.)
    pytest.importorskip("triton.compiler")
    import sm90

    if not hardware.warp_specialisation_available():
        pytest.skip("this triton has no warp_specialize")
    rows = sm90.run_json(SM90_BWD_WS_COMPILE)
    for kind in ("dkdv_ws", "dq_ws"):
        sm90.assert_warp_specialised(rows[kind], ("tma", "wgmma"))


@pytest.mark.parametrize("fwd,d,dtype", [("tma", 32, torch.bfloat16), ("ws", 64, torch.float16)])
def test_descriptor_forwards_read_strided_views(fwd, d, dtype):
    # BSHD views: 16-byte aligned strides, so the descriptors take them as they are.
    g = _gen(59)
    storage = [_randn((2, 30, 2, d), dtype, g) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in storage)
    out = ta.triton_attention(q, k, v, is_causal=True, variant=fwd)
    ref = reference_attention(q, k, v, is_causal=True)
    peer = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_standard(out, ref, peer, "output")
    assert all(common.tma_ok(t) for t in (q, k, v))
    problem = validate(q, k, v, None, 0.0, True, None, False, "bhsd", None)
    assert problem.tma_aligned and ta.TritonRunner(fwd).supports(problem, adaattn.Policy()) == []
    # The runner on the same views, through adaattn.attention with layout="bshd".
    with stats.collect() as recs:
        via_runner = adaattn.attention(*storage, is_causal=True, layout="bshd",
                                       policy=adaattn.Policy(backends=(f"triton.{fwd}",)))
    assert [r.backend for r in recs] == [f"triton.{fwd}"]
    assert torch.equal(via_runner.transpose(1, 2), out)
    # A view whose row stride is not a multiple of 16 bytes cannot be described.
    odd = _randn((1, 2, 30, 36), torch.bfloat16, g)[..., :32]  # rows 72 bytes apart
    assert not common.tma_ok(odd)
    odd_problem = validate(odd, odd, odd, None, 0.0, False, None, False, "bhsd", None)
    assert not odd_problem.tma_aligned
    assert any("16-byte" in r for r in ta.TritonRunner(fwd).supports(odd_problem, adaattn.Policy()))
    if fwd == "tma":  # launched anyway, the glue hands the kernel an aligned copy (pointer_ready)
        odd_ref = reference_attention(odd, odd, odd)
        assert_standard(ta.triton_attention(odd, odd, odd, variant=fwd), odd_ref,
                        F.scaled_dot_product_attention(odd, odd, odd), "output")
    else:  # the warp-specialised forward takes head dims 64 and 128 only
        with pytest.raises(ValueError, match="cannot run this launch"):
            ta.triton_attention(odd, odd, odd, variant=fwd)


def test_settings_and_variants_reject_unknown_names_and_bad_values():
    with pytest.raises(ValueError, match="unknown setting"):
        with settings.override(fwd_speed="fast"):
            pass
    with pytest.raises(ValueError, match="unknown setting"):  # the forward variant is a runner now
        with settings.override(fwd="tma"):
            pass
    for name, bad in (("dq", "sideways"), ("fwd_grid", "diagonal"), ("exp_fma", "3"), ("fp8_level_qk", "int4"),
                      ("bwd_ws", "sometimes")):
        with pytest.raises(ValueError, match=f"{name} must be one of"):
            with settings.override(**{name: bad}):
                pass
    with pytest.raises(ValueError, match="ADAATTN_TRITON_DQ"):
        settings.from_environment({"ADAATTN_TRITON_DQ": "sideways"})
    with pytest.warns(RuntimeWarning, match="ADAATTN_TRITON_FWD"):
        settings.from_environment({"ADAATTN_TRITON_FWD": "tma"})
    q = torch.randn(1, 1, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="variant must be one of"):
        ta.triton_attention(q, q, q, variant="texture")
    with pytest.raises(ValueError, match="unknown runners"):
        adaattn.Policy(backends=("triton.texture",))
    # A descriptor variant asked for a call it cannot take raises (never a silent switch of kernel).
    qh = q.to(torch.bfloat16)
    with pytest.raises(ValueError, match="cannot run this launch"):
        ta.triton_attention(qh, qh, qh, attn_mask=torch.ones(4, 4, dtype=torch.bool, device=DEVICE), variant="tma")


def test_eager_calls_skip_the_custom_op_and_match_it(monkeypatch):
    # Eager calls run launch_fwd directly (no gradient wanted) or through _EagerAttention (a
    # gradient wanted): the custom op's dispatch costs host time comparable to a short kernel.
    # Under a torch-function mode (as under a compiler or a transform) the custom op runs. Both
    # give the same output and gradients, bit for bit, and neither is differentiable twice.
    from torch.overrides import TorchFunctionMode

    class Watching(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    ops = []
    real = triton_ops.triton_fwd
    monkeypatch.setattr(triton_ops, "triton_fwd", lambda *a: ops.append(1) or real(*a))
    g = _gen(60)
    q, k, v = (_randn((1, 2, 20, 16), torch.bfloat16, g).requires_grad_() for _ in range(3))
    go = _randn((1, 2, 20, 16), torch.bfloat16, g)
    with torch.no_grad():
        a = ta.triton_attention(q, k, v, is_causal=True)
    assert ops == []
    b = ta.triton_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
    assert ops == [] and torch.equal(a, b)
    c = ta.triton_attention(q, k, v, is_causal=True)
    assert ops == [] and torch.equal(a, c) and c.requires_grad
    eager = torch.autograd.grad(c, (q, k, v), go)
    with Watching():
        d = ta.triton_attention(q, k, v, is_causal=True)
    assert ops == [1] and torch.equal(a, d) and d.requires_grad
    through_op = torch.autograd.grad(d, (q, k, v), go)
    assert all(torch.equal(x, y) for x, y in zip(eager, through_op))
    dq, = torch.autograd.grad(ta.triton_attention(q, k, v, is_causal=True), q, go, create_graph=True)
    with pytest.raises(RuntimeError, match="no second-order gradients"):
        torch.autograd.grad(dq.sum(), q)
    with Watching():
        dq, = torch.autograd.grad(ta.triton_attention(q, k, v, is_causal=True), q, go, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        torch.autograd.grad(dq.sum(), q)


def test_bad_arguments_are_rejected():
    q = torch.randn(1, 4, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="causal_alignment"):
        ta.triton_attention(q, q, q, is_causal=True, causal_alignment="bottom")
    with pytest.raises(ValueError, match="multiple"):
        ta.triton_attention(q, q[:, :3], q[:, :3])
    with pytest.raises(TypeError, match="dtype"):
        ta.triton_attention(q.double(), q.double(), q.double())
    with pytest.raises(ValueError, match="broadcast"):
        ta.triton_attention(q, q, q, attn_mask=torch.ones(3, 4, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="4-D"):
        ta.triton_attention(q[0], q[0], q[0])


def _packed(lengths_q, lengths_k, hq, hkv, d, dtype, seed):
    g = _gen(seed)
    q = _randn((sum(lengths_q), hq, d), dtype, g).requires_grad_()
    k = _randn((sum(lengths_k), hkv, d), dtype, g).requires_grad_()
    v = _randn((sum(lengths_k), hkv, d), dtype, g).requires_grad_()
    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), dtype=torch.int32, device=DEVICE)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize(
    "lengths_q,lengths_k,causal,window,align",
    [
        ([17, 1, 40, 0, 23], [17, 1, 40, 0, 23], True, None, "top_left"),
        ([5, 30, 12], [20, 30, 7], False, None, "top_left"),
        ([5, 30, 12], [20, 30, 7], True, (6, None), "bottom_right"),
    ],
)
@pytest.mark.parametrize("dq_mode", ["separate", "atomic"], indirect=True)
def test_varlen_matches_per_sequence_reference(lengths_q, lengths_k, causal, window, align, dq_mode):
    check_varlen_case(lengths_q, lengths_k, 4, 2, 32, causal, window, align)


def check_varlen_case(lengths_q, lengths_k, hq, hkv, d, causal, window, align, dtype=torch.bfloat16):
    """varlen_attention forward and backward on packed sequences against float64 and SDPA per
    sequence, through the varlen.triton runner."""
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, hq, hkv, d, dtype, seed=sum(lengths_q))
    with stats.collect() as recs:
        out = adaattn.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), is_causal=causal,
                                       window=window, causal_alignment=align)
    assert [r.backend for r in recs] == ["varlen.triton"]
    dout = _randn(out.shape, dtype, _gen(1))
    out.backward(dout)
    # Reference and SDPA per sequence, packed back; compared over the whole packed tensors
    # (a one-key sequence has dq = 0 exactly, which no relative error of its own can judge).
    refs = [torch.zeros_like(t, dtype=torch.float64) for t in (q, q, k, v)]
    peers = [torch.zeros_like(t) for t in (q, q, k, v)]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(lengths_q)):
        if lengths_q[i] == 0:
            continue
        sl_q, sl_k = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        qs, ks, vs = (t.detach()[s].transpose(0, 1)[None] for t, s in ((q, sl_q), (k, sl_k), (v, sl_k)))
        mask = explicit_mask(lengths_q[i], lengths_k[i], causal, window, None, align)
        do_s = dout[sl_q].transpose(0, 1)[None]
        for packed, got in ((refs, reference_grads(qs, ks, vs, mask, None, do_s)),
                            (peers, sdpa_grads(qs, ks, vs, mask, None, do_s))):
            for j, (t, sl) in enumerate(zip(got, (sl_q, sl_q, sl_k, sl_k))):
                packed[j][sl] = t[0].transpose(0, 1)
    for name, ours, r, p in zip(("output", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), refs, peers):
        assert_standard(ours, r, p, name)


VARLEN_WS_CASES = {
    # name: (lengths_q, lengths_k, hq, hkv, d, causal, window, align)
    "causal, empty and one-row documents": ([37, 1, 70, 0, 23], None, 2, 2, 64, True, None, "top_left"),
    "gqa, head dim 128": ([50, 33], None, 4, 2, 128, True, None, "top_left"),
    "bottom-right, keys longer": ([5, 30, 12], [20, 45, 7], 2, 1, 64, True, None, "bottom_right"),
    "not causal": ([40, 17], [21, 60], 2, 2, 64, False, None, "top_left"),
    "causal window": ([70, 44], None, 2, 2, 64, True, (9, 0), "top_left"),
}


@pytest.mark.parametrize("case", list(VARLEN_WS_CASES))
def test_varlen_backward_runs_the_warp_specialised_kernels_and_matches_float64(monkeypatch, case):
    # Packed documents through the warp-specialised backward: descriptors made in the kernel over
    # each sequence's rows, so no tile reads or writes the next document; empty documents included.
    lengths_q, lengths_k, hq, hkv, d, causal, window, align = VARLEN_WS_CASES[case]
    calls = spy_bwd_ws(monkeypatch)
    with settings.override(bwd_ws="on"):
        check_varlen_case(lengths_q, lengths_k or lengths_q, hq, hkv, d, causal, window, align)
    assert len(calls) == 1


@pytest.mark.parametrize("bwd_ws,dq", [("off", "atomic"), ("off", "separate"), ("on", "separate")])
def test_half_precision_gradients_at_a_small_scale_meet_the_standard(bwd_ws, dq):
    # ds * scale cast to fp16 fell into subnormals at scale 1e-4 (a fuzzer: dq 5.6e-3 against
    # SDPA's 5.5e-4): the kernels scale dq and dk in fp32 after the products, as FlashAttention.
    g = _gen(40)
    q = _randn((1, 2, 64, 64), torch.float16, g).requires_grad_()
    k, v = (_randn((1, 2, 128, 64), torch.float16, g).requires_grad_() for _ in range(2))
    dout = _randn((1, 2, 64, 64), torch.float16, g)
    with settings.override(bwd_ws=bwd_ws, dq=dq):
        out = adaattn.attention(q, k, v, scale=1e-4, policy=adaattn.Policy(backends=("triton",)))
        grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = reference_grads(q, k, v, None, 1e-4, dout)[1:]
    peers = sdpa_grads(q, k, v, None, 1e-4, dout)[1:]
    for name, ours, r, p in zip(("dq", "dk", "dv"), grads, refs, peers):
        assert_standard(ours, r, p, name)


@pytest.mark.parametrize("runner,bwd_ws", [("varlen.triton", "off"), ("varlen.triton", "on"), ("varlen.sdpa", "off")])
def test_varlen_rows_past_the_last_sequence_give_zeros_and_zero_gradients(runner, bwd_ws):
    # Packed tensors may be longer than cu_seqlens[-1] (a buffer of fixed size): those rows belong
    # to no sequence, give 0 as documented, and get zero gradients; the sequences' rows are as
    # without the padding. (A fuzzer found them unwritten: NaN or garbage from the kernels.)
    lengths = [20, 13]
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, 4, 2, 64, torch.float16, seed=31)
    g = _gen(32)
    pad = lambda t, n: torch.cat([t.detach(), _randn((n,) + tuple(t.shape[1:]), t.dtype, g)]).requires_grad_()
    qp, kp, vp = pad(q, 5), pad(k, 3), pad(v, 3)
    pol = adaattn.Policy(backends=(runner,))
    with settings.override(bwd_ws=bwd_ws, poison_outputs=True):
        out = adaattn.varlen_attention(q, k, v, cu_q, cu_k, 20, 20, is_causal=True, policy=pol)
        outp = adaattn.varlen_attention(qp, kp, vp, cu_q, cu_k, 20, 20, is_causal=True, policy=pol)
        dout = _randn(outp.shape, torch.float16, g)
        grads = torch.autograd.grad(out, (q, k, v), dout[:33])
        gradsp = torch.autograd.grad(outp, (qp, kp, vp), dout)
    assert (outp[33:] == 0).all() and torch.equal(outp[:33], out)
    for name, got, want in zip(("dq", "dk", "dv"), gradsp, grads):
        assert (got[33:] == 0).all(), name
        assert torch.equal(got[:33], want), name


def test_varlen_without_any_work_is_still_differentiable():
    # No sequence has both rows and keys: SDPA gives zeros with zero gradients, and so must a
    # packed call (the fuzzer's autograd.grad raised "does not require grad").
    q = torch.randn(5, 2, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(0, 2, 16, device=DEVICE, requires_grad=True)
    v = torch.randn(0, 2, 16, device=DEVICE, requires_grad=True)
    cu_q = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 0], dtype=torch.int32, device=DEVICE)
    out = adaattn.varlen_attention(q, k, v, cu_q, cu_k, 5, 0)
    assert (out == 0).all() and out.requires_grad
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert (dq == 0).all() and dk.shape == k.shape and dv.shape == v.shape


def test_varlen_fallback_agrees_with_kernels(monkeypatch):
    q, k, v, cu_q, cu_k = _packed([9, 25, 3], [9, 25, 14], 2, 1, 16, torch.float32, seed=22)
    with stats.collect() as recs:
        ours = adaattn.varlen_attention(q, k, v, cu_q, cu_k, 25, 25, is_causal=True)
        named = adaattn.varlen_attention(q, k, v, cu_q, cu_k, 25, 25, is_causal=True,
                                         policy=adaattn.Policy(backends=("varlen.sdpa",)))
        # Where our kernels decline the call, the planner runs the per-sequence SDPA runner.
        monkeypatch.setattr(varlen, "triton_reasons", lambda *a: ["forced fallback"])
        planner.reset()
        fallback = adaattn.varlen_attention(q, k, v, cu_q, cu_k, 25, 25, is_causal=True)
    assert [r.backend for r in recs] == ["varlen.triton", "varlen.sdpa", "varlen.sdpa"]
    assert rel_err(ours, fallback) < 1e-5 and rel_err(ours, named) < 1e-5


def test_varlen_rejects_inconsistent_offsets():
    q = torch.randn(10, 2, 16, device=DEVICE)
    cu = torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens"):
        adaattn.varlen_attention(q, q, q, cu, torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE), 10, 10)
    with pytest.raises(ValueError, match="3-D"):
        adaattn.varlen_attention(q[None], q[None], q[None], cu, cu, 10, 10)


def test_custom_ops_pass_opcheck():
    g = _gen(23)
    q, k, v = (_randn((1, 2, 20, 16), torch.float32, g).requires_grad_() for _ in range(3))
    mask = torch.rand((20, 20), generator=g, device=DEVICE) > 0.3
    causal = launch_id(make_launch("ptr", 0.25, True))
    windowed = launch_id(make_launch("ptr", 0.25, False, 3, -1, bottom_right=True, deterministic=True))
    torch.library.opcheck(triton_ops.triton_fwd, (q, k, v, None, None, None, 20, 20, causal))
    torch.library.opcheck(triton_ops.triton_fwd, (q, k, v, mask, None, None, 20, 20, windowed))
    # Views with transposed strides: the fake outputs must be laid out as the real ones.
    qt, kt, vt = (_randn((1, 20, 2, 16), torch.float32, g).transpose(1, 2).requires_grad_() for _ in range(3))
    torch.library.opcheck(triton_ops.triton_fwd, (qt, kt, vt, None, None, None, 20, 20, causal))
    qp, kp, vp = (_randn((30, 2, 16), torch.float32, g).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(triton_ops.triton_fwd, (qp, kp, vp, None, cu, cu, 20, 20, causal))
    # The backward op on its own, from the forward's outputs.
    out, lse, stats = triton_ops.triton_fwd(q.detach(), k.detach(), v.detach(), mask, None, None, 20, 20, windowed)
    dout = _randn(out.shape, torch.float32, g)
    torch.library.opcheck(triton_ops.triton_bwd, (dout, q.detach(), k.detach(), v.detach(), out, lse, mask, None,
                                                  None, 20, 20, windowed, stats))


def test_compiles_with_fullgraph_and_no_graph_break():
    g = _gen(24)
    q, k, v = (_randn((1, 2, 24, 16), torch.float32, g).requires_grad_() for _ in range(3))

    def f(q, k, v):
        return ta.triton_attention(q, k, v, is_causal=True).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    compiled(q, k, v).backward()
    eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    f(*eager).backward()
    for a, b in zip((q.grad, k.grad, v.grad), (t.grad for t in eager)):
        assert torch.equal(a, b)


def _problem(**over):
    base = dict(batch=1, q_heads=2, kv_heads=2, q_len=16, kv_len=16, head_dim=64, value_dim=64,
                dtype=torch.bfloat16, device_type=DEVICE, device_index=0 if DEVICE == "cuda" else None,
                causal=False, window_left=-1, window_right=-1, mask_kind="none", dropout_p=0.0, scale=0.125,
                needs_grad=False, layout="bhsd", tma_aligned=True)
    base.update(over)
    return Problem(**base)


def test_runners_decline_with_reasons(monkeypatch):
    policy = adaattn.Policy()
    runners = {name: ta.TritonRunner(name) for name in ("ws", "tma", "ptr")}
    assert [r.name for r in runners.values()] == ["triton.ws", "triton.tma", "triton.ptr"]
    for runner in runners.values():  # what every variant declines
        assert runner.supports(_problem(), policy) == []
        assert any("float64" in r for r in runner.supports(_problem(dtype=torch.float64), policy))
        assert any("256" in r for r in runner.supports(_problem(head_dim=512, value_dim=512), policy))
        assert any("dropout" in r for r in runner.supports(_problem(dropout_p=0.1), policy))
        assert any("varlen" in r for r in runner.supports(_problem(varlen=True), policy))
    ptr, tma, ws = runners["ptr"], runners["tma"], runners["ws"]
    # What the pointer forward takes and the descriptor forwards do not.
    for over, why in ((dict(mask_kind="bool"), "attn_mask"), (dict(dtype=torch.float32), "float16/bfloat16"),
                      (dict(head_dim=80, value_dim=80), "power-of-two"), (dict(tma_aligned=False), "16-byte"),
                      (dict(scale=-0.1), "positive scale")):
        assert ptr.supports(_problem(**over), policy) == []
        for runner in (tma, ws):
            assert any(why in r for r in runner.supports(_problem(**over), policy)), (runner, over)
    # What only the warp-specialised forward declines.
    for over, why in ((dict(window_left=8, window_right=4), "left window only"),
                      (dict(head_dim=32, value_dim=32), "head_dim 64 or 128")):
        assert tma.supports(_problem(**over), policy) == []
        assert any(why in r for r in ws.supports(_problem(**over), policy)), over
    for over in (dict(causal=True), dict(window_left=8), dict(window_left=8, window_right=0),
                 dict(causal=True, window_left=8, window_right=4)):  # a left window, the right bound at most causal
        assert ws.supports(_problem(head_dim=128, value_dim=128, **over), policy) == [], over
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for runner in runners.values():
        assert any("CUDA" in r for r in runner.supports(_problem(device_type="cpu", device_index=None), policy))


def test_a_settings_override_reaches_a_repeated_call(monkeypatch):
    calls = spy_fwd_launches(monkeypatch)
    q = _randn((1, 2, 16, 32), torch.bfloat16, _gen(26))
    policy = adaattn.Policy(backends=("triton.ptr",))
    adaattn.attention(q, q, q, policy=policy)
    with settings.override(fwd_grid="head_major"):
        adaattn.attention(q, q, q, policy=policy)
    assert [head_major for _, _, head_major in calls] == [False, True]


@pytest.mark.parametrize("name", ["triton.ws", "triton.tma", "triton.ptr"])
def test_runner_runs_through_attention(name):
    assert name in planner.REGISTRY
    g = _gen(25)
    q, k, v = (_randn((1, 2, 30, 64), torch.bfloat16, g) for _ in range(3))
    policy = adaattn.Policy(backends=(name,))
    assert adaattn.explain(q, k, v, is_causal=True, policy=policy).chosen == name
    with stats.collect() as recs:
        out = adaattn.attention(q, k, v, is_causal=True, policy=policy)
    assert [r.backend for r in recs] == [name]
    peer = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_standard(out, reference_attention(q, k, v, is_causal=True), peer, "output")


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,d,causal", [(1000, 64, False), (1000, 128, True), (2048, 256, True), (4096, 128, False)])
def test_gpu_medium_sizes(n, d, causal, dtype):
    check_case(b=2, hq=4, hkv=2, nq=n, nk=n, d=d, dtype=dtype, causal=causal, seed=n + d)


@gpu
@needs_cuda
def test_gpu_masks_windows_and_unequal_lengths():
    mask = torch.rand((2, 1, 700, 1300), device=DEVICE) > 0.2
    check_case(b=2, hq=4, hkv=1, nq=700, nk=1300, d=128, causal=True, attn_mask=mask, seed=1)
    check_case(b=2, hq=4, nq=700, nk=1300, d=128, causal=True, align="bottom_right", seed=2)
    check_case(b=1, hq=4, nq=2000, nk=2000, d=64, window=(256, 0), seed=3)


@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_long_sequence_memory_is_linear(causal):
    n, h, d = 131072, 8, 128
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    g = _gen(5)
    q, k, v = (_randn((1, h, n, d), torch.bfloat16, g).requires_grad_() for _ in range(3))
    base = torch.cuda.memory_allocated()
    out = ta.triton_attention(q, k, v, is_causal=causal)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # out, dout, dq, dk, dv and row statistics: a few times one input, far below N^2 bytes.
    linear = q.numel() * q.element_size()
    assert peak < 8 * linear and peak < 0.2 * n * n, f"peak {peak / 2**30:.2f} GiB is not linear in N"
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    # A sample of query rows against all keys, in float64.
    rows = torch.tensor([0, 1, 4097, n // 2, n - 1], device=DEVICE)
    s = (q[0, :, rows].double() @ k[0].double().transpose(-1, -2)) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.arange(n, device=DEVICE)[None, None, :] > rows[None, :, None], float("-inf"))
    ref = torch.softmax(s, -1) @ v[0].double()
    assert rel_err(out[0, :, rows], ref) < 1e-2


@gpu
@needs_cuda
def test_gpu_compile_fullgraph_and_cuda_graph_replay():
    g = _gen(6)
    q, k, v = (_randn((2, 8, 1024, 128), torch.bfloat16, g).requires_grad_() for _ in range(3))

    def f(q, k, v):
        return ta.triton_attention(q, k, v, is_causal=True)

    compiled = torch.compile(f, fullgraph=True)
    out = compiled(q, k, v)
    out.backward(torch.ones_like(out))
    eager = f(q, k, v)
    assert torch.equal(out, eager)

    # CUDA graph: configs are chosen on the warm-up call; capture and replay the raw ops.
    # deterministic=True: the atomic dq sums in a timing-dependent order, so only the
    # atomic-free backward can be compared bitwise between replay and eager.
    args = (q.detach(), k.detach(), v.detach(), None, None, None, 1024, 1024,
            launch_id(make_launch("ptr", 128 ** -0.5, True, deterministic=True)))
    o, lse, _ = triton_ops.triton_fwd(*args)
    dout = torch.randn_like(o)
    triton_ops.triton_bwd(dout, *args[:3], o, lse, *args[3:])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, lse_g, _ = triton_ops.triton_fwd(*args)
        dq_g, dk_g, dv_g = triton_ops.triton_bwd(dout, *args[:3], o_g, lse_g, *args[3:])
    for _ in range(2):
        q.data.copy_(torch.randn_like(q))
        graph.replay()
        o_e, lse_e, _ = triton_ops.triton_fwd(*args)
        dq_e, dk_e, dv_e = triton_ops.triton_bwd(dout, *args[:3], o_e, lse_e, *args[3:])
        torch.cuda.synchronize()
        for a, b in ((o_g, o_e), (dq_g, dq_e), (dk_g, dk_e), (dv_g, dv_e)):
            assert torch.equal(a, b)


@gpu
@needs_cuda
def test_gpu_gradients_are_bitwise_deterministic():
    g = _gen(7)
    q = _randn((2, 16, 4096, 128), torch.bfloat16, g)
    k, v = (_randn((2, 4, 4096, 128), torch.bfloat16, g) for _ in range(2))
    assert_bitwise_deterministic_gradients(q, k, v, torch.randn_like(q))


@gpu
@needs_cuda
def test_gpu_varlen():
    lengths = [1, 511, 2048, 17, 1000]
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, 8, 2, 128, torch.bfloat16, seed=8)
    out = adaattn.varlen_attention(q, k, v, cu_q, cu_k, max(lengths), max(lengths), is_causal=True)
    c = cu_q.tolist()
    for i in range(len(lengths)):
        s = slice(c[i], c[i + 1])
        qs, ks, vs = (t.detach()[s].transpose(0, 1)[None] for t in (q, k, v))
        ref = reference_attention(qs, ks, vs, is_causal=True)
        peer = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        assert_standard(out[s].transpose(0, 1)[None], ref, peer, f"seq {i}")


@gpu
@needs_cuda
@pytest.mark.parametrize("n", [8192, 3000])
def test_gpu_gradients_at_the_gpt_training_shape(n):
    # The shipped GPT: 6 query heads over 2 KV heads of 64, causal, bf16, context 8192.
    check_case(b=1, hq=6, hkv=2, nq=n, nk=n, d=64, dtype=torch.bfloat16, causal=True, seed=n)


# The Gluon forward (kernels/attention_fwd_gluon.py): one of the triton.ws runner's kernels on
# Hopper. It does not run in the interpreter; the CPU checks that it compiles for sm90 into the
# three partitions it is written as, and the GPU holds it to the standard.

GLUON_SM90_COMPILE = r'''
import json, re
from triton.experimental.gluon import language as gl
from adaattn.backends.triton.configs import HALF_CONFIGS
from adaattn.kernels.attention_fwd_gluon import attention_fwd_gluon_kernel as fn
from sm90 import compile_for_sm90

rows = []
for d, d_class in ((64, "small_d"), (128, "mid_d")):
    for cfg, varlen in [(cfg, varlen) for cfg in HALF_CONFIGS["fwd_gluon"][d_class] for varlen in (False, True)]:
        causal = cfg.num_stages == 3  # both mask forms over the configs
        left = causal and d == 128  # and a left window under causal
        half = cfg.block_m // 2
        ql = gl.NVMMASharedLayout.get_default_for([1, 1, half, d], gl.bfloat16)
        kl = gl.NVMMASharedLayout.get_default_for([1, 1, cfg.block_n, d], gl.bfloat16)
        types = {"q_desc": f"tensordesc<bf16[1,1,{half},{d}],{ql!r}>", "LSE": "*fp32", "scale_log2": "fp32",
                 "k_desc": f"tensordesc<bf16[1,1,{cfg.block_n},{d}],{kl!r}>", "CuQ": "*i32", "CuK": "*i32",
                 "O": "*bf16"}
        types["o_desc"], types["v_desc"] = types["q_desc"], types["k_desc"]
        # Packed sequences (VARLEN): sequence bounds from CuQ / CuK, outputs at a sequence's end by row.
        consts = dict(HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages,
                      CAUSAL=causal, BOTTOM_RIGHT=causal, HAS_LEFT=left)
        consts.update(VARLEN=varlen, **({} if varlen else dict(CuQ=None, CuK=None, O=None)))
        c = compile_for_sm90(fn, consts, lambda name: types.get(name, "i32"), lambda name, t: False,
                             cfg.num_warps, cfg.num_stages)
        ptx = c["ptx"]
        rows.append({"d": d, "cfg": str(cfg), "left": left, "varlen": varlen, "smem": c["smem"], "stack": c["stack"],
                     "threads": [int(t) for t in re.findall(r"reqntid (\d+)", ptx)],
                     "regs": sorted(set(int(r) for r in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
                     "wgmma": ptx.count("wgmma.mma_async"), "tma": "cp.async.bulk.tensor" in ptx,
                     "stores": ptx.count("st.global")})
print(json.dumps(rows))
'''


@pytest.mark.slow
def test_gluon_forward_compiles_for_sm90_into_its_partitions():
    """Every Gluon config compiles for sm90 with this triton, dense and for packed sequences: two
    consumer warp groups and a loader (12 warps, registers moved to the consumers), wgmma products
    and TMA copies, within shared memory, and without spills beyond a few registers (triton 3.6,
    where it is measured: none; triton 3.9: 112-128 bytes a thread at D=128 BN128/s2)."""
    from adaattn import hardware

    if not hardware.gluon_available():
        pytest.skip("this triton has no Gluon warp_specialize over (function, args) pairs")
    import sm90

    rows = sm90.run_json(GLUON_SM90_COMPILE)
    assert len(rows) == 8 and sum(r["varlen"] for r in rows) == 4
    for dense, packed in zip(rows[::2], rows[1::2]):  # a packed sequence's last rows leave by row
        assert not dense["varlen"] and packed["varlen"] and packed["stores"] > dense["stores"], (dense, packed)
    for r in rows:
        assert r["threads"] == [384] and r["wgmma"] > 0 and r["tma"], r
        assert 240 in r["regs"] and 24 in r["regs"], r
        assert r["smem"] <= 232448 and (r["stack"] or 0) <= 128, r


@pytest.mark.parametrize("field,variable", [("fwd_gluon", "ADAATTN_TRITON_FWD_GLUON"),
                                            ("bwd_gluon", "ADAATTN_TRITON_BWD_GLUON")])
def test_gluon_settings_are_checked(field, variable):
    with pytest.raises(ValueError, match=field):
        settings.Settings(**{field: "on"})
    assert getattr(settings.from_environment({variable: "off"}), field) == "off"


@pytest.mark.parametrize("here", ["gluon_fwd_here", "gluon_bwd_here"])
def test_gluon_kernels_are_not_used_off_hopper_or_in_the_interpreter(here):
    assert not getattr(common, here)(torch.zeros(1))


def gluon_config(d: int, i: int) -> KernelConfig:
    return tc.HALF_CONFIGS["fwd_gluon"][tc.d_class(d)][i]


@gpu
@needs_cuda
@pytest.mark.parametrize("ci", [0, 1])
@pytest.mark.parametrize(
    "b,hq,hkv,nq,nk,d,dtype,causal,align,window",
    [
        (1, 2, 2, 128, 128, 128, torch.bfloat16, False, "top_left", None),
        (2, 4, 2, 1000, 1000, 128, torch.bfloat16, True, "top_left", None),
        (1, 4, 4, 777, 1500, 64, torch.bfloat16, True, "bottom_right", None),
        (1, 4, 4, 1500, 777, 64, torch.float16, True, "bottom_right", None),
        (1, 4, 4, 1500, 777, 128, torch.float16, True, "top_left", None),
        (2, 8, 2, 2048, 2048, 128, torch.bfloat16, True, "top_left", None),
        (1, 2, 1, 17, 300, 64, torch.bfloat16, False, "top_left", None),
        (1, 2, 1, 300, 17, 128, torch.bfloat16, True, "top_left", None),
        (1, 2, 2, 1, 4100, 128, torch.bfloat16, False, "top_left", None),
        (1, 4, 2, 2000, 2000, 128, torch.bfloat16, True, "top_left", (300, 0)),
        (1, 4, 4, 1000, 1700, 64, torch.float16, True, "bottom_right", (129, 0)),
        (1, 4, 4, 1700, 1000, 128, torch.bfloat16, True, "bottom_right", (64, 0)),
        (1, 2, 2, 777, 900, 128, torch.bfloat16, False, "top_left", (200, None)),
    ],
)
def test_gpu_gluon_forward_meets_the_standard(b, hq, hkv, nq, nk, d, dtype, causal, align, window, ci):
    """Each Gluon config, forced, through the triton.ws runner (left windows included); gradients
    through the backward from its log-sum-exp."""
    if not gluon_here():
        pytest.skip("the Gluon forward runs on Hopper with triton >= 3.6 only")
    ran = []
    with triton_tuner.forced_configs(fwd_ws=gluon_config(d, ci)), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a Gluon failure would warn and run the Triton kernel
        check_case(b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dtype=dtype, causal=causal, align=align, window=window,
                   policy=adaattn.Policy(backends=("triton.ws",)), ran=ran, seed=nq + nk + d + ci)
    assert ran == ["triton.ws"]


@gpu
@needs_cuda
def test_gpu_gluon_forward_failure_falls_back_to_the_triton_kernel_with_one_warning(monkeypatch):
    if not gluon_here():
        pytest.skip("the Gluon forward runs on Hopper with triton >= 3.6 only")
    break_gluon(monkeypatch, tl_forward, "_launch_fwd_gluon")
    g = _gen(21)
    q, k, v = (_randn((1, 4, 500, 128), torch.bfloat16, g) for _ in range(3))
    policy = adaattn.Policy(backends=("triton.ws",))
    with triton_tuner.forced_configs(fwd_ws=gluon_config(128, 0)):
        with pytest.warns(RuntimeWarning, match="Gluon kernel failed"):
            out = adaattn.attention(q, k, v, is_causal=True, policy=policy)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = adaattn.attention(q, k, v, is_causal=True, policy=policy)
    assert not common.gluon_fwd_here(q)
    peer = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_standard(out, reference_attention(q, k, v, is_causal=True), peer, "output")
    assert torch.equal(out, again)


# The Gluon backward (kernels/attention_bwd_gluon.py): on Hopper, timed beside the warp-specialised
# pair for dense calls that may add dq atomically. Like the Gluon forward it does not run in the
# interpreter: the CPU checks its sm90 compile, the GPU holds it to the standard.

GLUON_BWD_SM90_COMPILE = r'''
import json, re
from triton.experimental.gluon import language as gl
from adaattn.backends.triton.configs import HALF_CONFIGS
from adaattn.kernels.attention_bwd_gluon import attention_bwd_gluon_kernel as fn
from sm90 import compile_for_sm90

def desc(dtype, name, box):
    lay = gl.NVMMASharedLayout.get_default_for(box, getattr(gl, dtype))
    return f"tensordesc<{name}[{','.join(map(str, box))}],{lay!r}>"

rows = []
for d, d_class in ((64, "small_d"), (128, "mid_d")):
    for cfg in HALF_CONFIGS["bwd_gluon"][d_class]:
        # Dense (not causal, causal, a left window) and packed sequences (VARLEN: not causal, causal).
        for causal, left, varlen in ((False, False, False), (True, False, False), (True, True, False),
                                     (False, False, True), (True, False, True)):
            bm, half = cfg.block_m, cfg.block_n // 2
            types = {"q_desc": desc("bfloat16", "bf16", [1, 1, bm, d]), "k_desc": desc("bfloat16", "bf16", [1, 1, half, d]),
                     "dq_desc": desc("float32", "fp32", [1, 1, bm, d]), "stat_desc": desc("float32", "fp32", [bm]),
                     "scale": "fp32", "scale_log2": "fp32", "post_scale": "fp32", "CuQ": "*i32", "CuK": "*i32",
                     "DK": "*bf16", "DV": "*bf16"}
            types["do_desc"] = types["q_desc"]
            types["v_desc"] = types["dk_desc"] = types["dv_desc"] = types["k_desc"]
            # The launch's choices (backward._run_bwd_gluon): P through shared memory and dq in
            # two column halves at head dim 128.
            consts = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages, CAUSAL=causal,
                          BOTTOM_RIGHT=causal, HAS_LEFT=left, P_SMEM=d > 64, DQ_SPLIT=2 if d > 64 else 1)
            consts.update(VARLEN=varlen, **({} if varlen else dict(CuQ=None, CuK=None, DK=None, DV=None)))
            c = compile_for_sm90(fn, consts, lambda name: types.get(name, "i32"), lambda name, t: False,
                                 cfg.num_warps, cfg.num_stages)
            ptx = c["ptx"]
            rows.append({"d": d, "cfg": str(cfg), "causal": causal, "left": left, "varlen": varlen, "smem": c["smem"],
                         "stack": c["stack"], "threads": [int(t) for t in re.findall(r"reqntid (\d+)", ptx)],
                         "regs": sorted(set(int(r) for r in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
                         "wgmma": ptx.count("wgmma.mma_async"), "reduce": "cp.reduce.async.bulk.tensor" in ptx,
                         "tma": "cp.async.bulk.tensor" in ptx, "stores": ptx.count("st.global")})
print(json.dumps(rows))
'''


@pytest.mark.slow
def test_gluon_backward_compiles_for_sm90_into_its_partitions():
    """Every Gluon backward config compiles for sm90 with this triton, causal, not and windowed,
    dense and for packed sequences: two consumer warp groups and a loader, wgmma products, TMA
    loads and TMA reductions of dq, within the shared memory the configs table estimates for it,
    and with spills of a few registers at most (triton 3.6, measured: none at D=64, 32-80 bytes a
    thread at D=128; triton 3.9: up to 216 at D=128). Packed sequences store dK and dV at a
    sequence's end by row (the only global stores of the kernel)."""
    from adaattn import hardware

    if not hardware.gluon_available():
        pytest.skip("this triton has no Gluon warp_specialize over (function, args) pairs")
    import sm90

    rows = sm90.run_json(GLUON_BWD_SM90_COMPILE)
    assert len(rows) == 10 and sum(r["varlen"] for r in rows) == 4
    for r in rows:
        assert (r["stores"] > 0) == r["varlen"], r
        assert r["threads"] == [384] and r["wgmma"] > 0 and r["tma"] and r["reduce"], r
        assert 240 in r["regs"] and 24 in r["regs"], r
        assert (r["stack"] or 0) <= (0 if r["d"] == 64 else 256), r
        cfg = tc.HALF_CONFIGS["bwd_gluon"][tc.d_class(r["d"])][0]
        assert r["smem"] <= tc.shared_memory_estimate("bwd_gluon", cfg, r["d"], 2) <= 232448, r


def count_gluon_backward(monkeypatch) -> list:
    """Calls of the Gluon backward's launch from now on (one entry per call)."""
    calls, real = [], tl_backward._run_bwd_gluon

    def counted(*args, **kwargs):
        calls.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(tl_backward, "_run_bwd_gluon", counted)
    return calls


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "b,hq,hkv,nq,nk,d,dtype,causal,align,window",
    [
        (2, 4, 4, 300, 300, 128, torch.bfloat16, True, "top_left", None),
        (1, 8, 2, 1000, 1000, 128, torch.bfloat16, True, "top_left", None),
        (2, 4, 4, 257, 513, 64, torch.float16, True, "bottom_right", None),
        (2, 4, 4, 513, 257, 128, torch.bfloat16, False, "top_left", None),
        (1, 4, 2, 700, 1300, 128, torch.float16, False, "top_left", None),
        (1, 4, 4, 1024, 1024, 128, torch.bfloat16, True, "top_left", (100, 0)),
        (1, 4, 4, 999, 1200, 64, torch.bfloat16, True, "bottom_right", (257, 0)),
        (1, 2, 1, 1, 700, 128, torch.bfloat16, False, "top_left", None),
        (1, 2, 2, 64, 64, 64, torch.bfloat16, True, "top_left", None),
        (1, 6, 2, 2048, 2048, 64, torch.bfloat16, True, "top_left", None),
        # More programs than SMs (later waves start while the first ones run).
        (4, 8, 4, 4096, 4096, 128, torch.bfloat16, True, "top_left", None),
        (2, 8, 8, 3000, 3000, 128, torch.bfloat16, True, "top_left", (500, 0)),
        (6, 8, 4, 1500, 1700, 64, torch.float16, False, "top_left", None),
    ],
)
def test_gpu_gluon_backward_meets_the_standard(monkeypatch, b, hq, hkv, nq, nk, d, dtype, causal, align, window):
    """The Gluon backward, forced, under the triton.ws runner's forward (windows included):
    gradients against float64 and torch's own."""
    if not gluon_here():
        pytest.skip("the Gluon backward runs on Hopper with triton >= 3.6 only")
    calls, ran = count_gluon_backward(monkeypatch), []
    cfg = tc.HALF_CONFIGS["bwd_gluon"][tc.d_class(d)][0]
    runner = "triton.ws"
    with triton_tuner.forced_configs(bwd_gluon=cfg), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a Gluon failure would warn and run the pair
        check_case(b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dtype=dtype, causal=causal, align=align, window=window,
                   policy=adaattn.Policy(backends=(runner,)), ran=ran, seed=nq + nk + d)
    assert ran == [runner] and calls


@gpu
@needs_cuda
def test_gpu_gluon_backward_is_not_used_for_deterministic_gradients(monkeypatch):
    """dq through TMA reductions is not bitwise reproducible: deterministic calls run the pair."""
    if not gluon_here():
        pytest.skip("the Gluon backward runs on Hopper with triton >= 3.6 only")
    calls = count_gluon_backward(monkeypatch)
    g = _gen(31)
    q, k, v = (_randn((1, 4, 700, 128), torch.bfloat16, g) for _ in range(3))
    with triton_tuner.forced_configs(bwd_gluon=tc.HALF_CONFIGS["bwd_gluon"]["mid_d"][0]):
        assert_bitwise_deterministic_gradients(q, k, v, _randn((1, 4, 700, 128), torch.bfloat16, g))
    assert not calls


@gpu
@needs_cuda
def test_gpu_gluon_backward_failure_falls_back_to_the_pair_with_one_warning(monkeypatch):
    if not gluon_here():
        pytest.skip("the Gluon backward runs on Hopper with triton >= 3.6 only")
    break_gluon(monkeypatch, tl_backward, "_run_bwd_gluon")
    policy = adaattn.Policy(backends=("triton.ws",))
    with triton_tuner.forced_configs(bwd_gluon=tc.HALF_CONFIGS["bwd_gluon"]["mid_d"][0]):
        with pytest.warns(RuntimeWarning, match="Gluon kernel failed"):
            check_case(b=1, hq=4, nq=500, d=128, dtype=torch.bfloat16, causal=True, policy=policy, ran=[], seed=5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_case(b=1, hq=4, nq=500, d=128, dtype=torch.bfloat16, causal=True, policy=policy, ran=[], seed=6)
    assert not common.gluon_bwd_here(torch.zeros(1, device="cuda"))


# Packed sequences (varlen, documents) through the Gluon kernels: sequence bounds read in the
# kernels, descriptors over (1, H, T, D) views of the packed tensors, and the rows at a sequence's
# end stored by row, since the next sequence's rows follow.
VARLEN_GLUON_CASES = {
    # name: (lengths_q, lengths_k (None: the same), hq, hkv, d, causal, window, align, dtype)
    "causal, ragged, empty and one-row documents, gqa": ([1, 511, 0, 2048, 17, 1000, 130], None, 8, 2, 128, True,
                                                         None, "top_left", torch.bfloat16),
    "head dim 64, fp16": ([300, 64, 129, 1, 257], None, 4, 4, 64, True, None, "top_left", torch.float16),
    "not causal": ([257, 40, 700], [100, 333, 700], 4, 2, 128, False, None, "top_left", torch.bfloat16),
    "bottom-right, keys longer": ([5, 300, 120], [200, 450, 700], 4, 2, 128, True, None, "bottom_right",
                                  torch.bfloat16),
    "top-left, queries longer": ([300, 450], [200, 129], 4, 4, 64, True, None, "top_left", torch.bfloat16),
    "causal left window": ([700, 1500, 90], None, 4, 2, 128, True, (100, 0), "top_left", torch.bfloat16),
    "many documents": ([1024] * 8 + [4096, 3000], None, 8, 8, 128, True, None, "top_left", torch.bfloat16),
}


@gpu
@needs_cuda
@pytest.mark.parametrize("ci", [0, 1])
@pytest.mark.parametrize("case", list(VARLEN_GLUON_CASES))
def test_gpu_gluon_kernels_take_packed_sequences(monkeypatch, case, ci):
    """The Gluon forward and backward, forced, on packed sequences: outputs and gradients against
    float64 and SDPA per sequence, over the whole packed tensors."""
    if not gluon_here():
        pytest.skip("the Gluon kernels run on Hopper with triton >= 3.6 only")
    lengths_q, lengths_k, hq, hkv, d, causal, window, align, dtype = VARLEN_GLUON_CASES[case]
    fwd_calls, bwd_calls = spy_launch(monkeypatch, tl_forward, "_launch_fwd_gluon"), count_gluon_backward(monkeypatch)
    with triton_tuner.forced_configs(fwd=gluon_config(d, ci), bwd_gluon=tc.HALF_CONFIGS["bwd_gluon"][tc.d_class(d)][0]):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a Gluon failure would warn and run the Triton kernels
            check_varlen_case(lengths_q, lengths_k or lengths_q, hq, hkv, d, causal, window, align, dtype)
    assert len(fwd_calls) == 1 and len(bwd_calls) == 1


@gpu
@needs_cuda
def test_gpu_gluon_packed_rows_past_the_last_sequence_give_zeros():
    """Rows of a packed buffer past cu_seqlens[-1] give 0 and zero gradients under the Gluon
    kernels too, and the sequences' rows match the same call without them."""
    if not gluon_here():
        pytest.skip("the Gluon kernels run on Hopper with triton >= 3.6 only")
    lengths = [200, 130]
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, 4, 2, 128, torch.bfloat16, seed=41)
    g = _gen(42)
    pad = lambda t, n: torch.cat([t.detach(), _randn((n,) + tuple(t.shape[1:]), t.dtype, g)]).requires_grad_()
    qp, kp, vp = pad(q, 70), pad(k, 70), pad(v, 70)
    cfgs = dict(fwd=gluon_config(128, 0), bwd_gluon=tc.HALF_CONFIGS["bwd_gluon"]["mid_d"][0])
    with triton_tuner.forced_configs(**cfgs), settings.override(poison_outputs=True):
        out = adaattn.varlen_attention(q, k, v, cu_q, cu_k, 200, 200, is_causal=True)
        outp = adaattn.varlen_attention(qp, kp, vp, cu_q, cu_k, 200, 200, is_causal=True)
        dout = _randn(outp.shape, torch.bfloat16, g)
        grads = torch.autograd.grad(out, (q, k, v), dout[:330])
        gradsp = torch.autograd.grad(outp, (qp, kp, vp), dout)
    assert (outp[330:] == 0).all() and torch.equal(outp[:330], out)
    for name, got, want in zip(("dq", "dk", "dv"), gradsp, grads):
        assert (got[330:] == 0).all(), name
        assert torch.allclose(got[:330].float(), want.float(), rtol=1e-2, atol=1e-2), name


def test_pointer_ready_copies_views_at_odd_offsets_and_keeps_aligned_ones():
    """K and V both at odd offsets made the compiled forward read outside them (seed 5300 #16237,
    H200); the launch glue hands the kernels 16-byte aligned rows."""
    from adaattn.backends.triton.common import pointer_ready

    base = torch.randn(1, 1, 9, 134, dtype=torch.bfloat16)
    k = base[..., 5:133]  # rows of 268 bytes at a 10-byte offset
    v = torch.randn(9 * 16 + 7, dtype=torch.bfloat16)[7:].view(1, 1, 9, 16)
    for t in (k, v):
        ready = pointer_ready(t)
        assert ready.data_ptr() % 16 == 0 and ready.stride(-1) == 1
        assert all(s * 2 % 16 == 0 for s in ready.stride()[:-1])
        assert torch.equal(ready, t)
    aligned = torch.randn(1, 2, 9, 64, dtype=torch.bfloat16)
    assert pointer_ready(aligned) is aligned
    expanded = torch.randn(1, 1, 9, 64, dtype=torch.bfloat16).expand(1, 4, 9, 64)
    assert pointer_ready(expanded) is expanded  # a stride-0 head dim loads as it is
