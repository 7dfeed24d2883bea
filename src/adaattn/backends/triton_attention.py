"""Our exact fused attention in Triton: launch glue, torch custom ops, autograd, the backend.

Layers, top to bottom:
  triton_attention / varlen_attention   public functions on (B, H, N, D) / packed (T, H, D)
  adaattn::flash_fwd, adaattn::flash_bwd torch custom ops (fake impls + autograd), so
                                        torch.compile(fullgraph=True) traces through them
  launch_fwd / launch_bwd               strides, grids and kernel configs; no host sync
  kernels/attention_fwd.py, _bwd.py     the @triton.jit code

float32 inputs run their matrix products in full fp32 (tl.dot input_precision="ieee"),
not TF32, so fp32 results match SDPA's fp32 paths; bf16/fp16 use the tensor cores with
fp32 accumulation.

Kernel configs are picked per bucketed shape class (dtype, head dim, mask/causal/window
flags, next power of two of the lengths, capped), by timing the candidates that fit the
device's shared memory the first time a class is seen. Under TRITON_INTERPRET=1 one small
fixed config runs.
"""

import math
import os
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .. import hardware
from .base import Backend
from .masks import position_keep

try:
    import triton

    from ..kernels.attention_bwd import (
        attention_bwd_delta_kernel,
        attention_bwd_dkdv_kernel,
        attention_bwd_dq_kernel,
    )
    from ..kernels.attention_fwd import LOG2E, MASK_ADDITIVE, MASK_BOOL, MASK_NONE, attention_fwd_kernel
    from ..kernels.attention_fwd_ws import attention_fwd_ws_kernel

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # older triton: the "tma" forward falls back to pointer loads
        TensorDescriptor = None

    TRITON_ERROR: Optional[str] = None
except Exception as e:  # ImportError, or a triton that does not work on this machine
    triton = None
    TensorDescriptor = None
    TRITON_ERROR = f"{type(e).__name__}: {e}".splitlines()[0][:120]

ALIGNMENTS = ("top_left", "bottom_right")
MAX_HEAD_DIM = 256

# Tests set this so every output starts as NaN: an element the kernel forgot to write fails.
POISON_OUTPUTS = os.environ.get("ADAATTN_POISON_OUTPUTS", "") == "1"

# Kernel variants, chosen at run time (benchmarks time them side by side; see
# kernel_variants()). Environment variables set the starting values.
#   dq:  "separate"  dk/dv pass, then a dq pass; no atomics (always used when deterministic)
#        "atomic"    dq added with fp32 atomics inside the dk/dv pass, no dq pass
#        "atomic_rotate"  as "atomic", each key block starting on its own query tile
#   fwd: "ptr"       pointer loads (cp.async pipelining)
#        "tma"       tensor-descriptor (TMA) loads of Q/K/V where the launch allows it:
#                    dense, no mask, head_dim a power of two >= 16, 16-byte aligned rows;
#                    anything else runs "ptr"
#        "ws"        kernels/attention_fwd_ws.py on Hopper: TMA loads, warp-specialised (a
#                    producer and two consumer warp groups); dense, no mask, no window
#                    (causal is fine), bf16/fp16, head_dim 64/128; anything else runs "ptr"
#   fwd_grid: "query_major"  grid (query blocks, batch * heads): one head's blocks run together
#             "head_major"   grid (batch * heads, query blocks): every head's last block first
DQ_MODES = ("separate", "atomic", "atomic_rotate")
FWD_MODES = ("ptr", "tma", "ws")
GRID_ORDERS = ("query_major", "head_major")
VARIANTS = {
    # atomic: measured fastest on the H100 (results/2026-11-22-triton-variants-h100.json);
    # deterministic=True (or torch.use_deterministic_algorithms, or Policy.deterministic)
    # always runs the separate, atomic-free dq pass.
    "dq": os.environ.get("ADAATTN_TRITON_DQ", "atomic"),
    # ws: measured fastest on the H100 at every yardstick shape where it runs
    # (results/2026-11-22-triton-variants-ws-h100.json); the rest runs "ptr".
    "fwd": os.environ.get("ADAATTN_TRITON_FWD", "ws"),
    "fwd_grid": os.environ.get("ADAATTN_TRITON_FWD_GRID", "query_major"),
    # exp_fma: share of the fully visible tiles' exp2 computed by a polynomial on the FMA
    # units instead of the multi-function unit: "0" none, "2" one in 2, "4" one in 4
    # (kernels/attention_fwd.exp2_tile); forward and quantized forward.
    "exp_fma": os.environ.get("ADAATTN_TRITON_EXP_FMA", "0"),
}
EXP_FMA_SHARES = ("0", "2", "4")


def exp_fma_share(value=None) -> int:
    """The EXP_FMA constexpr for a launch: `value` or VARIANTS["exp_fma"], validated."""
    value = VARIANTS["exp_fma"] if value is None else value
    if str(value) not in EXP_FMA_SHARES:
        raise ValueError(f"exp_fma must be one of {EXP_FMA_SHARES}, got {value!r}")
    return int(value)


@contextmanager
def kernel_variants(**variants: str):
    """Run with some VARIANTS replaced, e.g. kernel_variants(dq="atomic", fwd="tma")."""
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown kernel variant {sorted(unknown)}; known: {sorted(VARIANTS)}")
    old = dict(VARIANTS)
    VARIANTS.update(variants)
    try:
        yield
    finally:
        VARIANTS.clear()
        VARIANTS.update(old)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __str__(self) -> str:
        return f"BM{self.block_m}/BN{self.block_n}/w{self.num_warps}/s{self.num_stages}"


