"""Quantized attention forward: Q.K^T in INT8 or FP8, P.V in the input dtype or FP8.

The schemes (the float64 simulation in adaptive/quant_reference.py does the same math):

- K is smoothed: its mean over the sequence (per batch, kv head and channel, estimated from
  strided rows) is subtracted before quantization. Every score of a query row shifts by the
  same q.mean, and softmax is invariant to that, so the result is unchanged in exact
  arithmetic.
- K is quantized per block of BLOCK_N keys (one scale per block, amax / QMAX) by a pre-pass
  (`quantize_kv_kernel`, one launch) that reads K (and V) from memory once; Q is quantized per
  row inside the attention kernel (one scale per query row, amax / QMAX) right after its one
  load (the warp-specialised kernels take it quantized by the pre-pass launch).
  INT8 rounds with floor(x + 0.5) and clamps to [-127, 127]; FP8 is E4M3 (max 448),
  round to nearest even.
- Scores: s = dot(q_q, k_q) * q_scale[row] * k_scale[block] * softmax_scale * log2(e), in
  fp32, then the usual online softmax in fp32.
- P.V in FP8: V is smoothed (its sampled mean over the sequence subtracted, added back at the
  end, since the softmax weights sum to one) and given one scale per block of BLOCK_N keys
  (amax over the block's keys and channels / 448: E4M3 keeps its relative precision over a
  range of 2^15, so one scale per block loses little to per-channel scales, and needs no pass
  over all of V before quantizing); P (in [0, 1] after the running max) is scaled by 448 and
  rounded to E4M3. Each tile's product is multiplied by its V scale as it is added to the fp32
  accumulator (one FMA with the add). The row sum l uses the fp32 (scaled) P.
  out = acc / l + v_mean. The FP8 V is stored transposed (B, Hkv, D, N) so both tensor-core
  operands are K-major, as Hopper's FP8 MMA needs.
- P.V in the input dtype: P rounded to it, as the exact kernel does.

One kernel serves the three operating points (exact, qk8, fp8) through QK_MODE/PV_MODE; an
optional per-head level array lets one launch run only the heads assigned its level, so a
call with heads at different precisions is a few launches with no host synchronisation.
"""

import triton
import triton.language as tl

from .attention_fwd import apply_masks, dense_program, dot, exp2_tile, key_tile_range, load_rows, round_to, store_rows

QK_NATIVE = 0
QK_INT8 = 1
QK_FP8 = 2
PV_NATIVE = 0
PV_FP8 = 1

INT8_MAX = 127.0
FP8_MAX = 448.0
TINY_SCALE = 1e-30
V_SCALE_FLOOR: tl.constexpr = tl.constexpr(2.0 ** -40)  # quant_reference.V_SCALE_FLOOR


@triton.jit
def to_fp8(x, EMULATE: tl.constexpr):
    """fp32 -> float8 e4m3 (finite values within +-448), round to nearest even.

    EMULATE is for the CPU interpreter, whose conversion drops the carry when rounding
    overflows the mantissa (triton 3.9: 1.95 -> 1.0): there x is first rounded to a value
    e4m3 holds exactly (3 mantissa bits in fp32 bits; multiples of 2^-9 below 2^-6), and
    exact values convert correctly."""
    if EMULATE:
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        sub = tl.floor(x * 512.0 + 0.5) / 512.0
        x = tl.where(tl.abs(x) < 0.015625, sub, normal)
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    return x.to(tl.float8e4nv)


INT_BIAS: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2^23


@triton.jit
def biased_float(x):
    """int32 x (|x| < 2^22) -> the fp32 value 1.5 * 2^23 + x, exactly, without the int-to-float
    conversion instruction (a quarter-rate unit on Hopper, as slow as exp2): adding the bit
    pattern of 1.5 * 2^23 to x gives the bit pattern of that float. Subtracting INT_BIAS then
    leaves x exactly; the attention kernel does it inside the score's FMA operand. An INT8 dot
    over D <= 256 stays below 127 * 127 * 256 < 2^22."""
    return (x + 0x4B400000).to(tl.float32, bitcast=True)


