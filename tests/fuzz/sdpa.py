"""Fuzz adaattn.attention against a float64 softmax written here, with torch SDPA as the yardstick.

Each configuration comes from its own seeded RNG (seed, index), so one line repeats it:

    python -m tests.fuzz --device cuda --seed 7 --only 1234

A configuration draws dtypes, head dims 8-256 (Dv != D too), lengths 0-300 (q_len != k_len; a
few longer ones reach the runners of the medium bucket), GQA, causal and windows, bool and
additive masks of every broadcast shape (finfo.min, -inf, -1e4, fully masked rows; float32 masks
with half queries), tensor views (transposed, last-dimension slices at odd offsets, strided,
expanded, permuted, misaligned bases), layout="bshd", 2- to 5-D inputs, an explicit scale,
dropout 0, gradients (the mask's too). With --modifiers each configuration also draws score
modifiers (softcap, sinks, alibi_slopes; their gradients too), from an RNG of its own so the
rest of the draw is the plain one's; torch has no SDPA with them, so the yardstick is the
models' eager attention at the input dtype. The standard is MEASURING.md's:

    err(x) = ||x - ref64|| / ||ref64||,  pass if err(ours) <= 2 err(torch) + 1e-6

for the output and every gradient, torch being F.scaled_dot_product_attention at the input
dtype on the same tensors (causal and windows folded into a mask where SDPA cannot take them).
A fallback warning from adaattn on these legal inputs is a finding too. A CUDA fault kills the
process's context: the driver then reruns the remaining configurations in a fresh process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}
VIEWS = ("contiguous", "contiguous", "contiguous", "seq_head_swapped", "last_transposed", "slice_odd",
         "strided", "expanded", "permuted", "offset_base")
HEAD_DIMS = (8, 16, 32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 192, 256)
FAULT_WORDS = ("CUDA error", "illegal memory access", "misaligned address", "device-side assert",
               "CUBLAS_STATUS", "cudaError", "unspecified launch failure")


@dataclass
class Config:
    index: int
    seed: int
    dtype: str
    rank: int  # 2..5, of the tensors in bhsd order
    batch: tuple  # leading dims before the heads (rank - 3 of them)
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    causal: bool
    window: tuple | None
    scale: float | None
    layout: str
    enable_gqa: bool
    views: tuple  # one of VIEWS for q, k, v
    mask: str  # none, bool, additive
    mask_shape: tuple
    mask_fill: str  # -inf, finfo.min, -1e4 (additive masks)
    mask_dtype: str | None
    mask_dead_rows: bool
    mask_view: str  # contiguous, transposed, expanded, offset_base
    mask_grad: bool
    grad: bool
    logit_scale: float  # multiplies q: large logits
    pass_dropout: bool
    policy: str = "default"
    softcap: float | None = None  # score modifiers (--modifiers)
    sinks: bool = False
    alibi: bool = False
    kv_batch: tuple | None = None  # (--broadcast) the key's and value's leading dims, 1 where they broadcast
    q_batch: tuple | None = None  # (--broadcast) the query's, 1 where it broadcasts against the key's

    @property
    def modified(self) -> bool:
        return self.softcap is not None or self.sinks or self.alibi

    def repro(self, device: str) -> str:
        return (f"python -m tests.fuzz --device {device} --seed {self.seed} --only {self.index}"
                + (f" --policy {self.policy}" if self.policy != "default" else "")
                + (" --modifiers" if self.modified else "")
                + (" --broadcast" if self.kv_batch is not None or self.q_batch is not None else ""))


def draw(seed: int, index: int, device: str, policy: str = "default", max_len: int = 300,
         modifiers: bool = False, broadcast: bool = False) -> Config:
    """The configuration (seed, index): its own RNG, so any one can be rerun alone. With
    `modifiers`, score modifiers from a second RNG of its own (the rest is the plain draw); with
    `broadcast`, key and value leading dims of 1 against the query's (SDPA broadcasts them), from a
    third."""
    rng = random.Random(seed * 1_000_003 + index)
    interp = policy == "triton" and device == "cpu"
    dtype = rng.choice(["float16", "bfloat16", "float32"] * 3 + ["float64"])
    rank = rng.choice([2, 3, 4, 4, 4, 4, 5])
    heads = rank >= 3
    kv_heads = rng.choice([1, 2, 4]) if heads else 1
    groups = rng.choice([1, 1, 2, 4]) if heads else 1
    enable_gqa = groups > 1 or (heads and rng.random() < 0.1)
    if interp:
        max_len = min(max_len, 40)

    def length(most):  # log-uniform: short edge cases often, up to `most`
        return min(most, int(math.exp(rng.uniform(0.0, math.log(most + 1)))))

    if rng.random() < 0.1:
        q_len = rng.choice([0, 1])
    elif rng.random() < 0.04 and not interp and device == "cuda":
        q_len = rng.randint(513, 1100)  # the medium bucket: our Triton runners on CUDA
    else:
        q_len = length(max_len)
    if rng.random() < 0.5:
        kv_len = q_len
    elif rng.random() < 0.1:
        kv_len = rng.choice([0, 1])
    else:
        kv_len = length(max(max_len, q_len))
    if rng.random() < 0.8:
        head_dim = rng.choice(HEAD_DIMS)
    else:
        head_dim = rng.randint(8, 256)
    value_dim = head_dim if rng.random() < 0.75 else rng.choice(HEAD_DIMS + (rng.randint(8, 256),))
    if interp:
        head_dim, value_dim = min(head_dim, 128), min(value_dim, 128)
    batch = tuple(rng.randint(1, 3) for _ in range(max(rank - 3, 0)))
    causal = rng.random() < 0.3
    window = None
    if rng.random() < 0.2:
        window = (rng.choice([None, 0, 1, rng.randint(0, 64)]), rng.choice([None, 0, 1, rng.randint(0, 64)]))
        if window == (None, None):
            window = (rng.randint(0, 32), None)
    scale = None if rng.random() < 0.7 else rng.choice([0.0, -0.5, rng.uniform(0.01, 2.0)])
    layout = "bshd" if heads and rng.random() < 0.25 else "bhsd"
    views = tuple(rng.choice(VIEWS) for _ in range(3))
    mask = rng.choice(["none", "none", "bool", "additive"])
    q_heads = kv_heads * groups if heads else 1
    lead = batch + ((q_heads,) if heads else ())
    target = lead + (q_len, kv_len)
    mask_rank = rng.randint(2, len(target))
    mask_shape = tuple(d if rng.random() < 0.6 else 1 for d in target[len(target) - mask_rank:-2]) + (
        q_len if rng.random() < 0.85 else 1, kv_len if rng.random() < 0.95 else 1)
    mask_fill = rng.choice(["-inf", "finfo.min", "-1e4"])
    mask_dtype = None
    if mask == "additive":
        mask_dtype = dtype if rng.random() < 0.7 else "float32"
    grad = rng.random() < 0.4
    return Config(
        index=index, seed=seed, dtype=dtype, rank=rank, batch=batch, q_heads=q_heads, kv_heads=kv_heads,
        q_len=q_len, kv_len=kv_len, head_dim=head_dim, value_dim=value_dim, causal=causal, window=window,
        scale=scale, layout=layout, enable_gqa=enable_gqa, views=views, mask=mask, mask_shape=mask_shape,
        mask_fill=mask_fill, mask_dtype=mask_dtype, mask_dead_rows=rng.random() < 0.3,
        mask_view=rng.choice(["contiguous", "contiguous", "transposed", "expanded", "offset_base"]),
        mask_grad=mask == "additive" and mask_fill != "-inf" and rng.random() < 0.3,
        grad=grad, logit_scale=rng.choice([1.0] * 8 + [30.0, 100.0]), pass_dropout=rng.random() < 0.3,
        policy=policy, **(_draw_modifiers(seed, index) if modifiers else {}),
        **(_draw_broadcast(seed, index, batch) if broadcast else {}),
    )


def _draw_broadcast(seed: int, index: int, batch: tuple) -> dict:
    """Leading dims that broadcast: each dim above 1 made 1 at even odds (at least one where any is
    above 1), on the key's side three times in four, else on the query's (the output keeps `batch`);
    {} where nothing can broadcast (the plain draw's shapes)."""
    m = random.Random(seed * 1_000_003 + index + 0xB0C)
    wide = [i for i, n in enumerate(batch) if n > 1]
    if not wide:
        return {}
    ones = {i for i in wide if m.random() < 0.5} or {m.choice(wide)}
    kv_side = {i for i in ones if m.random() < 0.75}
    shrink = lambda side: tuple(1 if i in side else n for i, n in enumerate(batch))  # noqa: E731
    return {"kv_batch": shrink(kv_side) if kv_side else None, "q_batch": shrink(ones - kv_side) if ones - kv_side
            else None}


def _draw_modifiers(seed: int, index: int) -> dict:
    m = random.Random(seed * 1_000_003 + index + 0x5EED)
    softcap = m.choice([None, None, 0.5, 2.0, 20.0])
    sinks, alibi = m.random() < 0.5, m.random() < 0.4
    if softcap is None and not sinks and not alibi:
        softcap = 5.0
    return dict(softcap=softcap, sinks=sinks, alibi=alibi)


def _leaf_view(shape: tuple, dtype, device, view: str, gen: torch.Generator, rng: random.Random, scale=1.0):
    """(leaf, view): a leaf tensor and a view of it of `shape` in the memory form `view`."""
    def randn(*s):
        return (torch.randn(*s, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)

    n = len(shape)
    if view == "seq_head_swapped" and n >= 3:
        leaf = randn(*shape[:-3], shape[-2], shape[-3], shape[-1])
        return leaf, leaf.transpose(-3, -2)
    if view == "last_transposed" and n >= 2:
        leaf = randn(*shape[:-2], shape[-1], shape[-2])
        return leaf, leaf.transpose(-1, -2)
    if view == "slice_odd":
        off = rng.randint(1, 7)
        leaf = randn(*shape[:-1], shape[-1] + off + rng.randint(0, 3))
        return leaf, leaf[..., off:off + shape[-1]]
    if view == "strided" and n >= 2:
        leaf = randn(*shape[:-2], 2 * shape[-2], shape[-1])
        return leaf, leaf[..., ::2, :]
    if view == "expanded" and n >= 3:
        leaf = randn(1, *shape[1:])
        return leaf, leaf.expand(*shape)
    if view == "permuted" and n >= 3:
        perm = list(range(n))
        rng.shuffle(perm)
        leaf = randn(*[shape[p] for p in perm])
        inverse = [perm.index(i) for i in range(n)]
        return leaf, leaf.permute(*inverse)
    if view == "offset_base":
        off = rng.randint(1, 7)
        leaf = randn(math.prod(shape) + off)
        return leaf, leaf[off:].view(shape)
    leaf = randn(*shape)
    return leaf, leaf


def _mask_values(config: Config, gen: torch.Generator, rng: random.Random, device) -> torch.Tensor | None:
    if config.mask == "none":
        return None
    shape = config.mask_shape
    keep = torch.rand(*shape, generator=gen, dtype=torch.float64) < rng.uniform(0.2, 0.95)
    if config.mask_dead_rows and shape[-2] > 0:
        dead = torch.rand(*shape[:-1], generator=gen, dtype=torch.float64) < 0.25
        keep = keep & ~dead[..., None]
    if config.mask == "bool":
        values = keep
    else:
        dtype = DTYPES[config.mask_dtype]
        fill = {"-inf": -math.inf, "finfo.min": torch.finfo(dtype).min, "-1e4": -1e4}[config.mask_fill]
        values = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).masked_fill(~keep, fill)
    view = config.mask_view
    if view == "transposed" and len(shape) >= 2:
        return values.transpose(-1, -2).contiguous().to(device).transpose(-1, -2)
    if view == "expanded" and len(shape) >= 3 and shape[0] > 1:
        return values[:1].to(device).expand(*shape)
    if view == "offset_base" and values.numel() > 0:
        off = rng.randint(1, 7)
        base = torch.empty(values.numel() + off, dtype=values.dtype, device=device)
        base[off:] = values.reshape(-1).to(device)
        return base[off:].view(shape)
    return values.to(device)


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    grad_out: torch.Tensor | None
    sinks: torch.Tensor | None = None  # (Hq,), --modifiers
    slopes: torch.Tensor | None = None  # (Hq,) ALiBi slopes

    def modifiers(self) -> tuple:
        """(sinks, slopes): what fn(q, k, v, mask, sinks, slopes) takes besides the tensors."""
        return self.sinks, self.slopes


def build(config: Config, device: str) -> Inputs:
    """The configuration's tensors, in the layout the call takes."""
    rng = random.Random(config.seed * 7_919 + config.index)
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + config.index)
    dtype = DTYPES[config.dtype]
    heads = config.rank >= 3
    lead_q = (config.q_batch or config.batch) + ((config.q_heads,) if heads else ())
    lead_k = (config.kv_batch or config.batch) + ((config.kv_heads,) if heads else ())

    def shape(lead, n, d):
        s = lead + (n, d)
        if config.layout == "bshd":
            s = s[:-3] + (s[-2], s[-3], s[-1])
        return s

    qs, ks, vs = (shape(lead_q, config.q_len, config.head_dim), shape(lead_k, config.kv_len, config.head_dim),
                  shape(lead_k, config.kv_len, config.value_dim))
    ql, q = _leaf_view(qs, dtype, device, config.views[0], gen, rng, config.logit_scale)
    kl, k = _leaf_view(ks, dtype, device, config.views[1], gen, rng)
    vl, v = _leaf_view(vs, dtype, device, config.views[2], gen, rng)
    mask = _mask_values(config, gen, rng, device)
    if config.grad:
        for t in (ql, kl, vl):
            t.requires_grad_(True)
        q, k, v = _reapply(ql, q), _reapply(kl, k), _reapply(vl, v)
    grad_out = None
    if config.grad or config.mask_grad:
        empty = config.q_len == 0 or config.kv_len == 0  # (the query's own leading dims then: reference)
        lead = (config.q_batch or config.batch) if empty else config.batch
        out_shape = lead + ((config.q_heads,) if heads else ()) + (config.q_len, config.value_dim)
        if config.layout == "bshd":
            out_shape = out_shape[:-3] + (out_shape[-2], out_shape[-3], out_shape[-1])
        grad_out = torch.randn(*out_shape, generator=gen, dtype=torch.float64).to(dtype).to(device)
    if config.mask_grad and mask is not None:
        mask = mask.detach().requires_grad_(True) if mask._base is None else _mask_leaf(mask)
    sinks = slopes = None
    if config.modified:  # a generator of their own: the plain draw's tensors stay what they were
        gm = torch.Generator().manual_seed(config.seed * 1_000_003 + config.index + 0x5EED)
        sinks = (torch.randn(config.q_heads, generator=gm, dtype=torch.float64) * 2).to(dtype).to(device)
        slopes = (torch.rand(config.q_heads, generator=gm, dtype=torch.float64) * 0.3).to(dtype).to(device)
        sinks = sinks.requires_grad_(config.grad) if config.sinks else None
        slopes = slopes.requires_grad_(config.grad) if config.alibi else None
    return Inputs(q, k, v, mask, grad_out, sinks, slopes)


