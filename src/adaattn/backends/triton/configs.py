"""Kernel configs of our exact Triton attention: the candidate tables per kernel and head-dim
class, and the shared-memory model that keeps only those that fit the device (fitting_configs).
A config itself is common.KernelConfig; the shape buckets configs are tuned on are
common.length_bucket."""

from __future__ import annotations

import torch

from ... import hardware
from .common import KernelConfig

# One small config for the CPU interpreter: BLOCK_M != BLOCK_N exercises the tile ranges.
INTERPRET_CONFIGS = {
    "fwd": KernelConfig(32, 16, 1, 1),
    "fwd_ws": KernelConfig(32, 16, 1, 1),
    "dkdv": KernelConfig(16, 32, 1, 1),
    "dkdv_atomic": KernelConfig(16, 32, 1, 1),
    "dq": KernelConfig(32, 16, 1, 1),
    "dkdv_ws": KernelConfig(16, 32, 1, 1),
    "dq_ws": KernelConfig(32, 16, 1, 1),
    "delta": KernelConfig(32, 32, 1, 1),
}

# Candidates for Hopper (H100/H200), each kept only where its shared memory fits the device;
# the first fitting one runs when nothing is timed. From sm90 compiles of these kernels
# (triton 3.9, cuobjdump -res-usage): every first candidate compiles without register
# spills; the others are alternatives for the timing to judge.
HALF_CONFIGS = {
    "fwd": {
        "small_d": [KernelConfig(128, 64, 4, 3), KernelConfig(128, 128, 8, 3), KernelConfig(128, 64, 8, 4),
                    KernelConfig(64, 64, 4, 3)],
        # H100, D=128: 128/128/8/3 fastest at three of the four yardstick shapes (variants run).
        "mid_d": [KernelConfig(128, 128, 8, 3), KernelConfig(128, 64, 8, 3), KernelConfig(128, 128, 8, 2),
                  KernelConfig(128, 64, 8, 4), KernelConfig(64, 64, 4, 3)],
        "large_d": [KernelConfig(128, 32, 8, 2), KernelConfig(128, 64, 8, 2), KernelConfig(64, 32, 4, 3),
                    KernelConfig(64, 32, 4, 2)],
    },
    # The warp-specialised forward (kernels/attention_fwd_ws.py): num_warps is per warp group
    # (two consumer groups and a producer run, 3 x num_warps warps). Only HEAD_DIM 64/128.
    "fwd_ws": {
        "small_d": [KernelConfig(128, 128, 4, 2), KernelConfig(128, 64, 4, 2)],
        "mid_d": [KernelConfig(128, 128, 4, 2), KernelConfig(128, 64, 4, 2)],
        "large_d": [KernelConfig(128, 64, 4, 2)],
    },
    # The Gluon forward (kernels/attention_fwd_gluon.py), tried first where it runs: num_warps is
    # per consumer group (two groups of 64 rows and a one-warp loader). H100 probe
    # (benchmarks/NOTES.md, "A Gluon forward"): BN128/s2 fastest not causal and under GQA at
    # D=128, BN64/s3 on causal calls; BN128/s3 at D=64. 128/128/s3 at D=128 needs 229 KB.
    "fwd_gluon": {
        "small_d": [KernelConfig(128, 128, 4, 3, "gluon"), KernelConfig(128, 128, 4, 2, "gluon")],
        "mid_d": [KernelConfig(128, 128, 4, 2, "gluon"), KernelConfig(128, 64, 4, 3, "gluon")],
        "large_d": [],
    },
    # The Gluon backward (kernels/attention_bwd_gluon.py), timed beside the warp-specialised
    # pair (BWD_WS_PAIR) for calls that may add dq atomically: 64 query rows a tile, 128 keys a
    # program (64 per consumer group). 231 KB of shared memory at D=128 (P and dS through it).
    "bwd_gluon": {
        "small_d": [KernelConfig(64, 128, 4, 2, "gluon")],
        "mid_d": [KernelConfig(64, 128, 4, 2, "gluon")],
        "large_d": [],
    },
    # dk/dv accumulators live in registers all along: small query tiles keep them there.
    "dkdv": {
        "small_d": [KernelConfig(32, 128, 8, 2), KernelConfig(64, 128, 8, 2), KernelConfig(32, 64, 4, 2)],
        "mid_d": [KernelConfig(16, 128, 8, 2), KernelConfig(32, 128, 8, 2), KernelConfig(32, 128, 8, 1),
                  KernelConfig(32, 64, 4, 1)],
        # Every wgmma config spills at head_dim 256; the mma.sync one below does not.
        "large_d": [KernelConfig(16, 32, 4, 1), KernelConfig(16, 64, 8, 1), KernelConfig(16, 32, 4, 2)],
    },
    # The dk/dv pass with dq added atomically: one product more per tile (ds^T k).
    "dkdv_atomic": {
        "small_d": [KernelConfig(32, 128, 8, 2), KernelConfig(64, 128, 8, 2), KernelConfig(32, 64, 4, 2)],
        # H100, D=128: 64/128/8/2 fastest at all four yardstick shapes (variants run).
        "mid_d": [KernelConfig(64, 128, 8, 2), KernelConfig(32, 128, 8, 2), KernelConfig(16, 128, 8, 2),
                  KernelConfig(32, 64, 4, 2)],
        # 16/64/8/1 is left out: on the H100 (triton 3.6) it raised an illegal memory access at
        # head dims 256/256, 192/128, 128/256 and 256/128 (the dkdv kernel without atomics runs it).
        "large_d": [KernelConfig(16, 32, 4, 1), KernelConfig(16, 32, 4, 2)],
    },
    "dq": {
        "small_d": [KernelConfig(128, 64, 8, 3), KernelConfig(128, 32, 4, 3), KernelConfig(64, 64, 4, 3)],
        "mid_d": [KernelConfig(128, 64, 8, 2), KernelConfig(128, 64, 8, 3), KernelConfig(128, 32, 8, 3),
                  KernelConfig(64, 32, 4, 2)],
        "large_d": [KernelConfig(128, 32, 8, 2), KernelConfig(64, 16, 4, 2), KernelConfig(64, 16, 4, 1)],
    },
    # The warp-specialised backward (kernels/attention_bwd_ws.py): num_warps per consumer group;
    # the rows of each product (keys for dk/dv, queries for dq) split between two groups. H100
    # sweeps (benchmarks/NOTES.md, "A warp-specialised backward for Hopper"): 64/128/4/2 dk/dv fastest at both head dims;
    # dq 128/64 at 4k and in windows, 128/128 at 16k and at head dim 64. 128/128 dk/dv is left
    # out at head dim 128 (232 KB of shared memory and spills in an sm90 compile); 64/64 ran
    # 40-60% slower.
    "dkdv_ws": {
        "small_d": [KernelConfig(64, 128, 4, 2), KernelConfig(128, 128, 4, 2)],
        "mid_d": [KernelConfig(64, 128, 4, 2), KernelConfig(64, 128, 4, 3)],
        "large_d": [KernelConfig(64, 128, 4, 2)],
    },
    "dq_ws": {
        "small_d": [KernelConfig(128, 128, 4, 2), KernelConfig(128, 64, 4, 2)],
        "mid_d": [KernelConfig(128, 64, 4, 2), KernelConfig(128, 128, 4, 2), KernelConfig(128, 64, 4, 3)],
        "large_d": [KernelConfig(128, 64, 4, 2)],
    },
}
# float32 runs exact fp32 products (no tensor cores): small tiles, or the registers spill.
FP32_CONFIGS = {
    "fwd": [KernelConfig(32, 16, 4, 1), KernelConfig(16, 32, 4, 1)],
    "fwd_ws": [KernelConfig(32, 16, 4, 1)],
    "dkdv": [KernelConfig(16, 32, 4, 1), KernelConfig(32, 16, 4, 1)],
    "dkdv_atomic": [KernelConfig(16, 32, 4, 1), KernelConfig(32, 16, 4, 1)],
    "dq": [KernelConfig(32, 16, 4, 1), KernelConfig(16, 32, 4, 1)],
}
DELTA_CONFIG = KernelConfig(64, 64, 4, 1)
# The "bwd_gluon" candidate that runs the warp-specialised pair (dkdv_ws, dq_ws, each tuned).
BWD_WS_PAIR = KernelConfig(0, 0, 0, 0, "ws")


