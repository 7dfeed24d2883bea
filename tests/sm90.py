"""Compile Triton kernels for Hopper (sm90) on a machine without a GPU, for codegen checks.

triton ships ptxas (and cuobjdump), so a kernel compiles for sm90 anywhere. The compile runs in
a subprocess without TRITON_INTERPRET (the test process has it set), from a script that calls
`compile_for_sm90` and prints JSON as its last line; `run_json` runs such a script.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest


def compile_for_sm90(kernel, consts: dict, types: dict, divisible, num_warps: int, num_stages: int) -> dict:
    """Compile `kernel` (@triton.jit or @gluon.jit) with `consts` (unknown names ignored), argument
    types from types(name) (a Triton type string), and 16-divisibility hints where
    divisible(name, type) says so. Returns ptx, ttgir, shared memory bytes and the per-thread stack
    (spill) bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if type(kernel).__name__ == "GluonJITFunction":
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

    consts = {name: value for name, value in consts.items() if name in kernel.arg_names}
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        sig[name] = "constexpr" if name in consts else types(name)
        if sig[name] != "constexpr" and divisible(name, sig[name]):
            attrs[(i,)] = [["tt.divisibility", 16]]
    c = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    stack = None
    if os.path.exists(tool):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"])
            f.flush()
            usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"STACK:(\d+)", usage)
        stack = int(m.group(1)) if m else None
    return {"ptx": c.asm["ptx"], "ttgir": c.asm["ttgir"], "smem": c.metadata.shared, "stack": stack}


def ws_kernel_rows(kernel, config, types_for, extra_consts: dict, marks: dict) -> list:
    """Compile a warp-specialised attention kernel for sm90 at head dims 64 and 128, causal
    (with a key tail) and not: config(d) gives the KernelConfig, types_for(d, cfg) the argument
    types. Each row: smem, stack, whether the TTGIR is warp-specialised, the threads per block,
    and for each name in marks whether the PTX contains its pattern."""
    rows = []
    for d in (64, 128):
        cfg = config(d)
        for causal in (False, True):
            consts = dict(HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal, BOTTOM_RIGHT=False,
                          K_TAIL=causal, DOT_PRECISION="tf32", WARP_SPEC=True, **extra_consts)
            c = compile_for_sm90(kernel, consts, types_for(d, cfg),
                                 lambda n, t: t[0] == "*" or re.fullmatch(r"stride_[qo][bhm]", n),
                                 cfg.num_warps, cfg.num_stages)
            rows.append({"d": d, "causal": causal, "smem": c["smem"], "stack": c["stack"],
                         "warp_specialize": "ttg.warp_specialize" in c["ttgir"],
                         "threads": [int(t) for t in re.findall(r"reqntid (\d+)", c["ptx"])],
                         **{name: pattern in c["ptx"] for name, pattern in marks.items()}})
    return rows


def assert_warp_specialised(rows: list, marks) -> None:
    """Every row of ws_kernel_rows came out specialised: 3 warp groups of 4 warps (a TMA producer
    and two consumers), every mark present, within shared memory, without spills."""
    for r in rows:
        assert r["warp_specialize"] and r["threads"] == [384] and all(r[m] for m in marks), r
        assert r["smem"] <= 232448 and not r["stack"], r


def run_json(script: str):
    """Run `script` in a fresh interpreter (src/ and tests/ on the path, no TRITON_INTERPRET)
    and return the JSON of its last output line; skips the test where triton has no ptxas."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(here), "src"), here,
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0 and ("ptxas" in proc.stderr and "not found" in proc.stderr.lower()):
        pytest.skip("no ptxas in this triton install")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
