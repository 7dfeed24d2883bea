"""Hugging Face transformers: `attn_implementation="adaattn"`.

    import adaattn.integrations.hf  # registers "adaattn" with transformers
    model = AutoModel.from_pretrained(name, attn_implementation="adaattn")
    adaattn.integrations.hf.set_policy(model, adaattn.Policy(...), layers=[0, 1])

Importing this module registers the attention function and its mask format: "adaattn" gets
exactly the masks "sdpa" gets (boolean, True = takes part, or None where `is_causal` or no mask
says it all), so padding, causal decoders, encoders, GQA and KV-cache decoding behave as with
"sdpa". Needs transformers >= 4.53, and models that call transformers' attention interface (all
of them in transformers 5; in 4.x the decoders such as Llama and GPT-2, not BERT).

Not supported, with a ValueError saying so: attention weights (`output_attentions=True`),
logit soft-capping (`softcap`), attention sinks (`s_aux`) and the paged cache of continuous
batching. `sliding_window` needs nothing here: the mask transformers builds carries it.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..api import attention
from ..policy import Policy

NAME = "adaattn"

_UNSUPPORTED = {
    "softcap": "logit soft-capping (softcap)",
    "s_aux": "attention sinks (s_aux)",
}


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
    Raises ValueError for what adaattn cannot honour: output_attentions, softcap, s_aux, a paged cache.
    """
    _check_unsupported(kwargs)
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
    )
    return out.transpose(1, 2).contiguous(), None


def _check_unsupported(kwargs: dict) -> None:
    if kwargs.get("output_attentions"):
        raise ValueError(
            "attn_implementation='adaattn' does not return attention weights (output_attentions=True); "
            "run that call with model.set_attn_implementation('eager') and switch back after"
        )
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"attn_implementation='adaattn' does not support {what}, which this model asks for; "
                "use attn_implementation='eager' for this model"
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


def _is_attention_module(module: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return "Attention" in type(module).__name__ and not isinstance(module, PreTrainedModel)


def _layer_index(name: str, module: nn.Module) -> int | None:
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int) and not isinstance(idx, bool):
        return idx
    numbers = [int(p) for p in name.split(".") if p.isdigit()]
    return numbers[-1] if numbers else None


def set_policy(model: nn.Module, policy: Policy | None, layers: int | Iterable[int] | None = None) -> list[str]:
    """Use `policy` for the attention of `model`, in every layer or in the layers listed.

    model: a transformers model (any nn.Module) whose attention modules call the attention
        interface; `policy`: an adaattn.Policy, or None for exact attention.
    layers: a layer index or indices (the module's `layer_idx`, else the last number in its
        name: "model.layers.3.self_attn" is layer 3); None means all attention modules.
    Also labels every attention module with its name in `model`, so `adaattn.stats` records
    say e.g. "model.layers.3.self_attn". Returns the names of the modules given the policy.
    Raises TypeError for a policy that is not a Policy or None, or layer indices that are not
    ints; ValueError for layer indices the model does not have.
    """
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be an adaattn.Policy or None, got {type(policy).__name__}")
    wanted = None
    if layers is not None:
        wanted = {layers} if isinstance(layers, int) else set(layers)
        bad = [i for i in wanted if isinstance(i, bool) or not isinstance(i, int)]
        if bad:
            raise TypeError(f"layers must be ints (layer indices) or None, got {bad!r}")
    modules = [(n, m) for n, m in model.named_modules() if n and _is_attention_module(m)]
    index = {n: _layer_index(n, m) for n, m in modules}
    found = {i for i in index.values() if i is not None}
    if wanted is not None and wanted - found:
        raise ValueError(
            f"layers {sorted(wanted - found)} are not in this model; its attention layers are {sorted(found)}"
        )
    chosen: list[str] = []
    for name, module in modules:
        module.adaattn_label = name
        if wanted is None or index[name] in wanted:
            module.adaattn_policy = policy
            chosen.append(name)
    # Report the innermost modules (BertSelfAttention, not the BertAttention around it).
    chosen = [n for n in chosen if not any(c.startswith(n + ".") for c in chosen)]
    return chosen


def register(name: str = NAME) -> None:
    """Register `attention_forward` and the sdpa mask format under `name` with transformers.

    Done on import with name "adaattn"; call again to register under another name.
    Raises ImportError for transformers older than 4.53, whose models build masks by
    implementation name in ways another implementation cannot rely on (GPT-2 there would get
    a padding-only mask and lose its causal pattern).
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        import transformers

        raise ImportError(
            "adaattn.integrations.hf needs transformers>=4.53 (masks built per attention "
            f"implementation); this is transformers {transformers.__version__}"
        ) from e
    AttentionInterface.register(name, attention_forward)
    # Without a mask format transformers builds no mask at all, and padding is silently ignored.
    AttentionMaskInterface.register(name, sdpa_mask)


register()

__all__ = ["NAME", "attention_forward", "register", "set_policy"]