def d_class(block_d: int) -> str:
    return "small_d" if block_d <= 64 else ("mid_d" if block_d <= 128 else "large_d")


def shared_memory_estimate(kind: str, cfg: KernelConfig, block_d: int, elem: int, mask_elem: int = 0,
                           block_dv: int = 0) -> int:
    """Bytes of shared memory a config needs: tiles resident for the whole program plus
    num_stages copies of each pipelined tile (matches sm90 compiles within a few percent).
    block_d: the padded query/key head dim; block_dv: the padded value head dim (0: block_d),
    the width of V, dO and the output tiles."""
    bm, bn, stages = cfg.block_m, cfg.block_n, max(cfg.num_stages, 1)
    qk, vo = block_d, block_dv or block_d
    if kind == "bwd_gluon":  # K and V; P and dS per group; fp32 dq per group; Q, dO and their statistics
        resident = bn * (qk + vo) * elem + 2 * bm * bn * elem + 2 * bm * qk * 4
        return resident + stages * (bm * (qk + vo) * elem + 2 * bm * 4) + 1024
    if kind == "delta_exact":  # q and do resident; k and v loaded per key tile (the exact delta pass)
        resident, pipelined = bm * (qk + vo), bn * (qk + vo)
    elif kind in ("fwd", "fwd_ws", "fwd_gluon"):  # q resident; k and v pipelined
        resident, pipelined = bm * qk, bn * (qk + vo)
    elif kind in ("dkdv", "dkdv_ws"):  # k and v resident; q and do pipelined
        resident, pipelined = bn * (qk + vo), bm * (qk + vo)
    elif kind == "dkdv_atomic":  # ds^T goes through shared memory for the dq product
        resident, pipelined = bn * (qk + vo) + bm * bn, bm * (qk + vo)
    else:  # dq: q and do resident; k and v pipelined
        resident, pipelined = bm * (qk + vo), bn * (qk + vo)
    return (resident + stages * pipelined) * elem + (stages + 1) * bm * bn * mask_elem + 1024


