"""Score modifiers (soft-capping, sinks, ALiBi slopes): their facts and the checks of each argument
(problem.check_modifiers applies them to a call)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .arguments import _name


@dataclass(frozen=True)
class Modifiers:
    """The score modifiers of one call, applied to each score s = scale * q.k before masking:

    softcap c > 0:   s -> c * tanh(s / c)                      (Gemma 2's logit soft-capping)
    alibi_slopes m:  s -> s - m[b, h] * |i - j|                (ALiBi; positions aligned as the causal
                     mask is: query i at i, or at i + Nk - Nq where the call is bottom-right)
    sinks z:         softmax over the row's keys and one more logit z[h] that carries no value, so
                     out_i = sum_j exp(s_ij) v_j / (exp(z[h]) + sum_j exp(s_ij))   (gpt-oss's s_aux)

    A row with every key masked gives zeros, with or without a sink. A further modifier slots in as
    one more field here, its check in check_modifiers, its term in the reference
    (backends/reference.py) and in the runners that apply it (their `modifiers`)."""

    softcap: float | None = None
    sinks: torch.Tensor | None = None  # (Hq,)
    alibi_slopes: torch.Tensor | None = None  # (Hq,) or (B, Hq)


NO_MODIFIERS = Modifiers()


def check_softcap(softcap: object) -> float | None:
    """softcap as the API takes it (a float > 0, or a 0-d float tensor), as a float; None stays None."""
    if softcap is None:
        return None
    if isinstance(softcap, torch.Tensor) and softcap.dim() == 0 and softcap.is_floating_point():
        softcap = float(softcap)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float > 0 or None, got {_name(softcap)}")
    cap = float(softcap)
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"softcap must be a finite float > 0 (scores become softcap * tanh(s / softcap)), "
                         f"got {softcap}")
    return cap


def check_modifier_tensor(name: str, t: object, device_type: str) -> None:
    """sinks or alibi_slopes: a floating tensor on the query's device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {_name(t)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {t.dtype}")
    if t.device.type != device_type:
        raise ValueError(f"{name} must be on the query's device ({device_type}), got {t.device}")


def check_sinks_shape(sinks: torch.Tensor, heads: int) -> None:
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape (Hq,) = ({heads},): one logit per query head, got "
                         f"{tuple(sinks.shape)}")
