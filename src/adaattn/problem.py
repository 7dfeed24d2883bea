"""The frozen facts of one attention call, and the input checks that produce them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LAYOUTS = ("bhsd", "bshd")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Dispatch buckets on max(q_len, kv_len). Under torch.compile(dynamic=True) each bucket
# is one guard range, so a new sequence length recompiles only when it crosses a bucket.
SEQ_BUCKETS = ((1, "decode"), (512, "short"), (8192, "medium"))
LONG_BUCKET = "long"


@dataclass(frozen=True)
class Problem:
    """Shapes and options of one call, in the internal (B, H, N, D) layout."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    device_type: str
    device_index: int | None
    causal: bool
    window: tuple[int | None, int | None] | None
    mask_kind: str  # "none", "bool" or "additive"
    dropout_p: float
    scale: float | None
    needs_grad: bool
    layout: str
    gqa: bool = False  # q_heads != kv_heads, decided once (a plain bool even under torch.compile)
    mask_grad: bool = False  # an additive attn_mask that requires grad (a learned bias)

    @property
    def gqa_groups(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def seq_bucket(self) -> str:
        if self.q_len <= 1:
            return "decode"
        n = max(self.q_len, self.kv_len)
        for limit, name in SEQ_BUCKETS[1:]:
            if n <= limit:
                return name
        return LONG_BUCKET

    @property
    def shape_class(self) -> tuple:
        """What dispatch keys on: everything but exact lengths and batch/head counts."""
        return (
            self.device_type,
            self.dtype,
            self.seq_bucket,
            self.head_dim,
            self.value_dim,
            self.causal,
            self.window is not None,
            self.mask_kind,
            self.gqa,
            self.dropout_p > 0.0,
            self.needs_grad,
            self.mask_grad,
            self.layout,
            self.q_len != self.kv_len,  # backends decline causal/window calls on unequal lengths
            self.q_len == 0 or self.kv_len == 0,  # and empty sequences
        )

    def describe(self) -> str:
        parts = [
            f"B={self.batch} Hq={self.q_heads} Hkv={self.kv_heads} Nq={self.q_len} "
            f"Nk={self.kv_len} D={self.head_dim}",
            str(self.dtype).replace("torch.", ""),
            self.device_type,
        ]
        if self.value_dim != self.head_dim:
            parts.append(f"Dv={self.value_dim}")
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.mask_kind != "none":
            parts.append(f"{self.mask_kind} mask")
        if self.dropout_p:
            parts.append(f"dropout={self.dropout_p}")
        if self.needs_grad:
            parts.append("grad")
        return ", ".join(parts)


def _name(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"Tensor(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device})"
    return type(t).__name__


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


def check_window(window: object) -> tuple[int | None, int | None] | None:
    if window is None:
        return None
    ok = isinstance(window, (tuple, list)) and len(window) == 2
    if ok:
        for w in window:  # type: ignore[union-attr]
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
                ok = False
    if not ok:
        raise ValueError(
            "window must be None or a pair (left, right) of non-negative ints or None "
            f"(None = unbounded on that side), got {window!r}"
        )
    left, right = window  # type: ignore[misc]
    if left is None and right is None:
        return None
    return (left, right)


def check_scale(scale: object) -> float | None:
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale == 0:
        raise ValueError(f"scale must be a finite non-zero float or None, got {scale!r}")
    return float(scale)


def check_dropout(dropout_p: object) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def _broadcastable(shape: tuple, target: tuple) -> bool:
    if len(shape) > len(target):
        return False
    for s, t in zip(reversed(shape), reversed(target)):
        if s != 1 and s != t:
            return False
    return True


def validate(
    query: object,
    key: object,
    value: object,
    attn_mask: object = None,
    dropout_p: object = 0.0,
    is_causal: object = False,
    scale: object = None,
    enable_gqa: object = False,
    layout: object = "bhsd",
    window: object = None,
) -> Problem:
    """Check the arguments of `attention` and return the Problem they describe.

    Tensors are described in the internal (B, H, N, D) layout whatever `layout` says.
    Raises TypeError for arguments of the wrong type and ValueError for wrong values,
    each naming the argument, what it got and what is allowed.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {_name(t)}")
    layout = check_layout(layout)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            want = "(batch, heads, seq, head_dim)" if layout == "bhsd" else "(batch, seq, heads, head_dim)"
            raise ValueError(
                f"{name} must be 4-D {want} for layout={layout!r}, got {t.dim()}-D shape {tuple(t.shape)}"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{name} must have a floating dtype (float16, bfloat16, float32, float64), got {t.dtype}"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}"
        )
    if layout == "bhsd":
        b, hq, nq, d = query.shape
        bk, hk, nk, dk = key.shape
        bv, hv, nv, dv = value.shape
    else:
        b, nq, hq, d = query.shape
        bk, nk, hk, dk = key.shape
        bv, nv, hv, dv = value.shape
    if not (b == bk == bv):
        raise ValueError(f"query, key and value must have the same batch size, got {b}, {bk}, {bv}")
    if dk != d:
        raise ValueError(f"key head_dim must equal query head_dim {d}, got {dk}")
    if nv != nk:
        raise ValueError(f"value seq length must equal key seq length {nk}, got {nv}")
    if hv != hk:
        raise ValueError(f"value heads must equal key heads {hk}, got {hv}")
    if d == 0 or dv == 0:
        raise ValueError(f"head_dim must be positive, got query/key {d} and value {dv}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    gqa = False
    if hk != hq:
        gqa = True
        if not enable_gqa:
            raise ValueError(
                f"key/value heads ({hk}) differ from query heads ({hq}); pass enable_gqa=True for "
                "grouped-query attention"
            )
        if hk == 0 or hq % hk != 0:
            raise ValueError(
                f"query heads ({hq}) must be a multiple of key/value heads ({hk}) for grouped-query attention"
            )
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    dropout = check_dropout(dropout_p)
    scale_f = check_scale(scale)
    win = check_window(window)

    mask_kind = "none"
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {_name(attn_mask)}")
        if attn_mask.dtype == torch.bool:
            mask_kind = "bool"
        elif attn_mask.dtype == query.dtype:
            mask_kind = "additive"
        else:
            raise TypeError(
                f"attn_mask must be bool or the query dtype {query.dtype}, got {attn_mask.dtype}"
            )
        if attn_mask.device != query.device:
            raise ValueError(f"attn_mask must be on the query device {query.device}, got {attn_mask.device}")
        target = (b, hq, nq, nk)
        if not _broadcastable(tuple(attn_mask.shape), target):
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                f"(batch, heads, q_len, k_len) = {target}"
            )

    needs_grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )
    mask_grad = torch.is_grad_enabled() and attn_mask is not None and attn_mask.requires_grad
    return Problem(
        batch=b,
        q_heads=hq,
        kv_heads=hk,
        q_len=nq,
        kv_len=nk,
        head_dim=d,
        value_dim=dv,
        dtype=query.dtype,
        device_type=query.device.type,
        device_index=query.device.index,
        causal=is_causal,
        window=win,
        mask_kind=mask_kind,
        dropout_p=dropout,
        scale=scale_f,
        needs_grad=needs_grad or mask_grad,
        layout=layout,
        gqa=gqa,
        mask_grad=mask_grad,
    )
