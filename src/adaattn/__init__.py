"""adaattn: attention as fast as the hardware allows, and adaptive where the caller permits."""

from . import stats
from .api import Explanation, attention, explain
from .backends.triton_attention import varlen_attention
from .nn import AdaAttention
from .planner import NoBackendError
from .policy import Policy

__version__ = "0.1.0"


def info() -> dict:
    """Versions, devices (name, capability, SMs, memory, tensor-core precisions) and backends.

    Returns a dict; `adaattn info` prints the same as text.
    """
    from .hardware import report

    return report()


__all__ = [
    "AdaAttention",
    "Explanation",
    "NoBackendError",
    "Policy",
    "attention",
    "explain",
    "info",
    "stats",
    "varlen_attention",
    "__version__",
]
