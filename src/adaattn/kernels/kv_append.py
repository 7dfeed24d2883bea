"""Append keys and values to a paged KV cache in one launch per layer, positions read on the device.

Program (sequence x KV head, chunk): chunk c covers the c-th page the new tokens touch, from the
sequence's length in this layer (read from LENS on the device) onwards. It writes the new rows of
that page for both K and V, in the model dtype or quantized: FP8 E4M3 / INT8 with the page's
scale for this KV head, amax / QMAX over every token the page holds (when the new rows raise the
scale, the rows already there are requantized to it first, never clipped); INT4 per token, with a
bfloat16 scale and minimum per group of channels (kv/cache.py), written once.

The sequence's length advances by T once every program of that sequence has read it: each
program counts itself in COUNT[seq] (an atomic add, acquire-release), and the last one writes
LENS[seq] += T and zeroes the counter. So a CUDA graph can replay the append as sequences grow.

Divisions round to nearest (div_rn), as torch's do: the values written are the torch append's,
bit for bit.

Quantized keys are stored less their sequence's center KC[seq, h] (fp32, set by the cache at the
sequence's first append): attention over them is unchanged, their residuals quantize finer.

SUMMARIES: each program also keeps its page's key summaries for sparse decode (kv/cache.py): the
sum, per-channel min and max of the keys as stored (dequantized), updated from the new rows, or
recomputed over the whole page where its scale grew (every stored key changed).

Pool layout per layer: (num_pages, PAGE, Hkv, D); scales (num_pages, Hkv) fp32; centers
(max_seqs, Hkv, D) fp32; summaries (num_pages, Hkv, D) fp32.
"""

import triton
import triton.language as tl

NATIVE: tl.constexpr = tl.constexpr(0)
FP8: tl.constexpr = tl.constexpr(1)
INT8: tl.constexpr = tl.constexpr(2)
INT4: tl.constexpr = tl.constexpr(3)  # two codes a byte, scales per token and group: kv/cache._int4_encode


@triton.jit
def _round_half_even(y):
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _e4m3_grid(y):
    """y rounded to nearest even on the E4M3 grid (3 mantissa bits, subnormals below 2^-6), in fp32.
    For the interpreter, whose fp32 -> fp8 cast drops the carry of a mantissa that rounds up into
    the next binade (127.0 -> 64.0, triton 3.6/3.9); the GPU's cast rounds correctly."""
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(y), 1e-30))), -6.0)
    ulp = tl.exp2(e - 3.0)
    return _round_half_even(y / ulp) * ulp


