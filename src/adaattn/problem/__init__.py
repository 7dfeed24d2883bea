"""The frozen facts of one attention call, and the input checks that produce them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .arguments import (  # noqa: F401 (the package's names, as before it was split)
    LAYOUTS, NUMBER, _broadcast, _broadcastable, _name, check_dropout, check_layout, check_scale, check_window,
    sdpa_float,
)
from .documents import Documents, documents  # noqa: F401
from .modifiers import (  # noqa: F401
    NO_MODIFIERS, Modifiers, check_modifier_tensor, check_sinks_shape, check_softcap,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Dispatch buckets on max(q_len, kv_len). Under torch.compile(dynamic=True) each bucket
# is one guard range, so a new sequence length recompiles only when it crosses a bucket.
SEQ_BUCKETS = ((1, "decode"), (512, "short"), (8192, "medium"))
LONG_BUCKET = "long"


@dataclass(frozen=True)
class Problem:
    """Shapes and options of one call, in the internal (B, H, N, D) layout, resolved once.

    scale: the softmax scale, resolved (1/sqrt(head_dim) when the call gave none).
    window_left / window_right: the sliding-window sides, -1 where unbounded.
    out_lead: the leading dims of the output as SDPA gives them (the call's batch dims and
        heads), or None where the call was plain 4-D (B, H, N, D) with nothing to broadcast.
    bottom_right: query i sits at position i + kv_len - q_len (the KV-cache convention);
        SDPA's (and the default) is top-left.
    tma_aligned: q, k and v each have a unit last stride and 16-byte aligned base and strides
        (what tensor-descriptor loads need).
    varlen: packed sequences (varlen_attention): lengths are maxima over the batch.
    """

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    device_type: str
    device_index: int | None
    causal: bool
    window_left: int
    window_right: int
    mask_kind: str  # "none", "bool" or "additive"
    dropout_p: float
    scale: float
    needs_grad: bool
    layout: str = "bhsd"
    gqa: bool = False  # q_heads != kv_heads, decided once (a plain bool even under torch.compile)
    mask_grad: bool = False  # an additive attn_mask that requires grad (a learned bias)
    mask_dtype: torch.dtype | None = None  # an additive mask's dtype (float32 may come with half queries)
    out_lead: tuple | None = None
    tma_aligned: bool = False
    varlen: bool = False
    bottom_right: bool = False  # causal/window aligned to the end of the keys (KV caches)
    # Score modifiers (see Modifiers): the soft cap c (0.0: none), whether sinks or ALiBi slopes come
    # with the call, and whether the slopes want a gradient (a wanted sinks gradient sets needs_grad).
    softcap: float = 0.0
    sinks: bool = False
    alibi: bool = False
    alibi_grad: bool = False
    # Whether one of torch's fused SDPA kernels (cuDNN, flash, efficient) takes the call, as the
    # planner finds when it asks every runner (set there, before the runners prepare their launch):
    # where none does, torch answers with its math kernel, the accuracy our kernels then match.
    torch_fused: bool = True

    @property
    def modifiers(self) -> tuple[str, ...]:
        """The score modifiers of the call, by argument name."""
        return tuple(n for n, on in (("softcap", self.softcap > 0), ("sinks", self.sinks),
                                     ("alibi_slopes", self.alibi)) if on)

    @property
    def window(self) -> tuple[int | None, int | None] | None:
        """(left, right) with None for an unbounded side, or None without a window."""
        if self.window_left < 0 and self.window_right < 0:
            return None
        return (None if self.window_left < 0 else self.window_left,
                None if self.window_right < 0 else self.window_right)

    @property
    def gqa_groups(self) -> int:
        return self.q_heads // self.kv_heads if self.kv_heads else 1

    @property
    def seq_bucket(self) -> str:
        if self.q_len <= 1:
            return "decode"
        n = max(self.q_len, self.kv_len)
        for limit, name in SEQ_BUCKETS[1:]:
            if n <= limit:
                return name
        return LONG_BUCKET

    @property
    def shape_class(self) -> tuple:
        """What dispatch keys on: everything but exact lengths and batch/head counts."""
        return (
            self.device_type,
            self.dtype,
            self.seq_bucket,
            self.head_dim,
            self.value_dim,
            self.causal,
            self.window is not None,
            self.mask_kind,
            self.mask_dtype,
            self.gqa,
            self.dropout_p > 0.0,
            self.needs_grad,
            self.mask_grad,
            self.layout,
            self.q_len != self.kv_len,  # runners decline causal/window calls on unequal lengths
            self.q_len == 0 or self.kv_len == 0,  # and empty sequences
            self.tma_aligned,
            self.varlen,
            self.bottom_right,
            self.softcap, self.sinks, self.alibi, self.alibi_grad,
            self.out_lead is not None,  # runners decline calls that are not 4-D
            self.out_lead is not None and self.scores <= SMALL_SCORES,  # and small ones of them, forward too
        )

    @property
    def scores(self) -> int:
        """The size of the score matrix: B x Hq x Nq x Nk."""
        return self.batch * self.q_heads * self.q_len * self.kv_len

    def describe(self) -> str:
        parts = [
            f"B={self.batch} Hq={self.q_heads} Hkv={self.kv_heads} Nq={self.q_len} "
            f"Nk={self.kv_len} D={self.head_dim}",
            str(self.dtype).replace("torch.", ""),
            self.device_type,
        ]
        if self.value_dim != self.head_dim:
            parts.append(f"Dv={self.value_dim}")
        if self.varlen:
            parts.append("packed sequences (lengths are maxima)")
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.mask_kind != "none":
            parts.append(f"{self.mask_kind} mask" + (f" ({str(self.mask_dtype).replace('torch.', '')})"
                                                      if self.mask_dtype not in (None, self.dtype) else ""))
        if self.dropout_p:
            parts.append(f"dropout={self.dropout_p}")
        if self.softcap > 0:
            parts.append(f"softcap={self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        if self.alibi:
            parts.append("alibi_slopes")
        if self.needs_grad:
            parts.append("grad")
        return ", ".join(parts)


def check_modifiers(problem: Problem, softcap: object = None, sinks: object = None,
                    alibi_slopes: object = None) -> tuple[Problem, Modifiers]:
    """Check the score modifiers of a call against its problem; returns the problem with their facts
    and the Modifiers to hand a runner. Raises TypeError/ValueError naming the argument."""
    if softcap is None and sinks is None and alibi_slopes is None:
        return problem, NO_MODIFIERS
    import dataclasses

    cap = check_softcap(softcap)
    heads = problem.q_heads
    for name, t in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if t is not None:
            check_modifier_tensor(name, t, problem.device_type)
    if sinks is not None:
        check_sinks_shape(sinks, heads)
    if alibi_slopes is not None and tuple(alibi_slopes.shape) not in ((heads,), (problem.batch, heads)):
        raise ValueError(f"alibi_slopes must have shape (Hq,) = ({heads},) or (B, Hq) = ({problem.batch}, {heads}), "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes is not None and alibi_slopes.dim() == 2 and problem.out_lead is not None:
        raise ValueError("alibi_slopes of shape (B, Hq) needs 4-D (B, H, N, D) tensors; pass (Hq,) slopes for "
                         "other ranks")
    if problem.varlen:
        raise ValueError("score modifiers (softcap, sinks, alibi_slopes) are not yet applied to packed sequences")
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (sinks, alibi_slopes))
    alibi_grad = torch.is_grad_enabled() and alibi_slopes is not None and alibi_slopes.requires_grad
    problem = dataclasses.replace(problem, softcap=cap or 0.0, sinks=sinks is not None, alibi=alibi_slopes is not None,
                                  alibi_grad=alibi_grad, needs_grad=problem.needs_grad or grad)
    return problem, Modifiers(cap, sinks, alibi_slopes)


def default_scale(head_dim: int) -> float:
    """SDPA's default softmax scale, 1/sqrt(head_dim); with head_dim 0 every score is 0, and
    any finite scale gives SDPA's result (uniform attention)."""
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


