"""adaattn: attention as fast as the hardware allows, and adaptive where the caller permits."""

from . import stats
from .api import (Explanation, attention, decode_attention, explain, explain_decode, info, plan_decode,
                  varlen_attention, warmup)
from .kv import KVCache, PagedKVCache
from .nn import AdaAttention
from .planner import NoBackendError
from .policy import Policy
from .problem import Documents, documents
from .version import __version__

__all__ = [
    "AdaAttention",
    "Documents",
    "Explanation",
    "KVCache",
    "NoBackendError",
    "PagedKVCache",
    "Policy",
    "attention",
    "decode_attention",
    "documents",
    "explain",
    "explain_decode",
    "info",
    "plan_decode",
    "stats",
    "varlen_attention",
    "warmup",
    "__version__",
]