# One small config for the CPU interpreter: BLOCK_M != BLOCK_N exercises the tile ranges.
INTERPRET_CONFIGS = {
    "fwd": KernelConfig(32, 16, 1, 1),
    "fwd_ws": KernelConfig(32, 16, 1, 1),
    "dkdv": KernelConfig(16, 32, 1, 1),
    "dkdv_atomic": KernelConfig(16, 32, 1, 1),
    "dq": KernelConfig(32, 16, 1, 1),
    "delta": KernelConfig(32, 32, 1, 1),
}

# Candidates for Hopper (H100/H200), each kept only where its shared memory fits the device;
# the first fitting one runs when nothing is timed. From sm90 compiles of these kernels
# (triton 3.9, cuobjdump -res-usage): every first candidate compiles without register
# spills; the others are alternatives for the timing to judge.
HALF_CONFIGS = {
    "fwd": {
        "small_d": [KernelConfig(128, 64, 4, 3), KernelConfig(128, 128, 8, 3), KernelConfig(128, 64, 8, 4),
                    KernelConfig(64, 64, 4, 3)],
        # H100, D=128: 128/128/8/3 fastest at three of the four yardstick shapes (variants run).
        "mid_d": [KernelConfig(128, 128, 8, 3), KernelConfig(128, 64, 8, 3), KernelConfig(128, 128, 8, 2),
                  KernelConfig(128, 64, 8, 4), KernelConfig(64, 64, 4, 3)],
        "large_d": [KernelConfig(128, 32, 8, 2), KernelConfig(128, 64, 8, 2), KernelConfig(64, 32, 4, 3),
                    KernelConfig(64, 32, 4, 2)],
    },
    # The warp-specialised forward (kernels/attention_fwd_ws.py): num_warps is per warp group
    # (two consumer groups and a producer run, 3 x num_warps warps). Only HEAD_DIM 64/128.
    "fwd_ws": {
        "small_d": [KernelConfig(128, 128, 4, 2), KernelConfig(128, 64, 4, 2)],
        "mid_d": [KernelConfig(128, 128, 4, 2), KernelConfig(128, 64, 4, 2)],
        "large_d": [KernelConfig(128, 64, 4, 2)],
    },
    # dk/dv accumulators live in registers all along: small query tiles keep them there.
    "dkdv": {
        "small_d": [KernelConfig(32, 128, 8, 2), KernelConfig(64, 128, 8, 2), KernelConfig(32, 64, 4, 2)],
        "mid_d": [KernelConfig(16, 128, 8, 2), KernelConfig(32, 128, 8, 2), KernelConfig(32, 128, 8, 1),
                  KernelConfig(32, 64, 4, 1)],
        # Every wgmma config spills at head_dim 256; the mma.sync one below does not.
        "large_d": [KernelConfig(16, 32, 4, 1), KernelConfig(16, 64, 8, 1), KernelConfig(16, 32, 4, 2)],
    },
    # The dk/dv pass with dq added atomically: one product more per tile (ds^T k).
    "dkdv_atomic": {
        "small_d": [KernelConfig(32, 128, 8, 2), KernelConfig(64, 128, 8, 2), KernelConfig(32, 64, 4, 2)],
        # H100, D=128: 64/128/8/2 fastest at all four yardstick shapes (variants run).
        "mid_d": [KernelConfig(64, 128, 8, 2), KernelConfig(32, 128, 8, 2), KernelConfig(16, 128, 8, 2),
                  KernelConfig(32, 64, 4, 2)],
        "large_d": [KernelConfig(16, 32, 4, 1), KernelConfig(16, 64, 8, 1), KernelConfig(16, 32, 4, 2)],
    },
    "dq": {
        "small_d": [KernelConfig(128, 64, 8, 3), KernelConfig(128, 32, 4, 3), KernelConfig(64, 64, 4, 3)],
        "mid_d": [KernelConfig(128, 64, 8, 2), KernelConfig(128, 64, 8, 3), KernelConfig(128, 32, 8, 3),
                  KernelConfig(64, 32, 4, 2)],
        "large_d": [KernelConfig(128, 32, 8, 2), KernelConfig(64, 16, 4, 2), KernelConfig(64, 16, 4, 1)],
    },
}
# float32 runs exact fp32 products (no tensor cores): small tiles, or the registers spill.
FP32_CONFIGS = {
    "fwd": [KernelConfig(32, 16, 4, 1), KernelConfig(16, 32, 4, 1)],
    "fwd_ws": [KernelConfig(32, 16, 4, 1)],
    "dkdv": [KernelConfig(16, 32, 4, 1), KernelConfig(32, 16, 4, 1)],
    "dkdv_atomic": [KernelConfig(16, 32, 4, 1), KernelConfig(32, 16, 4, 1)],
    "dq": [KernelConfig(32, 16, 4, 1), KernelConfig(16, 32, 4, 1)],
}
DELTA_CONFIG = KernelConfig(64, 64, 4, 1)


def _d_class(block_d: int) -> str:
    return "small_d" if block_d <= 64 else ("mid_d" if block_d <= 128 else "large_d")


