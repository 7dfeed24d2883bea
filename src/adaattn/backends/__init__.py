"""The backend registry: every way adaattn can compute attention, by name."""

from __future__ import annotations

from .base import Backend
from .flash_attn import FlashAttnBackend
from .reference import ReferenceBackend
from .sdpa import sdpa_backends

REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend; the priority data decides when it is chosen."""
    REGISTRY[backend.name] = backend
    import sys

    planner = sys.modules.get("adaattn.planner")
    if planner is not None and hasattr(planner, "reset"):  # plans made before it are stale
        planner.reset()
    return backend


for _b in (*sdpa_backends(), FlashAttnBackend(), ReferenceBackend()):
    register(_b)

try:  # our Triton kernels, only where triton imports
    import triton  # noqa: F401

    from .triton_attention import TritonBackend
    from .triton_quant import TritonQuantBackend

    register(TritonBackend())
    register(TritonQuantBackend())
except Exception:
    pass

__all__ = ["Backend", "REGISTRY", "register"]
