"""Quantized attention forward in Triton: launch glue and the torch custom op.

Three operating points ("levels"), most precise first:
  0 "exact"  Q.K^T and P.V in the input dtype (the exact kernel's math),
  1 "qk8"    Q.K^T in INT8 (K smoothed, per-block K scales, per-row Q scales), P.V in the
             input dtype,
  2 "fp8"    Q.K^T in INT8 (or FP8 E4M3, `fp8_qk`), P.V in FP8 E4M3 (V smoothed, per-channel
             scales), FP32 accumulation.
"One level up" from a level is the next more precise one. `quant_attention` computes every
head at its own level: one launch per level present, each skipping the heads of other
levels, so no host synchronisation is needed to mix levels.

The pre-pass runs once per call for the levels launched: the smoothing means from a strided
sample of K and V rows, V's per-channel range (one read of V, fp8 only), then one Triton
kernel that reads K (and V) once and writes them quantized.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..adaptive.quant_reference import smoothing_mean
from .base import Backend
from .triton_attention import (
    CONFIGS,
    _dot_precision,
    _Layout,
    KernelConfig,
    _mask_args,
    _new_output,
    _position_flags,
    exp_fma_share,
    interpreting,
    length_bucket,
    max_shared_memory,
    triton,
    unsupported_options,
)

try:
    from ..kernels.attention_fwd import LOG2E
    from ..kernels.attention_quant import (
        PV_FP8,
        PV_NATIVE,
        QK_FP8,
        QK_INT8,
        QK_NATIVE,
        attention_quant_fwd_kernel,
        quantize_kv_kernel,
    )
except Exception:  # triton missing: triton_attention says why
    attention_quant_fwd_kernel = None

LEVELS = ("exact", "qk8", "fp8")
LEVEL_EXACT, LEVEL_QK8, LEVEL_FP8 = 0, 1, 2
SUPPORTED_HEAD_DIMS = (64, 128)
FP8_MAX = 448.0
# Q.K^T precision of the fp8 level: "int8" is the more accurate (see benchmarks/NOTES.md for
# the speed of each on the H100).
FP8_LEVEL_QK = "int8"

# One config per level for the CPU interpreter; BLOCK_N is also the K quantization block.
INTERPRET_QUANT = KernelConfig(32, 16, 1, 1)
# Hopper candidates (timed once per shape class like the exact kernel's); the first fitting
# one runs when nothing is timed.
QUANT_CONFIGS = {
    64: [KernelConfig(128, 64, 4, 3), KernelConfig(128, 128, 8, 3), KernelConfig(128, 64, 8, 4),
         KernelConfig(64, 64, 4, 3)],
    # H100, N=16384 (results/2026-11-22-quant-attention-h100.json): qk8 fastest at
    # 128/64/w8/s3, fp8 at 128/128/w8/s3 and 64/64/w4/s3.
    128: [KernelConfig(128, 64, 8, 3), KernelConfig(128, 128, 8, 3), KernelConfig(64, 64, 4, 3),
          KernelConfig(128, 64, 4, 3), KernelConfig(128, 128, 8, 2), KernelConfig(128, 64, 8, 4)],
}


def level_modes(level: int, fp8_qk: bool = False) -> tuple[int, int]:
    """(QK_MODE, PV_MODE) of a level."""
    if level == LEVEL_EXACT:
        return QK_NATIVE, PV_NATIVE
    if level == LEVEL_QK8:
        return QK_INT8, PV_NATIVE
    return (QK_FP8 if fp8_qk else QK_INT8), PV_FP8


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores: sm89 (Ada) and newer. Under the CPU interpreter the math is emulated."""
    if device.type == "cpu":
        return interpreting()
    major, minor = torch.cuda.get_device_capability(device)
    return (major, minor) >= (8, 9)


def int8_supported(device: torch.device) -> bool:
    if device.type == "cpu":
        return interpreting()
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _smem(cfg: KernelConfig, d: int, elem: int) -> int:
    return (cfg.block_m * d * elem + max(cfg.num_stages, 1) * 2 * cfg.block_n * d * elem) + 2048


def _configs(d: int, dtype: torch.dtype, device: torch.device) -> list:
    elem = torch.empty((), dtype=dtype).element_size()
    limit = max_shared_memory(device)
    fit = [c for c in QUANT_CONFIGS[d] if _smem(c, d, elem) <= limit]
    return fit or [KernelConfig(64, 32, 4, 1)]


