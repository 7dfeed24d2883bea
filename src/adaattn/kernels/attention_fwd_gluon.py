"""Exact attention forward for Hopper in Gluon: explicit warp partitions (triton >= 3.6).

The same math and outputs as attention_fwd_ws.py (online softmax in the log2 domain, fp32
accumulation, the natural-log log-sum-exp saved for backward), with the partitions written by
hand instead of left to Triton's automatic warp specialisation:

- two consumer partitions of one warp group each, each owning 64 of the program's 128 query
  rows (its own Q tile), running the same loop without a lock step: while one group's softmax
  runs, the other group's products keep the tensor cores busy;
- inside each group, the QK^T of key tile j is issued before the PV product of tile j - 1, so
  the softmax of tile j runs while that PV product does (FA3's intra-warpgroup overlap);
- a one-warp loader partition: Q once, then K and V tiles by TMA into a ring of STAGES buffers,
  a buffer reused once both consumer groups have released it.

Masks cost only the tiles that need them: the causal diagonal tiles, a key-tail tile and, with a
left window, the tiles at its edge take a select behind a runtime branch, which the automatic
pass does not allow (it selects on every tile); a window's key loop starts at its first visible
tile. Scope as the warp-specialised kernel: dense (B, H, N, D) 16-bit tensors with TMA-aligned
strides, no attn_mask, causal top-left or bottom-right or not, a left window, GQA, HEAD_DIM 64
or 128, a positive scale. Not run by the interpreter: on the CPU the warp-specialised kernel
stands in.

Measured on an H100 (benchmarks/NOTES.md, 2026-11-24, "A Gluon forward"): 2-9% faster than the
warp-specialised kernel at every yardstick shape.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

# triton 3.9 renamed the TMA copies; 3.6 has only the old names.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def load_tiles(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                    batch, head, kv_head, start_m, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    HALF: gl.constexpr, V_T: gl.constexpr = False, lo=0, k_row0=0):
    """Q's two halves once, then the K and V tiles of the key loop, key tiles lo .. lo + n_tiles
    (V_T: V is stored transposed, (B, H, D, N), and its tile is the (D, BLOCK_N) box at key
    (lo + j) * BLOCK_N). k_row0: the row of the sequence's first key (packed sequences)."""
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    _tma_load(q_desc, [batch, head, start_m, 0], q_bar, q_bufs.index(0))
    _tma_load(q_desc, [batch, head, start_m + HALF, 0], q_bar, q_bufs.index(1))
    for j in range(n_tiles):
        s = j % STAGES
        # A fresh mbarrier counts as having completed the phase before 0: the first pass waits on 1.
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        key = k_row0 + (lo + j) * BLOCK_N
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        _tma_load(k_desc, [batch, kv_head, key, 0], k_ready.index(s), k_bufs.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        if V_T:
            _tma_load(v_desc, [batch, kv_head, 0, key], v_ready.index(s), v_bufs.index(s))
        else:
            _tma_load(v_desc, [batch, kv_head, key, 0], v_ready.index(s), v_bufs.index(s))


@gluon.jit
def issue_qk(q, k_bufs, st, s_zero, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr):
    """Issue Q.K^T of the K tile in buffer st (asynchronous; the caller waits on it)."""
    return warpgroup_mma(q, k_bufs.index(st).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero, use_acc=False,
                         is_async=True)


@gluon.jit
def visible(s, j, start_m, diag, k_len, s_layout: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
             CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr = False, left=0):
    """Scores of key tile j with keys past k_len, past each row's last key (causal), and before
    its first (HAS_LEFT: row r's first key is r + diag - left) at -inf."""
    cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    keep = gl.expand_dims(cols < k_len, 0)
    if CAUSAL or HAS_LEFT:
        rows = start_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + diag, 1))
        if HAS_LEFT:
            keep = keep & (gl.expand_dims(cols, 0) >= gl.expand_dims(rows + diag - left, 1))
    return gl.where(keep, s, float("-inf"))


@gluon.jit
def _store_tile(tile, smem, desc, batch, head, row):
    """A tile to global memory by TMA through smem (a buffer whose readers are done); the
    descriptor drops rows past its shape."""
    smem.reshape(tile.shape).store(tile)
    fence_async_shared()
    _tma_store(desc, [batch, head, row, 0], smem)
    tma.store_wait(0)


