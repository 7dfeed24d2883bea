"""The SDPA runners' declared limits and the forms they hand torch's fused kernels (CPU-checkable
parts; the kernels themselves: test_gpu_fuzz)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from adaattn.backends.sdpa import sdpa_runners
from adaattn.backends.sdpa_forms import EFFICIENT_LOW_PEAK, drowned_rows, efficient_bias, finite_floor, fused_form, fused_ready
from adaattn.policy import Policy
from adaattn.problem import Problem

RUNNERS = {r.name: r for r in sdpa_runners()}


def _problem(**kw):
    base = dict(batch=2, q_heads=4, kv_heads=4, q_len=64, kv_len=64, head_dim=64, value_dim=64,
                dtype=torch.float16, device_type="cuda", device_index=0, causal=False, window_left=-1,
                window_right=-1, mask_kind="none", dropout_p=0.0, scale=0.125, needs_grad=False, tma_aligned=True)
    base.update(kw)
    return Problem(**base)


@pytest.mark.parametrize("view", ["offset", "slice", "last_transposed", "expanded", "odd_dim", "length_one_stride"])
def test_views_a_fused_kernel_cannot_load_are_not_fused_ready_and_their_form_is(view):
    base = torch.randn(2, 4, 9, 72)
    t = {
        "offset": torch.randn(2 * 4 * 9 * 64 + 3)[3:].view(2, 4, 9, 64),
        "slice": base[..., 3:67],
        "last_transposed": torch.randn(2, 4, 64, 9).transpose(-1, -2),
        "expanded": torch.randn(1, 4, 9, 64).expand(2, 4, 9, 64),
        "odd_dim": torch.randn(2, 4, 9, 35),
        "length_one_stride": torch.randn(2, 4, 64, 1).transpose(-1, -2),  # (2, 4, 1, 64), row stride 1
    }[view]
    assert not fused_ready(t)
    width = -(-t.shape[-1] // 8) * 8
    f = fused_form(t, width)
    assert fused_ready(f) and f.is_contiguous() and f.shape[-1] == width
    assert torch.equal(f[..., :t.shape[-1]], t) and not f[..., t.shape[-1]:].any()


def test_a_padded_channels_last_like_view_comes_out_dense():
    t = torch.randn(2, 5, 1, 7).permute(0, 3, 1, 2)  # (2, 7, 5, 1): heads innermost in memory
    f = fused_form(t.expand(2, 7, 5, 3), 8)
    assert f.is_contiguous() and f.stride(-1) == 1


def test_aligned_dense_tensors_are_passed_as_they_are():
    t = torch.randn(2, 4, 9, 64)
    assert fused_ready(t) and fused_form(t, 64) is t
    bshd = torch.randn(2, 9, 4, 64).transpose(1, 2)
    assert fused_ready(bshd) and fused_form(bshd, 64) is bshd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finfo_min_bias_is_floored_and_minus_inf_kept(dtype):
    m = torch.tensor([0.0, -1e4, torch.finfo(dtype).min, -math.inf], dtype=dtype, requires_grad=True)
    out = finite_floor(m)
    assert out[2].item() == pytest.approx(-1e30, rel=1e-2) and math.isinf(out[3].item())
    assert out[0].item() == 0.0 and out[1].item() == m[1].item()
    out.sum().backward()
    assert torch.equal(m.grad, torch.ones_like(m))


def test_float16_bias_is_untouched_by_the_floor():
    m = torch.tensor([0.0, torch.finfo(torch.float16).min, -math.inf], dtype=torch.float16)
    assert finite_floor(m) is m


def test_efficient_bias_turns_bool_masks_additive_and_lays_keys_out():
    keep = torch.tensor([[True, False, True]])
    bias = efficient_bias(keep, torch.bfloat16, 3)
    assert bias.dtype == torch.bfloat16 and bias.tolist() == [[0.0, -math.inf, 0.0]]
    col = torch.zeros(5, 1)
    assert efficient_bias(col, torch.float32, 4).shape == (5, 4)
    t = torch.randn(4, 5).t()  # keys strided
    assert efficient_bias(t, torch.float32, 4).stride(-1) == 1


def _reasons(name, problem):
    return " ".join(RUNNERS[name].supports(problem, Policy()))


@pytest.mark.parametrize("name", ["sdpa.cudnn", "sdpa.flash", "sdpa.efficient"])
def test_fused_kernels_decline_a_non_positive_scale_in_half_precision(name):
    assert "positive scale" in _reasons(name, _problem(scale=-0.5))
    assert "positive scale" in _reasons(name, _problem(scale=0.0))
    assert "positive scale" not in _reasons(name, _problem())
    assert "positive scale" not in _reasons("sdpa.math", _problem(scale=-0.5))


def test_efficient_takes_any_scale_in_float32():
    """torch's efficient kernel is finite at scales -0.5 and 0 (H200, torch 2.11), and torch runs it
    there for float32 (seed 5200 #17645: math's dk was 3.1x its error)."""
    for scale in (-0.5, 0.0):
        assert "scale" not in _reasons("sdpa.efficient", _problem(scale=scale, dtype=torch.float32))


def test_efficient_declines_masks_with_gqa_and_mask_gradients():
    gqa = _problem(kv_heads=2, gqa=True)
    assert "with GQA" in _reasons("sdpa.efficient", replace(gqa, mask_kind="additive"))
    assert "with GQA" in _reasons("sdpa.efficient", replace(gqa, window_left=4))
    assert "with GQA" not in _reasons("sdpa.efficient", gqa)
    assert "with GQA" not in _reasons("sdpa.efficient", _problem(mask_kind="additive"))
    grad = _problem(mask_kind="additive", mask_grad=True, needs_grad=True)
    assert "gradient for an attn_mask" in _reasons("sdpa.efficient", grad)


@pytest.mark.parametrize("name", ["sdpa.cudnn", "sdpa.flash", "sdpa.efficient"])
def test_fused_kernels_decline_gradients_of_calls_that_are_not_4d(name):
    assert "takes 4-D tensors" in _reasons(name, _problem(needs_grad=True, out_lead=(2, 2, 4)))
    assert "takes 4-D tensors" in _reasons(name, _problem(needs_grad=True, out_lead=(2, 2, 4), q_len=4096, kv_len=4096))
    assert "takes 4-D tensors" not in _reasons(name, _problem(needs_grad=True))


@pytest.mark.parametrize("name", ["sdpa.cudnn", "sdpa.flash", "sdpa.efficient"])
def test_fused_kernels_decline_small_calls_that_are_not_4d_forward_too(name):
    from adaattn.problem import SMALL_SCORES

    small = _problem(out_lead=(2, 2, 4))  # 2 x 4 x 64 x 64 scores: math's cost, and torch's choice
    assert small.scores <= SMALL_SCORES and "takes 4-D tensors" in _reasons(name, small)
    large = replace(small, q_len=2048, kv_len=2048)
    assert large.scores > SMALL_SCORES and "takes 4-D tensors" not in _reasons(name, large)
    assert "takes 4-D tensors" not in _reasons(name, replace(small, out_lead=None))
    # A cached plan is keyed on the class: a small and a large 3-D call are not one class.
    assert small.shape_class != large.shape_class



@pytest.mark.parametrize("name", ["sdpa.cudnn", "sdpa.flash", "sdpa.efficient"])
def test_fused_kernels_decline_gradients_at_head_dims_they_would_pad(name):
    assert "multiples of 8 only" in _reasons(name, _problem(head_dim=35, value_dim=35, needs_grad=True))
    assert "multiples of 8 only" in _reasons(name, _problem(value_dim=229, needs_grad=True))
    assert "multiples of 8 only" not in _reasons(name, _problem(head_dim=35, value_dim=35))
    assert "multiples of 8 only" not in _reasons(name, _problem(needs_grad=True))


def test_efficient_takes_float32_gradients_at_head_dims_of_whole_16_byte_rows_as_torch_does():
    # seed 5410 #13227 (H200): float32 D=116 with gradients ran torch's math kernel (dk 3x the error
    # of torch's own choice, its efficient kernel, which takes float32 rows of 4 elements unpadded).
    f32 = _problem(dtype=torch.float32, needs_grad=True)
    assert "multiples of" not in _reasons("sdpa.efficient", replace(f32, head_dim=116, value_dim=116))
    assert "multiples of 4 only" in _reasons("sdpa.efficient", replace(f32, head_dim=114, value_dim=114))
    assert "multiples of 8 only" in _reasons("sdpa.efficient", replace(f32, dtype=torch.bfloat16, head_dim=116,
                                                                      value_dim=116))
    t = torch.randn(2 * 3 * 5 * 116 + 1)[1:].view(2, 3, 5, 116)  # an odd offset: copied, not padded
    f = fused_form(t, 116, 4)
    assert fused_ready(f, 4) and not fused_ready(f) and f.shape == t.shape and torch.equal(f, t)


@pytest.mark.parametrize("dims,declines", [((40, 8), True), ((216, 8), True), ((100, 19), True), ((64, 8), True),
                                           ((40, 40), False), ((64, 32), False), ((128, 16), False)])
def test_triton_kernels_decline_unlike_value_head_dims_where_one_is_padded_on_cuda(monkeypatch, dims, declines):
    from adaattn.backends.triton import runner

    monkeypatch.setattr(runner, "interpreting", lambda: False)
    monkeypatch.setattr(runner.hardware, "capability_at_least", lambda *a: True)
    monkeypatch.setattr(runner, "TRITON_FOUND", True)
    reasons = " ".join(runner.triton_reasons("cuda", 0, torch.bfloat16, *dims))
    assert ("its forward faulted" in reasons) == declines, reasons
    # The interpreter (CPU) runs them: its tests keep covering these head dims.
    monkeypatch.setattr(runner, "interpreting", lambda: True)
    assert "its forward faulted" not in " ".join(runner.triton_reasons("cpu", None, torch.bfloat16, *dims))


def test_triton_runners_decline_gradients_of_calls_that_are_not_4d():
    from adaattn.backends.triton.runner import triton_runners

    ptr = next(r for r in triton_runners() if r.name == "triton.ptr")
    grad = _problem(device_type="cpu", device_index=None, needs_grad=True, out_lead=(2, 2, 4))
    assert any("4-D calls only" in r for r in ptr.supports(grad, Policy()))
    assert not any("4-D calls only" in r for r in ptr.supports(replace(grad, out_lead=None), Policy()))


def test_efficient_takes_float32_only_as_torch_does_4d_without_gqa():
    # seed 5101 #2538, #2602, #608 and seed 4601 #1378, #3793 on an H100: float32 GQA or 2-/3-D
    # calls ran the efficient kernel on repeated heads or a flattened call, at 3-600x the error of
    # torch's math kernel, which torch runs there.
    f32 = _problem(dtype=torch.float32)
    assert "takes float32 only as torch does" in _reasons("sdpa.efficient", replace(f32, kv_heads=2, gqa=True))
    assert "takes float32 only as torch does" in _reasons("sdpa.efficient", replace(f32, out_lead=(2, 4)))
    assert "takes float32 only as torch does" not in _reasons("sdpa.efficient", f32)
    # seed 5200 #9366 (H100): float32 D=214 padded to 216 for the efficient kernel, 5.6x the output
    # error of torch's math kernel, which torch runs for head dims that are not multiples of 4.
    assert "takes float32 only as torch does" in _reasons("sdpa.efficient", replace(f32, head_dim=214, value_dim=214))
    assert "takes float32 only as torch does" in _reasons("sdpa.efficient", replace(f32, value_dim=70))
    assert "takes float32 only as torch does" not in _reasons("sdpa.efficient", replace(f32, head_dim=20, value_dim=20))
    assert "takes float32 only as torch does" not in _reasons("sdpa.efficient", _problem(head_dim=214, value_dim=214))
    assert "takes float32 only as torch does" not in _reasons("sdpa.efficient", _problem(kv_heads=2, gqa=True))


def test_efficient_bias_aligns_an_offset_mask_and_pads_its_rows():
    # seed 5102 #4248 (H100): a float16 mask at an odd offset made the kernel raise "attn_bias_ptr
    # is not correctly aligned", and a fallback warning.
    flat = torch.randn(96 * 96 + 3, dtype=torch.float16)
    m = flat[3:].view(96, 96)
    out = efficient_bias(m, torch.float16, 96)
    assert out.data_ptr() % 16 == 0 and out.stride(0) % 8 == 0 and torch.equal(out, m)
    odd = torch.randn(5, 7)  # rows of 28 bytes: laid out in rows of 32
    out = efficient_bias(odd, torch.float32, 7)
    assert out.stride() == (8, 1) and torch.equal(out, odd)
    dense = torch.randn(5, 8)
    assert torch.equal(efficient_bias(dense, torch.float32, 8, floor=False), dense)


def test_efficient_bias_is_not_floored_when_gradients_are_taken():
    # seed 5101 #1979, #3541, seed 5102 #1026, #2782, #2996, #4211 (H100): with the floor, the
    # kernel's backward recomputed the weights of a finfo.min row from a -1e30 log-sum-exp:
    # inf gradients (bfloat16), 3x torch's error (float32).
    m = torch.tensor([[0.0, torch.finfo(torch.bfloat16).min]], dtype=torch.bfloat16)
    assert -1.1e30 < efficient_bias(m, torch.bfloat16, 2, floor=True)[0, 1].item() < -0.9e30
    assert torch.equal(efficient_bias(m, torch.bfloat16, 2, floor=False), m)


def test_a_kernel_selection_refusal_declines_without_a_warning():
    # seed 5101 #1625, seed 5102 #4245 (H100): float32 calls torch's can_use check passed and the
    # efficient kernel's host-side selection refused ("cutlassF: no kernel found to launch!").
    from adaattn.backends.base import Declined

    runner = RUNNERS["sdpa.efficient"]

    def refuse(*args):
        raise RuntimeError("cutlassF: no kernel found to launch!")

    def fail(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    probe = type(runner).__new__(type(runner))
    probe.__dict__.update(runner.__dict__)
    probe.direct = refuse
    with pytest.raises(Declined):
        probe._direct(None, None, None, _problem())
    probe.direct = fail
    with pytest.raises(RuntimeError, match="illegal memory"):
        probe._direct(None, None, None, _problem())


def test_cudnn_takes_masks_value_dims_and_wide_heads_with_torch_2_11():
    from adaattn.backends.sdpa_forms import CUDNN_WIDE

    def _reasons(name, problem):  # what the kernel takes (this machine has no GPU to ask about)
        return " ".join(r for r in RUNNERS[name].supports(problem, Policy()) if "compute capability" not in r)

    cudnn = "sdpa.cudnn"
    for mask in ("bool", "additive"):
        assert _reasons(cudnn, _problem(mask_kind=mask, mask_dtype=torch.float16 if mask == "additive" else None)) == ""
    assert "no gradient for an attn_mask" in _reasons(cudnn, _problem(mask_kind="additive", mask_grad=True,
                                                                      needs_grad=True))
    wide = [_problem(value_dim=72), _problem(head_dim=256, value_dim=256), _problem(causal=True, q_len=3)]
    for p in wide:
        assert (_reasons(cudnn, p) == "") == CUDNN_WIDE, p
    assert "exceeds its limit" in _reasons(cudnn, _problem(head_dim=264, value_dim=264))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float16])
