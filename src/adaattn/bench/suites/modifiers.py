"""modifiers: score modifiers (Gemma 2's soft-capping, gpt-oss's attention sinks) in prefill and
training, and sinks in decode over our cache.

Prefill: B=2 H=16 D=128 bf16 causal at 16k (--seq-lens), forward and forward+backward, with
softcap 50 (Gemma 2's attn_logit_softcapping) and with one random sink logit per head. Peers:
FlexAttention with the equivalent score_mod (soft-capping) or its lse (sinks: out * sigmoid(lse -
sink), which is the sink's softmax exactly), adaattn with the modifier (default policy, and our
Triton kernels pinned), and the same adaattn and cuDNN calls without the modifier: the ratio
x_<row> against "adaattn (no modifier)" says what the modifier costs.

Decode: B=16 Hq=32 Hkv=8 D=128 bf16, one query row over a 32k KVCache (bf16): decode_attention
with a plan, without and with sinks (and soft-capping), eager and CUDA-graph replay.
"""

from __future__ import annotations

import math

import torch

from ...api import attention, decode_attention, plan_decode
from ...backends.reference import relative_error, sample_rows
from ...backends.reference import reference_attention, relative_errors
from ...policy import Policy
from .. import peers
from ..cases import Case, Peer, graphed, unavailable
from ..dense import describe, random_qkv
from ..grid import Grid, dtype_name
from ..peers import Call
from . import options

NAME = "modifiers"
HELP = ("score modifiers, bf16 B=2 H=16 D=128 causal 16k, fwd and fwd+bwd, softcap 50 and sinks: FlexAttention "
        "(score_mod / lse), adaattn, triton, and the calls without the modifier; decode B=16 Hq=32 Hkv=8 32k over a "
        "KVCache with and without sinks; x flex and x the call without the modifier")
NEEDS_CUDA = True
DEFAULT = Grid((16384,), batch=2, heads=16, kv_heads=None, head_dim=128, dtypes=(torch.bfloat16,), causal="yes")
DECODE = Grid((32768,), batch=16, heads=32, kv_heads=8, head_dim=128, dtypes=(torch.bfloat16,), causal="no")
SOFTCAP = 50.0
PLAIN = "adaattn (no modifier)"
ERROR_ROWS = 128


def cases(args, device):
    grid = options.grid(args, DEFAULT, causal="yes")
    kv_heads = grid.kv_heads or grid.heads
    out = []
    for dtype in grid.dtypes:
        for i, n in enumerate(grid.seq_lens):
            for mod in ("softcap", "sinks"):
                for backward in (False, True):
                    what = "fwd+bwd" if backward else "fwd"
                    series = f"{mod} {describe(grid.batch, grid.heads, kv_heads, grid.head_dim, dtype)} {what}"
                    flops = 2.0 * grid.batch * grid.heads * grid.head_dim * n * (n + 1) * (3.5 if backward else 1)
                    fields = {"batch": grid.batch, "heads": grid.heads, "kv_heads": kv_heads,
                              "head_dim": grid.head_dim, "dtype": dtype_name(dtype), "seq_len": n, "causal": True,
                              "modifier": mod, "softcap": SOFTCAP if mod == "softcap" else None, "pass": what}
                    make = _prefill(grid, kv_heads, n, dtype, mod, backward, device, options.seed(args) + i)
                    out.append(Case(NAME, f"{series} N={n}", n, fields, "flex", "TFLOP/s", flops, make,
                                    series=series, also=(PLAIN,)))
    dec = DECODE
    for n in dec.seq_lens:
        kv_bytes = 2 * dec.batch * dec.kv_heads * n * dec.head_dim * 2
        series = f"decode {describe(dec.batch, dec.heads, dec.kv_heads, dec.head_dim, torch.bfloat16)}"
        out.append(Case(NAME, f"{series} KV={n} sinks", n,
                        {"batch": dec.batch, "heads": dec.heads, "kv_heads": dec.kv_heads, "head_dim": dec.head_dim,
                         "dtype": "bf16", "q_len": 1, "kv_len": n, "kv_bytes": kv_bytes, "modifier": "sinks"},
                        "kv bf16", "TB/s", kv_bytes, _decode(dec, n, device, options.seed(args) + 90), series=series))
    return out


