"""Hugging Face transformers: `attn_implementation="adaattn"`.

    import adaattn.integrations.hf  # registers "adaattn" with transformers
    model = AutoModel.from_pretrained(name, attn_implementation="adaattn")
    adaattn.integrations.hf.set_policy(model, adaattn.Policy(...), layers=[0, 1])

Importing this module registers the attention function and its mask format: "adaattn" gets
exactly the masks "sdpa" gets (boolean, True = takes part, or None where `is_causal` or no mask
says it all), so padding, causal decoders, encoders, GQA and KV-cache decoding behave as with
"sdpa". Needs transformers >= 4.53, and models that call transformers' attention interface (all
of them in transformers 5; in 4.x the decoders such as Llama and GPT-2, not BERT).

Not supported, with a ValueError saying so: attention weights (`output_attentions=True`),
logit soft-capping (`softcap`), attention sinks (`s_aux`) and the paged cache of continuous
batching. `sliding_window` needs nothing here: the mask transformers builds carries it.

adaattn's own KV cache for generate():

    cache = adaattn.integrations.hf.Cache(max_cache_len=4096, storage="fp8")   # or "native", "int8"; paged=True
    model.generate(ids, past_key_values=cache, max_new_tokens=64)

With attn_implementation="adaattn", decode steps (a few query rows, after a prompt without
padding) run adaattn.kv.decode_attention over the cache (the split-KV kernel on CUDA), with one
plan shared by all layers of a step; prompts run the usual attention on their own keys. The Cache
is compileable: on CUDA, generate() compiles its decode steps into CUDA graphs (see Cache).
`cache.explain()` and adaattn.stats say which decode runner ran and why (in a compiled step, stats
see the calls that recorded the graph, not its replays).
"""

from __future__ import annotations

import functools
import weakref
from typing import Iterable, Optional

import torch
from torch import nn

from ..api import attention
from ..policy import Policy

NAME = "adaattn"

_UNSUPPORTED = {
    "softcap": "logit soft-capping (softcap)",
    "s_aux": "attention sinks (s_aux)",
}


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface, computed by `adaattn.attention`.

    query (B, Hq, Nq, D), key and value (B, Hkv, Nk, D) with Hq a multiple of Hkv;
    attention_mask: None, bool (True = takes part) or additive, broadcastable to (B, Hq, Nq, Nk).
    Returns (output (B, Nq, Hq, Dv), None): adaattn never materialises attention weights.

    The policy is `module.adaattn_policy` (see `set_policy`; None = exact), the stats label
    `module.adaattn_label` or "layers.<layer_idx>.<class name>".
    Raises ValueError for what adaattn cannot honour: output_attentions, softcap, s_aux, a paged cache.
    """
    _check_unsupported(kwargs)
    handle = getattr(key, "_adaattn_kv", None)
    if handle is not None:  # keys and values of an adaattn Cache (see Cache below)
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        out = handle.decode(query, attention_mask, dropout, scaling, window)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
        key, value = handle.dense()
        if handle.token is not None:  # a compiled step: the whole cache, masked by the mask transformers built
            if attention_mask is None:
                raise RuntimeError("a compiled step over an adaattn Cache that needs a mask (after a padded or "
                                   "windowed prompt) got none")
            if attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
                attention_mask = attention_mask.to(query.dtype)
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1])
            return out.transpose(1, 2).contiguous(), None
    q_len, kv_len = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if attention_mask is not None:
        if attention_mask.shape[-1] > kv_len:  # transformers 4.x may pass one as long as a static cache
            attention_mask = attention_mask[:, :, :, :kv_len]
        if attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
            attention_mask = attention_mask.to(query.dtype)
    position_bias = kwargs.get("position_bias")
    # As transformers' sdpa path: top-left causal only where no mask was built and Nq > 1; a
    # single decode query attends every cached key, and any other case comes with a mask.
    causal = bool(q_len > 1) and attention_mask is None and bool(is_causal)  # plain bools under compile
    if causal and kv_len > q_len:  # an empty static cache in prefill: later keys are masked anyway
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        if position_bias is not None:
            position_bias = position_bias[..., :q_len]
    if position_bias is not None:
        attention_mask = _with_position_bias(position_bias.to(query.dtype), attention_mask, causal, q_len, key.shape[2])
        causal = False
    out = attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=float(dropout),
        is_causal=causal,
        scale=None if scaling is None else float(scaling),
        enable_gqa=query.shape[1] != key.shape[1],
        policy=getattr(module, "adaattn_policy", None),
        label=_label(module),
    )
    return out.transpose(1, 2).contiguous(), None


def _check_unsupported(kwargs: dict) -> None:
    if kwargs.get("output_attentions"):
        raise ValueError(
            "attn_implementation='adaattn' does not return attention weights (output_attentions=True); "
            "run that call with model.set_attn_implementation('eager') and switch back after"
        )
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"attn_implementation='adaattn' does not support {what}, which this model asks for; "
                "use attn_implementation='eager' for this model"
            )
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise ValueError(
            "attn_implementation='adaattn' does not support the paged cache of continuous batching; "
            "use attn_implementation='sdpa' for generate_batch()"
        )


def _with_position_bias(
    bias: torch.Tensor, mask: torch.Tensor | None, causal: bool, q_len: int, kv_len: int
) -> torch.Tensor:
    """One additive mask from a learned position bias and the mask or causal pattern (as transformers' sdpa)."""
    if mask is None and causal:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=bias.device).tril()
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, torch.finfo(bias.dtype).min)
    return bias + mask


