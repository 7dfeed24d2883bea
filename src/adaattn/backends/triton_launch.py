"""Launches of our exact Triton attention kernels, each from one frozen launch description.

`AttentionLaunch` is built once, when a call is planned (a runner's `prepare`), and holds every
decision a launch needs: the forward variant, the scale, the causal/window sides, the alignment,
the grid order and the backward's dq mode. `launch_fwd` / `launch_bwd` turn it and the tensors
into strides, grids and configs; no host synchronisation.

float32 inputs run their matrix products in full fp32 (tl.dot input_precision="ieee"), not
TF32, so fp32 results match SDPA's fp32 paths; bf16/fp16 use the tensor cores with fp32
accumulation.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import hardware, settings
from ..problem import tma_aligned
from .triton_configs import (
    BWD_WS_PAIR,
    DELTA_CONFIG,
    INTERPRET_CONFIGS,
    KernelConfig,
    block_d,
    cdiv,
    fitting_configs,
    interpreting,
    length_bucket,
)
from .triton_tuner import CONFIGS

FWD_VARIANTS = ("ws", "tma", "ptr")
DQ_MODES = settings.DQ_MODES
GRID_ORDERS = settings.GRID_ORDERS
MASK_NONE, MASK_BOOL, MASK_ADDITIVE = 0, 1, 2  # kernels/attention_fwd.py's MASK_* constants
LOG2E = 1.4426950408889634


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


@dataclass(frozen=True)
class AttentionLaunch(WindowSides):
    """Everything a launch of our exact kernels needs beyond the tensors.

    variant: "ws" (warp-specialised, Hopper), "tma" (tensor-descriptor K/V loads) or "ptr".
    window_left / window_right: -1 where unbounded; causal is the right bound 0.
    dq_mode: how the backward makes dq ("separate" is the deterministic, atomic-free one).
    """

    variant: str
    scale: float
    causal: bool
    bottom_right: bool = False
    window_left: int = -1
    window_right: int = -1
    grid_order: str = "query_major"
    exp_fma: int = 0
    dq_mode: str = "atomic"

    def __post_init__(self) -> None:
        if self.variant not in FWD_VARIANTS:
            raise ValueError(f"variant must be one of {FWD_VARIANTS}, got {self.variant!r}")
        if self.grid_order not in GRID_ORDERS:
            raise ValueError(f"grid_order must be one of {GRID_ORDERS}, got {self.grid_order!r}")
        if self.dq_mode not in DQ_MODES:
            raise ValueError(f"dq_mode must be one of {DQ_MODES}, got {self.dq_mode!r}")
        if self.exp_fma not in (0, 2, 4):
            raise ValueError(f"exp_fma must be 0, 2 or 4, got {self.exp_fma!r}")

def make_launch(variant: str, scale: float, causal: bool, window_left: int = -1, window_right: int = -1,
                bottom_right: bool = False, deterministic: bool = False) -> AttentionLaunch:
    """A launch description with the current settings' grid order, exp share and dq mode."""
    current = settings.current()
    return AttentionLaunch(variant, float(scale), bool(causal), bool(bottom_right), int(window_left),
                           int(window_right), current.fwd_grid, int(current.exp_fma),
                           "separate" if deterministic else current.dq)


# Custom ops take plain arguments: a launch description travels as a string of its fields
# (made in traced code without locks or global state; parsed once per distinct string).
_parsed: dict[str, AttentionLaunch] = {}


def launch_id(launch: AttentionLaunch) -> str:
    """The launch description as the custom ops take it (launch_of turns it back)."""
    return (f"{launch.variant},{launch.scale!r},{int(launch.causal)},{int(launch.bottom_right)},"
            f"{launch.window_left},{launch.window_right},{launch.grid_order},{launch.exp_fma},{launch.dq_mode}")


def launch_of(key: str) -> AttentionLaunch:
    got = _parsed.get(key)
    if got is None:
        v, scale, causal, bottom_right, left, right, grid, exp_fma, dq = key.split(",")
        got = _parsed[key] = AttentionLaunch(v, float(scale), causal == "1", bottom_right == "1", int(left),
                                             int(right), grid, int(exp_fma), dq)
    return got


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


def bwd_outputs(q, k, v, lay: RowLayout) -> tuple:
    """((dq, dk, dv) shaped like q, k, v, whether the backward has no work); without work the
    gradients are zeros already."""
    grads = tuple(new_output(t.shape, t.dtype, t.device) for t in (q, k, v))
    empty = lay.batch * lay.q_heads == 0 or q.numel() == 0 or k.numel() == 0 or lay.q_len == 0 or lay.k_len == 0
    if empty:
        for g in grads:
            g.zero_()
    return grads, empty


def row_layout(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k) -> RowLayout:
    if cu_seqlens_q is not None:
        return RowLayout(cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1], max_seqlen_q, max_seqlen_k,
                         q.shape[-1], True, v.shape[-1])
    return RowLayout(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[-1], False, v.shape[-1])


def lse_shape(q: torch.Tensor, varlen: bool) -> tuple:
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[1], q.shape[2])


def out_shape(q: torch.Tensor, v: torch.Tensor) -> tuple:
    return tuple(q.shape[:-1]) + (v.shape[-1],)


