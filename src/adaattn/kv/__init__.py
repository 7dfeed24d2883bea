"""KV caches (contiguous and paged, in the model dtype or quantized to FP8/INT8 at append) and
attention against them (decode)."""

from .cache import KVCache, PagedKVCache
from .decode import DecodePlan, decode_attention, plan_decode

__all__ = ["DecodePlan", "KVCache", "PagedKVCache", "decode_attention", "plan_decode"]
