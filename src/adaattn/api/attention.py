"""attention() and varlen_attention(): the entry points, SDPA-compatible."""

from __future__ import annotations

from typing import Optional

import torch

from .. import planner, stats
from ..backends.base import no_keys
from ..backends.varlen import check_varlen
from ..policy import Policy
from ..problem import NO_MODIFIERS, Documents, Modifiers, Problem, check_dropout, check_modifiers, check_scale, default_scale, documents, from_internal, validate, window_sides
from .run import _check_policy, _compiling, _modifier_key, _runner_form, _signature_or_none, _first_that_runs, _run, _run_recorded, _record

NO_KEYS = "none (no keys)"  # the record of a call with no key to attend: no runner ran


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    layout: str = "bhsd",
    window: tuple[int | None, int | None] | None = None,
    policy: Policy | None = None,
    label: str | None = None,
    documents: Documents | torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention, a drop-in for torch.nn.functional.scaled_dot_product_attention.

    Shapes with layout="bhsd" (default): query (..., Hq, Nq, D), key (..., Hkv, Nk, D),
    value (..., Hkv, Nk, Dv) -> (..., Hq, Nq, Dv), at least 2-D, leading dims broadcasting
    against each other as SDPA's do. With layout="bshd" the tensors are (..., N, H, D) instead,
    and the result is a (..., Nq, Hq, Dv) view; no copies are made for 4-D inputs.
    dtypes: float16, bfloat16, float32 (and float64), all three the same.

    attn_mask: bool (True = takes part) or additive (the query dtype, or float32), at least 2-D,
        broadcastable to (..., Hq, Nq, Nk); always in (..., H, Nq, Nk) order, whatever the layout.
    is_causal: top-left aligned causal mask, as SDPA; may be combined with attn_mask.
    window: (left, right) sliding window: query i attends keys i-left .. i+right
        (None on a side = unbounded); combines with is_causal and attn_mask.
    enable_gqa: allow Hq a multiple of Hkv (grouped-query / multi-query attention).
    dropout_p: applied whenever > 0, as SDPA (pass 0.0 in eval).
    policy: what may be approximated; None means exact.
    label: a name recorded in adaattn.stats for this call (a layer name, say).
    documents: documents packed along the sequence (FlexAttention's document mask): query i
        attends key j only within its own document, and is_causal / window apply inside it.
        adaattn.documents(document_ids) built once per batch (or the (N,) / (B, N) ids
        themselves, at a host sync per call). Self-attention (Nq == Nk), 3-D or 4-D tensors, no
        attn_mask or dropout; it runs as varlen_attention over the documents, without padding.
        With score modifiers it runs document by document in torch ops (varlen_attention's way
        with them), after one host read of the offsets.

    Score modifiers, on each score s = scale * q.k before masking (adaattn.problem.Modifiers):
    softcap: a float c > 0: s -> c * tanh(s / c) (Gemma 2's logit soft-capping).
    sinks: a (Hq,) tensor of logits, one per query head, each joining its rows' softmax
        denominator without a value: out_i = sum_j e^(s_ij) v_j / (e^(sinks[h]) + sum_j e^(s_ij))
        (gpt-oss's s_aux). Differentiable.
    alibi_slopes: (Hq,) or (B, Hq): s -> s - slope * |i - j|, positions aligned as the causal mask
        is (query i at position i). Differentiable where it requires grad.

    A row with no key to attend (fully masked) gives zeros, as SDPA's math backend.
    Raises TypeError/ValueError on bad arguments, NoBackendError (a ValueError) when no
    backend can run the call under the policy.
    """
    if type(dropout_p) is not float or (scale is not None and type(scale) is not float):
        # ints, NumPy scalars and 0-d tensors, as SDPA takes them, become Python floats here, once:
        # the call's signature (the plan cache's key) then holds no tensor.
        dropout_p, scale = check_dropout(dropout_p), check_scale(scale)
    modified = softcap is not None or sinks is not None or alibi_slopes is not None
    if documents is not None:
        return _document_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout,
                                   window, policy, label, documents, softcap, sinks, alibi_slopes)
    compiling = _compiling()
    signature = None if compiling else _signature_or_none(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                          enable_gqa, layout, window, policy)
    if modified and signature is not None:
        extra = _modifier_key(softcap, sinks, alibi_slopes)
        signature = None if extra is None else signature + extra
    hit = None
    if signature is not None:
        try:
            hit = planner.recall_call(signature)
        except TypeError:  # an unhashable argument: such calls are validated every time
            signature = None
    if hit is None:
        problem = validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout, window)
        problem, modifiers = check_modifiers(problem, softcap, sinks, alibi_slopes)
        pol = _check_policy(policy)
        plan = planner.get_plan(problem, pol, compiling)
        if signature is not None:
            planner.remember_call(signature, (problem, pol, plan))
    else:
        problem, pol, plan = hit
        modifiers = Modifiers(problem.softcap or None, sinks, alibi_slopes) if modified else NO_MODIFIERS
    mods = modifiers if modified else None
    if problem.kv_len == 0 or problem.q_len == 0:
        # No key, or no query: zeros in the query's shape (its leading dims as given, not broadcast
        # against the key's: torch's SDPA answers so, where a runner's (B, H, N, D) form would
        # broadcast them: seed 20261129 #462, H200), and zero gradients, whichever runner the plan
        # names; recorded as run by no runner.
        if stats.enabled and not compiling:
            note = (f"no {'key to attend' if problem.kv_len == 0 else 'query'}: zeros in the query's shape, as "
                    "SDPA gives, and no kernel launched")
            _record(problem, plan, pol, label, (), {"ran": NO_KEYS, "option": NO_KEYS, "note": note}, None)
        return no_keys(query, key, value, attn_mask, sinks, alibi_slopes)
    # torch's CPU SDPA runs its math kernel on a call that is not plain 4-D, on the tensors as given:
    # sdpa.cpu takes such a call in its own rank, so its result is torch's to the bit (flattened
    # to 4-D, math's batched products rounded differently: fp32 gradients of a 2-D call 3-5x torch's
    # error, a CPU fuzzer).
    call_form = (problem.out_lead is not None and len(plan.candidates) == 1
                 and planner.REGISTRY[plan.candidates[0]].takes_call_form)
    query, key, value, attn_mask = _runner_form(problem, query, key, value, attn_mask, call_form)
    if compiling:
        out = plan.runner.run(query, key, value, attn_mask, problem, plan.launch, label,
                              **({} if mods is None else {"modifiers": mods}))
    elif stats.enabled:
        out = _run_recorded(query, key, value, attn_mask, problem, plan, pol, label, mods)
    else:
        out = _run(query, key, value, attn_mask, problem, plan, label, modifiers=mods)[0]
    if problem.out_lead is not None and not call_form:
        out = from_internal(problem, out)
    if problem.layout == "bshd":
        return out.transpose(-3, -2)
    return out


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[tuple] = None,
    *,
    causal_alignment: str = "top_left",
    deterministic: bool = False,
    check_offsets: bool = True,
    policy: Optional[Policy] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention over a batch of sequences of different lengths, packed without padding.

    q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), Hq a multiple of Hkv;
    sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1]
    of k/v (int32 or int64, batch + 1 entries on q's device, starting at 0, never decreasing).
    max_seqlen_q/k bound the lengths (they size the launch grid).
    is_causal, window and causal_alignment ("top_left" as SDPA, or "bottom_right": the KV-cache
    convention) apply within each sequence. Rows of q past cu_seqlens_q[-1] give 0.
    check_offsets: check the offsets' values (one host read of a flag, a synchronisation, for
        offsets tensors this process has not checked; a tensor that passed is not read again
        until it changes in place, so one cu_seqlens passed to every layer is read once; skipped
        while a CUDA graph is captured or torch.compile traces). Pass False where the offsets are
        known good and the read matters.
    Returns (total_q, Hq, Dv) in q's dtype; differentiable. The planner picks the runner
    (varlen.triton: our kernels, no padding, no host sync; varlen.sdpa: torch SDPA per sequence).
    softcap, sinks, alibi_slopes: score modifiers as attention() takes them (alibi_slopes (Hq,) or
    (batch, Hq), positions within each sequence, aligned as causal_alignment says). Such a call
    runs sequence by sequence in torch ops (mods.torch), after one host read of the offsets: our
    varlen kernels apply none of them yet.
    Raises ValueError/TypeError for inconsistent shapes, dtypes, devices or offsets, each naming
    the argument.
    """
    if softcap is not None or sinks is not None or alibi_slopes is not None:
        return _modified_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                                window, causal_alignment, check_offsets, softcap, sinks, alibi_slopes)
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                             window, causal_alignment, deterministic, check_offsets, policy, None)


def _modified_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, window,
                     causal_alignment, check_offsets, softcap, sinks, alibi_slopes) -> torch.Tensor:
    """varlen_attention with score modifiers: each sequence through mods.torch (one host read of the
    offsets); rows of q past the last offset give 0, as the kernels give."""
    import dataclasses

    from ..backends.modifiers import modified_attention

    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(check_offsets))
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment must be 'top_left' or 'bottom_right', got {causal_alignment!r}")
    batch = cu_seqlens_q.shape[0] - 1
    if alibi_slopes is not None and isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 2 \
            and alibi_slopes.shape[0] != batch:
        raise ValueError(f"alibi_slopes must have shape (Hq,) = ({q.shape[1]},) or (batch, Hq) = ({batch}, "
                         f"{q.shape[1]}), got {tuple(alibi_slopes.shape)}")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for b in range(batch):
        qs, ks, vs = (t[lo:hi].transpose(0, 1)[None] for t, lo, hi in
                      ((q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]), (v, ck[b], ck[b + 1])))
        problem = validate(qs, ks, vs, None, 0.0, bool(is_causal), scale, q.shape[1] != k.shape[1], "bhsd", window)
        problem = dataclasses.replace(problem, bottom_right=causal_alignment == "bottom_right")
        slopes = alibi_slopes[b] if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 2 else alibi_slopes
        problem, modifiers = check_modifiers(problem, softcap, sinks, slopes)
        outs.append(modified_attention(qs, ks, vs, None, problem, modifiers)[0].transpose(0, 1))
    rest = q.shape[0] - cq[-1]
    if rest:
        outs.append(q.new_zeros(rest, q.shape[1], v.shape[-1]))
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[-1])


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, window,
                      causal_alignment, deterministic, check_offsets, policy, label):
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 bool(check_offsets) and not capturing and not _compiling())
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment must be 'top_left' or 'bottom_right', got {causal_alignment!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    from ..problem import check_window

    scale_f = check_scale(scale)
    left, right = window_sides(check_window(window))
    pol = _check_policy(policy)
    if deterministic and not pol.deterministic:
        from dataclasses import replace

        pol = replace(pol, deterministic=True)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    problem = Problem(
        batch=cu_seqlens_q.shape[0] - 1, q_heads=q.shape[1], kv_heads=k.shape[1], q_len=int(max_seqlen_q),
        kv_len=int(max_seqlen_k), head_dim=q.shape[-1], value_dim=v.shape[-1], dtype=q.dtype,
        device_type=q.device.type, device_index=q.device.index, causal=is_causal, window_left=left,
        window_right=right, mask_kind="none", dropout_p=0.0,
        scale=default_scale(q.shape[-1]) if scale_f is None else scale_f, needs_grad=needs_grad,
        gqa=q.shape[1] != k.shape[1], varlen=True, bottom_right=causal_alignment == "bottom_right",
    )
    plan = planner.get_plan(problem, pol, _compiling())
    out, failed = _first_that_runs(problem, plan, lambda r, launch: r.run_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, problem, launch))
    if stats.enabled and not _compiling():
        _record(problem, plan, pol, label, failed, None, None)
    return out


