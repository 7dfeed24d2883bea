"""hf: a Llama-shaped transformers model built from a config (no download), with each attention implementation."""

from __future__ import annotations

import contextlib

import torch

from ..cases import Case, Peer, unavailable
from ..grid import dtype_name
from ..peers import optional_module

NAME = "hf"
HELP = ("a Llama-shaped transformers model from a config (GQA; no download), attn_implementation adaattn vs sdpa "
        "vs eager: prefill tokens/s and generate() tokens/s (--prompt-len, --new-tokens), generate also with adaattn's "
        "Cache (bf16 and fp8; compiled decode steps on CUDA, and uncompiled), with transformers' StaticCache over sdpa "
        "(its compiled path), and the fraction of new tokens equal to eager's; x sdpa. Runs on the CPU too, with a "
        "tiny model (where transformers compiles nothing)")
NEEDS_CUDA = False
IMPLEMENTATIONS = ("sdpa", "eager", "adaattn")
# Llama-shaped sizes: on CUDA the model of NOTES.md's "HF generate with compiled decode steps" (16
# layers, d=2048, 32 query and 8 KV heads, ~0.9B parameters, bf16); a toy on the CPU (float32).
SIZES = {
    "cuda": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, batch=8, prompt_len=2048, new_tokens=64),
    "cpu": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, batch=1, prompt_len=128, new_tokens=8),
}
RUN = ("batch", "prompt_len", "new_tokens")


def cases(args, device):
    defaults = SIZES["cuda" if device.type == "cuda" else "cpu"]
    size = {k: v for k, v in defaults.items() if k not in RUN}
    batch = getattr(args, "batch", None) or defaults["batch"]
    prompts = getattr(args, "seq_lens", None) or (getattr(args, "prompt_len", None) or defaults["prompt_len"],)
    new = getattr(args, "new_tokens", None) or defaults["new_tokens"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_cache: dict = {}
    desc = (f"llama {size['num_hidden_layers']}x{size['hidden_size']} H={size['num_attention_heads']}/"
            f"{size['num_key_value_heads']} B={batch}")
    out = []
    for phase in ("prefill", "generate"):
        for prompt in prompts:
            fields = {"model": "llama", **size, "batch": batch, "prompt_len": prompt, "new_tokens": new,
                      "dtype": dtype_name(dtype), "phase": phase}
            what = "prefill" if phase == "prefill" else f"generate {new} after"
            tokens = batch * (prompt if phase == "prefill" else new)
            out.append(Case(NAME, f"{desc} {what} {prompt}", prompt, fields, "sdpa", "tokens/s", tokens,
                            _maker(phase, size, batch, prompt, new, dtype, device, model_cache),
                            series=f"{desc} {phase}"))
    return out


def _model(size, dtype, device, cache):
    if "model" not in cache:
        transformers = optional_module("transformers")[0]
        import adaattn.integrations.hf  # noqa: F401  (registers attn_implementation="adaattn")

        cfg = transformers.LlamaConfig(**size, max_position_embeddings=1 << 17, pad_token_id=0, bos_token_id=1,
                                       eos_token_id=2)
        torch.manual_seed(0)
        cache["model"] = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                                       dtype=dtype).to(device).eval()
    return cache["model"]


def _maker(phase, size, batch, prompt, new, dtype, device, cache):
    def make():
        mod, why = optional_module("transformers")
        if mod is None:
            return [unavailable(impl, f"skipped: {why}") for impl in IMPLEMENTATIONS], None
        model = _model(size, dtype, device, cache)
        gen = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(3, size["vocab_size"], (batch, prompt), generator=gen).to(device)
        peers = [_peer(model, impl, phase, ids, new) for impl in IMPLEMENTATIONS]
        if phase == "prefill":
            return peers, None
        peers += [_peer(model, "adaattn", phase, ids, new, cache=storage) for storage in ("native", "fp8")]
        peers += [_peer(model, "adaattn", phase, ids, new, cache="native", compile=False),
                  _peer(model, "sdpa", phase, ids, new, cache="static")]
        model.set_attn_implementation("eager")
        eager = _generate(model, ids, new)[:, prompt:]

        def agreement(out):
            same = (out[:, prompt:] == eager).double().mean().item()
            return 1.0 - same, {"tokens_equal_to_eager": same}

        return peers, agreement

    return make


@torch.no_grad()
def _generate(model, ids, new, cache=None, **kw):
    if cache is not None:
        kw["past_key_values"] = cache
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, **kw)


def _peer(model, impl, phase, ids, new, cache: str | None = None, compile: bool = True) -> Peer:
    """`impl` on the model; with `cache` ("native", "fp8"), generate() with an adaattn Cache of that
    storage (compileable unless compile=False), made once per peer and reset before each call, as
    a server keeps one per batch and resets it per request (a compiled step then replays its CUDA
    graph; a new Cache would record it again); cache="static": transformers' StaticCache, which
    generate() makes once and resets alike, and compiles on CUDA."""
    @contextlib.contextmanager
    def switched():  # once around the peer's calls: switching is not what is timed
        model.set_attn_implementation(impl)
        yield

    @torch.no_grad()
    def prefill():
        return model(ids, use_cache=False).logits

    held = {}

    def generate():
        if cache is None:
            return _generate(model, ids, new)
        if cache == "static":
            return _generate(model, ids, new, cache_implementation="static")
        if "cache" not in held:
            from ...integrations.hf import Cache

            held["cache"] = Cache(ids.shape[1] + new, storage=cache, compile=compile)
        held["cache"].reset()
        return _generate(model, ids, new, held["cache"])

    if cache is None:
        name = impl
    elif cache == "static":
        name = f"{impl} + StaticCache"
    else:
        name = f"{impl} + Cache{'' if cache == 'native' else ' ' + cache}{'' if compile else ' (uncompiled)'}"
    return Peer(name, prefill if phase == "prefill" else generate, context=switched)
