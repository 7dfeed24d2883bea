"""The shapes a benchmark run covers: the quick and full grids, or one built from options."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
CAUSAL = {"both": (False, True), "no": (False,), "yes": (True,)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Shape:
    """One benchmarked call: (B, H, N, D) query, (B, Hkv, N, D) key and value, Nq = Nk = N."""

    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    dtype: torch.dtype
    causal: bool

    def flops(self, backward: bool = False) -> float:
        """FLOPs as MEASURING.md counts them: 4·B·H·N²·D, halved when causal, 3.5x with backward."""
        fwd = 4.0 * self.batch * self.heads * self.seq_len * self.seq_len * self.head_dim
        if self.causal:
            fwd /= 2
        return fwd * 3.5 if backward else fwd

    @property
    def gqa(self) -> bool:
        return self.kv_heads != self.heads

    def label(self) -> str:
        kv = f"/{self.kv_heads}" if self.gqa else ""
        return (f"B={self.batch} H={self.heads}{kv} N={self.seq_len} D={self.head_dim} "
                f"{dtype_name(self.dtype)}{' causal' if self.causal else ''}")

    def as_dict(self) -> dict:
        return {
            "batch": self.batch, "heads": self.heads, "kv_heads": self.kv_heads,
            "seq_len": self.seq_len, "head_dim": self.head_dim,
            "dtype": dtype_name(self.dtype), "causal": self.causal,
        }


@dataclass(frozen=True)
class Grid:
    """A cross product of options; `shapes()` lists it ordered by dtype, causal, then N."""

    seq_lens: tuple[int, ...]
    batch: int
    heads: int
    kv_heads: int | None  # None: same as heads
    head_dim: int
    dtypes: tuple[torch.dtype, ...]
    causal: str  # a key of CAUSAL

    def shapes(self) -> list[Shape]:
        kv = self.kv_heads or self.heads
        return [
            Shape(self.batch, self.heads, kv, n, self.head_dim, dt, c)
            for dt, c, n in itertools.product(self.dtypes, CAUSAL[self.causal], self.seq_lens)
        ]

    def as_dict(self) -> dict:
        return {
            "seq_lens": list(self.seq_lens), "batch": self.batch, "heads": self.heads,
            "kv_heads": self.kv_heads or self.heads, "head_dim": self.head_dim,
            "dtypes": [dtype_name(d) for d in self.dtypes], "causal": self.causal,
        }


# Small enough that the whole CPU run (table and overhead) ends well inside a minute on 2 cores.
QUICK_CPU = Grid((128, 512, 1024), batch=1, heads=4, kv_heads=None, head_dim=64,
                 dtypes=(torch.float32,), causal="both")
QUICK_CUDA = Grid((1024, 4096), batch=2, heads=16, kv_heads=None, head_dim=128,
                  dtypes=(torch.bfloat16,), causal="both")
# The prefill yardstick of MEASURING.md (without 64k, which `--seq-lens` can add).
FULL = Grid((1024, 4096, 16384), batch=2, heads=16, kv_heads=None, head_dim=128,
            dtypes=(torch.bfloat16,), causal="both")


def base_grid(full: bool, device_type: str) -> Grid:
    if full:
        return FULL
    return QUICK_CUDA if device_type == "cuda" else QUICK_CPU


def override(grid: Grid, **options: object) -> Grid:
    """`grid` with every option that is not None put in its place."""
    return replace(grid, **{k: v for k, v in options.items() if v is not None})


def parse_seq_lens(text: str) -> tuple[int, ...]:
    """'1024,4k,16k' -> (1024, 4096, 16384)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        try:
            n = int(part[:-1] if mult > 1 else part) * mult
        except ValueError:
            raise ValueError(f"sequence lengths are comma-separated integers (4k = 4096), got {text!r}") from None
        if n <= 0:
            raise ValueError(f"sequence lengths must be positive, got {n}")
        out.append(n)
    if not out:
        raise ValueError(f"no sequence length in {text!r}")
    return tuple(dict.fromkeys(out))


def parse_dtypes(text: str) -> tuple[torch.dtype, ...]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if part not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(sorted(DTYPES))}, got {part!r}")
        out.append(DTYPES[part])
    return tuple(dict.fromkeys(out))
