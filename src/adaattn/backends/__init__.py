"""Exact runners: torch SDPA's kernels, flash_attn, our Triton kernels, the float64 reference.

`exact_runners()` lists them; the planner (adaattn.planner) keeps the registry. Nothing here
imports triton: our kernels' modules import it when a launch first needs it.
"""

from __future__ import annotations

from .base import Backend, Declined, ExactAlternative, Runner


def exact_runners() -> list[Runner]:
    from .flash_attn import FlashAttnRunner
    from .meta import MetaRunner
    from .modifiers import ModifiedTorchRunner
    from .reference import ReferenceRunner
    from .sdpa import sdpa_runners
    from .sdpa_sinks import sinks_runners
    from .triton.runner import triton_runners
    from .varlen import varlen_runners

    return [*sdpa_runners(), *sinks_runners(), FlashAttnRunner(), *triton_runners(), *varlen_runners(),
            ModifiedTorchRunner(), ReferenceRunner(), MetaRunner()]


__all__ = ["Backend", "Declined", "ExactAlternative", "Runner", "exact_runners"]
