"""A storage per KV head on the 32k checkpoint's own keys and values (part of `--suite decode`).

Each layer of the shipped long-context GPT runs once over the held-out bytes (sparse_decode's
capture); its keys, values and queries are replicated to B=16 sequences and Hkv=8 KV heads
(Hq=24, D=64). Three caches hold every layer: bf16, INT8, and storage="auto" at TAU with INT4's
window of WINDOW tokens, whose first append (all but the last token: the prompt) chooses each
head's storage; the last token is appended as a decode step would. The timed rows are the whole
model's decode attention at the final length (its 8 layers, the last position's queries): cuDNN
through SDPA on the same keys and values as (B, Hkv, N, D) bf16 tensors, and each cache through
decode_attention with a plan, eager and replayed in a CUDA graph. The rows' info gives each
layer's storages per head, what was measured at the choice, and the output error of sequence 0
against float64 attention over the unquantized keys and values.
"""

from __future__ import annotations

import torch

from ...api import decode_attention, plan_decode
from ...backends.reference import relative_errors
from ...kv import KVCache
from ...problem import default_scale
from ..cases import Case, Peer, graphed
from .sparse_decode import BATCH, CONTEXT, KV_HEADS, PAGE, _capture, _replicate

TAU, WINDOW = 5e-2, 512
LAYERS, HEAD_DIM = 8, 64


def cases(device, context: int = CONTEXT) -> list[Case]:
    kv_bytes = LAYERS * 2 * BATCH * KV_HEADS * context * HEAD_DIM * 2
    series = (f"storage per head, 32k checkpoint, B={BATCH} Hq={3 * KV_HEADS} Hkv={KV_HEADS} D={HEAD_DIM} bf16, "
              f"all {LAYERS} layers")
    return [Case("decode", f"{series}, KV={context}", context,
                 {"batch": BATCH, "heads": 3 * KV_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                  "dtype": "bfloat16", "q_len": 1, "kv_len": context, "layers": LAYERS, "kv_bytes": kv_bytes,
                  "tolerance": TAU, "window": WINDOW}, "cuDNN", "TB/s", kv_bytes, _make(device, context),
                 series=series)]


def _exact_error(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """Sequence 0's relative error against float64 attention over the unquantized keys and values:
    out (B, Hq, 1, D), q (B, Hq, 1, D), k/v (B, Hkv, N, D)."""
    g = q.shape[1] // k.shape[1]
    qq = q[0, :, 0].double().view(k.shape[1], g, -1)  # (Hkv, G, D)
    p = torch.softmax(qq @ k[0].double().transpose(-1, -2) * default_scale(q.shape[-1]), -1)
    want = (p @ v[0].double()).reshape(q.shape[1], 1, -1)
    return float(relative_errors(out[0], want, dtype=torch.float64))


def _make(device, context):
    def make():
        layers = _capture(device, context)  # per layer: q (1, 6, steps, 64); k, v (1, 2, N, 64)
        n = layers[0][1].shape[2]
        dense, queries = [], []
        caches = {name: KVCache(LAYERS, BATCH, KV_HEADS, n, HEAD_DIM, dtype=torch.bfloat16, device=device,
                                page_size=PAGE, **kw)
                  for name, kw in (("bf16", {}), ("int8", dict(storage="int8")),
                                   (f"auto tau={TAU:g}", dict(storage="auto", tolerance=TAU, window=WINDOW)))}
        for layer, (q0, k0, v0) in enumerate(layers):
            reps = KV_HEADS // k0.shape[1]
            k, v = _replicate(k0, reps, k0.shape[1]), _replicate(v0, reps, k0.shape[1])
            queries.append(_replicate(q0[:, :, -1:], reps, k0.shape[1]))
            dense.append((k, v))
            for cache in caches.values():
                cache.append(layer, k[:, :, :n - 1], v[:, :, :n - 1])  # the prompt: "auto" chooses here
                cache.append(layer, k[:, :, n - 1:], v[:, :, n - 1:])  # a decode step's token
        plans = {name: plan_decode(c, heads=3 * KV_HEADS) for name, c in caches.items()}

        def through(name):
            cache, plan = caches[name], plans[name]
            return lambda: torch.stack([decode_attention(queries[i], cache, i, plan=plan) for i in range(LAYERS)])

        per_layer = {}
        for name in caches:
            outs = through(name)()
            per_layer[name] = [round(_exact_error(outs[i], queries[i], *dense[i]), 6) for i in range(LAYERS)]
        auto = caches[f"auto tau={TAU:g}"]
        summary = {"error_per_layer": per_layer, "storages_per_layer": [auto.storages(i) for i in range(LAYERS)],
                   "plan": plans[f"auto tau={TAU:g}"].explain()}

        def sdpa():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kernel = sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if queries[0].is_cuda else sdpa_kernel(SDPBackend.MATH)
            with kernel:
                return torch.stack([torch.nn.functional.scaled_dot_product_attention(
                    queries[i], dense[i][0], dense[i][1], enable_gqa=True) for i in range(LAYERS)])

        rows = [Peer("cuDNN", sdpa, info=lambda: dict(summary))]
        for name in caches:
            rows.append(Peer(f"kv {name}", through(name), info=lambda: dict(summary)))
            if queries[0].is_cuda:
                rows.append(graphed(f"kv {name} graph", through(name), lambda: dict(summary)))
        exact = through("bf16")().float()
        return rows, lambda out: float(relative_errors(out, exact, dtype=torch.float32))

    return make
