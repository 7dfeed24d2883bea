"""Launch glue of kernels/verify.py: the sampled exact rows and the per-head verification steps
of a verified adaptive call, one launch each (the torch reference in adaptive/analysis.py took
about a hundred small launches, milliseconds of host time per verified call).

Both run where the quantized kernels run (CUDA, or the CPU under TRITON_INTERPRET=1) for
bf16/fp16 inputs without an explicit mask; `exact_rows` and `verify_step` return None where
they do not apply, and the caller takes the torch path. A kernel that fails warns once and is
not tried again in this process.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ..backends.triton.bound import bound
from ..backends.triton.common import TRITON_FOUND, cdiv, dot_precision, interpreting, next_pow2


def _kernels():
    """(exact_rows_kernel, verify_step_kernel), imported with triton on first use; None without it."""
    if not TRITON_FOUND:
        return None, None
    from ..kernels.verify import exact_rows_kernel, verify_step_kernel

    return exact_rows_kernel, verify_step_kernel

ROW_CHUNK = 128  # rows one exact-rows program holds (more rows: more programs)
SPLIT_PROGRAMS = 256  # exact-rows programs to aim at when keys are split (several per SM)
SPLIT_MIN_KEYS = 2048  # the fewest keys a split holds
MAX_HEAD_DIM = 256
_failed: dict = {}


def _pow2(x: int, least: int) -> int:
    return max(least, next_pow2(max(int(x), 1)))


def _where_ok(t: torch.Tensor) -> bool:
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


def _fail(name: str, e: Exception) -> None:
    _failed[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    warnings.warn(f"adaattn: the {name} verification kernel failed ({_failed[name]}); sampled verification "
                  "uses the slower torch path from now on.", RuntimeWarning, stacklevel=3)


def exact_rows(q, k, v, rows, attn_mask, scale: float, causal: bool, bottom_right: bool, window_left: int,
               window_right: int) -> Optional[torch.Tensor]:
    """Exact attention rows (B, Hq, R, D) fp32 for the query positions `rows` (int32/int64 (R,)),
    or None where the kernel does not apply (see the module docstring)."""
    exact_rows_kernel, _ = _kernels()
    if exact_rows_kernel is None or "exact_rows" in _failed or attn_mask is not None:
        return None
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    r = rows.shape[0]
    if (q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype
            or k.shape[-1] != d or v.shape[-1] != d or d > MAX_HEAD_DIM or not 0 < r
            or not _where_ok(q) or any(t.stride(-1) != 1 for t in (q, k, v))):
        return None
    ref = torch.empty((b, hq, r, d), dtype=torch.float32, device=q.device)
    if nk == 0 or ref.numel() == 0:
        return ref.zero_()
    has_right = causal or window_right >= 0
    block_n = 16 if interpreting() else 64
    chunks = cdiv(r, ROW_CHUNK)
    # Keys split over programs until about SPLIT_PROGRAMS run (at least SPLIT_MIN_KEYS each): one
    # program per head and row chunk read all 131k keys in 4.8 ms on an H100.
    splits = max(1, min(cdiv(nk, SPLIT_MIN_KEYS), SPLIT_PROGRAMS // (b * hq * chunks)))
    split_len = cdiv(cdiv(nk, splits), block_n) * block_n
    splits = cdiv(nk, split_len)
    part = (torch.empty((b * hq, splits, r, d + 2), dtype=torch.float32, device=q.device) if splits > 1
            else ref)
    try:
        bound(exact_rows_kernel)[(b * hq, chunks, splits)](
            q, k, v, rows, ref, part,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            hq, hq // hkv, r, nq, nk, float(scale), max(window_left, 0), 0 if causal else max(window_right, 0),
            split_len,
            HEAD_DIM=d, BLOCK_D=_pow2(d, 16), BLOCK_R=min(_pow2(r, 16), ROW_CHUNK), BLOCK_N=block_n,
            HAS_LEFT=window_left >= 0, HAS_RIGHT=has_right, BOTTOM_RIGHT=bottom_right,
            DOT_PRECISION=dot_precision(q.dtype), SPLIT=splits > 1, num_warps=4, num_stages=2,
        )
    except Exception as e:  # noqa: BLE001  a kernel failure: the torch path runs
        _fail("exact_rows", e)
        return None
    if splits > 1:  # splits that saw no key carry m = -inf and l = 0
        m = part[..., d]
        top = m.amax(1, keepdim=True)
        w = torch.where(m == float("-inf"), 0.0, torch.exp(m - torch.where(top == float("-inf"), 0.0, top)))
        total = (w * part[..., d + 1]).sum(1)
        acc = (w[..., None] * part[..., :d]).sum(1)
        ref.copy_(torch.where(total[..., None] > 0, acc / total.clamp_min(1e-30)[..., None], 0.0).view(b, hq, r, d))
    return ref


def verify_step(out, rows, ref, levels, up, work, err, limit: float, stage: int) -> bool:
    """Per-head errors of `out`'s sampled rows against `ref` into err (Hq,) fp32 and, for stage 0
    and 1, the redo decisions into work (3, Hq) int32 (rows work.stride(0) apart) (kernels/verify.py). False where the
    kernel does not apply or failed (nothing written)."""
    _, verify_step_kernel = _kernels()
    if verify_step_kernel is None or "verify_step" in _failed or not _where_ok(out) or out.stride(-1) != 1:
        return False
    b, hq, _, d = out.shape
    r = rows.shape[0]
    try:
        bound(verify_step_kernel)[(hq,)](
            out, rows, ref, levels, up, work, err,
            out.stride(0), out.stride(1), out.stride(2), hq * r * d, work.stride(0),
            b, hq, r, float(limit),
            HEAD_DIM=d, BLOCK_R=_pow2(r, 1), BLOCK_D=_pow2(d, 1), STAGE=stage, num_warps=8, num_stages=1,
        )
    except Exception as e:  # noqa: BLE001
        _fail("verify_step", e)
        return False
    return True
