"""Launching a compiled Triton kernel at the cost of the launch.

`kernel[grid](*args, **kw)` on a cache hit spends 20-30 us of Python in triton's JITFunction.run:
binding the arguments to the signature, specialising every one of them (dtype, 16-byte
alignment, ints equal to 1, integer width), hashing that into a cache key, and reading its knobs,
before the launcher itself (about 1 us) runs. `bound(kernel)[grid](*args, **kw)` takes the same
arguments and launches the same compiled kernel with the same arguments, through a table keyed
on what triton specialises on, computed in one pass:

- a tensor: its dtype and whether its data pointer is 16-byte aligned;
- an int: whether it equals 1, is a multiple of 16, and its width class (i32, i64, u64);
- a float or a bool: its type; None: None;
- a constexpr parameter and every launch option (num_warps, num_stages, ...): its value;
- anything else (a tensor descriptor): triton's own specialisation of it.

That key is at least as fine as triton's (a test drives both over arguments that differ in each
of these ways, triton's own binder beside ours), so two calls with one key run one compiled
kernel. A key seen for the first time goes through `kernel[grid]` itself, which compiles (or finds)
the kernel and launches it; the table keeps the compiled kernel for the next call. The bound path
steps aside, to `kernel[grid]`, under the interpreter, with triton's launch hooks set (profilers
read their metadata), with pre-run hooks or a stages-inspection hook, for a callable grid, and when
ADAATTN_TRITON_BOUND is not 1. Kernels are compiled for the current CUDA device, as triton does, and the
device is part of the key. Off unless ADAATTN_TRITON_BOUND=1 (see enabled()).

Site launches (site_launch) are the other path, on by default (sites_enabled()): a call site that
knows its launch keeps the compiled kernel of triton's own first launch and an argument template,
and later calls slot in their tensors. A call the site does not know launches through triton.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .common import interpreting

_EMPTY = inspect.Parameter.empty
_I32 = 1 << 31
_U64 = 1 << 63

# The versions of the launcher's argument list this module knows (triton >= 3.6: CompiledKernel.run
# takes grid x3, stream, function, packed metadata, launch metadata, enter hook, exit hook, *args).
_enabled: bool | None = None


def enabled() -> bool:
    """Whether bound launches run: ADAATTN_TRITON_BOUND=1 (default off; never under the
    interpreter). Off by default: on an H200 (torch 2.11, triton 3.6) they saved nothing
    measurable, since the key's Python loop over the arguments costs about what triton's own
    binding does (benchmarks/NOTES.md, "Host cost, first measurements"), and one bitwise mismatch
    of dk/dv there against triton's own launch, not reproduced since, is unexplained."""
    global _enabled
    if _enabled is None:
        import os

        _enabled = os.environ.get("ADAATTN_TRITON_BOUND", "0") == "1" and not interpreting()
    return _enabled


def set_enabled(on: bool | None) -> None:
    """Turn bound launches on or off for this process (None: back to the environment's choice)."""
    global _enabled
    _enabled = on if on is None else bool(on and not interpreting())


_sites: bool | None = None


def sites_enabled() -> bool:
    """Whether site launches run (site_launch: a decode step's and an append's launches found once
    per cache, then only their tensors slotted in): on by default, off with ADAATTN_TRITON_SITES=0,
    never under the interpreter. Decode steps and appends through them equal triton's own launches
    bit for bit, eager and in a CUDA graph, at every storage (tests/test_gpu_kv.py, H200, torch
    2.11, triton 3.6); the launcher's argument list is triton's own from 3.6 to 3.9 (jit.py)."""
    global _sites
    if _sites is None:
        import os

        _sites = os.environ.get("ADAATTN_TRITON_SITES", "1") != "0" and not interpreting()
    return _sites


def set_sites_enabled(on: bool | None) -> None:
    """Turn site launches on or off for this process (None: back to the environment's choice)."""
    global _sites
    _sites = on if on is None else bool(on and not interpreting())


def _device() -> int:
    """The current CUDA device, as triton's driver reads it."""
    return torch.cuda.current_device()


def _stream(device: int) -> int:
    """The current raw CUDA stream of `device`, as triton's driver reads it."""
    return torch._C._cuda_getCurrentRawStream(device)


if hasattr(torch._C, "_cuda_getDevice"):  # the same without torch.cuda's Python wrapper
    _device = torch._C._cuda_getDevice  # noqa: F811