def shared_memory_estimate(kind: str, cfg: KernelConfig, block_d: int, elem: int, mask_elem: int = 0) -> int:
    """Bytes of shared memory a config needs: tiles resident for the whole program plus
    num_stages copies of each pipelined tile (matches sm90 compiles within a few percent)."""
    bm, bn, stages = cfg.block_m, cfg.block_n, max(cfg.num_stages, 1)
    if kind in ("fwd", "fwd_ws"):
        resident, pipelined = bm * block_d, 2 * bn * block_d
    elif kind == "dkdv":
        resident, pipelined = 2 * bn * block_d, 2 * bm * block_d
    elif kind == "dkdv_atomic":  # ds^T goes through shared memory for the dq product
        resident, pipelined = 2 * bn * block_d + bm * bn, 2 * bm * block_d
    else:  # dq
        resident, pipelined = 2 * bm * block_d, 2 * bn * block_d
    return (resident + stages * pipelined) * elem + (stages + 1) * bm * bn * mask_elem + 1024


_smem_cache: dict = {}


def max_shared_memory(device: torch.device) -> int:
    """Shared memory one program may use on this device, in bytes."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _smem_cache:
        try:
            props = triton.runtime.driver.active.utils.get_device_properties(index)
            _smem_cache[index] = int(props["max_shared_mem"])
        except Exception:
            p = torch.cuda.get_device_properties(index)
            _smem_cache[index] = int(getattr(p, "shared_memory_per_block_optin", 48 * 1024))
    return _smem_cache[index]


def fitting_configs(kind: str, block_d: int, dtype: torch.dtype, device: torch.device,
                    mask_elem: int = 0) -> list:
    """The candidates for this kernel whose estimated shared memory fits the device."""
    if dtype == torch.float32:
        configs = FP32_CONFIGS[kind]
    else:
        configs = HALF_CONFIGS[kind][_d_class(block_d)]
    elem = torch.empty((), dtype=dtype).element_size()
    limit = max_shared_memory(device)
    fit = [c for c in configs if shared_memory_estimate(kind, c, block_d, elem, mask_elem) <= limit]
    if not fit:  # the smallest, shrunk until it fits; the launch says if even that is too big
        c = min(configs, key=lambda c: shared_memory_estimate(kind, c, block_d, elem, mask_elem))
        while shared_memory_estimate(kind, c, block_d, elem, mask_elem) > limit and c.num_stages > 1:
            c = KernelConfig(c.block_m, c.block_n, c.num_warps, c.num_stages - 1)
        while shared_memory_estimate(kind, c, block_d, elem, mask_elem) > limit and max(c.block_m, c.block_n) > 16:
            c = KernelConfig(max(c.block_m // 2, 16), max(c.block_n // 2, 16), c.num_warps, c.num_stages)
        fit = [c]
    return fit


def _next_pow2(n: int) -> int:
    # triton.next_power_of_2 / triton.cdiv cost microseconds per call on the host (they are
    # wrapped for use inside kernels); the launch glue calls these on every call.
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def length_bucket(n: int) -> int:
    """Lengths share a tuned config within a power of two; 1 (decode) is its own class."""
    return 1 if n <= 1 else min(_next_pow2(n), 16384)


class ConfigChooser:
    """Times the fitting candidates once per shape class and remembers the fastest."""

    def __init__(self):
        self._lock = threading.Lock()
        self.chosen: dict = {}
        self.untimed: dict = {}  # first fitting candidate per class, remembered while tune is off
        self.timings: dict = {}
        self.forced: dict = {}
        # ADAATTN_TRITON_AUTOTUNE=0: take the first fitting candidate, time nothing.
        self.tune = os.environ.get("ADAATTN_TRITON_AUTOTUNE", "1") != "0"

    def pick(self, kind: str, key: tuple, candidates, launch: Callable,
             output: Optional[Callable[[], torch.Tensor]] = None) -> KernelConfig:
        """candidates: a list, or a function returning one (only called when the class is new).
        output: what launch writes (the part of it that every candidate writes). When given, a
        candidate whose output holds a NaN or an infinity where another candidate's does not is
        dropped with a warning: a config the compiler gets wrong must not win on speed (seen
        with triton 3.6 on an H100: a 3-stage warp-specialised config wrote NaN)."""
        if kind in self.forced:
            return self.forced[kind]
        if interpreting():
            return INTERPRET_CONFIGS[kind]
        cfg = self.chosen.get((kind, key))
        if cfg is not None:
            return cfg
        if not self.tune and (kind, key) in self.untimed:
            return self.untimed[(kind, key)]
        if callable(candidates):
            candidates = candidates()
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not self.tune or len(candidates) == 1 or capturing:
            # No timing inside CUDA-graph capture: take the first candidate that fits.
            if not capturing:
                with self._lock:
                    self.untimed[(kind, key)] = candidates[0]
            return candidates[0]
        timings: dict = {}
        failures: dict = {}
        finite: dict = {}
        for c in candidates:
            try:
                timings[c] = triton.testing.do_bench(lambda: launch(c), warmup=5, rep=20,
                                                     return_mode="median")
                if output is not None:
                    finite[c] = bool(torch.isfinite(output()).all())
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # out of resources, or a compile failure for this shape
                failures[str(c)] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
        if any(finite.values()):  # (all non-finite: the inputs are, nothing to tell apart)
            for c in [c for c, ok in finite.items() if not ok]:
                del timings[c]
                failures[str(c)] = "wrote NaN or infinity where another config's output is finite"
                warnings.warn(f"adaattn triton: {kind} config {c} wrote NaN or infinity where another config's "
                              f"output is finite, for shape class {key}; it is not used (a compiler bug).",
                              RuntimeWarning, stacklevel=2)
        if not timings:
            raise RuntimeError(f"adaattn triton: no {kind} config ran for shape class {key}: {failures}")
        # The two fastest are timed once more, and each keeps its better time: one slow
        # reading (clocks, another process) must not decide, nor make a slow config look
        # fast. Seen on an H100: a candidate read 1.19 ms once and 0.34 ms in another run.
        for c in sorted(timings, key=timings.get)[:2] if len(timings) > 1 else []:
            timings[c] = min(timings[c], triton.testing.do_bench(lambda: launch(c), warmup=5, rep=20,
                                                                 return_mode="median"))
        best = min(timings, key=timings.get)
        with self._lock:
            self.chosen[(kind, key)] = best
            self.timings[(kind, key)] = {**{str(c): t for c, t in timings.items()}, **failures}
        return best


CONFIGS = ConfigChooser()


@contextmanager
def forced_configs(**kinds: KernelConfig):
    """Run with fixed configs, e.g. forced_configs(fwd=KernelConfig(128, 64, 8, 3)); for tests
    and benchmarks comparing variants."""
    old = dict(CONFIGS.forced)
    CONFIGS.forced.update(kinds)
    try:
        yield
    finally:
        CONFIGS.forced.clear()
        CONFIGS.forced.update(old)


def _new_output(shape, dtype, device) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


@dataclass
class _Layout:
    """Where rows of one (batch, head) live: strides (batch, head, row) of a dense
    (B, H, N, D) tensor, or (0, head, row) of a packed (T, H, D) one."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int  # dense length, or max_seqlen for packed
    k_len: int
    head_dim: int
    varlen: bool

    def strides(self, t: torch.Tensor) -> tuple:
        if self.varlen:
            return (0, t.stride(1), t.stride(0))
        return (t.stride(0), t.stride(1), t.stride(2))