def _document_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout, window,
                        policy, label, docs, softcap=None, sinks=None, alibi_slopes=None):
    """attention(..., documents=docs): the tensors packed to (B * N, H, D) (a view for B = 1,
    or for "bshd" tensors contiguous over (B, N)), varlen_attention over the documents, and the
    result viewed back in the call's layout. Score modifiers go with each document (varlen's:
    document by document in torch ops); (B, Hq) ALiBi slopes give each document its row's slopes
    (positions within a document: the same differences as within its row)."""
    from ..problem import check_layout

    if not isinstance(docs, Documents):
        docs = documents(docs)
    layout = check_layout(layout)
    if attn_mask is not None:
        raise ValueError("attn_mask cannot be combined with documents (fold the documents into the mask, or "
                         "drop the mask)")
    if check_dropout(dropout_p) > 0:
        raise ValueError(f"dropout_p must be 0 with documents, got {dropout_p}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() not in (3, 4):
            raise ValueError(f"{name} must be 3-D or 4-D with documents, got shape {tuple(t.shape)}")
    if not query.dim() == key.dim() == value.dim():
        raise ValueError(f"query, key and value must have one rank, got {query.dim()}, {key.dim()}, {value.dim()}")
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query[None], key[None], value[None]
    if layout == "bhsd":  # (B, H, N, D) -> (B, N, H, D), a view
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    b, n, hq = query.shape[:3]
    hkv = key.shape[2]
    if key.shape[:2] != (b, n) or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"documents take self-attention: query, key and value must share batch and length "
                         f"({b}, {n}), got key {tuple(key.shape)} and value {tuple(value.shape)} ({layout})")
    if n != docs.length:
        raise ValueError(f"documents cover length {docs.length}, the tensors have length {n}")
    if hq != hkv and not enable_gqa:
        raise ValueError(f"query has {hq} heads and key/value {hkv}; pass enable_gqa=True for grouped-query "
                         "attention")
    if b * n == 0:  # no position: nothing to attend, as SDPA returns an empty result
        out = query.new_zeros(b, n, hq, value.shape[-1])
        out = out.transpose(1, 2) if layout == "bhsd" else out
        return out[0] if squeeze else out
    docs = docs.for_batch(b)
    cu = docs.cu_seqlens if docs.cu_seqlens.device == query.device else docs.cu_seqlens.to(query.device)
    packed = [t.reshape(b * n, t.shape[2], t.shape[3]) for t in (query, key, value)]
    if softcap is not None or sinks is not None or alibi_slopes is not None:
        slopes = alibi_slopes
        if isinstance(slopes, torch.Tensor) and slopes.dim() == 2:
            if tuple(slopes.shape) != (b, hq):
                raise ValueError(f"alibi_slopes must have shape (Hq,) = ({hq},) or (batch, Hq) = ({b}, {hq}), got "
                                 f"{tuple(slopes.shape)}")
            row = torch.div(cu[:-1].long(), n, rounding_mode="floor").clamp_(max=b - 1)  # each document's row
            slopes = slopes[row.to(slopes.device)]
        out = _modified_varlen(*packed, cu, cu, docs.max_seqlen, docs.max_seqlen, is_causal, scale, window,
                               "top_left", False, softcap, sinks, slopes)
    else:
        out = _varlen_attention(*packed, cu, cu, docs.max_seqlen, docs.max_seqlen, is_causal, scale, window,
                                "top_left", False, False, policy, label)
    out = out.view(b, n, hq, out.shape[-1])
    if layout == "bhsd":
        out = out.transpose(1, 2)
    return out[0] if squeeze else out
