"""KV caches: pages of tokens per layer, a block table per sequence, stored in the model dtype or
quantized once at append (FP8 E4M3 or INT8 with one scale per (page, KV head); INT4 two values a
byte with a scale and a minimum per token and group of channels).

Layout per layer: keys and values are pools of shape (num_pages, page_size, Hkv, D) (token-major
pages, so a contiguous cache's pages of one sequence read as one (N, Hkv, D) tensor). A sequence
owns the pages its block-table row lists, in order; token t of a sequence sits in page
block_table[seq, t // page_size] at slot t % page_size. Lengths are per layer (each layer appends
its own keys and values during a step) and live on the device, with a host mirror for page
allocation, which is host work by nature.

`PagedKVCache` adds, extends and frees sequences independently (continuous batching);
`KVCache` is the contiguous case: a fixed batch whose sequences own consecutive pages from the
start, so its keys and values are also plain (B, Hkv, max_len, D) views.

Page summaries (`summaries=True`, for query-aware sparse decode, kv/sparse.py): per (page, KV
head), the sum of the page's keys and their per-channel min and max, fp32, of the keys as stored
(quantized keys dequantized, less their center), kept exact at every append. The sum over a
page's count is its centroid, whose score is a lower bound of the page's largest score (and, by
Jensen, count x exp(score) a lower bound of the page's softmax mass): it ranks pages. The min and
max bound every key's score from above (Quest's bound: sum over channels of max(q min, q max)).
They cost 3 x D floats per (page, KV head): 4.7% of a bf16 page of 64 keys and values at D=128.

Quantized pages (FP8, INT8): a page's scale is amax / QMAX over its tokens so far (per KV head).
An append that brings a larger value into a partly filled page rescales the page's stored values
to the new scale first (their error grows by at most one more rounding), so no value is ever
clipped.

INT4 pages: each token's values, per KV head, in groups of `group_size` channels (the largest power
of two up to it that divides the head dim), are stored as codes 0..15 over the group's range:
value = code x scale + minimum, the minimum rounded down and the scale (range / 15) rounded up to
bfloat16, so every value lies within the 16 levels. Codes pack two a byte (channel 2i in the low
nibble of byte i, 2i + 1 in the high one); scale and minimum sit in a (num_pages, page_size, Hkv,
D / group, 2) bfloat16 pool beside the codes. A token is written once: no page is ever rescaled.
Code x scale is exact in float32 (4 bits times bfloat16's 8), so the dequantized value is one
rounding of the sum, with or without a fused multiply-add. Groups of 16 measured 3-5 heads of 16
better than per-(page, head) scales or KIVI's per-channel keys at equal bytes on the shipped
GPT (benchmarks/NOTES.md, "INT4 layouts at equal bytes").

Window (`window=W`, INT4 only): each sequence's newest W tokens are kept a second time in the model
dtype, in a ring of W slots per sequence (token t in slot t % W, as appended), and every reader
(the split-KV kernel, gather) takes those tokens from the ring.
A decode query weighs its newest keys most; at 16k on the shipped GPT, a window of 512 brought 10
of 16 heads within 5e-2 where groups of 16 alone brought 1 (the same NOTES section). The ring costs
W x Hkv x (D + Dv) model-dtype values per sequence and layer, which for_budget counts. Page
summaries (sparse decode) stay those of the INT4 keys.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import append, mixed
from .formats import (INT4_GROUP, PER_PAGE, QMAX, STORAGES, _decode, _encode, _int4_decode, _int4_encode,  # noqa: F401
                      _quantize, check_layout, check_tolerance, int4_group, value_bytes)

APPENDS = ("auto", "triton", "torch")  # append: one Triton launch per layer (CUDA's default), or torch indexing


class PagedKVCache:
    """Keys and values of many sequences for `layers` layers, in pages of `page_size` tokens.

    storage: "native" (the model dtype `dtype`), "fp8" (E4M3), "int8" or "int4" (16 levels a value,
    two a byte, with a bfloat16 scale and minimum per token and `group_size` channels: 0.75 bytes a
    value at groups of 16, 0.5625 at 64, against bf16's 2), quantized at append; or a storage per
    (layer, KV head) among "int4", "int8" and "native" (a list per layer of one name per head), or
    "auto" with a `tolerance`: each layer's heads get the storage of fewest bytes whose error,
    measured at the layer's first decode step on its queries, is within it (kv/mixed.py). for_budget(...) sizes the
    pool by bytes.
    num_pages: pages per layer in the pool; max_seqs: sequences at once; max_pages_per_seq: the
    block table's width (default: every page). summaries: keep per-page key sums and per-channel
    bounds for sparse decode (the module's docstring).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_pages: int, page_size: int = 64, *,
                 value_dim: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", storage: str = "native", max_seqs: int = 256,
                 max_pages_per_seq: Optional[int] = None, append: str = "auto", summaries: bool = False,
                 group_size: Optional[int] = None, window: int = 0, tolerance: Optional[float] = None):
        for name, val in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                          ("num_pages", num_pages), ("page_size", page_size), ("max_seqs", max_seqs)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        per_head = mixed.check_storage(storage, layers, kv_heads)  # None: one storage for every head
        int4 = storage == "int4" or per_head == "auto" or (per_head is not None and any("int4" in r for r in per_head))
        if per_head == "auto":
            check_tolerance(tolerance)
        elif tolerance is not None:
            raise ValueError(f"tolerance={tolerance!r} is storage='auto''s, which chooses each head's storage under "
                             f"it; storage {storage!r} takes none")
        check_layout("auto" if per_head == "auto" else storage if per_head is None else "per head", group_size,
                     window, int4)
        if per_head is not None:
            if summaries:
                raise ValueError("summaries (sparse decode) are not kept for a cache with a storage per head yet")
            storage = "mixed"
        even = not (head_dim % 2 or (value_dim or head_dim) % 2)
        if int4 and not even and per_head != "auto":  # ("auto" then measures INT8 and the model dtype only)
            raise ValueError(f"storage 'int4' packs two values a byte: head_dim and value_dim must be even, got "
                             f"{head_dim} and {value_dim or head_dim}")
        if append not in APPENDS:
            raise ValueError(f"append must be one of {APPENDS}, got {append!r}")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        if not isinstance(summaries, bool):
            raise TypeError(f"summaries must be a bool, got {type(summaries).__name__}")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.value_dim = head_dim if value_dim is None else value_dim
        self.page_size, self.num_pages, self.max_seqs = page_size, num_pages, max_seqs
        self.max_pages_per_seq = num_pages if max_pages_per_seq is None else max_pages_per_seq
        self.dtype, self.storage, self.device = dtype, storage, torch.device(device)
        # INT4: channels per scale, keys and values (module docstring)
        group_size = INT4_GROUP if group_size is None else group_size
        self.group_size = group_size
        self.k_group, self.v_group = int4_group(group_size, head_dim), int4_group(group_size, self.value_dim)
        self.tolerance, self.window = tolerance, window
        if storage != "mixed":  # (a mixed cache's pools are its layers' parts: kv/mixed.py)
            self._pools(layers, num_pages, page_size, kv_heads, head_dim, dtype, storage, max_seqs, window)
        self.summaries = summaries
        if summaries:  # (num_pages, Hkv, D) fp32 each: key sums, per-channel min and max (see the module's docstring)
            self.k_sum = [torch.zeros(num_pages, kv_heads, head_dim, device=self.device) for _ in range(layers)]
            self.k_min = [torch.zeros(num_pages, kv_heads, head_dim, device=self.device) for _ in range(layers)]
            self.k_max = [torch.zeros(num_pages, kv_heads, head_dim, device=self.device) for _ in range(layers)]
        self.block_table = torch.zeros(max_seqs, self.max_pages_per_seq, dtype=torch.int32, device=self.device)
        self.lengths = torch.zeros(layers, max_seqs, dtype=torch.int32, device=self.device)
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._pages_owned = False  # pages are taken as sequences grow (KVCache: owned from the start)
        self._sites: dict = {}  # the append and decode kernels' launches per layout (bound.site_launch)
        self._free_seqs = list(range(max_seqs - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}  # sequence -> its pages, in order (host mirror)
        self._lengths = [[0] * max_seqs for _ in range(layers)]  # host mirror of self.lengths
        self._count = torch.zeros(max_seqs, dtype=torch.int32, device=self.device)  # append kernel's counters
        self._seq_ids: dict[tuple[int, ...], torch.Tensor] = {}
        self._sparse_sites: dict = {}  # layer -> kv.sparse.SparseSite (sparse decode's thresholds)
        if append == "auto":
            append = "triton" if self.device.type == "cuda" else "torch"
        self.append_runner = append
        # per layer, its heads by storage (kv/mixed.py); "auto": held in the model dtype from the layer's first
        # append, chosen at its first decode step
        self._mixed: list = []
        if storage == "mixed":
            self.k = self.v = []
            # empty tensors of the pools' shapes (Hkv, D and Dv), for what reads shapes off a pool
            self.k_shape = torch.empty(0, 0, kv_heads, head_dim, dtype=dtype, device=self.device)
            self.v_shape = torch.empty(0, 0, kv_heads, self.value_dim, dtype=dtype, device=self.device)
            self._mixed = [None if per_head == "auto" else mixed.Layer(self, row) for row in
                           (per_head if per_head != "auto" else [None] * layers)]

    def _part(self, heads: int, storage: str) -> "PagedKVCache":
        """A one-layer cache of `heads` KV heads in `storage`, sharing this cache's block table and
        pages (kv/mixed.py)."""
        int4 = storage == "int4"
        part = PagedKVCache(1, heads, self.head_dim, self.num_pages, self.page_size, value_dim=self.value_dim,
                            dtype=self.dtype, device=self.device, storage=storage, max_seqs=self.max_seqs,
                            max_pages_per_seq=self.max_pages_per_seq, append=self.append_runner,
                            group_size=self.group_size if int4 else None, window=self.window if int4 else 0)
        part.block_table, part._pages, part._pages_owned = self.block_table, self._pages, True
        part._free_pages, part._free_seqs = [], []
        return part

    def all_storages(self) -> str:
        """storages() of every layer, one clause each."""
        return "; ".join(f"layer {i}: {self.storages(i)}" for i in range(self.layers))

    def storages(self, layer: int) -> str:
        """What `layer`'s heads hold, and for a per-head cache which storage each head holds and why
        (with "auto", the errors measured at the layer's first decode step)."""
        if self.storage != "mixed":
            return f"{self.storage} for every head"
        here = self._mixed[layer]
        return ("nothing held yet (storage='auto': chosen at the layer's first decode step)" if here is None
                else here.describe())

    def _pools(self, layers, num_pages, page_size, kv_heads, head_dim, dtype, storage, max_seqs, window) -> None:
        """The pools of one storage for every head: keys and values, their scales and centres
        (quantized storages), INT4's window rings."""
        store = {"native": dtype, "fp8": torch.float8_e4m3fn, "int8": torch.int8, "int4": torch.uint8}[storage]
        shape = (num_pages, page_size, kv_heads)
        width = 2 if storage == "int4" else 1  # values a stored element holds
        self.k = [torch.zeros((*shape, head_dim // width), dtype=store, device=self.device)
                  for _ in range(layers)]
        self.v = [torch.zeros((*shape, self.value_dim // width), dtype=store, device=self.device)
                  for _ in range(layers)]
        if storage == "int4":  # (scale, minimum) per token and group, bfloat16
            self.k_scale = [torch.zeros(*shape, head_dim // self.k_group, 2, dtype=torch.bfloat16, device=self.device)
                            for _ in range(layers)]
            self.v_scale = [torch.zeros(*shape, self.value_dim // self.v_group, 2, dtype=torch.bfloat16,
                                        device=self.device) for _ in range(layers)]
        elif storage != "native":
            self.k_scale = [torch.zeros(num_pages, kv_heads, device=self.device) for _ in range(layers)]
            self.v_scale = [torch.zeros(num_pages, kv_heads, device=self.device) for _ in range(layers)]
        if storage != "native":
            # Each sequence's keys are stored less their mean over its first append (per layer and KV
            # head): attention is unchanged (q.c is the same for every key of a query's row), and
            # the quantized residuals are smaller than the keys where keys share an offset.
            self.k_center = [torch.zeros(max_seqs, kv_heads, head_dim, device=self.device) for _ in range(layers)]
        if window:  # the newest tokens' ring, per sequence (module docstring)
            self.k_window = [torch.zeros(max_seqs, window, kv_heads, head_dim, dtype=dtype, device=self.device)
                             for _ in range(layers)]
            self.v_window = [torch.zeros(max_seqs, window, kv_heads, self.value_dim, dtype=dtype, device=self.device)
                             for _ in range(layers)]

    @staticmethod
    def page_bytes(kv_heads: int, head_dim: int, page_size: int = 64, *, value_dim: Optional[int] = None,
                   dtype: torch.dtype = torch.bfloat16, storage: str = "native", summaries: bool = False,
                   group_size: int = INT4_GROUP) -> int:
        """Bytes one page takes in one layer: keys and values in the storage with their scales
        (FP8/INT8: one fp32 per (page, KV head); INT4: per token and group) and the page summaries
        (summaries=True)."""
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
        dv = head_dim if value_dim is None else value_dim
        total = page_size * kv_heads * (head_dim * value_bytes(storage, dtype, head_dim, group_size)
                                         + dv * value_bytes(storage, dtype, dv, group_size))
        if storage in PER_PAGE:
            total += 2 * kv_heads * 4  # fp32 key and value scales
        if summaries:
            total += 3 * kv_heads * head_dim * 4
        return int(total)

    @classmethod
    def for_budget(cls, budget_bytes: int, layers: int, kv_heads: int, head_dim: int, page_size: int = 64,
                   **kwargs) -> "PagedKVCache":
        """A cache whose page pools (all layers) take at most `budget_bytes`: as many pages as fit
        at its storage (kwargs as the constructor's; `capacity` then says how many tokens). The
        block table, lengths and each sequence's key centre are extra, a few bytes a page."""
        keep = {k: kwargs[k] for k in ("value_dim", "dtype", "summaries", "group_size") if kwargs.get(k) is not None}
        storage = kwargs.get("storage", "native")
        per_head = mixed.check_storage(storage, layers, kv_heads)
        if per_head == "auto":
            raise ValueError("for_budget needs the storages to size the pool: storage='auto' chooses them at each "
                             "layer's first decode step; give the storage per (layer, KV head) expected")
        if per_head is None:
            per_page = layers * cls.page_bytes(kv_heads, head_dim, page_size, storage=storage, **keep)
        else:
            per_page = sum(cls.page_bytes(1, head_dim, page_size, storage=x, **keep) for row in per_head for x in row)
        window = kwargs.get("window", 0)
        rings = 0
        if isinstance(window, int) and window > 0:  # every sequence's ring of the newest tokens, every layer
            item = torch.empty((), dtype=kwargs.get("dtype", torch.bfloat16)).element_size()
            dv = kwargs.get("value_dim") or head_dim
            held = layers * kv_heads if per_head is None else sum(r.count("int4") for r in per_head)  # INT4 heads
            rings = kwargs.get("max_seqs", 256) * window * held * (head_dim + dv) * item
        pages = (int(budget_bytes) - rings) // per_page
        if pages < 1:
            raise ValueError(f"budget_bytes {budget_bytes} holds no page: one page of every layer takes {per_page}"
                             + (f", after the windows' {rings} bytes" if rings else ""))
        return cls(layers, kv_heads, head_dim, pages, page_size, **kwargs)

    @property
    def capacity(self) -> int:
        """Tokens the pool holds, over all sequences (pages times page size)."""
        return self.num_pages * self.page_size

    # ---- sequences -------------------------------------------------------------------------

    def add(self, reserve: int = 0) -> int:
        """A new empty sequence (its id), with pages reserved for `reserve` tokens."""
        if not self._free_seqs:
            raise RuntimeError(f"PagedKVCache holds max_seqs={self.max_seqs} sequences already; free one first")
        seq = self._free_seqs.pop()
        self._pages[seq] = []
        for layer in range(self.layers):
            self._lengths[layer][seq] = 0
        self.lengths[:, seq] = 0
        self._forget(seq)
        mixed.forget(self, seq)
        try:
            self.reserve(seq, reserve)
        except (ValueError, RuntimeError):  # a reservation that does not fit adds no sequence
            self.free(seq)
            raise
        return seq

    def reserve(self, seq: int, tokens: int) -> None:
        """Make room for `tokens` more tokens of `seq` (beyond its longest layer)."""
        self._check_seq(seq)
        longest = max(self._lengths[layer][seq] for layer in range(self.layers))
        self._check_room(seq, longest, tokens)
        self._ensure(seq, longest + tokens)

    def free(self, seq: int) -> None:
        """Give a sequence's pages back; its id may be reused by a later add()."""
        self._check_seq(seq)
        pages = self._pages.pop(seq)
        if self.storage in PER_PAGE and pages:  # a reused page starts from a fresh scale
            for sc in (*self.k_scale, *self.v_scale):
                sc[pages] = 0
        self._free_pages.extend(reversed(pages))
        self._free_seqs.append(seq)
        for layer in range(self.layers):
            self._lengths[layer][seq] = 0
        self.lengths[:, seq] = 0
        self._forget(seq)
        mixed.forget(self, seq, pages)

    def _forget(self, seq: int) -> None:
        """Sparse decode's thresholds for this sequence slot start over (a new or emptied sequence)."""
        for site in self._sparse_sites.values():
            site.forget(seq)

    def length(self, seq: int, layer: int = 0) -> int:
        """Tokens of `seq` cached in `layer` (host mirror)."""
        self._check_seq(seq)
        return self._lengths[layer][seq]

    def pages_of(self, seq: int) -> list[int]:
        self._check_seq(seq)
        return list(self._pages[seq])

    def _check_seq(self, seq: int) -> None:
        if seq not in self._pages:
            raise ValueError(f"sequence {seq!r} is not in this cache (add() returns the ids in use)")

    def _max_len(self) -> tuple[int, str]:
        """The most tokens one sequence may hold, and where that limit comes from."""
        return (self.max_pages_per_seq * self.page_size,
                f"max_pages_per_seq={self.max_pages_per_seq} pages of page_size={self.page_size}")

    def _check_room(self, seq: int, held: int, more: int, layer: Optional[int] = None) -> None:
        """A ValueError where `held` + `more` tokens would not fit one sequence. `held` is the host
        mirror of the lengths (no device read); appends replayed in a CUDA graph advance only the
        device lengths, so those are checked after sync() by their owner (integrations/hf_cache.py)."""
        cap, why = self._max_len()
        if held + more > cap:
            where = f"sequence {seq}" + ("" if layer is None else f" of layer {layer}")
            raise ValueError(f"{where} holds {held} tokens; {more} more would make {held + more}, over "
                             f"max_len={cap}, the most this {type(self).__name__} holds per sequence"
                             + (f" ({why})" if why else ""))

    def _ensure(self, seq: int, tokens: int) -> None:
        """Pages for `tokens` tokens of `seq` (within max_len: _check_room first)."""
        pages = self._pages[seq]
        need = -(-tokens // self.page_size)
        if need - len(pages) > len(self._free_pages):
            raise RuntimeError(f"PagedKVCache is out of pages: {need - len(pages)} more needed, "
                               f"{len(self._free_pages)} free of {self.num_pages}")
        new = [self._free_pages.pop() for _ in range(need - len(pages))]
        if new:
            first = len(pages)
            pages.extend(new)
            self.block_table[seq, first:first + len(new)] = torch.tensor(new, dtype=torch.int32)

    # ---- append ----------------------------------------------------------------------------

    def append(self, layer: int, seqs: Sequence[int], key: torch.Tensor, value: torch.Tensor) -> None:
        """Write `key` (S, Hkv, T, D) and `value` (S, Hkv, T, Dv) after what `layer` holds for
        each of the S sequences `seqs` (pages allocated as needed; quantized pages rescaled)."""
        seqs = [int(s) for s in seqs]
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer must be in [0, {self.layers}), got {layer}")
        want = (len(seqs), self.kv_heads)
        if key.dim() != 4 or tuple(key.shape[:2]) != want or key.shape[3] != self.head_dim:
            raise ValueError(f"key must be (S={len(seqs)}, Hkv={self.kv_heads}, T, D={self.head_dim}), got "
                             f"{tuple(key.shape)}")
        if value.dim() != 4 or tuple(value.shape[:3]) != tuple(key.shape[:3]) or value.shape[3] != self.value_dim:
            raise ValueError(f"value must be (S, Hkv, T, Dv={self.value_dim}) like key {tuple(key.shape)}, got "
                             f"{tuple(value.shape)}")
        if len(set(seqs)) != len(seqs):
            raise ValueError("seqs must not repeat a sequence")
        t = key.shape[2]
        if t == 0:
            return
        # Every sequence is checked before any page is taken (in one pass each: a decode step
        # appends one token to every sequence of the batch, and its host time is the step's).
        for s in seqs:
            if s not in self._pages:
                self._check_seq(s)
        lengths = self._lengths[layer]
        held = [lengths[s] for s in seqs]
        if held and max(held) + t > self._max_len()[0]:
            for s, n in zip(seqs, held):
                self._check_room(s, n, t, layer)
        if not self._pages_owned:
            for s, n in zip(seqs, held):
                self._ensure(s, n + t)
        key, value = key.to(self.device), value.to(self.device)
        if self.storage == "mixed":  # each part writes its heads (and sets its own centres)
            mixed.append(self, layer, seqs, key, value)
            for s in seqs:
                lengths[s] += t
            return
        first = [i for i, n in enumerate(held) if n == 0]  # empty rows: their append sets the keys' center
        if first and self.storage != "native":
            rows = torch.tensor(first, device=self.device)
            ids = torch.tensor([seqs[i] for i in first], device=self.device)
            self.k_center[layer][ids] = key.index_select(0, rows).float().mean(2)
        if self.append_runner == "triton":
            self._append_kernel(layer, seqs, key, value)
        else:
            self._append_torch(layer, seqs, key, value)
        for s in seqs:
            lengths[s] += t

    def seq_ids(self, seqs: Sequence[int]) -> torch.Tensor:
        """`seqs` as an int32 device tensor, made once per distinct list (so that a step replayed in
        a CUDA graph copies nothing from the host)."""
        key = tuple(seqs)
        ids = self._seq_ids.get(key)
        if ids is None:
            if len(self._seq_ids) >= 64:
                self._seq_ids.clear()
            ids = self._seq_ids[key] = torch.tensor(key, dtype=torch.int32, device=self.device)
        return ids

    def sync(self) -> None:
        """Read the device lengths into the host mirror (after replaying captured appends, which
        advance only the device lengths)."""
        host = self.lengths.tolist()
        for layer in range(self.layers):
            self._lengths[layer] = list(host[layer])
        mixed.sync(self)

    def _append_kernel(self, layer, seqs, key, value) -> None:
        if self.storage == "mixed":  # (a compiled step's append: the device lengths only)
            mixed.append_kernel(self, layer, seqs, key, value)
        else:
            append.write_kernel(self, layer, seqs, key, value)

    def _append_torch(self, layer, seqs, key, value) -> None:
        append.write_torch(self, layer, seqs, key, value)

    # ---- reading -----------------------------------------------------------------------------

    def gather(self, layer: int, seqs: Sequence[int] | torch.Tensor, length: int, dtype: Optional[torch.dtype] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `seqs` as (S, Hkv, length, D) tensors in `dtype` (default the
        model dtype; quantized pages dequantized), padded past each sequence's own length."""
        dtype = self.dtype if dtype is None else dtype
        if isinstance(seqs, torch.Tensor):
            sid = seqs.to(device=self.device, dtype=torch.long)
        else:  # the device copy made once per list (no host-to-device copy in a captured step)
            sid = self.seq_ids([int(s) for s in seqs]).long()
        if self.storage == "mixed":
            return mixed.gather(self, layer, sid, length, dtype)
        pages = -(-length // self.page_size)
        table = self.block_table[sid, :pages].long()  # (S, P)
        out = []
        quantized = self.storage != "native"
        for pool, scales, center, ring in ((self.k[layer], self.k_scale[layer] if quantized else None,
                                            self.k_center[layer][sid][:, None, None] if quantized else None,
                                            self.k_window[layer] if self.window else None),
                                           (self.v[layer], self.v_scale[layer] if quantized else None, None,
                                            self.v_window[layer] if self.window else None)):
            x = pool[table]  # (S, P, page, Hkv, D)
            if scales is None:
                x = x.to(dtype)
            elif self.storage == "int4":
                x = _int4_decode(x, scales[table])
                x = x if center is None else x + center
                if self.window:  # the newest tokens from the ring
                    x = self._windowed(x.reshape(len(sid), -1, *x.shape[3:]), layer, sid, ring).view(x.shape)
                x = x.to(dtype)
            else:
                x = _decode(x, self.storage) * scales[table][:, :, None, :, None]
                x = (x if center is None else x + center).to(dtype)
            x = x.reshape(len(sid), pages * self.page_size, self.kv_heads, -1)[:, :length]
            out.append(x.transpose(1, 2))
        return out[0], out[1]

    def _windowed(self, x: torch.Tensor, layer: int, sid: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
        """x (S, N, Hkv, D) float32 values of `sid`'s tokens from the pages, with each sequence's
        newest `window` tokens (positions len - W .. len - 1, by the device lengths) from its ring."""
        n = x.shape[1]
        pos = torch.arange(n, device=self.device)[None, :]
        lens = self.lengths[layer][sid].long()[:, None]
        newest = (pos >= lens - self.window) & (pos < lens)  # (S, N)
        from_ring = ring[sid[:, None], pos % self.window].float()  # (S, N, Hkv, D)
        return torch.where(newest[:, :, None, None], from_ring, x)


class KVCache(PagedKVCache):
    """A contiguous cache for a fixed batch: sequence b owns pages b*P .. b*P+P-1 from the start
    (P pages of `page_size` for `max_len` tokens), so keys(layer) and values(layer) are plain
    (B, Hkv, max_len, D) views of the pools (native storage)."""

    def __init__(self, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, *,
                 value_dim: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", storage: str = "native", page_size: int = 64,
                 append: str = "auto", summaries: bool = False, group_size: Optional[int] = None, window: int = 0,
                 tolerance: Optional[float] = None):
        for name, val in (("batch", batch), ("max_len", max_len), ("page_size", page_size)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        per_seq = -(-max_len // page_size)
        super().__init__(layers, kv_heads, head_dim, batch * per_seq, page_size, value_dim=value_dim, dtype=dtype,
                         device=device, storage=storage, max_seqs=batch, max_pages_per_seq=per_seq, append=append,
                         summaries=summaries, group_size=group_size, window=window, tolerance=tolerance)
        self.batch, self.max_len = batch, max_len
        self._free_pages = []  # every page belongs to its sequence from the start
        self._pages_owned = True  # (so an append takes none: _ensure would find nothing to do)
        for b in range(batch):
            seq = self._free_seqs.pop()
            assert seq == b
            self._pages[b] = list(range(b * per_seq, (b + 1) * per_seq))
        self.block_table.copy_(torch.arange(batch * per_seq, dtype=torch.int32, device=self.device)
                               .view(batch, per_seq))

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor, seqs: Optional[Sequence[int]] = None) -> None:
        """Write `key` (B, Hkv, T, D) and `value` after what `layer` holds (every sequence of the
        batch by default)."""
        super().append(layer, range(self.batch) if seqs is None else seqs, key, value)

    def _max_len(self) -> tuple[int, str]:
        return self.max_len, ""

    def free(self, seq: int) -> None:
        raise TypeError("KVCache holds a fixed batch; use reset(seq) to empty a sequence, or PagedKVCache")

    def reset(self, seq: Optional[int] = None) -> None:
        """Empty one sequence (or all): its length goes to 0, its pages stay its own."""
        for s in (range(self.batch) if seq is None else (seq,)):
            self._check_seq(s)
            for layer in range(self.layers):
                self._lengths[layer][s] = 0
            self.lengths[:, s] = 0
            self._forget(s)
            mixed.forget(self, s, self._pages[s])
            if self.storage in PER_PAGE:
                for sc in (*self.k_scale, *self.v_scale):
                    sc[self._pages[s]] = 0

    def keys(self, layer: int) -> torch.Tensor:
        """(B, Hkv, max_len, D) view of the keys (native storage only)."""
        return self._view(self.k[layer])

    def values(self, layer: int) -> torch.Tensor:
        return self._view(self.v[layer])

    def _view(self, pool: torch.Tensor) -> torch.Tensor:
        if self.storage != "native":
            raise TypeError(f"a {self.storage} cache has no model-dtype view; use gather(...)")
        per_seq = self.max_pages_per_seq
        x = pool.view(self.batch, per_seq * self.page_size, self.kv_heads, pool.shape[-1])[:, :self.max_len]
        return x.transpose(1, 2)
