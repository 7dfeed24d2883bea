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

The pieces live beside this module: hf_attention (the attention function), hf_policy
(set_policy), hf_cache (Cache), hf_decode (how the attention function reads a Cache: the decode
kernel or dense keys) and hf_cache_ops (the custom ops of compiled steps). This module registers
the attention function and is the one to import.
"""

from __future__ import annotations

from .hf_attention import attention_forward
from .hf_cache import Cache
from .hf_policy import set_policy

NAME = "adaattn"


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


__all__ = ["NAME", "Cache", "attention_forward", "register", "set_policy"]