def test_cudnn_bias_unmasks_dead_rows_and_names_the_live_ones(dtype):
    from adaattn.backends.sdpa_forms import cudnn_bias

    keep = torch.rand(2, 1, 6, 7) < 0.6
    keep[0, 0, 2] = False  # a dead row
    keep[1, 0, 5] = False
    keep[0, 0, 3] = True
    mask = keep if dtype == torch.bool else torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, -math.inf)
    bias, live = cudnn_bias(mask, torch.float16, 7, floor=True)
    assert live.shape == (2, 1, 6, 1) and torch.equal(live[..., 0], keep.any(-1))
    assert bias.dtype == torch.float16 and bias.shape == (2, 1, 6, 7)
    assert torch.equal(bias[0, 0, 2], torch.zeros(7, dtype=torch.float16))  # unmasked: finite, zeroed after
    rows = live[..., 0]
    assert torch.equal(torch.isneginf(bias)[rows], ~keep[rows])
    assert bias.stride(-2) * 2 % 16 == 0  # 16-byte rows, as the fused kernels load them



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_and_drowned_rows_are_found_and_moved_to_peak_at_zero(dtype):
    # seed 5411 #339 (H200): a row whose window keys all carried finfo.min overflowed to -inf in
    # cuDNN's kernel (0.40 output error, inf gradients) where SDPA gives uniform weights.
    low, inf = torch.finfo(dtype).min, math.inf
    m = torch.tensor([[low, low, -inf, -inf], [0.0, low, -2.0, -inf], [-inf] * 4, [-7.0, -9.0, low, 3.0],
                      [-1e30, -1e30, -1e30, low], [low, -3e38, low, -inf]], dtype=dtype)
    s, rows = drowned_rows(m)
    assert rows.flatten().tolist() == [True, False, False, False, True, True]
    assert torch.equal(s[0], torch.tensor([0.0, 0.0, -inf, -inf], dtype=dtype))
    assert all(torch.equal(s[i], m[i]) for i in (1, 2, 3))  # other rows keep their values to the bit
    assert s[5, 1].item() == 0.0 and s[5, 0].item() < -1e37 and s[5, 3].item() == -inf  # differences kept
    live = [0, 1, 3, 4, 5]
    assert torch.allclose(torch.softmax(s[live].double(), -1), torch.softmax(m[live].double(), -1), atol=1e-6)
    wide = m[None, None].expand(3, 5, 6, 4)  # a broadcast mask stays broadcast: no full-size copy
    shifted, w_rows = drowned_rows(wide)
    assert torch.equal(shifted, s.expand(3, 5, 6, 4)) and shifted.stride()[:2] == (0, 0)
    assert torch.equal(w_rows, rows[None, None])
    plain = torch.tensor([[0.0, -1e4, -inf]], dtype=dtype)
    assert drowned_rows(plain) == (plain, None)  # nothing drowned: nothing copied
    # Low rows that do not drown (cuDNN's backward gave inf dq at -1e4: seed 20261129 #132) are
    # shifted alone; float16's finfo.min drowns nothing in float32.
    for low_row in (torch.tensor([[-1e4, -1e4 - 64, -inf], [0.0, -1e4, -inf]], dtype=dtype),
                    torch.tensor([[-65504.0, -65504.0], [1.0, -65504.0]], dtype=torch.float16)):
        moved, none = drowned_rows(low_row)
        assert none is None and torch.equal(moved[1], low_row[1])
        assert torch.equal(moved[0], low_row[0] - low_row[0].max())
        assert torch.allclose(torch.softmax(moved.double(), -1), torch.softmax(low_row.double(), -1))
        # The efficient kernel takes rows of -1e4 as they are (seed 5418 #2950).
        assert drowned_rows(low_row, EFFICIENT_LOW_PEAK) == (low_row, None)
    s_eff, rows_eff = drowned_rows(m, EFFICIENT_LOW_PEAK)
    assert torch.equal(rows_eff, rows) and torch.equal(s_eff[rows.flatten()], s[rows.flatten()])
    # Below EFFICIENT_LOW_PEAK float32 loses the scores beside the bias: such rows move for it too.
    lost = torch.tensor([[-1e9, -1e9 - 128, -inf], [0.0, -1e9, -inf]], dtype=dtype)
    moved, none = drowned_rows(lost, EFFICIENT_LOW_PEAK)
    assert none is None and torch.equal(moved[0], lost[0] - lost[0].max()) and torch.equal(moved[1], lost[1])


