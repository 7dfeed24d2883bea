"""How a KV cache stores a value: the storages, their bytes, and the encoders of the quantized ones
(kv/cache.py's docstring describes the layouts). kernels/kv_append.py encodes alike, bit for bit."""

from __future__ import annotations

import torch

STORAGES = ("native", "fp8", "int8", "int4")
QMAX = {"fp8": 448.0, "int8": 127.0, "int4": 15.0}
PER_PAGE = ("fp8", "int8")  # the storages with one scale per (page, KV head)
INT4_GROUP = 16  # INT4's default group of channels (kv/cache.py's docstring)


def check_layout(storage: str, group_size, window: int, int4: bool) -> None:
    """INT4's group_size (None: the default) and window, checked (a ValueError naming the argument):
    either given only where INT4 pages can be (`int4`: the storage is "int4", "auto", or a storage
    per head with an INT4 head)."""
    if group_size is not None and (not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1):
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    if window and not int4:
        raise ValueError(f"window={window} keeps the newest tokens in the model dtype beside INT4 pages; storage "
                         f"{storage!r} holds none (use storage='int4', or window=0)")
    if group_size is not None and not int4:
        raise ValueError(f"group_size={group_size} sets INT4's channels per scale; storage {storage!r} holds no INT4 "
                         "page")


def check_tolerance(tolerance) -> float:
    """storage="auto"'s tolerance: a number > 0."""
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not tolerance > 0:
        raise ValueError(f"storage='auto' chooses each head's storage under a tolerance: give tolerance > 0, got "
                         f"{tolerance!r}")
    return float(tolerance)


def int4_group(group_size: int, dim: int) -> int:
    """The channels one INT4 scale covers for a head dim of `dim`: the largest power of two up to
    `group_size` that divides `dim` (dim is even, so at least 2)."""
    g = 1 << (int(group_size).bit_length() - 1)
    while dim % g:
        g //= 2
    return g


def value_bytes(storage: str, dtype: torch.dtype, dim: int = 128, group_size: int = INT4_GROUP) -> float:
    """Bytes one stored value takes in `storage`, its scales included: the model dtype's size for
    "native", 1 for FP8 and INT8 (their (page, KV head) scales are a few bytes a page), and for INT4
    half a byte plus 4 bytes (bfloat16 scale and minimum) per group of channels of a `dim` head."""
    if storage == "native":
        return torch.empty((), dtype=dtype).element_size()
    if storage == "int4":
        return 0.5 + 4 / int4_group(group_size, dim)
    return 1.0


def _encode(y: torch.Tensor, storage: str) -> torch.Tensor:
    """Values already in the scale's units (float) to the storage (FP8, INT8; INT4: _int4_encode)."""
    if storage == "fp8":
        return y.clamp(-QMAX["fp8"], QMAX["fp8"]).to(torch.float8_e4m3fn)
    return y.round().clamp(-QMAX["int8"], QMAX["int8"]).to(torch.int8)


def _decode(stored: torch.Tensor, storage: str) -> torch.Tensor:
    """The stored values as float32, in the scale's units (the inverse of _encode; INT4: the codes
    0..15, unpacked)."""
    if storage != "int4":
        return stored.float()
    return torch.stack((stored & 15, stored >> 4), dim=-1).flatten(-2).float()


def _bf16_toward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 `x` rounded to bfloat16 toward +inf (up) or -inf, as bfloat16 (bit arithmetic:
    bfloat16 is float32's upper half). kernels/kv_append.py rounds alike."""
    bits = x.float().contiguous().view(torch.int32)
    magnitude_up = (bits >= 0) == up  # toward +inf grows a positive value's magnitude, toward -inf a negative one's
    bits = torch.where(magnitude_up, (bits + 0xFFFF) & -65536, bits & -65536)
    return bits.view(torch.float32).to(torch.bfloat16)


def _int4_encode(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float to INT4: the packed codes (..., D / 2) uint8 and (..., D / group, 2)
    bfloat16 scale and minimum (module docstring)."""
    y = x.float().unflatten(-1, (-1, group))
    low = _bf16_toward(y.amin(-1), up=False)
    scale = _bf16_toward((y.amax(-1) - low.float()) / 15.0, up=True)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = ((y - low.float()[..., None]) / safe[..., None]).round().clamp(0, 15).flatten(-2).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), torch.stack((scale, low), dim=-1)


def _int4_decode(stored: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse of _int4_encode, float32: code x scale + minimum per group."""
    codes = _decode(stored, "int4").unflatten(-1, (scales.shape[-2], -1))
    sm = scales.float()
    return (codes * sm[..., 0:1] + sm[..., 1:2]).flatten(-2)


def _quantize(x: torch.Tensor, scale: torch.Tensor, storage: str) -> torch.Tensor:
    """x (float) / scale, to the storage dtype (scale broadcast against x)."""
    return _encode(x.float() / scale, storage)


def stored_values(x: torch.Tensor, storage: str, dtype: torch.dtype, page_size: int = 64, *, centre: bool = False,
                  group_size: int = INT4_GROUP, window: int = 0) -> torch.Tensor:
    """What a cache of `storage` reads back (float32, as gather(dtype=float32) does) after one append
    of x (B, H, N, D) to empty sequences: a prompt. centre: keys, stored less their mean over the
    append (per sequence and head) and read back plus it. FP8/INT8: one scale per (page of
    `page_size` tokens, head), amax / QMAX; INT4: per token and group, with the newest `window`
    tokens as they came. The cache's append and gather compute the same, bit for bit (a test
    holds them so); the per-head choice measures on this without making a cache."""
    if storage == "native":
        return x.to(dtype).float()
    b, h, n, d = x.shape
    c = x.float().mean(2, keepdim=True) if centre else torch.zeros((), device=x.device)
    y = x.float() - c  # (B, H, N, D)
    if storage == "int4":
        codes, scales = _int4_encode(y, int4_group(group_size, d))
        out = _int4_decode(codes, scales) + c
        if window:
            out[:, :, n - min(window, n):] = x[:, :, n - min(window, n):].to(dtype).float()
        return out
    pages = -(-n // page_size)
    padded = torch.nn.functional.pad(y, (0, 0, 0, pages * page_size - n)).view(b, h, pages, page_size, d)
    scale = padded.abs().amax((3, 4), keepdim=True) / QMAX[storage]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    stored = _decode(_quantize(padded, safe, storage), storage) * scale
    return stored.view(b, h, pages * page_size, d)[:, :, :n] + c
