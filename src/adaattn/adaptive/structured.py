"""A structured set of attention inputs where quantization breaks or shines.

Each case is one (q, k, v) with several heads, every head built to stress one thing:

- "random":        q, k, v standard normal: diffuse attention, the usual benchmark input.
- "outlier_channels": a few channels of Q and K 30x larger than the rest (as in LLM
                   activations): per-block INT8 scales spend their range on the outliers.
- "large_logits":  Q and K scaled so |q.k| * scale reaches tens: near-hard attention where a
                   small score error moves a lot of probability.
- "one_hot":       every query aligned with one key (near-one-hot attention rows).
- "large_v_mean":  V with a mean 20x its spread: the output is mostly the mean, which V
                   smoothing keeps exact and plain FP8 V would blur.
- "k_mean":        K with a large common offset per channel: what K smoothing is for.
- extra cases, such as Q/K/V captured from the shipped GPT (adaattn.models.capture.
                   shipped_model_heads): real attention heads (GQA 6/2, D=64, causal).

`cases(...)` yields (name, q, k, v, causal); the test suite holds every head that adaattn
reports as quantized to its tolerance against float64, on each case.
"""

from __future__ import annotations


import torch
from ..problem import default_scale

KINDS = ("random", "outlier_channels", "large_logits", "one_hot", "large_v_mean", "k_mean")


def make(kind: str, batch: int = 1, heads: int = 4, n: int = 128, d: int = 64, dtype=torch.bfloat16,
         device="cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) (B, H, N, D) in dtype for one kind of structure (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    g = torch.Generator(device="cpu").manual_seed(seed * 1000 + KINDS.index(kind))
    shape = (batch, heads, n, d)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    if kind == "outlier_channels":
        ch = torch.randperm(d, generator=g)[:3]
        q[..., ch] *= 30.0
        k[..., ch] *= 30.0
        q, k = q / 4.0, k / 4.0  # keep logits in a realistic range despite the outliers
    elif kind == "large_logits":
        q, k = q * 3.0, k * 3.0  # |q.k| / sqrt(d) ~ 9 typical, tails to ~40
    elif kind == "one_hot":
        target = torch.randint(0, n, (batch, heads, n), generator=g)
        q = k.gather(2, target[..., None].expand(shape)) * 1.5 + 0.1 * q
    elif kind == "large_v_mean":
        v = v + 20.0 * torch.randn((batch, heads, 1, d), generator=g, dtype=torch.float64)
    elif kind == "k_mean":
        k = k + 10.0 * torch.randn((batch, heads, 1, d), generator=g, dtype=torch.float64)
    return tuple(t.to(dtype).to(device) for t in (q, k, v))


def cases(n: int = 128, d: int = 64, heads: int = 4, dtype=torch.bfloat16, device="cpu", seed: int = 0,
          extra=()):
    """Every structured case: (name, q, k, v, causal), then each (name, q, k, v) of `extra`
    (causal), e.g. adaattn.models.capture.shipped_model_heads(...): the library does not load
    the shipped model itself."""
    for i, kind in enumerate(KINDS):
        q, k, v = make(kind, 1, heads, n, d, dtype, device, seed)
        yield kind, q, k, v, bool(i % 2)
    for name, q, k, v in extra:
        yield name, q, k, v, True


def scale_for(d: int) -> float:
    return default_scale(d)
