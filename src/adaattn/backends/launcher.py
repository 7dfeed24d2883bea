"""Launch a Triton kernel with less host work than `kernel[grid](...)` on repeated calls.

A decode step launches small kernels whose host cost rivals their GPU time: `JITFunction.run`
binds and specializes every argument and builds launch metadata on every call (about 45 us per
launch of decode_split_kernel's 45 arguments on the H100 machine; benchmarks/NOTES.md, sparse
decode). `launch` keeps the compiled kernel of each specialization it has seen, under a key
that holds everything Triton specializes on (each tensor's dtype and 16-byte alignment; each
integer's being 1, its divisibility by 16 and its width; the constexprs and launch options), and
calls the compiled kernel's launcher directly when the key repeats. A new key goes through
`kernel[grid](...)`, which compiles or finds the kernel and launches it.

The ordinary path runs whenever the direct one cannot be trusted: under TRITON_INTERPRET, with a
launch hook installed (profilers), or on a Triton whose compiled kernels lack the launcher this
relies on (`run`, `function`, `packed_metadata`).
"""

from __future__ import annotations

import inspect

import torch

from .triton_configs import interpreting

_CACHE: dict = {}
_CACHE_LIMIT = 4096
_INT32 = (-(2 ** 31), 2 ** 31)


def _spec(x) -> object:
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.data_ptr() % 16 == 0)
    if isinstance(x, bool):
        return ("b", x)
    if isinstance(x, int):
        return ("i", x == 1, x % 16 == 0, _INT32[0] <= x < _INT32[1])
    if isinstance(x, float):
        return "f"
    if x is None:
        return None
    return ("v", type(x).__name__, x)


def _hooked() -> bool:
    try:
        from triton import knobs
    except ImportError:  # an older Triton: no direct path
        return True
    return knobs.runtime.launch_enter_hook is not None or knobs.runtime.launch_exit_hook is not None


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), with the arguments in the kernel's parameter order
    (positional first, constexprs and num_warps / num_stages by name)."""
    if interpreting() or not args or not isinstance(args[0], torch.Tensor) or not args[0].is_cuda or _hooked():
        kernel[grid](*args, **kwargs)
        return
    device = args[0].device.index
    key = (id(kernel), device, tuple(sorted(kwargs.items())), tuple(_spec(a) for a in args))
    hit = _CACHE.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        names = kernel.arg_names
        tail = names[len(args):]
        defaults = {p.name: p.default for p in kernel.params}
        if (compiled is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
                or any(n not in kwargs and defaults.get(n, inspect.Parameter.empty) is inspect.Parameter.empty for n in tail)):
            return
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        _CACHE[key] = (compiled, tuple((n, kwargs[n] if n in kwargs else defaults[n]) for n in tail))
        return
    compiled, tail = hit
    g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
    stream = torch.cuda.current_stream(device).cuda_stream
    compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *(v for _, v in tail))
