"""Which difference between the warp-specialised probe (ws_probe_kernels.ws_probe_fwd, correct
on the H100) and the product kernel (kernels/attention_fwd_ws.py, NaN there) breaks it.

    PYTHONPATH=src python3 benchmarks/ws_bisect_gpu.py
"""

import itertools
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

FLAGS = ("Q_GLOBAL", "GUARD", "KV_2D", "STORE_LSE", "DESC_STORE")
# One change at a time from the probe's form, and from the product's form.
PROBE = dict(Q_GLOBAL=True, GUARD=False, KV_2D=True, STORE_LSE=False, DESC_STORE=True)
PRODUCT = dict(Q_GLOBAL=False, GUARD=True, KV_2D=False, STORE_LSE=True, DESC_STORE=False)
VARIANTS = [("probe", PROBE), ("product", PRODUCT)]
for f in FLAGS:
    VARIANTS.append((f"probe but {f}={not PROBE[f]}", dict(PROBE, **{f: not PROBE[f]})))
    VARIANTS.append((f"product but {f}={not PRODUCT[f]}", dict(PRODUCT, **{f: not PRODUCT[f]})))


def _alloc(size, alignment, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def run(flags, b, h, n, d=128, bm=128, bn=128, seed=0):
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ws_probe_kernels import ws_bisect_fwd

    triton.set_allocator(_alloc)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(b, h, n, device="cuda")
    box = [1, 1, bn, d]
    k2, v2 = k.reshape(b * h * n, d), v.reshape(b * h * n, d)
    ws_bisect_fwd[(n // bm, b * h)](
        q, TensorDescriptor(k, list(k.shape), list(k.stride()), box), TensorDescriptor(v, list(v.shape), list(v.stride()), box),
        TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [bn, d]),
        TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [bn, d]), out, lse,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2), h, n, n,
        d ** -0.5 * 1.4426950408889634, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=2, **flags)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return ((out.float() - ref).norm() / ref.norm()).item(), int(torch.isnan(out).sum())


def _compile(i):
    t0 = time.time()
    try:
        run(VARIANTS[i][1], 1, 1, 256)
        torch.cuda.synchronize()
        return i, time.time() - t0, None
    except Exception as e:
        return i, time.time() - t0, f"{type(e).__name__}: {str(e)[-200:]}"


if __name__ == "__main__":
    pool = mp.get_context("spawn").Pool(min(16, len(VARIANTS)))
    errors = {i: err for i, _, err in pool.imap_unordered(_compile, range(len(VARIANTS)))}
    pool.terminate()
    for i, (name, flags) in enumerate(VARIANTS):
        if errors.get(i):
            print(f"{name:36s} compile/launch FAILED {errors[i]}", flush=True)
            continue
        cells = []
        for b, h, n in ((1, 16, 1024), (2, 16, 4096)):
            try:
                e, nans = run(flags, b, h, n)
                cells.append(f"B{b} N{n}: err {e:.1e} nan {nans}")
            except Exception as ex:
                cells.append(f"B{b} N{n}: {type(ex).__name__} {str(ex)[:80]}")
        print(f"{name:36s} " + " | ".join(cells), flush=True)
