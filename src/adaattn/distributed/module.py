"""RingAttention: ring_attention as an nn.Module, holding its process group, balance, algorithm,
kernel, policy and call-site label."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..backends.ring_blocks import KERNELS
from ..policy import Policy
from .bands import Window
from .comm import ALGORITHMS
from .layout import check_balance
from .ring import check_policy, ring_attention


class RingAttention(nn.Module):
    """ring_attention as a module, holding its process group, balance, algorithm and kernel."""

    def __init__(self, group=None, balance: str = "zigzag", algorithm: str = "ring", kernel: str = "auto",
                 policy: Optional[Policy] = None, label: Optional[str] = None):
        super().__init__()
        self.policy = check_policy(policy)
        # Each module is its own call site unless labelled: its levels follow its own errors.
        self.label = label if label is not None else f"RingAttention@{id(self):x}"
        check_balance(balance)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, not {algorithm!r}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, not {kernel!r}")
        self.group = group
        self.balance, self.algorithm, self.kernel = balance, algorithm, kernel

    def forward(self, q, k, v, is_causal: bool = False, scale: float | None = None, window: Window = None,
                enable_gqa: bool = False, cu_seqlens=None) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, is_causal=is_causal, scale=scale, window=window,
                              enable_gqa=enable_gqa, balance=self.balance, cu_seqlens=cu_seqlens,
                              algorithm=self.algorithm, kernel=self.kernel, policy=self.policy, label=self.label)

    def extra_repr(self) -> str:
        extra = "" if self.policy.mode == "exact" else f", policy={self.policy!r}"
        return f"balance={self.balance!r}, algorithm={self.algorithm!r}, kernel={self.kernel!r}{extra}"
