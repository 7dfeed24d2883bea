"""The frozen launch description of our exact Triton kernels, and the facts that choose a variant.

`AttentionLaunch` is built once, when a call is planned (a runner's `prepare`), and holds every
decision a launch needs: the forward variant, the scale, the causal/window sides, the alignment,
the grid order and the backward's dq mode. forward.py and backward.py turn it and the tensors
into strides, grids and configs; no host synchronisation. Custom ops take it as a string
(launch_id / launch_of). Here too: which tensors the descriptor kernels take (descriptor_scope),
whether a launch's forward variant fits the call (check_variant, gluon_varlen_fwd_ok), whether the
warp-specialised backward runs (bwd_ws_here, bwd_ws_ok), and the tuner's shape class (shape_key).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import hardware, settings
from .common import (
    MASK_NONE,
    RowLayout,
    WindowSides,
    block_d,
    gluon_fwd_here,
    interpreting,
    length_bucket,
    tensor_descriptor,
    tma_ok,
)

FWD_VARIANTS = ("ws", "tma", "ptr")
DQ_MODES = settings.DQ_MODES
GRID_ORDERS = settings.GRID_ORDERS


@dataclass(frozen=True)
class AttentionLaunch(WindowSides):
    """Everything a launch of our exact kernels needs beyond the tensors.

    variant: "ws" (warp-specialised, Hopper), "tma" (tensor-descriptor K/V loads) or "ptr".
    window_left / window_right: -1 where unbounded; causal is the right bound 0.
    dq_mode: how the backward makes dq ("separate" is the deterministic, atomic-free one).
    softcap: logit soft-capping c (scores c * tanh(s / c)), 0.0 for none: the pointer kernels only.
    ds_split: the backward's dk and dq products take ds in two roundings (hi + lo), to math's
    accuracy (kernels/attention_bwd.ds_low): the pointer and warp-specialised backward kernels
    (the Gluon backward is then not timed).
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
    softcap: float = 0.0
    ds_split: bool = False

    def __post_init__(self) -> None:
        if self.variant not in FWD_VARIANTS:
            raise ValueError(f"variant must be one of {FWD_VARIANTS}, got {self.variant!r}")
        if self.grid_order not in GRID_ORDERS:
            raise ValueError(f"grid_order must be one of {GRID_ORDERS}, got {self.grid_order!r}")
        if self.dq_mode not in DQ_MODES:
            raise ValueError(f"dq_mode must be one of {DQ_MODES}, got {self.dq_mode!r}")
        if self.exp_fma not in (0, 2, 4):
            raise ValueError(f"exp_fma must be 0, 2 or 4, got {self.exp_fma!r}")
        if not self.softcap >= 0.0:
            raise ValueError(f"softcap must be >= 0 (0: none), got {self.softcap!r}")
        if self.softcap and self.variant != "ptr":
            raise ValueError(f"softcap runs on the ptr variant only, got {self.variant!r}")

def make_launch(variant: str, scale: float, causal: bool, window_left: int = -1, window_right: int = -1,
                bottom_right: bool = False, deterministic: bool = False, softcap: float = 0.0,
                ds_split: bool = False) -> AttentionLaunch:
    """A launch description with the current settings' grid order, exp share and dq mode."""
    current = settings.current()
    return AttentionLaunch(variant, float(scale), bool(causal), bool(bottom_right), int(window_left),
                           int(window_right), current.fwd_grid, int(current.exp_fma),
                           "separate" if deterministic else current.dq, float(softcap), bool(ds_split))


# Custom ops take plain arguments: a launch description travels as a string of its fields
# (made in traced code without locks or global state; parsed once per distinct string).
_parsed: dict[str, AttentionLaunch] = {}


def launch_id(launch: AttentionLaunch) -> str:
    """The launch description as the custom ops take it (launch_of turns it back)."""
    return (f"{launch.variant},{launch.scale!r},{int(launch.causal)},{int(launch.bottom_right)},"
            f"{launch.window_left},{launch.window_right},{launch.grid_order},{launch.exp_fma},{launch.dq_mode},"
            f"{launch.softcap!r},{int(launch.ds_split)}")


def launch_of(key: str) -> AttentionLaunch:
    got = _parsed.get(key)
    if got is None:
        v, scale, causal, bottom_right, left, right, grid, exp_fma, dq, softcap, ds_split = key.split(",")
        got = _parsed[key] = AttentionLaunch(v, float(scale), causal == "1", bottom_right == "1", int(left),
                                             int(right), grid, int(exp_fma), dq, float(softcap), ds_split == "1")
    return got


def shape_key(q, lay: RowLayout, launch: AttentionLaunch, mask_kind, mask_elem=0) -> tuple:
    return (q.device.type, q.device.index, q.dtype, lay.head_dim, lay.value_dim, lay.varlen, launch.causal,
            launch.bottom_right, launch.has_left, launch.window_right >= 0, mask_kind, mask_elem,
            lay.q_heads != lay.kv_heads, length_bucket(lay.q_len), length_bucket(lay.k_len)) + (
                ("softcap",) if launch.softcap else ()) + (("ds_split",) if launch.ds_split else ())


def descriptor_scope(launch: AttentionLaunch, *tensors) -> bool:
    """What every tensor-descriptor kernel needs of a dense, unmasked call: a positive scale, 16-bit
    inputs, one head dim for all the tensors, and each tensor as a descriptor takes it."""
    d = tensors[0].shape[-1]
    return (launch.scale > 0 and tensors[0].dtype != torch.float32 and all(t.shape[-1] == d for t in tensors)
            and tensor_descriptor() is not None and all(tma_ok(t) for t in tensors))


def gluon_varlen_fwd_ok(q, k, v, out, lay: RowLayout, launch: AttentionLaunch, mask_kind: int) -> bool:
    """Whether the Gluon forward takes a packed call: on Hopper (gluon_fwd_here), no mask, head dim
    64 or 128 for Q, K and V, no right bound past the causal one, and descriptor_scope."""
    return (lay.varlen and mask_kind == MASK_NONE and lay.head_dim in (64, 128) and launch.right == 0
            and gluon_fwd_here(q) and descriptor_scope(launch, q, k, v, out))


def check_variant(launch: AttentionLaunch, lay: RowLayout, q, k, v, mask_kind: int) -> None:
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


def bwd_ws_here(q: torch.Tensor) -> bool:
    """Whether the settings send backward calls on q's device to the warp-specialised kernels where
    bwd_ws_ok: "auto" on Hopper (sm90) with a triton that specialises, "on" everywhere."""
    want = settings.current().bwd_ws
    if want == "auto":
        return (q.is_cuda and not interpreting() and hardware.warp_specialisation_available()
                and hardware.arch("cuda", q.device.index) == "sm90")
    return want == "on"


def bwd_ws_ok(dout, q, k, v, attn_mask, varlen: bool, launch: AttentionLaunch) -> bool:
    """Whether the warp-specialised backward (kernels/attention_bwd_ws.py) takes this call (tensors
    with a unit last stride): dense or packed varlen, no mask, causal or not, a left window only
    under causal, head dim 64 or 128, and descriptor_scope."""
    if attn_mask is not None or q.shape[-1] not in (64, 128) or launch.softcap:
        return False
    if (launch.has_right and launch.right != 0) or (launch.has_left and not launch.has_right):
        return False
    return descriptor_scope(launch, q, k, v, dout)
