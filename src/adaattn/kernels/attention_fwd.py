"""Exact fused attention, forward: online softmax over key tiles, fp32 accumulation.

One program owns BLOCK_M query rows of one (batch, query head). It walks the key tiles that
can be visible to those rows (the tile range), applies the causal/window/sequence-end and
user masks (masking), and folds each tile into a running max, sum and output (per-tile
work). The three pieces are separate functions so a tile can later be computed another
way (quantized, low-rank) without touching the loop or the masks.

Scores live in the log2 domain: s = (q . k) * scale * log2(e), so exp2 replaces exp.
The saved log-sum-exp is in the natural-log domain (as SDPA's), -inf for a row that sees
no key.

Positions: query row i sits at position i + diag, where diag = k_len - q_len for
bottom-right alignment (KV cache) and 0 for top-left (SDPA). Key j is visible iff
j <= pos + right (causal folds in as right = 0) and j >= pos - left, each only when that
side is bounded (HAS_RIGHT / HAS_LEFT).
"""

import os

import triton
import triton.language as tl

MASK_NONE = 0
MASK_BOOL = 1
MASK_ADDITIVE = 2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# The same constants, readable inside @triton.jit functions.
LOG2E_K: tl.constexpr = tl.constexpr(LOG2E)
LN2_K: tl.constexpr = tl.constexpr(LN2)


# Whether @triton.jit functions run under the CPU interpreter (triton decides that when a function
# is decorated, from the same variable).
INTERPRETED: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    """a @ b (+ acc) accumulated in fp32. "ieee" and "tf32" go to tl.dot as they are.
    "interpreter_bf16" is for bfloat16 under the CPU interpreter, whose tl.dot reads bf16
    bits as integers (triton 3.9): both operands are upcast first. Products of bf16 values
    are exact in fp32, so only the summation order differs from the tensor cores.
    float32 ("ieee") under the interpreter accumulates in float64: the interpreter's tl.dot is
    numpy's float32 matmul, whose accuracy is the CPU's BLAS kernel's. On an AMD EPYC (OpenBLAS's
    Zen kernel) a fuzzed float32 backward (seed 20261127 #20, logits x30) gave dq 2.4e-5 against
    torch's 7.3e-6; accumulated in float64, 7.9e-7. The GPU's fp32 products are the CUDA fuzz's."""
    if DOT_PRECISION == "interpreter_bf16":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif INTERPRETED and DOT_PRECISION == "ieee":
        product = tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee")
        if acc is None:
            return product.to(tl.float32)
        return (product + acc.to(tl.float64)).to(tl.float32)
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def round_to(x, dtype: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """fp32 x cast to dtype, rounding to nearest even as the GPU does. The interpreter
    truncates fp32 -> bf16 (triton 3.9, whatever rounding is asked for), so there the
    rounding increment is added to the bits first and its truncation then rounds."""
    if DOT_PRECISION == "interpreter_bf16":
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)).to(tl.float32, bitcast=True)
        # Zeros and subnormals: the interpreter's conversion mangles subnormal inputs.
        return tl.where((bits & 0x7F800000) == 0, 0.0, rounded).to(dtype)
    else:
        return x.to(dtype)


# exp2 on the FMA units: 2^x = 2^round(x) * 2^f, f in [-1/2, 1/2], 2^f by a degree-3 polynomial
# (minimax for relative error, max 7.5e-5: far below bf16/fp16/fp8 rounding of P).
EXP2_C0: tl.constexpr = tl.constexpr(0.9999281167984009)
EXP2_C1: tl.constexpr = tl.constexpr(0.6932609677314758)
EXP2_C2: tl.constexpr = tl.constexpr(0.24260999262332916)
EXP2_C3: tl.constexpr = tl.constexpr(0.055171094834804535)


