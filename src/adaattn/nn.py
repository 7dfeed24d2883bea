"""AdaAttention: a drop-in for torch.nn.MultiheadAttention that calls adaattn.attention."""

from __future__ import annotations

import itertools
import math
import weakref
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from . import stats
from .api import attention
from .policy import Policy
from .problem import sdpa_float

_ids = itertools.count()


def _forget_controllers(label: str) -> None:
    from .adaptive import sites

    sites.forget(label)


def _keeps_own_forward(module, args):
    """A forward pre-hook that does nothing. nn.TransformerEncoderLayer takes its fused "fast path"
    (torch._transformer_encoder_layer_fwd, which reads self_attn's weights and never calls it) only
    when no module inside it has hooks, so this hook keeps AdaAttention's own forward running there.
    """
    return None


class AdaAttention(nn.Module):
    """Multi-head attention with the parameters and call of torch.nn.MultiheadAttention.

    Same parameter names as MultiheadAttention (in_proj_weight, or q/k/v_proj_weight when
    kdim/vdim differ or num_kv_heads is set; in_proj_bias; out_proj), so
    `load_state_dict(mha.state_dict())` works, and the attributes code written for
    MultiheadAttention reads (embed_dim, kdim, vdim, num_heads, head_dim, dropout, batch_first,
    _qkv_same_embed_dim, bias_k = bias_v = None, add_zero_attn = False, merge_masks).
    num_kv_heads < num_heads gives grouped-query attention. add_bias_kv and add_zero_attn are
    accepted only as False. Note the positional order after `bias` differs from
    MultiheadAttention's: pass the rest by keyword.

    forward() has MultiheadAttention's call and defaults, need_weights=True included: pass
    need_weights=False for speed (adaattn.attention; weights are not formed), as with
    MultiheadAttention. Inside nn.TransformerEncoderLayer / TransformerEncoder /
    TransformerDecoderLayer it is called with need_weights=False in every mode: torch's fused
    encoder-layer fast path is kept off (a no-op forward pre-hook), so adaattn's attention runs,
    and nested-tensor inputs (TransformerEncoder's padding fast path) are handled.
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
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
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
        if type(dropout) is not float:  # what SDPA takes for dropout_p: ints, NumPy scalars, 0-d tensors
            dropout = sdpa_float("dropout", dropout, "a float in [0, 1)")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        for name, val in (("kdim", kdim), ("vdim", vdim)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {val!r}")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"policy must be an adaattn.Policy or None, got {type(policy).__name__}")
        for name, val in (("add_bias_kv", add_bias_kv), ("add_zero_attn", add_zero_attn)):
            if val:
                raise ValueError(f"{name}={val!r} is not supported by AdaAttention (only False); "
                                 "use torch.nn.MultiheadAttention for it")
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
        # MultiheadAttention's attributes for add_bias_kv=False, add_zero_attn=False.
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._reset_parameters()
        self.register_forward_pre_hook(_keeps_own_forward)

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
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MultiheadAttention's call: (L, B, E) inputs, or (B, L, E) with batch_first, or unbatched (L, E).

        key_padding_mask: (B, S), or (S,) unbatched; bool True = ignore that key, or float added to scores.
        attn_mask: (L, S) or (B * num_heads, L, S); bool True = not allowed, or float added.
        is_causal: causal attention, top-left aligned, combined with any masks given (MultiheadAttention
            takes it only as a hint that attn_mask is causal; here attn_mask may be left out).
        need_weights: False computes attention with adaattn.attention (fast, memory-linear; the policy
            applies) and returns (output, None). True (the default, as MultiheadAttention) is the slow
            path: like MultiheadAttention it forms the full (B, H, L, S) weights, softmax of the scaled
            scores with the masks applied (in float32 for half types), dropout on them in training,
            and output = weights @ values, exact whatever the policy; returns (output, weights),
            weights averaged over heads (B, L, S) when average_attn_weights, else per head
            (B, H, L, S) (GQA heads repeated); (L, S) / (H, L, S) for unbatched input. A query with
            no key left gets zero weights and zero attention (MultiheadAttention gives NaN there).
        Nested-tensor inputs (batch-first, as MultiheadAttention's fast path takes them) give a nested
        output; their lengths take the place of key_padding_mask.
        Raises TypeError/ValueError naming the argument for inputs or masks of the wrong type or shape.
        """
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if query.is_nested or key.is_nested or value.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask, need_weights, attn_mask,
                                        average_attn_weights, is_causal)
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be 2-D (unbatched) or 3-D, got {query.dim()}-D shape "
                             f"{tuple(query.shape)}")
        for name, t in (("key", key), ("value", value)):
            if t.dim() != query.dim():
                raise ValueError(f"{name} must be {query.dim()}-D like query, got {t.dim()}-D shape "
                                 f"{tuple(t.shape)}")
        for name, t, dim_name, dim in (("query", query, "embed_dim", self.embed_dim), ("key", key, "kdim", self.kdim),
                                       ("value", value, "vdim", self.vdim)):
            if t.shape[-1] != dim:
                raise ValueError(f"{name}'s last dimension must be {dim_name} ({dim}), got {t.shape[-1]}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"key and value must have the same batch and sequence dimensions, got "
                             f"{tuple(key.shape)} and {tuple(value.shape)}")
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                if key_padding_mask.dim() != 1:
                    raise ValueError(f"key_padding_mask must be 1-D (kv_len,) for unbatched input, "
                                     f"got shape {tuple(key_padding_mask.shape)}")
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            same_kv = key is value
            same_qk = query is key
            query = query.transpose(0, 1)
            key = query if same_qk else key.transpose(0, 1)
            value = key if same_kv else value.transpose(0, 1)
        if query.shape[0] != key.shape[0]:
            raise ValueError(f"query and key must have the same batch size, got {query.shape[0]} and "
                             f"{key.shape[0]}")
        out, weights = self._attend(query, key, value, key_padding_mask, need_weights, attn_mask,
                                    average_attn_weights, is_causal)
        if unbatched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _attend(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                is_causal):
        """(B, L, E) batch-first inputs -> (B, L, E) output and the weights (or None)."""
        batch, q_len, _ = query.shape
        kv_len = key.shape[1]
        q, k, v = self._project(query, key, value)
        q = q.view(batch, q_len, self.num_heads, self.head_dim)
        k = k.view(batch, kv_len, self.num_kv_heads, self.head_dim)
        v = v.view(batch, kv_len, self.num_kv_heads, self.head_dim)
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            out, weights = self._attend_with_weights(q, k, v, key_padding_mask, attn_mask, is_causal, dropout_p)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            mask = self._mask(attn_mask, key_padding_mask, batch, q_len, kv_len, q.dtype)
            out = attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p,
                is_causal=is_causal, enable_gqa=self.num_kv_heads != self.num_heads,
                layout="bshd", policy=self.policy, label=self.label,
            )
        if not torch.compiler.is_compiling():
            self._calls += 1
        return self.out_proj(out.reshape(batch, q_len, self.embed_dim)), weights

    def _attend_with_weights(self, q, k, v, key_padding_mask, attn_mask, is_causal, dropout_p):
        """MultiheadAttention's need_weights path on (B, N, H, D) tensors: (B, L, H, D) output and the
        (B, H, L, S) weights, both in q's dtype (computed in float32 for half types)."""
        batch, q_len, _, head_dim = q.shape
        kv_len = k.shape[1]
        dtype = q.dtype
        acc = torch.promote_types(dtype, torch.float32)
        q, k, v = (t.transpose(1, 2).to(acc) for t in (q, k, v))
        if self.num_kv_heads != self.num_heads:
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q * math.sqrt(1.0 / float(head_dim)), k.transpose(-2, -1))
        mask = self._mask(attn_mask, key_padding_mask, batch, q_len, kv_len, acc)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        if is_causal:
            keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        # A query with no key left: zero weights and zero attention, as adaattn.attention gives.
        weights = weights.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.matmul(weights, v).transpose(1, 2).to(dtype)
        return out, weights.to(dtype)

    def _forward_nested(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                        is_causal):
        """Nested (batch, ragged seq, E) inputs, as MultiheadAttention's fast path takes them: padded,
        attended with a key padding mask from the lengths, and nested again."""
        if not (query.is_nested and key.is_nested and value.is_nested):
            raise ValueError("query, key and value must all be nested tensors or none, got nested: "
                             f"query={query.is_nested}, key={key.is_nested}, value={value.is_nested}")
        for name, m in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
            if m is not None:
                raise ValueError(f"{name} must be None with nested-tensor inputs (their lengths mark the "
                                 "padding), got a tensor")
        q_lens = [t.shape[0] for t in query.unbind()]
        kv_lens = [t.shape[0] for t in key.unbind()]
        if [t.shape[0] for t in value.unbind()] != kv_lens:
            raise ValueError(f"value's sequence lengths must equal key's ({kv_lens}), got "
                             f"{[t.shape[0] for t in value.unbind()]}")
        padded = {}
        for t in (query, key, value):
            if id(t) not in padded:
                padded[id(t)] = torch.nested.to_padded_tensor(t, 0.0)
        q, k, v = padded[id(query)], padded[id(key)], padded[id(value)]
        for name, t, dim in (("query", q, self.embed_dim), ("key", k, self.kdim), ("value", v, self.vdim)):
            if t.dim() != 3 or t.shape[-1] != dim:
                raise ValueError(f"{name} must be nested (batch, seq, {dim}), got padded shape {tuple(t.shape)}")
        lens = torch.tensor(kv_lens, device=k.device)
        kpm = torch.arange(k.shape[1], device=k.device) >= lens[:, None]  # True = padding
        out, weights = self._attend(q, k, v, kpm, need_weights, None, average_attn_weights, is_causal)
        out = torch.nested.as_nested_tensor([out[i, :n] for i, n in enumerate(q_lens)], layout=query.layout)
        if weights is not None:  # zero rows for padded queries, as MultiheadAttention's fast path
            q_keep = torch.arange(q.shape[1], device=q.device) < torch.tensor(q_lens, device=q.device)[:, None]
            weights = weights * q_keep.view(q.shape[0], *([1] * (weights.dim() - 3)), -1, 1).to(weights.dtype)
        return out, weights

    def merge_masks(self, attn_mask, key_padding_mask, query):
        """MultiheadAttention.merge_masks: (merged mask, mask type 0/1/2), for torch code that calls it.

        key_padding_mask alone: itself, type 1; with attn_mask, both expanded to
        (B, num_heads, L, L) and added, type 2; neither: (None, None).
        """
        mask_type = None
        merged_mask = None
        if key_padding_mask is not None:
            mask_type = 1
            merged_mask = key_padding_mask
        if attn_mask is not None:
            batch_size, seq_len, _ = query.shape
            mask_type = 2
            if attn_mask.dim() == 3:
                attn_mask_expanded = attn_mask.view(batch_size, -1, seq_len, seq_len)
            else:
                attn_mask_expanded = attn_mask.view(1, 1, seq_len, seq_len).expand(
                    batch_size, self.num_heads, -1, -1)
            merged_mask = attn_mask_expanded
            if key_padding_mask is not None:
                key_padding_mask_expanded = key_padding_mask.view(batch_size, 1, 1, seq_len).expand(
                    -1, self.num_heads, -1, -1)
                merged_mask = attn_mask_expanded + key_padding_mask_expanded
        return merged_mask, mask_type

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
