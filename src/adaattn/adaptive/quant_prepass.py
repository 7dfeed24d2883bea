"""The pre-pass of the quantized attention (adaptive/quant_launch.py): K and V quantized per key
block and smoothed by the mean of a strided sample of their rows, and for the warp-specialised
kernels Q quantized per row, one launch per call and level (quantize_kv_kernel, quantize_q_kernel
of kernels/attention_quant.py). Prepared holds what it made; QuantizedQ the per-row Q. Also the
kernels' QK/PV modes and `K`, the quantized kernels imported (with triton) on first use."""

from __future__ import annotations

from typing import Optional

import torch

from ..backends.triton.bound import bound
from ..backends.triton.common import interpreting


# kernels/attention_quant.py's modes (constexpr values of the kernels).
QK_NATIVE, QK_INT8, QK_FP8 = 0, 1, 2
PV_NATIVE, PV_FP8 = 0, 1
# Rows sampled (strided) for the smoothing means of K and V (adaptive/quant_reference.py follows it).
SMOOTHING_SAMPLE = 256


class _Kernels:
    """The quantized kernels, imported (with triton) on the first launch, not with adaattn."""

    def __getattr__(self, name):
        from ..kernels import attention_quant, attention_quant_ws

        for module in (attention_quant, attention_quant_ws):
            if hasattr(module, name):
                value = getattr(module, name)
                setattr(self, name, value)
                return value
        raise AttributeError(name)


K = _Kernels()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Rows per step of the sampled K and V means in quantize_kv_kernel: MEAN_TILE // D (their (rows,
# D) fp32 sum in registers); 16 under the interpreter.
MEAN_TILE = 4096
INTERPRET_MEAN_ROWS = 16


_PLACEHOLDERS: dict = {}


