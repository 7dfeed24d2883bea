"""The small shared helpers of our Triton glue, and the one module of this package that code
outside backends/ imports (adaptive/, kv/, distributed/): whether triton runs in its interpreter,
integer helpers the launch glue calls on every call (next_pow2, cdiv, block_d, length_bucket), a
kernel config (KernelConfig), the dot precision of a dtype, tensors as the pointer and descriptor
kernels take them (pointer_ready, tma_ok, tensor_descriptor, the device-side allocator), a fresh
output (new_output), the visible band of a launch (WindowSides), where rows live (RowLayout,
mask_args), the reasons every Triton runner shares (unsupported_options), and whether and how
the Gluon kernels run (gluon_fwd_here, gluon_bwd_here, run_gluon_first, shared_layout).

float32 inputs run their matrix products in full fp32 (tl.dot input_precision="ieee"), not
TF32, so fp32 results match SDPA's fp32 paths; bf16/fp16 use the tensor cores with fp32
accumulation.

Nothing here imports triton at import time, nor any other module of this package.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from ... import hardware, settings
from ...problem import tma_aligned

MASK_NONE, MASK_BOOL, MASK_ADDITIVE = 0, 1, 2  # kernels/attention_fwd.py's MASK_* constants
LOG2E = 1.4426950408889634
TRITON_FOUND = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton runs in its CPU interpreter (TRITON_INTERPRET=1): tests, never timing."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def next_pow2(n: int) -> int:
    # triton.next_power_of_2 / triton.cdiv cost microseconds per call on the host (they are
    # wrapped for use inside kernels); the launch glue calls these on every call.
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def length_bucket(n: int) -> int:
    """Lengths share a tuned config within a power of two; 1 (decode) is its own class."""
    return 1 if n <= 1 else min(next_pow2(n), 16384)


def block_d(head_dim: int) -> int:
    """The padded head dim of a tile: a power of two, at least 16."""
    return max(16, next_pow2(head_dim))


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    # "" for the kernel of the kind; "gluon": the Gluon kernel of the same kind, which the tuner
    # times beside it (kernels/attention_fwd_gluon.py for "fwd_ws", attention_quant_gluon.py
    # for "quant_fp8_ws").
    impl: str = ""

    def __str__(self) -> str:
        tail = f"/{self.impl}" if self.impl else ""
        return f"BM{self.block_m}/BN{self.block_n}/w{self.num_warps}/s{self.num_stages}{tail}"


class WindowSides:
    """The visible band of a launch with `causal`, `window_left` and `window_right` (-1 unbounded):
    causal is the right bound 0."""

    @property
    def has_left(self) -> bool:
        return self.window_left >= 0

    @property
    def has_right(self) -> bool:
        return self.causal or self.window_right >= 0

    @property
    def left(self) -> int:
        return max(self.window_left, 0)

    @property
    def right(self) -> int:
        return 0 if self.causal else max(self.window_right, 0)


def dot_precision(dtype: torch.dtype) -> str:
    if interpreting() and dtype == torch.bfloat16:
        return "interpreter_bf16"  # see kernels/attention_fwd.py: dot, round_to
    return "ieee" if dtype == torch.float32 else "tf32"


def new_output(shape, dtype, device) -> torch.Tensor:
    if settings.current().poison_outputs:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def pointer_ready(t: torch.Tensor) -> torch.Tensor:
    """t as the pointer kernels load it: a unit-stride last dim, a 16-byte aligned base and row
    strides; otherwise a contiguous copy. With K and V both at odd offsets (rows of 268 and 32
    bytes) the forward read outside them (illegal memory access) at BLOCK_N 64 and not at 128;
    with either one aligned it ran (seed 5300 #16237, H200, triton 3.6)."""
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return t.contiguous()
    if torch.compiler.is_compiling() or t.device.type == "meta":
        return t
    e = t.element_size()
    if t.data_ptr() % 16 == 0 and all((st * e) % 16 == 0 for st in t.stride()[:-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)


@dataclass
class RowLayout:
    """Where rows of one (batch, head) live: strides (batch, head, row) of a dense
    (B, H, N, D) tensor, or (0, head, row) of a packed (T, H, D) one."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int  # dense length, or max_seqlen for packed
    k_len: int
    head_dim: int
    varlen: bool
    value_dim: int = 0

    def strides(self, t: torch.Tensor) -> tuple:
        if self.varlen:
            return (0, t.stride(1), t.stride(0))
        return (t.stride(0), t.stride(1), t.stride(2))

    def offsets(self, cu_seqlens_q, cu_seqlens_k, like: torch.Tensor) -> tuple:
        """The (CuQ, CuK) arguments of the kernels: the packed call's offsets, or for a dense call
        any tensor (`like`: the kernels do not read it)."""
        if self.varlen:
            return cu_seqlens_q, cu_seqlens_k
        return like, like


def mask_args(attn_mask, lay: RowLayout, like: torch.Tensor):
    """(tensor, strides (b, h, q, k), MASK_KIND) with stride 0 on broadcast dimensions."""
    if attn_mask is None:
        return like, (0, 0, 0, 0), MASK_NONE
    m = attn_mask.expand(lay.batch, lay.q_heads, lay.q_len, lay.k_len)
    if m.dtype == torch.bool:
        return m.view(torch.uint8), m.stride(), MASK_BOOL
    return m, m.stride(), MASK_ADDITIVE


def alibi_args(slopes: torch.Tensor) -> dict:
    """The kernels' ALiBi arguments for float32 slopes of shape (Hq,) or (B, Hq): a row of Hq per
    batch (stride 0 for one row shared by the batch)."""
    return dict(Slopes=slopes, stride_sb=slopes.stride(0) if slopes.dim() == 2 else 0, HAS_ALIBI=True)


def tma_ok(t: torch.Tensor) -> bool:
    """A tensor a TMA descriptor takes as it is (problem.tma_aligned, the fact the planner read)."""
    return tma_aligned(t)


def tensor_descriptor():
    """triton's TensorDescriptor class, or None on a triton without it."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def _triton_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def ensure_triton_allocator() -> None:
    """Kernels that make tensor descriptors on the device need scratch memory from the
    allocator set with triton.set_allocator. Install one backed by torch's caching allocator
    (so it works under CUDA-graph capture) unless the caller already set their own. The
    setting is a context variable: checked on every launch, since a new thread starts without."""
    import triton

    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except Exception:
        pass
    triton.set_allocator(_triton_scratch)


def unsupported_options(problem) -> list[str]:
    """Reasons, shared by our Triton runners, from call options the kernels do not implement."""
    reasons = []
    if problem.dropout_p > 0:
        reasons.append("dropout is not implemented.")
    if problem.mask_grad:
        reasons.append("an attn_mask that requires grad would get no gradient (not implemented).")
    return reasons


def run_gluon_first(pick, run, gluon: bool) -> bool:
    """Run the config pick(gluon) chooses. A Gluon config that fails to compile or launch warns
    once (gluon_failed), and the config pick(False) chooses runs instead. False when pick gives
    None (no kernel of the runner takes the call): nothing ran."""
    cfg = pick(gluon)
    if cfg is not None and cfg.impl == "gluon":
        try:
            run(cfg)
            return True
        except Exception as e:  # a compile or launch failure of the Gluon kernel on this triton
            gluon_failed(e)
            cfg = pick(False)
    if cfg is None:
        return False
    run(cfg)
    return True


_GLUON_BROKEN: list = []


def gluon_failed(e: BaseException) -> None:
    """A Gluon kernel failed to compile or launch (a triton whose Gluon differs): one warning, and
    no Gluon kernel runs in this process from then on (the Triton kernels of the same runners do)."""
    import warnings

    if not _GLUON_BROKEN:
        warnings.warn(f"adaattn triton: a Gluon kernel failed ({type(e).__name__}: {str(e).strip()[:200]}); "
                      "the Triton kernels run instead from now on.", RuntimeWarning, stacklevel=3)
    _GLUON_BROKEN.append(True)


def gluon_fwd_here(q: torch.Tensor) -> bool:
    """Whether calls on q's device may run the Gluon forwards (the exact one of triton.ws, the fp8
    one of triton.quant.ws): Hopper (sm90), not the interpreter, a triton whose Gluon has
    warp_specialize over (function, args) pairs (3.6 and newer), the setting not "off", and no
    Gluon failure in this process."""
    return _gluon_here(q, settings.current().fwd_gluon)


def gluon_bwd_here(q: torch.Tensor) -> bool:
    """Whether backward calls on q's device may run the Gluon backward (kernels/attention_bwd_gluon.py):
    as gluon_fwd_here, under the bwd_gluon setting."""
    return _gluon_here(q, settings.current().bwd_gluon)


def _gluon_here(q: torch.Tensor, setting: str) -> bool:
    if _GLUON_BROKEN or setting == "off":
        return False
    if not q.is_cuda or interpreting() or hardware.arch("cuda", q.device.index) != "sm90":
        return False
    return hardware.gluon_available()


@functools.lru_cache(maxsize=None)
def shared_layout(box: tuple, dtype: torch.dtype):
    """The NVMMA shared layout of a Gluon kernel's TMA box, made once per box and dtype (a host
    cost of every call otherwise)."""
    from triton.experimental.gluon import language as gl

    elem = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
            torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), elem)
