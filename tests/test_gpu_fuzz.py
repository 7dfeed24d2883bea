"""On CUDA: the fuzzer's run (tests/fuzz), and one regression test for each class it found at
34bab39 (faults on misaligned views, finfo.min masks with GQA, gradients over the standard,
fallback warnings on legal inputs)."""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch

import adaattn
from fuzz.sdpa import main, rel_err, softmax_attention
from helpers import assert_within_standard, keep_mask

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _no_fallback_warning(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
        torch.cuda.synchronize()
    assert [str(w.message) for w in caught if "adaattn" in str(w.message)] == []
    return out


def _ref64(q, k, v, mask=None, causal=False, scale=None, window=None):
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(g, -3), v.repeat_interleave(g, -3)
    keep = keep_mask(q.shape[-2], k.shape[-2], causal, window, q.device)
    return softmax_attention(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale, keep, mask)


@cuda
def test_fuzzer_finds_nothing_in_2000_configurations_within_two_minutes(tmp_path):
    # Worker processes share the GPU: a new shape's cuDNN plan and Triton compile are host work.
    path = tmp_path / "fuzz.json"
    t0 = time.perf_counter()
    code = main(["--device", "cuda", "--n", "2000", "--seed", "20261127", "--jobs", "12", "--json", str(path)])
    took = time.perf_counter() - t0
    summary = json.loads(path.read_text())
    assert [f"{r['status']}: {r.get('why', '')[:200]} | {r['repro']}" for r in summary["findings"]] == []
    assert code == 0 and summary["ran"] == 2000
    assert took < 120


@cuda
def test_fuzzer_finds_nothing_in_150_configurations_with_score_modifiers(tmp_path):
    # Each configuration compiles its own kernel variants (soft cap, ALiBi, sinks; forward and
    # backward, with their config search): 15 workers ran about 3 a second on an H200.
    assert _clean_run(tmp_path, 150, 20261128, "--modifiers")["modifiers"]


def _clean_run(tmp_path, n: int, seed: int, flag: str) -> dict:
    """The fuzzer on CUDA with `flag`, 15 workers: no finding, every configuration ran; its summary."""
    path = tmp_path / "fuzz.json"
    code = main(["--device", "cuda", "--n", str(n), "--seed", str(seed), "--jobs", "15", flag, "--json", str(path)])
    summary = json.loads(path.read_text())
    assert [f"{r['status']}: {r.get('why', '')[:200]} | {r['repro']}" for r in summary["findings"]] == []
    assert code == 0 and summary["ran"] == n
    return summary


@cuda
def test_fuzzer_finds_nothing_in_500_configurations_with_broadcast_leading_dims(tmp_path):
    # Key and value leading dims of 1 against the query's: torch's fused kernels take equal batch
    # dims only, so these reach its math kernel or ours on broadcast views.
    assert _clean_run(tmp_path, 500, 20261129, "--broadcast")["broadcast"]


@cuda
@pytest.mark.parametrize("dtype,d,which", [(torch.float32, 256, "k"), (torch.bfloat16, 80, "v"),
                                           (torch.float16, 8, "q"), (torch.float32, 128, "q")])
def test_views_at_odd_offsets_run_without_a_fault_or_a_warning(dtype, d, which):
    base = {n: torch.randn(2, 4, 7, d + 3, dtype=dtype, device="cuda") for n in "qkv"}
    t = {n: base[n][..., :d].contiguous() for n in "qkv"}
    t[which] = base[which][..., 3:3 + d]  # a last-dim slice: its base is 6 or 12 bytes off 16
    out = _no_fallback_warning(lambda: adaattn.attention(t["q"], t["k"], t["v"]))
    assert rel_err(out, _ref64(t["q"], t["k"], t["v"]), 1.0) < (1e-5 if dtype == torch.float32 else 1e-2)


@cuda
def test_misaligned_base_of_a_contiguous_tensor_runs_on_a_fused_kernel():
    flat = torch.randn(2 * 4 * 64 * 128 + 3, device="cuda")
    q = flat[3:].view(2, 4, 64, 128)  # contiguous, 12 bytes off 16
    k, v = torch.randn(2, 4, 64, 128, device="cuda"), torch.randn(2, 4, 64, 128, device="cuda")
    out = _no_fallback_warning(lambda: adaattn.attention(q, k, v, is_causal=True))
    assert rel_err(out, _ref64(q, k, v, causal=True), 1.0) < 1e-5
    assert adaattn.explain(q, k, v, is_causal=True).chosen == "sdpa.efficient"


@cuda
def test_bshd_gqa_query_slice_with_a_window_matches_float64():
    base = torch.randn(3, 2, 4, 48 + 5, device="cuda")
    q = base[..., 5:]  # (B, N, H, D), a last-dim slice
    k, v = torch.randn(3, 64, 2, 48, device="cuda"), torch.randn(3, 64, 2, 48, device="cuda")
    out = _no_fallback_warning(lambda: adaattn.attention(q, k, v, window=(1, 5), enable_gqa=True, layout="bshd"))
    ref = _ref64(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window=(1, 5)).transpose(1, 2)
    assert rel_err(out, ref, 1.0) < 1e-5


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finfo_min_additive_mask_with_gqa_gives_sdpa_uniform_rows(dtype):
    torch.manual_seed(0)
    q = torch.randn(3, 4, 3, 32, dtype=dtype, device="cuda")
    k, v = torch.randn(3, 2, 3, 32, dtype=dtype, device="cuda"), torch.randn(3, 2, 3, 32, dtype=dtype, device="cuda")
    mask = torch.zeros(3, 3, dtype=dtype, device="cuda")
    mask[1] = torch.finfo(dtype).min  # a dead row: SDPA gives it uniform weights over its keys
    mask[2, 0] = torch.finfo(dtype).min
    out = adaattn.attention(q, k, v, attn_mask=mask, scale=1.33, enable_gqa=True)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.33,
                                                                 enable_gqa=True)
    ref = _ref64(q, k, v, mask=mask, scale=1.33)
    assert rel_err(out, ref, 1.0) <= 2 * rel_err(torch_out, ref, 1.0) + 1e-6


