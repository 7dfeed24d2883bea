"""Exact attention backward for Hopper in Gluon: dk/dv per key block with dq added by TMA reductions.

The math of attention_bwd_ws.py (probabilities recomputed from the log2-domain log-sum-exp of the
prep kernel's planes, ds at the ds scale, fp32 accumulation), in FA3's work split: one program owns
BLOCK_N keys of one KV head and walks every query tile (of every query head of its GQA group) that
can see them. Per tile it makes five products, where the two-pass backward makes seven:

    S^T = K Q^T, dP^T = V dO^T             (keys as the M rows)
    P^T = exp2(S^T * scale_log2 - lse2),   dS^T = P^T * (dP^T - delta) * ds_scale
    dV += P^T dO, dK += dS^T Q             (registers as the A operand)
    dQ_part = dS K                         (dS^T through shared memory, read transposed)

and adds dQ_part (fp32) into a (B, Hq, Nq, D) fp32 accumulator with a TMA reduce-add. The
accumulator's bits depend on the order the additions land in, so this kernel serves the default
backward, never a deterministic one (that runs attention_bwd_ws.py).

Partitions: two consumer warp groups, each owning BLOCK_N // 2 of the program's keys (its own K
and V halves, its own dK and dV, its own dQ part, so the groups never wait on each other), out of
step so one group's exponentials run under the other's products; and a one-warp TMA loader: K and
V once, then Q and dO tiles into a ring of STAGES buffers, a buffer reused once both groups have
released it. Masks (causal diagonal, window edge) cost only the tiles whose keys some query of the
tile cannot see: a runtime branch per tile, which the automatic pass does not allow.

Scope as attention_bwd_ws.py's dense path: dense (B, H, N, D) 16-bit tensors with TMA-aligned
strides, no attn_mask, causal (top-left or bottom-right) or not, a left window under causal, GQA,
HEAD_DIM 64 or 128, a positive scale. Not run by the interpreter (tests compile it for sm90 on the
CPU and check it against float64 on the GPU).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .attention_fwd_gluon import _tma_load, _tma_store, sequence_rows

# A barrier of the partition's warps: gl.thread_barrier in triton 3.6, gl.barrier in 3.9.
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@builtin
def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of a shared buffer into global memory, for triton 3.6, whose Gluon has the
    builder's op but no wrapper (3.9 has tma.async_atomic_add)."""
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


_tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36


