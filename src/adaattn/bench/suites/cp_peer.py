"""The cp suite's lock-step machinery: the world torchrun gives (or a world of one), the process
group, synchronisation and agreement across ranks, timing a call the same number of times on every
rank, and torch's own context parallelism (torch.distributed.tensor.experimental.context_parallel),
the peer the suite times ours against."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .distributed import _group

def _world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment, or a world of one."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return 0, 1, 0


def _init(device: torch.device) -> torch.device:
    """Initialise the process group (once per process); returns this rank's device."""
    rank, world, local = _world()
    if device.type == "cuda":
        device = torch.device("cuda", local if world > 1 else (device.index or 0))
        torch.cuda.set_device(device)
    if world == 1:
        _group(device)  # the distributed suite's process group of one
    elif not dist.is_initialized():  # torchrun's environment; a 1M-token call can outlast the default timeout
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=30),
                                **({"device_id": device} if device.type == "cuda" else {}))
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _agree_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum over the ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _agree_all(flag: bool, device: torch.device) -> bool:
    """True where every rank says True."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


LONG_MS = 3000.0  # a call this long takes one sample after its warm-up (its noise is far below a percent)


def _time(fn, device: torch.device, rep_ms: float, min_samples: int = 2, max_samples: int = 20):
    """(samples in ms, each the slowest rank's; the last call's result): a warm-up call (compiles,
    plans), then a count every rank agrees on from the first timed sample (about rep_ms of
    samples, at least min_samples, one for calls over LONG_MS)."""

    def once():
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        got = fn()
        _sync(device)
        return (time.perf_counter() - t0) * 1e3, got

    first, got = once()
    first = _agree_max([first], device)[0]
    samples = []
    if first <= LONG_MS:  # a long warm-up is all kernel time: no second call just to size the count
        del got
        ms, got = once()
        samples.append(ms)
        first = _agree_max([ms], device)[0]
    least = 1 if first > LONG_MS else min_samples
    count = max(least, min(max_samples, int(rep_ms / max(first, 1e-3))))
    while len(samples) < count:
        del got
        ms, got = once()
        samples.append(ms)
    return _agree_max(samples, device), got


# ----------------------------------------------------------------------------- the suite


def _torch_cp(q, k, v, dout, gqa, method, device, rep_ms):
    """torch's context_parallel: (samples fwd, samples fwd+bwd), the gathered output, how GQA went in."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    set_rotate_method(method)
    how = "enable_gqa"
    kk, vv = k, v
    if gqa and not _torch_cp_takes_gqa(mesh, q, k, v, device):
        group = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        how = "K/V repeated to the query heads (torch's ring refused enable_gqa)"
    use_gqa = gqa and how == "enable_gqa"
    # context_parallel shards its buffers in place: these are this call's own copies.
    bufs = [q, kk, vv, dout]
    del q, k, v, dout, kk, vv
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
        ql, kl, vl, dl = bufs

        def call(backward):
            a, b, c = ((t.detach().requires_grad_() for t in (ql, kl, vl)) if backward else (ql, kl, vl))
            o = F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=use_gqa)
            if backward:
                o.backward(dl)
            return o

        fwd, o = _time(lambda: call(False), device, rep_ms)
        both = _time(lambda: call(True), device, rep_ms)[0]
    full = context_parallel_unshard(mesh, [o], [2])[0]
    return (fwd, both), full, how


def _torch_cp_takes_gqa(mesh, q, k, v, device) -> bool:
    """Whether torch's ring runs SDPA with enable_gqa at this dtype (a short trial on every rank,
    agreed)."""
    from torch.distributed.tensor.experimental import context_parallel

    world = dist.get_world_size()
    m = 64 * max(world, 1)
    bufs = [t[:, :, :m].clone() for t in (q, k, v)]
    ok = True
    try:
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(bufs)):
            F.scaled_dot_product_attention(*bufs, is_causal=True, enable_gqa=True)
            _sync(device)
    except Exception:
        ok = False
    return _agree_all(ok, device)
