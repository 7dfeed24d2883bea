"""Tensors on the `meta` device: the output's shape and dtype, no kernel (HF's meta
initialisation and shape propagation call attention on such tensors)."""

from __future__ import annotations

from .base import Runner


class MetaRunner(Runner):
    name = "meta"
    modifiers = frozenset(("softcap", "sinks", "alibi_slopes"))  # they change no shape

    def supports(self, problem, policy) -> list[str]:
        if problem.device_type != "meta":
            return [f"takes meta tensors only, got {problem.device_type}."]
        return []

    def run(self, query, key, value, attn_mask, problem, launch, label=None, modifiers=None):
        return query.new_empty(query.shape[:-1] + (value.shape[-1],))
