"""What every backend declares: a name, what it supports (as reasons), and how it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..planner import Plan
    from ..problem import Problem


class Backend:
    """One way to compute attention. Subclasses set `name` and override both methods."""

    name: str = ""
    exact: bool = True

    def supports(self, problem: Problem) -> list[str]:
        """Reasons this backend cannot run `problem`, each a short sentence; empty means it can."""
        raise NotImplementedError

    def run(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        problem: Problem,
        plan: Plan,
    ) -> torch.Tensor:
        """Attention on (B, H, N, D) tensors; returns (B, Hq, Nq, Dv) in the input dtype."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name}>"
