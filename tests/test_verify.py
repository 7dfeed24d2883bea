"""The verification kernels (kernels/verify.py): sampled exact rows against float64 attention,
and the per-head verification stages against their torch equivalent (adaptive/controller._step)."""

from __future__ import annotations

import torch

import pytest

triton = pytest.importorskip("triton")

from adaattn.adaptive import analysis, controller  # noqa: E402
from adaattn.adaptive import quant_launch as tq  # noqa: E402
from adaattn.adaptive import verify_launch  # noqa: E402

from helpers import DEVICE, NEEDS_CUDA_OR_INTERPRETER, keep_mask  # noqa: E402

pytestmark = NEEDS_CUDA_OR_INTERPRETER


def _float64_rows(q, k, v, rows, scale, keep):
    g = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(g, 1)
    vv = v.double().repeat_interleave(g, 1)
    s = q.double()[:, :, rows.long()] @ kk.transpose(-1, -2) * scale
    if keep is not None:
        s = s.masked_fill(~keep[rows.long()].to(s.device), float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return p @ vv


@pytest.mark.parametrize(
    "b,hq,hkv,nq,nk,d,dtype,causal,window,align,r",
    [
        (2, 4, 2, 70, 70, 64, torch.bfloat16, False, None, "top_left", 64),
        (1, 2, 2, 50, 83, 128, torch.float16, True, None, "top_left", 20),
        (1, 3, 1, 40, 29, 64, torch.bfloat16, True, None, "bottom_right", 40),  # rows before the first key
        (1, 2, 1, 61, 61, 64, torch.bfloat16, False, (7, 3), "top_left", 9),
        (2, 2, 2, 33, 47, 80, torch.float16, False, (5, None), "bottom_right", 33),
        (1, 2, 1, 300, 300, 64, torch.bfloat16, True, None, "top_left", 200),  # two row chunks, causal bound
        (1, 2, 2, 150, 150, 64, torch.float16, False, None, "top_left", 150),
    ],
)
@pytest.mark.parametrize("split", [False, True])
def test_exact_rows_kernel_matches_float64(monkeypatch, split, b, hq, hkv, nq, nk, d, dtype, causal, window, align, r):
    if split:  # keys over several programs, combined after: splits of 32 keys
        monkeypatch.setattr(verify_launch, "SPLIT_MIN_KEYS", 32)
    g = torch.Generator().manual_seed(nq * 31 + nk)
    q, k, v = ((torch.randn(b, h, n, d, generator=g) * 1.5).to(dtype).to(DEVICE)
               for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    rows = torch.randperm(nq, generator=g)[:r].sort().values.to(torch.int32).to(DEVICE)
    scale = d ** -0.5
    left, right = (-1, -1) if window is None else (-1 if window[0] is None else window[0],
                                                     -1 if window[1] is None else window[1])
    ref = verify_launch.exact_rows(q, k, v, rows, None, scale, causal, align == "bottom_right", left, right)
    assert ref is not None, "the kernel should run here"
    keep = keep_mask(nq, nk, causal, window, bottom_right=align == "bottom_right") if (causal or window is not None) else None
    want = _float64_rows(q.cpu(), k.cpu(), v.cpu(), rows.cpu(), scale, keep)
    err = (ref.cpu().double() - want).norm() / want.norm()
    assert err <= 2e-5, err
    if keep is not None:  # rows that see no key are zero
        blind = ~keep[rows.long().cpu()].any(1)
        assert (ref.cpu()[:, :, blind] == 0).all()
    # analysis.exact_rows takes the kernel without p, and the torch reference with p: they agree
    torch_ref, _ = analysis.exact_rows(q, k, v, rows, None, scale, causal, align == "bottom_right", left, right)
    assert (torch_ref.cpu().double() - want).norm() / want.norm() <= 2e-5


def test_exact_rows_kernel_declines_what_it_does_not_cover():
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16, device=DEVICE)
    rows = torch.arange(8, device=DEVICE)
    mask = torch.ones(16, 16, dtype=torch.bool, device=DEVICE)
    assert verify_launch.exact_rows(q, q, q, rows, mask, 0.1, False, False, -1, -1) is None
    assert verify_launch.exact_rows(q.float(), q.float(), q.float(), rows, None, 0.1, False, False, -1, -1) is None


@pytest.mark.parametrize("allowed", [(tq.LEVEL_QK8, tq.LEVEL_FP8), (tq.LEVEL_FP8,)])
def test_verify_steps_match_their_torch_equivalent(monkeypatch, allowed):
    g = torch.Generator().manual_seed(len(allowed))
    b, hq, nq, r, d = 2, 8, 40, 16, 64
    ref = torch.randn(b, hq, r, d, generator=g).to(DEVICE)
    rows = torch.randperm(nq, generator=g)[:r].sort().values.to(torch.int32).to(DEVICE)
    out = torch.randn(b, hq, nq, d, generator=g).to(torch.bfloat16)
    # heads 0-3 close to the reference, 4-7 far; head 6's reference is zero (its error is ||out||)
    noise = torch.tensor([1e-3, 1e-2, 3e-2, 1e-3, 0.2, 0.3, 0.5, 1.0]).view(1, hq, 1, 1)
    out[:, :, rows.long().cpu()] = (ref.cpu() + noise * torch.randn(b, hq, r, d, generator=g)).to(torch.bfloat16)
    ref[:, 6] = 0
    out = out.to(DEVICE)
    levels = torch.tensor([2, 1, 2, 0, 2, 1, 2, 0], dtype=torch.int32, device=DEVICE)
    up = torch.tensor([controller._up(x, tuple(sorted(set(allowed) | {0}))) for x in range(3)], dtype=torch.int32,
                      device=DEVICE)
    results = []
    first_out = out
    for kernel in (True, False):
        out = first_out
        if not kernel:
            monkeypatch.setattr(verify_launch, "verify_step", lambda *a: False)
        work = torch.full((3, 8), -7, dtype=torch.int32, device=DEVICE)
        errs = torch.zeros((3, 8), dtype=torch.float32, device=DEVICE)
        for stage in (0, 1, 2):
            if stage == 1:  # the redo changed the rows of the redone heads (here: halves their error)
                redone = (work[0] >= 0).cpu()
                fix = out.clone()
                fix[:, :, rows.long()] = (0.5 * (out[:, :, rows.long()].float() + ref)).to(out.dtype)
                out = torch.where(redone.to(DEVICE).view(1, hq, 1, 1), fix, out)
            controller._step(out, rows, ref, levels, up, work, errs[stage], 0.04, stage)
        results.append((work.cpu(), errs.cpu()))
    (w_kernel, e_kernel), (w_torch, e_torch) = results
    assert torch.equal(w_kernel, w_torch), (w_kernel, w_torch)
    assert torch.allclose(e_kernel, e_torch, rtol=1e-5, atol=0)
    assert (w_kernel[0, [0, 1, 3, 7]] == -1).all() and (w_kernel[0, [4, 5, 6]] >= 0).all()
    assert e_kernel[0, 6] > 1  # ||out|| where the reference is zero
