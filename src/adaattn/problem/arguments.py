"""The checks of a call's arguments that SDPA takes as plain values: layout, window, scale,
dropout_p (numbers as SDPA takes them), and broadcast batch dims; each raises TypeError/ValueError
naming the argument, what it got and what is allowed."""

from __future__ import annotations

import math
import sys

import torch

LAYOUTS = ("bhsd", "bshd")


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


NUMBER = "(a Python or NumPy int or float, or a 0-d tensor, as SDPA takes)"


def sdpa_float(name: str, value: object, allowed: str) -> float:
    """`value` as a Python float, taking what torch's scaled_dot_product_attention takes for its
    float arguments (scale, dropout_p): a Python int or float (bool included), a NumPy integer,
    float or bool scalar, or a 0-d real tensor that does not require grad (read on the host once,
    as SDPA reads it). Refused as SDPA refuses them: a tensor of one element but more dims, a
    tensor that requires grad, a NumPy array, str, Fraction, Decimal; refused here too: complex
    (SDPA drops a NumPy complex's imaginary part). TypeError names `name`, what it got, `allowed`."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not value.requires_grad and not value.is_complex():
            return float(value)
        got = ("a tensor that requires grad" if value.requires_grad else
               f"a complex tensor ({value.dtype})" if value.is_complex() else
               f"a tensor of shape {tuple(value.shape)}")
        raise TypeError(f"{name} must be {allowed} {NUMBER}, got {got}")
    numpy = sys.modules.get("numpy")  # (a NumPy scalar means NumPy is imported; never import it here)
    if numpy is not None and isinstance(value, (numpy.integer, numpy.floating, numpy.bool_)):
        return float(value)
    raise TypeError(f"{name} must be {allowed} {NUMBER}, got {type(value).__name__}")


def check_scale(scale: object) -> float | None:
    if scale is None:
        return None
    if type(scale) is not float:
        scale = sdpa_float("scale", scale, "a float or None")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    return scale


def check_dropout(dropout_p: object) -> float:
    if type(dropout_p) is not float:
        dropout_p = sdpa_float("dropout_p", dropout_p, "a float in [0, 1]")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p!r}")
    return dropout_p


def _broadcastable(shape: tuple, target: tuple) -> bool:
    if len(shape) > len(target):
        return False
    for s, t in zip(reversed(shape), reversed(target)):
        if s != 1 and s != t:
            return False
    return True


def _broadcast(shapes: list[tuple], names: str) -> tuple:
    if all(tuple(s) == tuple(shapes[0]) for s in shapes[1:]):  # the common case, and plain for torch.compile
        return tuple(shapes[0])
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        raise ValueError(f"{names} batch dimensions {', '.join(str(tuple(s)) for s in shapes)} do not broadcast "
                         "against each other") from None
