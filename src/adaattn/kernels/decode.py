"""Split-KV decode over a paged KV cache: a few query rows per sequence against its cached keys.

One program owns one (sequence, KV head, split): the query rows of the whole GQA group of that
KV head (G query heads x T rows, packed into one BLOCK_M tile, row r = g * T + t) against the
keys of its split, BLOCK_N keys at a time, each key's page read from the sequence's block-table
row. Pages in FP8 or INT8 convert exactly to fp16 in registers, and their (page, KV head) scales
multiply the scores and P; INT4 pages are dequantized in registers (per token and group of
channels) to the query's dtype. Each program writes its split's normalised output and natural-log
log-sum-exp; a second kernel merges the splits by log-sum-exp.

Positions are bottom-right aligned: query row t of T sits at position len - T + t and sees keys
j <= that (len: the sequence's length in this layer, read on the device).

SPARSE: each (sequence, KV head) reads only the pages its row of SEL lists (COUNT of them, from
kernels/page_select.py): key j of the listed pages' concatenation is key (SEL[j // PAGE] * PAGE +
j % PAGE) of the sequence, TILES_PER_SPLIT tiles of them a program, so that the programs of a
(sequence, KV head) are as many as its listed pages need (splits past COUNT's keys write an empty
split). Sharing each head's listed keys evenly among a fixed number of splits instead made the heads
that keep the most pages the long tail of the launch (benchmarks/NOTES.md, sparse decode).

Pool layout per layer: (num_pages, PAGE, Hkv, D), token-major pages (adaattn.kv.cache).
"""

import triton
import triton.language as tl

