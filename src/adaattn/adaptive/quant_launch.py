"""Quantized attention forward in Triton (the adaptive-precision runners' launch glue).

Three operating points ("levels"), most precise first:
  0 "exact"  Q.K^T and P.V in the input dtype (the exact kernel's math),
  1 "qk8"    Q.K^T in INT8 (K smoothed, per-block K scales, per-row Q scales), P.V in the
             input dtype,
  2 "fp8"    Q.K^T in INT8 (or FP8 E4M3, `fp8_qk`), P.V in FP8 E4M3 (V smoothed, per-channel
             scales), FP32 accumulation.
"One level up" from a level is the next more precise one. `quant_attention` computes every
head at its own level: one launch per level present, each skipping the heads of other
levels, so no host synchronisation is needed to mix levels.

The pre-pass is one launch per call and level (see Prepared, adaptive/quant_prepass.py):
quantize_kv_kernel reads K (and V) from memory once and writes them quantized per key block,
each program smoothing them by the mean of a strided sample of their rows. For the
warp-specialised kernels the same launch quantizes Q per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..backends.triton.bound import bound
from ..problem import default_scale
from .. import hardware, settings
from ..backends.triton.common import (
    LOG2E,
    TRITON_FOUND,
    KernelConfig,
    RowLayout,
    WindowSides,
    dot_precision,
    ensure_triton_allocator,
    gluon_fwd_here,
    interpreting,
    length_bucket,
    mask_args,
    new_output,
    run_gluon_first,
    shared_layout,
    tensor_descriptor,
    tma_ok,
)
from ..backends.triton.tuner import CONFIGS
from .quant_prepass import (
    PV_FP8,
    PV_NATIVE,
    QK_FP8,
    QK_INT8,
    QK_NATIVE,
    K,
    Prepared,
    QuantizedQ,
    _cdiv,
)

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
            bound(K.attention_fp8_ws_kernel)[grid](
                qrows.qq, qrows.scales, k_desc, descriptor(vq, list(vq.shape), list(vq.stride()),
                                                                 [1, 1, d, cfg.block_n]),
                kscale, v_scale, v_mean, *rest, EMULATE=interp, **meta)
        else:
            bound(K.attention_qk8_ws_kernel)[grid](
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

    bound(attention_fp8_gluon_kernel)[(_cdiv(nq, cfg.block_m), b * hq)](
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
        bound(K.attention_quant_fwd_kernel)[grid](
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
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
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