def _layout(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k) -> _Layout:
    if cu_seqlens_q is not None:
        return _Layout(cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1], max_seqlen_q, max_seqlen_k,
                       q.shape[-1], True)
    return _Layout(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[-1], False)


def _lse_shape(q: torch.Tensor, lay: _Layout) -> tuple:
    return (q.shape[1], q.shape[0]) if lay.varlen else (q.shape[0], q.shape[1], q.shape[2])


def _lse_strides(lse: torch.Tensor, lay: _Layout) -> tuple:
    if lay.varlen:
        return (0, lse.stride(0), lse.stride(1))
    return (lse.stride(0), lse.stride(1), lse.stride(2))


def _mask_args(attn_mask, lay: _Layout, like: torch.Tensor):
    """(tensor, strides (b, h, q, k), MASK_KIND) with stride 0 on broadcast dimensions."""
    if attn_mask is None:
        return like, (0, 0, 0, 0), MASK_NONE
    m = attn_mask.expand(lay.batch, lay.q_heads, lay.q_len, lay.k_len)
    if m.dtype == torch.bool:
        return m.view(torch.uint8), m.stride(), MASK_BOOL
    return m, m.stride(), MASK_ADDITIVE


def _position_flags(causal: bool, window_left: int, window_right: int):
    """(HAS_LEFT, left, HAS_RIGHT, right); causal is the right bound 0. -1 means unbounded."""
    has_left = window_left >= 0
    has_right = causal or window_right >= 0
    right = 0 if causal else max(window_right, 0)
    return has_left, max(window_left, 0), has_right, right


def _dot_precision(dtype: torch.dtype) -> str:
    if interpreting() and dtype == torch.bfloat16:
        return "interpreter_bf16"  # see kernels/attention_fwd.py: dot, round_to
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    return max(16, _next_pow2(head_dim))


def _shape_key(q, lay, causal, bottom_right, window_left, window_right, mask_kind, mask_elem=0) -> tuple:
    return (q.device.type, q.device.index, q.dtype, lay.head_dim, lay.varlen, causal, bottom_right,
            window_left >= 0, window_right >= 0, mask_kind, mask_elem, lay.q_heads != lay.kv_heads,
            length_bucket(lay.q_len), length_bucket(lay.k_len))


def _tma_ok(lay: _Layout, mask_kind: int, scale: float, block_d: int, *tensors) -> bool:
    """Whether K/V may be read through 4-D tensor descriptors: dense, no mask, positive scale,
    a power-of-two head_dim (the box is the whole row), 16-byte aligned base and strides."""
    if TensorDescriptor is None or lay.varlen or mask_kind != MASK_NONE or not scale > 0:
        return False
    if lay.head_dim != block_d:
        return False
    return all(t.dtype != torch.float32 and tma_ok(t) for t in tensors)


def _ws_available() -> bool:
    """Triton accepts tl.range(..., warp_specialize=...) (3.6 and newer here)."""
    try:
        import inspect

        import triton.language as tl

        return "warp_specialize" in inspect.signature(tl.range.__init__).parameters
    except Exception:
        return False


WS_AVAILABLE = triton is not None and _ws_available()