from .attention_fwd import dot, masked_softmax_step, round_to, soft_cap

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def as_operand(x, dtype: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Page values (the model dtype, FP8 or INT8) as a tensor-core operand of `dtype`: exact for
    every storage. The interpreter's integer -> bf16 conversion is wrong (triton 3.6/3.9), and its
    dot upcasts bf16 to fp32 anyway (attention_fwd.dot), so there the values go to fp32."""
    if DOT_PRECISION == "interpreter_bf16":
        return x.to(tl.float32)
    else:
        return x.to(dtype)


@triton.jit
def load_int4(row_ptrs, scale_ptrs, live, stride_d, WIDTH: tl.constexpr, GROUP: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """(BLOCK_N, BLOCK_W) fp32 values of INT4 rows (kv/cache._int4_decode): WIDTH / 2 bytes at
    row_ptrs (channel 2i in byte i's low nibble, 2i + 1 in its high one) and, per GROUP channels,
    a bfloat16 (scale, minimum) pair at scale_ptrs; value = code x scale + minimum (the product is
    exact, so fused or not it is one rounding, as the cache's own). Rows not live and columns past
    WIDTH give 0. A token's pairs sit together, group after group (strides 2 and 1: kv/cache.py
    makes the pools so, and tests/test_kv_int4.py checks it): all of them come in one vector load,
    split after, so the pools' group stride is no argument. Two scalar loads a group took 1.5x (D64) to 1.8x (D128) the kernel's time at
    groups of 16 (H200, benchmarks/NOTES.md, session 41)."""
    half = tl.arange(0, BLOCK_W // 2)
    b = tl.load(row_ptrs + half[None, :] * stride_d, mask=live[:, None] & (half[None, :] < WIDTH // 2), other=0)
    b = b.to(tl.int32)
    codes = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_N, BLOCK_W)).to(tl.float32)
    NG: tl.constexpr = BLOCK_W // GROUP
    j = tl.arange(0, 2 * NG)
    pairs = tl.load(scale_ptrs + j[None, :], mask=live[:, None] & (j[None, :] < 2 * (WIDTH // GROUP)), other=0.0)
    scale, low = tl.split(tl.reshape(pairs.to(tl.float32), (BLOCK_N, NG, 2)))
    x = tl.reshape(codes, (BLOCK_N, NG, GROUP)) * scale[:, :, None] + low[:, :, None]
    return tl.reshape(x, (BLOCK_N, BLOCK_W))


@triton.jit
def int4_tile(K, V, KS, VS, KW, VW, centre, page, slot, keys, live, length, seq, hk,
              stride_kp, stride_kn, stride_kh, stride_kd, stride_vp, stride_vn, stride_vh, stride_vd,
              stride_ksp, stride_ksn, stride_ksh, stride_vsp, stride_vsn, stride_vsh,
              stride_ws, stride_wn, stride_wh, stride_wd, stride_xs, stride_xn, stride_xh, stride_xd,
              D: tl.constexpr, DV: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, WINDOW: tl.constexpr):
    """One tile's keys and values (fp32) of head `hk` of INT4 pools; with WINDOW, the sequence's
    newest WINDOW keys (length - WINDOW on) from the rings KW, VW instead (keys less `centre`)."""
    dq = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    paged = live
    if WINDOW > 0:
        newest = live & (keys >= length - WINDOW)
        paged = live & (keys < length - WINDOW)
    k = load_int4(K + page[:, None] * stride_kp + slot[:, None] * stride_kn + hk * stride_kh,
                  KS + page[:, None] * stride_ksp + slot[:, None] * stride_ksn + hk * stride_ksh, paged,
                  stride_kd, D, GK, BLOCK_N, BLOCK_D)
    v = load_int4(V + page[:, None] * stride_vp + slot[:, None] * stride_vn + hk * stride_vh,
                  VS + page[:, None] * stride_vsp + slot[:, None] * stride_vsn + hk * stride_vsh, paged,
                  stride_vd, DV, GV, BLOCK_N, BLOCK_DV)
    # (the two loads' rows are disjoint: the other gives zeros). Only tiles that reach the newest
    # WINDOW keys read the ring: masked loads in every tile took 1.9x (D64) the kernel's time (H200,
    # benchmarks/NOTES.md, session 41).
    if WINDOW > 0:
        if tl.max(newest.to(tl.int32), 0) > 0:
            ring = keys % WINDOW
            kw = tl.load(KW + seq.to(tl.int64) * stride_ws + ring[:, None] * stride_wn + hk * stride_wh
                         + dq[None, :] * stride_wd, mask=newest[:, None] & (dq[None, :] < D), other=0.0)
            k = k + tl.where(newest[:, None], kw.to(tl.float32) - centre[None, :], 0.0)
            v = v + tl.load(VW + seq.to(tl.int64) * stride_xs + ring[:, None] * stride_xn + hk * stride_xh
                            + dv[None, :] * stride_xd, mask=newest[:, None] & (dv[None, :] < DV),
                            other=0.0).to(tl.float32)
    return k, v


@triton.jit
def decode_split_kernel(
    Q, K, V, KS, VS, TABLE, LENS, SEQS, O_PART, L_PART, SEL, COUNT,
    sm_scale,
    stride_qs, stride_qh, stride_qt, stride_qd,
    stride_kp, stride_kn, stride_kh, stride_kd,
    stride_vp, stride_vn, stride_vh, stride_vd,
    stride_sp, stride_sh,
    stride_ts, stride_tp,
    stride_os, stride_oh, stride_ot, stride_osp, stride_od,
    stride_ls, stride_lh, stride_lt, stride_lsp,
    stride_sel,
    HKV, TILES_PER_SPLIT,
    G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr, QUANTIZED: tl.constexpr, DOT_PRECISION: tl.constexpr, CONTIG: tl.constexpr = False,
    SPARSE: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0, SLOPES=None, stride_slb=0,
    HAS_ALIBI: tl.constexpr = False, QOFF=None, HAS_QOFF: tl.constexpr = False, INT4: tl.constexpr = False,
    stride_ksp=0, stride_ksn=0, stride_ksh=0,  # INT4's (page, slot, head) scales (groups: load_int4)
    stride_vsp=0, stride_vsn=0, stride_vsh=0,
    GK: tl.constexpr = 1, GV: tl.constexpr = 1,
    KW=None, VW=None, KC=None, stride_ws=0, stride_wn=0, stride_wh=0, stride_wd=0,  # INT4's window rings
    stride_xs=0, stride_xn=0, stride_xh=0, stride_xd=0, stride_cs=0, stride_ch=0, WINDOW: tl.constexpr = 0,
    MIXED: tl.constexpr = False, HS=None, HI=None,  # per-head storages: each head's code and index in its pool
    KN=None, VN=None, HN=1, K8=None, V8=None, KS8=None, VS8=None, H8=1,  # the model-dtype and INT8 heads' pools
):
    """Program (split, sequence x KV head): tiles [split * TILES_PER_SPLIT, ...) of BLOCK_N keys
    of its sequence (a tile may span pages, or a page several tiles: each key's page comes from
    the block table). A split past the sequence's end writes lse = -inf and zeros. Quantized
    pages: the raw FP8/INT8 values convert exactly to fp16 and go to the tensor cores as they are
    (fp16, not bf16: the conversion to bf16 costs a detour through fp32, measured 1.13x slower at
    32k in benchmarks/NOTES.md); the query is scaled by a power of two into fp16's range; the
    (page, KV head) scales multiply the scores, and P over the tile's largest V scale.
    CONTIG: the sequence's pages follow each other in the pool from its first (a contiguous
    KVCache), so a key's page is computed, not read: no dependent load in the loop.
    INT4 (not QUANTIZED): pages hold two codes a byte with a bfloat16 scale and minimum per token
    and GK (keys) or GV (values) channels in KS and VS (kv/cache.py); a tile's bytes and scales are
    loaded and dequantized in registers, then go to the tensor cores in the query's dtype as a
    model-dtype page would. WINDOW > 0: each sequence's newest WINDOW keys and values come from
    the rings KW and VW (S, WINDOW, Hkv, D) in the model dtype instead (token j in slot j % WINDOW),
    keys less their centre KC (S, Hkv, D) fp32, as the pages hold them.
    MIXED: the KV heads hold different storages (kv/mixed.py): head h's code HS[h] (0 the model
    dtype, 2 INT8, 3 INT4) picks the pool its program reads, at index HI[h] there: K, V, KS, VS
    (and the window rings) as for INT4; KN, VN the model-dtype heads' pools (num_pages, PAGE, HN, D)
    and K8, V8 the INT8 heads' (num_pages, PAGE, H8, D) with (num_pages, H8) fp32 scales KS8, VS8,
    all contiguous. Every storage is dequantized to fp32, then goes to the tensor cores in the
    query's dtype (the branch is uniform over a program).
    Score modifiers (problem.Modifiers): SOFTCAP > 0 caps the scaled scores at that value (the cap
    times log2(e)) before the causal mask; HAS_ALIBI subtracts slope * (position - key), SLOPES
    float32 (Hq,) (stride_slb 0) or one row of Hq per query sequence. HAS_QOFF: QOFF (S, Hq, T)
    float32, contiguous, is added to each row's scaled scores first: the q.c a quantized cache's
    centred keys leave out (cache.k_center), which the soft cap and the sinks see."""
    pid_sh = tl.program_id(1)
    split = tl.program_id(0)
    s = pid_sh // HKV
    h = pid_sh % HKV
    seq = tl.load(SEQS + s)
    length = tl.load(LENS + seq)

    rows = tl.arange(0, BLOCK_M)
    g = rows // T
    t = rows % T
    row_ok = rows < G * T
    dq = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + s * stride_qs + (h * G + g)[:, None] * stride_qh + t[:, None] * stride_qt + dq[None, :] * stride_qd
    q = tl.load(q_ptr, mask=row_ok[:, None] & (dq[None, :] < D), other=0.0)
    pos = length - T + t  # each row's position: it sees keys <= pos
    if HAS_QOFF:
        qoff2 = tl.load(QOFF + (s * (HKV * G) + h * G + g) * T + t, mask=row_ok, other=0.0) * LOG2E
    if HAS_ALIBI:  # each row's slope, times log2(e): the scores are in the log2 domain
        slope2 = tl.load(SLOPES + s * stride_slb + h * G + g, mask=row_ok, other=0.0) * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    qk_scale = sm_scale * LOG2E
    if SPARSE:  # the listed pages' keys, TILES_PER_SPLIT tiles a program: a head listing more pages gets more
        listed = tl.load(COUNT + pid_sh) * PAGE
        n_tiles = tl.cdiv(listed, BLOCK_N)
        first = split * TILES_PER_SPLIT
        last = tl.minimum(first + TILES_PER_SPLIT, n_tiles)
        sel = SEL + pid_sh * stride_sel
    else:
        n_tiles = tl.cdiv(length, BLOCK_N)
        first = split * TILES_PER_SPLIT
        last = tl.minimum(first + TILES_PER_SPLIT, n_tiles)
    cols = tl.arange(0, BLOCK_N)
    hk = h  # the head's index in the pool it reads
    if MIXED:
        code = tl.load(HS + h)
        hk = tl.load(HI + h)
    centre = tl.zeros([BLOCK_D], tl.float32)
    if WINDOW > 0:  # (MIXED: only an INT4 head has a centre in KC, the INT4 part's)
        ok = dq < D
        if MIXED:
            ok = ok & ((dq * 0 + code) == 3)
        centre = tl.load(KC + seq.to(tl.int64) * stride_cs + hk * stride_ch + dq, mask=ok, other=0.0)
    table = TABLE + seq * stride_ts
    base = tl.load(table).to(tl.int64)
    if QUANTIZED:  # fp16 operands (FP8/INT8 convert to fp16 natively; to bf16 through fp32): q scaled into range
        qf = q.to(tl.float32)
        qmax = tl.max(tl.max(tl.abs(qf), 1), 0)
        e = tl.maximum(tl.ceil(tl.log2(tl.maximum(qmax, 1e-30))) - 14.0, 0.0)
        q = as_operand(qf * tl.exp2(-e), tl.float16, DOT_PRECISION)
        qk_scale = qk_scale * tl.exp2(e)
    for i in range(first, last):
        if SPARSE:
            at = i * BLOCK_N + cols
            index = tl.load(sel + at // PAGE, mask=at < listed, other=0)
            keys = index * PAGE + at % PAGE
            live = (at < listed) & (keys < length)
        else:
            keys = i * BLOCK_N + cols
            live = keys < length
        if CONTIG:
            page = base + keys // PAGE
        else:
            page = tl.load(table + (keys // PAGE) * stride_tp, mask=live, other=0).to(tl.int64)
        slot = keys % PAGE
        if MIXED:
            if code == 3:
                k, v = int4_tile(K, V, KS, VS, KW, VW, centre, page, slot, keys, live, length, seq, hk,
                                 stride_kp, stride_kn, stride_kh, stride_kd, stride_vp, stride_vn, stride_vh, stride_vd,
                                 stride_ksp, stride_ksn, stride_ksh, stride_vsp, stride_vsn, stride_vsh,
                                 stride_ws, stride_wn, stride_wh, stride_wd, stride_xs, stride_xn,
                                 stride_xh, stride_xd, D, DV, GK, GV, BLOCK_N, BLOCK_D, BLOCK_DV, WINDOW)
            elif code == 2:
                at = page[:, None] * (PAGE * H8) + slot[:, None] * H8 + hk
                k = tl.load(K8 + at * D + dq[None, :], mask=live[:, None] & (dq[None, :] < D), other=0.0)
                k = k.to(tl.float32) * tl.load(KS8 + page * H8 + hk, mask=live, other=0.0)[:, None]
                v = tl.load(V8 + at * DV + dv[None, :], mask=live[:, None] & (dv[None, :] < DV), other=0.0)
                v = v.to(tl.float32) * tl.load(VS8 + page * H8 + hk, mask=live, other=0.0)[:, None]
            else:
                at = page[:, None] * (PAGE * HN) + slot[:, None] * HN + hk
                k = tl.load(KN + at * D + dq[None, :], mask=live[:, None] & (dq[None, :] < D),
                            other=0.0).to(tl.float32)
                v = tl.load(VN + at * DV + dv[None, :], mask=live[:, None] & (dv[None, :] < DV),
                            other=0.0).to(tl.float32)
        elif INT4:
            k, v = int4_tile(K, V, KS, VS, KW, VW, centre, page, slot, keys, live, length, seq, hk,
                             stride_kp, stride_kn, stride_kh, stride_kd, stride_vp, stride_vn, stride_vh, stride_vd,
                             stride_ksp, stride_ksn, stride_ksh, stride_vsp, stride_vsn, stride_vsh,
                             stride_ws, stride_wn, stride_wh, stride_wd, stride_xs, stride_xn,
                             stride_xh, stride_xd, D, DV, GK, GV, BLOCK_N, BLOCK_D, BLOCK_DV, WINDOW)
        else:
            k = tl.load(K + page[:, None] * stride_kp + slot[:, None] * stride_kn + h * stride_kh
                        + dq[None, :] * stride_kd, mask=live[:, None] & (dq[None, :] < D), other=0.0)
            v = tl.load(V + page[:, None] * stride_vp + slot[:, None] * stride_vn + h * stride_vh
                        + dv[None, :] * stride_vd, mask=live[:, None] & (dv[None, :] < DV), other=0.0)
        kt = tl.trans(as_operand(k, q.dtype, DOT_PRECISION))
        v = as_operand(v, q.dtype, DOT_PRECISION)
        qk = dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_PRECISION)
        if QUANTIZED:
            qk = qk * (tl.load(KS + page * stride_sp + h * stride_sh, mask=live, other=0.0) * qk_scale)[None, :]
        else:
            qk = qk * qk_scale
        if HAS_QOFF:
            qk = qk + qoff2[:, None]
        if SOFTCAP > 0:
            qk, _ = soft_cap(qk, SOFTCAP, DOT_PRECISION)
        if HAS_ALIBI:
            qk = qk - slope2[:, None] * (pos[:, None] - keys[None, :]).to(tl.float32)
        visible = (keys[None, :] <= pos[:, None]) & live[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        pexp, alpha, m_new = masked_softmax_step(qk, m_i)
        l_i = l_i * alpha + tl.sum(pexp, 1)
        if QUANTIZED:  # P times each key's V scale over the tile's largest (<= 1: no fp16 overflow), rounded to fp16
            vsc = tl.load(VS + page * stride_sp + h * stride_sh, mask=live, other=0.0)
            vmax = tl.max(vsc, 0)
            pv = pexp * (vsc / tl.where(vmax > 0, vmax, 1.0))[None, :]
            pv = dot(round_to(pv, tl.float16, "tf32"), v, tl.zeros([BLOCK_M, BLOCK_DV], tl.float32), DOT_PRECISION)
            acc = acc * alpha[:, None] + pv * vmax
        else:
            # P rounded to the query's dtype (to nearest, as the tensor cores take it; SDPA's kernels
            # do the same) against V's values, exact in that dtype.
            acc = dot(round_to(pexp, q.dtype, DOT_PRECISION), v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    o_ptr = (O_PART + s * stride_os + (h * G + g)[:, None] * stride_oh + t[:, None] * stride_ot + split * stride_osp
             + dv[None, :] * stride_od)
    tl.store(o_ptr, out, mask=row_ok[:, None] & (dv[None, :] < DV))
    l_ptr = L_PART + s * stride_ls + (h * G + g) * stride_lh + t * stride_lt + split * stride_lsp
    tl.store(l_ptr, lse, mask=row_ok)


@triton.jit
def decode_merge_kernel(
    O_PART, L_PART, OUT,
    stride_os, stride_oh, stride_ot, stride_osp, stride_od,
    stride_ls, stride_lh, stride_lt, stride_lsp,
    stride_s, stride_h, stride_t, stride_d,
    HQ, T, SPLITS,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SINKS=None, HAS_SINKS: tl.constexpr = False,
):
    """One program per (sequence, query head, row): the splits' outputs weighted by
    exp(lse_split - lse_total); a row that saw no key gives zeros. HAS_SINKS: SINKS (Hq,) float32
    logits join each row's denominator as a key with a zero value (problem.Modifiers sinks)."""
    pid = tl.program_id(0)
    s = pid // (HQ * T)
    h = (pid // T) % HQ
    t = pid % T
    sp = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    lse = tl.load(L_PART + s * stride_ls + h * stride_lh + t * stride_lt + sp * stride_lsp, mask=sp < SPLITS,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + h)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp(sink - m_safe)
    o = tl.load(O_PART + s * stride_os + h * stride_oh + t * stride_ot + sp[:, None] * stride_osp
                + dv[None, :] * stride_od, mask=(sp[:, None] < SPLITS) & (dv[None, :] < DV), other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + s * stride_s + h * stride_h + t * stride_t + dv * stride_d,
             round_to(out, OUT.dtype.element_ty, DOT_PRECISION), mask=dv < DV)
