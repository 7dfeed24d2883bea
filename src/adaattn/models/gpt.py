"""A compact decoder-only transformer whose attention is `adaattn.attention`.

Pre-norm (RMSNorm), rotary position embeddings, optional grouped-query attention, SwiGLU
MLP, byte vocabulary by default. `GPT(config, policy=...)` passes the policy to every
attention call; `attention="sdpa"` calls torch's SDPA instead (the peer in comparisons).
Runs on the CPU in float32 and on CUDA under bf16 autocast.

Incremental decoding over an adaattn KV cache:

    cache = model.make_cache(batch=4, max_len=4096, storage="fp8")   # or "native", "int8"
    logits, _ = model(prompt, cache=cache)       # the prompt: its keys go to the cache
    logits, _ = model(next_tokens, cache=cache)  # one (or a few) tokens per sequence against it
    out = model.generate(prompt, 64, cache=cache)                    # greedy; temperature= samples

With a cache, a prompt (the cache empty, more than one token) attends over its own fresh keys as
without one (with the policy); every later call attends over what the cache holds (quantized
pages included) through adaattn.decode_attention, bottom-right causal, with one plan per call
shared by the layers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..api import attention as ada_attention
from ..api import decode_attention, plan_decode
from ..kv import DecodePlan, KVCache
from ..policy import Policy

ATTENTION_KINDS = ("adaattn", "sdpa")


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model. `mlp_hidden` None means 8/3 * d_model rounded up to a multiple of 64."""

    vocab_size: int = 256
    n_layer: int = 8
    n_head: int = 6
    n_kv_head: int = 2
    d_model: int = 384
    mlp_hidden: int | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    train_seq_len: int = 8192  # the length it was trained at (RoPE itself has no limit)

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def hidden(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def rope_tables(seq_len: int, head_dim: int, base: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (seq_len, head_dim / 2), computed in float32 then cast to `dtype`."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, N, H, D) by position: the two halves of D are the real and imaginary parts."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # (N, 1, D/2) broadcasts over heads
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


Recorder = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class Attention(nn.Module):
    """Causal self-attention: fused QKV projection, RoPE on Q and K, attention, output projection."""

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        kv_dim = config.n_kv_head * config.head_dim
        self.qkv = nn.Linear(config.d_model, config.d_model + 2 * kv_dim, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.kind = "adaattn"  # GPT.set_attention sets these three on every layer
        self.policy: Policy | None = None
        self.recorder: Recorder | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                plan: DecodePlan | None = None) -> torch.Tensor:
        b, n, d = x.shape
        h, hk, hd = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv(x).split([h * hd, hk * hd, hk * hd], dim=-1)
        q = apply_rope(q.view(b, n, h, hd), cos, sin)
        k = apply_rope(k.view(b, n, hk, hd), cos, sin)
        v = v.view(b, n, hk, hd)
        gqa = hk != h
        if cache is not None:
            cache.append(self.layer, k.transpose(1, 2), v.transpose(1, 2))
        if plan is not None:  # against the cache, which now holds this call's keys too
            out = decode_attention(q.transpose(1, 2), cache, self.layer, plan=plan).transpose(1, 2)
        elif self.kind == "sdpa":
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=gqa
            ).transpose(1, 2)
        else:
            out = ada_attention(q, k, v, is_causal=True, enable_gqa=gqa, layout="bshd",
                                policy=self.policy, label=f"layer{self.layer}")
        if self.recorder is not None:
            self.recorder(self.layer, q, k, v, out)
        return self.proj(out.reshape(b, n, d))


class MLP(nn.Module):
    """SwiGLU: proj(silu(gate(x)) * up(x)), gate and up fused in one matrix."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.hidden = config.hidden
        self.gate_up = nn.Linear(config.d_model, 2 * config.hidden, bias=False)
        self.proj = nn.Linear(config.hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.norm1 = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, layer)
        self.norm2 = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache=None, plan=None):
        x = x + self.attn(self.norm1(x), cos, sin, cache, plan)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Decoder-only transformer on token ids.

    attention: "adaattn" (adaattn.attention with `policy`; None is exact) or "sdpa"
        (torch.nn.functional.scaled_dot_product_attention), both causal.
    checkpoint: recompute each block in the backward (activation checkpointing) when training.
    forward(tokens (B, N) int64, targets (B, N) int64 or None, cache=None) -> (logits (B, N, vocab)
    in the compute dtype, mean cross-entropy in nats as float32, or None without targets). With
    `cache` (from make_cache), the tokens continue what the cache holds (see the module docstring);
    through_cache: a prompt into an empty cache attends over what the cache stores of it (quantized
    pages included) rather than its fresh keys.
    """

    def __init__(self, config: GPTConfig, *, policy: Policy | None = None, attention: str = "adaattn",
                 checkpoint: bool = False):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.checkpoint = checkpoint
        self.set_attention(attention, policy)
        self._rope: dict = {}
        self.reset_parameters()

    def set_attention(self, attention: str = "adaattn", policy: Policy | None = None) -> None:
        """Switch every layer to adaattn.attention with `policy`, or to torch SDPA."""
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"policy must be an adaattn.Policy or None, got {type(policy).__name__}")
        self.attention = attention
        self.policy = policy
        for block in self.blocks:
            block.attn.kind, block.attn.policy = attention, policy

    def set_recorder(self, recorder: Recorder | None) -> None:
        """Call `recorder(layer, q, k, v, out)` in every layer's forward ((B, N, H, D) tensors), or stop."""
        for block in self.blocks:
            block.attn.recorder = recorder

    def reset_parameters(self) -> None:
        """GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.ones_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, 0.0, std)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def rope(self, seq_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device), dtype)
        if key not in self._rope:
            self._rope.clear()  # one length at a time is what training and evaluation use
            self._rope[key] = rope_tables(seq_len, self.config.head_dim, self.config.rope_base, device, dtype)
        return self._rope[key]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
                through_cache: bool = False):
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq_len) int64, got shape {tuple(tokens.shape)}")
        x = self.embed(tokens)
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        plan = None
        if cache is None:
            cos, sin = self.rope(tokens.shape[1], x.device, dtype)
        else:
            start, plan = self._plan(tokens, cache, dtype, through_cache)
            cos, sin = self.rope(cache.max_len, x.device, dtype)
            cos, sin = cos[start:start + tokens.shape[1]], sin[start:start + tokens.shape[1]]
        for block in self.blocks:
            if cache is not None:
                x = block(x, cos, sin, cache, plan)
            elif self.checkpoint and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def make_cache(self, batch: int, max_len: int, *, storage: str = "native", dtype: torch.dtype | None = None,
                   device=None, page_size: int = 64, summaries: bool = False) -> KVCache:
        """An empty adaattn KVCache for `batch` sequences of up to `max_len` tokens, shaped for this
        model. storage: "native" (in `dtype`), "fp8" or "int8" (quantized at append). dtype: the
        compute dtype the forward will run in (default: bfloat16 on CUDA, as under the autocast of
        evaluation, else the parameters' dtype). summaries: keep page summaries, so that decode
        under a policy with mode="auto" and "skip" reads only the pages each step needs
        (adaattn.kv.sparse)."""
        p = next(self.parameters())
        device = p.device if device is None else torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else p.dtype
        c = self.config
        return KVCache(c.n_layer, batch, c.n_kv_head, max_len, c.head_dim, dtype=dtype, device=device,
                       storage=storage, page_size=page_size, summaries=summaries)

    def _plan(self, tokens: torch.Tensor, cache: KVCache, dtype: torch.dtype, through_cache: bool = False
              ) -> tuple[int, DecodePlan | None]:
        """Where `tokens` start in `cache`, and the decode plan (None for a prompt into an empty
        cache, unless through_cache)."""
        c = self.config
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be an adaattn.KVCache (model.make_cache), got {type(cache).__name__}")
        if (cache.layers, cache.kv_heads, cache.head_dim) != (c.n_layer, c.n_kv_head, c.head_dim):
            raise ValueError(f"cache holds {cache.layers} layers x {cache.kv_heads} KV heads x {cache.head_dim} dims; "
                             f"this model needs {c.n_layer} x {c.n_kv_head} x {c.head_dim}")
        b, n = tokens.shape
        if b != cache.batch:
            raise ValueError(f"tokens hold {b} sequences but the cache's batch is {cache.batch}")
        lengths = {cache.length(s, layer) for s in range(b) for layer in range(c.n_layer)}
        if len(lengths) != 1:
            raise ValueError(f"the cache's sequences and layers hold different lengths {sorted(lengths)}; "
                             "GPT continues a batch that advances together")
        start = lengths.pop()
        if start + n > cache.max_len:
            raise ValueError(f"the cache holds {start} tokens of at most max_len={cache.max_len}; {n} more do not fit")
        if cache.dtype != dtype:
            raise TypeError(f"the cache's dtype {cache.dtype} is not the forward's compute dtype {dtype}")
        if start == 0 and n > 1 and not through_cache:
            return 0, None
        runner = "sdpa" if self.attention == "sdpa" else None
        policy = self.policy if self.attention == "adaattn" else None  # sparse decode where it allows skipping
        return start, plan_decode(cache, heads=c.n_head, query_len=n, dtype=dtype, runner=runner, policy=policy)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, *, cache: KVCache | None = None,
                 use_cache: bool = True, temperature: float = 0.0, top_k: int | None = None, generator: torch.Generator | None = None,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
        """prompt (B, N) int64 followed by `max_new_tokens` generated tokens, (B, N + max_new_tokens).

        Greedy when temperature is 0, else sampled from softmax(logits / temperature) (over the
        top_k most likely when given). cache: an empty KVCache from make_cache, with room for
        N + max_new_tokens (default: one in the model dtype is made). use_cache=False recomputes
        the whole sequence every step instead (the reference; cache must then be None). dtype: the compute dtype (default: bfloat16
        autocast on CUDA, the parameters' dtype elsewhere)."""
        if prompt.dim() != 2 or prompt.shape[1] < 1 or prompt.dtype != torch.long:
            raise ValueError(f"prompt must be (batch, seq_len >= 1) int64, got {tuple(prompt.shape)} {prompt.dtype}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        p = next(self.parameters())
        prompt = prompt.to(p.device)
        if dtype is None:
            dtype = torch.bfloat16 if p.device.type == "cuda" else p.dtype
        b, n = prompt.shape
        if not use_cache:
            if cache is not None:
                raise ValueError("use_cache=False recomputes every step; it takes no cache")
        elif cache is None:
            cache = self.make_cache(b, n + max_new_tokens, dtype=dtype)
        elif any(cache.length(s) for s in range(cache.batch)):
            raise ValueError("cache must be empty (cache.reset() empties it)")
        autocast = (torch.autocast(p.device.type, dtype=dtype) if dtype != p.dtype
                    else torch.autocast(p.device.type, enabled=False))
        was_training = self.training
        self.eval()
        out = [prompt]
        try:
            with autocast:
                step = prompt
                for _ in range(max_new_tokens):
                    if not use_cache:
                        logits, _ = self(torch.cat(out, dim=1))
                    else:
                        logits, _ = self(step, cache=cache)
                    logits = logits[:, -1].float()
                    if temperature == 0:
                        step = logits.argmax(-1, keepdim=True)
                    else:
                        logits = logits / temperature
                        if top_k is not None and top_k < logits.shape[-1]:
                            kth = logits.topk(top_k, dim=-1).values[:, -1:]
                            logits = logits.masked_fill(logits < kth, float("-inf"))
                        step = torch.multinomial(logits.softmax(-1), 1, generator=generator)
                    out.append(step)
        finally:
            self.train(was_training)
        return torch.cat(out, dim=1)

    def optimizer(self, lr: float, weight_decay: float, betas=(0.9, 0.95), fused: bool | None = None):
        """AdamW with weight decay on the matrices only (not norms, not the embedding)."""
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and not n.startswith("embed")]
        other = [p for n, p in self.named_parameters() if p.dim() < 2 or n.startswith("embed")]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
        kw = {} if fused is None else {"fused": fused}
        return torch.optim.AdamW(groups, lr=lr, betas=betas, **kw)


def parse_attention(spec: str) -> tuple[str, Policy | None]:
    """'sdpa' -> torch SDPA; 'adaattn' -> adaattn's dispatch; 'adaattn:NAME' -> pinned to a backend;
    'auto:TAU' -> adaattn with Policy(mode="auto", precisions native/int8/fp8, tolerance TAU);
    'rank:TAU' -> adaattn with Policy(mode="auto", approximations lowrank/skip, tolerance TAU).

    Returns (attention, policy) for GPT(..., attention=..., policy=...). Raises ValueError otherwise.
    """
    if spec in ("sdpa", "adaattn"):
        return spec, None
    for prefix in ("auto:", "rank:"):
        if spec.startswith(prefix):
            try:
                tau = float(spec.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"attention spec {prefix}TAU needs a number, got {spec!r}") from None
            if prefix == "rank:":
                return "adaattn", Policy(mode="auto", approximations=("lowrank", "skip"), tolerance=tau)
            return "adaattn", Policy(mode="auto", precisions=("native", "int8", "fp8"), tolerance=tau)
    if spec.startswith("adaattn:") and spec.split(":", 1)[1]:
        return "adaattn", Policy(backends=(spec.split(":", 1)[1],))
    raise ValueError(f"attention spec must be sdpa, adaattn, adaattn:BACKEND, auto:TAU or rank:TAU, got {spec!r}")