@cuda
def test_negative_scale_does_not_run_a_fused_kernel_that_gives_nan():
    x = torch.randn(1, 43, 2, 16, dtype=torch.float16, device="cuda", requires_grad=True)
    out = adaattn.attention(x, x, x, scale=-0.5, layout="bshd")
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    ref = _ref64(*(x.detach().transpose(1, 2),) * 3, scale=-0.5).transpose(1, 2)
    assert rel_err(out, ref, 1.0) < 1e-3


@cuda
def test_gradient_of_an_additive_mask_alone():
    q, k, v = (torch.randn(1, 16, 5, 64, dtype=torch.float16, device="cuda") for _ in range(3))
    mask = torch.randn(16, 5, 5, dtype=torch.float16, device="cuda", requires_grad=True)
    out = adaattn.attention(q, k, v, attn_mask=mask, is_causal=True)
    (g,) = torch.autograd.grad(out.float().sum(), mask)
    m64 = mask.detach().double().requires_grad_(True)
    (g64,) = torch.autograd.grad(_ref64(q, k, v, mask=m64, causal=True).sum(), m64)
    assert rel_err(g, g64, 1.0) < 1e-2


@cuda
@pytest.mark.parametrize("shape", [(2, 1, 1, 37), (2, 1, 37, 37)])
def test_hf_padding_mask_for_a_37_token_prompt_raises_no_warning(shape):
    q = torch.randn(2, 32, 37, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(2, 8, 37, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    mask = torch.ones(*shape, dtype=torch.bool, device="cuda")
    mask[0, ..., :5] = False  # left padding of the first prompt
    if shape[-2] == 37:
        mask &= torch.ones(37, 37, dtype=torch.bool, device="cuda").tril()
    out = _no_fallback_warning(lambda: adaattn.attention(q, k, v, attn_mask=mask, enable_gqa=True))
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ref = _ref64(q, k, v, mask=mask)
    assert rel_err(out, ref, 1.0) <= 2 * rel_err(torch_out, ref, 1.0) + 1e-6


# Configurations the fuzzer found on an H100 (torch 2.11) after 1e71c02, one per class:
# float32 GQA / 2-3-D calls on the efficient kernel (3-600x math's error; torch runs math there);
# finfo.min bias floored under gradients (inf gradients in bfloat16, 3x in float32); masks at odd
# offsets and float32 head dims the kernel's host-side selection refused (fallback warnings);
# torch's own faults on masks broadcast over keys (yardstick side, now laid out for torch).
FOUND_AFTER_1E71C02 = [(5101, i) for i in (15, 416, 608, 1625, 1979, 2538, 2602, 3541, 610, 942, 3900)] + [
    (5102, i) for i in (1026, 2782, 2996, 4211, 4245, 4248)] + [
    (4601, i) for i in (1378, 3793, 5278, 5945, 6897, 7059, 5474)] + [(5200, 9366)] + [
    # float32 causal at a negative scale: the efficient kernel declined it, math's dk was 3.1x and its
    # output 4.5x torch's efficient kernel (H100, H200).
    (5200, 17645), (20261127, 465)] + [
    # torch ran cuDNN with a mask (Dv != D, D=160, windows as masks) where we ran efficient at 2.2-3x its
    # gradient error; 2-3-D calls on math as torch (a fused kernel on the flattened call: 2.4-3.2x);
    # float32 math on aligned copies, as torch is given them (8x on transposed views) (H200).
    (5200, 3423)] + [(5300, i) for i in (3318, 4174, 8265, 11918, 19290, 19544)] + [
    # Our Triton forward faulted (illegal memory access) at D/Dv 216/8, 100/19, 40/8: it declines them (H200).
    (5400, i) for i in (1453, 3992, 6349)] + [
    # float16 GQA with a bool mask at scale -0.5: torch ran math, our backward rounded ds once (dq, dk
    # 2.3x math's error, H200); in two roundings still 2.1x: where torch runs math under half-precision
    # gradients, sdpa.math runs first (planner._math_where_torch_runs_math).
    (5300, 7381)] + [
    # Drowned rows (finfo.min rows, under gradients: two launches, sdpa._run_drowned) and torch's
    # answer at the input dtype where its own gives inf (seeds 5410-5412, H200); flash's q_len-1
    # gradients where torch runs cuDNN (5413 #17715).
    (5410, 10815), (5411, 339), (5413, 17715)] + [(5412, i) for i in (421, 1774, 2105, 4860, 5891, 8822, 9656)] + [
    # One query against one key under gradients: cuDNN's backward refuses it ('s_q = s_kv = 1 is not
    # supported') after its forward ran, so nothing could fall back (25 of seed 5414's 20,000, H200).
    (5414, i) for i in (419, 546, 2178, 2763, 3617)] + [
    # cuDNN's float16 backward with a mask (here a window) gave inf dq at scales of 1 and more, torch's
    # own choice alike (5415 #16352, H200): sdpa.cudnn declines float16 masked calls under gradients.
    (5415, 16352)] + [
    # float32 causal with an additive mask under gradients on views torch's checks refuse: the
    # efficient kernel on aligned copies, as torch is given them; math there was 9.5x torch's output
    # error (5419 #6040, H200, when sdpa.efficient declined such calls in a7aa1ff, reverted).
    (5419, 6040),
    # One query against one key whose additive mask is -1e4 (a transposed-last-dim key): the low row
    # shifted to peak at 0 gave the efficient kernel's float32 dv 16x torch's error; it now runs
    # unshifted, as torch runs it (seed 5418 #2950, H200).
    (5418, 2950),
    # The Triton forward read outside K/V with both at odd offsets, at BLOCK_N 64 (illegal memory
    # access, H200): they are now copied to aligned rows first. Its dk was then 3.8x math's (cuDNN
    # refused the views, torch's own SDPA runs math there): runners behind torch's fused choice now
    # give math-grade gradients (sdpa.math first where it fits; triton.ptr's exact delta) (session 43).
    (5300, 16237),
    # cuDNN's backward at exactly 64 keys gave NaN dq on rows of a low log-sum-exp: bfloat16 with a bool
    # mask, causal and a window at logits x100 (rows below -88), and float16 with a window at logits
    # x30 (rows of -15 and -32); torch's own default alike. sdpa.cudnn takes no gradients at 64 keys;
    # sdpa.math runs first there (session 45).
    (5419, 12693), (5421, 2768)]


def _in_fresh_process(code: str) -> str:
    """Run `code` in a new Python process (tests/ on its path) and return its stdout: a CUDA fault
    there fails the one test and leaves this session's CUDA context alive."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys; sys.path[:0] = ['tests']\n" + code],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    return done.stdout


@cuda
@pytest.mark.parametrize("seed,index", [(5902, 17), (5902, 2777)])
def test_triton_forward_at_padded_large_head_dims_under_gqa_runs_without_a_fault(seed, index):
    # float16, rank 3, GQA 4/1, D 192 and 160 (BLOCK_D 256), Policy(backends=("triton",)): the
    # tuner's first candidate BM128/BN32/w8/s2 read out of bounds (illegal memory access, a dead
    # CUDA context).
    out = _in_fresh_process("from fuzz.sdpa import check, draw\n"
                            f"r = check(draw({seed}, {index}, 'cuda', policy='triton'), 'cuda')\n"
                            "print(r['status'], r.get('why', '')[:300])")
    assert out.startswith("ok"), out


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,nq,nk,groups", [(144, 91, 55, 4), (160, 91, 55, 2), (192, 300, 300, 4)])
def test_triton_forward_padded_large_head_dims_with_gqa_match_float64(dtype, d, nq, nk, groups):
    stdout = _in_fresh_process(f"""
import torch
import adaattn
from adaattn.backends.triton.tuner import CONFIGS
from fuzz.sdpa import softmax_attention
CONFIGS.tune = True  # every fitting candidate runs once
g = torch.Generator(device='cuda').manual_seed({d})
q = torch.randn(2, 4, {nq}, {d}, device='cuda', generator=g).to({dtype})
k, v = (torch.randn(2, 4 // {groups}, {nk}, {d}, device='cuda', generator=g).to({dtype}) for _ in range(2))
out = adaattn.attention(q, k, v, enable_gqa=True, policy=adaattn.Policy(backends=('triton',)))
sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
kk, vv = (t.double().repeat_interleave({groups}, 1) for t in (k, v))
keep = torch.ones({nq}, {nk}, dtype=torch.bool, device='cuda')
ref = softmax_attention(q.double(), kk, vv, {d} ** -0.5, keep, None)
err = lambda x: ((x.double() - ref).norm() / ref.norm()).item()
print('ERR', err(out), err(sdpa))
""")
    ours, torch_err = map(float, stdout.split("ERR")[1].split())
    assert ours <= 2 * torch_err + 1e-6, (ours, torch_err)


@cuda
@pytest.mark.parametrize("dtype,low", [(torch.float16, 30.0), (torch.bfloat16, 200.0)])
@pytest.mark.parametrize("nq,masked", [(64, True), (5, True), (64, False)])
def test_gradients_at_64_keys_on_rows_of_low_log_sum_exp_are_finite_and_meet_the_standard(dtype, low, nq, masked):
    # cuDNN's backward gave NaN dq on every such row at exactly 64 keys (5, 65, 128 keys finite). Its
    # NaN leaves math as the standard; unmasked, flash's bfloat16 dq was 108x math's (1.5e-2, keys
    # nearly parallel; float16 over the standard too): sdpa.math runs first at 64 keys (session 45).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from adaattn import hardware, planner

    if not planner._torch_prefers_cudnn(hardware.arch("cuda", 0)):
        pytest.skip("torch's own choice here is not cuDNN: its fused kernel stays the standard")
    g = torch.Generator(device="cuda").manual_seed(64)
    q, go = (torch.randn(1, 2, nq, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, 2, 64, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    mask = None
    if masked:
        mask = torch.full((nq, 64), -low, device="cuda").to(dtype)
        mask[:, 40:] = float("-inf")
    else:  # keys that all point away from the queries: every score near -low
        k0 = torch.randn(64, device="cuda", generator=g)
        k0 = k0 / k0.norm()
        k = (k0 + 0.05 * torch.randn(1, 2, 64, 64, device="cuda", generator=g)).to(dtype)
        q = (-(low * 8.0) * k0).expand(1, 2, nq, 64).contiguous().to(dtype)

    def grads(fn, *t):
        t = [x.detach().clone().requires_grad_() for x in t]
        out = fn(*t)
        return torch.autograd.grad(out, t, go.to(out.dtype))

    ref = grads(lambda q, k, v: _ref64(q, k, v, None if mask is None else mask.double()), q, k, v)

    def math(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    ours = _no_fallback_warning(lambda: grads(lambda q, k, v: adaattn.attention(q, k, v, attn_mask=mask), q, k, v))
    yard = grads(math, q, k, v)
    for name, a, b, r in zip("qkv", ours, yard, ref):
        assert torch.isfinite(a).all(), name
        assert_within_standard(a, r, b, f"d{name}")


@cuda
@pytest.mark.parametrize("seed,index", FOUND_AFTER_1E71C02)
def test_configurations_found_after_1e71c02_meet_the_standard(seed, index):
    from fuzz.sdpa import check, draw

    result = check(draw(seed, index, "cuda"), "cuda")
    assert result["status"] == "ok", f"{result.get('why')} | {result['repro']}"

