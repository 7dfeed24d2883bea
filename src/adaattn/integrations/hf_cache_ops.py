"""The custom ops of an adaattn Cache's compiled steps (torch.compile of a model's forward, as
transformers' generate() does for a compileable cache): the cache's append, decode and gather,
opaque to the compiler, whose Python runs when a graph is recorded and not when it is replayed
(CUDA graphs). They find their cache through its tensors (`state`: the layer's lengths, K and V
pools, and scales), which are static addresses: a new Cache gives new addresses, and CUDA-graph
trees record again rather than replay into another cache's memory. The append returns a token
that the decode and gather take, so that the compiler orders them after it.
"""

from __future__ import annotations

from typing import Optional

import torch

_OWNERS: dict = {}  # lengths.data_ptr() -> (weakref to the Cache, layer)


def _forget(ptr: int, ref) -> None:
    if _OWNERS.get(ptr, (None,))[0] is ref:  # (a later cache may hold the address by now)
        del _OWNERS[ptr]


def _owner(state):
    entry = _OWNERS.get(state[0].data_ptr())
    cache = entry[0]() if entry is not None else None
    if cache is None or [t.data_ptr() for t in cache._state(entry[1])] != [t.data_ptr() for t in state]:
        raise RuntimeError("adaattn Cache op: these tensors belong to no live adaattn Cache")
    return cache, entry[1]


@torch.library.custom_op("adaattn::hf_cache_append", mutates_args=())
def _append_op(key: torch.Tensor, value: torch.Tensor, state: list[torch.Tensor]) -> torch.Tensor:
    cache, layer = _owner(state)
    cache._append_now(layer, key, value)
    return key.new_empty(0)


@_append_op.register_fake
def _(key, value, state):
    return key.new_empty(0)


@torch.library.custom_op("adaattn::hf_cache_decode", mutates_args=())
def _decode_op(query: torch.Tensor, token: torch.Tensor, state: list[torch.Tensor],
               scale: Optional[float]) -> torch.Tensor:
    cache, layer = _owner(state)
    return cache._decode_now(query, layer, scale)


@_decode_op.register_fake
def _(query, token, state, scale):
    return query.new_empty(*query.shape[:3], _width(state[2]))


@torch.library.custom_op("adaattn::hf_cache_gather", mutates_args=())
def _gather_op(token: torch.Tensor, state: list[torch.Tensor], dtype: torch.dtype, batch: int, length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    cache, layer = _owner(state)
    k, v = cache.kvs[layer].gather(0, cache.seqs, length, dtype=dtype)
    return k.contiguous(), v.contiguous()


@_gather_op.register_fake
def _(token, state, dtype, batch, length):
    hkv = state[1].shape[2]  # pools are (pages, page size, Hkv, D)
    return (state[1].new_empty(batch, hkv, length, _width(state[1]), dtype=dtype),
            state[2].new_empty(batch, hkv, length, _width(state[2]), dtype=dtype))


def _width(pool: torch.Tensor) -> int:
    """The head dim a (pages, page size, Hkv, D) pool holds: int4 pages (uint8) hold two values a byte."""
    return pool.shape[3] * (2 if pool.dtype == torch.uint8 else 1)