def _reapply(leaf: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The same view of `leaf`, now that it requires grad (a view of it in autograd's graph)."""
    if view is leaf:
        return leaf
    return leaf.as_strided(view.shape, view.stride(), view.storage_offset())


def _mask_leaf(mask: torch.Tensor) -> torch.Tensor:
    base = mask._base.detach().requires_grad_(True)
    return base.as_strided(mask.shape, mask.stride(), mask.storage_offset())


def _bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(-3, -2) if layout == "bshd" else t


def positions(config: Config, device) -> torch.Tensor:
    """(q_len, kv_len) bool: True where query i may see key j (top-left causal, window sides)."""
    i = torch.arange(config.q_len, device=device)[:, None]
    j = torch.arange(config.kv_len, device=device)[None, :]
    keep = torch.ones(config.q_len, config.kv_len, dtype=torch.bool, device=device)
    if config.causal:
        keep &= j <= i
    if config.window is not None:
        left, right = config.window
        if left is not None:
            keep &= j >= i - left
        if right is not None:
            keep &= j <= i + right
    return keep


def reference(config: Config, q, k, v, mask, sinks=None, slopes=None) -> torch.Tensor:
    """float64 softmax attention, written here: SDPA's semantics (top-left causal, GQA, masks
    broadcast to (..., Hq, Nq, Nk), rows with no key give zeros) plus windows. Takes float64
    tensors in the call's layout and returns the output in it. With either side empty, SDPA's
    answer is zeros in the query's own shape, leading dims unbroadcast (torch's rule; --broadcast)."""
    if config.q_len == 0 or config.kv_len == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1]) + 0 * (q.sum() + k.sum() + v.sum())
    q, k, v = _bhsd(q, config.layout), _bhsd(k, config.layout), _bhsd(v, config.layout)
    if config.rank >= 3 and config.q_heads != config.kv_heads:
        groups = config.q_heads // config.kv_heads
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scale = 1.0 / math.sqrt(config.head_dim) if config.scale is None else config.scale
    return _bhsd(softmax_attention(q, k, v, scale, positions(config, q.device), mask, config.softcap,
                                   _per_head(sinks, config), _per_head(slopes, config)), config.layout)


