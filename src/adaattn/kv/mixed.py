"""Storage per KV head: a layer whose heads hold different storages (INT4, INT8 or the model dtype),
chosen by the caller or, with storage="auto", from the error each storage measures at the layer's
first decode step, under a tolerance.

A mixed layer keeps one single-layer cache per storage it holds ("part"), of that storage's heads
only, so each part's pool takes its own bytes. The parts share the cache's block table and page
list (a page id means the same tokens in every part) and keep their own lengths, which advance
with the cache's. An append writes each part (one launch a part); the split-KV kernel reads every
head in one launch, each program branching on its head's storage (kernels/decode.py, MIXED).

The choice ("auto"): a layer's first appends (the prompts) are held in the model dtype until its
first decode step, whose queries are the first an append's keys meet. Then, per head, the storage
of fewest bytes whose output error, measured on those queries against the keys and values held
(kv/choose.py, each sequence of the step, the largest error), is within the tolerance; every
sequence's tokens move to the chosen storages (a one-time cost, outside a CUDA graph: the first
decode step of a layer must not be captured). The prompt's own keys as queries do not do: they
sit in INT4's window, and on the shipped GPT at 16k they measured every head within 5e-2 where the
model's queries found 5 of 16 above it (benchmarks/NOTES.md). Fewer than MIN_PROMPT tokens
measure nothing worth trusting: such a layer keeps the model dtype. Where the keys held are fewer
than 4 windows, INT4 is measured without its window (the window will be a smaller share of a longer
sequence). INT4 is not a candidate where the head dims are odd (it packs two values a byte), nor
on CUDA while its decode kernel measures slower than the model dtype's (CUDA_DECODE_TIME). The
choice holds for the cache's life (a sequence freed or reset keeps it); a head whose error drifts
past the tolerance later is not yet moved up a level. A pending layer holds full model-dtype pools,
and the move allocates the chosen ones before it frees those: the peak is a model-dtype cache's.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

import torch

from .choose import choose_storages, storage_errors
from .formats import PER_PAGE, STORAGES

MIXED = ("native", "int8", "int4")  # what a mixed layer's heads may hold (one kernel branch each)
CODES = {"native": 0, "int8": 2, "int4": 3}  # kernels/decode.py's HS codes
# The split-KV kernel's time over a storage against the model dtype's, in CUDA graphs at B16 Hkv8
# 32k (H200, benchmarks/NOTES.md): INT8 0.86x at head dim 64 (289 vs 336 us) and 0.86x at 128
# (session 41); INT4 in groups of 16, with its scales in one load a token and the window's ring
# read only where reached (session 41), 1.13x and 1.14x (381, 647 us), with a window of 512 1.48x
# and 1.95x; groups of 64 0.96x and 1.06x (the kernel before: 1.74x and 2.05x at groups of 16).
# On CUDA a storage slower than the model dtype is no candidate: an approximation that is slower
# than exact must not run. (On the CPU, unmeasured, the fewest bytes decide.)
CUDA_DECODE_TIME = {"native": 1.0, "int8": 0.86, "int4": 1.13}
MIN_PROMPT = 64  # the fewest tokens a layer's first decode step must meet for "auto" to measure on
_SERIALS = itertools.count()  # each Layer's own number (a kernel launch site's key: ids are reused)


def check_storage(storage: Any, layers: int, kv_heads: int) -> Optional[tuple]:
    """None for a single storage name; "auto" as it is; per-layer per-head names as a tuple of
    tuples (a ValueError naming what is wrong otherwise)."""
    if isinstance(storage, str):
        if storage == "auto" or storage in STORAGES:
            return storage if storage == "auto" else None
        raise ValueError(f"storage must be one of {STORAGES}, 'auto', or one storage per (layer, KV head), got "
                         f"{storage!r}")
    try:
        rows = tuple(tuple(row) for row in storage)
    except TypeError:
        raise ValueError(f"storage must be a name or one storage per (layer, KV head), got {storage!r}") from None
    if any(isinstance(row, str) for row in storage):
        raise ValueError(f"storage per head is a list per layer of one name per KV head (e.g. [['int4', 'int8']]), "
                         f"got {storage!r}")
    if len(rows) != layers or any(len(row) != kv_heads for row in rows):
        raise ValueError(f"storage per head must be {layers} layer(s) of {kv_heads} KV head(s), got "
                         f"{[len(r) for r in rows]}")
    for row in rows:
        for name in row:
            if name not in MIXED:
                raise ValueError(f"a head's storage must be one of {MIXED}, got {name!r}")
    return rows


class Layer:
    """One layer's heads by storage: `parts` storage -> (heads, its one-layer cache), the device
    maps the kernel reads (`code`, `index`: per head, its storage's code and its index in that
    part), and, where "auto" chose, the errors measured and why."""

    def __init__(self, cache, storages: tuple, errors: Optional[dict] = None, why: str = "", pending: bool = False):
        self.storages, self.errors, self.why, self.pending = storages, errors, why, pending
        self.serial = next(_SERIALS)
        self.parts: dict[str, tuple[list[int], Any]] = {}
        index = [0] * len(storages)
        for s in MIXED:
            heads = [h for h, x in enumerate(storages) if x == s]
            if not heads:
                continue
            part = cache._part(len(heads), s)
            for i, h in enumerate(heads):
                index[h] = i
            self.parts[s] = (heads, part)
        dev = cache.device
        self.code = torch.tensor([CODES[s] for s in storages], dtype=torch.int32, device=dev)
        self.index = torch.tensor(index, dtype=torch.int32, device=dev)
        self.heads = {s: torch.tensor(h, dtype=torch.long, device=dev) for s, (h, _) in self.parts.items()}

    def describe(self) -> str:
        counts = ", ".join(f"{s} {len(h)}" for s, (h, _) in self.parts.items())
        line = f"{counts} of {len(self.storages)} heads: {list(self.storages)}"
        if self.errors:
            line += "; measured " + ", ".join(f"{s} {[round(float(x), 4) for x in e]}" for s, e in self.errors.items())
        return line + (f" ({self.why})" if self.why else "")


def slower_than_exact(device_type: str) -> list[str]:
    """The storages whose decode kernel measured slower than the model dtype's on this device type
    (CUDA_DECODE_TIME): no candidates for "auto" there."""
    if device_type != "cuda":
        return []
    return [s for s, t in CUDA_DECODE_TIME.items() if t > CUDA_DECODE_TIME["native"]]


def settle(cache, layer: int, query: torch.Tensor, seqs: Sequence[int]) -> None:
    """A pending layer's storages chosen from `query` (S, Hq, T, D), the rows of `seqs`, and its
    tokens moved to them (module docstring); nothing for a layer already chosen."""
    here = cache._mixed[layer]
    if here is None or not here.pending:
        return
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"layer {layer} of a storage='auto' cache chooses its storages at its first decode step, "
                           "which moves its tokens (allocations): run that step outside CUDA-graph capture")
    cache.sync()  # (the host lengths, after any replayed appends)
    lengths = [cache._lengths[layer][s] for s in seqs]
    if max(lengths) < MIN_PROMPT:  # the model dtype it holds already, for good
        here.pending = False
        here.why = f"its first decode step met {max(lengths)} tokens, fewer than {MIN_PROMPT} to measure on"
        return
    even = not (cache.head_dim % 2 or cache.value_dim % 2)
    slower = slower_than_exact(query.device.type)
    candidates = tuple(c for c in (("int4", "int8") if even else ("int8",)) if c not in slower)
    worst: dict = {}
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        if n == 0 or not candidates:
            continue
        k, v = gather(cache, layer, cache.seq_ids([s]), n, cache.dtype)
        window = cache.window if n >= 4 * cache.window else 0
        errors = storage_errors(k, v, query[i:i + 1], storages=candidates, page_size=cache.page_size,
                                group_size=cache.group_size, window=window)
        for name, e in errors.items():
            worst[name] = e if name not in worst else torch.maximum(worst[name], e)
    chosen = tuple(choose_storages(worst, cache.tolerance, cache.dtype)) if worst else ("native",) * cache.kv_heads
    n = max(lengths)
    why = (f"chosen at its first decode step ({n} tokens, its {query.shape[2]} query row(s)) under tolerance "
           f"{cache.tolerance:g}" + ("" if n >= 4 * cache.window or not cache.window or "int4" not in candidates
                                     else f"; INT4 measured without its window of {cache.window}")
           + "".join(f"; {c} no candidate on {query.device.type}: its decode kernel measured {CUDA_DECODE_TIME[c]:g}x the model "
                     f"dtype's time (H200)" for c in slower))
    cache._mixed[layer] = _moved(cache, layer, Layer(cache, chosen, worst, why))


def _moved(cache, layer: int, new: Layer) -> Layer:
    """`new` holding every token the layer's current parts hold, sequence by sequence."""
    held = [(s, cache._lengths[layer][s]) for s in cache._pages if cache._lengths[layer][s] > 0]
    old = [(s, n, *gather(cache, layer, cache.seq_ids([s]), n, cache.dtype)) for s, n in held]
    for s, n, k, v in old:
        for name, (_, part) in new.parts.items():
            heads = new.heads[name]
            part.append(0, [s], k.index_select(1, heads), v.index_select(1, heads))
    return new


