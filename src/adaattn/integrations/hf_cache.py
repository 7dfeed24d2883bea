"""adaattn's KV cache for transformers' generate(): `Cache(...)`, which checks its arguments, and
the transformers Cache subclass it makes (once, importing transformers only then), backed by one
single-layer adaattn.kv cache per model layer and compileable into CUDA graphs.
"""

from __future__ import annotations

import functools
import weakref

import torch

from .hf_cache_ops import _OWNERS, _append_op, _forget
from .hf_decode import _Handle


def Cache(max_cache_len: int, storage: str = "native", paged: bool = False, page_size: int = 64,
          decode_runner: str | None = None, compile: bool | None = None, *, group_size: int | None = None, window: int = 0,
          tolerance: float | None = None):
    """A transformers Cache backed by adaattn.kv: pass it as `past_key_values` to generate() or
    forward() of a model loaded with attn_implementation="adaattn".

    max_cache_len: tokens per sequence it holds (prompt + new tokens); storage: "native" (the
    model dtype), "fp8" or "int8" (quantized once at append, per (page, KV head) scales) or "int4"
    (per token and `group_size` channels; `window`: the newest tokens also kept in the model dtype,
    adaattn.kv.cache's docstring), or "auto" with a `tolerance`: each layer's KV heads in INT4, INT8
    or the model dtype, chosen from the error each measures on the prompt (adaattn.kv.mixed); paged:
    a PagedKVCache (pages from a pool, each sequence's reserved at its first update) instead of a
    contiguous KVCache; page_size: tokens per page; decode_runner: "triton", "sdpa" or None (the
    plan's choice).

    compile: whether the cache is compileable (`is_compileable`), as transformers' StaticCache;
    None (the default) means where CUDA is. generate() then compiles the model's decode step on
    the GPU (torch.compile, mode "reduce-overhead": one CUDA graph per step, which removes the host
    time of transformers' Python per layer) and runs the prompt uncompiled. Masks get static
    shapes (max_cache_len keys). A step of one new token after prompts with no more than the
    causal mask (no padding) and no window shorter than the cache runs the split-KV kernel, the
    mask transformers built holding nothing else; other steps attend the whole cache under the
    mask. The first generate() compiles (tens of seconds); keep the Cache and reset() it between
    requests, so that later calls replay the recorded CUDA graph: a new Cache records it again
    (torch stops re-recording after cudagraph_unexpected_rerecord_limit, 128). max_cache_len must
    hold prompt + new tokens: compiled steps cannot raise, and tokens past it are not kept (the
    steps that needed them are wrong); the next reset() or uncompiled update raises ValueError
    saying so. compile=False: every step uncompiled, masks as long as the keys.

    Keys and values go to the cache at each layer's update; the attention function reads them from
    there. With another attn_implementation, a native contiguous cache works uncompiled (update
    returns views of it); a quantized or paged one returns NaN placeholders, so that a model that
    bypasses adaattn's attention fails loudly instead of reading wrong keys, and a compiled step
    after such a prompt raises. Beam search (reorder_cache) and crop are refused."""
    from ..kv.formats import STORAGES, check_layout, check_tolerance
    from ..planner import DECODE_RUNNER_NAMES as RUNNERS

    if storage not in STORAGES and storage != "auto":
        raise ValueError(f"storage must be one of {STORAGES} or 'auto', got {storage!r}")
    if decode_runner is not None and decode_runner not in RUNNERS:
        raise ValueError(f"decode_runner must be one of {RUNNERS} or None, got {decode_runner!r}")
    for name, value in (("max_cache_len", max_cache_len), ("page_size", page_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool or None, got {type(compile).__name__}")
    if compile is None:
        compile = torch.cuda.is_available()
    check_layout(storage, group_size, window, storage in ("int4", "auto"))
    if storage != "auto" and tolerance is not None:
        raise ValueError(f"tolerance={tolerance!r} is storage='auto''s, which chooses each head's storage under it; "
                         f"storage {storage!r} takes none")
    cache = _cache_class()(max_cache_len, storage, bool(paged), page_size, decode_runner, compile)
    cache._layout = dict(window=min(window, max_cache_len))
    if group_size is not None:
        cache._layout["group_size"] = group_size
    if storage == "auto":
        cache._layout["tolerance"] = check_tolerance(tolerance)
    return cache


@functools.lru_cache(maxsize=None)
def _cache_class():
    """The Cache class, made once (transformers is imported only when a Cache is asked for)."""
    from transformers.cache_utils import Cache as HFCache, CacheLayerMixin

    class _Layer(CacheLayerMixin):
        def __init__(self, owner, idx):
            super().__init__()
            self.owner, self.idx = owner, idx

        @property
        def is_compileable(self):
            return self.owner.is_compileable

        def lazy_initialization(self, key_states, value_states):
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            return self.owner._update(self.idx, key_states, value_states)

        def get_mask_sizes(self, query_length):
            return self.owner.get_mask_sizes(query_length, self.idx)

        def get_seq_length(self):
            return self.owner.get_seq_length(self.idx)

        def get_max_length(self):
            return self.owner.max_cache_len

        def reset(self):
            self.owner.reset()

        def reorder_cache(self, beam_idx):
            raise NotImplementedError("adaattn's Cache does not reorder for beam search; use transformers' "
                                      "DynamicCache with num_beams > 1")

        def crop(self, max_length):
            raise NotImplementedError("adaattn's Cache does not crop; use transformers' DynamicCache for assisted "
                                      "generation")

    class AdaattnCache(HFCache):
        def __init__(self, max_cache_len, storage, paged, page_size, decode_runner, compile):
            super().__init__(layers=[])
            self._capacity, self.storage, self.paged, self.page_size = max_cache_len, storage, paged, page_size
            self.decode_runner, self._compile = decode_runner, compile
            self.kvs: list = []  # one single-layer adaattn.kv cache per model layer, made at its first update
            self.seqs: tuple[int, ...] = ()
            self._plans: dict = {}
            self._masked: list[bool] = []  # per layer: a prompt or chunk came with more than the causal mask
            self._seen: list[bool] = []  # per layer: adaattn's attention function read the cache
            self._stale = False  # compiled steps advanced the device lengths, not the host mirrors
            self._layout: dict = {}  # INT4's group_size and window (Cache sets them)

        @property
        def max_cache_len(self) -> int:  # a read-only property of transformers' Cache in some versions
            return self._capacity

        @property
        def is_compileable(self) -> bool:
            return self._compile

        def _state(self, layer):
            """The tensors the compiled-step ops take for `layer` (see _OWNERS)."""
            kv = self.kvs[layer]
            if kv.storage == "mixed":  # its parts' tensors (made at the first update)
                from ..kv import mixed

                return [kv.lengths, kv.k_shape, kv.v_shape, *mixed.tensors(kv, 0)]  # (the ops' fakes read 1, 2)
            state = [kv.lengths, kv.k[0], kv.v[0]]
            if kv.storage != "native":
                state += [kv.k_scale[0], kv.v_scale[0]]
            if kv.window:
                state += [kv.k_window[0], kv.v_window[0]]
            return state

        def _static(self, layer):
            """The layer's tensors at fixed addresses: CUDA graphs replay over them."""
            for x in self._state(layer):
                torch._dynamo.mark_static_address(x, guard=False)

        def _sync(self):
            """The host mirrors of the lengths, from the device, after compiled steps; a ValueError
            where those steps went past max_cache_len (they cannot raise themselves)."""
            for kv in self.kvs:
                if kv is not None:
                    kv.sync()
            self._stale = False
            longest = max((kv.length(s) for kv in self.kvs if kv is not None for s in self.seqs), default=0)
            if longest > self.max_cache_len:
                raise ValueError(f"max_cache_len={self.max_cache_len} was too short for the last generate(): "
                                 f"compiled steps appended up to {longest} tokens, and the steps past max_cache_len "
                                 f"were wrong; make the Cache with max_cache_len >= prompt + new tokens")

        def _update(self, layer, key_states, value_states):
            if torch.compiler.is_compiling():
                return self._update_compiled(layer, key_states, value_states)
            from ..kv import KVCache, PagedKVCache

            if self._stale:
                self._sync()
            b, hkv, t, d = key_states.shape
            if self.kvs and b != len(self.seqs):
                raise ValueError(f"this Cache holds a batch of {len(self.seqs)}, got {b}")
            while len(self.kvs) <= layer:
                self.kvs.append(None)
                self._masked.append(False)
                self._seen.append(False)
            kv = self.kvs[layer]
            if kv is None:
                if self.paged:
                    per_seq = -(-self.max_cache_len // self.page_size)
                    kv = PagedKVCache(1, hkv, d, b * per_seq, self.page_size, value_dim=value_states.shape[3],
                                      dtype=key_states.dtype, device=key_states.device, storage=self.storage,
                                      max_seqs=b, max_pages_per_seq=per_seq, **self._layout)
                    seqs = tuple(kv.add(reserve=self.max_cache_len) for _ in range(b))  # (no allocation in steps)
                else:
                    kv = KVCache(1, b, hkv, self.max_cache_len, d, value_dim=value_states.shape[3],
                                 dtype=key_states.dtype, device=key_states.device, storage=self.storage,
                                 page_size=self.page_size, **self._layout)
                    seqs = tuple(range(b))
                self.kvs[layer], self.seqs = kv, seqs
                ref = weakref.ref(self)
                _OWNERS[kv.lengths.data_ptr()] = (ref, layer)
                weakref.finalize(self, _forget, kv.lengths.data_ptr(), ref)
            before = kv.length(self.seqs[0])
            if before + t > self.max_cache_len:
                raise ValueError(f"max_cache_len={self.max_cache_len} is too short: layer {layer} would hold "
                                 f"{before + t} tokens")
            PagedKVCache.append(kv, 0, self.seqs, key_states, value_states)  # KVCache's own takes no seqs first
            if before == 0:  # (after the first append: storage="auto" makes its pools there)
                self._static(layer)
            n = self.max_cache_len if self._compile else before + t  # (as long as the masks transformers builds)
            if isinstance(kv, KVCache) and self.storage == "native":
                keys, values = kv.keys(0)[:, :, :n], kv.values(0)[:, :, :n]
            else:
                keys, values = self._placeholders(key_states, value_states, n)
            keys = keys.view_as(keys)  # a tensor object of its own, to carry the handle
            keys._adaattn_kv = _Handle(self, layer, before, key_states, value_states)
            return keys, values

        @staticmethod
        def _placeholders(key_states, value_states, n):
            b, hkv, _, d = key_states.shape
            nan = torch.full((1, 1, 1, 1), float("nan"), dtype=key_states.dtype, device=key_states.device)
            return nan.expand(b, hkv, n, d), nan.expand(b, hkv, n, value_states.shape[3])

        def _update_compiled(self, layer, key_states, value_states):
            if layer >= len(self.kvs) or self.kvs[layer] is None:
                raise RuntimeError("a compiled forward over an empty adaattn Cache: run the prompt uncompiled "
                                   "first (transformers' generate() does)")
            if not self._seen[layer]:
                raise RuntimeError("a compiled step over an adaattn Cache needs the model's attention to be "
                                   "attn_implementation='adaattn' (its prompt ran another attention function)")
            token = _append_op(key_states, value_states, self._state(layer))
            self._stale = True
            keys, values = self._placeholders(key_states, value_states, self.max_cache_len)
            keys = keys.view_as(keys)
            keys._adaattn_kv = _Handle(self, layer, None, key_states, value_states, token)
            return keys, values

        def _append_now(self, layer, key, value):
            """The append op's body: the append kernel reads and advances only the device lengths
            (a replayed graph runs no Python); the torch append (CPU) keeps the host mirror too."""
            from ..kv import PagedKVCache

            kv = self.kvs[layer]
            if kv.append_runner == "triton":
                kv._append_kernel(0, self.seqs, key, value)
            else:
                kv.sync()
                PagedKVCache.append(kv, 0, self.seqs, key, value)  # KVCache's own takes no seqs first

        def _decode_now(self, query, layer, scale):
            """The decode op's body: one plan per step shape for every length up to max_cache_len
            (lengths are read on the device, so a replayed graph serves every step)."""
            from ..api import decode_attention, plan_decode
            from ..kv.gathered import sdpa_gathered

            kv = self.kvs[layer]
            t, hq = query.shape[2], query.shape[1]
            key = ("static", t, hq, query.dtype)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plans[key] = plan_decode(kv, self.seqs, heads=hq, query_len=t, dtype=query.dtype,
                                                      runner=self.decode_runner, max_len=self.max_cache_len)
            self._last_plan, self._last_compiled = plan, True
            if plan.runner == "triton":
                try:
                    return decode_attention(query, kv, 0, scale=scale, plan=plan)
                finally:  # the split buffers live only in the call: a CUDA graph's pool may hold no tensor of ours
                    plan._scratch.clear()
            # The SDPA runner reads host lengths, which replays do not advance: the whole cache under
            # a mask of the device lengths instead.
            return sdpa_gathered(query, kv, 0, self.seqs, kv.lengths[0, plan.seq_ids.long()], self.max_cache_len,
                                 scale)

        def _plan(self, query, layer):
            """One plan per step shape and length bucket (a power of two), shared by every layer and
            reused across steps until the sequences outgrow the bucket."""
            from ..api import plan_decode

            t, hq = query.shape[2], query.shape[1]
            n = self.kvs[layer].length(self.seqs[0])
            bucket = min(self.max_cache_len, 1 << max(n - 1, 1).bit_length())
            key = (t, hq, bucket, query.dtype)
            plan = self._plans.get(key)
            if plan is None:
                if len(self._plans) > 32:
                    self._plans.clear()
                plan = self._plans[key] = plan_decode(self.kvs[layer], self.seqs, heads=hq, query_len=t, dtype=query.dtype,
                                                      runner=self.decode_runner, max_len=bucket)
            self._last_plan, self._last_compiled = plan, False
            return plan

        def explain(self) -> str:
            plan = getattr(self, "_last_plan", None)
            if plan is None:
                return getattr(self, "_dense_why", None) or "no decode step has run yet"
            if not self._last_compiled:
                return plan.explain()
            how = "" if plan.runner == "triton" else " (SDPA over the whole cache, masked by the device lengths)"
            return plan.explain() + f"; in a compiled step{how}, planned for max_cache_len"

        def reset(self):
            overflow = None
            if self._stale:  # an overflow in compiled steps is reported here, after the reset
                try:
                    self._sync()
                except ValueError as e:
                    overflow = e
            for kv in self.kvs:
                if kv is None:
                    continue
                if self.paged:
                    for s in reversed(self.seqs):
                        kv.free(s)
                    assert tuple(kv.add(reserve=self.max_cache_len) for _ in self.seqs) == self.seqs  # freed ids come back in order
                else:
                    kv.reset()
            self._plans.clear()
            self._masked = [False] * len(self._masked)
            self._seen = [False] * len(self._seen)
            # (_last_plan stays: a compiled step replays what it recorded, running no Python to say so)
            if overflow is not None:
                raise ValueError(f"{overflow} (this Cache is reset and usable)")

        def get_seq_length(self, layer_idx: int = 0):
            """Tokens cached in the layer: an int, or with a compileable cache a 0-dim device tensor
            (as transformers' StaticCache: no host sync between compiled steps)."""
            if layer_idx >= len(self.kvs) or self.kvs[layer_idx] is None:
                return 0
            kv = self.kvs[layer_idx]
            if self._compile:
                return kv.lengths[0, self.seqs[0]].long()
            if self._stale:
                self._sync()
            return kv.length(self.seqs[0])

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
            if self._compile:  # static shapes: the mask covers every slot (as StaticCache's)
                return self.max_cache_len, 0
            return self.get_seq_length(layer_idx) + query_length, 0

        def get_max_length(self, layer_idx=None) -> int:
            return self.max_cache_len

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            while len(self.layers) <= layer_idx:
                self.layers.append(_Layer(self, len(self.layers)))
            return self._update(layer_idx, key_states, value_states)

    return AdaattnCache


__all__ = ["Cache"]
