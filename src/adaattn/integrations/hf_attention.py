"""The attention function of `attn_implementation="adaattn"`: transformers' attention-function
interface (`attention_forward`), computed by `adaattn.attention`, or for the keys of an adaattn
Cache by what the Cache's handle says (see hf_decode). Logit soft-capping (Gemma 2's `softcap`) and
attention sinks (gpt-oss's `s_aux`) go to adaattn.attention as its score modifiers. Refuses, with a
ValueError, what adaattn cannot honour: attention weights and the paged cache of continuous batching.
"""

from __future__ import annotations

import torch
from torch import nn

from ..api import attention

def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface, computed by `adaattn.attention`.

    query (B, Hq, Nq, D), key and value (B, Hkv, Nk, D) with Hq a multiple of Hkv;
    attention_mask: None, bool (True = takes part) or additive, broadcastable to (B, Hq, Nq, Nk).
    Returns (output (B, Nq, Hq, Dv), None): adaattn never materialises attention weights.

    The policy is `module.adaattn_policy` (see `set_policy`; None = exact), the stats label
    `module.adaattn_label` or "layers.<layer_idx>.<class name>".
    softcap and s_aux (a (Hq,) tensor of sink logits) are applied as adaattn.attention's `softcap` and
    `sinks`.
    Raises ValueError for what adaattn cannot honour: output_attentions, a paged cache.
    """
    _check_unsupported(kwargs)
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    modifiers = {} if softcap is None and sinks is None else dict(
        softcap=None if softcap is None else float(softcap), sinks=sinks)
    handle = getattr(key, "_adaattn_kv", None)
    if handle is not None:  # keys and values of an adaattn Cache (see Cache below)
        handle.settle(query)  # (storage="auto": a prompt chooses each head's storage)
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        # The Cache's decode kernels apply no score modifier yet: such calls attend its dense keys.
        out = None if modifiers else handle.decode(query, attention_mask, dropout, scaling, window)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
        key, value = handle.dense()
        if handle.token is not None:  # a compiled step: the whole cache, masked by the mask transformers built
            if attention_mask is None:
                raise RuntimeError("a compiled step over an adaattn Cache that needs a mask (after a padded or "
                                   "windowed prompt) got none")
            if attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
                attention_mask = attention_mask.to(query.dtype)
            if modifiers:
                out = attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                enable_gqa=query.shape[1] != key.shape[1], **modifiers)
            else:
                out = torch.nn.functional.scaled_dot_product_attention(
                    query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling,
                    enable_gqa=query.shape[1] != key.shape[1])
            return out.transpose(1, 2).contiguous(), None
    q_len, kv_len = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if attention_mask is not None:
        if attention_mask.shape[-1] > kv_len:  # transformers 4.x may pass one as long as a static cache
            attention_mask = attention_mask[:, :, :, :kv_len]
        if attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
            attention_mask = attention_mask.to(query.dtype)
    position_bias = kwargs.get("position_bias")
    # As transformers' sdpa path: top-left causal only where no mask was built and Nq > 1; a
    # single decode query attends every cached key, and any other case comes with a mask.
    causal = bool(q_len > 1) and attention_mask is None and bool(is_causal)  # plain bools under compile
    if causal and kv_len > q_len:  # an empty static cache in prefill: later keys are masked anyway
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        if position_bias is not None:
            position_bias = position_bias[..., :q_len]
    if position_bias is not None:
        attention_mask = _with_position_bias(position_bias.to(query.dtype), attention_mask, causal, q_len, key.shape[2])
        causal = False
    out = attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=float(dropout),
        is_causal=causal,
        scale=None if scaling is None else float(scaling),
        enable_gqa=query.shape[1] != key.shape[1],
        policy=getattr(module, "adaattn_policy", None),
        label=_label(module),
        **modifiers,
    )
    return out.transpose(1, 2).contiguous(), None


def _check_unsupported(kwargs: dict) -> None:
    if kwargs.get("output_attentions"):
        raise ValueError(
            "attn_implementation='adaattn' does not return attention weights (output_attentions=True); "
            "run that call with model.set_attn_implementation('eager') and switch back after"
        )
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise ValueError(
            "attn_implementation='adaattn' does not support the paged cache of continuous batching; "
            "use attn_implementation='sdpa' for generate_batch()"
        )


def _with_position_bias(
    bias: torch.Tensor, mask: torch.Tensor | None, causal: bool, q_len: int, kv_len: int
) -> torch.Tensor:
    """One additive mask from a learned position bias and the mask or causal pattern (as transformers' sdpa)."""
    if mask is None and causal:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=bias.device).tril()
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, torch.finfo(bias.dtype).min)
    return bias + mask


def _label(module: nn.Module) -> str:
    label = getattr(module, "adaattn_label", None)
    if label is not None:
        return label
    idx = getattr(module, "layer_idx", None)
    name = type(module).__name__
    return name if idx is None else f"layers.{idx}.{name}"


__all__ = ["attention_forward"]