@triton.jit
def exp2_fma(x):
    """2^x for x <= 0 (finite; below -125 it returns about 2^-125, not 0) without the
    multi-function unit, which issues a quarter as many exp2 per clock as the FMA units
    issue FMAs (the softmax's bottleneck once the products are fast). Rounding x to an
    integer n by adding 1.5 * 2^23 leaves n in the low mantissa bits of the sum; shifting
    those bits into the exponent field of the polynomial's value multiplies it by 2^n."""
    x = tl.maximum(x, -125.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = ((EXP2_C3 * f + EXP2_C2) * f + EXP2_C1) * f + EXP2_C0
    return (p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def exp2_tile(x, EXP_FMA: tl.constexpr):
    """2^x of a (BLOCK_M, BLOCK_N) score tile (x <= 0, finite where EXP_FMA != 0), a share of it
    on the FMA units so they and the multi-function unit both work: EXP_FMA = 0 none, 2 one
    column in 2, 4 one column in 4. The columns are picked by reshapes and splits that follow
    the tensor-core accumulator layout (each thread holds column pairs 2t, 2t + 1 repeating every
    8 columns), so they move no data between threads."""
    if EXP_FMA == 0:
        return tl.math.exp2(x)
    elif EXP_FMA == 2:
        a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
        return tl.reshape(tl.join(tl.math.exp2(a), exp2_fma(b)), [x.shape[0], x.shape[1]])
    else:
        x5 = tl.permute(tl.reshape(x, [x.shape[0], x.shape[1] // 16, 2, 4, 2]), (0, 1, 3, 2, 4))
        a, b = tl.split(x5)
        b0, b1 = tl.split(b)
        p5 = tl.join(tl.math.exp2(a), tl.join(tl.math.exp2(b0), exp2_fma(b1)))
        return tl.reshape(tl.permute(p5, (0, 1, 3, 2, 4)), [x.shape[0], x.shape[1]])


@triton.jit
def dense_program(q_heads, kv_group, q_len, k_len, BLOCK_M: tl.constexpr, BOTTOM_RIGHT: tl.constexpr):
    """(pid_bh, batch, head, kv_head, start_m, diag) of a program of a dense (query blocks,
    batch * q_heads) grid, query blocks last-first (under causal masks the last do the most
    work; starting them first shortens the tail of the grid)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    head = pid_bh % q_heads
    diag = 0
    if BOTTOM_RIGHT:
        diag = k_len - q_len
    return pid_bh, pid_bh // q_heads, head, head // kv_group, pid_m * BLOCK_M, diag


@triton.jit
def sequence_bounds(CuSeqlens, batch_index, dense_len, IS_VARLEN: tl.constexpr):
    """(start row in the packed tensor, length) of one sequence."""
    if IS_VARLEN:
        start = tl.load(CuSeqlens + batch_index)
        end = tl.load(CuSeqlens + batch_index + 1)
        return start, end - start
    else:
        return 0, dense_len


@triton.jit
def load_rows(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              CHECK_ROWS: tl.constexpr):
    """A (rows, BLOCK_D) tile; rows past n_rows and columns past HEAD_DIM read as 0."""
    if CHECK_ROWS:
        if BLOCK_D != HEAD_DIM:
            return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if BLOCK_D != HEAD_DIM:
            return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def store_rows(ptrs, value, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if BLOCK_D != HEAD_DIM:
        tl.store(ptrs, value, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))
    else:
        tl.store(ptrs, value, mask=rows[:, None] < n_rows)


@triton.jit
def key_tile_range(start_m, q_len, k_len, diag, window_left, window_right,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key tiles a query block [start_m, start_m + BLOCK_M) can see, in three runs:
    [lo, full_lo) edge tiles, [full_lo, full_hi) tiles visible to every row (no position
    masks, no bounds checks), [full_hi, hi) edge tiles. Tiles outside [lo, hi) are skipped.
    """
    first_pos = start_m + diag
    last_pos = tl.minimum(start_m + BLOCK_M, q_len) - 1 + diag
    lo = 0
    hi = k_len
    full_lo = 0
    full_hi = (k_len // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = (tl.maximum(first_pos - window_left, 0) // BLOCK_N) * BLOCK_N
        full_lo = ((tl.maximum(last_pos - window_left, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(k_len, tl.maximum(last_pos + window_right + 1, 0))
        full_hi = (tl.minimum(k_len, tl.maximum(first_pos + window_right + 1, 0)) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def position_keep(q_idx, k_idx, q_len, k_len, diag, window_left, window_right,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, CHECK_ROWS: tl.constexpr = True):
    """True where query q_idx may see key k_idx (broadcast shapes), sequence ends included (the
    query end only with CHECK_ROWS: callers whose rows past the end get p = 0 anyway skip it)."""
    keep = k_idx < k_len
    if CHECK_ROWS:
        keep = keep & (q_idx < q_len)
    pos = q_idx + diag
    if HAS_RIGHT:
        keep = keep & (k_idx <= pos + window_right)
    if HAS_LEFT:
        keep = keep & (k_idx >= pos - window_left)
    return keep


# Where |mask x log2(e)| is at least this, apply_masks_lo leaves the residual out: fp32 (torch) and
# float64 alike lose the scores next to such a mask (finfo.min rows give SDPA's mean of V).
BIAS_LO_LIMIT: tl.constexpr = tl.constexpr(2.0**40)


@triton.jit
def apply_masks_lo(s, q_idx, k_idx, q_len, k_len, diag, window_left, window_right,
                   mask_base, stride_mm, stride_mn,
                   EDGE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   MASK_KIND: tl.constexpr, LO: tl.constexpr = False):
    """Scores s (log2 domain) with masked entries set to -inf and the additive mask added, and
    with LO what that sum's rounding lost: (s, lo), lo a tensor for an additive mask (MASK_KIND
    2) under LO, else 0.0. p = exp2((s - m) + lo) is then the exact score's, where exp2(s - m)
    takes the sum's rounding at the mask's size: at |mask| ~ 1e4 fp32 keeps a score to 1e-3, what
    torch keeps (seed 5840 #511 was 2.3x torch's error by such luck; with lo float64's to ~1e-7).
    Callers take LO for float32 inputs only: half inputs round p to 16 bits for P.V
    anyway, and a row's largest p, exp2(lo) there, would no longer round to exactly 1.

    q_idx and k_idx broadcast to the shape of s, so the same code serves the (query, key)
    orientation of the forward and the (key, query) orientation of the backward.
    """
    lo = 0.0
    if MASK_KIND != 0:
        in_bounds = (q_idx < q_len) & (k_idx < k_len)
        mask_ptrs = mask_base + q_idx.to(tl.int64) * stride_mm + k_idx * stride_mn
        if MASK_KIND == 1:
            user_keep = tl.load(mask_ptrs, mask=in_bounds, other=0) != 0
            s = tl.where(user_keep, s, float("-inf"))
        else:
            bias = tl.load(mask_ptrs, mask=in_bounds, other=0.0).to(tl.float32)
            # finfo(bf16/fp32).min (the Hugging Face "masked" value) times log2(e) would overflow
            # to -inf and turn a fully masked row into zeros; SDPA gives the mean of V there.
            # (-inf itself stays -inf: a row masked with -inf everywhere gives zeros.)
            bias = tl.where(bias == float("-inf"), bias, tl.maximum(bias, -2.0e38))
            # Explicit fmas (one rounding each, whatever the compiler contracts): t = bias log2(e)
            # + s rounded once, and lo = (bias log2(e) - t) + s, exact but for s's own rounding.
            t = tl.math.fma(bias, LOG2E_K, s)
            if LO:
                lo = tl.math.fma(bias, LOG2E_K, -t) + s
                lo = tl.where(tl.abs(bias) < BIAS_LO_LIMIT / LOG2E_K, lo, 0.0)
            s = t
    if EDGE:
        keep = position_keep(q_idx, k_idx, q_len, k_len, diag, window_left, window_right,
                             HAS_LEFT, HAS_RIGHT)
        s = tl.where(keep, s, float("-inf"))
    return s, lo


@triton.jit
def apply_masks(s, q_idx, k_idx, q_len, k_len, diag, window_left, window_right,
                mask_base, stride_mm, stride_mn,
                EDGE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                MASK_KIND: tl.constexpr):
    """apply_masks_lo's scores without the residual (the quantized kernels' approximate path)."""
    s, _ = apply_masks_lo(s, q_idx, k_idx, q_len, k_len, diag, window_left, window_right,
                          mask_base, stride_mm, stride_mn, EDGE, HAS_LEFT, HAS_RIGHT, MASK_KIND)
    return s


@triton.jit
def soft_cap(s, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(SOFTCAP * tanh(s / SOFTCAP), tanh(s / SOFTCAP)): logit soft-capping of scores s, both in
    the log2 domain (SOFTCAP is the cap c times log2(e)); the tanh also gives the backward its
    chain factor 1 - tanh^2. Half precision: tanh(x) = 2 / (1 + e^-2x) - 1, one exp2 and one
    division, to fp32's absolute rounding near 0 (far below a half-precision P). float32 ("ieee"):
    sign(x) (1 - e^-2|x|) / (1 + e^-2|x|), 2-4x more accurate near 0 (the sigmoid form gave float32
    outputs 3x eager's error at a cap of 20), one tile more live (a spill in the half kernels)."""
    if DOT_PRECISION == "ieee":
        x = s * (1.0 / SOFTCAP)
        e = tl.math.exp2(tl.abs(x) * (-2.0 * LOG2E_K))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(x < 0.0, -t, t)
    else:
        t = 2.0 / (1.0 + tl.math.exp2(s * (-2.0 * LOG2E_K / SOFTCAP))) - 1.0
    return t * SOFTCAP, t


@triton.jit
def alibi_bias(s, q_idx, k_idx, diag, alibi2):
    """Scores s (log2 domain) less the ALiBi bias slope * |position - key| (alibi2: the slope times
    log2(e)); q_idx and k_idx broadcast as apply_masks takes them, the query at q_idx + diag."""
    return s - alibi2 * tl.abs((q_idx + diag) - k_idx).to(tl.float32)


@triton.jit
def head_slope(Slopes, b64, stride_sb, head, HAS_ALIBI: tl.constexpr):
    """The ALiBi slope of (batch, head) in the log2 domain (times log2(e)); 0.0 without ALiBi."""
    if HAS_ALIBI:
        return tl.load(Slopes + b64 * stride_sb + head).to(tl.float32) * LOG2E_K
    else:
        return 0.0


@triton.jit
def masked_softmax_step(s, m_i, lo=0.0, HAS_LO: tl.constexpr = False):
    """A tile's scores s (log2 domain, -inf where masked) against the running row max m_i:
    (p = exp2(s - new max), alpha = the rescale of what came before, the new max). A row that
    has seen only masked keys keeps m = -inf; subtracting 0 keeps p = 0, not NaN. HAS_LO: p takes
    the scores' residual lo (apply_masks_lo) after the shift, exp2((s - max) + lo)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    if HAS_LO:
        p = tl.math.exp2((s - m_shift[:, None]) + lo)
    else:
        p = tl.math.exp2(s - m_shift[:, None])
    return p, tl.math.exp2(m_i - m_shift), m_new


@triton.jit
def fwd_tile(acc, l_i, m_i, q, k_base, v_base, mask_base, start_n,
             offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
             stride_kn, stride_vn, stride_mm, stride_mn, scale_log2,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
             EDGE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
             DOT_PRECISION: tl.constexpr, SCALE_POSITIVE: tl.constexpr, EXP_FMA: tl.constexpr = 0,
             SOFTCAP: tl.constexpr = 0.0, HAS_ALIBI: tl.constexpr = False, alibi2=0.0):
    """Fold one key tile into the running (acc, l_i, m_i) of the online softmax. EXP_FMA: the
    share of the fully visible tiles' exp2 computed on the FMA units (exp2_tile). K tiles are
    (BLOCK_N, BLOCK_D) over HEAD_DIM columns, V tiles and acc (., BLOCK_DV) over HEAD_DIM_V."""
    cols = start_n + offs_n
    k = load_rows(k_base + cols[:, None] * stride_kn + offs_d[None, :], cols, k_len, offs_d,
                  HEAD_DIM, BLOCK_D, EDGE)
    qk = dot(q, tl.trans(k), None, DOT_PRECISION)
    if (not EDGE) and MASK_KIND == 0 and SCALE_POSITIVE and SOFTCAP == 0.0 and not HAS_ALIBI:
        # Every score of the tile is visible and finite: take the row max of the raw scores
        # (a positive scale keeps the argmax) and fold scale and shift into one FMA per score.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        alpha = tl.math.exp2(m_i - m_new)
        p = exp2_tile(qk * scale_log2 - m_new[:, None], EXP_FMA)
    else:
        s = qk * scale_log2
        if SOFTCAP != 0.0:
            s, _ = soft_cap(s, SOFTCAP, DOT_PRECISION)
        if HAS_ALIBI:
            s = alibi_bias(s, offs_m[:, None], cols[None, :], diag, alibi2)
        LO: tl.constexpr = (MASK_KIND == 2) and (q.dtype == tl.float32)  # apply_masks_lo
        s, s_lo = apply_masks_lo(s, offs_m[:, None], cols[None, :], q_len, k_len, diag,
                                 window_left, window_right, mask_base, stride_mm, stride_mn, EDGE,
                                 HAS_LEFT, HAS_RIGHT, MASK_KIND, LO)
        p, alpha, m_new = masked_softmax_step(s, m_i, s_lo, LO)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_rows(v_base + cols[:, None] * stride_vn + offs_dv[None, :], cols, k_len, offs_dv,
                  HEAD_DIM_V, BLOCK_DV, EDGE)
    acc = acc * alpha[:, None]
    acc = dot(round_to(p, v.dtype, DOT_PRECISION), v, acc, DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def fwd_tile_run(acc, l_i, m_i, q, k_base, v_base, mask_base, tile_start, tile_end,
                 offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                 stride_kn, stride_vn, stride_mm, stride_mn, scale_log2,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                 EDGE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALE_POSITIVE: tl.constexpr,
                 EXP_FMA: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0, HAS_ALIBI: tl.constexpr = False,
                 alibi2=0.0):
    """The tile loop over keys [tile_start, tile_end), in steps of BLOCK_N."""
    for start_n in range(tile_start, tile_end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = fwd_tile(acc, l_i, m_i, q, k_base, v_base, mask_base, start_n,
                                 offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                                 stride_kn, stride_vn, stride_mm, stride_mn, scale_log2,
                                 HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, EDGE, HAS_LEFT, HAS_RIGHT, MASK_KIND,
                                 DOT_PRECISION, SCALE_POSITIVE, EXP_FMA, SOFTCAP, HAS_ALIBI, alibi2)
    return acc, l_i, m_i


@triton.jit
def fwd_tile_tma(acc, l_i, m_i, q, k_desc, v_desc, batch, kv_head, start_n, scale_log2,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_DV: tl.constexpr):
    """fwd_tile for a tile every row sees, no mask, positive scale: K and V come through
    tensor descriptors (TMA on Hopper) as (1, 1, BLOCK_N, BLOCK_D) boxes of (B, Hkv, Nk, D)
    (V's box (1, 1, BLOCK_N, BLOCK_DV); the launch takes TMA only where Dv == D)."""
    k = k_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
    qk = dot(q, tl.trans(k), None, DOT_PRECISION)
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_DV)
    acc = acc * alpha[:, None]
    acc = dot(round_to(p, v.dtype, DOT_PRECISION), v, acc, DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def fwd_tile_run_tma(acc, l_i, m_i, q, k_desc, v_desc, batch, kv_head, tile_start, tile_end, scale_log2,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     BLOCK_DV: tl.constexpr):
    for start_n in range(tile_start, tile_end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = fwd_tile_tma(acc, l_i, m_i, q, k_desc, v_desc, batch, kv_head, start_n, scale_log2,
                                     BLOCK_N, BLOCK_D, DOT_PRECISION, BLOCK_DV)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["q_len_dense", "k_len_dense", "window_left", "window_right"])
def attention_fwd_kernel(
    Q, K, V, Out, LSE, Mask, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh, stride_lm,
    stride_mb, stride_mh, stride_mm, stride_mn,
    q_heads, kv_group, q_len_dense, k_len_dense,
    scale_log2, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALE_POSITIVE: tl.constexpr,
    KDesc=None, VDesc=None, USE_TMA: tl.constexpr = False, HEAD_MAJOR: tl.constexpr = False,
    EXP_FMA: tl.constexpr = 0, Stats=None, stride_ls=0, STORE_STATS: tl.constexpr = False,
    SOFTCAP: tl.constexpr = 0.0, Sinks=None, HAS_SINKS: tl.constexpr = False,
    Slopes=None, stride_sb=0, HAS_ALIBI: tl.constexpr = False,
):
    """Grid: (query blocks, batch * q_heads), or (batch * q_heads, query blocks) with
    HEAD_MAJOR. Writes Out rows and their log-sum-exp.

    STORE_STATS: also write each row's max m (log2 domain, -inf for a row that saw nothing) and
    log2 of its sum, apart, into Stats (two planes stride_ls apart, each laid out as LSE). The
    backward recomputes p = exp2((s - m) - log2(sum)) from them: under a large additive bias
    (-1e4, fp16's finfo.min) m + log2(sum) in one fp32 loses log2(sum) to m's rounding, which
    scales every p of the row.

    Q and K tiles span HEAD_DIM columns padded to BLOCK_D; V, the accumulator and Out span the
    value head dim HEAD_DIM_V padded to BLOCK_DV (the launch passes BLOCK_DV == BLOCK_D where
    HEAD_DIM_V == HEAD_DIM, so that case compiles to the same code as a single head dim).

    USE_TMA (dense, no mask, positive scale, HEAD_DIM == BLOCK_D): the fully visible key
    tiles load K and V through the tensor descriptors KDesc/VDesc over (B, Hkv, Nk, D); edge
    tiles keep pointer loads."""
    # Query blocks run last-first: under causal masks the last blocks do the most work, and
    # starting them first shortens the tail of the grid.
    if HEAD_MAJOR:
        # Launch order goes over heads first: every head's last (under causal masks, longest)
        # query block starts before any head's next one. Better balance under causal masks;
        # fewer programs of one head run together, so K/V tiles are shared less in L2.
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
        pid_bh = tl.program_id(0)
    else:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
        pid_bh = tl.program_id(1)
    batch = pid_bh // q_heads
    head = pid_bh % q_heads
    kv_head = head // kv_group
    q_start, q_len = sequence_bounds(CuSeqlensQ, batch, q_len_dense, IS_VARLEN)
    k_start, k_len = sequence_bounds(CuSeqlensK, batch, k_len_dense, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    diag = 0
    if BOTTOM_RIGHT:
        diag = k_len - q_len

    b64 = batch.to(tl.int64)
    q_base = Q + b64 * stride_qb + head.to(tl.int64) * stride_qh
    k_base = K + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + kv_head.to(tl.int64) * stride_vh
    o_base = Out + b64 * stride_ob + head.to(tl.int64) * stride_oh
    l_base = LSE + b64 * stride_lb + head.to(tl.int64) * stride_lh
    mask_base = Mask + b64 * stride_mb + head.to(tl.int64) * stride_mh
    if IS_VARLEN:
        q_base += q_start.to(tl.int64) * stride_qm
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn
        o_base += q_start.to(tl.int64) * stride_om
        l_base += q_start.to(tl.int64) * stride_lm

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_rows(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], offs_m, q_len, offs_d,
                  HEAD_DIM, BLOCK_D, True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    alibi2 = head_slope(Slopes, b64, stride_sb, head, HAS_ALIBI)

    lo, full_lo, full_hi, hi = key_tile_range(start_m, q_len, k_len, diag, window_left, window_right,
                                              BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    acc, l_i, m_i = fwd_tile_run(acc, l_i, m_i, q, k_base, v_base, mask_base, lo, full_lo,
                                 offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                                 stride_kn, stride_vn, stride_mm, stride_mn, scale_log2,
                                 HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                                 MASK_KIND, DOT_PRECISION, SCALE_POSITIVE, 0, SOFTCAP, HAS_ALIBI, alibi2)
    if USE_TMA:
        acc, l_i, m_i = fwd_tile_run_tma(acc, l_i, m_i, q, KDesc, VDesc, batch, kv_head, full_lo, full_hi, scale_log2,
                                         BLOCK_N, BLOCK_D, DOT_PRECISION, BLOCK_DV)
    else:
        acc, l_i, m_i = fwd_tile_run(acc, l_i, m_i, q, k_base, v_base, mask_base, full_lo, full_hi,
                                     offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left,
                                     window_right, stride_kn, stride_vn, stride_mm, stride_mn, scale_log2,
                                     HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, False, HAS_LEFT, HAS_RIGHT,
                                     MASK_KIND, DOT_PRECISION, SCALE_POSITIVE, EXP_FMA, SOFTCAP, HAS_ALIBI,
                                     alibi2)
    acc, l_i, m_i = fwd_tile_run(acc, l_i, m_i, q, k_base, v_base, mask_base, full_hi, hi,
                                 offs_m, offs_n, offs_d, offs_dv, q_len, k_len, diag, window_left, window_right,
                                 stride_kn, stride_vn, stride_mm, stride_mn, scale_log2,
                                 HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                                 MASK_KIND, DOT_PRECISION, SCALE_POSITIVE, 0, SOFTCAP, HAS_ALIBI, alibi2)

    if HAS_SINKS:
        # The head's sink logit z joins the row's denominator with no value (gpt-oss's s_aux): one
        # more term of the online softmax. A row with every key masked then gives 0 and lse = z.
        z = tl.load(Sinks + head).to(tl.float32) * LOG2E_K
        m_z = tl.maximum(m_i, z)
        alpha = tl.math.exp2(m_i - m_z)
        l_i = l_i * alpha + tl.math.exp2(z - m_z)
        acc = acc * alpha[:, None]
        m_i = m_z
    # A row that saw no key (fully masked) writes 0 and lse = -inf, as SDPA's math path.
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    log2_sum = tl.math.log2(tl.where(seen, l_i, 1.0))
    lse = tl.where(seen, (m_i + log2_sum) * LN2_K, float("-inf"))
    if Out.dtype.element_ty == tl.float32:  # float32 out for half inputs too (the sinks' backward reads it)
        store_rows(o_base + offs_m[:, None] * stride_om + offs_dv[None, :], out, offs_m, q_len, offs_dv,
                   HEAD_DIM_V, BLOCK_DV)
    else:
        store_rows(o_base + offs_m[:, None] * stride_om + offs_dv[None, :],
                   round_to(out, Out.dtype.element_ty, DOT_PRECISION), offs_m, q_len, offs_dv, HEAD_DIM_V, BLOCK_DV)
    tl.store(l_base + offs_m * stride_lm, lse, mask=offs_m < q_len)
    if STORE_STATS:
        s_base = Stats + b64 * stride_lb + head.to(tl.int64) * stride_lh
        if IS_VARLEN:
            s_base += q_start.to(tl.int64) * stride_lm
        tl.store(s_base + offs_m * stride_lm, m_i, mask=offs_m < q_len)
        tl.store(s_base + stride_ls + offs_m * stride_lm, log2_sum, mask=offs_m < q_len)


@triton.jit
def fill_packed_tail(X, start, total, n_cols, stride_r, stride_c, fill, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    """This program's block of rows of X (rows start .. total get `fill`, the rest stay)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = (rows >= start) & (rows < total)
    if tl.max(live.to(tl.int32), 0) > 0:
        cols = tl.arange(0, BLOCK_C)
        base = X + rows.to(tl.int64)[:, None] * stride_r
        for c0 in range(0, n_cols, BLOCK_C):
            at = c0 + cols
            tl.store(base + at.to(tl.int64)[None, :] * stride_c, tl.zeros([BLOCK_R, BLOCK_C], tl.float32) + fill,
                     mask=live[:, None] & (at < n_cols)[None, :])


@triton.jit
def packed_tail_kernel(X0, X1, X2, Cu0, Cu1, Cu2, last,
                       total0, total1, total2, cols0, cols1, cols2,
                       stride_r0, stride_c0, stride_r1, stride_c1, stride_r2, stride_c2, fill0, fill1, fill2,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows Cu[last] .. total of up to three packed tensors (rows past the last sequence, which no
    attention program visits) get their `fill`, one launch for all; grid (cdiv(longest total,
    BLOCK_R), tensors): blocks before Cu[last] do nothing."""
    which = tl.program_id(1)
    if which == 0:
        fill_packed_tail(X0, tl.load(Cu0 + last), total0, cols0, stride_r0, stride_c0, fill0, BLOCK_R, BLOCK_C)
    elif which == 1:
        fill_packed_tail(X1, tl.load(Cu1 + last), total1, cols1, stride_r1, stride_c1, fill1, BLOCK_R, BLOCK_C)
    else:
        fill_packed_tail(X2, tl.load(Cu2 + last), total2, cols2, stride_r2, stride_c2, fill2, BLOCK_R, BLOCK_C)
