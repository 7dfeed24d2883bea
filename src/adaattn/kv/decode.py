"""Attention of a few query rows per sequence against a KV cache (decode, speculative decoding,
chunked prefill against the cache), bottom-right causal: query row i of T sees keys up to
length - T + i.

    plan = adaattn.plan_decode(cache, seqs, heads=32)        # once per step: host work, buffers, the runner
    for layer in range(layers):
        cache.append(layer, seqs, k, v)                       # one launch on CUDA
        out = adaattn.decode_attention(q, cache, layer, plan=plan)

Without `plan`, decode_attention makes one per call (the same result, more host work per layer).
The planner makes the plan (planner.plan_decode chooses among kv/runners.py's runners); this module
checks a step's arguments (check_step), builds the plan for the chosen runner (build_plan) and runs
a layer's step (run_decode).

Two dense runners:
    "triton"  the split-KV kernel (kernels/decode.py): a GQA group's query rows in one tile, the
              keys of each sequence split across programs so that every program reads about the
              same number of keys (ragged batches balance), each key's page read from the block
              table (FP8/INT8 converted in registers), splits merged by log-sum-exp. The default
              on CUDA; any page size, head dims up to 256.
    "sdpa"    torch's SDPA: a contiguous native KVCache whose sequences have equal lengths is read
              through its (B, Hkv, N, D) views without a copy; otherwise the sequences' pages are
              gathered (quantized pages dequantized) and masked by length. The default on the
              CPU, and wherever the kernel declines (the plan says why).

Sparse decode (kv/sparse.py): under Policy(mode="auto", approximations=("skip",), tolerance=t)
and a cache made with summaries=True, a step reads only the pages its queries need, under the
tolerance, measured on sampled calls; plan_decode(..., policy=...) decides it, and the plan's
explain() says why it did or did not.

Static shapes for CUDA graphs: a plan made with `max_len` fixes the launch grid, and the kernel
reads lengths and block tables on the device, so one captured step replays as sequences grow up to
max_len (pages reserved beforehand; PagedKVCache.reserve). Nothing recompiles as lengths grow:
lengths are not kernel constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..backends.triton.common import next_pow2
from ..problem import default_scale
from .. import hardware, stats
from . import mixed, sparse
from .gathered import sdpa_gathered
from .cache import PER_PAGE, KVCache, PagedKVCache

# The triton runner's tiles and launch, from sweeps on an H100 (benchmarks/NOTES.md, decode): 128 keys
# per tile; 8 warps for pages in the model dtype, 4 for quantized pages (their fp16 operands sit in
# registers); the split count aims at 4 programs per SM for native pages and 8 for quantized ones;
# 3 stages where the keys' pages are computed (a contiguous KVCache: the loads pipeline), else 2.
BLOCK_N = 128
PROGRAMS_PER_SM = {"native": 4, "fp8": 8, "int8": 8, "int4": 8, "mixed": 8}  # int4, mixed: as int8 until measured
# Tiles a program reads at least, unless that would leave SMs without one: short programs lose to
# their pipeline's fill and to a wider merge. H100, bf16 pages (benchmarks/NOTES.md, decode at head
# dim 64): head dim 64, B8 Hkv8 8k, 0.906x -> 0.979x cuDNN in CUDA graphs; head dim 128, B16 8k,
# 2.72 -> 2.76 TB/s. Quantized pages keep the occupancy rule alone: longer programs moved the
# shipped GPT's bits per byte through an FP8 cache from +0.095% to +0.102% of exact (the P of keys
# far under a longer split's running max loses precision in fp16), and INT8 ran slower.
MIN_TILES = {"native": 32, "fp8": 1, "int8": 1, "int4": 1, "mixed": 1}
WARPS = {"native": 8, "fp8": 4, "int8": 4, "int4": 4, "mixed": 4}
STAGES = {True: 3, False: 2}  # by contiguity
# Warps for native pages of head dim <= 64 (stages as above). H100, CUDA-graph kernel times, 8 ->
# 4 warps (benchmarks/NOTES.md, decode at head dim 64): B16 Hkv8 32k 446.7 -> 417.3 us, ragged
# 1k..32k 125.9 -> 122.0 (B16: 236.5 -> 224.7), 8k 65.2 -> 64.5, paged ragged 125.1 -> 123.2.
# (4 stages: 32k better still, ragged 6% worse; 2 stages: 8k 20% worse.)
SMALL_HEAD_NATIVE_WARPS = 4


# Shared memory kept free of the pipelined tiles: the tensor-core operands' layout conversions and
# the compiler's scratch.
STAGE_RESERVE = 32 * 1024


def _stages(cache: PagedKVCache, contiguous: bool, storage: Optional[str] = None) -> int:
    """STAGES[contiguous], less where that many copies of a tile's loads would not fit the device's
    shared memory, for the cache's storage or `storage` (one part of a cache with a storage per
    head). A tile of BLOCK_N keys loads D + Dv channels at the storage's bytes a value (a cache with
    a storage per head: its widest, the model dtype), INT4's scales and minima (4 bytes a group),
    and with a window (INT4's) the ring's rows in the model dtype as well. INT4 with a window at head
    dim 128 in 3 stages asked for 233,472 bytes of 232,448 (OutOfResources, H200); bf16 at head
    dim 256 would ask for 384 KiB."""
    stages, storage = STAGES[contiguous], storage or cache.storage
    if cache.device.type != "cuda":
        return stages
    d, dv = max(16, next_pow2(cache.head_dim)), max(16, next_pow2(cache.value_dim))  # the kernel's BLOCK_D, BLOCK_DV
    elem = cache.dtype.itemsize
    tile = BLOCK_N * (d + dv) * {"fp8": 1, "int8": 1, "int4": 0.5}.get(storage, elem)
    if storage in ("int4", "mixed"):
        tile += BLOCK_N * (-(-d // cache.k_group) + -(-dv // cache.v_group)) * 4
        if cache.window:
            tile += BLOCK_N * (d + dv) * elem
    limit = hardware.max_shared_memory(cache.device.index) - STAGE_RESERVE
    while stages > 1 and stages * tile > limit:
        stages -= 1
    return stages


@dataclass
class DecodePlan:
    """What decode_attention needs beyond the tensors, computed once per step and shared by the
    layers: the sequences (as a device tensor), the runner and why, the triton runner's split of
    the keys, and its scratch buffers."""

    runner: str
    why: str
    seqs: tuple[int, ...]
    seq_ids: torch.Tensor
    heads: int
    query_len: int
    max_len: int
    splits: int = 1
    tiles_per_split: int = 1
    block_n: int = BLOCK_N
    num_warps: int = 4
    num_stages: int = 2
    contiguous: bool = False
    sparse: bool = False
    sparse_always: bool = False
    sparse_why: str = ""
    policy: object = None
    storages: str = ""  # a cache with a storage per head: what each layer's heads hold (kv/mixed.py)
    part_stages: dict = field(default_factory=dict)  # and the stages of a layer whose heads all hold one storage
    _scratch: dict = field(default_factory=dict, repr=False)

    def explain(self) -> str:
        split = (f"; {self.splits} split(s) of up to {self.tiles_per_split * self.block_n} keys"
                 if self.runner == "triton" else "")
        sparse_ = f"; sparse: {self.sparse_why}" if self.sparse_why else ""
        held = f"; storage per head: {self.storages}" if self.storages else ""
        return (f"decode runner kv.{self.runner} for {len(self.seqs)} sequence(s), {self.query_len} query row(s) "
                f"each, up to {self.max_len} keys{split}: {self.why}{sparse_}{held}")

    def scratch(self, dv: int, device, splits: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The split outputs and log-sum-exps (fp32) of `splits` splits (default: the plan's),
        allocated once and reused by every layer."""
        splits = self.splits if splits is None else splits
        key = (dv, str(device), splits)
        if key not in self._scratch:
            s, t = len(self.seqs), self.query_len
            self._scratch[key] = (torch.empty(s, self.heads, t, splits, dv, dtype=torch.float32, device=device),
                                  torch.empty(s, self.heads, t, splits, dtype=torch.float32, device=device))
        return self._scratch[key]


def check_step(cache: PagedKVCache, seqs: Optional[Sequence[int]], heads, query_len, dtype: Optional[torch.dtype],
               max_len: Optional[int], policy, sparse_) -> tuple:
    """The arguments of a decode step checked (ValueError/TypeError naming the one at fault):
    (seqs as a tuple, the query dtype, each sequence's longest length now, max_len)."""
    if seqs is None:
        if not isinstance(cache, KVCache):
            raise ValueError("seqs is required for a PagedKVCache (the sequence ids the query rows belong to)")
        seqs = range(cache.batch)
    seqs = tuple(int(s) for s in seqs)
    if not seqs:
        raise ValueError("seqs must name at least one sequence")
    for s in seqs:
        cache._check_seq(s)
    if not isinstance(heads, int) or heads < 1 or heads % cache.kv_heads:
        raise ValueError(f"heads must be a positive multiple of the cache's kv_heads ({cache.kv_heads}), got {heads!r}")
    if not isinstance(query_len, int) or query_len < 1:
        raise ValueError(f"query_len must be a positive int, got {query_len!r}")
    if sparse_ is not None and not isinstance(sparse_, bool) and sparse_ != "always":
        raise TypeError(f"sparse must be None, True, False or 'always', got {sparse_!r}")
    if policy is not None:
        from ..policy import Policy

        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be an adaattn.Policy or None, got {type(policy).__name__}")
    dtype = cache.dtype if dtype is None else dtype
    now = [max(cache._lengths[layer][s] for layer in range(cache.layers)) for s in seqs]
    if max_len is None:  # (no sequence grows past the block table's width)
        max_len = min(max(now) + query_len, cache.max_pages_per_seq * cache.page_size)
    elif max_len < max(now):
        raise ValueError(f"max_len={max_len} is shorter than a sequence the cache already holds ({max(now)} tokens)")
    return seqs, dtype, now, int(max_len)


def build_plan(cache: PagedKVCache, seqs: tuple, heads: int, query_len: int, max_len: int, now: list[int],
               runner: str, why: str, splits: Optional[int], policy, sparse_on: bool, sparse_always: bool,
               sparse_why: str) -> DecodePlan:
    """The plan of a step whose runner the planner chose (planner.plan_decode): "triton" or "sdpa",
    page selection on or off, and the split-KV kernel's split of the keys."""
    seq_ids = cache.seq_ids(seqs)  # made once per list: a fresh host-to-device copy would wait for the GPU's queue
    plan = DecodePlan(runner, why, seqs, seq_ids, heads, query_len, max_len, policy=policy, sparse=sparse_on,
                      sparse_always=sparse_always, sparse_why=sparse_why)
    if cache.storage == "mixed":
        plan.storages = cache.all_storages()
    if runner == "triton":
        tiles = -(-plan.max_len // BLOCK_N)
        if splits is None:
            if cache.device.type == "cuda":
                sms = torch.cuda.get_device_properties(cache.device).multi_processor_count
            else:
                sms = 4
            work = cache.kv_heads * sum(-(-min(n + query_len, plan.max_len) // BLOCK_N) for n in now)
            per = max(1, -(-work // (PROGRAMS_PER_SM[cache.storage] * sms)))
            if not plan.sparse:
                # (Not for sparse steps: they size their programs as this figure times the pages
                # fraction they last read, and the floor would give each fraction a split of its own.)
                per = max(per, min(MIN_TILES[cache.storage], -(-work // sms)))
        else:
            if not isinstance(splits, int) or splits < 1:
                raise ValueError(f"splits must be a positive int, got {splits!r}")
            per = -(-tiles // splits)
        plan.block_n, plan.tiles_per_split, plan.splits = BLOCK_N, per, -(-tiles // per)
        plan.num_warps = WARPS[cache.storage]
        # A KVCache's sequence b owns pages b*P.. b*P+P-1 in order: keys' pages are computed, not read.
        plan.contiguous = isinstance(cache, KVCache)
        plan.num_stages = _stages(cache, plan.contiguous)
        if cache.storage == "mixed":
            plan.part_stages = {s: _stages(cache, plan.contiguous, s) for s in mixed.MIXED}
        if cache.storage == "native" and max(cache.head_dim, cache.value_dim) <= 64:
            plan.num_warps = SMALL_HEAD_NATIVE_WARPS
    return plan


def run_decode(query: torch.Tensor, cache: PagedKVCache, layer: int, plan: DecodePlan,
               seqs: Optional[Sequence[int]] = None, scale: Optional[float] = None,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
               alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One layer's step under `plan` (see adaattn.decode_attention)."""
    if query.dim() != 4:
        raise ValueError(f"query must be (S, Hq, T, D), got {tuple(query.shape)}")
    if not 0 <= layer < cache.layers:
        raise ValueError(f"layer must be in [0, {cache.layers}), got {layer}")
    s, hq, t, d = query.shape
    if seqs is not None and tuple(int(x) for x in seqs) != plan.seqs:
        raise ValueError(f"seqs {list(seqs)} differ from the plan's {list(plan.seqs)}")
    if s != len(plan.seqs) or hq != plan.heads or t != plan.query_len:
        raise ValueError(f"query must be (S={len(plan.seqs)}, Hq={plan.heads}, T={plan.query_len}, D) as planned, "
                         f"got {tuple(query.shape)}")
    if cache.storage == "mixed" and cache._mixed[layer] is not None and cache._mixed[layer].pending:
        mixed.settle(cache, layer, query, plan.seqs)  # storage="auto": this layer's first decode step chooses
        plan.storages = cache.all_storages()
    if d != cache.head_dim:
        raise ValueError(f"query head_dim {d} must equal the cache's head_dim {cache.head_dim}")
    lengths = [cache._lengths[layer][x] for x in plan.seqs]
    if min(lengths) < t:
        raise ValueError(f"each sequence must hold at least the query's {t} tokens in layer {layer}; lengths "
                         f"{lengths}")
    if max(lengths) > plan.max_len:
        raise ValueError(f"the plan covers {plan.max_len} tokens per sequence but layer {layer} holds up to "
                         f"{max(lengths)}: make a new plan (plan_decode(..., max_len=...))")
    if plan.runner == "triton" and query.dtype != cache.dtype:
        raise TypeError(f"query dtype {query.dtype} must be the cache's dtype {cache.dtype} for runner='triton'")
    extra = {}
    modified = softcap is not None or sinks is not None or alibi_slopes is not None
    in_kernel = modified and _kernel_takes_modifiers(query, plan, sinks, alibi_slopes)
    if in_kernel:
        mods = _kernel_modifiers(query, cache, layer, plan, scale, softcap, sinks, alibi_slopes)
        out = _split_kv(query, cache, layer, plan, scale, mods=mods)
    elif modified:
        out = _modified(query, cache, layer, plan, scale, lengths, softcap, sinks, alibi_slopes)
    elif plan.sparse:
        out, extra = _sparse_step(query, cache, layer, plan, scale, lengths)
    else:
        out = _dense(query, cache, layer, plan, scale, lengths)
    if stats.enabled:
        stats.add(stats.CallRecord(
            backend="kv.mods" if modified and not in_kernel
            else f"kv.{plan.runner}" + (".sparse" if extra.get("sparse") == "sparse" else ""),
            shape=f"S={s} Hq={hq} Hkv={cache.kv_heads} T={t} Nk<={max(lengths)} D={d}",
            dtype=str(query.dtype).replace("torch.", ""), device=str(query.device.type),
            mode="decode" if not plan.sparse else "decode.auto",
            decisions={"why": plan.why, "storage": cache.storage, "page_size": cache.page_size,
                       **({"head_storages": cache.storages(layer)} if cache.storage == "mixed" else {}),
                       "splits": plan.splits if plan.runner == "triton" else None, "layer": layer, **extra}))
    return out


def _kernel_takes_modifiers(query, plan, sinks, alibi_slopes) -> bool:
    """The split-KV kernel applies soft-capping and ALiBi in-tile and the merge the sinks, forward
    only: a step that needs no gradient (the usual decode) runs there."""
    if plan.runner != "triton":
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, sinks, alibi_slopes)):
        return False
    return True


def _kernel_modifiers(query, cache, layer, plan, scale, softcap, sinks, alibi_slopes) -> dict:
    """The modifiers, checked as attention() checks them (problem.check_modifiers, on a problem of
    the query against stand-in key views), as _split_kv's kernel arguments."""
    from ..problem import check_modifiers, validate

    s, hq, t, _ = query.shape
    keys = query[:, :1].expand(s, cache.kv_heads, t, cache.head_dim)
    values = query[:, :1, :, :1].expand(s, cache.kv_heads, t, cache.value_dim)
    _, checked = check_modifiers(validate(query, keys, values, None, 0.0, False, None, hq != cache.kv_heads),
                                 softcap, sinks, alibi_slopes)
    mods = {}
    if checked.softcap is not None:
        mods["SOFTCAP"] = checked.softcap * math.log2(math.e)
    if alibi_slopes is not None:
        slopes = alibi_slopes.detach().float().contiguous()
        mods.update(SLOPES=slopes, stride_slb=slopes.stride(0) if slopes.dim() == 2 else 0, HAS_ALIBI=True)
    if sinks is not None:
        mods["merge"] = dict(SINKS=sinks.detach().float().contiguous(), HAS_SINKS=True)
    if cache.storage != "native" and (softcap is not None or sinks is not None):
        # Quantized pages hold keys less their sequence's centre c: the scores lack q.c, which the
        # softmax ignores but the cap and the sinks do not.
        centre = (mixed.key_centre(cache, layer) if cache.storage == "mixed" else cache.k_center[layer])
        centre = centre.index_select(0, plan.seq_ids.long())  # (S, Hkv, D)
        centre = centre.repeat_interleave(hq // cache.kv_heads, 1)  # (S, Hq, D)
        scale_f = default_scale(query.shape[-1]) if scale is None else float(scale)
        qoff = torch.einsum("shtd,shd->sht", query.float(), centre).mul_(scale_f).contiguous()
        mods.update(QOFF=qoff, HAS_QOFF=True)
    return mods


def _modified(query, cache, layer, plan, scale, lengths, softcap, sinks, alibi_slopes):
    """A step with score modifiers (problem.Modifiers): the sequences' keys gathered (dequantized), the
    bottom-right causal mask of each sequence's own length and its ALiBi bias, -slope * (position - key),
    folded into one additive mask (it is added after the soft cap, as the modifiers' order asks), then
    mods.torch (backends/modifiers.py). The split-KV kernel applies none of them yet."""
    import dataclasses

    from ..backends.modifiers import modified_attention
    from ..problem import check_modifiers, validate

    s, hq, t, _ = query.shape
    longest = max(lengths)
    k, v = cache.gather(layer, plan.seqs, longest, dtype=query.dtype)
    keys = torch.arange(longest, device=query.device)
    pos = torch.tensor(lengths, device=query.device)[:, None] - t + torch.arange(t, device=query.device)  # (S, T)
    distance = (pos[:, None, :, None] - keys).float()  # (S, 1, T, L): how far back each key is
    bias = torch.zeros_like(distance).masked_fill(distance < 0, float("-inf"))
    problem, modifiers = check_modifiers(validate(query, k, v, None, 0.0, False, scale, hq != cache.kv_heads),
                                         softcap, sinks, alibi_slopes)
    if alibi_slopes is not None:  # each sequence's own positions: folded into the additive mask
        slopes = alibi_slopes.float()
        slopes = slopes[:, :, None, None] if slopes.dim() == 2 else slopes[None, :, None, None]
        bias = bias - slopes * distance.clamp_min(0)
        modifiers = dataclasses.replace(modifiers, alibi_slopes=None)
    return modified_attention(query, k, v, bias, problem, modifiers)


def _dense(query, cache, layer, plan, scale, lengths):
    if plan.runner == "triton":
        return _split_kv(query, cache, layer, plan, scale)
    return _sdpa(query, cache, layer, plan, lengths, scale)


def _sparse_step(query, cache, layer, plan, scale, lengths):
    """One step of sparse decode at a call site (kv/sparse.py): select, read the kept pages, and on
    sampled calls verify against the exact step (timing both on CUDA) and move the thresholds."""
    site = sparse.site(cache, layer, plan.policy.tolerance)
    site.poll()
    if site.dense_now() and not plan.sparse_always:
        site.decisions["dense"] += 1
        out = _dense(query, cache, layer, plan, scale, lengths)
        if not stats.enabled:  # (the host path of a dense call stays as short as the plain one's)
            return out, {}
        return out, {"sparse": "dense", "sparse_why": f"{site.why_dense}; dense until call {site.dense_until}"}
    kernel = plan.runner == "triton"
    scale_f = default_scale(query.shape[-1]) if scale is None else float(scale)
    check = sparse.should_verify(site, plan.policy, query)
    # a verified call on the kernel path times its sparse step and the exact one (CUDA events), in
    # turns first (the second finds some of the pages the first read in L2)
    timed = check and kernel and query.is_cuda
    exact_first = timed and site.decisions["verified"] % 2 == 1
    marks: list = []

    def mark():
        if timed:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()

    mark()
    if exact_first:
        exact = _dense(query, cache, layer, plan, scale, lengths)
        mark()
    sel, count = sparse.select(query, cache, layer, plan, site.theta, scale_f, kernel)
    if kernel:
        out = _split_kv(query, cache, layer, plan, scale, sel=sel, count=count, pages=site.expected_pages)
    else:
        out = sparse.sparse_reference(query, cache, layer, plan.seq_ids, sel, count, scale_f, lengths)
    if check:
        mark()
        if not exact_first:
            exact = _dense(query, cache, layer, plan, scale, lengths)
            mark()
        out = sparse.verify(site, out, exact, count, sparse.page_counts(cache, layer, plan.seq_ids), plan.seq_ids,
                            (*marks, exact_first) if timed else None)
    site.decisions["sparse"] += 1
    site.decisions["verified"] += int(check)
    extra = {"sparse": "sparse", "verified": check}
    if stats.enabled:  # device tensors: read only when the records are
        extra.update(theta=site.theta[plan.seq_ids.long()].clone(), pages_read=site.pages.clone(),
                     error=site.error.clone(), pages_this_call=count.clone())
    return out, extra


def _sdpa(query, cache, layer, plan, lengths, scale):
    s, hq, t, d = query.shape
    gqa = hq != cache.kv_heads
    longest = max(lengths)
    if (isinstance(cache, KVCache) and cache.storage == "native" and min(lengths) == longest
            and query.dtype == cache.dtype and plan.seqs == tuple(range(cache.batch))):
        k, v = cache.keys(layer)[:, :, :longest], cache.values(layer)[:, :, :longest]  # views, no copy
        if t == 1:
            return F.scaled_dot_product_attention(query, k, v, scale=scale, enable_gqa=gqa)
        visible = torch.ones(t, longest, dtype=torch.bool, device=query.device).tril(longest - t)
        return F.scaled_dot_product_attention(query, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
    return sdpa_gathered(query, cache, layer, plan.seqs, torch.tensor(lengths, device=query.device), longest, scale)


def _split_kv(query, cache, layer, plan, scale, sel=None, count=None, pages=1.0, mods=None, stages=None):
    """The split-KV kernel and the merge. Sparse (sel, count): each program reads TILES_PER_SPLIT
    tiles of its (sequence, KV head)'s listed pages, sized so that a head listing the fraction
    `pages` of its pages (the site's last read-back figure) gets the dense plan's programs times
    that fraction: heads listing more get more programs, and the launch covers a head listing all.
    `stages`: the pipeline's, where not the plan's (a layer of a per-head cache run as its one part)."""
    from ..backends.triton.bound import bound, site_launch
    from ..backends.triton.common import next_pow2 as next_power_of_2
    from ..backends.triton.common import dot_precision
    from ..kernels.decode import decode_merge_kernel, decode_split_kernel

    whole = mixed.uniform_part(cache, layer) if cache.storage == "mixed" else None
    if whole is not None:  # every head of the layer in one storage: that storage's own path
        return _split_kv(query, whole, 0, plan, scale, sel, count, pages, mods, plan.part_stages.get(whole.storage))
    stages = plan.num_stages if stages is None else stages
    s, hq, t, d = query.shape
    hkv, dv = cache.kv_heads, cache.value_dim
    g = hq // hkv
    sparse_ = sel is not None
    per, splits = plan.tiles_per_split, plan.splits
    if sparse_:
        per = max(1, round(plan.tiles_per_split * min(max(pages, 0.05), 1.0)))
        listed_keys = min(-(-plan.max_len // cache.page_size), cache.max_pages_per_seq) * cache.page_size  # all
        tiles = -(-listed_keys // plan.block_n)
        splits = -(-tiles // per)
    o_part, l_part = plan.scratch(dv, query.device, splits)
    lengths = cache.lengths[layer]
    quantized, int4 = cache.storage in PER_PAGE, cache.storage == "int4"
    int4_strides = {}
    if cache.storage == "mixed":  # each head reads its storage's pool (kv/mixed.py)
        m = mixed.kernel_args(cache, layer, l_part)
        k_pool, v_pool, ks, vs = m["pools"]["K"], m["pools"]["V"], m["pools"]["KS"], m["pools"]["VS"]
        int4_strides = m["kw"]
    else:
        k_pool, v_pool = cache.k[layer], cache.v[layer]
        ks = cache.k_scale[layer] if quantized or int4 else l_part  # a placeholder pointer when not read
        vs = cache.v_scale[layer] if quantized or int4 else l_part
    if int4:  # the scales' (page, slot, head) strides (their groups lie as kernels/decode.load_int4 reads them)
        int4_strides = dict(zip(("stride_ksp", "stride_ksn", "stride_ksh"), ks.stride()[:3]))
        int4_strides.update(zip(("stride_vsp", "stride_vsn", "stride_vsh"), vs.stride()[:3]))
        int4_strides.update(GK=cache.k_group, GV=cache.v_group)
        if cache.window:  # the newest tokens' rings, and the keys' centre they are read less of
            kw, vw, kc = cache.k_window[layer], cache.v_window[layer], cache.k_center[layer]
            int4_strides.update(KW=kw, VW=vw, KC=kc, WINDOW=cache.window, stride_cs=kc.stride(0),
                                stride_ch=kc.stride(1))
            int4_strides.update(zip(("stride_ws", "stride_wn", "stride_wh", "stride_wd"), kw.stride()))
            int4_strides.update(zip(("stride_xs", "stride_xn", "stride_xh", "stride_xd"), vw.stride()))
    scale = default_scale(d) if scale is None else float(scale)
    precision = dot_precision(query.dtype)
    block_m, block_d, block_dv = max(16, next_power_of_2(g * t)), max(16, next_power_of_2(d)), max(16, next_power_of_2(dv))

    def split_args():
        return ((query, k_pool, v_pool, ks, vs, cache.block_table, lengths, plan.seq_ids, o_part, l_part,
                 sel if sparse_ else l_part, count if sparse_ else l_part, scale,
                 *query.stride(), *k_pool.stride(), *v_pool.stride(),
                 *(ks.stride() if quantized else (0, 0)), *cache.block_table.stride(),
                 *o_part.stride(), *l_part.stride(), sel.stride(0) if sparse_ else 0,
                 hkv, per),
                dict(G=g, T=t, D=d, DV=dv, BLOCK_M=block_m, BLOCK_N=plan.block_n,
                     BLOCK_D=block_d, BLOCK_DV=block_dv, PAGE=cache.page_size,
                     QUANTIZED=quantized, INT4=int4, DOT_PRECISION=precision, **int4_strides,
                     CONTIG=plan.contiguous, SPARSE=sparse_, num_warps=plan.num_warps, num_stages=stages,
                     **{name: x for name, x in (mods or {}).items() if name != "merge"}))

    out = torch.empty(s, hq, t, dv, dtype=query.dtype, device=query.device)

    def merge_args():
        return ((o_part, l_part, out, *o_part.stride(), *l_part.stride(), *out.stride(), hq, t, splits),
                dict(DV=dv, BLOCK_DV=block_dv, BLOCK_S=max(2, next_power_of_2(splits)), DOT_PRECISION=precision,
                     **(mods or {}).get("merge", {})))

    if sparse_ or mods:  # (their arguments change per call: launched through triton each time)
        args, kw = split_args()
        bound(decode_split_kernel)[(splits, s * hkv)](*args, **kw)
        args, kw = merge_args()
        bound(decode_merge_kernel)[(s * hq * t,)](*args, **kw)
        return out
    # A dense step's launches are fixed by the cache and its layer, the query's shape, layout and
    # dtype, the scale and the plan's split: known once per cache (bound.site_launch, where bound
    # launches are on), so a plan made every step finds them too. The plan's tensors (its sequence
    # ids and scratch) are slotted in like the query.
    key = (layer, query.dtype, query.shape, query.stride(), scale, splits, per, plan.block_n, plan.num_warps,
           stages, plan.contiguous, cache._mixed[layer].serial if cache.storage == "mixed" else None)
    site_launch(cache._sites, ("split",) + key, decode_split_kernel, (splits, s * hkv),
                (query, k_pool, v_pool, ks, vs, cache.block_table, lengths, plan.seq_ids, o_part, l_part)
                + tuple(x for x in int4_strides.values() if isinstance(x, torch.Tensor)), split_args)
    site_launch(cache._sites, ("merge",) + key, decode_merge_kernel, (s * hq * t,), (o_part, l_part, out), merge_args)
    return out