@pytest.mark.parametrize("gqa", [False, True])
def test_drowned_rows_run_in_two_launches_give_sdpa_s_gradients(gqa):
    """A fused kernel recomputes a drowned row's weights from a log-sum-exp that drowned too:
    torch's fused CPU kernel, like the CUDA ones, gives gradients there n times SDPA's (0.7
    relative here). The runner's two launches (_run_drowned) give SDPA's answer, forward and
    backward, against a float64 softmax; here through torch's fused CPU kernel (no mask gradient
    there; test_gpu_sdpa takes one)."""
    from torch.nn.attention import SDPBackend

    from adaattn.backends.sdpa import SdpaRunner

    torch.manual_seed(0)
    hk = 1 if gqa else 2
    q = torch.randn(1, 2, 5, 16, requires_grad=True)
    k, v = (torch.randn(1, hk, 6, 16, requires_grad=True) for _ in range(2))
    m = torch.zeros(5, 6)
    m[1] = torch.finfo(torch.float32).min
    m[1, 4:] = -math.inf
    m[2, :3], m[2, 3:] = torch.finfo(torch.float32).min, -1e30
    m[4, :] = -1e26
    go = torch.randn(1, 2, 5, 16)

    def grads(fn, *args):
        out = fn(*args)
        return [out, *torch.autograd.grad(out, args[:3], go.to(out.dtype))]

    def manual(q, k, v, m):
        kk, vv = (t.repeat_interleave(2 // hk, dim=1) for t in (k, v))
        return torch.softmax(q @ kk.transpose(-1, -2) / 4 + m, -1) @ vv

    ref = grads(manual, *(t.detach().double().requires_grad_() for t in (q, k, v)), m.double())
    # torch's fused CPU kernel drowns as the CUDA ones do; the two launches are the point
    runner = SdpaRunner("sdpa.flash-cpu", SDPBackend.FLASH_ATTENTION, "cpu", (torch.float32,), native_gqa=False)
    runner._check = lambda *args: None  # torch's checks are CUDA's
    problem = _problem(batch=1, q_heads=2, kv_heads=hk, q_len=5, kv_len=6, head_dim=16, value_dim=16,
                       dtype=torch.float32, device_type="cpu", mask_kind="additive", scale=0.25, needs_grad=True,
                       gqa=gqa)

    def two_launches(q, k, v, m):
        shifted, rows = drowned_rows(m)
        return runner._run_drowned(q, k, v, shifted, rows, problem)

    def err(got):
        return max(((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, ref))

    assert err(grads(two_launches, q, k, v, m)) < 1e-5
    shifted, rows = drowned_rows(m)
    one = grads(lambda q, k, v, m: runner._launch(q - q.detach() * rows, k, v, drowned_rows(m)[0], problem, False),
                q, k, v, m)
    assert err(one) > 1e-2  # the first launch alone misses the drowned rows' part of dk


def test_a_planned_route_is_the_same_for_every_problem_of_its_plan_s_class():
    """SdpaRunner.prepare decides a call's route once per plan, and a plan serves every problem with
    its key (planner.plan_key): over fuzzer-drawn calls, made CUDA-side too, problems with equal keys
    get equal routes from every SDPA runner, and an empty side never gets one."""
    from adaattn import planner
    from adaattn.backends.sdpa import DIRECT, PLAIN
    from adaattn.problem import validate
    from fuzz import sdpa as fz

    routes: dict = {}
    seen = {DIRECT: 0, PLAIN: 0}
    for index in range(400):
        c = fz.draw(77, index, "cpu")
        x = fz.build(c, "cpu")
        base = validate(x.q, x.k, x.v, x.mask, 0.0, c.causal, c.scale, c.enable_gqa, c.layout, c.window)
        for p in (base, replace(base, device_type="cuda", device_index=0)):
            for r in RUNNERS.values():
                route = r.prepare(p, Policy())
                if route is not None:
                    seen[route] += 1
                    assert p.q_len and p.kv_len
                key = (r.name, planner.plan_key(p, Policy()))
                assert routes.setdefault(key, route) is route, (r.name, p)
    assert seen[DIRECT] and seen[PLAIN]


def _drowned_case(dtype=torch.float32, mask_dtype=torch.float32):
    torch.manual_seed(0)
    q = torch.randn(1, 2, 5, 16, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 2, 6, 16, dtype=dtype, requires_grad=True) for _ in range(2))
    m = torch.zeros(5, 6, dtype=mask_dtype)
    m[1] = torch.finfo(mask_dtype).min
    m[1, 4:] = -math.inf
    m[3] = -1e20  # masked_fill(-1e20), a common idiom: drowned too (uniform in float64)
    go = torch.randn(1, 2, 5, 16, dtype=dtype)
    return q, k, v, m, go


def test_drowned_rows_under_dropout_draw_one_dropout_mask():
    """The second launch draws the first's dropout mask (the generator's state put back around it):
    with a kernel that drowns nothing (torch's math kernel, float32), the two launches give what
    one launch of it gives on the same seed. Drawn afresh, dk was 0.75 off (a review)."""
    from torch.nn.attention import SDPBackend

    from adaattn.backends.sdpa import SdpaRunner

    q, k, v, m, go = _drowned_case()
    runner = SdpaRunner("sdpa.math-cpu", SDPBackend.MATH, "cpu", (torch.float32,))
    runner._check = lambda *args: None
    problem = _problem(batch=1, q_heads=2, kv_heads=2, q_len=5, kv_len=6, head_dim=16, value_dim=16,
                       dtype=torch.float32, device_type="cpu", mask_kind="additive", scale=0.25, needs_grad=True,
                       dropout_p=0.5)

    def grads(fn):
        torch.manual_seed(7)
        out = fn()
        return [out, *torch.autograd.grad(out, (q, k, v), go)]

    def two():
        shifted, rows = drowned_rows(m)
        assert rows is not None
        return runner._run_drowned(q, k, v, shifted, rows, problem)

    def one():
        with torch.nn.attention.sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=0.5, scale=0.25)

    for a, b in zip(grads(two), grads(one)):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def _launch_dtypes(monkeypatch) -> list:
    """The query dtype of each SDPA runner launch from now on (the list fills as they run)."""
    import adaattn.backends.sdpa as sdpa

    launch, dtypes = sdpa.SdpaRunner._launch, []
    monkeypatch.setattr(sdpa.SdpaRunner, "_launch", lambda self, q, *a: dtypes.append(q.dtype) or launch(self, q, *a))
    return dtypes


def test_float16_queries_against_a_float32_mask_of_finfo_min_get_sdpa_s_gradients(monkeypatch):
    """seed 5803 #1283 (CPU): float16 queries, a float32 mask of finfo.min: the second launch's
    query scaled by 2^-40 underflowed float16 (dk 0.44 off); it runs in float32."""
    import adaattn

    q, k, v, m, go = _drowned_case(torch.float16, torch.float32)
    launches = _launch_dtypes(monkeypatch)

    def grads(qq, kk, vv, mm, policy=None):
        out = adaattn.attention(qq, kk, vv, attn_mask=mm, policy=policy)
        return [out, *torch.autograd.grad(out, (qq, kk, vv), go.to(out.dtype))]

    ours = grads(q, k, v, m)
    assert launches == [torch.float16, torch.float32]  # torch's fused CPU kernel: two launches, the second wide
    ref = grads(*(t.detach().double().requires_grad_() for t in (q, k, v)), m.double())
    for a, b in zip(ours, ref):
        assert ((a.double() - b).norm() / b.norm()).item() < 2e-3


def test_a_mask_taking_a_gradient_keeps_one_per_element_through_drowned_rows():
    """CPU fuzz seed 5810 #1516 and five more: a (4, 4, 4) mask leaf of strides (0, 4, 1), its rows
    at -1e4 or finfo.min, took its gradient as the sum at one head and zeros at the others: a
    broadcast dim read once is right for the values, not for a gradient kept per element."""
    leaf = torch.randn(4, 4)
    leaf[0] = torch.finfo(torch.float32).min
    leaf[1] = -1e4
    mask = leaf.as_strided((4, 4, 4), (0, 4, 1)).detach().requires_grad_()  # stride 0, and a leaf
    g = torch.randn(4, 4, 4)
    shifted, rows = drowned_rows(mask)
    assert rows is not None and rows.shape == (4, 4, 1)
    (got,) = torch.autograd.grad((shifted * g).sum(), mask)
    assert torch.equal(got, g)


def test_where_torch_runs_its_cpu_math_kernel_a_drowned_row_takes_one_launch(monkeypatch):
    """torch's CPU math kernel (a mask taking a gradient, say) answers drowned rows as SDPA's rule
    says; two launches there only added a rounding (CPU fuzz seed 5811 #11195: dk 2.05x math's)."""
    import adaattn

    launches = _launch_dtypes(monkeypatch)
    q, k, v, m, go = _drowned_case(torch.bfloat16, torch.bfloat16)
    m.requires_grad_()
    out = adaattn.attention(q, k, v, attn_mask=m)
    torch.autograd.grad(out, (q, k, v, m), go)
    assert launches == [torch.bfloat16]


def test_under_torch_compile_low_rows_are_shifted_without_a_read(monkeypatch):
    """Under torch.compile the mask cannot be read (a sync), but its low rows are shifted all the
    same (a review: the runner skipped drowned_rows there, so finfo.min reached cuDNN, which gave
    0.40 output error and inf gradients on the H200); no row is named drowned (one launch)."""
    import adaattn
    import adaattn.backends.sdpa as sdpa

    seen = []
    real = sdpa.drowned_rows

    def spy(mask, *low_peak):
        shifted, rows = real(mask, *low_peak)
        seen.append((torch.compiler.is_compiling(), rows is None))
        return shifted, rows

    monkeypatch.setattr(sdpa, "drowned_rows", spy)
    q, k, v, m, go = _drowned_case()
    out = torch.compile(lambda q, k, v, m: adaattn.attention(q, k, v, attn_mask=m))(q, k, v, m)
    grads = torch.autograd.grad(out, (q, k, v), go)
    assert (True, True) in seen
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    rows = [0, 2, 4]  # rows that neither drown nor shift: SDPA's answer
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m.double())
    assert torch.allclose(out[:, :, rows].double(), ref[:, :, rows], atol=1e-5)