def _label(module: nn.Module) -> str:
    label = getattr(module, "adaattn_label", None)
    if label is not None:
        return label
    idx = getattr(module, "layer_idx", None)
    name = type(module).__name__
    return name if idx is None else f"layers.{idx}.{name}"


def _is_attention_module(module: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return "Attention" in type(module).__name__ and not isinstance(module, PreTrainedModel)


def _layer_index(name: str, module: nn.Module) -> int | None:
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int) and not isinstance(idx, bool):
        return idx
    numbers = [int(p) for p in name.split(".") if p.isdigit()]
    return numbers[-1] if numbers else None


def set_policy(model: nn.Module, policy: Policy | None, layers: int | Iterable[int] | None = None) -> list[str]:
    """Use `policy` for the attention of `model`, in every layer or in the layers listed.

    model: a transformers model (any nn.Module) whose attention modules call the attention
        interface; `policy`: an adaattn.Policy, or None for exact attention.
    layers: a layer index or indices (the module's `layer_idx`, else the last number in its
        name: "model.layers.3.self_attn" is layer 3); None means all attention modules.
    Also labels every attention module with its name in `model`, so `adaattn.stats` records
    say e.g. "model.layers.3.self_attn". Returns the names of the modules given the policy.
    Raises TypeError for a policy that is not a Policy or None, or layer indices that are not
    ints; ValueError for layer indices the model does not have.
    """
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be an adaattn.Policy or None, got {type(policy).__name__}")
    wanted = None
    if layers is not None:
        wanted = {layers} if isinstance(layers, int) else set(layers)
        bad = [i for i in wanted if isinstance(i, bool) or not isinstance(i, int)]
        if bad:
            raise TypeError(f"layers must be ints (layer indices) or None, got {bad!r}")
    modules = [(n, m) for n, m in model.named_modules() if n and _is_attention_module(m)]
    index = {n: _layer_index(n, m) for n, m in modules}
    found = {i for i in index.values() if i is not None}
    if wanted is not None and wanted - found:
        raise ValueError(
            f"layers {sorted(wanted - found)} are not in this model; its attention layers are {sorted(found)}"
        )
    chosen: list[str] = []
    for name, module in modules:
        module.adaattn_label = name
        if wanted is None or index[name] in wanted:
            module.adaattn_policy = policy
            chosen.append(name)
    # Report the innermost modules (BertSelfAttention, not the BertAttention around it).
    chosen = [n for n in chosen if not any(c.startswith(n + ".") for c in chosen)]
    return chosen


