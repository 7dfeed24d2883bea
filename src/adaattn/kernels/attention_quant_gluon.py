"""The fp8 level's forward for Hopper in Gluon: the math of attention_fp8_ws_kernel
(kernels/attention_quant_ws.py) on the partitions of the Gluon exact forward
(kernels/attention_fwd_gluon.py).

Math (adaptive/quant_reference.py simulates it in float64): Q per row and K per block of BLOCK_N
keys in E4M3 (the pre-pass's outputs, K smoothed by its mean), Q.K^T in FP8 on the tensor cores;
P scaled into E4M3's range by folding log2(448) into the subtracted max and rounded to E4M3; V
smoothed by its mean, E4M3 with one scale per key block, stored transposed (D, N) as the FP8
product needs it. Each tile's P.V product starts from zero and is added in fp32: Hopper's FP8
product keeps about 14 bits when it adds into its accumulator, and accumulating the whole key
loop there measured 2.5x the error at 16k keys (0.133 against 0.054 on random inputs, H100;
benchmarks/NOTES.md, "An FP8 Gluon forward"), though 10% faster with 256-key tiles.

Partitions: two consumer warp groups of 64 query rows each, out of step; in each, the Q.K^T of
tile j is issued before the P.V of tile j - 1, so the softmax of tile j runs under that product;
P goes to the product through a shared buffer per group (an FP8 register operand cannot be held
through the wait on the product in triton 3.6/3.9); a one-warp TMA loader. Masks cost only the
tiles that need them (causal diagonal, key tail), where the Triton warp-specialised kernel selects
on every tile (so causal calls ran the general kernel). Scope: dense, no attn_mask, no window,
causal top-left or bottom-right, GQA, HEAD_DIM 64 or 128, positive scale, bf16/fp16 output; no
log-sum-exp (forward only, as the Triton kernel). Not run by the interpreter.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from .attention_fwd_gluon import _tma_store, issue_qk, load_tiles, program_tiles, tile_ring, visible

# A barrier of the partition's warps: gl.thread_barrier in triton 3.6, gl.barrier in 3.9.
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

LOG2_FP8_MAX = gl.constexpr(8.807354922057604)  # log2(448)
# The smallest normal fp32: a row's score scale (Q row scale x K block scale x softmax scale)
# held above it, so a masked score (-inf) times the scale stays -inf where both scales are tiny.
TINY = gl.constexpr(1.1754943508222875e-38)


@gluon.jit
def _scores(s, j, my_start, diag, k_len, first_masked, q_scale, ks_base, m_i, s_layout: gl.constexpr,
            HALF: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Tile j's softmax step: (p, alpha, m_new), p scaled by 448 (in E4M3's range)."""
    if j >= first_masked:
        s = visible(s, j, my_start, diag, k_len, s_layout, HALF, BLOCK_N, CAUSAL)
    rs = gl.maximum(q_scale * gl.load(ks_base + j), TINY)
    m_new = gl.maximum(m_i, gl.max(s, 1) * rs)
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_shift)
    p = gl.exp2(s * gl.expand_dims(rs, 1) - gl.expand_dims(m_shift - LOG2_FP8_MAX, 1))
    return p, alpha, m_new


@gluon.jit
def _stage_p(p, p_smem):
    """P of a tile, in E4M3, into this group's shared buffer for the P.V product (an FP8 register
    operand cannot ride through the wait on that product, which keeps its registers reserved)."""
    p_smem.store(p.to(gl.float8e4nv))
    fence_async_shared()
    _barrier()