@gluon.jit
def _consume(q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, o_desc, LSE, lse_off, stride_lm, q_len,
             k_len, start_m, diag, n_tiles, first_masked, scale_log2, batch, head,
             HEAD_DIM: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             CAUSAL: gl.constexpr, GROUP: gl.constexpr, HAS_LEFT: gl.constexpr, lo, edge_end, left,
             VARLEN: gl.constexpr = False, q_row0=0, O=None, o_off=0, stride_om=0):
    """One consumer warp group: rows start_m + GROUP * HALF .. + HALF of the program, over key
    tiles lo .. lo + n_tiles; tiles from first_masked on and before edge_end take the masks.
    VARLEN: the sequence's rows start at q_row0 of the packed tensors, and the rows after its
    last belong to the next sequence: a group whose rows pass q_len stores its output by row
    (O + o_off + row * stride_om, masked), not by TMA."""
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    my_start = start_m + GROUP * HALF

    q_smem = q_bufs.index(GROUP)
    q = q_smem.reshape([HALF, HEAD_DIM])
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([HALF], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([HALF], gl.float32, row_s)
    mbarrier.wait(q_bar, 0)
    if n_tiles > 0:
        mbarrier.wait(k_ready.index(0), 0)
        s = issue_qk(q, k_bufs, 0, s_zero, HEAD_DIM, BLOCK_N)
        s = warpgroup_mma_wait(0, deps=(s, ))
        if (lo >= first_masked) | (lo < edge_end):
            s = visible(s, lo, my_start, diag, k_len, s_layout, HALF, BLOCK_N, CAUSAL, HAS_LEFT, left)
        # A positive scale keeps the argmax: the max is taken on raw scores, scale and shift
        # fold into one FMA per score. A row with no visible key keeps m = -inf and p = 0.
        m_i = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
        m_shift = gl.where(m_i == float("-inf"), 0.0, m_i)
        p = gl.exp2(s * scale_log2 - gl.expand_dims(m_shift, 1))
        l_i = gl.sum(p, 1)
        for j in range(1, n_tiles):
            st = j % STAGES
            pst = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
            mbarrier.wait(v_ready.index(pst), ((j - 1) // STAGES) & 1)
            s_next = issue_qk(q, k_bufs, st, s_zero, HEAD_DIM, BLOCK_N)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, v_bufs.index(pst).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            # wgmma groups retire in order: one left outstanding means QK^T of tile j is done.
            s = warpgroup_mma_wait(1, deps=(s_next, ))
            if (lo + j >= first_masked) | (lo + j < edge_end):
                s = visible(s, lo + j, my_start, diag, k_len, s_layout, HALF, BLOCK_N, CAUSAL, HAS_LEFT, left)
            m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
            m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_shift)
            p = gl.exp2(s * scale_log2 - gl.expand_dims(m_shift, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            # p_op rides through the wait: its registers stay untouched until the product is done.
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            mbarrier.arrive(kv_empty.index(pst), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        last = n_tiles - 1
        lst = last % STAGES
        mbarrier.wait(v_ready.index(lst), (last // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p_op, v_bufs.index(lst).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(kv_empty.index(lst), count=1)
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
    rows = my_start + gl.arange(0, HALF, layout=row_s)
    gl.store(LSE + lse_off + rows.to(gl.int64) * stride_lm, lse, mask=rows < q_len)
    if VARLEN:
        if my_start + HALF > q_len:
            rows_o = my_start + gl.arange(0, HALF, layout=row_o)
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            ptrs = O + o_off + gl.expand_dims(rows_o.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
            gl.store(ptrs, out.to(dtype), mask=gl.expand_dims(rows_o < q_len, 1))
        else:
            _store_tile(out.to(dtype), q_smem, o_desc, batch, head, q_row0 + my_start)
    else:
        _store_tile(out.to(dtype), q_smem, o_desc, batch, head, my_start)


@gluon.jit
def program_tiles(q_heads, kv_group, q_len, k_len, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, HAS_LEFT: gl.constexpr = False, left=0):
    """A program's place on the grid (query blocks, batch * q_heads), last query block first, and
    its key tiles: (batch, head, kv_head, start_m, diag, first_masked, n_tiles, lo, edge_end),
    key tiles lo .. lo + n_tiles. Tiles in [edge_end, first_masked) are visible to every row of
    the program (no select); with a left window (HAS_LEFT), the tiles before edge_end hold keys
    before the last row's first key."""
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    pid_bh = gl.program_id(1)
    head = pid_bh % q_heads
    batch = pid_bh // q_heads
    kv_head = head // kv_group
    start_m = pid_m * BLOCK_M
    diag = 0
    if BOTTOM_RIGHT:
        diag = k_len - q_len
    hi = k_len
    first_masked = k_len // BLOCK_N
    if CAUSAL:
        hi = gl.minimum(k_len, gl.maximum(start_m + BLOCK_M + diag, 0))
        first_masked = gl.minimum(first_masked, gl.maximum(start_m + diag + 1, 0) // BLOCK_N)
    lo = 0
    edge_end = 0
    if HAS_LEFT:
        lo = gl.maximum(start_m + diag - left, 0) // BLOCK_N
        edge_end = gl.cdiv(gl.maximum(start_m + BLOCK_M - 1 + diag - left, 0), BLOCK_N)
    n_tiles = gl.maximum(gl.cdiv(hi, BLOCK_N) - lo, 0)
    return batch, head, kv_head, start_m, diag, first_masked, n_tiles, lo, edge_end


@gluon.jit
def sequence_rows(CuQ, CuK, seq):
    """Packed sequence seq's first row and length, of the queries and of the keys:
    (q_row0, q_len, k_row0, k_len) from the cu_seqlens offsets."""
    q_row0 = gl.load(CuQ + seq)
    k_row0 = gl.load(CuK + seq)
    return q_row0, gl.load(CuQ + seq + 1) - q_row0, k_row0, gl.load(CuK + seq + 1) - k_row0


@gluon.jit
def tile_ring(q_desc, k_desc, v_desc, STAGES: gl.constexpr):
    """Shared memory of a program: Q's two halves, rings of STAGES K and V tiles, and their
    barriers (a K/V buffer is released by both consumer groups)."""
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    return q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty


@gluon.jit
def attention_fwd_gluon_kernel(q_desc, k_desc, v_desc, o_desc, LSE, stride_lb, stride_lh, stride_lm,
                               q_heads, kv_group, q_len, k_len, scale_log2, window_left,
                               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               STAGES: gl.constexpr, CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
                               HAS_LEFT: gl.constexpr = False, VARLEN: gl.constexpr = False, CuQ=None, CuK=None,
                               O=None, stride_om=0, stride_oh=0):
    """Grid (query blocks, batch * q_heads), last query block first; launched with num_warps=4
    (the first consumer group; the second and the loader are worker partitions). Descriptors
    (host, 4-D over (B, H, N, D)): Q and Out with (1, 1, BLOCK_M // 2, HEAD_DIM) boxes, K and V
    with (1, 1, BLOCK_N, HEAD_DIM). HAS_LEFT: a left window of window_left keys (row r sees keys
    from r + diag - window_left).

    VARLEN: packed sequences, "batch" the sequence: the descriptors are over (1, H, T, D) views of
    the packed (T, H, D) tensors, sequence b's rows CuQ[b] .. CuQ[b + 1] (keys: CuK), q_len and
    k_len the longest sequence's (the grid's); the output O (T, Hq, D) with row and head strides
    for the stores by row at a sequence's end, and the log-sum-exp (Hq, T)."""
    HALF: gl.constexpr = BLOCK_M // 2
    q_row0 = 0
    k_row0 = 0
    desc_b = gl.program_id(1) // q_heads
    if VARLEN:
        q_row0, q_len, k_row0, k_len = sequence_rows(CuQ, CuK, desc_b)
        desc_b = 0
    batch, head, kv_head, start_m, diag, first_masked, n_tiles, lo, edge_end = program_tiles(
        q_heads, kv_group, q_len, k_len, BLOCK_M, BLOCK_N, CAUSAL, BOTTOM_RIGHT, HAS_LEFT, window_left)
    lse_off = batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh
    o_off = 0
    if VARLEN:
        # A block past its sequence's end does no work and stores nothing.
        n_tiles = gl.where(start_m < q_len, n_tiles, 0)
        lse_off += q_row0.to(gl.int64) * stride_lm
        o_off = q_row0.to(gl.int64) * stride_om + head.to(gl.int64) * stride_oh
    q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty = tile_ring(q_desc, k_desc, v_desc, STAGES)

    gl.warp_specialize([
        (_consume, (q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, o_desc, LSE, lse_off, stride_lm,
                    q_len, k_len, start_m, diag, n_tiles, first_masked, scale_log2, desc_b, head, HEAD_DIM, HALF,
                    BLOCK_N, STAGES, CAUSAL, 0, HAS_LEFT, lo, edge_end, window_left, VARLEN, q_row0, O, o_off,
                    stride_om)),
        (_consume, (q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, o_desc, LSE, lse_off, stride_lm,
                    q_len, k_len, start_m, diag, n_tiles, first_masked, scale_log2, desc_b, head, HEAD_DIM, HALF,
                    BLOCK_N, STAGES, CAUSAL, 1, HAS_LEFT, lo, edge_end, window_left, VARLEN, q_row0, O, o_off,
                    stride_om)),
        (load_tiles, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, desc_b,
                      head, kv_head, q_row0 + start_m, n_tiles, BLOCK_N, STAGES, HALF, False, lo, k_row0)),
    ], [4, 1], [240, 24])