class Prepared:
    """The quantized K/V of one call, per (QK_MODE, PV_MODE, BLOCK_N), made on first use."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v
        self.b, self.hkv, self.nk, self.d = k.shape
        self._k_mean = None
        self._v_stats = None
        self._made: dict = {}

    def k_mean(self) -> torch.Tensor:
        if self._k_mean is None:
            self._k_mean = smoothing_mean(self.k).contiguous()
        return self._k_mean

    def v_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, scale) per (B, Hkv, D): V smoothed by its mean, scaled so max |v'| is 448."""
        if self._v_stats is None:
            v_mean = smoothing_mean(self.v)
            if self.nk:
                v_min, v_max = torch.aminmax(self.v, dim=-2)
                amax = torch.maximum(v_max.float() - v_mean, v_mean - v_min.float())
            else:
                amax = torch.zeros_like(v_mean)
            self._v_stats = (v_mean.contiguous(), (amax.clamp_min(1e-30) / FP8_MAX).contiguous())
        return self._v_stats

    def get(self, qk_mode: int, pv_mode: int, block_n: int):
        """(Kq, KScale, Vq, VScale, VMean, n_blocks); placeholders where a mode needs none."""
        key = (qk_mode, pv_mode, block_n)
        if key in self._made:
            return self._made[key]
        k, v = self.k, self.v
        n_blocks = max(triton.cdiv(self.nk, block_n), 1)
        npad = n_blocks * block_n
        dev = k.device
        if qk_mode == QK_NATIVE:
            kq, kscale, k_mean = k, torch.ones(1, device=dev), torch.zeros(1, device=dev)
        else:
            kdtype = torch.int8 if qk_mode == QK_INT8 else torch.float8_e4m3fn
            kq = torch.empty((self.b, self.hkv, npad, self.d), dtype=kdtype, device=dev)
            kscale = torch.empty((self.b, self.hkv, n_blocks), dtype=torch.float32, device=dev)
            k_mean = self.k_mean()
        if pv_mode == PV_FP8:
            v_mean, v_scale = self.v_stats()
            vq = torch.empty((self.b, self.hkv, self.d, npad), dtype=torch.float8_e4m3fn, device=dev)
        else:
            v_mean, v_scale, vq = torch.zeros(1, device=dev), torch.ones(1, device=dev), v
        if qk_mode != QK_NATIVE or pv_mode == PV_FP8:
            kqs = kq.stride() if qk_mode != QK_NATIVE else (0, 0, 0, 0)
            vqs = vq.stride() if pv_mode == PV_FP8 else (0, 0, 0, 0)
            quantize_kv_kernel[(n_blocks, self.b * self.hkv)](
                k, v, k_mean, v_mean, v_scale, kq, kscale, vq,
                k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                kqs[0], kqs[1], kqs[2], vqs[0], vqs[1], vqs[2],
                self.hkv, self.nk, n_blocks,
                HEAD_DIM=self.d, BLOCK_D=self.d, BLOCK_N=block_n,
                QK_MODE=qk_mode, PV_MODE=pv_mode, EMULATE=interpreting(),
                num_warps=4, num_stages=1,
            )
        made = (kq, kscale, vq, v_scale, v_mean, n_blocks)
        self._made[key] = made
        return made