def _ws_ok(lay: _Layout, q, k, v, mask_kind: int, scale: float, block_d: int, has_left: bool,
           has_right: bool, right: int) -> bool:
    """Whether the warp-specialised forward (kernels/attention_fwd_ws.py) can run this call:
    Hopper (or the CPU interpreter), dense bf16/fp16, no mask, no sliding window (causal is
    fine), head_dim 64 or 128, and what TMA needs (16-byte aligned base and strides)."""
    if not WS_AVAILABLE or has_left or (has_right and right != 0) or lay.head_dim not in (64, 128):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not ws_device_ok(q.device):
        return False
    return _tma_ok(lay, mask_kind, scale, block_d, q, k, v)


_CAPABILITY: dict = {}


def device_capability(device: torch.device) -> tuple[int, int]:
    """torch.cuda.get_device_capability, remembered per device (it costs microseconds per call,
    and the quantized path asks several times per call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _CAPABILITY.get(index)
    if cap is None:
        cap = _CAPABILITY[index] = tuple(torch.cuda.get_device_capability(index))
    return cap


def ws_device_ok(device: torch.device) -> bool:
    """Triton's warp specialisation of our kernels runs here: Hopper (sm90), or the CPU
    interpreter (which ignores it)."""
    if not WS_AVAILABLE:
        return False
    if device.type == "cuda":
        return device_capability(device)[0] == 9
    return interpreting()


def tma_ok(t: torch.Tensor) -> bool:
    """A tensor a TMA descriptor takes as it is: unit last stride, 16-byte aligned base and strides."""
    e = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and not any((st * e) % 16 for st in t.stride()[:-1])


def _triton_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def ensure_triton_allocator() -> None:
    """Kernels that make tensor descriptors on the device need scratch memory from the
    allocator set with triton.set_allocator. Install one backed by torch's caching allocator
    (so it works under CUDA-graph capture) unless the caller already set their own. The
    setting is a context variable: checked on every launch, since a new thread starts without."""
    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except Exception:
        pass
    triton.set_allocator(_triton_scratch)


def _launch_fwd_ws(q, k, v, out, lse, lay, scale, causal_right: bool, bottom_right: bool) -> None:
    def launch(cfg: KernelConfig):
        ensure_triton_allocator()
        box = [1, 1, cfg.block_n, lay.head_dim]
        attention_fwd_ws_kernel[(_cdiv(lay.q_len, cfg.block_m), lay.batch * lay.q_heads)](
            q, TensorDescriptor(k, list(k.shape), list(k.stride()), box),
            TensorDescriptor(v, list(v.shape), list(v.stride()), box), out, lse, *lay.strides(q), *lay.strides(out),
            *_lse_strides(lse, lay), lay.q_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
            scale * LOG2E, HEAD_DIM=lay.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            CAUSAL=causal_right, BOTTOM_RIGHT=bottom_right, K_TAIL=lay.k_len % cfg.block_n != 0,
            DOT_PRECISION=_dot_precision(q.dtype), WARP_SPEC=not interpreting(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    key = _shape_key(q, lay, causal_right, bottom_right, -1, 0 if causal_right else -1, MASK_NONE)
    cfg = CONFIGS.pick("fwd_ws", key, lambda: fitting_configs("fwd_ws", lay.head_dim, q.dtype, q.device), launch,
                       lambda: out)
    launch(cfg)


def launch_fwd(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               scale, causal, bottom_right, window_left, window_right, fwd_mode: Optional[str] = None,
               grid_order: Optional[str] = None, exp_fma=None):
    """Run the forward kernel; returns (out like q, lse fp32 (B, Hq, Nq) or (Hq, T)).

    fwd_mode / grid_order / exp_fma default to VARIANTS["fwd"] / ["fwd_grid"] / ["exp_fma"];
    "tma" runs pointer loads where descriptors cannot be used (see _tma_ok)."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    lay = _layout(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    out = _new_output(q.shape, q.dtype, q.device)
    lse = _new_output(_lse_shape(q, lay), torch.float32, q.device)
    if lay.batch * lay.q_heads == 0 or lay.q_len == 0 or q.numel() == 0:
        return out, lse
    mode = fwd_mode or VARIANTS["fwd"]
    order = grid_order or VARIANTS["fwd_grid"]
    if mode not in FWD_MODES or order not in GRID_ORDERS:
        raise ValueError(f"forward variant must be one of {FWD_MODES} / {GRID_ORDERS}, got {mode!r} / {order!r}")
    mask, mask_strides, mask_kind = _mask_args(attn_mask, lay, q)
    has_left, left, has_right, right = _position_flags(causal, window_left, window_right)
    block_d = _block_d(lay.head_dim)
    cu_q = cu_seqlens_q if lay.varlen else q
    cu_k = cu_seqlens_k if lay.varlen else q
    if mode == "ws" and _ws_ok(lay, q, k, v, mask_kind, scale, block_d, has_left, has_right, right):
        _launch_fwd_ws(q, k, v, out, lse, lay, scale, has_right, bottom_right)
        return out, lse
    use_tma = mode == "tma" and _tma_ok(lay, mask_kind, scale, block_d, k, v)
    head_major = order == "head_major"
    exp_share = exp_fma_share(exp_fma)

    def launch(cfg: KernelConfig):
        blocks = _cdiv(lay.q_len, cfg.block_m)
        grid = (lay.batch * lay.q_heads, blocks) if head_major else (blocks, lay.batch * lay.q_heads)
        extra = {}
        if use_tma:
            box = [1, 1, cfg.block_n, block_d]
            extra = dict(KDesc=TensorDescriptor(k, list(k.shape), list(k.stride()), box),
                         VDesc=TensorDescriptor(v, list(v.shape), list(v.stride()), box), USE_TMA=True)
        attention_fwd_kernel[grid](
            q, k, v, out, lse, mask, cu_q, cu_k,
            *lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(out),
            *_lse_strides(lse, lay), *mask_strides,
            lay.q_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
            scale * LOG2E, left, right,
            HEAD_DIM=lay.head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            IS_VARLEN=lay.varlen, BOTTOM_RIGHT=bottom_right, HAS_LEFT=has_left, HAS_RIGHT=has_right,
            MASK_KIND=mask_kind, DOT_PRECISION=_dot_precision(q.dtype), SCALE_POSITIVE=scale > 0,
            HEAD_MAJOR=head_major, EXP_FMA=exp_share, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **extra,
        )

    key = _shape_key(q, lay, causal, bottom_right, window_left, window_right, mask_kind,
                     mask.element_size() if mask_kind else 0)
    if use_tma or head_major:
        key = key + (("tma" if use_tma else "ptr"), order)
    if exp_share:
        key = key + (f"exp_fma{exp_share}",)
    cfg = CONFIGS.pick("fwd", key, lambda: fitting_configs("fwd", block_d, q.dtype, q.device,
                                                           mask.element_size() if mask_kind else 0), launch,
                       lambda: out)
    launch(cfg)
    return out, lse


