"""KV caches (contiguous and paged, in the model dtype or quantized to FP8/INT8 at append) and
attention against them (decode)."""

from .cache import KVCache, PagedKVCache
from .decode import decode_attention

__all__ = ["KVCache", "PagedKVCache", "decode_attention"]
