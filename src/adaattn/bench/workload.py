"""`--workload gpt`: inputs captured from the shipped GPT on held-out text instead of torch.randn."""

from __future__ import annotations

from pathlib import Path

import torch

from .grid import Grid, Shape
from .suite import Case

WORKLOADS = ("random", "gpt")
HOW = ("q, k, v are a layer's post-RoPE queries, keys and values from adaattn.models.capture: the shipped "
       "byte-level GPT (or --weights) run with exact attention on `batch` consecutive windows of N bytes of "
       "this machine's held-out stdlib sources, in the grid's dtype (bf16/fp16 by autocast). Attention is "
       "causal in the model; non-causal rows reuse the same inputs.")


def parse_layers(text: str, n_layer: int) -> list[int]:
    """'ends' (first, middle, last), 'all', or comma-separated indices (negative counts from the end)."""
    text = text.strip().lower()
    if text == "all":
        return list(range(n_layer))
    if text == "ends":
        return sorted({0, n_layer // 2, n_layer - 1})
    out = []
    for part in text.split(","):
        try:
            i = int(part)
        except ValueError:
            raise ValueError(f"--gpt-layers takes 'ends', 'all' or layer indices, got {text!r}") from None
        if not -n_layer <= i < n_layer:
            raise ValueError(f"--gpt-layers: layer {i} out of range for a model of {n_layer} layers")
        out.append(i % n_layer)
    return sorted(set(out))


def gpt_cases(grid: Grid, device: torch.device, weights: Path | None, layers: str) -> tuple[list[Case], dict]:
    """One case per (dtype, causal, N, layer) of `grid`, with inputs captured from the model.

    The model sets heads, kv heads and head dim; the grid sets N, batch, dtypes and causal.
    Returns the cases and facts for the record (weights, model, layers, capture bits per byte).
    Raises FileNotFoundError where there are no weights, ValueError for bad layers.
    """
    from ..models import capture, load
    from ..models.pretrained import DEFAULT_WEIGHTS

    model = load(weights, device)
    cfg = model.config
    chosen = parse_layers(layers, cfg.n_layer)
    captured: dict = {}
    info = {"workload": "gpt", "weights": str(weights or DEFAULT_WEIGHTS), "model": cfg.as_dict(),
            "layers": chosen, "how": HOW, "capture_bits_per_byte": {}}
    cases = []
    for dtype in grid.dtypes:
        for n in grid.seq_lens:
            cap = capture(model, seq_len=n, batch=grid.batch, layers=chosen, dtype=dtype)
            info["capture_bits_per_byte"][f"{str(dtype).replace('torch.', '')}/{n}"] = cap.bits_per_byte
            for lc in cap.layers:
                captured[(dtype, n, lc.layer)] = tuple(t.to(dtype) for t in (lc.q, lc.k, lc.v))
    from .grid import CAUSAL

    for dtype in grid.dtypes:
        for causal in CAUSAL[grid.causal]:
            for n in grid.seq_lens:
                for layer in chosen:
                    shape = Shape(grid.batch, cfg.n_head, cfg.n_kv_head, n, cfg.head_dim, dtype, causal)
                    cases.append(Case(shape, _maker(captured[(dtype, n, layer)]), {"workload": "gpt", "layer": layer}))
    del model
    return cases, info


def _maker(qkv: tuple[torch.Tensor, ...]):
    def make(device: torch.device, requires_grad: bool) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device).detach().requires_grad_(requires_grad) for t in qkv)

    return make