def _per_head(t, config: Config):
    """A (Hq,) modifier as it broadcasts against (..., Hq, Nq, Nk) scores (no heads dim at rank 2)."""
    if t is None:
        return None
    return t.reshape(-1, 1, 1) if config.rank >= 3 else t.reshape(1, 1)


def softmax_attention(q, k, v, scale, keep, mask, softcap=None, sinks=None, slopes=None) -> torch.Tensor:
    """softmax(q k^T scale + mask) v over the keys `keep` (and a bool `mask`) allows, float64,
    on (..., N, D) tensors of equal heads; a row with no key gives zeros. Score modifiers: the
    soft cap c tanh(s / c) first, then the ALiBi bias -slope |i - j|, then the masks; a sink's
    logit joins each row's denominator (sinks, slopes broadcast against the scores)."""
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        i = torch.arange(s.shape[-2], device=s.device, dtype=s.dtype)[:, None]
        j = torch.arange(s.shape[-1], device=s.device, dtype=s.dtype)[None, :]
        s = s - slopes.to(s.dtype) * (i - j).abs()
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            s = s + mask.double()
    s = s.masked_fill(~keep, -math.inf)
    if sinks is not None:  # one more logit per row, never masked, with a zero value
        z = sinks.to(s.dtype).expand(*s.shape[:-1], 1)
        s = torch.cat([s, z], -1)
        v = torch.cat([v.expand(*s.shape[:-2], *v.shape[-2:]), v.new_zeros(1).expand(*s.shape[:-2], 1, v.shape[-1])],
                      -2)
    top = s.amax(-1, keepdim=True) if s.shape[-1] > 0 else s.sum(-1, keepdim=True)
    dead = torch.isneginf(top)
    p = torch.exp(s - torch.where(dead, torch.zeros_like(top), top))
    denom = p.sum(-1, keepdim=True)
    p = p / torch.where(dead | (denom == 0), torch.ones_like(denom), denom)
    return p @ v