def launch_bwd(dout, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
               max_seqlen_k, scale, causal, bottom_right, window_left, window_right,
               deterministic: bool = True, dq_mode: Optional[str] = None):
    """Run delta, dk/dv and dq kernels; returns (dq, dk, dv) shaped like q, k, v.

    dq_mode (default VARIANTS["dq"]) picks how dq is made; deterministic=True always runs
    "separate", the only mode whose bits do not depend on timing."""
    mode = "separate" if deterministic else (dq_mode or VARIANTS["dq"])
    if mode not in DQ_MODES:
        raise ValueError(f"dq mode must be one of {DQ_MODES}, got {mode!r}")
    atomic = mode != "separate"
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    dout, out = _last_dim_contiguous(dout), _last_dim_contiguous(out)
    lay = _layout(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    dq = _new_output(q.shape, q.dtype, q.device)
    dk = _new_output(k.shape, k.dtype, k.device)
    dv = _new_output(v.shape, v.dtype, v.device)
    if lay.batch * lay.q_heads == 0 or q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    mask, mask_strides, mask_kind = _mask_args(attn_mask, lay, q)
    has_left, left, has_right, right = _position_flags(causal, window_left, window_right)
    block_d = _block_d(lay.head_dim)
    cu_q = cu_seqlens_q if lay.varlen else q
    cu_k = cu_seqlens_k if lay.varlen else q
    precision = _dot_precision(q.dtype)
    flags = dict(IS_VARLEN=lay.varlen, BOTTOM_RIGHT=bottom_right, HAS_LEFT=has_left, HAS_RIGHT=has_right,
                 MASK_KIND=mask_kind, DOT_PRECISION=precision)
    lse_strides = _lse_strides(lse, lay)

    delta = torch.empty_like(lse)
    # Atomic dq: an fp32 accumulator the delta kernel zeroes (dq itself when it is fp32).
    # Poisoned like an output, so rows the zeroing missed show up as NaN.
    if atomic:
        dq_acc = dq if dq.dtype == torch.float32 else _new_output(q.shape, torch.float32, q.device)
        dq_acc_strides = lay.strides(dq_acc)
    else:
        dq_acc, dq_acc_strides = dq, (0, 0, 0)
    dcfg = INTERPRET_CONFIGS["delta"] if interpreting() else DELTA_CONFIG
    attention_bwd_delta_kernel[(_cdiv(lay.q_len, dcfg.block_m), lay.batch * lay.q_heads)](
        out, dout, delta, dq_acc, cu_q, *lay.strides(out), *lay.strides(dout), *lse_strides,
        *dq_acc_strides, lay.q_heads, lay.q_len,
        HEAD_DIM=lay.head_dim, BLOCK_D=block_d, BLOCK_M=dcfg.block_m, IS_VARLEN=lay.varlen,
        ZERO_DQ=atomic, num_warps=dcfg.num_warps, num_stages=dcfg.num_stages,
    )

    dq_acc_dirty = [False]

    def launch_dkdv(cfg: KernelConfig):
        grid = (_cdiv(lay.k_len, cfg.block_n), lay.batch * lay.kv_heads)
        if atomic and dq_acc_dirty[0]:
            dq_acc.zero_()  # config timing runs the kernel many times; each run adds into dq_acc
        dq_acc_dirty[0] = atomic
        attention_bwd_dkdv_kernel[grid](
            q, k, v, dout, lse, delta, dk, dv, dq_acc, mask, cu_q, cu_k,
            *lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(dout), *lse_strides,
            *lay.strides(dk), *lay.strides(dv), *dq_acc_strides, *mask_strides,
            lay.kv_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
            scale, scale * LOG2E, left, right,
            HEAD_DIM=lay.head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            ATOMIC_DQ=atomic, ROTATE=mode == "atomic_rotate",
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
        )

    def launch_dq(cfg: KernelConfig):
        grid = (_cdiv(lay.q_len, cfg.block_m), lay.batch * lay.q_heads)
        attention_bwd_dq_kernel[grid](
            q, k, v, dout, lse, delta, dq, mask, cu_q, cu_k,
            *lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(dout), *lse_strides,
            *lay.strides(dq), *mask_strides,
            lay.q_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
            scale, scale * LOG2E, left, right,
            HEAD_DIM=lay.head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
        )

    mask_elem = mask.element_size() if mask_kind else 0
    key = _shape_key(q, lay, causal, bottom_right, window_left, window_right, mask_kind, mask_elem)
    kernels = ((("dkdv_atomic" if atomic else "dkdv"), launch_dkdv),) + (() if atomic else (("dq", launch_dq),))
    for kind, launch in kernels:
        candidates = (lambda kind=kind: fitting_configs(kind, block_d, q.dtype, q.device, mask_elem))
        launch(CONFIGS.pick(kind, key + ((mode,) if atomic else ()), candidates, launch))
    if atomic and dq_acc is not dq:
        dq.copy_(dq_acc)
    return dq, dk, dv


@torch.library.custom_op("adaattn::flash_fwd", mutates_args=())
def flash_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool, bottom_right: bool,
    window_left: int, window_right: int, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse). Dense q (B, Hq, Nq, D) or packed (T, Hq, D) with cu_seqlens; window sides
    are -1 when unbounded; `deterministic` only travels to the backward."""
    return launch_fwd(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      scale, causal, bottom_right, window_left, window_right)


@flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    scale, causal, bottom_right, window_left, window_right, deterministic):
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32)
    # Contiguous, as the real outputs are (empty_like would copy a view's strides).
    return q.new_empty(q.shape), lse


@torch.library.custom_op("adaattn::flash_bwd", mutates_args=())
def flash_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, attn_mask: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, scale: float,
    causal: bool, bottom_right: bool, window_left: int, window_right: int, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv). deterministic=True runs the no-atomics kernels (bitwise reproducible);
    otherwise dq is made as VARIANTS["dq"] says."""
    return launch_bwd(dout, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                      max_seqlen_k, scale, causal, bottom_right, window_left, window_right,
                      deterministic=deterministic)


