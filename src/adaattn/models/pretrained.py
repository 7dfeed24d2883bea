"""Weights on disk: int8 with one scale per row (or bf16/fp32), loaded with nothing but this repo."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..policy import Policy
from .gpt import GPT, GPTConfig

FORMAT = "adaattn-gpt/1"
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_WEIGHTS = WEIGHTS_DIR / "gpt_stdlib.pt"
LONG_WEIGHTS = WEIGHTS_DIR / "gpt_stdlib_32k.pt"  # trained at context 32768 (weights/README.md)
STORAGE = ("int8", "bf16", "fp32")


def _quantize_rows(w: torch.Tensor) -> dict:
    """Symmetric int8 per output row: w ~ q * scale[:, None], |q| <= 127."""
    w = w.detach().float().cpu()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"q": q, "scale": scale}


def state_for_storage(model: GPT, storage: str = "int8") -> dict[str, object]:
    """The model's tensors as stored: matrices in `storage`, vectors (norm weights) in float32."""
    if storage not in STORAGE:
        raise ValueError(f"storage must be one of {STORAGE}, got {storage!r}")
    out: dict[str, object] = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if t.dim() == 2 and storage == "int8":
            out[name] = _quantize_rows(t)
        elif t.dim() == 2 and storage == "bf16":
            out[name] = t.to(torch.bfloat16)
        else:
            out[name] = t.float()
    return out


def save(model: GPT, path: str | os.PathLike, storage: str = "int8", meta: dict | None = None) -> Path:
    """Write the model's config and weights to `path` (torch.save of plain tensors and dicts).

    meta: JSON-like facts kept beside the weights (the command, corpus, held-out bits per byte).
    Returns the path. int8 keeps one float32 scale per matrix row.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "format": FORMAT,
        "config": model.config.as_dict(),
        "storage": storage,
        "tensors": state_for_storage(model, storage),
        "meta": _plain(meta),
    }
    torch.save(record, path)
    return path


def _plain(meta: dict | None) -> dict:
    """JSON-like values only (str subclasses such as torch.__version__ become str), so that
    torch.load(weights_only=True) reads the file back."""
    return json.loads(json.dumps(dict(meta or {}), default=str))


def _dequantize(entry: object) -> torch.Tensor:
    if isinstance(entry, dict):
        return entry["q"].float() * entry["scale"].float()[:, None]
    return entry.float()


def read(path: str | os.PathLike | None = None) -> dict:
    """The stored record: format, config, storage, tensors, meta. Raises FileNotFoundError, ValueError."""
    path = Path(path) if path is not None else DEFAULT_WEIGHTS
    if not path.is_file():
        hint = ""
        if path.parent == WEIGHTS_DIR:
            hint = (": the shipped checkpoints are in the source repository (src/adaattn/models/weights/), not in an "
                    "installed wheel. Run from a source checkout (./install.sh, an editable install), or pass "
                    "--weights PATH (adaattn eval) / load(PATH) with a copy of the file")
        raise FileNotFoundError(f"no model weights at {path}{hint}")
    record = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{path} is not an adaattn GPT weights file (format {FORMAT})")
    return record


def update_meta(path: str | os.PathLike, meta: dict) -> None:
    """Replace the facts stored beside the weights at `path`, leaving the tensors as they are."""
    record = read(path)
    record["meta"] = _plain(meta)
    torch.save(record, Path(path))


def load(
    path: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    *,
    policy: Policy | None = None,
    attention: str = "adaattn",
) -> GPT:
    """The GPT stored at `path` (default: the shipped weights), float32 on `device`, in eval mode.

    Its attention is adaattn.attention with `policy` (None: exact), or torch SDPA with
    attention="sdpa". `model.meta` holds what was stored beside the weights.
    Raises FileNotFoundError where there is no file and ValueError for another format.
    """
    record = read(path)
    config = GPTConfig.from_dict(record["config"])
    model = GPT(config, policy=policy, attention=attention)
    state = {name: _dequantize(t) for name, t in record["tensors"].items()}
    model.load_state_dict(state)
    model.meta = dict(record.get("meta") or {})
    model.meta.setdefault("storage", record.get("storage"))
    return model.to(device).eval()
