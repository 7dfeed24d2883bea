"""The `flash_attn` package (FlashAttention 2/3), when it imports."""

from __future__ import annotations

import torch

from .. import hardware
from .base import Runner

# Imported once, here: an import inside supports() would break torch.compile tracing.
try:
    from flash_attn import flash_attn_func as _func  # type: ignore[import-not-found]

    _import_error: str | None = None
except Exception as e:  # ImportError, or a broken CUDA extension
    _func = None
    _import_error = f"{type(e).__name__}: {e}".splitlines()[0][:120]


class FlashAttnRunner(Runner):
    name = "flash_attn"

    def supports(self, problem, policy) -> list[str]:
        if _func is None:
            return [f"the flash_attn package does not import ({_import_error})."]
        reasons = []
        if problem.device_type != "cuda":
            reasons.append("runs on CUDA tensors only.")
            return reasons
        if problem.dtype not in (torch.float16, torch.bfloat16):
            reasons.append("takes float16 or bfloat16 only.")
        if not hardware.capability_at_least(problem.device_index, 8, 0):
            reasons.append(f"needs sm80 or newer, this GPU is {hardware.arch('cuda', problem.device_index)}.")
        if problem.head_dim > 256 or problem.value_dim != problem.head_dim:
            reasons.append("needs head_dim <= 256 and equal query/value head dims.")
        if problem.mask_kind != "none":
            reasons.append("takes no attn_mask.")
        if problem.q_len != problem.kv_len and (problem.causal or problem.window is not None):
            reasons.append("aligns causal/window masks bottom-right when q_len != k_len; SDPA aligns top-left.")
        if problem.q_len == 0 or problem.kv_len == 0 or problem.head_dim == 0:
            reasons.append("does not take empty sequences or head_dim 0.")
        if problem.varlen:
            reasons.append("takes dense (B, H, N, D) tensors here, not packed sequences.")
        return reasons

    def run(self, query, key, value, attn_mask, problem, launch, label=None):
        left, right = problem.window if problem.window is not None else (None, None)
        window = (-1 if left is None else left, -1 if right is None else right)
        out = _func(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            dropout_p=problem.dropout_p, softmax_scale=problem.scale,
            causal=problem.causal, window_size=window,
        )
        return out.transpose(1, 2)