@flash_bwd.register_fake
def _flash_bwd_fake(dout, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, scale, causal, bottom_right, window_left, window_right, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, attn_mask, cu_q, cu_k, max_q, max_k, scale, causal, bottom_right,
     window_left, window_right, deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, cu_q, cu_k)
    ctx.options = (max_q, max_k, scale, causal, bottom_right, window_left, window_right, deterministic)
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, attn_mask, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = flash_bwd(dout, q, k, v, out, lse, attn_mask, cu_q, cu_k, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


flash_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def _window_sides(window) -> tuple[int, int]:
    if window is None:
        return -1, -1
    left, right = window
    return (-1 if left is None else int(left)), (-1 if right is None else int(right))


def _check_alignment(causal_alignment: str) -> bool:
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    return causal_alignment == "bottom_right"


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_dense(q, k, v, attn_mask) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (B, H, N, D) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"query, key and value must share one dtype among float16, bfloat16, float32; got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}")
    b, hq, _, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"key and value must be (B, Hkv, Nk, D) with query's B={b} and D={d}, got key "
                         f"{tuple(k.shape)} and value {tuple(v.shape)}")
    if k.shape[1] == 0 or hq % k.shape[1] != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({k.shape[1]})")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {d}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor) or (attn_mask.dtype != torch.bool and not attn_mask.is_floating_point()):
            raise TypeError(f"attn_mask must be a bool or floating tensor, got {attn_mask!r:.80}")
        try:
            torch.broadcast_shapes(attn_mask.shape, (b, hq, q.shape[2], k.shape[2]))
        except RuntimeError:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                             f"(B, Hq, Nq, Nk) = {(b, hq, q.shape[2], k.shape[2])}") from None


def triton_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[tuple] = None,
    *,
    causal_alignment: str = "top_left",
    deterministic: bool = False,
) -> torch.Tensor:
    """Exact attention with our Triton kernels on (B, H, N, D) tensors; returns (B, Hq, Nq, D).

    query (B, Hq, Nq, D), key/value (B, Hkv, Nk, D), Hq a multiple of Hkv (GQA/MQA read the
    kv head q_head // groups, never repeated in memory); float16, bfloat16 or float32.
    attn_mask: bool (True takes part) or additive in the query dtype, broadcastable to
        (B, Hq, Nq, Nk); additive masks get no gradient.
    is_causal / window (left, right): as SDPA and adaattn.attention, aligned top-left; with
        causal_alignment="bottom_right" query i sits at position i + (Nk - Nq), so key j is
        visible iff j <= i + Nk - Nq (the KV-cache convention); windows shift the same way.
    deterministic: bitwise-reproducible gradients: the backward then runs its no-atomics
        kernels whatever VARIANTS["dq"] says (an atomic dq sums in a timing-dependent order).
    Rows that see no key give 0. Raises ValueError/TypeError for inconsistent shapes, dtypes
    or devices, head_dim > 256, or a bad causal_alignment.
    """
    _check_dense(query, key, value, attn_mask)
    bottom_right = _check_alignment(causal_alignment)
    d = query.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    left, right = _window_sides(window)
    if _direct_ok(query, key, value, attn_mask):
        out, _ = launch_fwd(query, key, value, attn_mask, None, None, query.shape[2], key.shape[2], scale,
                            bool(is_causal), bottom_right, left, right)
        return out
    out, _ = flash_fwd(query, key, value, attn_mask, None, None, query.shape[2], key.shape[2], scale,
                       bool(is_causal), bottom_right, left, right,
                           bool(deterministic) or torch.are_deterministic_algorithms_enabled())
    return out