def append(cache, layer: int, seqs: Sequence[int], key: torch.Tensor, value: torch.Tensor) -> None:
    """Write each part's heads (the cache's append checked and allocated already), then advance the
    cache's own device lengths."""
    if cache._mixed[layer] is None:  # "auto": held in the model dtype until the layer's first decode step chooses
        cache._mixed[layer] = Layer(cache, ("native",) * cache.kv_heads, None,
                                    "pending: chosen at the layer's first decode step, from its queries", pending=True)
    _write(cache, layer, seqs, key, value, compiled=False)


def append_kernel(cache, layer: int, seqs: Sequence[int], key: torch.Tensor, value: torch.Tensor) -> None:
    """A compiled step's append (no host state): each part's kernel on its heads, then the cache's
    device lengths."""
    _write(cache, layer, seqs, key, value, compiled=True)


def _write(cache, layer: int, seqs: Sequence[int], key: torch.Tensor, value: torch.Tensor, compiled: bool) -> None:
    """Each part's heads appended (compiled: its kernel alone, no host state), then the cache's own
    device lengths of `seqs` in `layer` advanced (its parts keep theirs)."""
    here = cache._mixed[layer]
    for s, (_, part) in here.parts.items():
        heads = here.heads[s]
        write = part._append_kernel if compiled else part.append
        write(0, seqs, key.index_select(1, heads), value.index_select(1, heads))
    add = torch.full((len(seqs),), key.shape[2], dtype=torch.int32, device=cache.device)
    cache.lengths[layer].index_add_(0, cache.seq_ids(seqs), add)


