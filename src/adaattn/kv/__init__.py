"""KV caches (contiguous and paged, in the model dtype or quantized to FP8/INT8/INT4 at append, one
storage for every head or one per head), the decode runners over them (runners.py) and the step
they run (decode.py). The planner chooses the
runner: adaattn.plan_decode and adaattn.decode_attention are the entry points."""

from .cache import KVCache, PagedKVCache
from .choose import choose_storages, storage_errors
from .decode import DecodePlan

__all__ = ["DecodePlan", "KVCache", "PagedKVCache", "choose_storages", "storage_errors"]