@triton.jit
def quantize(x, QK_MODE: tl.constexpr, EMULATE: tl.constexpr):
    """x already divided by its scale: INT8 (floor(x + 0.5), clamped) or FP8 E4M3."""
    if QK_MODE == 1:
        return tl.minimum(tl.maximum(tl.floor(x + 0.5), -127.0), 127.0).to(tl.int8)
    else:
        return to_fp8(x, EMULATE)


@triton.jit
def kv_program(kv_heads):
    """(pid_bh, batch, kv head) of a pre-pass program on grid axis 1 (batch * kv_heads), the
    latter two as int64 offsets."""
    pid_bh = tl.program_id(1)
    return pid_bh, (pid_bh // kv_heads).to(tl.int64), (pid_bh % kv_heads).to(tl.int64)


@triton.jit
def sample_mean(base, stride_n, k_len, sample_stride, n_samples,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """The fp32 mean of rows 0, sample_stride, 2 * sample_stride, ... < k_len of the (k_len, D)
    rows at base (quant_reference.smoothing_mean; n_samples is their number as a float, at least
    1). Every program that calls it adds the same rows in the same order: the same bits."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    j_hi = (k_len + sample_stride - 1) // sample_stride
    total = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for j0 in range(0, j_hi, BLOCK_R):
        j = j0 + offs_r
        total += load_rows(base + (j * sample_stride)[:, None] * stride_n + offs_d[None, :], j, j_hi,
                           offs_d, HEAD_DIM, BLOCK_D, True).to(tl.float32)
    return tl.math.div_rn(tl.sum(total, 0), n_samples)


@triton.jit
def quantize_rows(X, Xq, XScale, stride_xb, stride_xh, stride_xm, batch, head, heads, x_len, pitch, start,
                  HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, QK_MODE: tl.constexpr, EMULATE: tl.constexpr):
    """Rows [start, start + BLOCK) of X's (batch, head) slice to INT8 (QK_MODE 1) or E4M3 (2) with
    one scale per row (amax / 127 or / 448, at least 1e-30), as attention_quant_fwd_kernel
    quantizes Q in its prologue. Xq is (B, heads, x_len, D) contiguous, XScale (B * heads, pitch)
    fp32."""
    rows = start + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < x_len
    x = tl.load(X + batch.to(tl.int64) * stride_xb + head.to(tl.int64) * stride_xh + rows[:, None] * stride_xm
                + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    if QK_MODE == 1:
        qmax = 127.0
    else:
        qmax = 448.0
    x_scale = tl.maximum(tl.max(tl.abs(x), 1) / qmax, 1e-30)
    bh = batch.to(tl.int64) * heads + head
    tl.store(Xq + (bh * x_len + rows[:, None]) * HEAD_DIM + offs_d[None, :],
             quantize(x / x_scale[:, None], QK_MODE, EMULATE), mask=ok[:, None])
    tl.store(XScale + bh * pitch + rows, x_scale, mask=ok)


@triton.jit
def quantize_kv_kernel(
    K, V, KMean, VMean, Kq, KScale, Vq, VScale,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_kqb, stride_kqh, stride_kqn,
    stride_vqb, stride_vqh, stride_vqd,
    kv_heads, k_len, n_blocks, blocks_per_program, k_programs, sample_stride, n_samples,
    Q, Qq, QScale, stride_qb, stride_qh, stride_qm, q_len, q_pitch, q_blocks, kv_group,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr, QK_MODE: tl.constexpr, PV_MODE: tl.constexpr, EMULATE: tl.constexpr,
    QUANTIZE: tl.constexpr = True, Q_MODE: tl.constexpr = 0, BLOCK_Q: tl.constexpr = 64,
):
    """Grid (k_programs + [kv_group * q_blocks], batch * kv_heads): the whole quantization
    pre-pass in one launch.

    A K/V program (axis 0 < k_programs) quantizes key blocks [p * blocks_per_program, ...) of its
    (batch, kv head): K (QK_MODE INT8 or FP8) and V (PV_MODE FP8), each smoothed by its sampled
    mean (`sample_mean`, which every program computes alike) and given one scale per block (the
    block's amax / QMAX, at least 1e-30 for K and V_SCALE_FLOOR for V). Program 0 writes k_mean
    and v_mean to KMean and VMean
    ((B, Hkv, D) fp32). QUANTIZE=False (grid (1, B * Hkv)) only does that.

    BLOCK_R: rows per step of the means; BLOCK_S (dividing BLOCK_N): rows per slice of a block.
    Kq is (B, Hkv, n_blocks * BLOCK_N, D) int8/fp8, rows past k_len zero; Vq is
    (B, Hkv, D, n_blocks * BLOCK_N) fp8 (transposed); KScale and VScale are (B, Hkv, n_blocks)
    fp32.

    With Q_MODE (1 INT8, 2 E4M3), the programs past k_programs quantize Q per row for the
    warp-specialised kernels (`quantize_rows`: BLOCK_Q rows of one query head of the kv head's
    group each) into Qq (B, Hq, Nq, D) and QScale (B * Hq, q_pitch): one launch less."""
    pid_n = tl.program_id(0)
    pid_bh, b64, h64 = kv_program(kv_heads)
    if pid_n >= k_programs:
        idx = pid_n - k_programs
        if Q_MODE != 0:
            quantize_rows(Q, Qq, QScale, stride_qb, stride_qh, stride_qm, b64, h64 * kv_group + idx // q_blocks,
                          kv_heads * kv_group, q_len, q_pitch, (idx % q_blocks) * BLOCK_Q, HEAD_DIM, BLOCK_Q,
                          Q_MODE, EMULATE)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        stat = (b64 * kv_heads + h64) * HEAD_DIM
        d_ok = offs_d < HEAD_DIM
        k_base = K + b64 * stride_kb + h64 * stride_kh
        v_base = V + b64 * stride_vb + h64 * stride_vh
        scale_row = (b64 * kv_heads + h64) * n_blocks

        if QK_MODE != 0:
            k_mean = sample_mean(k_base, stride_kn, k_len, sample_stride, n_samples, HEAD_DIM, BLOCK_D, BLOCK_R)
            if pid_n == 0:
                tl.store(KMean + stat + offs_d, k_mean, mask=d_ok)
        if PV_MODE == 1:
            v_mean = sample_mean(v_base, stride_vn, k_len, sample_stride, n_samples, HEAD_DIM, BLOCK_D, BLOCK_R)
            if pid_n == 0:
                tl.store(VMean + stat + offs_d, v_mean, mask=d_ok)

        if QUANTIZE:
            # Each block is streamed in BLOCK_S-row slices (a whole 128- or 256-row block in
            # registers spills), twice: for the block's scale, then to quantize (the second
            # read hits the cache).
            if QK_MODE == 1:
                qmax = 127.0
            else:
                qmax = 448.0
            blk_hi = tl.minimum((pid_n + 1) * blocks_per_program, n_blocks)
            for blk in range(pid_n * blocks_per_program, blk_hi):
                if QK_MODE != 0:
                    k_scale = tl.maximum(block_amax(k_base, stride_kn, k_mean, blk, k_len, HEAD_DIM, BLOCK_D,
                                                    BLOCK_N, BLOCK_S) / qmax, 1e-30)
                    for r0 in range(0, BLOCK_N, BLOCK_S):
                        rows = blk * BLOCK_N + r0 + tl.arange(0, BLOCK_S)
                        k = smoothed_rows(k_base, stride_kn, k_mean, rows, k_len, HEAD_DIM, BLOCK_D)
                        tl.store(Kq + b64 * stride_kqb + h64 * stride_kqh + rows[:, None] * stride_kqn
                                 + offs_d[None, :], quantize(k / k_scale, QK_MODE, EMULATE), mask=d_ok[None, :])
                    tl.store(KScale + scale_row + blk, k_scale)
                if PV_MODE == 1:
                    v_scale = tl.maximum(block_amax(v_base, stride_vn, v_mean, blk, k_len, HEAD_DIM, BLOCK_D,
                                                    BLOCK_N, BLOCK_S) / 448.0, V_SCALE_FLOOR)
                    for r0 in range(0, BLOCK_N, BLOCK_S):
                        rows = blk * BLOCK_N + r0 + tl.arange(0, BLOCK_S)
                        v = smoothed_rows(v_base, stride_vn, v_mean, rows, k_len, HEAD_DIM, BLOCK_D)
                        tl.store(Vq + b64 * stride_vqb + h64 * stride_vqh + offs_d[None, :] * stride_vqd
                                 + rows[:, None], to_fp8(v / v_scale, EMULATE), mask=d_ok[None, :])
                    tl.store(VScale + scale_row + blk, v_scale)


@triton.jit
def smoothed_rows(base, stride_n, mean, rows, k_len, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(rows, BLOCK_D) fp32: the rows at base minus mean; rows past k_len (and padding columns) 0."""
    offs_d = tl.arange(0, BLOCK_D)
    x = load_rows(base + rows[:, None] * stride_n + offs_d[None, :], rows, k_len, offs_d, HEAD_DIM, BLOCK_D,
                  True).to(tl.float32)
    return tl.where((rows[:, None] < k_len) & (offs_d < HEAD_DIM)[None, :], x - mean[None, :], 0.0)


@triton.jit
def block_amax(base, stride_n, mean, blk, k_len, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    """max |row - mean| over key block blk's rows and channels, slice by slice (an elementwise
    running maximum, reduced once: no cross-warp reduction per slice)."""
    amax = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    for r0 in range(0, BLOCK_N, BLOCK_S):
        rows = blk * BLOCK_N + r0 + tl.arange(0, BLOCK_S)
        amax = tl.maximum(amax, tl.abs(smoothed_rows(base, stride_n, mean, rows, k_len, HEAD_DIM, BLOCK_D)))
    return tl.max(tl.max(amax, 1), 0)


@triton.jit
def quant_tile(acc, l_i, m_i, vs_prev, q, row_scale, k_base, kq_base, ks_base, v_base, vq_base, vs_base, mask_base,
               start_n, offs_m, offs_n, offs_d, q_len, k_len, diag, window_left, window_right,
               stride_kn, stride_kqn, stride_vn, stride_vqd, stride_mm, stride_mn,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, EDGE: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
               QK_MODE: tl.constexpr, PV_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
               SCALE_POSITIVE: tl.constexpr, EMULATE: tl.constexpr, EXP_FMA: tl.constexpr):
    """Fold one key tile into (acc, l_i, m_i); the products in the precisions asked for."""
    cols = start_n + offs_n
    # INT8 scores come out as biased floats f = 1.5 * 2^23 + x (see biased_float; the bias is
    # subtracted in the FMA's operand, exactly), and FP8 P is produced already scaled by 448
    # (log2(448) folded into the subtracted max), so neither costs a conversion or a multiply.
    bias = 0.0
    if PV_MODE == 1:
        p_log2_scale = 8.807354922057604  # log2(448)
        # acc is kept in units of the current tile's V scale: the change of unit rides on the
        # per-row alpha, so the add below stays one FMA per element (a multiply of the product
        # by the scale would be a second one, 12% slower on the H100). Loaded first, so its
        # latency hides behind Q.K^T.
        vs = tl.load(vs_base + start_n // BLOCK_N)
        unit = vs_prev / vs
        vs_prev = vs
    else:
        p_log2_scale = 0.0
    if QK_MODE == 0:
        k = load_rows(k_base + cols[:, None] * stride_kn + offs_d[None, :], cols, k_len, offs_d,
                      HEAD_DIM, BLOCK_D, EDGE)
        qk = dot(q, tl.trans(k), None, DOT_PRECISION)
        rs = row_scale
    else:
        # Quantized K is padded to whole blocks: no bounds checks, the scores mask the tail.
        k = tl.load(kq_base + cols[:, None] * stride_kqn + offs_d[None, :])
        if QK_MODE == 1:
            qk = biased_float(tl.dot(q, tl.trans(k), out_dtype=tl.int32))
            bias = INT_BIAS
        else:
            qk = tl.dot(q, tl.trans(k))
        rs = row_scale * tl.load(ks_base + start_n // BLOCK_N)
    if (not EDGE) and MASK_KIND == 0 and SCALE_POSITIVE:
        m_new = tl.maximum(m_i, (tl.max(qk, 1) - bias) * rs)
        alpha = tl.math.exp2(m_i - m_new)
        p = exp2_tile((qk - bias) * rs[:, None] - (m_new - p_log2_scale)[:, None], EXP_FMA)
    else:
        s = apply_masks((qk - bias) * rs[:, None], offs_m[:, None], cols[None, :], q_len, k_len, diag,
                        window_left, window_right, mask_base, stride_mm, stride_mn, EDGE,
                        HAS_LEFT, HAS_RIGHT, MASK_KIND)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_shift)
        p = tl.math.exp2(s - (m_shift - p_log2_scale)[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if PV_MODE == 1:
        # Loaded as (D, BLOCK_N), keys contiguous, and transposed in shared memory: the
        # tensor-core B operand stays K-major, and the load is pipelined like K's.
        vt = tl.load(vq_base + offs_d[:, None] * stride_vqd + cols[None, :])
        # Each tile's FP8 product starts from zero and is added to the fp32 accumulator here:
        # Hopper's FP8 MMA accumulates with fewer bits than fp32, which over thousands of keys
        # (one long accumulation chain) costs accuracy (measured: 0.12 instead of 0.04 at
        # N=16384); per tile the chain is BLOCK_N products long.
        acc = acc * (alpha * unit)[:, None] + tl.dot(to_fp8(p, EMULATE), tl.trans(vt))
    else:
        acc = acc * alpha[:, None]
        v = load_rows(v_base + cols[:, None] * stride_vn + offs_d[None, :], cols, k_len, offs_d,
                      HEAD_DIM, BLOCK_D, EDGE)
        acc = dot(round_to(p, v.dtype, DOT_PRECISION), v, acc, DOT_PRECISION)
    return acc, l_i, m_new, vs_prev


@triton.jit
def quant_tile_run(acc, l_i, m_i, vs_prev, q, row_scale, k_base, kq_base, ks_base, v_base, vq_base, vs_base, mask_base,
                   tile_start, tile_end, offs_m, offs_n, offs_d, q_len, k_len, diag, window_left, window_right,
                   stride_kn, stride_kqn, stride_vn, stride_vqd, stride_mm, stride_mn,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, EDGE: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
                   QK_MODE: tl.constexpr, PV_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   SCALE_POSITIVE: tl.constexpr, EMULATE: tl.constexpr, EXP_FMA: tl.constexpr):
    """The loop over key tiles [tile_start, tile_end) (tile indices, not keys). It counts tiles
    rather than keys: start_n = tile * BLOCK_N is then known to be aligned, which the pipeliner
    needs to prefetch the transposed FP8 V (whose rows run along keys) with asynchronous copies."""
    for tile in range(tile_start, tile_end):
        start_n = tile * BLOCK_N
        acc, l_i, m_i, vs_prev = quant_tile(acc, l_i, m_i, vs_prev, q, row_scale, k_base, kq_base, ks_base, v_base, vq_base,
                                   vs_base, mask_base, start_n, offs_m, offs_n, offs_d, q_len, k_len, diag,
                                   window_left, window_right, stride_kn, stride_kqn, stride_vn, stride_vqd,
                                   stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_N, EDGE, HAS_LEFT,
                                   HAS_RIGHT, MASK_KIND, QK_MODE, PV_MODE, DOT_PRECISION, SCALE_POSITIVE,
                                   EMULATE, EXP_FMA)
    return acc, l_i, m_i, vs_prev


@triton.jit(do_not_specialize=["q_len", "k_len", "window_left", "window_right", "n_blocks"])
def attention_quant_fwd_kernel(
    Q, K, V, Kq, KScale, Vq, VScale, VMean, Out, Mask, HeadLevel, KMean, Lse,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_kqb, stride_kqh, stride_kqn,
    stride_vqb, stride_vqh, stride_vqd,
    stride_ob, stride_oh, stride_om,
    stride_mb, stride_mh, stride_mm, stride_mn,
    q_heads, kv_group, q_len, k_len, n_blocks,
    scale_log2, window_left, window_right,
    RUN_LEVEL: tl.constexpr, HAS_HEAD_LEVEL: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, QK_MODE: tl.constexpr, PV_MODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SCALE_POSITIVE: tl.constexpr, EMULATE: tl.constexpr,
    EXP_FMA: tl.constexpr = 0, STORE_LSE: tl.constexpr = False,
):
    """Grid (query blocks, batch * q_heads). With HAS_HEAD_LEVEL, a program whose head's
    entry in HeadLevel (int32, one per query head) is not RUN_LEVEL returns at once, leaving
    its rows of Out to the launch of that head's level.

    STORE_LSE: each row's log-sum-exp of its (quantized) scores, natural log, fp32, into Lse
    (B * q_heads, q_len) (-inf for a row that sees no key), so partial results merge exactly.
    The smoothing mean's share of the scores (scale * q.k_mean, which the quantized Q.K^T leaves
    out: softmax ignores it) is added back from KMean ((B, Hkv, D) fp32) and the unquantized q."""
    pid_bh, batch, head, kv_head, start_m, diag = dense_program(q_heads, kv_group, q_len, k_len, BLOCK_M,
                                                                BOTTOM_RIGHT)
    if HAS_HEAD_LEVEL:
        if tl.load(HeadLevel + head) != RUN_LEVEL:
            return

    b64 = batch.to(tl.int64)
    h64 = head.to(tl.int64)
    kv64 = kv_head.to(tl.int64)
    q_base = Q + b64 * stride_qb + h64 * stride_qh
    k_base = K + b64 * stride_kb + kv64 * stride_kh
    v_base = V + b64 * stride_vb + kv64 * stride_vh
    kq_base = Kq + b64 * stride_kqb + kv64 * stride_kqh
    vq_base = Vq + b64 * stride_vqb + kv64 * stride_vqh
    ks_base = KScale + (b64 * (q_heads // kv_group) + kv64) * n_blocks
    vs_base = VScale + (b64 * (q_heads // kv_group) + kv64) * n_blocks
    stat = (b64 * (q_heads // kv_group) + kv64) * HEAD_DIM
    o_base = Out + b64 * stride_ob + h64 * stride_oh
    mask_base = Mask + b64 * stride_mb + h64 * stride_mh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_rows(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], offs_m, q_len, offs_d,
                  HEAD_DIM, BLOCK_D, True)
    q_shift = tl.zeros([BLOCK_M], dtype=tl.float32)  # log2 units: what smoothing took out of the scores
    if QK_MODE == 0:
        row_scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32) * scale_log2
    else:
        qf = q.to(tl.float32)
        if STORE_LSE:
            k_mean = tl.load(KMean + stat + offs_d, mask=offs_d < HEAD_DIM, other=0.0)
            q_shift = tl.sum(qf * k_mean[None, :], 1) * scale_log2
        if QK_MODE == 1:
            qmax = 127.0
        else:
            qmax = 448.0
        q_scale = tl.maximum(tl.max(tl.abs(qf), 1) / qmax, 1e-30)
        q = quantize(qf / q_scale[:, None], QK_MODE, EMULATE)
        row_scale = q_scale * scale_log2

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    vs_prev = tl.full([], 1.0, tl.float32)  # the V scale of the tile acc is in units of (fp8 P.V)
    lo, full_lo, full_hi, hi = key_tile_range(start_m, q_len, k_len, diag, window_left, window_right,
                                              BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # The three runs in tile indices, each tile in exactly one: a partial tile at either end of
    # the unmasked run goes to the masked run beside it. (key_tile_range clamps its bounds to hi,
    # which need not be a tile boundary: converting each run's key bounds on its own counted
    # such a tile in two or three runs, one of them unmasked, whenever a window or a causal
    # diagonal ended inside a tile before the unmasked run began: wrong outputs on the H100.)
    t_lo = lo // BLOCK_N
    t_full_lo = tl.cdiv(full_lo, BLOCK_N)
    t_full_hi = tl.maximum(t_full_lo, full_hi // BLOCK_N)
    t_hi = tl.maximum(t_full_hi, tl.cdiv(hi, BLOCK_N))
    acc, l_i, m_i, vs_prev = quant_tile_run(acc, l_i, m_i, vs_prev, q, row_scale, k_base, kq_base, ks_base, v_base, vq_base,
                                   vs_base, mask_base, t_lo, t_full_lo, offs_m, offs_n, offs_d, q_len, k_len, diag,
                                   window_left, window_right, stride_kn, stride_kqn, stride_vn, stride_vqd,
                                   stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_LEFT,
                                   HAS_RIGHT, MASK_KIND, QK_MODE, PV_MODE, DOT_PRECISION, SCALE_POSITIVE,
                                   EMULATE, EXP_FMA)
    acc, l_i, m_i, vs_prev = quant_tile_run(acc, l_i, m_i, vs_prev, q, row_scale, k_base, kq_base, ks_base, v_base, vq_base,
                                   vs_base, mask_base, t_full_lo, t_full_hi, offs_m, offs_n, offs_d, q_len, k_len, diag,
                                   window_left, window_right, stride_kn, stride_kqn, stride_vn, stride_vqd,
                                   stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_LEFT,
                                   HAS_RIGHT, MASK_KIND, QK_MODE, PV_MODE, DOT_PRECISION, SCALE_POSITIVE,
                                   EMULATE, EXP_FMA)
    acc, l_i, m_i, vs_prev = quant_tile_run(acc, l_i, m_i, vs_prev, q, row_scale, k_base, kq_base, ks_base, v_base, vq_base,
                                   vs_base, mask_base, t_full_hi, t_hi, offs_m, offs_n, offs_d, q_len, k_len, diag,
                                   window_left, window_right, stride_kn, stride_kqn, stride_vn, stride_vqd,
                                   stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_LEFT,
                                   HAS_RIGHT, MASK_KIND, QK_MODE, PV_MODE, DOT_PRECISION, SCALE_POSITIVE,
                                   EMULATE, EXP_FMA)

    seen = l_i > 0.0
    inv_l = 1.0 / tl.where(seen, l_i, 1.0)
    if PV_MODE == 1:
        v_mean = tl.load(VMean + stat + offs_d, mask=offs_d < HEAD_DIM, other=0.0)
        out = acc * (inv_l * vs_prev)[:, None]  # P and l both carry the factor 448
        out = tl.where(seen[:, None], out + v_mean[None, :], 0.0)
    else:
        out = acc * inv_l[:, None]
    store_rows(o_base + offs_m[:, None] * stride_om + offs_d[None, :],
               round_to(out, Out.dtype.element_ty, DOT_PRECISION), offs_m, q_len, offs_d, HEAD_DIM, BLOCK_D)
    if STORE_LSE:
        if PV_MODE == 1:
            p_log2_scale = 8.807354922057604  # log2(448): P, and so l, carry the factor 448
        else:
            p_log2_scale = 0.0
        lse2 = m_i + tl.math.log2(tl.where(seen, l_i, 1.0)) - p_log2_scale + q_shift
        lse = tl.where(seen, lse2 * 0.6931471805599453, float("-inf"))
        tl.store(Lse + pid_bh.to(tl.int64) * q_len + offs_m, lse, mask=offs_m < q_len)