def sdpa_yardstick(config: Config, q, k, v, mask, backend=None) -> torch.Tensor:
    """torch SDPA on the same tensors (in its bhsd order); causal with a mask, and windows, go in
    as a mask, which SDPA cannot take otherwise."""
    q, k, v = _bhsd(q, config.layout), _bhsd(k, config.layout), _bhsd(v, config.layout)
    causal = config.causal
    if config.window is not None or (causal and mask is not None):
        keep = positions(config, q.device)
        if mask is None:
            mask = keep
        elif mask.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = mask.masked_fill(~keep, -math.inf)
        causal = False
    kwargs = dict(attn_mask=mask, is_causal=causal, scale=config.scale, enable_gqa=config.enable_gqa)
    if backend is None:
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    else:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    return _bhsd(out, config.layout)


def eager_yardstick(config: Config, q, k, v, mask, sinks=None, slopes=None) -> torch.Tensor:
    """Attention with the score modifiers as the models' eager code computes it (Gemma 2's soft cap,
    gpt-oss's sink column), every step at the input dtype, a fully masked row giving zeros."""
    q, k, v = _bhsd(q, config.layout), _bhsd(k, config.layout), _bhsd(v, config.layout)
    if config.rank >= 3 and config.q_heads != config.kv_heads:
        groups = config.q_heads // config.kv_heads
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scale = 1.0 / math.sqrt(config.head_dim) if config.scale is None else config.scale
    s = (q @ k.transpose(-1, -2)) * scale
    if config.softcap is not None:
        s = torch.tanh(s / config.softcap) * config.softcap
    if slopes is not None:
        i = torch.arange(s.shape[-2], device=s.device)[:, None]
        j = torch.arange(s.shape[-1], device=s.device)[None, :]
        s = s - _per_head(slopes, config) * (i - j).abs().to(s.dtype)
    keep = positions(config, q.device)
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            s = s + mask.to(s.dtype)
    s = s.masked_fill(~keep, -math.inf)
    if sinks is not None:
        s = torch.cat([s, _per_head(sinks, config).expand(*s.shape[:-1], 1)], -1)
        p = torch.softmax(s, dim=-1)[..., :-1]
    else:  # a row with every key masked gives zeros (its scores made finite first: no NaN gradient)
        dead = torch.isneginf(s.amax(-1, keepdim=True)) if s.shape[-1] else torch.zeros(
            s.shape[:-1] + (1,), dtype=torch.bool, device=s.device)
        p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return _bhsd(p @ v, config.layout)