def test_cudnn_declines_the_gradients_its_backward_would_refuse_or_overflow(monkeypatch):
    """Declines whose failure would surface only in the backward, after the forward ran (nothing
    could fall back there): one query against one key (cuDNN: 's_q = s_kv = 1 is not supported',
    CUDA fuzz seed 5414), float16 with a mask or window at scales from 0.25 (dq = inf at scales >= 1, seed 5415 #16352),
    and cuDNN 9.10.0/9.10.1 (no half backward). Forward-only calls and bfloat16 keep cuDNN."""
    import adaattn.backends.sdpa as sdpa_mod

    cudnn = RUNNERS["sdpa.cudnn"]

    def says(problem, words):
        return any(words in r for r in cudnn.supports(problem, Policy()))

    one = _problem(q_len=1, kv_len=1, needs_grad=True)
    assert says(one, "one query against one key")
    assert not says(replace(one, needs_grad=False), "one query against one key")
    assert not says(replace(one, kv_len=2), "one query against one key")
    for form in (dict(mask_kind="bool"), dict(mask_kind="additive"), dict(window_left=8)):
        masked = _problem(needs_grad=True, scale=1.69, **form)
        assert says(masked, "inf gradients in float16"), form
        assert not says(replace(masked, dtype=torch.bfloat16), "inf gradients in float16")
        assert not says(replace(masked, needs_grad=False), "inf gradients in float16")
        # Under the measured scale cuDNN runs them, as torch does (its dq 2.8x more accurate than
        # the efficient kernel's: seed 5200 #3423).
        assert not says(replace(masked, scale=0.125), "inf gradients in float16")
        assert says(replace(masked, scale=0.25), "inf gradients in float16")
    assert not says(_problem(needs_grad=True, scale=1.0), "inf gradients in float16")
    for version, refused in ((91000, True), (91001, True), (91002, False), (90900, False)):
        monkeypatch.setattr(sdpa_mod, "CUDNN_VERSION", version)
        assert says(_problem(needs_grad=True), "9.10.0 and 9.10.1") == refused
        assert not says(_problem(), "9.10.0 and 9.10.1")