@triton.jit
def _bf16_toward(x, UP: tl.constexpr):
    """fp32 x rounded to a bfloat16 value toward +inf (UP) or -inf, as fp32 (kv/cache._bf16_toward)."""
    bits = x.to(tl.int32, bitcast=True)
    if UP:
        grow = bits >= 0
    else:
        grow = bits < 0
    bits = tl.where(grow, (bits + 0xFFFF) & -65536, bits & -65536)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _write_int4(X, stride_xt, stride_xd, P, S, page, h, stride_pp, stride_pn, stride_ph, stride_pd,
                stride_sp, stride_sn, stride_sh, stride_sg, slots, tok, new, old_rows, cols, DIM: tl.constexpr,
                GROUP: tl.constexpr, C=None, stride_cd=0, CENTER: tl.constexpr = False, SUMS=None, MINS=None,
                MAXS=None, stride_bp=0, stride_bh=0, SUMMARIES: tl.constexpr = False, BLOCK_R: tl.constexpr = 1,
                BLOCK_C: tl.constexpr = 1, RING=None, ring_off=0, stride_rn=0, stride_rd=0, ring_rows=None,
                ring_slots=None, WINDOW: tl.constexpr = 0):
    """The new rows of one page and KV head as INT4 (kv/cache._int4_encode, the same operations in
    the same order): per row and GROUP channels, the minimum rounded down and (max - min) / 15
    rounded up to bfloat16, codes round((x - min) / scale) in [0, 15], two a byte, and (scale,
    minimum) at S[page, slot, h, group]. SUMMARIES: the page's key sum and per-channel min/max kept
    exact from the dequantized rows (code x scale is exact in fp32: fused or not, one rounding).
    WINDOW: the rows `ring_rows` also go to RING[ring_off + ring_slots] in RING's dtype (the
    model's), as they come."""
    NG: tl.constexpr = BLOCK_C // GROUP
    dmask = cols[None, :] < DIM
    live = new[:, None] & dmask
    x = tl.load(X + tok[:, None] * stride_xt + cols[None, :] * stride_xd, mask=live, other=0.0).to(tl.float32)
    if WINDOW > 0:
        tl.store(RING + ring_off + ring_slots[:, None] * stride_rn + cols[None, :] * stride_rd, x.to(RING.dtype.element_ty),
                 mask=ring_rows[:, None] & dmask)
    if CENTER:
        x = x - tl.load(C + cols * stride_cd, mask=cols < DIM, other=0.0)[None, :]
    y = tl.reshape(x, (BLOCK_R, NG, GROUP))
    y_ok = tl.reshape(live, (BLOCK_R, NG, GROUP))
    low = _bf16_toward(tl.min(tl.where(y_ok, y, float("inf")), 2), False)
    high = tl.max(tl.where(y_ok, y, float("-inf")), 2)
    low = tl.where(low == float("inf"), 0.0, low)  # (groups past DIM or rows not new: not stored)
    high = tl.where(high == float("-inf"), 0.0, high)
    scale = _bf16_toward(tl.div_rn(high - low, 15.0), True)
    safe = tl.where(scale > 0, scale, 1.0)
    codes = _round_half_even(tl.div_rn(y - low[:, :, None], safe[:, :, None]))
    codes = tl.minimum(tl.maximum(codes, 0.0), 15.0)
    n = tl.reshape(codes, (BLOCK_R, BLOCK_C)).to(tl.int32)
    even, odd = tl.split(tl.reshape(n, (BLOCK_R, BLOCK_C // 2, 2)))
    bcols = tl.arange(0, BLOCK_C // 2)
    dst = P + page * stride_pp + slots[:, None] * stride_pn + h * stride_ph + bcols[None, :] * stride_pd
    tl.store(dst, (even | (odd << 4)).to(tl.uint8), mask=new[:, None] & (bcols[None, :] < DIM // 2))
    grp = tl.arange(0, NG)
    s_ptr = S + page * stride_sp + slots[:, None] * stride_sn + h * stride_sh + grp[None, :] * stride_sg
    s_ok = new[:, None] & (grp[None, :] < DIM // GROUP)
    tl.store(s_ptr, scale.to(tl.bfloat16), mask=s_ok)
    tl.store(s_ptr + 1, low.to(tl.bfloat16), mask=s_ok)
    if SUMMARIES:
        b_off = page * stride_bp + h * stride_bh + cols
        stored = tl.reshape(codes * scale[:, :, None] + low[:, :, None], (BLOCK_R, BLOCK_C))
        b_ok = (cols < DIM) & (cols * 0 + tl.sum(old_rows.to(tl.int32), 0) > 0)  # none from a fresh page
        o_sum = tl.load(SUMS + b_off, mask=b_ok, other=0.0)
        o_min = tl.load(MINS + b_off, mask=b_ok, other=float("inf"))
        o_max = tl.load(MAXS + b_off, mask=b_ok, other=float("-inf"))
        tl.store(SUMS + b_off, o_sum + tl.sum(tl.where(live, stored, 0.0), 0), mask=cols < DIM)
        tl.store(MINS + b_off, tl.minimum(o_min, tl.min(tl.where(live, stored, float("inf")), 0)), mask=cols < DIM)
        tl.store(MAXS + b_off, tl.maximum(o_max, tl.max(tl.where(live, stored, float("-inf")), 0)), mask=cols < DIM)


@triton.jit
def _encode(y, STORAGE: tl.constexpr, QMAX: tl.constexpr, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """y (fp32, already divided by the scale) in the pool's dtype (FP8 or INT8)."""
    if STORAGE == INT8:
        return tl.minimum(tl.maximum(_round_half_even(y), -QMAX), QMAX).to(dtype)
    else:
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if INTERPRET:
            y = _e4m3_grid(y)
        return y.to(dtype)


@triton.jit
def _write_page(X, stride_xt, stride_xd, P, S, page, h, stride_pp, stride_pn, stride_ph, stride_pd,
                stride_sp, stride_sh, slots, tok, new, old_rows, cols, DIM: tl.constexpr,
                STORAGE: tl.constexpr, QMAX: tl.constexpr, INTERPRET: tl.constexpr, C=None, stride_cd=0,
                CENTER: tl.constexpr = False, SUMS=None, MINS=None, MAXS=None, stride_bp=0, stride_bh=0,
                SUMMARIES: tl.constexpr = False, BLOCK_R: tl.constexpr = 1, BLOCK_C: tl.constexpr = 1):
    """The new rows (slots where `new`, token index `tok` of X) of one page and KV head, less the
    center C (CENTER); the rows already there (`old_rows`) requantized when the page's scale grows.
    SUMMARIES: the page's key sum and per-channel min/max (SUMS, MINS, MAXS) kept exact."""
    dmask = cols[None, :] < DIM
    x = tl.load(X + tok[:, None] * stride_xt + cols[None, :] * stride_xd, mask=new[:, None] & dmask,
                other=0.0).to(tl.float32)
    if CENTER:
        x = tl.where(new[:, None] & dmask, x - tl.load(C + cols * stride_cd, mask=cols < DIM, other=0.0)[None, :], 0.0)
    dst = P + page * stride_pp + slots[:, None] * stride_pn + h * stride_ph + cols[None, :] * stride_pd
    if SUMMARIES:  # the page's summaries so far: from the rows already there, none for a fresh page
        b_off = page * stride_bp + h * stride_bh + cols
        b_ok = (cols < DIM) & (cols * 0 + tl.sum(old_rows.to(tl.int32), 0) > 0)
        o_sum = tl.load(SUMS + b_off, mask=b_ok, other=0.0)
        o_min = tl.load(MINS + b_off, mask=b_ok, other=float("inf"))
        o_max = tl.load(MAXS + b_off, mask=b_ok, other=float("-inf"))
    if STORAGE == NATIVE:
        stored = x.to(P.dtype.element_ty)
        tl.store(dst, stored, mask=new[:, None] & dmask)
        stored = stored.to(tl.float32)
    else:
        s_ptr = S + page * stride_sp + h * stride_sh
        old = tl.load(s_ptr)
        scale = tl.maximum(old, tl.div_rn(tl.max(tl.max(tl.abs(x), 1), 0), QMAX))
        if (scale > old) & (old > 0):
            keep = old_rows[:, None] & dmask
            y = tl.load(dst, mask=keep).to(tl.float32) * tl.div_rn(old, scale)  # masked lanes are never stored
            y = _encode(y, STORAGE, QMAX, P.dtype.element_ty, INTERPRET)
            tl.store(dst, y, mask=keep)
            if SUMMARIES:  # every stored key changed: the summaries start again from the requantized rows
                y = y.to(tl.float32) * scale
                o_sum = tl.sum(tl.where(keep, y, 0.0), 0)
                o_min = tl.min(tl.where(keep, y, float("inf")), 0)
                o_max = tl.max(tl.where(keep, y, float("-inf")), 0)
        safe = tl.where(scale > 0, scale, 1.0)
        stored = _encode(tl.div_rn(x, safe), STORAGE, QMAX, P.dtype.element_ty, INTERPRET)
        tl.store(dst, stored, mask=new[:, None] & dmask)
        tl.store(s_ptr, scale)
        stored = stored.to(tl.float32) * safe
    if SUMMARIES:
        live = new[:, None] & dmask
        tl.store(SUMS + b_off, o_sum + tl.sum(tl.where(live, stored, 0.0), 0), mask=cols < DIM)
        tl.store(MINS + b_off, tl.minimum(o_min, tl.min(tl.where(live, stored, float("inf")), 0)), mask=cols < DIM)
        tl.store(MAXS + b_off, tl.maximum(o_max, tl.max(tl.where(live, stored, float("-inf")), 0)), mask=cols < DIM)


@triton.jit
def append_kernel(
    KEY, VALUE, K, V, KS, VS, KC, TABLE, LENS, SEQS, COUNT, SUMS, MINS, MAXS,
    stride_ks, stride_kh, stride_kt, stride_kd,
    stride_vs, stride_vh, stride_vt, stride_vd,
    stride_kp, stride_kn, stride_kph, stride_kpd,
    stride_vp, stride_vn, stride_vph, stride_vpd,
    stride_sp, stride_sh,
    stride_cs, stride_ch, stride_cd,
    stride_ts, stride_tp,
    stride_bp, stride_bh,  # summaries: unit stride along D
    T, HKV, CHUNKS, MAX_PAGES,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_P: tl.constexpr, STORAGE: tl.constexpr, QMAX: tl.constexpr,
    INTERPRET: tl.constexpr = False, SUMMARIES: tl.constexpr = False,
    stride_ksp=0, stride_ksn=0, stride_ksh=0, stride_ksg=0,  # INT4's (page, slot, head, group) scales
    stride_vsp=0, stride_vsn=0, stride_vsh=0, stride_vsg=0,
    GK: tl.constexpr = 1, GV: tl.constexpr = 1,
    KW=None, VW=None, stride_ws=0, stride_wn=0, stride_wh=0, stride_wd=0,  # INT4's window rings (S, W, Hkv, D)
    stride_xs=0, stride_xn=0, stride_xh=0, stride_xd=0,  # (the value ring's)
    WINDOW: tl.constexpr = 0,
):
    pid_sh = tl.program_id(0)
    c = tl.program_id(1)
    s = pid_sh // HKV
    h = pid_sh % HKV
    seq = tl.load(SEQS + s)
    start = tl.load(LENS + seq)
    index = start // PAGE + c  # the page (within the sequence) this program writes
    first = index * PAGE
    lo = tl.maximum(first, start)
    hi = tl.minimum(first + PAGE, start + T)
    if (lo < hi) & (index < MAX_PAGES):  # (past the block table's width nothing is written: no page is the sequence's)
        page = tl.load(TABLE + seq * stride_ts + index * stride_tp).to(tl.int64)
        slots = tl.arange(0, BLOCK_P)
        pos = first + slots
        new = (pos >= lo) & (pos < hi)
        old_rows = pos < start
        tok = pos - start
        ring_rows = new & (pos >= start + T - WINDOW)  # the last WINDOW new tokens go to the ring too
        ring_slots = pos % tl.maximum(WINDOW, 1)
        if STORAGE == INT4:
            _write_int4(KEY + s * stride_ks + h * stride_kh, stride_kt, stride_kd, K, KS, page, h,
                        stride_kp, stride_kn, stride_kph, stride_kpd, stride_ksp, stride_ksn, stride_ksh, stride_ksg,
                        slots, tok, new, old_rows, tl.arange(0, BLOCK_D), D, GK, KC + seq * stride_cs + h * stride_ch,
                        stride_cd, True, SUMS, MINS, MAXS, stride_bp, stride_bh, SUMMARIES, BLOCK_P, BLOCK_D,
                        KW, seq.to(tl.int64) * stride_ws + h * stride_wh, stride_wn, stride_wd, ring_rows, ring_slots, WINDOW)
            _write_int4(VALUE + s * stride_vs + h * stride_vh, stride_vt, stride_vd, V, VS, page, h,
                        stride_vp, stride_vn, stride_vph, stride_vpd, stride_vsp, stride_vsn, stride_vsh, stride_vsg,
                        slots, tok, new, old_rows, tl.arange(0, BLOCK_DV), DV, GV, BLOCK_R=BLOCK_P, BLOCK_C=BLOCK_DV,
                        RING=VW, ring_off=seq.to(tl.int64) * stride_xs + h * stride_xh, stride_rn=stride_xn, stride_rd=stride_xd,
                        ring_rows=ring_rows, ring_slots=ring_slots, WINDOW=WINDOW)
        else:
            _write_page(KEY + s * stride_ks + h * stride_kh, stride_kt, stride_kd, K, KS, page, h,
                        stride_kp, stride_kn, stride_kph, stride_kpd, stride_sp, stride_sh, slots, tok, new, old_rows,
                        tl.arange(0, BLOCK_D), D, STORAGE, QMAX, INTERPRET, KC + seq * stride_cs + h * stride_ch,
                        stride_cd, STORAGE != NATIVE, SUMS, MINS, MAXS, stride_bp, stride_bh, SUMMARIES, BLOCK_P, BLOCK_D)
            _write_page(VALUE + s * stride_vs + h * stride_vh, stride_vt, stride_vd, V, VS, page, h,
                        stride_vp, stride_vn, stride_vph, stride_vpd, stride_sp, stride_sh, slots, tok, new, old_rows,
                        tl.arange(0, BLOCK_DV), DV, STORAGE, QMAX, INTERPRET, BLOCK_R=BLOCK_P, BLOCK_C=BLOCK_DV)
    done = tl.atomic_add(COUNT + seq, 1)  # every program of this sequence has read LENS[seq] before it counts
    if done == HKV * CHUNKS - 1:
        tl.store(LENS + seq, start + T)
        tl.store(COUNT + seq, 0)