def _placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ones(1), zeros(1)) fp32 for the arguments a mode does not read, made once per device
    (not kept when made during CUDA-graph capture, where a fill only runs on replay)."""
    got = _PLACEHOLDERS.get(device)
    if got is None:
        got = (torch.ones(1, device=device), torch.zeros(1, device=device))
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _PLACEHOLDERS[device] = got
    return got


class QuantizedQ:
    """Q quantized per row for the warp-specialised kernels: qq (B, Hq, Nq, D) INT8 or E4M3,
    scales (B * Hq, pitch) fp32 (pitch >= Nq, a multiple of 4: 16-byte rows). Written by the
    pre-pass launch that quantizes K (Prepared.get), or by `ensure` alone when K was quantized
    earlier in the call."""

    def __init__(self, q: torch.Tensor, qk_mode: int):
        b, hq, nq, d = q.shape
        self.q, self.mode = q, qk_mode
        self.qq = torch.empty(q.shape, dtype=torch.int8 if qk_mode == QK_INT8 else torch.float8_e4m3fn,
                              device=q.device)
        self.pitch = -(-nq // 4) * 4
        self.scales = torch.empty((b * hq, self.pitch), dtype=torch.float32, device=q.device)
        self.done = False

    def ensure(self) -> None:
        if self.done:
            return
        q = self.q
        b, hq, nq, d = q.shape
        bound(K.quantize_q_kernel)[(_cdiv(nq, Q_BLOCK), b * hq)](
            q, self.qq, self.scales, q.stride(0), q.stride(1), q.stride(2), hq, nq, self.pitch,
            HEAD_DIM=d, BLOCK_M=Q_BLOCK, EMULATE=interpreting(), QK_MODE=self.mode, num_warps=4, num_stages=1)
        self.done = True


Q_BLOCK = 64  # query rows per program of the Q quantization
PREPASS_PROGRAMS = 264  # about two per SM of an H100: key blocks per program grow past that
PREPASS_MAX_BLOCKS = 2
PREPASS_SLICE = 8192  # elements per slice of a key block (rows: PREPASS_SLICE // D)
PREPASS_WARPS = 4


class Prepared:
    """The quantized K/V of one call, per (QK_MODE, PV_MODE, BLOCK_N), made on first use.

    A new key costs one launch of quantize_kv_kernel: K and V smoothed by their sampled means
    (which every program computes alike) and quantized per block, with Q quantized in the same
    launch when a QuantizedQ is passed. The means live in one fp32 workspace (2, B, Hkv, D)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v
        self.b, self.hkv, self.nk, self.d = k.shape
        self._means = None
        self._reduced = [False, False]  # k_mean, v_mean are written
        self._made: dict = {}

    def _workspace(self) -> torch.Tensor:
        if self._means is None:
            self._mean_rows = INTERPRET_MEAN_ROWS if interpreting() else max(16, MEAN_TILE // max(self.d, 1))
            self._sample_stride = max(1, self.nk // SMOOTHING_SAMPLE)
            self._samples = float(max(-(-self.nk // self._sample_stride), 1))  # rows averaged
            self._means = torch.empty((2, self.b, self.hkv, self.d), dtype=torch.float32, device=self.k.device)
            self._k_mean, self._v_mean = self._means[0], self._means[1]
        return self._means

    def _quantize(self, qk_mode: int, pv_mode: int, kq, kscale, vq, vscale, n_blocks: int, block_n: int,
                  quantize: bool = True, q_rows: Optional[QuantizedQ] = None) -> None:
        """One launch of quantize_kv_kernel (with quantize=False only the means, into the
        workspace), with q_rows' Q programs in it."""
        self._workspace()
        quant_k, quant_v = qk_mode != QK_NATIVE, pv_mode == PV_FP8
        k, v = self.k, self.v
        bh = self.b * self.hkv
        kqs = kq.stride() if quant_k and quantize else (0, 0, 0, 0)
        vqs = vq.stride() if quant_v and quantize else (0, 0, 0, 0)
        per = 1
        if quantize:
            per = max(1, min(PREPASS_MAX_BLOCKS, n_blocks * bh // PREPASS_PROGRAMS))
        k_programs = -(-n_blocks // per) if quantize else 1
        q_mode, q_blocks, group, qargs = 0, 0, 1, (k, k, k, 0, 0, 0, 0, 0)
        if q_rows is not None and not q_rows.done:
            q = q_rows.q
            group = q.shape[1] // self.hkv
            q_mode, q_blocks = q_rows.mode, _cdiv(q.shape[2], Q_BLOCK)
            qargs = (q, q_rows.qq, q_rows.scales, q.stride(0), q.stride(1), q.stride(2), q.shape[2], q_rows.pitch)
        interp = interpreting()
        bound(K.quantize_kv_kernel)[(k_programs + group * q_blocks, bh)](
            k, v, self._k_mean, self._v_mean, kq, kscale, vq, vscale,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            kqs[0], kqs[1], kqs[2], vqs[0], vqs[1], vqs[2],
            self.hkv, self.nk, n_blocks, per, k_programs, self._sample_stride, self._samples, *qargs, q_blocks, group,
            HEAD_DIM=self.d, BLOCK_D=self.d, BLOCK_N=block_n, BLOCK_R=self._mean_rows,
            BLOCK_S=min(INTERPRET_MEAN_ROWS if interp else max(16, PREPASS_SLICE // self.d), block_n),
            QK_MODE=qk_mode, PV_MODE=pv_mode, EMULATE=interp, QUANTIZE=quantize,
            Q_MODE=q_mode, BLOCK_Q=Q_BLOCK, num_warps=PREPASS_WARPS, num_stages=1,
        )
        if q_mode:
            q_rows.done = True
        self._reduced[0] |= quant_k
        self._reduced[1] |= quant_v

    def k_mean(self) -> torch.Tensor:
        """K's smoothing mean (B, Hkv, D) fp32 as the kernels use it: quant_reference.smoothing_mean
        up to fp32 rounding (the order of the sum)."""
        if not self._reduced[0]:
            ones, _ = _placeholders(self.k.device)
            self._quantize(QK_INT8, PV_NATIVE, ones, ones, ones, ones, 1, 16, quantize=False)
        return self._k_mean

    def v_mean(self) -> torch.Tensor:
        """V's smoothing mean (B, Hkv, D) fp32, as k_mean."""
        if not self._reduced[1]:
            ones, _ = _placeholders(self.k.device)
            self._quantize(QK_NATIVE, PV_FP8, ones, ones, ones, ones, 1, 16, quantize=False)
        return self._v_mean

    def get(self, qk_mode: int, pv_mode: int, block_n: int, q_rows: Optional[QuantizedQ] = None):
        """(Kq, KScale, Vq, VScale, VMean, n_blocks); placeholders where a mode needs none. When
        the key is new, q_rows (if given and not yet written) is quantized in the same launch."""
        key = (qk_mode, pv_mode, block_n)
        made = self._made.get(key)
        if made is not None:
            return made
        k, v = self.k, self.v
        n_blocks = max(_cdiv(self.nk, block_n), 1)
        npad = n_blocks * block_n
        dev = k.device
        ones, zeros = _placeholders(dev)
        quant_k, quant_v = qk_mode != QK_NATIVE, pv_mode == PV_FP8
        if quant_k:
            kdtype = torch.int8 if qk_mode == QK_INT8 else torch.float8_e4m3fn
            kq = torch.empty((self.b, self.hkv, npad, self.d), dtype=kdtype, device=dev)
            kscale = torch.empty((self.b, self.hkv, n_blocks), dtype=torch.float32, device=dev)
        else:
            kq, kscale = k, ones
        v_mean = zeros
        if quant_v:
            vq = torch.empty((self.b, self.hkv, self.d, npad), dtype=torch.float8_e4m3fn, device=dev)
            vscale = torch.empty((self.b, self.hkv, n_blocks), dtype=torch.float32, device=dev)
        else:
            vq, vscale = v, ones
        if quant_k or quant_v:
            self._quantize(qk_mode, pv_mode, kq, kscale, vq, vscale, n_blocks, block_n, q_rows=q_rows)
            if quant_v:
                v_mean = self._v_mean
        made = (kq, kscale, vq, vscale, v_mean, n_blocks)
        self._made[key] = made
        return made
