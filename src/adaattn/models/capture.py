"""Run the model on held-out text and keep what each layer's attention saw and returned."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from .data import load_corpus, windows
from .gpt import GPT


@dataclass
class LayerCapture:
    """One layer's attention call, all (B, H, N, D) contiguous.

    q: post-RoPE queries (B, Hq, N, D); k: post-RoPE keys (B, Hkv, N, D); v: (B, Hkv, N, D);
    out: the exact attention output the model computed, (B, Hq, N, D). Attention is causal
    with the default scale 1/sqrt(D); Hq > Hkv means grouped-query (enable_gqa=True).
    """

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor

    @property
    def gqa(self) -> bool:
        return self.q.shape[1] != self.k.shape[1]


@dataclass
class Capture:
    """tokens (B, N) int64; layers in order; bits_per_byte of the forward on those tokens."""

    tokens: torch.Tensor
    layers: list[LayerCapture] = field(default_factory=list)
    bits_per_byte: float | None = None
    dtype: torch.dtype = torch.float32


def heldout_tokens(seq_len: int, batch: int = 1, offset: int = 0) -> torch.Tensor:
    """(batch, seq_len + 1) int64 consecutive windows of this machine's held-out stdlib bytes."""
    return windows(load_corpus().heldout, seq_len, batch, offset)


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@torch.no_grad()
def capture(
    model: GPT,
    tokens: torch.Tensor | None = None,
    *,
    seq_len: int = 1024,
    batch: int = 1,
    layers: list[int] | None = None,
    dtype: torch.dtype | None = None,
    offset: int = 0,
) -> Capture:
    """Run `model` and return each layer's post-RoPE Q, K, V and exact attention output.

    tokens: (B, N) int64 inputs; None takes `batch` consecutive windows of length `seq_len`
        from this machine's held-out stdlib text, starting at byte `offset` (and the byte after
        each window as the last target, for bits_per_byte).
    layers: which layers to keep (default all); the others still run.
    dtype: compute dtype; default bfloat16 (autocast) on CUDA, float32 on the CPU.
    The model runs with exact attention (adaattn.attention, default policy) whatever it was set
    to, and is restored afterwards. Tensors stay on the model's device. Comfortable sizes: N up
    to 4096 on the CPU, up to 65536 on one GPU (memory is O(N) per layer kept; the model was
    trained at config.train_seq_len, so beyond it RoPE extrapolates).
    bits_per_byte: the model's cross-entropy on the next byte, over every position that has one.
    Raises ValueError for tokens of the wrong shape or layers out of range.
    """
    device = next(model.parameters()).device
    dtype = dtype or default_dtype(device)
    if tokens is None:
        window = heldout_tokens(seq_len, batch, offset).to(device)
        inputs, targets = window[:, :-1], window[:, 1:]
    else:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a (B, N) int64 tensor, got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}")
        inputs = tokens.to(device)
        targets = torch.cat((inputs[:, 1:], torch.full_like(inputs[:, :1], -100)), dim=1)
    n_layer = model.config.n_layer
    keep = set(range(n_layer)) if layers is None else set(layers)
    bad = [i for i in keep if not 0 <= i < n_layer]
    if bad:
        raise ValueError(f"layers must be in [0, {n_layer}), got {sorted(bad)}")

    kept: dict[int, LayerCapture] = {}

    def record(layer, q, k, v, out):
        if layer in keep:
            kept[layer] = LayerCapture(
                layer, *(t.transpose(1, 2).contiguous() for t in (q, k, v, out))
            )

    before = (model.attention, model.policy, model.training)
    model.set_attention("adaattn", None)
    model.set_recorder(record)
    model.eval()
    try:
        with _autocast(device, dtype):
            logits, _ = model(inputs)
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
    finally:
        model.set_recorder(None)
        model.set_attention(before[0], before[1])
        model.train(before[2])
    bpb = float(loss) / math.log(2) if bool((targets != -100).any()) else None
    return Capture(inputs, [kept[i] for i in sorted(kept)], bpb, dtype)


def _autocast(device: torch.device, dtype: torch.dtype):
    if dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def shipped_model_heads(n: int = 256, layers=(0, 3, 7), device="cpu", dtype=torch.bfloat16):
    """[(name, q, k, v)] from the shipped GPT's layers on held-out text (causal, GQA)."""
    from . import pretrained

    model = pretrained.load(device=device)
    got = capture(model, seq_len=n, layers=list(layers), dtype=torch.float32 if device == "cpu" else dtype)
    return [(f"shipped_model.layer{lc.layer}", lc.q.to(dtype), lc.k.to(dtype), lc.v.to(dtype)) for lc in got.layers]