def test_cudnn_takes_no_gradients_at_exactly_64_keys_and_math_runs_there_first(monkeypatch):
    """cuDNN's backward gave NaN dq on rows of a low log-sum-exp at exactly 64 keys, masked or not,
    float16 and bfloat16 (seeds 5421 #2768, 5419 #12693; a probe: 5, 65, 96, 128 keys finite, H200):
    sdpa.cudnn declines those gradients, and sdpa.math runs first (flash's bfloat16 dq there: 108x math's)."""
    from adaattn import planner

    cudnn = RUNNERS["sdpa.cudnn"]

    def says(problem):
        return any("exactly 64 keys" in r for r in cudnn.supports(problem, Policy()))

    for dtype in (torch.float16, torch.bfloat16):
        for form in (dict(), dict(mask_kind="bool"), dict(causal=True), dict(q_len=5)):
            hit = _problem(needs_grad=True, dtype=dtype, **form)
            assert says(hit), (dtype, form)
            assert not says(replace(hit, needs_grad=False))
            for keys in (63, 65, 128):
                assert not says(replace(hit, kv_len=keys, q_len=min(hit.q_len, keys)))
    monkeypatch.setattr(planner, "_torch_prefers_cudnn", lambda arch: arch == "sm90")
    hit = _problem(needs_grad=True, mask_kind="additive")
    notes = []
    order = ["sdpa.efficient", "triton.ptr", "sdpa.math"]
    assert planner._math_where_cudnn_nans(hit, order, notes, "sm90") == ["sdpa.math", "sdpa.efficient", "triton.ptr"]
    assert notes and "NaN" in notes[0]
    assert planner._math_where_cudnn_nans(hit, ["sdpa.flash", "sdpa.math"], [], "sm90") == ["sdpa.math", "sdpa.flash"]
    for change in (dict(kv_len=65), dict(needs_grad=False), dict(dtype=torch.float32), dict(device_type="cpu")):
        assert planner._math_where_cudnn_nans(replace(hit, **change), order, [], "sm90") == order
    assert planner._math_where_cudnn_nans(hit, ["sdpa.efficient"], [], "sm90") == ["sdpa.efficient"]
    # Where torch's own choice is not cuDNN (an A100), its fused kernel stays the standard.
    assert planner._math_where_cudnn_nans(hit, order, [], "sm80") == order
    # An approximate runner first (mode="auto") keeps its place: math is no exact alternative's stand-in.
    assert planner._math_where_cudnn_nans(hit, ["triton.rank", "sdpa.efficient", "sdpa.math"], [], "sm90") == \
        ["triton.rank", "sdpa.efficient", "sdpa.math"]