def gather(cache, layer: int, sid: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    here = cache._mixed[layer]
    k = torch.zeros(len(sid), cache.kv_heads, length, cache.head_dim, dtype=dtype, device=cache.device)
    v = torch.zeros(len(sid), cache.kv_heads, length, cache.value_dim, dtype=dtype, device=cache.device)
    if here is None:
        return k, v
    for s, (_, part) in here.parts.items():
        pk, pv = part.gather(0, sid, length, dtype)
        k[:, here.heads[s]] = pk
        v[:, here.heads[s]] = pv
    return k, v


def key_centre(cache, layer: int) -> torch.Tensor:
    """(max_seqs, Hkv, D) fp32: the centre each head's stored keys are less of (zero for the
    model-dtype heads)."""
    out = torch.zeros(cache.max_seqs, cache.kv_heads, cache.head_dim, device=cache.device)
    here = cache._mixed[layer]
    for s, (_, part) in (here.parts.items() if here is not None else ()):
        if s != "native":
            out[:, here.heads[s]] = part.k_center[0]
    return out


def forget(cache, seq: int, pages: Sequence[int] = ()) -> None:
    """A sequence emptied (added, freed or reset): each part's lengths for it go to 0, and the
    per-page scales of `pages` (given back) start afresh."""
    for here in cache._mixed:
        for s, (_, part) in (here.parts.items() if here is not None else ()):
            part._lengths[0][seq] = 0
            part.lengths[0, seq] = 0
            if s in PER_PAGE and pages:
                part.k_scale[0][list(pages)] = 0
                part.v_scale[0][list(pages)] = 0


def sync(cache) -> None:
    for here in cache._mixed:
        for _, part in (here.parts.values() if here is not None else ()):
            part.sync()


def tensors(cache, layer: int) -> list[torch.Tensor]:
    """Every tensor a mixed layer's reads and writes touch (a compiled step's static addresses)."""
    here = cache._mixed[layer]
    out = []
    for _, part in (here.parts.values() if here is not None else ()):
        out += [part.lengths, part.k[0], part.v[0]]
        if part.storage != "native":
            out += [part.k_scale[0], part.v_scale[0], part.k_center[0]]
        if part.window:
            out += [part.k_window[0], part.v_window[0]]
    return out


def uniform_part(cache, layer: int):
    """The one-layer cache that holds every head of `layer` where they all hold one storage (in head
    order), else None. Such a layer decodes through that storage's own kernel path, not the MIXED
    branch: on an H200 the branch per head cost 30-35% over plain INT4 (benchmarks/NOTES.md,
    "Session 40"), and plain INT8 reads with fp16 operands and its scales after the dot."""
    here = cache._mixed[layer]
    if here is None or len(here.parts) != 1:
        return None
    (_, part), = here.parts.values()
    return part


def kernel_args(cache, layer: int, placeholder: torch.Tensor) -> dict:
    """The split-KV kernel's MIXED arguments for `layer` (kernels/decode.py): "pools", the INT4 part's
    K, V, KS, VS (the caller passes them and their pools' strides), and "kw", the rest: the head
    maps, the INT4 scales' strides, groups and window, the model-dtype and INT8 parts' pools.
    `placeholder` stands for a part the layer lacks (never read)."""
    here = cache._mixed[layer]
    if here is None:
        raise ValueError(f"layer {layer} of this storage='auto' cache holds no token yet: its storages are chosen "
                         "at its first decode step")
    kw: dict = dict(MIXED=True, HS=here.code, HI=here.index, KN=placeholder, VN=placeholder, K8=placeholder,
                    V8=placeholder, KS8=placeholder, VS8=placeholder, HN=1, H8=1)
    pools = {"K": placeholder, "V": placeholder, "KS": placeholder, "VS": placeholder}
    if "native" in here.parts:
        heads, part = here.parts["native"]
        kw.update(KN=part.k[0], VN=part.v[0], HN=len(heads))
    if "int8" in here.parts:
        heads, part = here.parts["int8"]
        kw.update(K8=part.k[0], V8=part.v[0], KS8=part.k_scale[0], VS8=part.v_scale[0], H8=len(heads))
    if "int4" in here.parts:
        _, part = here.parts["int4"]
        ks, vs = part.k_scale[0], part.v_scale[0]
        pools = {"K": part.k[0], "V": part.v[0], "KS": ks, "VS": vs}
        kw.update(zip(("stride_ksp", "stride_ksn", "stride_ksh"), ks.stride()[:3]))
        kw.update(zip(("stride_vsp", "stride_vsn", "stride_vsh"), vs.stride()[:3]))
        kw.update(GK=part.k_group, GV=part.v_group)
        if part.window:
            kc = part.k_center[0]
            kw.update(KW=part.k_window[0], VW=part.v_window[0], KC=kc, WINDOW=part.window, stride_cs=kc.stride(0),
                      stride_ch=kc.stride(1))
            kw.update(zip(("stride_ws", "stride_wn", "stride_wh", "stride_wd"), part.k_window[0].stride()))
            kw.update(zip(("stride_xs", "stride_xn", "stride_xh", "stride_xd"), part.v_window[0].stride()))
    return {"pools": pools, "kw": kw}
