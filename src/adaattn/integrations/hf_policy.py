"""`set_policy`: an adaattn.Policy per attention module of a transformers model (all layers or
those listed), and a stats label for every attention module (its name in the model).
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from ..policy import Policy


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


__all__ = ["set_policy"]