def launch_level(q, k, v, prepared: Prepared, out, attn_mask, head_levels: Optional[torch.Tensor], level: int,
                 scale: float, causal: bool, bottom_right: bool, window_left: int, window_right: int,
                 fp8_qk: bool = False, exp_fma=None) -> None:
    """Write into `out` the rows of the heads at `level` (every head when head_levels is None).
    exp_fma: see triton_attention.VARIANTS (default there)."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if b * hq == 0 or nq == 0:
        return
    qk_mode, pv_mode = level_modes(level, fp8_qk)
    lay = _Layout(b, hq, hkv, nq, nk, d, False)
    mask, mask_strides, mask_kind = _mask_args(attn_mask, lay, q)
    has_left, left, has_right, right = _position_flags(causal, window_left, window_right)
    exp_share = exp_fma_share(exp_fma)

    def launch(cfg: KernelConfig):
        kq, kscale, vq, v_scale, v_mean, n_blocks = prepared.get(qk_mode, pv_mode, cfg.block_n)
        vq_strides = (vq.stride(0), vq.stride(1), vq.stride(2)) if pv_mode == PV_FP8 else (0, 0, 0)
        grid = (triton.cdiv(nq, cfg.block_m), b * hq)
        attention_quant_fwd_kernel[grid](
            q, k, v, kq, kscale, vq, v_scale, v_mean, out, mask,
            head_levels if head_levels is not None else q,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            kq.stride(0), kq.stride(1), kq.stride(2),
            *vq_strides,
            out.stride(0), out.stride(1), out.stride(2),
            *mask_strides,
            hq, hq // hkv, nq, nk, n_blocks,
            scale * LOG2E, left, right,
            RUN_LEVEL=level, HAS_HEAD_LEVEL=head_levels is not None,
            HEAD_DIM=d, BLOCK_D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BOTTOM_RIGHT=bottom_right, HAS_LEFT=has_left, HAS_RIGHT=has_right,
            MASK_KIND=mask_kind, QK_MODE=qk_mode, PV_MODE=pv_mode,
            DOT_PRECISION=_dot_precision(q.dtype), SCALE_POSITIVE=scale > 0, EMULATE=interpreting(),
            EXP_FMA=exp_share, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    kind = f"quant_{LEVELS[level]}" + ("_fp8qk" if fp8_qk and level == LEVEL_FP8 else "")
    if interpreting():
        cfg = CONFIGS.forced.get(kind, INTERPRET_QUANT)
    else:
        key = (q.device.index, q.dtype, d, causal, bottom_right, has_left, window_right >= 0, mask_kind,
               hq != hkv, length_bucket(nq), length_bucket(nk), exp_share)
        cfg = CONFIGS.pick(kind, key, _configs(d, q.dtype, q.device), launch)
    launch(cfg)


def quant_attention(q, k, v, attn_mask=None, *, levels, head_levels: Optional[torch.Tensor] = None,
                    scale: Optional[float] = None, causal: bool = False, bottom_right: bool = False,
                    window_left: int = -1, window_right: int = -1, fp8_qk: bool = False,
                    out: Optional[torch.Tensor] = None, prepared: Optional[Prepared] = None,
                    exp_fma=None) -> torch.Tensor:
    """Attention with each query head at its level; q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D).

    levels: the levels to launch; head_levels: int32 (Hq,) on q's device giving each head's
    level, or None when `levels` is one level for every head. Heads whose level is not in
    `levels` are left unwritten in `out` (for recomputing some heads of an earlier output).
    """
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if out is None:
        out = _new_output(q.shape, q.dtype, q.device)
    prepared = Prepared(k, v) if prepared is None else prepared
    for level in levels:
        launch_level(q, k, v, prepared, out, attn_mask, head_levels, int(level), scale, causal, bottom_right,
                     window_left, window_right, fp8_qk, exp_fma)
    return out


def quant_can_run(device: torch.device, dtype: torch.dtype, head_dim: int, value_dim: int) -> list[str]:
    """Reasons the quantized kernels cannot run here (empty: they can)."""
    reasons = []
    if attention_quant_fwd_kernel is None or triton is None:
        return ["triton does not import."]
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        reasons.append(f"quantized kernels run on CUDA GPUs (CPU only under TRITON_INTERPRET=1), got {device.type}.")
    elif device.type == "cuda" and not int8_supported(device):
        reasons.append("INT8 tensor cores need compute capability 8.0 or newer.")
    if dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"quantized kernels take float16 or bfloat16 inputs, got {str(dtype).replace('torch.', '')}.")
    if head_dim not in SUPPORTED_HEAD_DIMS or value_dim != head_dim:
        reasons.append(f"quantized kernels take head_dim 64 or 128 (value too), got {head_dim}/{value_dim}.")
    return reasons


class TritonQuantBackend(Backend):
    """Quantized attention forward (per-head levels exact / qk8 / fp8). Approximate: the
    planner puts it first only under Policy(mode="auto"); adaptive/ runs it."""

    name = "triton.quant"
    exact = False

    def supports(self, problem) -> list[str]:
        device = torch.device(problem.device_type, problem.device_index)
        return quant_can_run(device, problem.dtype, problem.head_dim, problem.value_dim) + unsupported_options(problem)

    def run(self, query, key, value, attn_mask, problem, plan):
        raise RuntimeError("triton.quant runs through adaattn.adaptive (it needs the policy and call site).")