def window_sides(window: tuple[int | None, int | None] | None) -> tuple[int, int]:
    """(left, right) with -1 for an unbounded side."""
    if window is None:
        return -1, -1
    left, right = window
    return (-1 if left is None else int(left)), (-1 if right is None else int(right))


# A call that is not 4-D runs torch's math kernel in torch's SDPA; where its score matrix has at most
# this many elements adaattn runs math too, forward as well (backends/sdpa.py says why).
SMALL_SCORES = 1 << 22


def tma_aligned(*tensors: torch.Tensor) -> bool:
    """Unit last stride, 16-byte aligned base and strides, no expanded (stride-0) dim (no data
    read: meta tensors say False)."""
    if torch.compiler.is_compiling():  # data pointers are not traceable: plan for any alignment
        return False
    for t in tensors:
        if t.device.type == "meta" or t.stride(-1) != 1:
            return False
        e = t.element_size()
        if t.data_ptr() % 16 or any((st * e) % 16 for st in t.stride()[:-1]):
            return False
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):  # expanded: rows alias
            return False
    return True


def validate(
    query: object,
    key: object,
    value: object,
    attn_mask: object = None,
    dropout_p: object = 0.0,
    is_causal: object = False,
    scale: object = None,
    enable_gqa: object = False,
    layout: object = "bhsd",
    window: object = None,
) -> Problem:
    """Check the arguments of `attention` and return the Problem they describe.

    As SDPA: query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev), at least 2-D,
    leading dims broadcast against each other (key/value batch 1 against query's batch, say).
    With layout="bshd" the tensors are 4-D (B, N, H, D). Tensors are described in the internal
    (B, H, N, D) layout whatever `layout` says.
    Raises TypeError for arguments of the wrong type and ValueError for wrong values,
    each naming the argument, what it got and what is allowed.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {_name(t)}")
    layout = check_layout(layout)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if layout == "bshd" and t.dim() < 3:
            raise ValueError(f"{name} must be at least 3-D (..., seq, heads, head_dim) for layout='bshd', got "
                             f"{t.dim()}-D shape {tuple(t.shape)}")
        if t.dim() < 2:
            raise ValueError(f"{name} must be at least 2-D (..., seq, head_dim), got {t.dim()}-D shape "
                             f"{tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{name} must have a floating dtype (float16, bfloat16, float32, float64), got {t.dtype}"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}"
        )
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if layout == "bshd":  # (..., N, H, D): described as (..., H, N, D)
        qs, ks, vs = (tuple(t.shape[:-3]) + (t.shape[-2], t.shape[-3], t.shape[-1]) for t in (query, key, value))
    else:
        qs, ks, vs = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    nq, d = qs[-2], qs[-1]
    nk, dk = ks[-2], ks[-1]
    nv, dv = vs[-2], vs[-1]
    if dk != d:
        raise ValueError(f"key head_dim must equal query head_dim {d}, got {dk}")
    if nv != nk:
        raise ValueError(f"value seq length must equal key seq length {nk}, got {nv}")
    q_lead, k_lead, v_lead = qs[:-2], ks[:-2], vs[:-2]
    k_lead = _broadcast([k_lead, v_lead], "key and value")
    hq = q_lead[-1] if q_lead else 1
    hk = k_lead[-1] if k_lead else 1
    gqa = False
    # Different head counts (dim -3): grouped-query attention with enable_gqa=True, as SDPA;
    # a single head on one side otherwise broadcasts like any other leading dim.
    if q_lead and k_lead and hk != hq and (min(hq, hk) != 1 or (enable_gqa and hk == 1)):
        if not enable_gqa:
            raise ValueError(
                f"key/value heads ({hk}) differ from query heads ({hq}); pass enable_gqa=True for "
                "grouped-query attention"
            )
        if hk == 0 or hq % hk != 0:
            raise ValueError(
                f"query heads ({hq}) must be a multiple of key/value heads ({hk}) for grouped-query attention"
            )
        gqa = hk != hq
        batch_dims = _broadcast([q_lead[:-1], k_lead[:-1], v_lead[:-1]], "query, key and value")
        out_lead = batch_dims + (hq,)
    else:
        out_lead = _broadcast([q_lead, k_lead, v_lead], "query, key and value")
        hq = hk = out_lead[-1] if out_lead else 1
        batch_dims = out_lead[:-1]
    b = math.prod(batch_dims) if batch_dims else 1
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    dropout = check_dropout(dropout_p)
    scale_f = check_scale(scale)
    win = check_window(window)

    mask_kind, mask_dtype = "none", None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {_name(attn_mask)}")
        if attn_mask.dtype == torch.bool:
            mask_kind = "bool"
        elif attn_mask.dtype == query.dtype or attn_mask.dtype == torch.float32:
            mask_kind, mask_dtype = "additive", attn_mask.dtype
        else:
            raise TypeError(
                f"attn_mask must be bool, float32 or the query dtype {query.dtype}, got {attn_mask.dtype}"
            )
        if attn_mask.device != query.device:
            raise ValueError(f"attn_mask must be on the query device {query.device}, got {attn_mask.device}")
        if attn_mask.dim() < 2:
            raise ValueError(f"attn_mask must be at least 2-D (..., q_len, k_len), got {attn_mask.dim()}-D shape "
                             f"{tuple(attn_mask.shape)}")
        target = tuple(out_lead) + (nq, nk)
        if not _broadcastable(tuple(attn_mask.shape), target):
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                f"(..., heads, q_len, k_len) = {target}"
            )

    needs_grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )
    mask_grad = torch.is_grad_enabled() and attn_mask is not None and attn_mask.requires_grad
    plain = (len(qs) == len(ks) == len(vs) == 4 and q_lead == tuple(out_lead)
             and k_lead[:-1] == tuple(batch_dims) and (gqa or k_lead == tuple(out_lead)) and vs[:-2] == ks[:-2])
    left, right = window_sides(win)
    return Problem(
        batch=b,
        q_heads=hq,
        kv_heads=hk,
        q_len=nq,
        kv_len=nk,
        head_dim=d,
        value_dim=dv,
        dtype=query.dtype,
        device_type=query.device.type,
        device_index=query.device.index,
        causal=is_causal,
        window_left=left,
        window_right=right,
        mask_kind=mask_kind,
        dropout_p=dropout,
        scale=default_scale(d) if scale_f is None else scale_f,
        needs_grad=needs_grad or mask_grad,
        layout=layout,
        gqa=gqa,
        mask_grad=mask_grad,
        mask_dtype=mask_dtype,
        out_lead=None if plain else tuple(out_lead),
        tma_aligned=tma_aligned(query, key, value),
    )


def to_internal(problem: Problem, query, key, value, attn_mask):
    """(q, k, v, mask) as (B, H, N, D) views for a call whose inputs were not plain 4-D
    (problem.out_lead non-empty): leading dims broadcast (expand, a view) and flattened."""
    lead = problem.out_lead
    batch = lead[:-1]
    kv_lead = batch + (problem.kv_heads,)

    def four(t, heads_lead):
        t = t.expand(*heads_lead, *t.shape[-2:])
        return t.reshape(problem.batch, heads_lead[-1] if heads_lead else 1, *t.shape[-2:])

    q = four(query, lead)
    k, v = four(key, kv_lead), four(value, kv_lead)
    if attn_mask is not None and len(lead) > 2 and attn_mask.dim() >= 4:
        if attn_mask.requires_grad and attn_mask.dtype in (torch.float16, torch.bfloat16):
            # Laid out, the mask's gradient is summed back over its broadcast dims: in float32, as
            # torch's math kernel sums it on the call as given (half precision: 2-8x its error).
            # Only math kernels take mask gradients, and they take a float32 mask.
            attn_mask = attn_mask.float()
        attn_mask = attn_mask.expand(*lead, *attn_mask.shape[-2:]).reshape(
            problem.batch, problem.q_heads, *attn_mask.shape[-2:])
    return q, k, v, attn_mask


def from_internal(problem: Problem, out: torch.Tensor) -> torch.Tensor:
    """The (B, Hq, Nq, Dv) output in the call's own leading dims."""
    return out.reshape(*problem.out_lead, problem.q_len, problem.value_dim)