def _direct_ok(*tensors) -> bool:
    """Whether a forward may call launch_fwd without the custom op, whose dispatch costs tens
    of microseconds of host time per call (as much as a short kernel): no gradient wanted,
    no tracing, plain tensors, no dispatch or function mode, no functorch transform."""
    present = [t for t in tensors if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return False
    if any(type(t) is not torch.Tensor for t in present):
        return False
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active() or torch.jit.is_tracing():
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    return torch.utils._python_dispatch._get_current_dispatch_mode() is None


def triton_can_run(device: torch.device, dtype: torch.dtype, head_dim: int) -> list:
    """Reasons our Triton kernels cannot run on this device/dtype/head_dim (empty: they can)."""
    reasons = []
    if triton is None:
        reasons.append(f"triton does not import ({TRITON_ERROR}).")
        return reasons
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        reasons.append(f"runs on CUDA tensors only (CPU only under TRITON_INTERPRET=1), got {device.type}.")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(f"takes float16, bfloat16 or float32, got {str(dtype).replace('torch.', '')}.")
    if head_dim > MAX_HEAD_DIM:
        reasons.append(f"head_dim {head_dim} exceeds its limit {MAX_HEAD_DIM}.")
    if device.type == "cuda" and not interpreting():
        dev = hardware.device(device.index)
        if dev is not None and dev.capability < (8, 0):
            reasons.append(f"needs compute capability sm80 or newer, this GPU is {dev.arch}.")
    return reasons


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a packed 3-D tensor (total_tokens, heads, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k and v must have equal shapes with q's head_dim, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32 tensor of batch + 1 offsets")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[tuple] = None,
    *,
    causal_alignment: str = "top_left",
    deterministic: bool = False,
) -> torch.Tensor:
    """Attention over a batch of sequences of different lengths, packed without padding.

    q (total_q, Hq, D), k and v (total_k, Hkv, D), Hq a multiple of Hkv; sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k/v
    (int32 or int64, batch + 1 entries, starting at 0). max_seqlen_q/k bound the lengths
    (they size the launch grid; no host synchronisation on the Triton path).
    is_causal, window and causal_alignment apply within each sequence as in triton_attention.
    Returns (total_q, Hq, D) in q's dtype; differentiable. Where the Triton kernels cannot run
    (no triton, CPU without TRITON_INTERPRET=1, float64, ...) each sequence goes through
    torch SDPA instead, which reads the offsets on the host.
    Raises ValueError/TypeError for inconsistent shapes, dtypes or offsets.
    """
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    bottom_right = _check_alignment(causal_alignment)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    left, right = _window_sides(window)
    if not triton_can_run(q.device, q.dtype, q.shape[-1]):  # no reasons: the kernels run
        cu_q = cu_seqlens_q.to(torch.int32)
        cu_k = cu_seqlens_k.to(torch.int32)
        out, _ = flash_fwd(q, k, v, None, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), scale,
                           bool(is_causal), bottom_right, left, right,
                           bool(deterministic) or torch.are_deterministic_algorithms_enabled())
        return out
    return _varlen_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, bool(is_causal), scale, window, bottom_right)


def _varlen_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal, scale, window, bottom_right):
    """Per-sequence torch SDPA: the fallback where the Triton kernels cannot run."""
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    groups = q.shape[1] // k.shape[1]
    outs = []
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)
        ks = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(groups, dim=0)
        vs = v[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(groups, dim=0)
        nq, nk = qs.shape[1], ks.shape[1]
        if nq == 0:
            outs.append(q.new_zeros(0, q.shape[1], q.shape[2]))
            continue
        keep = position_keep(nq, nk, is_causal, window, q.device, bottom_right)
        if nk == 0:
            o = qs.new_zeros(qs.shape)
        elif keep is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        else:
            # Fully masked rows: SDPA's math gives NaN on some versions; define them as 0.
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=keep, scale=scale)
            o = torch.where(keep.any(-1, keepdim=True), o, torch.zeros_like(o))
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, 0) if outs else q.new_zeros(q.shape)


def unsupported_options(problem) -> list[str]:
    """Reasons, shared by our Triton backends, from call options the kernels do not implement."""
    reasons = []
    if problem.dropout_p > 0:
        reasons.append("dropout is not implemented.")
    if problem.mask_grad:
        reasons.append("an attn_mask that requires grad would get no gradient (not implemented).")
    return reasons


class TritonBackend(Backend):
    """Our exact fused attention (forward and backward) in Triton."""

    name = "triton"

    @property
    def interpreted(self) -> bool:
        """True under TRITON_INTERPRET=1: CPU runs are for tests, far too slow to benchmark."""
        return interpreting()

    def supports(self, problem) -> list[str]:
        device = torch.device(problem.device_type, problem.device_index)
        reasons = triton_can_run(device, problem.dtype, problem.head_dim)
        if problem.value_dim != problem.head_dim:
            reasons.append("value head_dim differs from query/key head_dim.")
        return reasons + unsupported_options(problem)

    def run(self, query, key, value, attn_mask, problem, plan):
        return triton_attention(
            query, key, value, attn_mask, problem.causal, problem.scale, problem.window,
            deterministic=plan.deterministic or torch.are_deterministic_algorithms_enabled(),
        )
