"""How adaattn's attention function reads an adaattn Cache: `_Handle`, which a Cache layer's
update() attaches to the keys it returns, chooses per call between decode_attention over the cache
(decode steps, uncompiled or through the compiled-step decode op) and the usual attention over
dense keys (prompts, chunks, masked or windowed steps), and records why in the cache.
"""

from __future__ import annotations

import torch

from .hf_cache_ops import _decode_op, _gather_op


DECODE_ROWS = 64  # a step whose query rows (T x GQA group) fit one tile of the decode kernel
SETTLE_ROWS = 16  # storage="auto": the prompt's last query rows that choose each head's storage


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
        from ..api import decode_attention

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

    def settle(self, query):
        """storage="auto": a prompt's last query rows choose each head's storage (kv/mixed.py), before
        any step reads the cache (a compiled step cannot move its tokens)."""
        if self.token is not None or self.before != 0:
            return
        kv = self.cache.kvs[self.layer]
        if kv.storage == "mixed" and kv._mixed[0] is not None and kv._mixed[0].pending:
            from ..kv import mixed

            mixed.settle(kv, 0, query[:, :, -SETTLE_ROWS:], self.cache.seqs)
            self.cache._static(self.layer)

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