def lse_strides(lse: torch.Tensor, lay: RowLayout) -> tuple:
    if lay.varlen:
        return (0, lse.stride(0), lse.stride(1))
    return (lse.stride(0), lse.stride(1), lse.stride(2))


def mask_args(attn_mask, lay: RowLayout, like: torch.Tensor):
    """(tensor, strides (b, h, q, k), MASK_KIND) with stride 0 on broadcast dimensions."""
    if attn_mask is None:
        return like, (0, 0, 0, 0), MASK_NONE
    m = attn_mask.expand(lay.batch, lay.q_heads, lay.q_len, lay.k_len)
    if m.dtype == torch.bool:
        return m.view(torch.uint8), m.stride(), MASK_BOOL
    return m, m.stride(), MASK_ADDITIVE


def dot_precision(dtype: torch.dtype) -> str:
    if interpreting() and dtype == torch.bfloat16:
        return "interpreter_bf16"  # see kernels/attention_fwd.py: dot, round_to
    return "ieee" if dtype == torch.float32 else "tf32"


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


def _shape_key(q, lay: RowLayout, launch: AttentionLaunch, mask_kind, mask_elem=0) -> tuple:
    return (q.device.type, q.device.index, q.dtype, lay.head_dim, lay.value_dim, lay.varlen, launch.causal,
            launch.bottom_right, launch.has_left, launch.window_right >= 0, mask_kind, mask_elem,
            lay.q_heads != lay.kv_heads, length_bucket(lay.q_len), length_bucket(lay.k_len))


def _launch_fwd_ws(q, k, v, out, lse, lay: RowLayout, launch: AttentionLaunch) -> None:
    """The triton.ws runner's forward: the warp-specialised Triton kernel, and on Hopper the Gluon
    kernel too (kernels/attention_fwd_gluon.py; its configs come first, and the tuner times both
    kernels per shape class). A Gluon launch that fails (a triton whose Gluon differs) warns once,
    and the Triton kernel runs from then on."""
    from ..kernels.attention_fwd_ws import attention_fwd_ws_kernel

    descriptor = tensor_descriptor()

    def run_triton(cfg: KernelConfig):
        ensure_triton_allocator()
        box = [1, 1, cfg.block_n, lay.head_dim]
        attention_fwd_ws_kernel[(cdiv(lay.q_len, cfg.block_m), lay.batch * lay.q_heads)](
            q, descriptor(k, list(k.shape), list(k.stride()), box),
            descriptor(v, list(v.shape), list(v.stride()), box), out, lse, *lay.strides(q), *lay.strides(out),
            *lse_strides(lse, lay), lay.q_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
            launch.scale * LOG2E, launch.left, HEAD_DIM=lay.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            CAUSAL=launch.has_right, BOTTOM_RIGHT=launch.bottom_right, K_TAIL=lay.k_len % cfg.block_n != 0,
            DOT_PRECISION=dot_precision(q.dtype), WARP_SPEC=not interpreting(), HAS_LEFT=launch.has_left,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def run(cfg: KernelConfig):
        if cfg.impl == "gluon":
            _launch_fwd_gluon(q, k, v, out, lse, lay, launch, cfg)
        else:
            run_triton(cfg)

    def pick(gluon: bool) -> KernelConfig:
        """The tuned config among the Triton kernel's, and the Gluon kernel's first where it runs."""
        def candidates() -> list:
            triton_configs = fitting_configs("fwd_ws", lay.head_dim, q.dtype, q.device)
            return (fitting_configs("fwd_gluon", lay.head_dim, q.dtype, q.device) if gluon else []) + triton_configs

        cfg = CONFIGS.pick("fwd_ws", _shape_key(q, lay, launch, MASK_NONE) + (gluon,), candidates, run, lambda: out)
        if cfg.impl == "gluon" and not gluon:  # a forced Gluon config after a failure: the Triton kernel's first
            cfg = fitting_configs("fwd_ws", lay.head_dim, q.dtype, q.device)[0]
        return cfg

    run_gluon_first(pick, run, gluon_fwd_here(q))


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


def heads_rows(t: torch.Tensor, lay: RowLayout) -> torch.Tensor:
    """The 4-D (B, H, rows, D) tensor a Gluon kernel's descriptors take: t itself, or for packed
    (T, H, D) tensors the (1, H, T, D) view (its last two box dims are (rows, D), as dense tiles,
    so the shared-memory swizzle is the one the kernels' tiles assume)."""
    return t.permute(1, 0, 2).unsqueeze(0) if lay.varlen else t


def _launch_fwd_gluon(q, k, v, out, lse, lay: RowLayout, launch: AttentionLaunch, cfg: KernelConfig,
                      cu_q=None, cu_k=None) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..kernels.attention_fwd_gluon import attention_fwd_gluon_kernel

    d, half = lay.head_dim, cfg.block_m // 2

    def desc(t, rows):
        t = heads_rows(t, lay)
        box = (1, 1, rows, d)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), shared_layout(box, t.dtype))

    packed = {}
    if lay.varlen:  # sequences from cu_q / cu_k; outputs at a sequence's end stored by row
        packed = dict(VARLEN=True, CuQ=cu_q, CuK=cu_k, O=out, stride_om=out.stride(0), stride_oh=out.stride(1))
    attention_fwd_gluon_kernel[(cdiv(lay.q_len, cfg.block_m), lay.batch * lay.q_heads)](
        desc(q, half), desc(k, cfg.block_n), desc(v, cfg.block_n), desc(out, half), lse, *lse_strides(lse, lay),
        lay.q_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len, launch.scale * LOG2E, launch.left,
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages, CAUSAL=launch.has_right,
        BOTTOM_RIGHT=launch.bottom_right, HAS_LEFT=launch.has_left, num_warps=cfg.num_warps, **packed,
    )


