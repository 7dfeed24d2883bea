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

The pre-pass is one launch per call and level (see Prepared): quantize_kv_kernel reads K (and
V) from memory once and writes them quantized per key block, each program smoothing them by
the mean of a strided sample of their rows. For the warp-specialised kernels the same launch
quantizes Q per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import hardware, settings
from .triton_attention import TRITON_FOUND
from .triton_configs import KernelConfig, interpreting, length_bucket
from .triton_launch import (
    LOG2E,
    RowLayout,
    WindowSides,
    dot_precision,
    ensure_triton_allocator,
    gluon_fwd_here,
    mask_args,
    new_output,
    run_gluon_first,
    shared_layout,
    tensor_descriptor,
    tma_ok,
)
from .triton_tuner import CONFIGS

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


LEVELS = ("exact", "qk8", "fp8")
LEVEL_EXACT, LEVEL_QK8, LEVEL_FP8 = 0, 1, 2
SUPPORTED_HEAD_DIMS = (64, 128)
FP8_MAX = 448.0
# Q.K^T precision of the fp8 level: "int8" (the more accurate), "fp8", or "auto": FP8 on Hopper
# (where it was measured faster: in the warp-specialised kernel, and causal in the general one,
# H100 4k/16k causal 0.354/3.35 ms against 0.38-0.50/3.70 with INT8, error 4.8-5.2e-2 against
# 3.5-3.9e-2), INT8 elsewhere (benchmarks/NOTES.md).

# One config per level for the CPU interpreter; BLOCK_N is also the K quantization block.
INTERPRET_QUANT = KernelConfig(32, 16, 1, 1)
# The warp-specialised fp8 kernel (kernels/attention_quant_ws.py): num_warps per warp group.
# H100, bf16 B=2 H=16 D=128 (benchmarks/NOTES.md, fourth session): 256 keys per tile ran the
# kernel 1.17x / 1.29x cuDNN at N=4096 / 16384 against 1.01x / 1.24x with 128, same error.
FP8_WS_CONFIGS = [KernelConfig(128, 256, 4, 2), KernelConfig(128, 128, 4, 2), KernelConfig(128, 64, 4, 2)]
# The Gluon fp8 kernel (kernels/attention_quant_gluon.py), timed beside the Triton one where it
# runs (Hopper, a triton with Gluon): BLOCK_M 128 in two groups of 64 rows, num_warps of one
# group. H100, bf16 (benchmarks/NOTES.md, "An FP8 Gluon forward"): 1.01x / 1.07x cuDNN at 16k /
# 16k causal (the Triton kernel 1.21x not causal; the general kernel 1.00x causal). 256-key tiles
# spill with each tile's product added in fp32 (0.79-0.86x): not offered.
FP8_GLUON_CONFIGS = [KernelConfig(128, 128, 4, 2, "gluon")]
# The warp-specialised qk8 kernel: the exact warp-specialised forward's candidates. (With 3
# stages, 128/128/4/3, it compiles under triton 3.6 and wrote NaN on the H100: fifth session.)
QK8_WS_CONFIGS = [KernelConfig(128, 128, 4, 2), KernelConfig(128, 64, 4, 2)]
# Whether causal calls at the fp8 level run the warp-specialised fp8 kernel (its causal mask is a
# select on every tile); off: the general kernel (third session, 128-key tiles: slower).
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