@gluon.jit
def _load_bwd(q_desc, do_desc, k_desc, v_desc, stat_desc, k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, delta_bufs,
              kv_bar, q_ready, do_ready, qdo_empty, batch, kv_head, kv_group, q_heads, q_pitch, stat_plane, start_n, lo,
              n_tiles, BLOCK_M: gl.constexpr, HALF: gl.constexpr, STAGES: gl.constexpr, desc_b, q_row0, k_row0):
    """K and V halves once, then the Q and dO tiles of the loop, each with its rows' statistics
    (lse2 with Q, delta with dO). Descriptor coordinates: desc_b, and rows from q_row0 / k_row0
    (a packed sequence's first row; 0 for dense tensors)."""
    mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    for half in gl.static_range(2):
        _tma_load(k_desc, [desc_b, kv_head, k_row0 + start_n + half * HALF, 0], kv_bar, k_bufs.index(half))
        _tma_load(v_desc, [desc_b, kv_head, k_row0 + start_n + half * HALF, 0], kv_bar, v_bufs.index(half))
    for t in range(kv_group * n_tiles):
        g = t // n_tiles
        start_m = lo + (t - g * n_tiles) * BLOCK_M
        head = kv_head * kv_group + g
        s = t % STAGES
        # A fresh mbarrier counts as having completed the phase before 0: the first pass waits on 1.
        mbarrier.wait(qdo_empty.index(s), ((t // STAGES) & 1) ^ 1)
        row = (batch * q_heads + head) * q_pitch + start_m
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + stat_desc.block_type.nbytes)
        _tma_load(q_desc, [desc_b, head, q_row0 + start_m, 0], q_ready.index(s), q_bufs.index(s))
        _tma_load(stat_desc, [row], q_ready.index(s), lse_bufs.index(s))
        mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + stat_desc.block_type.nbytes)
        _tma_load(do_desc, [desc_b, head, q_row0 + start_m, 0], do_ready.index(s), do_bufs.index(s))
        _tma_load(stat_desc, [stat_plane + row], do_ready.index(s), delta_bufs.index(s))


@gluon.jit
def _store_dkdv(dk, dv, post_scale, k_smem, v_smem, k_bufs, v_bufs, dk_desc, dv_desc, batch, kv_head, row,
                GROUP: gl.constexpr):
    """dK and dV leave through this group's K and V buffers (every product that read them is
    done); the descriptors drop keys past a dense k_len."""
    dtype: gl.constexpr = k_smem.dtype
    k_smem.store((dk * post_scale).to(dtype))
    v_smem.store(dv.to(dtype))
    fence_async_shared()
    _barrier()
    _tma_store(dk_desc, [batch, kv_head, row, 0], k_bufs.index(GROUP))
    _tma_store(dv_desc, [batch, kv_head, row, 0], v_bufs.index(GROUP))
    tma.store_wait(0)


@gluon.jit
def _consume_bwd(k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, p_bufs, dq_bufs, kv_bar, q_ready,
                 do_ready, qdo_empty, dk_desc, dv_desc, dq_desc, batch, kv_head, kv_group, start_n, diag, lo, n_tiles,
                 scale, scale_log2, window_left, post_scale,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, HALF: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, DQ_SPLIT: gl.constexpr, P_SMEM: gl.constexpr,
                 GROUP: gl.constexpr, VARLEN: gl.constexpr, k_len, q_row0, k_row0, DK, DV, stride_dkn, stride_dkh,
                 stride_dvn, stride_dvh):
    """One consumer warp group: keys start_n + GROUP * HALF .. + HALF of the program.

    VARLEN: a packed sequence from rows q_row0 (queries) and k_row0 (keys); the rows after its
    last belong to the next sequence. Its keys past k_len are masked (their rows hold the next
    sequence's keys), query rows past its end have p = 0 from their statistics (so they add
    exact zeros into dq), and a group whose keys pass k_len stores dK and dV by row
    (DK + (k_row0 + key) * stride_dkn + kv_head * stride_dkh, masked), not by TMA: the offsets
    are made there, not before the loop, where they held registers the loop spilled."""
    dtype: gl.constexpr = q_bufs.dtype
    # S^T and dP^T tiles: (HALF keys, BLOCK_M queries); dK, dV: (HALF, D); the dQ part: (BLOCK_M, D).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    my_n = start_n + GROUP * HALF

    k_smem = k_bufs.index(GROUP).reshape([HALF, HEAD_DIM])
    v_smem = v_bufs.index(GROUP).reshape([HALF, HEAD_DIM])
    ds_smem = ds_bufs.index(GROUP)
    p_smem = p_bufs.index(GROUP)
    dq_smem = dq_bufs.index(GROUP)
    s_zero = gl.zeros([HALF, BLOCK_M], gl.float32, s_layout)
    DQ_COLS: gl.constexpr = HEAD_DIM // DQ_SPLIT
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    dk = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    keys = my_n + gl.arange(0, HALF, layout=row_s)
    mbarrier.wait(kv_bar, 0)
    for t in range(kv_group * n_tiles):
        g = t // n_tiles
        start_m = lo + (t - g * n_tiles) * BLOCK_M
        head = kv_head * kv_group + g
        st = t % STAGES
        ph = (t // STAGES) & 1
        mbarrier.wait(q_ready.index(st), ph)
        q_smem = q_bufs.index(st).reshape([BLOCK_M, HEAD_DIM])
        s_t = warpgroup_mma(k_smem, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(st), ph)
        do_smem = do_bufs.index(st).reshape([BLOCK_M, HEAD_DIM])
        dp_t = warpgroup_mma(v_smem, do_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # Rows past q_len have lse2 = +inf and delta = 0 in the planes (p = 0 there).
        lse2 = lse_bufs.index(st).load(col_s)
        s_t = warpgroup_mma_wait(1, deps=(s_t, ))
        s_t = s_t * scale_log2
        # Some query of the tile does not see some key of this group: before the diagonal, or past
        # the window's left edge.
        need = start_m < 0
        if VARLEN:
            need = need | (my_n + HALF > k_len)
        if CAUSAL:
            need = need | (start_m + diag < my_n + HALF - 1)
        if HAS_LEFT:
            need = need | (start_m + BLOCK_M - 1 + diag - my_n > window_left)
        if need:
            q_pos = gl.expand_dims(start_m + diag + gl.arange(0, BLOCK_M, layout=col_s), 0)
            k_pos = gl.expand_dims(keys, 1)
            if CAUSAL:
                keep = q_pos >= k_pos
                if VARLEN:
                    keep = keep & (k_pos < k_len)
            else:  # VARLEN (need holds only for it when not causal): keys within the sequence
                keep = k_pos < k_len
            if HAS_LEFT:
                keep = keep & (q_pos - k_pos <= window_left)
            s_t = gl.where(keep, s_t, float("-inf"))
        p_t = gl.exp2(s_t - gl.expand_dims(lse2, 0))
        delta = delta_bufs.index(st).load(col_s)
        if P_SMEM:
            # P^T through this group's shared buffer: its registers are free while dV's product runs.
            p_smem.store(p_t.to(dtype))
            fence_async_shared()
            _barrier()
            dv = warpgroup_mma(p_smem, do_smem, dv, is_async=True)
        else:
            p_op = gl.convert_layout(p_t.to(dtype), a_layout)
            dv = warpgroup_mma(p_op, do_smem, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
        ds = (p_t * (dp_t - gl.expand_dims(delta, 0)) * scale).to(dtype)
        # dS^T goes through this group's shared buffer: the A operand of dK += dS^T Q as it is, and
        # read transposed, of dQ_part = dS K.
        tma.store_wait(0)  # the previous tile's reduction has read the dQ buffer
        ds_smem.store(ds)
        fence_async_shared()
        _barrier()
        dk = warpgroup_mma(ds_smem, q_smem, dk, is_async=True)
        for c in gl.static_range(DQ_SPLIT):
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem.slice(c * DQ_COLS, DQ_COLS, 1), dq_zero,
                               use_acc=False, is_async=True)
            if c == DQ_SPLIT - 1:
                if P_SMEM:
                    dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
                else:  # P's registers stay reserved until dV's product is done
                    dv, dk, dq, p_op = warpgroup_mma_wait(0, deps=(dv, dk, dq, p_op))
                mbarrier.arrive(qdo_empty.index(st), count=1)
            else:
                dq = warpgroup_mma_wait(0, deps=(dq, ))
            dq_smem.reshape([BLOCK_M, HEAD_DIM]).slice(c * DQ_COLS, DQ_COLS, 1).store(dq)
        fence_async_shared()
        _barrier()
        _tma_reduce_add(dq_desc, [batch, head, q_row0 + start_m, 0], dq_smem)
    tma.store_wait(0)
    if VARLEN:
        if my_n + HALF > k_len:  # the sequence's last keys: the next sequence's rows follow
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
            rows = my_n + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
            inside = gl.expand_dims(rows < k_len, 1)
            rows64 = gl.expand_dims(rows.to(gl.int64), 1)
            dk_off = k_row0.to(gl.int64) * stride_dkn + kv_head.to(gl.int64) * stride_dkh
            dv_off = k_row0.to(gl.int64) * stride_dvn + kv_head.to(gl.int64) * stride_dvh
            gl.store(DK + dk_off + rows64 * stride_dkn + gl.expand_dims(cols, 0), (dk * post_scale).to(dtype),
                     mask=inside)
            gl.store(DV + dv_off + rows64 * stride_dvn + gl.expand_dims(cols, 0), dv.to(dtype), mask=inside)
        else:
            _store_dkdv(dk, dv, post_scale, k_smem, v_smem, k_bufs, v_bufs, dk_desc, dv_desc, batch, kv_head,
                        k_row0 + my_n, GROUP)
    else:
        _store_dkdv(dk, dv, post_scale, k_smem, v_smem, k_bufs, v_bufs, dk_desc, dv_desc, batch, kv_head, my_n,
                    GROUP)


@gluon.jit
def attention_bwd_gluon_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dq_desc, stat_desc,
                               kv_heads, kv_group, q_len, k_len, q_pitch, stat_plane, scale, scale_log2, window_left,
                               post_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               STAGES: gl.constexpr, CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
                               HAS_LEFT: gl.constexpr, DQ_SPLIT: gl.constexpr = 1,
                               P_SMEM: gl.constexpr = True, VARLEN: gl.constexpr = False, CuQ=None, CuK=None,
                               DK=None, DV=None, stride_dkn=0, stride_dkh=0, stride_dvn=0, stride_dvh=0):
    """Grid (key blocks, batch * kv_heads); num_warps=4 (the first consumer group; the second and
    the loader are worker partitions). Descriptors (host, 4-D over (B, H, N, D)): Q and dO with
    (1, 1, BLOCK_M, D) boxes; K, V, dK and dV with (1, 1, BLOCK_N // 2, D); dq_desc over the fp32
    accumulator (B, Hq, Nq, D), zeroed, box (1, 1, BLOCK_M, D); stat_desc over the prep kernel's
    flat planes (attention_bwd_ws_prep_kernel, q_pitch a multiple of BLOCK_M), box (BLOCK_M,). dK
    is multiplied by post_scale here; the accumulator is left at the ds scale.

    VARLEN: packed sequences, "batch" the sequence: the descriptors are over (1, H, T, D) views of
    the packed (T, H, D) tensors (the accumulator's too), sequence b's rows CuQ[b] .. CuQ[b + 1]
    (keys: CuK), q_len and k_len the longest sequence's (the grid's); the planes are per
    (sequence, head) as the prep kernel lays them out for packed calls. dK and dV (T, Hkv, D) with
    row and head strides, for the stores by row at a sequence's end."""
    HALF: gl.constexpr = BLOCK_N // 2
    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    batch = pid_bh // kv_heads
    kv_head = pid_bh % kv_heads
    q_heads = kv_heads * kv_group
    start_n = pid_n * BLOCK_N
    desc_b = batch
    q_row0 = 0
    k_row0 = 0
    if VARLEN:
        q_row0, q_len, k_row0, k_len = sequence_rows(CuQ, CuK, batch)
        desc_b = 0
    diag = 0
    if BOTTOM_RIGHT:
        diag = k_len - q_len
    # The query rows that can see keys [start_n, start_n + BLOCK_N): [lo, hi), lo a tile start.
    lo = 0
    hi = q_len
    if CAUSAL:
        lo = (gl.minimum(gl.maximum(start_n - diag, 0), q_len) // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = gl.minimum(q_len, gl.maximum(start_n + BLOCK_N + window_left - diag, 0))
    hi = gl.maximum(hi, lo)
    n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    if VARLEN:  # a block past its sequence's last key does no work and stores nothing
        n_tiles = gl.where(start_n < k_len, n_tiles, 0)

    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, HALF, BLOCK_M],
                                        gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_M], q_desc.dtype))
    lse_bufs = gl.allocate_shared_memory(stat_desc.dtype, [STAGES] + stat_desc.block_type.shape, stat_desc.layout)
    delta_bufs = gl.allocate_shared_memory(stat_desc.dtype, [STAGES] + stat_desc.block_type.shape, stat_desc.layout)
    p_bufs = gl.allocate_shared_memory(q_desc.dtype, [2 if P_SMEM else 1, HALF, BLOCK_M],
                                       gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_M], q_desc.dtype))
    dq_bufs = gl.allocate_shared_memory(dq_desc.dtype, [2] + dq_desc.block_type.shape, dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=2)

    # (Each consumer's arguments in full: a tuple built from a shared one would lose the constexprs.)
    gl.warp_specialize([
        (_consume_bwd, (k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, p_bufs, dq_bufs, kv_bar,
                        q_ready, do_ready, qdo_empty, dk_desc, dv_desc, dq_desc, desc_b, kv_head, kv_group, start_n,
                        diag, lo, n_tiles, scale, scale_log2, window_left, post_scale, HEAD_DIM, BLOCK_M, HALF,
                        STAGES, CAUSAL, HAS_LEFT, DQ_SPLIT, P_SMEM, 0, VARLEN, k_len, q_row0, k_row0, DK, DV,
                        stride_dkn, stride_dkh, stride_dvn, stride_dvh)),
        (_consume_bwd, (k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, p_bufs, dq_bufs, kv_bar,
                        q_ready, do_ready, qdo_empty, dk_desc, dv_desc, dq_desc, desc_b, kv_head, kv_group, start_n,
                        diag, lo, n_tiles, scale, scale_log2, window_left, post_scale, HEAD_DIM, BLOCK_M, HALF,
                        STAGES, CAUSAL, HAS_LEFT, DQ_SPLIT, P_SMEM, 1, VARLEN, k_len, q_row0, k_row0, DK, DV,
                        stride_dkn, stride_dkh, stride_dvn, stride_dvh)),
        (_load_bwd, (q_desc, do_desc, k_desc, v_desc, stat_desc, k_bufs, v_bufs, q_bufs, do_bufs, lse_bufs,
                     delta_bufs, kv_bar, q_ready, do_ready, qdo_empty, batch, kv_head, kv_group, q_heads, q_pitch,
                     stat_plane, start_n, lo, n_tiles, BLOCK_M, HALF, STAGES, desc_b, q_row0, k_row0)),
    ], [4, 1], [240, 24])