def gluon_varlen_fwd_ok(q, k, v, out, lay: RowLayout, launch: AttentionLaunch, mask_kind: int) -> bool:
    """Whether the Gluon forward takes a packed call: on Hopper (gluon_fwd_here), no mask, head dim
    64 or 128 for Q, K and V, no right bound past the causal one, and descriptor_scope."""
    return (lay.varlen and mask_kind == MASK_NONE and lay.head_dim in (64, 128) and launch.right == 0
            and gluon_fwd_here(q) and descriptor_scope(launch, q, k, v, out))


def _check_variant(launch: AttentionLaunch, lay: RowLayout, q, k, v, mask_kind: int) -> None:
    """The planner picks a variant from the call's facts; a launch that breaks them is a bug
    (raised, so the fallback runs, never a silent switch of kernel)."""
    if launch.variant == "ptr":
        return
    ok = (not lay.varlen and mask_kind == MASK_NONE and lay.head_dim == block_d(lay.head_dim)
          and descriptor_scope(launch, q, k, v))
    if ok and launch.variant == "ws":  # a left window, and no right bound past the causal one
        ok = launch.right == 0 and lay.head_dim in (64, 128)
    if not ok:
        raise ValueError(f"the {launch.variant} forward cannot run this launch (mask, window, head dim, dtype or "
                         "alignment); the planner should not have chosen it")


def stats_shape(q: torch.Tensor, attn_mask, varlen: bool) -> tuple:
    """The shape of the split row statistics a forward saves for its backward: (2, *lse shape)
    under an additive mask or for float32 inputs (planes: row max m in the log2 domain, log2 of the
    row sum; see kernels/attention_bwd.py), (0,) otherwise."""
    if (attn_mask is not None and attn_mask.dtype != torch.bool) or q.dtype == torch.float32:
        return (2,) + lse_shape(q, varlen)
    return (0,)


def clear_packed_tails(*parts: tuple) -> None:
    """Give the rows of packed tensors past their last sequence the value each asks for, in one
    launch, on the device (no host read). parts: up to three (t, cu, rows_dim, fill): t a
    contiguous (T, ...) with rows_dim 0, or a contiguous lse (H, T) with rows_dim 1, as the
    launches allocate them; rows cu[-1] .. T get `fill`. The attention
    kernels visit each sequence's rows only; a packed tensor longer than cu[-1] has rows no
    sequence owns, which are 0 (outputs, gradients) or -inf (log-sum-exps), as for a query that
    sees no key."""
    from ..kernels.attention_fwd import packed_tail_kernel

    views = []
    for t, cu, rows_dim, fill in parts:
        total = t.shape[rows_dim]
        if total == 0 or t.numel() == 0:
            continue
        assert t.is_contiguous(), "packed outputs and gradients are allocated contiguous"
        views.append((t.movedim(rows_dim, 0).flatten(1), cu, float(fill)))  # (T, rest): a view of t
    if not views:
        return
    n = len(views)
    views += [views[0]] * (3 - n)
    (x0, c0, f0), (x1, c1, f1), (x2, c2, f2) = views
    longest = max(v[0].shape[0] for v in views)
    packed_tail_kernel[(cdiv(longest, 64), n)](
        x0, x1, x2, c0, c1, c2, c0.shape[0] - 1, x0.shape[0], x1.shape[0], x2.shape[0],
        x0.shape[1], x1.shape[1], x2.shape[1], *x0.stride(), *x1.stride(), *x2.stride(), f0, f1, f2,
        BLOCK_R=64, BLOCK_C=128, num_warps=4)


def launch_fwd(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               launch: AttentionLaunch, stats: Optional[torch.Tensor] = None):
    """Run the forward kernel; returns (out (..., Dv) like q, lse fp32 (B, Hq, Nq) or (Hq, T)).
    stats: a (2, *lse shape) fp32 tensor (stats_shape) the kernel fills with the row max and
    log2 row sum under an additive mask, for launch_bwd; ignored without one. Packed rows past
    the last sequence give 0 (and an lse of -inf)."""
    out, lse = _launch_fwd(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, launch, stats)
    if cu_seqlens_q is not None:
        clear_packed_tails((out, cu_seqlens_q, 0, 0.0), (lse, cu_seqlens_q, 1, float("-inf")))
    return out, lse