@gluon.jit
def _consume_fp8(q_bufs, k_bufs, v_bufs, o_bufs, p_bufs, q_bar, k_ready, v_ready, kv_empty, o_desc, QScale, q_row0,
                 KScale, VScale, VMean, scale_row, stat, q_len, k_len, start_m, diag, n_tiles, first_masked,
                 scale_log2, batch, head, HEAD_DIM: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, CAUSAL: gl.constexpr, GROUP: gl.constexpr):
    """One consumer warp group: rows start_m + GROUP * HALF .. + HALF of the program.

    Each tile's P.V product starts from zero and is added to acc in fp32: acc is kept in units of
    the V scale of the last tile added and relative to that tile's max, so adding the product of
    tile j - 1 (known after the softmax of tile j was started) is one FMA per element with the
    rescale alpha_{j-1} * vs_{j-2} / vs_{j-1}."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    my_start = start_m + GROUP * HALF
    ks_base = KScale + scale_row
    vs_base = VScale + scale_row
    p_smem = p_bufs.index(GROUP)

    rows = my_start + gl.arange(0, HALF, layout=row_s)
    q_scale = gl.load(QScale + q_row0 + rows, mask=rows < q_len, other=1.0) * scale_log2
    q = q_bufs.index(GROUP).reshape([HALF, HEAD_DIM])
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
    o_zero = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([HALF], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([HALF], gl.float32, row_s)
    vs_prev = gl.load(vs_base)  # any value while acc is zero (n_blocks >= 1)
    mbarrier.wait(q_bar, 0)
    if n_tiles > 0:
        mbarrier.wait(k_ready.index(0), 0)
        s = issue_qk(q, k_bufs, 0, s_zero, HEAD_DIM, BLOCK_N)
        s = warpgroup_mma_wait(0, deps=(s, ))
        p, alpha, m_i = _scores(s, 0, my_start, diag, k_len, first_masked, q_scale, ks_base, m_i, s_layout, HALF,
                                BLOCK_N, CAUSAL)
        l_i = gl.sum(p, 1)
        _stage_p(p, p_smem)
        alpha_prev = gl.convert_layout(alpha, row_o)  # the rescale of the product added next
        for j in range(1, n_tiles):
            st = j % STAGES
            pst = (j - 1) % STAGES
            vs = gl.load(vs_base + j - 1)
            mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
            mbarrier.wait(v_ready.index(pst), ((j - 1) // STAGES) & 1)
            s_next = issue_qk(q, k_bufs, st, s_zero, HEAD_DIM, BLOCK_N)
            pv = warpgroup_mma(p_smem, v_bufs.index(pst).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0)), o_zero,
                               use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_next, ))
            p, alpha, m_new = _scores(s, j, my_start, diag, k_len, first_masked, q_scale, ks_base, m_i, s_layout,
                                      HALF, BLOCK_N, CAUSAL)
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            p8 = p.to(gl.float8e4nv)
            pv = warpgroup_mma_wait(0, deps=(pv, ))
            mbarrier.arrive(kv_empty.index(pst), count=1)
            _stage_p(p8, p_smem)  # the product that read the previous P is done
            acc = acc * gl.expand_dims(alpha_prev * (vs_prev / vs), 1) + pv
            vs_prev = vs
            alpha_prev = gl.convert_layout(alpha, row_o)
        last = n_tiles - 1
        lst = last % STAGES
        vs = gl.load(vs_base + last)
        mbarrier.wait(v_ready.index(lst), (last // STAGES) & 1)
        pv = warpgroup_mma(p_smem, v_bufs.index(lst).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0)), o_zero,
                           use_acc=False, is_async=True)
        pv = warpgroup_mma_wait(0, deps=(pv, ))
        mbarrier.arrive(kv_empty.index(lst), count=1)
        acc = acc * gl.expand_dims(alpha_prev * (vs_prev / vs), 1) + pv
        vs_prev = vs
    seen = gl.convert_layout(l_i > 0.0, row_o)
    factor = vs_prev / gl.where(seen, gl.convert_layout(l_i, row_o), 1.0)
    v_mean = gl.load(VMean + stat + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout)))
    out = acc * gl.expand_dims(factor, 1) + gl.expand_dims(v_mean, 0)
    out = gl.where(gl.expand_dims(seen, 1), out, 0.0)
    # The output leaves through smem by TMA (the descriptor drops rows past q_len); Q's buffer is
    # FP8 and half the size, so the output has its own.
    o_smem = o_bufs.index(GROUP)
    o_smem.reshape([HALF, HEAD_DIM]).store(out.to(o_desc.dtype))
    fence_async_shared()
    _tma_store(o_desc, [batch, head, my_start, 0], o_smem)
    tma.store_wait(0)


@gluon.jit
def attention_fp8_gluon_kernel(q_desc, k_desc, v_desc, o_desc, QScale, KScale, VScale, VMean,
                               q_heads, kv_group, q_len, q_pitch, k_len, n_blocks, scale_log2,
                               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               STAGES: gl.constexpr, CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr):
    """Grid (query blocks, batch * q_heads), last query block first; num_warps=4. Descriptors
    (host, 4-D): q_desc over the pre-pass's E4M3 Q (B, Hq, Nq, D), box (1, 1, BLOCK_M // 2, D);
    k_desc over its E4M3 K (B, Hkv, Npad, D), box (1, 1, BLOCK_N, D); v_desc over its transposed
    E4M3 V (B, Hkv, D, Npad), box (1, 1, D, BLOCK_N); o_desc over Out (B, Hq, Nq, D), box
    (1, 1, BLOCK_M // 2, D). QScale (B * Hq, q_pitch), KScale and VScale (B, Hkv, n_blocks),
    VMean (B, Hkv, D), all fp32. BLOCK_N is the pre-pass's key block."""
    HALF: gl.constexpr = BLOCK_M // 2
    batch, head, kv_head, start_m, diag, first_masked, n_tiles, _lo, _edge = program_tiles(
        q_heads, kv_group, q_len, k_len, BLOCK_M, BLOCK_N, CAUSAL, BOTTOM_RIGHT)
    q_row0 = (batch * q_heads + head).to(gl.int64) * q_pitch
    kv_row = batch.to(gl.int64) * (q_heads // kv_group) + kv_head
    scale_row = kv_row * n_blocks
    stat = kv_row * HEAD_DIM
    q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty = tile_ring(q_desc, k_desc, v_desc, STAGES)
    o_bufs = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)
    p_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M // 2, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, BLOCK_N], gl.float8e4nv))

    gl.warp_specialize([
        (_consume_fp8, (q_bufs, k_bufs, v_bufs, o_bufs, p_bufs, q_bar, k_ready, v_ready, kv_empty, o_desc, QScale,
                        q_row0, KScale, VScale, VMean, scale_row, stat, q_len, k_len, start_m, diag, n_tiles,
                        first_masked, scale_log2, batch, head, HEAD_DIM, HALF, BLOCK_N, STAGES, CAUSAL, 0)),
        (_consume_fp8, (q_bufs, k_bufs, v_bufs, o_bufs, p_bufs, q_bar, k_ready, v_ready, kv_empty, o_desc, QScale,
                        q_row0, KScale, VScale, VMean, scale_row, stat, q_len, k_len, start_m, diag, n_tiles,
                        first_masked, scale_log2, batch, head, HEAD_DIM, HALF, BLOCK_N, STAGES, CAUSAL, 1)),
        (load_tiles, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, batch,
                      head, kv_head, start_m, n_tiles, BLOCK_N, STAGES, HALF, True)),
    ], [4, 1], [240, 24])