def rel_err(x: torch.Tensor | None, ref: torch.Tensor, unit: float) -> float:
    """||x - ref|| / ||ref||; where the exact answer is (nearly) zero (a gradient of a one-key
    softmax, say), relative to `unit`, the size the quantity has when it is not zero."""
    ref = ref.double()
    x = torch.zeros_like(ref) if x is None else x.double()
    if x.shape != ref.shape:
        return math.inf
    big = max(x.abs().max().item(), ref.abs().max().item()) if x.numel() else 0.0
    if math.isfinite(big) and big > 1e150:  # norms of such values overflow float64 (seed 5502 #62159:
        # gradients of 1e277, ours equal to SDPA's, read as an infinite error): scaled first
        x, ref, unit = x / big, ref / big, unit / big
    num = (x - ref).norm().item()
    den = ref.norm().item()
    if not math.isfinite(num):
        return math.inf
    if den < 1e-6 * unit:  # an exact zero: judge the difference against the quantity's size
        den = unit
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _forward_backward(fn, inputs: Inputs, config: Config, wrt: list):
    """fn(q, k, v, mask) and, where the configuration wants them, the gradients of
    <out, grad_out> with respect to `wrt`."""
    extra = () if inputs.sinks is None and inputs.slopes is None else inputs.modifiers()
    out = fn(inputs.q, inputs.k, inputs.v, inputs.mask, *extra)
    grads = []
    if wrt and not out.requires_grad:  # nothing to attend (an empty key): no graph, zero gradients
        grads = [None] * len(wrt)
    elif wrt:
        grads = torch.autograd.grad(out, wrt, inputs.grad_out.to(out.dtype), allow_unused=True)
    return out, list(grads)


def _wrt(inputs: Inputs, config: Config) -> list:
    """What gradients are taken with respect to: the tensors as the call got them (views)."""
    wrt = [inputs.q, inputs.k, inputs.v] if config.grad else []
    if config.mask_grad and inputs.mask is not None:
        wrt.append(inputs.mask)
    if config.grad:
        wrt += [t for t in (inputs.sinks, inputs.slopes) if t is not None]
    return wrt


def _aligned(t: torch.Tensor) -> bool:
    e = t.element_size()
    # Every stride, a length-one dim's too: torch's efficient kernel checks them all (a view with an
    # odd stride on a length-one dim made torch's own SDPA raise "no kernel found" and the yardstick
    # fall to its math kernel, H100, torch 2.11).
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((st * e) % 16 == 0 and (st != 0 or n == 1) for st, n in zip(t.stride()[:-1], t.shape[:-1])))


class TorchFault(RuntimeError):
    """A CUDA fault in torch's own SDPA on the yardstick side (after adaattn's call completed)."""


