"""The entry points: attention() and varlen_attention() (SDPA-compatible), decode_attention() and
plan_decode() over a KV cache, explain(), explain_decode(), warmup(), info()."""

from ..planner import explain_decode, plan_decode
from .attention import attention, varlen_attention
from .decode import decode_attention
from .explain import Explanation, explain, explain_problem, info, warmup

__all__ = ["Explanation", "attention", "decode_attention", "explain", "explain_decode", "explain_problem", "info",
           "plan_decode", "varlen_attention", "warmup"]