def _launch_fwd(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                launch: AttentionLaunch, stats: Optional[torch.Tensor] = None):
    q, k, v = pointer_ready(q), pointer_ready(k), pointer_ready(v)
    lay = row_layout(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    out = new_output(out_shape(q, v), q.dtype, q.device)
    lse = new_output(lse_shape(q, lay.varlen), torch.float32, q.device)
    if lay.batch * lay.q_heads == 0 or lay.q_len == 0 or q.numel() == 0 or out.numel() == 0:
        return out, lse
    if lay.k_len == 0 or k.numel() == 0:  # no key: rows give 0, as SDPA's math; the lse is -inf
        if stats is not None and stats.numel():
            stats[0].fill_(float("-inf"))
            stats[1].zero_()
        return out.zero_(), lse.fill_(float("-inf"))
    mask, mask_strides, mask_kind = mask_args(attn_mask, lay, q)
    split = stats is not None and stats.numel() > 0
    _check_variant(launch, lay, q, k, v, mask_kind)
    if launch.variant == "ws":
        _launch_fwd_ws(q, k, v, out, lse, lay, launch)
        return out, lse
    from ..kernels.attention_fwd import attention_fwd_kernel

    # Q/K tiles are bd wide, V/Out tiles bdv: no padding spent on the smaller head dim. Equal
    # head dims give equal widths, so D == Dv compiles to the kernel it always was.
    bd, bdv = block_d(lay.head_dim), block_d(lay.value_dim)
    cu_q, cu_k = lay.offsets(cu_seqlens_q, cu_seqlens_k, q)
    use_tma = launch.variant == "tma"
    head_major = launch.grid_order == "head_major"
    descriptor = tensor_descriptor() if use_tma else None

    def run(cfg: KernelConfig):
        blocks = cdiv(lay.q_len, cfg.block_m)
        grid = (lay.batch * lay.q_heads, blocks) if head_major else (blocks, lay.batch * lay.q_heads)
        extra = dict(Stats=stats, stride_ls=stats.stride(0), STORE_STATS=True) if split else {}
        if use_tma:
            extra.update(KDesc=descriptor(k, list(k.shape), list(k.stride()), [1, 1, cfg.block_n, bd]),
                         VDesc=descriptor(v, list(v.shape), list(v.stride()), [1, 1, cfg.block_n, bdv]),
                         USE_TMA=True)
        attention_fwd_kernel[grid](
            q, k, v, out, lse, mask, cu_q, cu_k,
            *lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(out),
            *lse_strides(lse, lay), *mask_strides,
            lay.q_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
            launch.scale * LOG2E, launch.left, launch.right,
            HEAD_DIM=lay.head_dim, BLOCK_D=bd, HEAD_DIM_V=lay.value_dim, BLOCK_DV=bdv,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            IS_VARLEN=lay.varlen, BOTTOM_RIGHT=launch.bottom_right, HAS_LEFT=launch.has_left,
            HAS_RIGHT=launch.has_right, MASK_KIND=mask_kind, DOT_PRECISION=dot_precision(q.dtype),
            SCALE_POSITIVE=launch.scale > 0, HEAD_MAJOR=head_major, EXP_FMA=launch.exp_fma,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
        )

    mask_elem = mask.element_size() if mask_kind else 0
    key = _shape_key(q, lay, launch, mask_kind, mask_elem)
    if use_tma or head_major:
        key = key + (launch.variant, launch.grid_order)
    if launch.exp_fma:
        key = key + (f"exp_fma{launch.exp_fma}",)

    def general() -> list:
        return fitting_configs("fwd", bd, q.dtype, q.device, mask_elem, bdv)

    if gluon_varlen_fwd_ok(q, k, v, out, lay, launch, mask_kind):
        # Packed sequences on Hopper: the Gluon forward, timed beside this kernel's configs.
        def run_any(cfg: KernelConfig):
            if cfg.impl == "gluon":
                _launch_fwd_gluon(q, k, v, out, lse, lay, launch, cfg, cu_q, cu_k)
            else:
                run(cfg)

        def pick(gluon: bool) -> KernelConfig:
            if not gluon:
                return CONFIGS.pick("fwd", key, general, run, lambda: out)
            return CONFIGS.pick("fwd", key + ("gluon",),
                                lambda: fitting_configs("fwd_gluon", lay.head_dim, q.dtype, q.device) + general(),
                                run_any, lambda: out)

        run_gluon_first(pick, run_any, True)
        return out, lse
    run(CONFIGS.pick("fwd", key, general, run, lambda: out))
    return out, lse


DS_SCALE_FLOOR = 2.0 ** -6
# A backward whose out and lse come from these very keys (exact_delta) recomputes delta = rowsum(P * dP)
# in fp32 for query tiles whose rows see at most this many keys; the others take rowsum(dO * O) from
# the saved output, as FA2 and cuDNN do (kernels/attention_bwd.py, "delta", says why and what it costs).
EXACT_DELTA_KEYS = 64


def exact_delta_keys(lay: RowLayout, launch: AttentionLaunch) -> int:
    """The delta kernels' EXACT_KEYS: EXACT_DELTA_KEYS where at least 1/8 of the query rows see at
    most that many keys, else 0 (the exact pass not compiled in: its shared memory slows the delta
    pass of every tile; compiled in, it cost a causal 4k backward 2% on an H200 for the first rows).
    Packed calls are judged by their longest sequences."""
    most = EXACT_DELTA_KEYS
    nq, nk = lay.q_len, lay.k_len
    if most <= 0 or nq <= 0:
        return 0
    if nk <= most or (launch.has_left and launch.has_right and launch.left + launch.right + 1 <= most):
        return most
    diag = nk - nq if launch.bottom_right else 0
    short = 0  # rows that see at most `most` keys: the first under a right bound, the last under a left one
    if launch.has_right:
        short += min(max(most - diag - launch.right, 0), nq)
    if launch.has_left:
        short += min(max(nq - max(nk - most + launch.left - diag, 0), 0), nq)
    return most if 8 * short >= nq else 0


def ds_scales(scale: float) -> tuple[float, float]:
    """(ds scale, post scale) of a backward launch: ds goes to the products times the softmax
    scale, kept at DS_SCALE_FLOOR or more in magnitude (half precision's range: a near-overflow ds
    needs the scale, a tiny scale made it subnormal), and dq/dk are multiplied by the rest in fp32
    (kernels/attention_bwd.py, dkdv_tile)."""
    ds = math.copysign(max(abs(scale), DS_SCALE_FLOOR), scale) if scale else DS_SCALE_FLOOR
    return ds, scale / ds


def _clear_packed_grads(grads: tuple, cu_seqlens_q, cu_seqlens_k) -> tuple:
    """Packed gradients: rows past the last sequence (of q for dq, of k/v for dk/dv) are 0."""
    if cu_seqlens_q is not None:
        dq, dk, dv = grads
        clear_packed_tails((dq, cu_seqlens_q, 0, 0.0), (dk, cu_seqlens_k, 0, 0.0), (dv, cu_seqlens_k, 0, 0.0))
    return grads


def launch_bwd(dout, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               launch: AttentionLaunch, stats: Optional[torch.Tensor] = None, exact_delta: bool = False):
    """Run delta, dk/dv and dq kernels; returns (dq, dk, dv) shaped like q, k, v.
    launch.dq_mode "separate" is the one whose bits do not depend on timing. stats: what
    launch_fwd filled under an additive mask (recomputed probabilities then keep full precision
    under large biases); without it the backward reads lse alone. Packed rows past the last
    sequence get 0. exact_delta: out and lse are these keys' own forward (not a ring step's global
    ones), so delta may be recomputed from q, k, v where a query tile sees few keys (EXACT_DELTA_KEYS)."""
    return _clear_packed_grads(_launch_bwd(dout, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_q, max_seqlen_k, launch, stats, exact_delta),
                               cu_seqlens_q, cu_seqlens_k)


def _launch_bwd(dout, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                launch: AttentionLaunch, stats: Optional[torch.Tensor] = None, exact_delta: bool = False):
    from ..kernels.attention_bwd import (
        attention_bwd_delta_kernel,
        attention_bwd_dkdv_kernel,
        attention_bwd_dq_kernel,
    )

    mode = launch.dq_mode
    atomic = mode != "separate"
    q, k, v = pointer_ready(q), pointer_ready(k), pointer_ready(v)
    dout, out = pointer_ready(dout), pointer_ready(out)
    if mode != "atomic_rotate" and bwd_ws_here(q) and bwd_ws_ok(dout, q, k, v, attn_mask, cu_seqlens_q is not None,
                                                                 launch):
        return _launch_bwd_ws(dout, q, k, v, out, lse, launch, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, exact_delta=exact_delta)
    lay = row_layout(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    (dq, dk, dv), empty = bwd_outputs(q, k, v, lay)
    if empty:
        return dq, dk, dv
    mask, mask_strides, mask_kind = mask_args(attn_mask, lay, q)
    bd, bdv = block_d(lay.head_dim), block_d(lay.value_dim)  # Q/K/dQ/dK tiles; V/O/dO/dV tiles
    cu_q, cu_k = lay.offsets(cu_seqlens_q, cu_seqlens_k, q)
    flags = dict(IS_VARLEN=lay.varlen, BOTTOM_RIGHT=launch.bottom_right, HAS_LEFT=launch.has_left,
                 HAS_RIGHT=launch.has_right, MASK_KIND=mask_kind, DOT_PRECISION=dot_precision(q.dtype))
    lse_st = lse_strides(lse, lay)
    dcfg = INTERPRET_CONFIGS["delta"] if interpreting() else DELTA_CONFIG
    split = {}
    if stats is not None and stats.numel() > 0:
        if stats[0].stride() != lse.stride():
            raise ValueError(f"stats planes must be laid out as lse, got strides {stats[0].stride()} and "
                             f"{lse.stride()}")
        # One int32 flag per (batch, head), raised by the delta kernel where a row needs the split form.
        # float32: every head, from the start. An fp32 lse keeps log2(sum) to 2^-17 of |m|-sized
        # rows, which is 5e-6 of p, far above float32's rounding: its gradients were 5-18x torch's
        # math error at logits x30-100 (the interpreter fuzz, --policy triton).
        marks = (torch.ones if q.dtype == torch.float32 else torch.zeros)(
            lay.batch * lay.q_heads, dtype=torch.int32, device=q.device)
        split = dict(Stats=stats, Flags=marks, SPLIT_STATS=True)
        flags.update(split, stride_ls=stats.stride(0))
    left, right = launch.left, launch.right
    scale, post_scale = ds_scales(launch.scale)

    delta = torch.empty_like(lse)
    # Atomic dq: an fp32 accumulator the delta kernel zeroes (dq itself when it is fp32).
    # Poisoned like an output, so rows the zeroing missed show up as NaN.
    if atomic:
        dq_acc = dq if dq.dtype == torch.float32 else new_output(q.shape, torch.float32, q.device)
        dq_acc_strides = lay.strides(dq_acc)
    else:
        dq_acc, dq_acc_strides = dq, (0, 0, 0)
    exact = {}
    if exact_delta and exact_delta_keys(lay, launch):  # delta = rowsum(P * dP) where a query tile sees few keys
        exact = dict(Q=q, K=k, V=v, LSE=lse, Mask=mask, CuSeqlensK=cu_k, **dict(zip(
            ("stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh",
             "stride_vn", "stride_mb", "stride_mh", "stride_mm", "stride_mn"),
            lay.strides(q) + lay.strides(k) + lay.strides(v) + tuple(mask_strides))),
            kv_group=lay.q_heads // lay.kv_heads, k_len_dense=lay.k_len, scale_log2=launch.scale * LOG2E,
            window_left=left, window_right=right, BLOCK_N=dcfg.block_n, BOTTOM_RIGHT=launch.bottom_right,
            HAS_LEFT=launch.has_left, HAS_RIGHT=launch.has_right, MASK_KIND=mask_kind,
            DOT_PRECISION=flags["DOT_PRECISION"], EXACT_KEYS=exact_delta_keys(lay, launch))
        if split:
            exact["stride_ls"] = stats.stride(0)
    attention_bwd_delta_kernel[(cdiv(lay.q_len, dcfg.block_m), lay.batch * lay.q_heads)](
        out, dout, delta, dq_acc, cu_q, *lay.strides(out), *lay.strides(dout), *lse_st,
        *dq_acc_strides, lay.q_heads, lay.q_len,
        HEAD_DIM=lay.head_dim, BLOCK_D=bd, HEAD_DIM_V=lay.value_dim, BLOCK_DV=bdv,
        BLOCK_M=dcfg.block_m, IS_VARLEN=lay.varlen,
        ZERO_DQ=atomic, num_warps=dcfg.num_warps, num_stages=dcfg.num_stages, **split, **exact,
    )

    dq_acc_dirty = [False]

    def run_dkdv(cfg: KernelConfig):
        grid = (cdiv(lay.k_len, cfg.block_n), lay.batch * lay.kv_heads)
        if atomic and dq_acc_dirty[0]:
            dq_acc.zero_()  # config timing runs the kernel many times; each run adds into dq_acc
        dq_acc_dirty[0] = atomic
        attention_bwd_dkdv_kernel[grid](
            q, k, v, dout, lse, delta, dk, dv, dq_acc, mask, cu_q, cu_k,
            *lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(dout), *lse_st,
            *lay.strides(dk), *lay.strides(dv), *dq_acc_strides, *mask_strides,
            lay.kv_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
            scale, launch.scale * LOG2E, left, right,
            HEAD_DIM=lay.head_dim, BLOCK_D=bd, HEAD_DIM_V=lay.value_dim, BLOCK_DV=bdv,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ATOMIC_DQ=atomic, ROTATE=mode == "atomic_rotate",
            post_scale=post_scale, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
        )

    def run_dq(cfg: KernelConfig):
        grid = (cdiv(lay.q_len, cfg.block_m), lay.batch * lay.q_heads)
        attention_bwd_dq_kernel[grid](
            q, k, v, dout, lse, delta, dq, mask, cu_q, cu_k,
            *lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(dout), *lse_st,
            *lay.strides(dq), *mask_strides,
            lay.q_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
            scale, launch.scale * LOG2E, left, right,
            HEAD_DIM=lay.head_dim, BLOCK_D=bd, HEAD_DIM_V=lay.value_dim, BLOCK_DV=bdv,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, post_scale=post_scale, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **flags,
        )

    mask_elem = mask.element_size() if mask_kind else 0
    key = _shape_key(q, lay, launch, mask_kind, mask_elem)
    kernels = ((("dkdv_atomic" if atomic else "dkdv"), run_dkdv),) + (() if atomic else (("dq", run_dq),))
    for kind, run in kernels:
        candidates = (lambda kind=kind: fitting_configs(kind, bd, q.dtype, q.device, mask_elem, bdv))
        run(CONFIGS.pick(kind, key + ((mode,) if atomic else ()), candidates, run))
    if atomic:  # the kernels add ds k products with ds at the ds scale (attention_bwd.dkdv_tile)
        if dq_acc is dq:
            dq.mul_(post_scale)
        else:
            dq.copy_(dq_acc.mul_(post_scale))
    return dq, dk, dv


def bwd_ws_here(q: torch.Tensor) -> bool:
    """Whether the settings send backward calls on q's device to the warp-specialised kernels where
    bwd_ws_ok: "auto" on Hopper (sm90) with a triton that specialises, "on" everywhere."""
    want = settings.current().bwd_ws
    if want == "auto":
        return (q.is_cuda and not interpreting() and hardware.warp_specialisation_available()
                and hardware.arch("cuda", q.device.index) == "sm90")
    return want == "on"


def descriptor_scope(launch: AttentionLaunch, *tensors) -> bool:
    """What every tensor-descriptor kernel needs of a dense, unmasked call: a positive scale, 16-bit
    inputs, one head dim for all the tensors, and each tensor as a descriptor takes it."""
    d = tensors[0].shape[-1]
    return (launch.scale > 0 and tensors[0].dtype != torch.float32 and all(t.shape[-1] == d for t in tensors)
            and tensor_descriptor() is not None and all(tma_ok(t) for t in tensors))


def bwd_ws_ok(dout, q, k, v, attn_mask, varlen: bool, launch: AttentionLaunch) -> bool:
    """Whether the warp-specialised backward (kernels/attention_bwd_ws.py) takes this call (tensors
    with a unit last stride): dense or packed varlen, no mask, causal or not, a left window only
    under causal, head dim 64 or 128, and descriptor_scope."""
    if attn_mask is not None or q.shape[-1] not in (64, 128):
        return False
    if (launch.has_right and launch.right != 0) or (launch.has_left and not launch.has_right):
        return False
    return descriptor_scope(launch, q, k, v, dout)


def launch_bwd_ws(dout, q, k, v, out, lse, launch: AttentionLaunch, configs: Optional[tuple] = None,
                  warp_spec: bool = True, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                  exact_delta: bool = False):
    """The warp-specialised backward: prep, dk/dv and dq kernels, no atomics (bitwise reproducible).
    Returns (dq, dk, dv). configs: (dkdv, dq) KernelConfigs to run instead of the tuned ones;
    warp_spec: False runs the same loops unspecialised (as the interpreter always does). Packed
    (T, H, D) tensors come with cu_seqlens_q/k and max_seqlen_q/k, and exact_delta, as in launch_bwd."""
    return _clear_packed_grads(_launch_bwd_ws(dout, q, k, v, out, lse, launch, configs, warp_spec, cu_seqlens_q,
                                              cu_seqlens_k, max_seqlen_q, max_seqlen_k, exact_delta),
                               cu_seqlens_q, cu_seqlens_k)


def _launch_bwd_ws(dout, q, k, v, out, lse, launch: AttentionLaunch, configs: Optional[tuple] = None,
                   warp_spec: bool = True, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                   exact_delta: bool = False):
    from ..kernels.attention_bwd_ws import attention_bwd_dkdv_ws_kernel, attention_bwd_dq_ws_kernel

    q, k, v = pointer_ready(q), pointer_ready(k), pointer_ready(v)
    dout, out = pointer_ready(dout), pointer_ready(out)
    lay = row_layout(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    (dq, dk, dv), empty = bwd_outputs(q, k, v, lay)
    if empty:
        return dq, dk, dv
    d = lay.head_dim
    varlen = lay.varlen
    cu_q, cu_k = lay.offsets(cu_seqlens_q, cu_seqlens_k, q)
    stat, pitch, plane = _bwd_stat_planes(out, dout, lse, lay, cu_q,
                                          (q, k, v, cu_k, launch) if exact_delta else None)
    descriptor = tensor_descriptor()
    ensure_triton_allocator()
    group = lay.q_heads // lay.kv_heads
    causal = launch.has_right
    common = dict(HEAD_DIM=d, CAUSAL=causal, BOTTOM_RIGHT=launch.bottom_right, HAS_LEFT=launch.has_left,
                  IS_VARLEN=varlen, DOT_PRECISION=dot_precision(q.dtype), WARP_SPEC=warp_spec and not interpreting())
    scale, post_scale = ds_scales(launch.scale)

    def heads(t, box_rows):
        # Packed tensors go as they are: the kernels make one descriptor per sequence.
        return t if varlen else descriptor(t, list(t.shape), list(t.stride()), [1, 1, box_rows, d])

    def run_dkdv(cfg: KernelConfig):
        attention_bwd_dkdv_ws_kernel[(cdiv(lay.k_len, cfg.block_n), lay.batch * lay.kv_heads)](
            heads(q, cfg.block_m), heads(dout, cfg.block_m),
            descriptor(stat, [2 * plane], [1], [cfg.block_m]), k, v, dk, dv, cu_q, cu_k,
            *lay.strides(q)[1:], *lay.strides(dout)[1:],
            *lay.strides(k), *lay.strides(v), *lay.strides(dk), *lay.strides(dv),
            lay.kv_heads, group, lay.q_len, lay.k_len, pitch, plane, scale, launch.scale * LOG2E, launch.left,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, post_scale=post_scale, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **common,
        )

    def run_dq(cfg: KernelConfig):
        attention_bwd_dq_ws_kernel[(cdiv(lay.q_len, cfg.block_m), lay.batch * lay.q_heads)](
            q, dout, heads(k, cfg.block_n), heads(v, cfg.block_n), stat, dq, cu_q, cu_k,
            *lay.strides(q), *lay.strides(dout), *lay.strides(dq), *lay.strides(k)[1:], *lay.strides(v)[1:],
            lay.q_heads, group, lay.q_len, lay.k_len, pitch, plane, scale, launch.scale * LOG2E, launch.left,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, K_TAIL=varlen or lay.k_len % cfg.block_n != 0,
            post_scale=post_scale, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )

    key = _shape_key(q, lay, launch, MASK_NONE)

    def run_pair():
        for i, (kind, run, written) in enumerate((("dkdv_ws", run_dkdv, dk), ("dq_ws", run_dq, dq))):
            if configs is not None:
                run(configs[i])
            else:
                run(CONFIGS.pick(kind, key, lambda kind=kind: fitting_configs(kind, d, q.dtype, q.device), run,
                                 lambda written=written: written))

    if configs is not None or not warp_spec or launch.dq_mode == "separate" or not gluon_bwd_here(q):
        run_pair()
        return dq, dk, dv

    # Free to add dq atomically: the Gluon backward is timed beside the pair.
    def run(cfg: KernelConfig):
        if cfg.impl == "gluon":
            _run_bwd_gluon(dq, dk, dv, dout, q, k, v, stat, pitch, plane, lay, launch, cfg, cu_q, cu_k)
        else:
            run_pair()

    def pick(gluon: bool) -> KernelConfig:
        if not gluon:
            return BWD_WS_PAIR
        return CONFIGS.pick("bwd_gluon", key,
                            lambda: fitting_configs("bwd_gluon", d, q.dtype, q.device) + [BWD_WS_PAIR], run, lambda: dq)

    run_gluon_first(pick, run, True)
    return dq, dk, dv


def _bwd_stat_planes(out, dout, lse, lay: RowLayout, cu_q, exact: Optional[tuple] = None) -> tuple:
    """The prep kernel's planes of a backward (kernels/attention_bwd_ws.py): (stat, pitch, plane),
    lse in the log2 domain at stat[bh * pitch + row] and delta at stat[plane + bh * pitch + row]. Whole
    128-row tiles (the largest BLOCK_M) per (sequence, head), the longest sequence's length each,
    so a tile's statistics never leave its plane. exact: (q, k, v, cu_k, launch) where delta may be
    recomputed from them (launch_bwd's exact_delta)."""
    from ..kernels.attention_bwd_ws import attention_bwd_ws_prep_kernel

    pitch = cdiv(lay.q_len, 128) * 128
    plane = lay.batch * lay.q_heads * pitch
    stat = torch.empty(2 * plane, dtype=torch.float32, device=out.device)
    extra = {}
    if exact is not None and exact_delta_keys(lay, exact[-1]):
        q, k, v, cu_k, launch = exact
        extra = dict(Q=q, K=k, V=v, CuK=cu_k, **dict(zip(
            ("stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh",
             "stride_vn"), lay.strides(q) + lay.strides(k) + lay.strides(v))),
            kv_group=lay.q_heads // lay.kv_heads, k_len=lay.k_len, scale_log2=launch.scale * LOG2E,
            window_left=launch.left, BLOCK_N=64, CAUSAL=launch.has_right, BOTTOM_RIGHT=launch.bottom_right,
            HAS_LEFT=launch.has_left, DOT_PRECISION=dot_precision(q.dtype), EXACT_KEYS=exact_delta_keys(lay, launch))
    attention_bwd_ws_prep_kernel[(pitch // 64, lay.batch * lay.q_heads)](
        out, dout, lse, stat, cu_q, *lay.strides(out), *lay.strides(dout), *lse_strides(lse, lay),
        lay.q_heads, lay.q_len, pitch, plane, HEAD_DIM_V=lay.head_dim, BLOCK_DV=lay.head_dim, BLOCK_M=64,
        IS_VARLEN=lay.varlen, num_warps=4, **extra,
    )
    return stat, pitch, plane


def _run_bwd_gluon(dq, dk, dv, dout, q, k, v, stat, pitch, plane, lay: RowLayout, launch: AttentionLaunch,
                   cfg: KernelConfig, cu_q=None, cu_k=None) -> None:
    """kernels/attention_bwd_gluon.py into dq, dk, dv (dense or packed with cu_q / cu_k, unit last
    strides) from the prep kernel's planes: one kernel adds dq into a zeroed fp32 accumulator by
    TMA reductions, and dq is converted from it. dq's bits depend on the order of the reductions:
    never for a deterministic launch. P goes through shared memory at head dim 128 (in registers
    it spills), and dq's product runs in two column halves there (fewer live registers; 1-2%
    faster)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..kernels.attention_bwd_gluon import attention_bwd_gluon_kernel

    d, bm, bn = lay.head_dim, cfg.block_m, cfg.block_n
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def desc(t, box):
        if len(box) == 4:
            t = heads_rows(t, lay)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), shared_layout(box, t.dtype))

    packed = {}
    if lay.varlen:  # sequences from cu_q / cu_k; dK and dV at a sequence's end stored by row
        packed = dict(VARLEN=True, CuQ=cu_q, CuK=cu_k, DK=dk, DV=dv, stride_dkn=dk.stride(0),
                      stride_dkh=dk.stride(1), stride_dvn=dv.stride(0), stride_dvh=dv.stride(1))
    scale, post_scale = ds_scales(launch.scale)
    rows, keys = (1, 1, bm, d), (1, 1, bn // 2, d)
    attention_bwd_gluon_kernel[(cdiv(lay.k_len, bn), lay.batch * lay.kv_heads)](
        desc(q, rows), desc(dout, rows), desc(k, keys), desc(v, keys), desc(dk, keys), desc(dv, keys),
        desc(dq_acc, rows), desc(stat, (bm,)), lay.kv_heads, lay.q_heads // lay.kv_heads, lay.q_len, lay.k_len,
        pitch, plane, scale, launch.scale * LOG2E, launch.left, post_scale, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
        STAGES=cfg.num_stages, CAUSAL=launch.has_right, BOTTOM_RIGHT=launch.bottom_right,
        HAS_LEFT=launch.has_left, P_SMEM=d > 64, DQ_SPLIT=2 if d > 64 else 1, num_warps=cfg.num_warps, **packed,
    )
    if post_scale != 1.0:  # one pass: the fp32 product rounds once into dq's dtype
        torch.mul(dq_acc, post_scale, out=dq)
    else:
        dq.copy_(dq_acc)