def test_plans_at_64_keys_under_gradients_are_their_own_class(monkeypatch):
    """64 and 65 keys share a shape class; the 64-key rule (sdpa.cudnn declines, sdpa.math first)
    must not reach a 65-key call's cached plan, nor that plan a 64-key call (a review's repro)."""
    from adaattn import hardware, planner

    monkeypatch.setattr(hardware, "arch", lambda t, i=None: "sm90" if t == "cuda" else "cpu")
    monkeypatch.setattr(hardware, "capability_at_least", lambda *a: True)
    monkeypatch.setattr(hardware, "max_shared_memory", lambda i: 232448)
    monkeypatch.setattr(planner, "_torch_prefers_cudnn", lambda arch: True)
    p64 = _problem(needs_grad=True, dtype=torch.bfloat16)
    p65 = replace(p64, kv_len=65, q_len=65)
    assert p64.shape_class == p65.shape_class
    assert planner.plan_key(p64, Policy()) != planner.plan_key(p65, Policy())
    for first, second in ((p65, p64), (p64, p65)):
        planner.reset()
        plans = {p.kv_len: planner.get_plan(p, Policy()) for p in (first, second)}
        assert plans[64].backend == "sdpa.math" and "sdpa.cudnn" not in plans[64].candidates
        assert plans[65].backend != "sdpa.math" and "sdpa.cudnn" in plans[65].candidates
    planner.reset()
    # Forward-only calls at 64 keys keep cuDNN.
    assert "sdpa.cudnn" in planner.get_plan(replace(p64, needs_grad=False), Policy()).candidates
    planner.reset()


