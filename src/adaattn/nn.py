"""AdaAttention: a drop-in for torch.nn.MultiheadAttention that calls adaattn.attention."""

from __future__ import annotations

import itertools
import weakref
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from . import stats
from .api import attention
from .policy import Policy

_ids = itertools.count()


def _forget_controllers(label: str) -> None:
    from .adaptive import controller

    controller.forget(label)


class AdaAttention(nn.Module):
    """Multi-head attention with the parameters and call of torch.nn.MultiheadAttention.

    Same parameter names as MultiheadAttention (in_proj_weight, or q/k/v_proj_weight when
    kdim/vdim differ or num_kv_heads is set; in_proj_bias; out_proj), so
    `load_state_dict(mha.state_dict())` works. num_kv_heads < num_heads gives grouped-query
    attention. Attention weights are never formed, so need_weights=True raises.
    add_bias_kv and add_zero_attn are not offered.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        batch_first: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        num_kv_heads: int | None = None,
        policy: Policy | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        label: str | None = None,
    ) -> None:
        super().__init__()
        for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads <= 0 or num_heads % kv_heads:
            raise ValueError(f"num_kv_heads must be a positive divisor of num_heads ({num_heads}), got {num_kv_heads!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
            raise TypeError(f"dropout must be a float in [0, 1), got {type(dropout).__name__}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        for name, val in (("kdim", kdim), ("vdim", vdim)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {val!r}")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"policy must be an adaattn.Policy or None, got {type(policy).__name__}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.num_heads = num_heads
        self.num_kv_heads = kv_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = float(dropout)
        self.batch_first = batch_first
        self.policy = policy
        self.label = label if label is not None else f"AdaAttention#{next(_ids)}"
        if label is None:  # its own precision controllers (Policy(mode="auto")) go with it
            weakref.finalize(self, _forget_controllers, self.label)
        self._calls = 0
        kv_dim = kv_heads * self.head_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim and kv_heads == num_heads
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(kv_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(kv_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(embed_dim + 2 * kv_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # The same initialisation as MultiheadAttention.
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)

    def _project(self, query, key, value):
        e, kv_dim = self.embed_dim, self.num_kv_heads * self.head_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.split([e, kv_dim, kv_dim])
        if self._qkv_same_embed_dim:
            wq, wk, wv = self.in_proj_weight.split([e, kv_dim, kv_dim])
            if query is key and key is value:
                q, k, v = F.linear(query, self.in_proj_weight, b).split([e, kv_dim, kv_dim], dim=-1)
                return q, k, v
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _mask(self, attn_mask, key_padding_mask, batch, q_len, kv_len, dtype):
        """MultiheadAttention's masks (True = masked out) as one SDPA mask (True = takes part)."""
        masks = []
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if tuple(attn_mask.shape) != (q_len, kv_len):
                    raise ValueError(f"attn_mask must be ({q_len}, {kv_len}) or "
                                     f"({batch * self.num_heads}, {q_len}, {kv_len}), got {tuple(attn_mask.shape)}")
                m = attn_mask.view(1, 1, q_len, kv_len)
            elif attn_mask.dim() == 3:
                if tuple(attn_mask.shape) != (batch * self.num_heads, q_len, kv_len):
                    raise ValueError(f"attn_mask must be ({q_len}, {kv_len}) or "
                                     f"({batch * self.num_heads}, {q_len}, {kv_len}), got {tuple(attn_mask.shape)}")
                m = attn_mask.view(batch, self.num_heads, q_len, kv_len)
            else:
                raise ValueError(f"attn_mask must be 2-D or 3-D, got {attn_mask.dim()}-D")
            masks.append(m)
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (batch, kv_len):
                raise ValueError(f"key_padding_mask must be (batch, kv_len) = ({batch}, {kv_len}), "
                                 f"got {tuple(key_padding_mask.shape)}")
            masks.append(key_padding_mask.view(batch, 1, 1, kv_len))
        if not masks:
            return None
        if all(m.dtype == torch.bool for m in masks):
            keep = ~masks[0]
            for m in masks[1:]:
                keep = keep & ~m
            return keep
        total = None
        for m in masks:
            add = (torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
                   if m.dtype == torch.bool else m.to(dtype))
            total = add if total is None else total + add
        return total

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """(L, B, E) inputs, or (B, L, E) with batch_first, or unbatched (L, E).

        key_padding_mask: (B, S), bool True = ignore that key, or float added to scores.
        attn_mask: (L, S) or (B * num_heads, L, S), bool True = not allowed, or float added.
        is_causal: causal attention (combined with any masks given).
        Returns (output, None): attention weights are never formed.
        Raises ValueError for need_weights=True and for masks of the wrong shape.
        """
        if need_weights:
            raise ValueError(
                "need_weights=True is not supported: adaattn never forms the attention-weight "
                "matrix (that is what makes it fast and memory-linear). Pass need_weights=False, "
                "or use torch.nn.MultiheadAttention where the weights are needed."
            )
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            same_kv = key is value
            same_qk = query is key
            query = query.transpose(0, 1)
            key = query if same_qk else key.transpose(0, 1)
            value = key if same_kv else value.transpose(0, 1)
        batch, q_len, _ = query.shape
        kv_len = key.shape[1]
        q, k, v = self._project(query, key, value)
        q = q.view(batch, q_len, self.num_heads, self.head_dim)
        k = k.view(batch, kv_len, self.num_kv_heads, self.head_dim)
        v = v.view(batch, kv_len, self.num_kv_heads, self.head_dim)
        mask = self._mask(attn_mask, key_padding_mask, batch, q_len, kv_len, q.dtype)
        out = attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal, enable_gqa=self.num_kv_heads != self.num_heads,
            layout="bshd", policy=self.policy, label=self.label,
        )
        if not torch.compiler.is_compiling():
            self._calls += 1
        out = self.out_proj(out.reshape(batch, q_len, self.embed_dim))
        if unbatched:
            return out.squeeze(0), None
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, None

    def get_statistics(self) -> dict:
        """Calls made through this module, and what ran for them (from adaattn.stats when enabled)."""
        recs = [r for r in stats.records() if r.label == self.label]
        return {
            "label": self.label,
            "calls": self._calls,
            "policy": repr(self.policy),
            "backends": dict(Counter(r.backend for r in recs)),
            "records": [r.as_dict() for r in recs[-16:]],
            "stats_enabled": stats.enabled,
        }

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"dropout={self.dropout}, batch_first={self.batch_first}")