class _Entry:
    __slots__ = ("kernel", "run", "function", "packed")

    def __init__(self, kernel):
        self.kernel = kernel  # kept alive: a newer triton unloads the module when it is collected
        self.run = kernel.run  # (reading .run loads the binary; .function only after it)
        self.function = kernel.function
        self.packed = kernel.packed_metadata


class BoundKernel:
    """A JITFunction launched through its compiled kernels' launchers (module docstring)."""

    def __init__(self, fn):
        self.fn = fn
        params = list(fn.params)
        self.n = len(params)
        self.index = {p.name: i for i, p in enumerate(params)}
        sig = fn.signature.parameters
        self.defaults = [sig[p.name].default for p in params]
        self.constexpr = [bool(p.is_constexpr) for p in params]
        self.entries: dict[tuple, _Entry] = {}

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launch(grid, args, kw)

    def _steps_aside(self, grid) -> bool:
        return callable(grid) or _state(self.fn) is None

    def key(self, args: tuple, kw: dict) -> tuple[tuple, list] | None:
        """(the specialisation key, every argument in parameter order), or None where an argument
        is missing (the ordinary launch then raises triton's error)."""
        full = list(args)
        if len(full) > self.n:
            return None
        full.extend([_EMPTY] * (self.n - len(full)))
        options = []
        for name, value in kw.items():
            i = self.index.get(name)
            if i is None:
                options.append((name, value))
            else:
                full[i] = value
        key = [_device(), tuple(options), _state(self.fn)]
        append = key.append
        for i, a in enumerate(full):
            if a is _EMPTY:
                a = full[i] = self.defaults[i]
                if a is _EMPTY:
                    return None
            if self.constexpr[i]:
                append(a)
                continue
            t = type(a)
            if t is torch.Tensor or isinstance(a, torch.Tensor):
                append((a.dtype, not a.data_ptr() & 15))
            elif t is int:
                append(1 if a == 1 else (not a % 16, -_I32 <= a < _I32, a < _U64))
            elif t is float or t is bool or a is None:
                append(t)
            else:
                append(self._other(a, key[0]))
        return tuple(key), full

    def _other(self, a: Any, device: int):
        """Triton's own specialisation of an argument of another kind (a tensor descriptor: its
        dtype, block shape and layout), with the backend triton's binder uses."""
        from triton._C.libtriton import native_specialize_impl

        backend = self.fn.device_caches[device][3]
        spec = native_specialize_impl(backend, a, False, True, True)
        return (type(a),) + tuple(_hashable(x) for x in spec)

    def launch(self, grid, args: tuple, kw: dict):
        if self._steps_aside(grid):
            return self.fn[grid](*args, **kw)
        found = self.key(args, kw)
        if found is None:
            return self.fn[grid](*args, **kw)
        return self.launch_found(grid, args, kw, found)

    def launch_found(self, grid, args: tuple, kw: dict, found: tuple):
        """launch() with the key and argument list already made (site_launch's first call)."""
        key, full = found
        entry = self.entries.get(key)
        if entry is None:
            kernel = self.fn[grid](*args, **kw)
            if kernel is not None and hasattr(kernel, "packed_metadata") and hasattr(kernel, "function"):
                self.entries[key] = _Entry(kernel)
            return kernel
        g = tuple(grid)
        gx = g[0]
        gy = g[1] if len(g) > 1 else 1
        gz = g[2] if len(g) > 2 else 1
        stream = _stream(key[0])
        entry.run(gx, gy, gz, stream, entry.function, entry.packed, None, None, None, *full)
        return entry.kernel


