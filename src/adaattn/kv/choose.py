"""Which storage each KV head can take: attention's output error per (KV head, storage), measured
on the keys and values a cache would hold, and the storage of fewest bytes within a tolerance.

The error is measured, not modelled: the keys and values are stored and read back exactly as a
cache's append and gather do them (formats.stored_values, bit for bit: pages of `page_size` tokens
with one scale per (page, KV head), keys less their centre; INT4 per token and group), and the
queries attend them in float64 beside the same queries over the unquantized keys and values. A head's error is
||o_storage - o|| / ||o|| over every row of its query group (the per-head figure of MEASURING.md).

Decode queries sit after the cached tokens, so every query row sees every key (no causal mask).
Without queries the keys themselves stand in for them (each KV head's keys as its group's
queries): a proxy that ranks heads by how their keys and values quantize, not a measurement of
the model's own attention; pass the model's queries where they are at hand.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..backends.reference import relative_errors
from ..problem import default_scale
from .formats import INT4_GROUP, STORAGES, stored_values, value_bytes

QUANTIZED = ("int4", "fp8", "int8")  # the storages that quantize, fewest bytes first


def storage_errors(key: torch.Tensor, value: torch.Tensor, query: Optional[torch.Tensor] = None, *,
                   storages: Sequence[str] = QUANTIZED, page_size: int = 64,
                   scale: Optional[float] = None, proxy_rows: int = 64, group_size: int = INT4_GROUP,
                   window: int = 0) -> dict[str, torch.Tensor]:
    """{storage: (Hkv,) float64 tensor}: per KV head, the relative error of attention's output when
    a cache holds `key` (B, Hkv, N, D) and `value` (B, Hkv, N, Dv) in that storage (stored as one
    append, as a prompt is), against the same attention over them unquantized, in float64.

    query: (B, Hq, T, D) rows attending every key (decode steps), Hq a multiple of Hkv; None: the
    last `proxy_rows` keys of each KV head stand in for its group's queries (see the module's
    docstring). scale: the softmax scale (default 1/sqrt(D)). storages: any of "native", "fp8",
    "int8", "int4" ("native": the model dtype's own rounding, zero for float32 keys). group_size:
    INT4's channels per scale; window: INT4's newest tokens kept in the model dtype (kv.cache)."""
    if not isinstance(key, torch.Tensor) or not isinstance(value, torch.Tensor):
        raise TypeError(f"key and value must be tensors, got {type(key).__name__} and {type(value).__name__}")
    if key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key and value must be (B, Hkv, N, D) and (B, Hkv, N, Dv), got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    b, hkv, n, d = key.shape
    if n == 0:
        raise ValueError("key and value hold no token: there is nothing to measure")
    for s in storages:
        if s not in STORAGES:
            raise ValueError(f"storages must be among {STORAGES}, got {s!r}")
    if query is None:
        rows = min(n, max(1, int(proxy_rows)))
        query = key[:, :, n - rows:]
    elif (not isinstance(query, torch.Tensor) or query.dim() != 4 or query.shape[0] != b or query.shape[3] != d
          or query.shape[1] % hkv):
        raise ValueError(f"query must be (B, Hq, T, D) with B={b}, D={d} and Hq a multiple of Hkv={hkv}, got "
                         f"{tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__}")
    scale = default_scale(d) if scale is None else float(scale)
    groups = query.shape[1] // hkv
    q = query.detach().double().reshape(b, hkv, groups * query.shape[2], d)
    k64, v64 = key.detach().double(), value.detach().double()
    exact = _attend(q, k64, v64, scale)
    out = {}
    for s in storages:
        layout = dict(group_size=group_size, window=window if s == "int4" else 0)
        ks = stored_values(key.detach(), s, key.dtype, page_size, centre=True, **layout)
        vs = stored_values(value.detach(), s, key.dtype, page_size, **layout)
        out[s] = relative_errors(_attend(q, ks.double(), vs.double(), scale), exact, dims=(0, 2, 3)).cpu()
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T scale) v, float64, rows of q against every key (B, Hkv, R, D) x (B, Hkv, N, D)."""
    return torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1) @ v


def storage_bytes(storage: str, dtype: torch.dtype, dim: int = 128, group_size: int = INT4_GROUP) -> float:
    """Bytes one stored value takes in `storage`, scales included (cache.value_bytes)."""
    return float(value_bytes(storage, dtype, dim, group_size))


def choose_storages(errors: dict[str, torch.Tensor], tolerance: float, dtype: torch.dtype = torch.bfloat16
                    ) -> list[str]:
    """Per KV head, the storage of fewest bytes whose measured error (storage_errors) is at most
    `tolerance`, the lower error between storages of equal bytes (FP8 and INT8); "native" where no
    measured storage is within it."""
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not tolerance >= 0:
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    if not errors:
        raise ValueError("errors must hold at least one storage's errors (storage_errors' result)")
    heads = {int(e.numel()) for e in errors.values()}
    if len(heads) != 1:
        raise ValueError(f"errors must give one error per KV head for every storage, got sizes {sorted(heads)}")
    chosen = []
    for h in range(heads.pop()):
        fits = [(storage_bytes(s, dtype), float(e[h]), s) for s, e in errors.items() if float(e[h]) <= tolerance]
        chosen.append(min(fits)[2] if fits else "native")
    return chosen
