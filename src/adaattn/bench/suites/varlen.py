"""varlen: documents packed without padding, causal within each, against the documents as a batch."""

from __future__ import annotations

import torch

from ...api import attention, varlen_attention
from ...problem import documents
from .. import peers
from ..cases import Case
from ..dense import describe, error_check, random_qkv
from ..grid import Grid, dtype_name
from ..peers import Call
from . import options

NAME = "varlen"
HELP = ("--documents 8 x --doc-len 8192 packed, causal in each, bf16 H=16 D=128, fwd and fwd+bwd: "
        "adaattn.varlen_attention and adaattn.attention(documents=) vs cuDNN on the documents as a batch, adaattn on "
        "the batch, Flex document mask; "
        "x cuDNN (batch)")
NEEDS_CUDA = True
DEFAULT = Grid((8192,), batch=8, heads=16, kv_heads=None, head_dim=128, dtypes=(torch.bfloat16,), causal="yes")


def cases(args, device):
    docs = getattr(args, "documents", None) or DEFAULT.batch
    doc_len = getattr(args, "doc_len", None)
    grid = options.grid(args, DEFAULT, causal="yes", batch=docs, **({"seq_lens": (doc_len,)} if doc_len else {}))
    kv_heads = grid.kv_heads or grid.heads
    out = []
    for dtype in grid.dtypes:
        for i, n in enumerate(grid.seq_lens):
            for backward in (False, True):
                what = "fwd+bwd" if backward else "fwd"
                series = f"varlen {describe(1, grid.heads, kv_heads, grid.head_dim, dtype)} {docs} docs {what}"
                flops = 2.0 * docs * grid.heads * n * n * grid.head_dim * (3.5 if backward else 1)
                fields = {"documents": docs, "doc_len": n, "heads": grid.heads, "kv_heads": kv_heads,
                          "head_dim": grid.head_dim, "dtype": dtype_name(dtype), "causal": True, "pass": what}
                make = _maker(docs, n, grid.heads, kv_heads, grid.head_dim, dtype, backward, device,
                              options.seed(args) + i)
                out.append(Case(NAME, f"{series} doc_len={n}", n, fields, "cuDNN (batch)", "TFLOP/s", flops, make,
                                series=series))
    return out


def _maker(docs, n, heads, kv_heads, head_dim, dtype, backward, device, seed):
    def make():
        # Packed (total, H, D) leaves; each peer takes its own view of them inside its call.
        q, k, v = (t.transpose(1, 2).reshape(docs * n, t.shape[1], head_dim).detach().requires_grad_(backward)
                   for t in random_qkv(docs, heads, kv_heads, n, n, head_dim, dtype, device, seed))
        packed = (q, k, v)
        cu = torch.arange(0, docs + 1, device=device, dtype=torch.int32) * n
        doc_id = torch.arange(docs * n, device=device) // n
        doc_mask = documents(doc_id)  # built once, as Flex's block mask is

        def as_batch(t):  # (total, H, D) -> (docs, H, n, D), a view
            return t.view(docs, n, t.shape[1], head_dim).transpose(1, 2)

        def as_one(t):  # (total, H, D) -> (1, H, total, D), a view
            return t.unsqueeze(0).transpose(1, 2)

        def same_doc(b, h, q_idx, kv_idx):
            return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

        batch = Call(*(as_batch(t) for t in packed), causal=True)
        one = Call(*(as_one(t) for t in packed), causal=True)
        rows = [
            _packed(peers.sdpa(batch, "cuDNN (batch)", peers.SDPA_KERNELS["cuDNN"]), packed, backward),
            _packed(peers.adaattn(batch, "adaattn (batch)"), packed, backward),
            _packed(peers.Peer("varlen", lambda: as_batch(varlen_attention(q, k, v, cu, cu, n, n, is_causal=True))),
                    packed, backward),
            _unpacked(peers.Peer("adaattn (documents)", lambda: attention(*(as_one(t) for t in packed), is_causal=True,
                                                                         documents=doc_mask,
                                                                         enable_gqa=kv_heads != heads)),
                      docs, n, head_dim, packed, backward),
            _unpacked(peers.flex(one, same_doc, "flex (document)"), docs, n, head_dim, packed, backward),
        ]
        check = error_check(Call(*(as_batch(t.detach()) for t in packed), causal=True))
        return rows, check

    return make


def _packed(peer, packed, backward):
    """`peer` with the backward taken to the packed leaves."""
    if backward and peer.forward is not None:
        peer.timed = peers.with_backward(peer.forward, packed)
    return peer


def _unpacked(peer, docs, n, head_dim, packed, backward):
    """A (1, H, total, D) peer whose output is viewed as (docs, H, n, D) for the error check."""
    if peer.forward is None:
        return peer
    one = peer.forward
    peer.forward = lambda: one().transpose(1, 2).reshape(docs, n, -1, head_dim).transpose(1, 2)
    return _packed(peer, packed, backward)