def _sinks(heads: int, device, seed: int) -> torch.Tensor:
    """One sink logit per head, spread as gpt-oss's trained sinks are (a few units around 0)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(heads, generator=gen, device=device, dtype=torch.float32) * 2


def _prefill(grid, kv_heads, n, dtype, mod, backward, device, seed):
    def make():
        q, k, v = random_qkv(grid.batch, grid.heads, kv_heads, n, n, grid.head_dim, dtype, device, seed, backward)
        call = Call(q, k, v, causal=True, backward=backward)
        sinks = _sinks(grid.heads, device, seed + 1).to(dtype).requires_grad_(backward) if mod == "sinks" else None
        kw = {"softcap": SOFTCAP} if mod == "softcap" else {"sinks": sinks}
        inputs = (q, k, v) + ((sinks,) if sinks is not None else ())
        rows = [_flex(call, mod, sinks, inputs),
                _peer(call, "adaattn", lambda: attention(q, k, v, is_causal=True, **kw), inputs),
                _peer(call, "triton", lambda: attention(q, k, v, is_causal=True, policy=Policy(backends=("triton",)),
                                                        **kw), inputs),
                peers.adaattn(call, PLAIN), peers.sdpa(call, "cuDNN")]
        rows[-1].name = "cuDNN (no modifier)"
        return rows, _check(q, k, v, kw)

    return make


def _peer(call: Call, name: str, forward, inputs) -> Peer:
    timed = peers.with_backward(forward, inputs) if call.backward else None
    return Peer(name, forward, timed=timed)


def _flex(call: Call, mod: str, sinks, inputs) -> Peer:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as e:
        return unavailable("flex", f"torch.nn.attention.flex_attention does not import ({type(e).__name__})")
    n = call.q.shape[2]
    block_mask = torch.compile(create_block_mask)(lambda b, h, i, j: i >= j, None, None, n, n, device=call.q.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    q, k, v = call.q, call.k, call.v
    if mod == "softcap":
        def cap(score, b, h, i, j):
            return SOFTCAP * torch.tanh(score / SOFTCAP)

        def forward():
            return compiled(q, k, v, score_mod=cap, block_mask=block_mask)
    else:
        def forward():
            # The sink's softmax: each row's output times exp(lse) / (exp(lse) + exp(sink)).
            out, lse = compiled(q, k, v, block_mask=block_mask, return_lse=True)
            return out * torch.sigmoid(lse - sinks.float()[None, :, None])[..., None].to(out.dtype)
    return _peer(call, "flex", forward, inputs)


def _check(q, k, v, kw):
    """Relative error against float64 with the modifier, on ERROR_ROWS sampled query rows."""
    idx = sample_rows(q.shape[2], ERROR_ROWS).to(q.device)
    keep = torch.arange(k.shape[2], device=q.device)[None, :] <= idx[:, None]
    with torch.no_grad():
        sinks = kw.get("sinks")
        ref = reference_attention(q.detach().index_select(2, idx), k.detach(), v.detach(), keep,
                                  softcap=kw.get("softcap"), sinks=None if sinks is None else sinks.detach())
    return lambda out: relative_error(out, ref, idx)


def _decode(dec, n, device, seed):
    def make():
        from ...kv import KVCache

        q, k, v = random_qkv(dec.batch, dec.heads, dec.kv_heads, 1, n, dec.head_dim, torch.bfloat16, device, seed)
        cache = KVCache(1, dec.batch, dec.kv_heads, n, dec.head_dim, dtype=q.dtype, device=device)
        cache.append(0, k, v)
        # Sinks near the log of the length: their weight in each row is of order one, so the error
        # column tells a step that applies them from one that does not.
        sinks = (_sinks(dec.heads, device, seed + 1) + math.log(n)).to(q.dtype)
        plan = plan_decode(cache, heads=dec.heads, query_len=1)
        rows = []
        for name, kw in (("kv bf16", {}), ("kv bf16 sinks", {"sinks": sinks}),
                         ("kv bf16 softcap", {"softcap": SOFTCAP})):
            def call(kw=kw):
                return decode_attention(q, cache, 0, plan=plan, **kw)

            info = (lambda: {"decode_plan": plan.explain()})
            rows.append(Peer(name, call, info=info))
            rows.append(graphed(f"{name} graph", call, info))
        return rows, _decode_check(q, k, v, sinks)

    return make


def _decode_check(q, k, v, sinks):
    """Against float64 with the sinks: the rows without them (and those with the soft cap instead)
    differ by the sinks' weight, which their error column then shows; the check is for the rows
    with sinks."""
    with torch.no_grad():
        ref = reference_attention(q, k, v, sinks=sinks)

    def check(out):
        return relative_errors(out, ref).item()

    return check
