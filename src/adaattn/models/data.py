"""The corpus every Python install has: its standard library's own .py sources, as bytes.

Files are read in sorted order of their path relative to the stdlib root, joined with a NUL
byte between files (NUL does not occur in source text), and split into train and held-out by
a hash of that relative path, so the split of a file is the same on every machine and
Python version. `site-packages`/`dist-packages` (installed third-party code) are left out.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

SEPARATOR = 0  # byte between files
HELDOUT_FRACTION = 0.1
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative paths (posix) of every .py file under the stdlib, sorted; symlinks not followed."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        rel = Path(folder).relative_to(root)
        for name in files:
            if name.endswith(".py") and not os.path.islink(os.path.join(folder, name)):
                out.append((rel / name).as_posix())
    return sorted(out)


def is_heldout(relpath: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Whether a file is held out: the first 8 bytes of sha256(relpath) as a fraction of 2**64."""
    h = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big")
    return h < fraction * 2**64


@dataclass
class Corpus:
    """train and heldout: 1-D uint8 tensors of bytes; info: where they came from."""

    train: torch.Tensor
    heldout: torch.Tensor
    info: dict = field(default_factory=dict)


@functools.lru_cache(maxsize=4)
def load_corpus(root: str | None = None, heldout_fraction: float = HELDOUT_FRACTION) -> Corpus:
    """Read the stdlib sources once (cached); split by file. About 30 MB on CPython 3.11."""
    base = Path(root) if root is not None else stdlib_root()
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    counts = {False: 0, True: 0}
    digest = hashlib.sha256()
    sep = bytes([SEPARATOR])
    for rel in stdlib_files(base):
        try:
            data = (base / rel).read_bytes()
        except OSError:
            continue
        data = data.replace(sep, b"")
        held = is_heldout(rel, heldout_fraction)
        parts[held].append(data)
        counts[held] += 1
        digest.update(rel.encode() + sep + data + sep)
    train, heldout = (sep.join(parts[h]) + sep for h in (False, True))
    info = {
        "source": "standard library .py files",
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "stdlib_root": str(base),
        "train_files": counts[False],
        "heldout_files": counts[True],
        "train_bytes": len(train),
        "heldout_bytes": len(heldout),
        "heldout_fraction": heldout_fraction,
        "split": "sha256(relative path)[:8] / 2**64 < heldout_fraction",
        "sha256": digest.hexdigest(),
    }
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train), as_tensor(heldout), info)


def windows(data: torch.Tensor, seq_len: int, max_windows: int | None = None, offset: int = 0) -> torch.Tensor:
    """Non-overlapping (W, seq_len + 1) int64 windows of `data` from `offset`, stride seq_len.

    Window w holds bytes [offset + w*seq_len, offset + (w+1)*seq_len]: inputs are [:, :-1],
    targets [:, 1:], so every byte after the first is predicted exactly once.
    Raises ValueError when `data` is shorter than one window.
    """
    usable = (data.numel() - offset - 1) // seq_len
    if usable < 1:
        raise ValueError(f"{data.numel()} bytes from offset {offset} hold no window of {seq_len} + 1")
    count = usable if max_windows is None else min(usable, max_windows)
    starts = offset + torch.arange(count, device=data.device) * seq_len
    idx = starts[:, None] + torch.arange(seq_len + 1, device=data.device)
    return data[idx].long()


def random_batch(data: torch.Tensor, seq_len: int, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (batch, seq_len) int64, at uniform random offsets of `data`.

    `generator` is a CPU generator (the offsets are drawn on the CPU whatever data's device,
    so the same seed gives the same batches everywhere).
    """
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=generator).to(data.device)
    idx = starts[:, None] + torch.arange(seq_len + 1, device=data.device)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def unigram_bits_per_byte(train: torch.Tensor, heldout: torch.Tensor) -> float:
    """Cross-entropy in bits of held-out bytes under train byte frequencies (add-one smoothed)."""
    counts = torch.bincount(train.long().cpu(), minlength=256).double() + 1.0
    logp = torch.log2(counts / counts.sum())
    held = torch.bincount(heldout.long().cpu(), minlength=256).double()
    return float(-(held * logp).sum() / held.sum())