def padded_large_d_faults(cfg: KernelConfig) -> bool:
    """A half-precision forward config that faulted with a padded head dim of the large class.

    Triton 3.6 on an H200: BM128/BN32/w8/s2 read out of bounds (illegal memory access) at head dims
    144, 160 and 192 (BLOCK_D 256) under GQA (groups 2 and 4, float16 and bfloat16, contiguous
    tensors, no mask; CUDA fuzzer seed 5902 #17 and #2777 under the Triton policy). It ran at D 200
    and 256, without GQA, at w4, at BM64 and at one stage; compute-sanitizer saw no error (the fault
    did not occur under it). Not traced further: the 128-row, 8-warp configs are left out there."""
    return cfg.block_m == 128 and cfg.num_warps == 8


def fitting_configs(kind: str, block_d: int, dtype: torch.dtype, device: torch.device,
                    mask_elem: int = 0, block_dv: int = 0, padded: bool = False) -> list:
    """The candidates for this kernel whose estimated shared memory fits the device. block_dv:
    the padded value head dim where it differs from block_d (0: the same); the candidate table
    is that of the larger of the two (its register and shared-memory budget). padded: a head dim
    below its block (the forward leaves out padded_large_d_faults there)."""
    block_dv = block_dv or block_d
    if dtype == torch.float32:
        configs = FP32_CONFIGS[kind]
    else:
        cls = d_class(max(block_d, block_dv))
        configs = HALF_CONFIGS[kind][cls]
        if kind == "fwd" and padded and cls == "large_d":
            configs = [c for c in configs if not padded_large_d_faults(c)]
    elem = torch.empty((), dtype=dtype).element_size()
    limit = hardware.max_shared_memory(device.index)

    def need(c: KernelConfig) -> int:
        return shared_memory_estimate(kind, c, block_d, elem, mask_elem, block_dv)

    fit = [c for c in configs if need(c) <= limit]
    if not fit:  # the smallest, shrunk until it fits; the launch says if even that is too big
        c = min(configs, key=need)
        while need(c) > limit and c.num_stages > 1:
            c = KernelConfig(c.block_m, c.block_n, c.num_warps, c.num_stages - 1)
        while need(c) > limit and max(c.block_m, c.block_n) > 16:
            c = KernelConfig(max(c.block_m // 2, 16), max(c.block_n // 2, 16), c.num_warps, c.num_stages)
        fit = [c]
    return fit


def exact_delta_config(block_d: int, dtype: torch.dtype, device: torch.device, mask_elem: int = 0,
                       block_dv: int = 0) -> KernelConfig:
    """DELTA_CONFIG for a delta pass with the exact recompute compiled in, its tiles halved until
    their shared memory fits the device (fp32 at head dim 256 needed 256 KiB at 64 x 64: an
    OutOfResources launch on an H200, a CUDA fuzzer with score modifiers)."""
    elem = torch.empty((), dtype=dtype).element_size()
    limit = hardware.max_shared_memory(device.index)
    c = DELTA_CONFIG
    while (shared_memory_estimate("delta_exact", c, block_d, elem, mask_elem, block_dv) > limit
           and max(c.block_m, c.block_n) > 16):
        c = KernelConfig(max(c.block_m // 2, 16), max(c.block_n // 2, 16), c.num_warps, c.num_stages)
    return c