def _hook_set(hook) -> bool:
    """A launch hook that does something: a function, or a chain of them (a newer triton keeps an
    empty chain where an older one keeps None)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hashable(x):
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


_bound: dict[int, BoundKernel] = {}


def bound(fn):
    """The BoundKernel of a @triton.jit function (one per function); the function itself where
    bound launches do not run (the interpreter's functions have no compiled kernels)."""
    if not enabled():
        return fn
    return _kernel_of(fn)


def _kernel_of(fn) -> BoundKernel:
    b = _bound.get(id(fn))
    if b is None or b.fn is not fn:
        b = _bound[id(fn)] = BoundKernel(fn)
    return b


class _Site:
    __slots__ = ("entry", "template", "slots", "groups", "grid", "sig", "state")

    def __init__(self, entry, template, slots, groups, grid, sig, state):
        self.entry, self.template, self.slots, self.groups = entry, template, slots, groups
        self.grid, self.sig, self.state = grid, sig, state


def _signature(tensors) -> tuple:
    return tuple([(t.dtype, t.data_ptr() & 15) for t in tensors])


_knobs = None


def _state(fn) -> tuple | None:
    """What triton's launch reads besides the arguments (its debug and instrumentation knobs),
    or None where a launch must go through triton's own path (launch hooks, pre-run hooks, a
    stages-inspection hook)."""
    global _knobs
    if _knobs is None:
        from triton import knobs as _knobs
    rt = _knobs.runtime
    if (_hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)
            or getattr(rt, "add_stages_inspection_hook", None) is not None or getattr(fn, "pre_run_hooks", None)):
        return None
    comp = _knobs.compilation
    return (rt.debug, getattr(comp, "instrumentation_mode", None), getattr(comp, "fpsan_homomorphic_casts", None))


_PLAIN = (int, float, bool, str)  # what a site's template may keep as it is (with None)


def site_launch(sites: dict, key, fn, grid: tuple, tensors: tuple, build) -> None:
    """Launch `fn` over `grid` from a call site that knows its launch: the compiled kernel and its
    whole argument list are found once per `key` (through triton's own launch), and later calls put
    their tensors in their slots and run the launcher, with no argument list built and no
    per-argument key.

    tensors: every tensor argument of the launch, in a fixed order (each call's own objects). A
    tensor listed twice (a placeholder pointer) must be listed twice in every call with that key:
    the site checks it, and a call where one is not (a key passed as its own value, say) goes
    through triton. key: everything else the arguments depend on (shapes, strides of tensors whose
    layout can vary, scalars, constexprs), which the caller guarantees; `sites` is the caller's
    dict, which lives as long as what the key describes (a cache's). build(): the launch's (args,
    kwargs), called only when the site is not known yet. A tensor's dtype and 16-byte alignment,
    which triton specialises on, are checked each call, as are triton's debug knobs and hooks; a
    change launches through triton again. Runs only where site launches are on (sites_enabled()).
    The site keeps no tensor: its argument list holds None in their slots."""
    if not sites_enabled():
        args, kw = build()
        fn[grid](*args, **kw)
        return
    device = _device()  # (a kernel is loaded per device, and launched on the current one's stream)
    key = (key, device)
    site = sites.get(key)
    if (site is not None and site.sig == _signature(tensors) and site.state == _state(fn)
            and all(tensors[g[0]] is tensors[j] for g in site.groups for j in g[1:])):
        full = site.template.copy()
        for i, j in site.slots:
            full[i] = tensors[j]
        e = site.entry
        g = site.grid
        e.run(g[0], g[1], g[2], _stream(device), e.function, e.packed, None, None, None, *full)
        return
    args, kw = build()
    b = _kernel_of(fn)
    state = _state(fn)
    if callable(grid) or state is None:
        fn[grid](*args, **kw)
        return
    found = b.key(args, kw)
    if found is None:
        fn[grid](*args, **kw)
        return
    # triton's own launch, always, where the site is not known (the generic key only orders the
    # arguments here: a miss never launches through it); the compiled kernel it ran is the site's.
    kernel = fn[grid](*args, **kw)
    if kernel is None or not hasattr(kernel, "packed_metadata") or not hasattr(kernel, "function"):
        return
    entry = _Entry(kernel)
    first: dict[int, int] = {}
    groups: dict[int, list[int]] = {}
    for j, t in enumerate(tensors):
        j0 = first.setdefault(id(t), j)
        groups.setdefault(j0, [j0])
        if j0 != j:
            groups[j0].append(j)
    template = list(found[1])
    slots = []
    for i, a in enumerate(template):
        if isinstance(a, torch.Tensor):
            j = first.get(id(a))
            if j is None:  # a tensor the caller did not list: this site cannot be bound
                return
            slots.append((i, j))
            template[i] = None
        elif not (a is None or type(a) in _PLAIN):
            # an object that may hold a tensor (a tensor descriptor holds its base): the template
            # would keep this call's, so every call goes through triton's own launch
            return
    g = tuple(grid) + (1,) * (3 - len(grid))
    sites[key] = _Site(entry, template, tuple(slots), tuple(tuple(v) for v in groups.values() if len(v) > 1), g,
                       _signature(tensors), state)