def _for_torch(inputs: Inputs, config: Config | None = None) -> Inputs:
    """The inputs as torch's SDPA is given them on CUDA: views its fused kernels cannot load (odd
    offsets, strides, a transposed last dim, expanded dims) as aligned copies of the same values. On such views
    torch's own SDPA faults (misaligned address, seen on an H200 with torch 2.11) or falls to its
    math kernel; the yardstick is torch's kernel for these values."""
    def fix(t):
        if t is None or t.numel() == 0 or _aligned(t):
            return t
        return t.detach().clone(memory_format=torch.contiguous_format).requires_grad_(t.requires_grad)

    def fix_mask(m):
        # A mask broadcast over keys (last dim 1), laid out over the keys with 16-byte rows: torch
        # 2.11's efficient kernel faulted (misaligned address) on the broadcast form. Same values.
        nk = inputs.k.shape[-2] if config is None or config.layout == "bhsd" else inputs.k.shape[-3]
        if m is None or m.requires_grad or m.dim() == 0 or m.shape[-1] != 1 or nk <= 1:
            return fix(m)
        width = -(-nk * m.element_size() // 16) * 16 // m.element_size()
        dense = m.new_empty(*m.shape[:-1], width)[..., :nk]
        dense.copy_(m.detach().expand(*m.shape[:-1], nk))
        return dense

    return Inputs(fix(inputs.q), fix(inputs.k), fix(inputs.v), fix_mask(inputs.mask), inputs.grad_out, inputs.sinks,
                  inputs.slopes)


def _copy(inputs: Inputs, convert) -> Inputs:
    """The inputs with every leaf replaced by convert(leaf) (a fresh leaf where the original wants
    gradients) and the same views taken of it."""
    def copy(t):
        if t is None:
            return None
        leaf = t._base if t._base is not None else t
        fresh = convert(leaf.detach())
        if leaf.requires_grad:
            fresh.requires_grad_(True)
        return fresh if t is leaf else fresh.as_strided(t.shape, t.stride(), t.storage_offset())

    grad_out = None if inputs.grad_out is None else convert(inputs.grad_out)
    return Inputs(copy(inputs.q), copy(inputs.k), copy(inputs.v), copy(inputs.mask), grad_out, copy(inputs.sinks),
                  copy(inputs.slopes))


def _as64(inputs: Inputs) -> Inputs:
    """float64 copies (masks keep bool), for the reference."""
    return _copy(inputs, lambda t: t if t.dtype == torch.bool else t.double())


def policy_of(name: str):
    import adaattn

    if name == "default":
        return None
    if name == "triton":
        return adaattn.Policy(backends=("triton",))
    if name == "auto":
        return adaattn.Policy(mode="auto")
    raise ValueError(f"policy must be default, triton or auto, got {name!r}")


def check(config: Config, device: str) -> dict:
    """Run one configuration; returns {status, errors, ...}. status: ok, fail (over the standard
    or an error adaattn raised where torch did not), warn (a fallback warning), declined (the
    pinned policy has no runner for it), fault (CUDA)."""
    import adaattn
    from adaattn import planner

    planner.reset()  # each configuration meets its runners' limits afresh
    result = {"index": config.index, "config": asdict(config), "repro": config.repro(device)}
    inputs = build(config, device)
    wrt = _wrt(inputs, config)
    policy = policy_of(config.policy)
    ref_in = _as64(inputs)
    ref_out, ref_grads = _forward_backward(lambda q, k, v, m, *mods: reference(config, q, k, v, m, *mods), ref_in, config,
                                           _wrt(ref_in, config))

    def ours(q, k, v, m, sinks=None, slopes=None):
        kwargs = dict(attn_mask=m, is_causal=config.causal, scale=config.scale, enable_gqa=config.enable_gqa,
                      layout=config.layout, window=config.window, policy=policy)
        if config.pass_dropout:
            kwargs["dropout_p"] = 0.0
        if config.modified:
            kwargs.update(softcap=config.softcap, sinks=sinks, alibi_slopes=slopes)
        return adaattn.attention(q, k, v, **kwargs)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            our_out, our_grads = _forward_backward(ours, inputs, config, wrt)
            if device == "cuda":
                torch.cuda.synchronize()
        except planner.NoBackendError as e:
            if config.policy == "triton":
                return {**result, "status": "declined", "why": str(e).splitlines()[0][:200]}
            return {**result, "status": "fail", "why": f"NoBackendError: {str(e)[:400]}"}
        except Exception as e:  # noqa: BLE001 - every error is a finding
            text = f"{type(e).__name__}: {e}"
            if any(w in text for w in FAULT_WORDS):
                return {**result, "status": "fault", "why": text[:400]}
            return {**result, "status": "fail", "why": text[:400], "trace": traceback.format_exc()[-1500:]}
    fallbacks = [str(w.message)[:300] for w in caught if "adaattn: runner" in str(w.message)]

    torch_in = _for_torch(inputs, config) if device == "cuda" else inputs
    try:
        torch_out, torch_grads = _torch_side(config, torch_in, _wrt(torch_in, config), device,
                                             judge=lambda out: 0.0 if ref_out.numel() == 0 else
                                             rel_err(out, ref_out, _unit(inputs, config, "out")))
    except TorchFault as e:  # ours ran and synchronised before: the fault is torch's, not adaattn's
        return {**result, "status": "torch_fault", "why": str(e)[:400]}
    errors = {}
    names = ["out"] + [f"d{n}" for n in ("q", "k", "v")[: 3 if config.grad else 0]] + (
        ["dmask"] if config.mask_grad and inputs.mask is not None else [])
    if config.grad:
        names += [n for n, t in (("dsinks", inputs.sinks), ("dslopes", inputs.slopes)) if t is not None]
    ours_all, torch_all, ref_all = [our_out] + our_grads, [torch_out] + torch_grads, [ref_out] + ref_grads
    failed = []
    units = [_unit(inputs, config, name) for name in names]
    for name, o, t, r, unit in zip(names, ours_all, torch_all, ref_all, units):
        if r is None or r.numel() == 0:
            continue
        e_ours = rel_err(o, r, unit)
        e_torch = rel_err(t, r, unit) if t is not None else math.inf
        if not math.isfinite(e_torch):
            e_torch = _floor(config)
        errors[name] = (e_ours, e_torch)
        if not e_ours <= 2 * e_torch + 1e-6:
            failed.append(name)
    if our_out.dtype != DTYPES[config.dtype] or tuple(our_out.shape) != tuple(ref_out.shape):
        return {**result, "status": "fail", "why": f"output {tuple(our_out.shape)} {our_out.dtype}, expected "
                f"{tuple(ref_out.shape)} {config.dtype}"}
    result["errors"] = {n: [float(f"{a:.3e}"), float(f"{b:.3e}")] for n, (a, b) in errors.items()}
    if failed:
        return {**result, "status": "fail", "why": "over the standard: " + ", ".join(
            f"{n} {errors[n][0]:.3e} > 2 x {errors[n][1]:.3e}" for n in failed)}
    if fallbacks:
        return {**result, "status": "warn", "why": fallbacks[0]}
    return {**result, "status": "ok"}


def _unit(inputs: Inputs, config: Config, name: str) -> float:
    """A quantity's typical norm: ||v|| for the output, ||grad_out|| times the inputs' norms for
    the gradients (the scale against which a zero reference is judged)."""
    v = inputs.v.detach().double().norm().item()
    if name == "out":
        return v
    g = inputs.grad_out.double().norm().item()
    return g * max(v, 1.0) * max(inputs.q.detach().double().norm().item(), 1.0)


def _floor(config: Config) -> float:
    """Where torch gives no finite answer at all (NaN in every kernel), the dtype's rounding."""
    return {"float16": 1e-3, "bfloat16": 8e-3, "float32": 1e-6, "float64": 1e-12}[config.dtype]


def half_math(config: Config, inputs: Inputs, wrt: list):
    """torch's math kernel reduced in the input dtype (by default it computes half inputs in float32
    inside): output and gradients; the setting is put back."""
    from torch.nn.attention import SDPBackend

    was = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        return _forward_backward(lambda q, k, v, m: sdpa_yardstick(config, q, k, v, m, SDPBackend.MATH), inputs,
                                 config, wrt)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(was)


HALF_MATH_SOUND = 0.05  # math reduced in half: an output error above this is its failure, not the dtype's rounding


def _torch_side(config: Config, inputs: Inputs, wrt: list, device: str, judge=None):
    """torch's output and gradients at the input dtype: its default SDPA; where that raises or
    gives a non-finite result, its math kernel (at the input dtype, then float32 inside); then its
    CPU kernel."""
    from torch.nn.attention import SDPBackend

    if config.modified:  # no SDPA takes them: the models' eager attention at the input dtype
        return _forward_backward(lambda q, k, v, m, *mods: eager_yardstick(config, q, k, v, m, *mods), inputs,
                                 config, wrt)
    # Where torch's own kernel gives no finite answer, the yardstick is its math kernel computing at
    # the input dtype (half inputs reduced in half, as the FlashAttention standard's reference), then
    # its math kernel as it runs by default (float32 inside), then its CPU kernel. Measuring a bf16
    # fused kernel against float32 arithmetic failed ours where torch's own gave inf (seed 5410
    # #10815, seed 5411 #339: ours 2.3-3.6x math's float32 gradients, 0.2-0.9x its bf16 ones).
    reduces_in_half = hasattr(torch.backends.cuda, "allow_fp16_bf16_reduction_math_sdp")
    attempts = ([None] + (["math-half"] if reduces_in_half else []) + [SDPBackend.MATH]
                + (["cpu"] if device == "cuda" else []))
    if device == "cuda" and config.mask_grad and inputs.mask is not None:
        # torch 2.11's default (efficient) gradient of a mask faulted (illegal memory access) on
        # broadcast masks: its math kernel (as it runs by default) is the answer torch gives safely.
        attempts = [SDPBackend.MATH, "cpu"]
    best = (None, [None] * len(wrt))
    for how in attempts:
        try:
            if how == "cpu":
                cpu = _to_cpu(inputs)
                out, grads = _forward_backward(lambda q, k, v, m: sdpa_yardstick(config, q, k, v, m), cpu, config,
                                               _wrt(cpu, config))
            elif how == "math-half":
                if config.dtype not in ("float16", "bfloat16"):
                    continue  # the same kernel as the next attempt
                out, grads = half_math(config, inputs, wrt)
                if judge is not None and not judge(out) <= HALF_MATH_SOUND:
                    # Reduced in half, a bias of -1e4 swallows the scores (bfloat16's spacing there is
                    # 64): its answer is off by 0.3 (seed 20261129 #132), no measure of the dtype's
                    # rounding, and a yardstick that loose would pass anything: math as it runs.
                    continue
            else:
                out, grads = _forward_backward(lambda q, k, v, m: sdpa_yardstick(config, q, k, v, m, how), inputs,
                                               config, wrt)
                if device == "cuda":  # a fault surfaces here, on torch's side, not later in ours
                    torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - torch refusing is not ours to judge; its faults are reported
            text = f"{type(e).__name__}: {e}"
            if device == "cuda" and how != "cpu" and any(w in text for w in FAULT_WORDS):
                raise TorchFault(f"torch SDPA ({how or 'default'}): {text}") from e
            continue
        best = (out, list(grads))
        if bool(torch.isfinite(out).all()) and all(g is None or bool(torch.isfinite(g).all()) for g in grads):
            return best
    return best


def _to_cpu(inputs: Inputs) -> Inputs:
    return _copy(inputs, lambda t: t.cpu())


def work(args) -> int:
    """Run configurations start..end-1 in this process, one JSON line each; exit 3 after a fault."""
    device = args.device
    indices = [args.only] if args.only is not None else range(args.start, args.end)
    with open(args.lines, "a") if args.lines else contextlib.nullcontext(sys.stdout) as sink:
        for index in indices:
            if args.deadline and time.time() > args.deadline:
                return 0
            config = draw(args.seed, index, device, args.policy, args.max_len, args.modifiers, args.broadcast)
            t0 = time.perf_counter()
            try:
                result = check(config, device)
            except Exception as e:  # noqa: BLE001 - a broken harness case is reported, not hidden
                text = f"{type(e).__name__}: {e}"
                status = "fault" if any(w in text for w in FAULT_WORDS) else "harness"
                result = {"index": index, "config": asdict(config), "repro": config.repro(device),
                          "status": status, "why": text[:400], "trace": traceback.format_exc()[-1500:]}
            result["ms"] = round((time.perf_counter() - t0) * 1e3, 2)
            sink.write(json.dumps(result) + "\n")
            sink.flush()
            if result["status"] in ("fault", "torch_fault"):
                return 3
    return 0


GRACE_S = 45


def drive(args) -> dict:
    """Run n configurations in worker processes, a fresh one after each CUDA fault; summarise."""
    lines = f"/tmp/adaattn-fuzz-{os.getpid()}.lines"
    if args.seconds:
        args.deadline = time.time() + args.seconds
    open(lines, "w").close()
    t0 = time.perf_counter()
    jobs = max(1, args.jobs)
    chunks = [(args.start + i * args.n // jobs, args.start + (i + 1) * args.n // jobs) for i in range(jobs)]
    procs = {}
    pending = list(chunks)
    files = {}
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
    if args.device == "cpu" and args.policy == "triton":
        env.setdefault("TRITON_INTERPRET", "1")
    if args.device == "cpu" and "OMP_NUM_THREADS" not in env:
        # Each CPU worker keeps to its share of the cores: two workers of two threads each on two cores
        # ran about 12 configurations a second, one of one thread alone about 34.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    restarts = 0
    while pending or procs:
        while pending and len(procs) < jobs:
            start, end = pending.pop(0)
            if start >= end:
                continue
            part = f"{lines}.{start}"
            files[start] = part
            cmd = [sys.executable, "-m", "tests.fuzz", "--worker", "--device", args.device, "--seed", str(args.seed),
                   "--start", str(start), "--end", str(end), "--policy", args.policy, "--max-len", str(args.max_len),
                   "--lines", part, "--deadline", str(args.deadline or 0)] + (["--modifiers"] if args.modifiers else []) + (["--broadcast"] if args.broadcast else [])
            procs[subprocess.Popen(cmd, cwd=root, env=env)] = (start, end, part)
        late = args.deadline and time.time() > args.deadline + GRACE_S
        for p in list(procs):
            if p.poll() is None and late:
                # Past the deadline and its grace: the configuration it is on hangs or compiles for
                # minutes. Stop it and report that configuration, so a bounded run still summarises.
                p.kill()
                p.wait()
                start, end, part = procs.pop(p)
                done = [json.loads(x) for x in open(part) if x.strip()]
                index = done[-1]["index"] + 1 if done else start
                with open(part, "a") as f:
                    f.write(json.dumps({"index": index, "status": "timeout", "repro": draw(
                        args.seed, index, args.device, args.policy, args.max_len, args.modifiers, args.broadcast).repro(args.device),
                        "why": f"still running {GRACE_S} s after the deadline"}) + "\n")
                continue
            if p.poll() is None:
                continue
            start, end, part = procs.pop(p)
            done = [json.loads(x) for x in open(part) if x.strip()]
            last = done[-1]["index"] if done else start - 1
            if p.returncode != 0 and last + 1 < end and not (args.deadline and time.time() > args.deadline):
                # A fault (exit 3) or a crash: rerun the rest in a fresh process.
                restarts += 1
                if p.returncode != 3 and (not done or done[-1]["status"] not in ("fault", "torch_fault")):
                    with open(part, "a") as f:
                        f.write(json.dumps({"index": last + 1, "status": "fault", "repro": draw(
                            args.seed, last + 1, args.device, args.policy, args.max_len, args.modifiers, args.broadcast
                        ).repro(args.device),
                            "why": f"worker died with exit code {p.returncode}"}) + "\n")
                    last += 1
                pending.append((last + 1, end))
        time.sleep(0.05)
    results = []
    for start in sorted(files):
        results += [json.loads(x) for x in open(files[start]) if x.strip()]
        os.remove(files[start])
    os.remove(lines)
    results.sort(key=lambda r: r["index"])
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    summary = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "git_commit": _git_commit(root), "source_digest": source_digest(root),
        "seed": args.seed, "n": args.n, "ran": len(results), "start": args.start, "policy": args.policy,
        "modifiers": args.modifiers,
        "broadcast": args.broadcast,
        "max_len": args.max_len,
        "seconds": round(time.perf_counter() - t0, 1), "restarts": restarts,
        "counts": counts,
        "findings": [r for r in results if r["status"] not in ("ok", "declined")],
        "slowest": [{"index": r["index"], "ms": r["ms"], "repro": r["repro"]}
                    for r in sorted(results, key=lambda r: -r.get("ms", 0))[:8]],
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def _triton_version():
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001
        return None


def _git_commit(root: str):
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def source_digest(root: str) -> str:
    """sha1 of the library's source files (src/adaattn) as they are on disk: what ran, where a
    copied tree's .git names an older commit (the device machine copies the working tree)."""
    import hashlib

    h = hashlib.sha1()
    base = os.path.join(root, "src", "adaattn")
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith((".py", ".json")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, base).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--end", type=int, default=None)
    ap.add_argument("--only", type=int, default=None, help="run one configuration and print its result")
    ap.add_argument("--policy", choices=("default", "triton", "auto"), default="default")
    ap.add_argument("--max-len", type=int, default=300)
    ap.add_argument("--modifiers", action="store_true", help="draw score modifiers (softcap, sinks, alibi_slopes)")
    ap.add_argument("--broadcast", action="store_true", help="draw key/value leading dims of 1 against the query's")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (CPU runs)")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--seconds", type=float, default=None, help="stop starting configurations after this long")
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lines", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cpu" and args.policy == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        if args.worker or args.only is not None:
            print("set TRITON_INTERPRET=1 for --policy triton on the CPU", file=sys.stderr)
            return 2
    if args.only is not None:
        config = draw(args.seed, args.only, args.device, args.policy, args.max_len, args.modifiers, args.broadcast)
        print(json.dumps(asdict(config)))
        result = check(config, args.device)
        print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1))
        return 0 if result["status"] in ("ok", "declined") else 1
    if args.worker:
        args.end = args.end if args.end is not None else args.start + args.n
        return work(args)
    summary = drive(args)
    for r in summary["findings"]:
        print(f"{r['status']:>7}  {r.get('why', '')[:160]}  |  {r['repro']}")
    keys = ("device", "device_name", "seed", "n", "ran", "policy", "seconds", "restarts", "counts")
    print(json.dumps({k: summary[k] for k in keys}))
    return 0 if not summary["findings"] else 1