def test_sinks_cudnn_and_the_ring_cudnn_blocks_take_no_gradients_at_64_keys(monkeypatch):
    """The other paths through cuDNN's backward: sinks.cudnn declines gradients at 64 keys, a ring's
    64-key block (a zigzag shard of 128) runs its backward on our Triton blocks, and varlen.sdpa's
    64-key documents run torch's math kernel."""
    from adaattn.backends import ring_blocks
    from adaattn.backends.sdpa_sinks import sinks_runners

    monkeypatch.setattr("adaattn.backends.sdpa_sinks.hardware.capability_at_least", lambda *a: True)
    sinks = {r.name: r for r in sinks_runners()}
    call = _problem(needs_grad=True, sinks=True)

    def says(name, problem):
        return any("exactly 64 keys" in r for r in sinks[name].supports(problem, Policy()))

    assert says("sinks.cudnn", call)
    assert not says("sinks.cudnn", replace(call, needs_grad=False))
    assert not says("sinks.cudnn", replace(call, kv_len=65, q_len=65))
    assert not says("sinks.flash", call)

    seen = []
    eng = ring_blocks.CudnnBlocks.__new__(ring_blocks.CudnnBlocks)

    class Ours:
        def backward(self, *args):
            seen.append("ours")
            return "ours"

    eng.triton = Ours()
    monkeypatch.setattr(ring_blocks.CudnnBlocks, "failed", False)
    monkeypatch.setattr(ring_blocks.CudnnBlocks, "_bwd", staticmethod(lambda *a: seen.append("cudnn") or "cudnn"))
    for keys, want in ((64, "ours"), (65, "cudnn"), (128, "cudnn")):
        q, k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, keys, 16), torch.randn(1, 2, keys, 16)
        assert eng.backward(q, k, v, q, q, q[..., 0], 0.25, -1, -1) == want, keys
    # varlen.sdpa's per-document calls: math at 64 keys under gradients on CUDA, torch's choice elsewhere.
    from adaattn.backends.varlen import math_only

    assert math_only(64, torch.bfloat16, "cuda", True) and math_only(64, torch.float16, "cuda", True)
    assert not any((math_only(65, torch.bfloat16, "cuda", True), math_only(64, torch.bfloat16, "cuda", False),
                    math_only(64, torch.float32, "cuda", True), math_only(64, torch.bfloat16, "cpu", True)))


def test_float64_queries_with_a_float32_mask_match_float64_on_the_cpu():
    """torch's fused CPU kernel takes a float32 additive mask with float64 queries and answers
    wrongly (1.6 relative, torch 2.13; CPU fuzz seed 5833 #64792): the mask goes in as float64."""
    import adaattn

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, dtype=torch.float64, requires_grad=True) for n in (5, 40, 40))
    mask = torch.randn(5, 40) * 2
    out = adaattn.attention(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    r = [t.detach().requires_grad_(True) for t in (q, k, v)]
    ref = torch.softmax(r[0] @ r[1].transpose(-1, -2) / 4 + mask.double(), -1) @ r[2]
    ref_grads = torch.autograd.grad(ref.square().sum(), r)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-9, atol=1e-11)