def register(name: str = NAME) -> None:
    """Register `attention_forward` and the sdpa mask format under `name` with transformers.

    Done on import with name "adaattn"; call again to register under another name.
    Raises ImportError for transformers older than 4.53, whose models build masks by
    implementation name in ways another implementation cannot rely on (GPT-2 there would get
    a padding-only mask and lose its causal pattern).
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        import transformers

        raise ImportError(
            "adaattn.integrations.hf needs transformers>=4.53 (masks built per attention "
            f"implementation); this is transformers {transformers.__version__}"
        ) from e
    AttentionInterface.register(name, attention_forward)
    # Without a mask format transformers builds no mask at all, and padding is silently ignored.
    AttentionMaskInterface.register(name, sdpa_mask)


register()


class _Handle:
    """What an adaattn Cache layer's update() hands the attention function, attached to the key
    tensor it returns: the cache, the layer, the length before this update (None in a compiled
    step, which reads no host state), the new states, and in a compiled step the append's token
    (the output of the append op, which orders the reads of the cache after it)."""

    __slots__ = ("cache", "layer", "before", "key_states", "value_states", "token")

    def __init__(self, cache, layer, before, key_states, value_states, token=None):
        self.cache, self.layer, self.before = cache, layer, before
        self.key_states, self.value_states, self.token = key_states, value_states, token

    def decode(self, query, mask, dropout, scaling, window=None):
        """decode_attention over the cache for a decode step; None for anything else (the usual
        attention then runs over the cache's keys, under the mask).

        A decode step needs no mask of its own: bottom-right causal over each sequence's length
        is what it means. Uncompiled caches (compile=False) take a step of a few rows without a
        mask, as transformers passes none for a step without padding. A compileable cache makes
        transformers build a mask for every step (static shapes); there a step of one new token
        takes the kernel where every mask the layer got for its longer chunks (the prompt's first)
        was the plain causal one, and no window shorter than the cache applies: its mask then
        holds nothing but the sequence's length."""
        cache, layer = self.cache, self.layer
        t, g = query.shape[2], query.shape[1] // self.key_states.shape[1]
        if self.token is not None:  # inside a compiled step
            if dropout:
                raise NotImplementedError("dropout in a compiled step over an adaattn Cache: run it uncompiled")
            if t * g > DECODE_ROWS:
                raise NotImplementedError(
                    f"a compiled step over an adaattn Cache takes up to {DECODE_ROWS} query rows per KV head "
                    f"(GQA group x new tokens), got {t * g}; transformers' generate() compiles only the decode "
                    f"steps, whose prompts run uncompiled")
            if self._dense(t, window):
                return None
            return _decode_op(query, self.token, cache._state(layer), scaling)
        cache._seen[layer] = True
        if t > 1 or self.before == 0:  # a prompt or a chunk: does its mask say more than causality?
            # (for any cache: a user may compile the forward over a Cache(compile=False) too)
            cache._masked[layer] |= not _plain_causal(mask, self.before, t, self.before + t)
        if self.before == 0 or dropout or t * g > DECODE_ROWS:
            return None
        if cache.is_compileable:
            if self._dense(t, window):
                return None
        elif mask is not None:
            cache._dense_why = "a step with a mask (padding): the usual attention over the cache, under the mask"
            return None
        from ..kv import decode_attention

        plan = cache._plan(query, layer)
        return decode_attention(query, cache.kvs[layer], 0, scale=scaling, plan=plan)

    def _dense(self, t, window) -> bool:
        """Whether a step over a compileable cache attends the whole cache under transformers' mask
        instead of running the kernel (several new tokens, a layer whose prompt or chunks had more
        than the causal mask, a window shorter than the cache); cache._dense_why then says which."""
        cache = self.cache
        masked = cache._masked[self.layer]
        if t > 1 or masked or (window is not None and window < cache.max_cache_len):
            cache._dense_why = _dense_why(t, masked, window)
            return True
        return False

    def dense(self):
        """Keys and values for the usual attention: a prompt's own states, else the whole history
        (views of a contiguous native cache; gathered and dequantized otherwise). In a compiled
        step: the whole cache up to max_cache_len, gathered after the append."""
        if self.token is not None:
            cache = self.cache
            return _gather_op(self.token, cache._state(self.layer), self.key_states.dtype, len(cache.seqs),
                              cache.max_cache_len)
        if self.before == 0:
            return self.key_states, self.value_states
        kv = self.cache.kvs[self.layer]
        n = kv.length(self.cache.seqs[0])
        return kv.gather(0, self.cache.seqs, n, dtype=self.key_states.dtype)


# Compiled steps (torch.compile of a model's forward, as transformers' generate() does for a
# compileable cache): the cache's append, decode and gather are custom ops, opaque to the
# compiler, whose Python runs when a graph is recorded and not when it is replayed (CUDA graphs).
# They find their cache through its tensors (`state`: the layer's lengths, K and V pools, and
# scales), which are static addresses: a new Cache gives new addresses, and CUDA-graph trees record
# again rather than replay into another cache's memory. The append returns a token that the
# decode and gather take, so that the compiler orders them after it.
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
    return query.new_empty(*query.shape[:3], state[2].shape[-1])


@torch.library.custom_op("adaattn::hf_cache_gather", mutates_args=())
def _gather_op(token: torch.Tensor, state: list[torch.Tensor], dtype: torch.dtype, batch: int, length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    cache, layer = _owner(state)
    k, v = cache.kvs[layer].gather(0, cache.seqs, length, dtype=dtype)
    return k.contiguous(), v.contiguous()


@_gather_op.register_fake
def _(token, state, dtype, batch, length):
    hkv = state[1].shape[2]  # pools are (pages, page size, Hkv, D)
    return (state[1].new_empty(batch, hkv, length, state[1].shape[3], dtype=dtype),
            state[2].new_empty(batch, hkv, length, state[2].shape[3], dtype=dtype))


DECODE_ROWS = 64  # a step whose query rows (T x GQA group) fit one tile of the decode kernel


def _dense_why(t: int, masked: bool, window) -> str:
    what = ("a step of several new tokens" if t > 1 else "a prompt with more than the causal mask (padding)"
            if masked else f"a window of {window} keys, shorter than the cache")
    return f"{what}: the usual attention over the whole cache, under transformers' mask"


def _plain_causal(mask, before: int, t: int, n: int) -> bool:
    """Whether `mask` (None, bool or additive, broadcastable to (B, H, t, >= n)) lets query row i
    of a chunk of t rows after `before` cached tokens see exactly keys 0 .. before + i of the n
    there are (a host sync: called for prompts and chunks, not for decode steps)."""
    if mask is None:
        return True
    m = mask[..., :n]
    visible = (torch.arange(n, device=m.device)[None, :]
               <= before + torch.arange(t, device=m.device)[:, None])  # (t, n)
    if m.dtype == torch.bool:
        return bool((m == visible).all())
    return bool(torch.where(visible, m == 0, m <= torch.finfo(m.dtype).min / 2).all())


def Cache(max_cache_len: int, storage: str = "native", paged: bool = False, page_size: int = 64,
          decode_runner: str | None = None, compile: bool | None = None):
    """A transformers Cache backed by adaattn.kv: pass it as `past_key_values` to generate() or
    forward() of a model loaded with attn_implementation="adaattn".

    max_cache_len: tokens per sequence it holds (prompt + new tokens); storage: "native" (the
    model dtype), "fp8" or "int8" (quantized once at append, per (page, KV head) scales); paged:
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
    from ..kv.cache import STORAGES
    from ..kv.decode import RUNNERS

    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    if decode_runner is not None and decode_runner not in RUNNERS:
        raise ValueError(f"decode_runner must be one of {RUNNERS} or None, got {decode_runner!r}")
    for name, value in (("max_cache_len", max_cache_len), ("page_size", page_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool or None, got {type(compile).__name__}")
    if compile is None:
        compile = torch.cuda.is_available()
    return _cache_class()(max_cache_len, storage, bool(paged), page_size, decode_runner, compile)


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

        @property
        def max_cache_len(self) -> int:  # a read-only property of transformers' Cache in some versions
            return self._capacity

        @property
        def is_compileable(self) -> bool:
            return self._compile

        def _state(self, layer):
            """The tensors the compiled-step ops take for `layer` (see _OWNERS)."""
            kv = self.kvs[layer]
            state = [kv.lengths, kv.k[0], kv.v[0]]
            if kv.storage != "native":
                state += [kv.k_scale[0], kv.v_scale[0]]
            return state

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
                                      max_seqs=b, max_pages_per_seq=per_seq)
                    seqs = tuple(kv.add(reserve=self.max_cache_len) for _ in range(b))  # (no allocation in steps)
                else:
                    kv = KVCache(1, b, hkv, self.max_cache_len, d, value_dim=value_states.shape[3],
                                 dtype=key_states.dtype, device=key_states.device, storage=self.storage,
                                 page_size=self.page_size)
                    seqs = tuple(range(b))
                self.kvs[layer], self.seqs = kv, seqs
                for x in self._state(layer):  # fixed addresses: CUDA graphs replay over them
                    torch._dynamo.mark_static_address(x, guard=False)
                ref = weakref.ref(self)
                _OWNERS[kv.lengths.data_ptr()] = (ref, layer)
                weakref.finalize(self, _forget, kv.lengths.data_ptr(), ref)
            before = kv.length(self.seqs[0])
            if before + t > self.max_cache_len:
                raise ValueError(f"max_cache_len={self.max_cache_len} is too short: layer {layer} would hold "
                                 f"{before + t} tokens")
            PagedKVCache.append(kv, 0, self.seqs, key_states, value_states)  # KVCache's own takes no seqs first
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
            from ..kv import decode_attention, plan_decode
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
            from ..kv import plan_decode

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


__all__ = ["NAME", "Cache", "attention_forward", "register", "set_policy"]