def ws_device_ok(device: torch.device) -> bool:
    """Triton's warp specialisation of our kernels runs here: Hopper (sm90), or the CPU
    interpreter (which ignores it)."""
    if not hardware.warp_specialisation_available():
        return False
    if device.type == "cuda":
        return hardware.arch("cuda", device.index) == "sm90"
    return interpreting()


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores: sm89 (Ada) and newer. Under the CPU interpreter the math is emulated."""
    if device.type == "cpu":
        return interpreting()
    return hardware.capability_at_least(device.index, 8, 9)


def int8_supported(device: torch.device) -> bool:
    if device.type == "cpu":
        return interpreting()
    return hardware.capability_at_least(device.index, 8, 0)


def _smem(cfg: KernelConfig, d: int, elem: int) -> int:
    return (cfg.block_m * d * elem + max(cfg.num_stages, 1) * 2 * cfg.block_n * d * elem) + 2048


def _configs(d: int, dtype: torch.dtype, device: torch.device) -> list:
    elem = torch.empty((), dtype=dtype).element_size()
    limit = hardware.max_shared_memory(device.index)
    fit = [c for c in QUANT_CONFIGS[d] if _smem(c, d, elem) <= limit]
    return fit or [KernelConfig(64, 32, 4, 1)]


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
        K.quantize_q_kernel[(_cdiv(nq, Q_BLOCK), b * hq)](
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
        K.quantize_kv_kernel[(k_programs + group * q_blocks, bh)](
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


@dataclass(frozen=True)
class QuantKernelLaunch(WindowSides):
    """What a quantized launch needs beyond the tensors and the level: the scale, the
    causal/window sides (-1 unbounded), the fp8 level's Q.K^T precision, the exp2 share on the FMA
    units, and whether the warp-specialised kernels may run (runner triton.quant.ws)."""

    scale: float
    causal: bool = False
    bottom_right: bool = False
    window_left: int = -1
    window_right: int = -1
    fp8_qk: bool = False
    exp_fma: int = 0
    allow_ws: bool = True


# The config kind of (level, fp8_qk): "quant_<level>", "_fp8qk" for the fp8 level with FP8 Q.K^T.
_KINDS = [(f"quant_{name}", f"quant_{name}" + ("_fp8qk" if i == LEVEL_FP8 else "")) for i, name in enumerate(LEVELS)]


def _fp8_ws_kernels(launch: QuantKernelLaunch, q, out, attn_mask, head_levels, level: int) -> tuple[bool, bool]:
    """Which warp-specialised fp8 kernels may run this launch: (the Gluon one,
    kernels/attention_quant_gluon.py; the Triton one, kernels/attention_quant_ws.py). Both need
    the warp-specialised runner ("triton.quant.ws"), the fp8 level with FP8 Q.K^T for every head
    (no head-level array), no mask, no window, positive scale, Hopper (the Triton one also the
    CPU interpreter), and Out as TMA takes it (16-byte aligned base and strides; Q is copied).
    Causal (top-left or bottom-right): the Gluon kernel, which masks only the diagonal tiles; the
    Triton one only with ADAATTN_FP8_WS_CAUSAL=1 (its mask, a select on every tile of the
    branch-free loop, made it slower than the general kernel: H100, 4k, 0.475 vs 0.379 ms). A
    forced "quant_fp8_ws" config runs its own kernel (a Gluon one where Gluon runs, else the
    Triton kernel's first config)."""
    if not launch.allow_ws or tensor_descriptor() is None:
        return False, False
    if level != LEVEL_FP8 or not launch.fp8_qk or head_levels is not None or attn_mask is not None:
        return False, False
    if launch.has_left or (launch.has_right and launch.right != 0):
        return False, False
    if not launch.scale > 0 or q.shape[-1] not in SUPPORTED_HEAD_DIMS or not (ws_device_ok(q.device) and tma_ok(out)):
        return False, False
    current = settings.current()
    gluon = gluon_fwd_here(q) and out.dtype in (torch.float16, torch.bfloat16)
    triton = not launch.has_right or current.fp8_ws_causal
    forced = current.forced("quant_fp8_ws")  # a forced config picks its kernel
    if forced is not None:
        if forced.impl == "gluon" and gluon:
            triton = False
        elif forced.impl != "gluon":
            gluon = False
    return gluon, triton


def _ws_config(kind: str, configs: list, q, hkv: int, nk: int, causal_right: bool, bottom_right: bool,
               launch, out, extra: tuple = ()) -> KernelConfig:
    """The config of a warp-specialised quantized launch: forced (or INTERPRET_QUANT) under the
    interpreter, else timed once per shape class."""
    if interpreting():
        return settings.current().forced(kind) or INTERPRET_QUANT
    b, hq, nq, d = q.shape
    key = (q.device.index, q.dtype, d, causal_right, bottom_right, hq != hkv, length_bucket(nq), length_bucket(nk),
           *extra)
    return CONFIGS.pick(kind, key, configs, launch, lambda: out)


def _qk8_ws_ok(launch: QuantKernelLaunch, q, v, out, attn_mask, head_levels, level: int) -> bool:
    """Whether the warp-specialised qk8 kernel (kernels/attention_quant_ws.py) runs this launch:
    the forward variant "ws", the qk8 level for every head, no mask, no window (causal is fine),
    positive scale, Hopper (or the CPU interpreter), bf16/fp16 V and Out as TMA takes them."""
    if not launch.allow_ws or tensor_descriptor() is None:
        return False
    if level != LEVEL_QK8 or head_levels is not None or attn_mask is not None:
        return False
    if launch.has_left or launch.right != 0 or not launch.scale > 0 or q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return False
    if v.dtype not in (torch.float16, torch.bfloat16) or v.shape[-1] != q.shape[-1]:
        return False
    return ws_device_ok(q.device) and tma_ok(out) and tma_ok(v)


def _launch_quant_ws(level: int, q, v, prepared: "Prepared", out, scale: float, causal_right: bool,
                     bottom_right: bool, kernels: tuple[bool, bool] = (False, True)) -> bool:
    """One warp-specialised quantized launch for every head at `level`: qk8 (INT8 Q.K^T, P.V with
    V as it is; kernels/attention_quant_ws.py) or fp8 (FP8 Q.K^T and P.V; the Gluon kernel of
    kernels/attention_quant_gluon.py and the Triton one of attention_quant_ws.py, as `kernels`
    (gluon, triton) allows, the tuner timing both). False when none ran: a Gluon failure (one
    warning) where the Triton kernel may not take the call; the general kernel runs it then."""
    b, hq, nq, d = q.shape
    hkv, nk = prepared.hkv, prepared.nk
    fp8 = level == LEVEL_FP8
    qk_mode, pv_mode = level_modes(level, True)
    interp = interpreting()
    # Q per row, in the pre-pass launch (a reduction over Q inside the warp-specialised kernel
    # does not pass triton's warp-specialisation pass).
    qrows = QuantizedQ(q, qk_mode)

    def launch(cfg: KernelConfig):
        kq, kscale, vq, v_scale, v_mean, n_blocks = prepared.get(qk_mode, pv_mode, cfg.block_n, qrows)
        qrows.ensure()
        if cfg.impl == "gluon":
            return _launch_fp8_gluon(qrows, kq, kscale, vq, v_scale, v_mean, n_blocks, out, hkv, nk, scale,
                                     causal_right, bottom_right, cfg)
        ensure_triton_allocator()
        grid = (_cdiv(nq, cfg.block_m), b * hq)
        descriptor = tensor_descriptor()
        k_desc = descriptor(kq, list(kq.shape), list(kq.stride()), [1, 1, cfg.block_n, d])
        rest = (out, out.stride(0), out.stride(1), out.stride(2), hq, hq // hkv, nq, qrows.pitch, nk, n_blocks,
                scale * LOG2E)
        meta = dict(HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal_right,
                    BOTTOM_RIGHT=bottom_right, K_TAIL=nk % cfg.block_n != 0, DOT_PRECISION=dot_precision(q.dtype),
                    WARP_SPEC=not interp, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if fp8:  # V quantized and transposed (D, Npad): its box is (D, BLOCK_N)
            K.attention_fp8_ws_kernel[grid](
                qrows.qq, qrows.scales, k_desc, descriptor(vq, list(vq.shape), list(vq.stride()),
                                                                 [1, 1, d, cfg.block_n]),
                kscale, v_scale, v_mean, *rest, EMULATE=interp, **meta)
        else:
            K.attention_qk8_ws_kernel[grid](
                qrows.qq, qrows.scales, k_desc, descriptor(v, list(v.shape), list(v.stride()),
                                                                 [1, 1, cfg.block_n, d]),
                kscale, *rest, **meta)

    if not fp8:
        launch(_ws_config("quant_qk8_ws", QK8_WS_CONFIGS, q, hkv, nk, causal_right, bottom_right, launch, out))
        return True

    def pick(gluon: bool, triton: bool) -> Optional[KernelConfig]:
        configs = (FP8_GLUON_CONFIGS if gluon else []) + (FP8_WS_CONFIGS if triton else [])
        if not configs:
            return None
        cfg = _ws_config("quant_fp8_ws", configs, q, hkv, nk, causal_right, bottom_right, launch, out,
                         extra=(gluon, triton))
        if cfg.impl == "gluon" and not gluon:  # forced where Gluon cannot run: the Triton kernel's first
            return configs[0]
        return cfg

    gluon, triton = kernels
    return run_gluon_first(lambda g: pick(g, triton), launch, gluon)


def _launch_fp8_gluon(qrows: "QuantizedQ", kq, kscale, vq, v_scale, v_mean, n_blocks: int, out, hkv: int, nk: int,
                      scale: float, causal_right: bool, bottom_right: bool, cfg: KernelConfig) -> None:
    """The Gluon fp8 kernel over the pre-pass's outputs (kernels/attention_quant_gluon.py)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..kernels.attention_quant_gluon import attention_fp8_gluon_kernel

    b, hq, nq, d = out.shape
    half = cfg.block_m // 2

    def desc(t, *box):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), shared_layout(box, t.dtype))

    attention_fp8_gluon_kernel[(_cdiv(nq, cfg.block_m), b * hq)](
        desc(qrows.qq, 1, 1, half, d), desc(kq, 1, 1, cfg.block_n, d), desc(vq, 1, 1, d, cfg.block_n),
        desc(out, 1, 1, half, d),
        qrows.scales, kscale, v_scale, v_mean, hq, hq // hkv, nq, qrows.pitch, nk, n_blocks, scale * LOG2E,
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages, CAUSAL=causal_right,
        BOTTOM_RIGHT=bottom_right, num_warps=cfg.num_warps,
    )


def fp8_level_uses_fp8_qk(q, attn_mask, causal: bool, window_left: int, window_right: int) -> bool:
    """Whether the fp8 level computes Q.K^T in FP8 (else INT8) for such a call (FP8_LEVEL_QK)."""
    choice = settings.current().fp8_level_qk
    if choice != "auto":
        return choice == "fp8"
    return ws_device_ok(q.device)  # Hopper (or the CPU interpreter, which stands in for it)


def launch_level(q, k, v, prepared: Prepared, out, attn_mask, head_levels: Optional[torch.Tensor], level: int,
                 launch: QuantKernelLaunch, lse: Optional[torch.Tensor] = None) -> None:
    """Write into `out` the rows of the heads at `level` (every head when head_levels is None),
    and with `lse` ((B, Hq, Nq) fp32, contiguous) their rows' log-sum-exp (natural log)."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if b * hq == 0 or nq == 0:
        return
    qk_mode, pv_mode = level_modes(level, launch.fp8_qk)
    scale, bottom_right, fp8_qk = launch.scale, launch.bottom_right, launch.fp8_qk
    lay = None if attn_mask is None else RowLayout(b, hq, hkv, nq, nk, d, False, d)  # (read for a mask only)
    mask, mask_strides, mask_kind = mask_args(attn_mask, lay, q)
    has_left, has_right = launch.has_left, launch.has_right
    left, right = max(launch.window_left, 0), launch.right
    if lse is None:
        fp8_kernels = _fp8_ws_kernels(launch, q, out, attn_mask, head_levels, level)
        if any(fp8_kernels) or _qk8_ws_ok(launch, q, v, out, attn_mask, head_levels, level):
            if _launch_quant_ws(level, q, v, prepared, out, scale, has_right, bottom_right, fp8_kernels):
                return
    exp_share = launch.exp_fma
    interp = interpreting()

    def run(cfg: KernelConfig):
        kq, kscale, vq, v_scale, v_mean, n_blocks = prepared.get(qk_mode, pv_mode, cfg.block_n)
        vq_strides = (vq.stride(0), vq.stride(1), vq.stride(2)) if pv_mode == PV_FP8 else (0, 0, 0)
        grid = (_cdiv(nq, cfg.block_m), b * hq)
        k_mean = prepared.k_mean() if lse is not None and qk_mode != QK_NATIVE else v_mean
        K.attention_quant_fwd_kernel[grid](
            q, k, v, kq, kscale, vq, v_scale, v_mean, out, mask,
            head_levels if head_levels is not None else q, k_mean, lse if lse is not None else v_mean,
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
            DOT_PRECISION=dot_precision(q.dtype), SCALE_POSITIVE=scale > 0, EMULATE=interp,
            EXP_FMA=exp_share, STORE_LSE=lse is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    kind = _KINDS[level][bool(fp8_qk)]
    if interp:
        cfg = settings.current().forced(kind) or INTERPRET_QUANT
    else:
        key = (q.device.index, q.dtype, d, launch.causal, bottom_right, has_left, launch.window_right >= 0, mask_kind,
               hq != hkv, length_bucket(nq), length_bucket(nk), exp_share)
        # The candidates are only listed (a tensor made for the element size) for a new class.
        # (Only this launch's heads are compared: the others may be left unwritten.)
        written = (lambda: out) if head_levels is None else (
            lambda: out.index_select(1, (head_levels == level).nonzero().flatten()))
        cfg = CONFIGS.pick(kind, key, lambda: _configs(d, q.dtype, q.device), run, written)
    run(cfg)


def quant_attention(q, k, v, attn_mask=None, *, levels, head_levels: Optional[torch.Tensor] = None,
                    scale: Optional[float] = None, causal: bool = False, bottom_right: bool = False,
                    window_left: int = -1, window_right: int = -1, fp8_qk: bool = False,
                    out: Optional[torch.Tensor] = None, prepared: Optional[Prepared] = None,
                    exp_fma=None, allow_ws: bool = True, lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention with each query head at its level; q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D).

    levels: the levels to launch; head_levels: int32 (Hq,) on q's device giving each head's
    level, or None when `levels` is one level for every head. Heads whose level is not in
    `levels` are left unwritten in `out` (for recomputing some heads of an earlier output).
    The keyword options make one QuantKernelLaunch for every level's launch (exp_fma: the
    settings' share by default). lse: (B, Hq, Nq) fp32, contiguous, to receive each written row's
    log-sum-exp of its scores as computed (natural log; -inf for a row that sees no key): the
    general kernel runs then, never the warp-specialised ones.
    """
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if out is None:
        out = new_output(q.shape, q.dtype, q.device)
    prepared = Prepared(k, v) if prepared is None else prepared
    launch = QuantKernelLaunch(scale, bool(causal), bool(bottom_right), int(window_left), int(window_right),
                               bool(fp8_qk), int(settings.current().exp_fma if exp_fma is None else exp_fma),
                               bool(allow_ws))
    for level in levels:
        launch_level(q, k, v, prepared, out, attn_mask, head_levels, int(level), launch, lse)
    return out


def quant_can_run(device: torch.device, dtype: torch.dtype, head_dim: int, value_dim: int) -> list[str]:
    """Reasons the quantized kernels cannot run here (empty: they can)."""
    reasons = []
    if not TRITON_FOUND:
        return ["triton is not installed (pip install adaattn[triton])."]
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        reasons.append(f"quantized kernels run on CUDA GPUs (CPU only under TRITON_INTERPRET=1), got {device.type}.")
    elif device.type == "cuda" and not int8_supported(device):
        reasons.append("INT8 tensor cores need compute capability 8.0 or newer.")
    if dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"quantized kernels take float16 or bfloat16 inputs, got {str(dtype).replace('torch.', '')}.")
    if head_dim not in SUPPORTED_HEAD_DIMS or value_dim != head_dim:
        reasons.append(f"quantized kernels take head_dim 64 or 128 (value too), got {head_dim}/{value_dim}.")
    return reasons
