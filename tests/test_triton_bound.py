"""Bound launches (backends/triton/bound.py): a compiled kernel launched without triton's per-call
binding must get exactly the arguments triton's own launch gives it, and must never run a kernel
compiled for another specialisation.

No GPU is needed: triton's driver is replaced by one that names a Hopper target, and compiling is
replaced by a stand-in kernel per triton cache key that records each launch. What runs is triton's
own JITFunction.run (binder, specialisation, cache key) beside our bound path."""

from __future__ import annotations

import random

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.runtime.jit import JITFunction  # noqa: E402

from adaattn.backends.triton import bound as B  # noqa: E402


class _Kernel:
    """A compiled kernel's stand-in: one per triton cache key; records its launches."""

    def __init__(self, key):
        self.key = key
        self.function = object()
        self.packed_metadata = (4, 1, 0)
        self.launches = []

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        self.launches.append(args)


@pytest.fixture
def fake_gpu(monkeypatch):
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 7

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    old = driver._active
    driver.set_active(Driver())
    monkeypatch.setattr(B, "_device", lambda: 0)
    monkeypatch.setattr(B, "_stream", lambda device: 7)
    compiled = {}

    def jit(fn, **kw):
        """A JITFunction of `fn` (an interpreter function's Python code too) that 'compiles' to
        stand-ins, one per triton cache key."""
        f = JITFunction(getattr(fn, "fn", fn), **(kw or getattr(fn, "kwargs", {})))

        def do_compile(key, signature, device, constexprs, options, attrs, warmup):
            k = compiled.setdefault((id(f), key), _Kernel(key))
            f.device_caches[device][0][key] = k
            return k

        f._do_compile = do_compile
        return f

    yield jit
    driver._active = old


def _toy(X, Y, OPT, n, stride, scale, flag, dns, BLOCK: tl.constexpr, HAS_OPT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs * stride, mask=offs < n)
    if HAS_OPT:
        x += tl.load(OPT + offs, mask=offs < n)
    if flag:
        x = x * scale
    tl.store(Y + offs, x + dns, mask=offs < n)


def _normal(args):
    """A launch's arguments with tensors as (their storage pointer, shape, strides, dtype)."""
    return tuple((a.data_ptr(), tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                 for a in args)


def test_bound_launches_pass_triton_s_own_arguments_and_never_reuse_another_specialisation(fake_gpu):
    """Random calls that differ in everything triton specialises on (dtype, 16-byte alignment,
    ints equal to 1, multiples of 16 and past 32 bits, None against a tensor, constexprs, launch
    options): each bound launch runs the stand-in that triton's own launch of the same call runs,
    with the same arguments."""
    fn = fake_gpu(_toy, do_not_specialize=["dns"])
    ours = B.BoundKernel(fn)
    rng = random.Random(0)
    base = {dt: torch.zeros(64, dtype=dt) for dt in (torch.float16, torch.bfloat16, torch.float32)}
    ints = [0, 1, 2, 3, 16, 17, 32, 2**31 - 16, 2**31, 2**31 + 16, 2**32 + 1, -16, -1]
    hits = 0
    for _ in range(400):
        dt = rng.choice(list(base))
        x = base[dt][rng.choice([0, 0, 1, 8, 16]):]  # views at 0, 2-4, 16-32, 32-64 bytes
        y = base[rng.choice(list(base))][rng.choice([0, 8]):]
        opt = rng.choice([None, base[dt][rng.choice([0, 3])]])
        args = (x, y, opt, rng.choice(ints), rng.choice(ints), rng.choice([0.5, 2.0]), rng.choice([True, False]),
                rng.choice(ints))
        kw = dict(BLOCK=rng.choice([16, 32]), HAS_OPT=opt is not None, num_warps=rng.choice([2, 4]))
        grid = (rng.randint(1, 9), rng.choice([1, 3]))
        theirs = fn.run(*args, grid=grid, warmup=True, **kw)  # triton's own choice, without a launch
        for _ in range(2):  # the second launch is a bound one (its key is known by then)
            known = len(ours.entries)
            ours.launch(grid, args, kw)
            ran = [k for k in _all_kernels(fn) if k.launches]
            assert len(ran) == 1, "one launch, on one compiled kernel"
            assert ran[0] is theirs, "the bound launch ran a kernel of another specialisation"
            got = ran[0].launches.pop()
        assert len(ours.entries) == known
        hits += 1
        fn[grid](*args, **kw)
        want = theirs.launches.pop()
        assert _normal(got[:6] + got[9:]) == _normal(want[:6] + want[9:])
        assert got[6:9] == (None, None, None) and not any(B._hook_set(h) for h in want[7:9])
    assert hits == 400 and len(ours.entries) > 50, len(ours.entries)


def _all_kernels(fn):
    return [k for caches in fn.device_caches.values() for k in caches[0].values()]


CASES = ["plain", "gqa", "d72", "bf16", "one_row", "strided_view", "causal_window"]


def test_our_forward_through_bound_launches_runs_triton_s_kernel_with_triton_s_arguments(fake_gpu, monkeypatch):
    """The pointer forward's real launch (forward._launch_fwd), twice per case: the second launch is
    a bound one, on the kernel of triton's own launch, with its arguments; the cases triton compiles
    apart (GQA, head dim 72, bf16, one query row, a view with rows 144 bytes apart, a causal window) never share a
    compiled kernel through a bound entry that triton would not share."""
    import adaattn.kernels.attention_fwd as kf
    from adaattn.backends.triton.common import KernelConfig
    from adaattn.backends.triton.forward import _launch_fwd
    from adaattn.backends.triton.launch import make_launch
    from adaattn.backends.triton.tuner import forced_configs

    fn = fake_gpu(kf.attention_fwd_kernel)
    monkeypatch.setattr(kf, "attention_fwd_kernel", fn)
    monkeypatch.setattr(B, "enabled", lambda: True)
    B._bound.pop(id(fn), None)
    seen = []
    for case in CASES:
        hq, hk, n, d, dt = 4, 4, 40, 64, torch.float16
        if case == "gqa":
            hk = 2
        elif case == "d72":
            d = 72
        elif case == "bf16":
            dt = torch.bfloat16
        elif case == "one_row":
            n = 1
        q = torch.randn(2, hq, n, d + 8, dtype=dt)[..., (8 if case == "strided_view" else 0):][..., :d]
        k, v = (torch.randn(2, hk, n, d, dtype=dt) for _ in range(2))
        causal = case == "causal_window"
        launch = make_launch("ptr", d ** -0.5, causal, 16 if causal else -1, 0 if causal else -1)

        def call():
            with forced_configs(fwd=KernelConfig(32, 32, 4, 2)):
                _launch_fwd(q, k, v, None, None, None, n, n, launch)

        call()
        first = [kk for kk in _all_kernels(fn) if kk.launches]
        assert len(first) == 1, case
        seen.append(first[0])
        slow = first[0].launches.pop()
        entries = len(B._bound[id(fn)].entries)
        call()
        assert len(B._bound[id(fn)].entries) == entries, case  # a bound launch: its key was known
        fast = first[0].launches.pop()  # the same compiled kernel ran
        assert _same_but_outputs(fast, slow), case
        assert [t.data_ptr() for t in fast[9:12]] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]
        assert not any(kk.launches for kk in _all_kernels(fn))
    distinct = len(set(map(id, seen)))
    assert distinct >= 5 and len(B._bound[id(fn)].entries) >= distinct  # ours at least as fine as triton's


def _same_but_outputs(fast, slow):
    """Equal but for the fresh out and lse tensors (arguments 12 and 13: launch prefix of 9, then
    q, k, v, out, lse), which must match in shape, strides and dtype."""
    strip = lambda a: tuple((tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t  # noqa: E731
                            for t in a[9:])
    return fast[:6] == slow[:6] and fast[6:9] == (None, None, None) and strip(fast) == strip(slow)


def test_bound_launches_step_aside_for_profiler_hooks_and_a_callable_grid(fake_gpu, monkeypatch):
    from triton import knobs

    fn = fake_gpu(_toy)
    ours = B.BoundKernel(fn)
    x = torch.zeros(64)
    args = (x, x, None, 64, 1, 1.0, False, 0)
    kw = dict(BLOCK=16, HAS_OPT=False)
    ours.launch((4,), args, kw)
    ours.launch((4,), args, kw)
    (k,) = _all_kernels(fn)
    assert len(k.launches) == 2 and k.launches[-1][6:9] == (None, None, None)
    hook = lambda *a: None  # noqa: E731
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    ours.launch((4,), args, kw)  # triton's own launch: the hook reaches the launcher
    assert k.launches[-1][7] is hook
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    calls = []
    ours.launch(lambda meta: calls.append(meta) or (4,), args, kw)
    assert calls and len(k.launches) == 4


@pytest.mark.parametrize("storage", ["native", "int8", "int4"])
def test_a_decode_step_launched_from_its_plan_runs_triton_s_kernels_with_triton_s_arguments(fake_gpu, monkeypatch,
                                                                                            storage):
    """decode_attention's split and merge launches, found once per plan (bound.site_launch): the
    second step launches with no argument list built, on the compiled kernels of triton's own
    launch, with its arguments (the fresh output and the step's query in their slots)."""
    import adaattn.kernels.decode as kd
    from adaattn import decode_attention, plan_decode
    from adaattn.kv import KVCache

    split, merge = fake_gpu(kd.decode_split_kernel), fake_gpu(kd.decode_merge_kernel)
    monkeypatch.setattr(kd, "decode_split_kernel", split)
    monkeypatch.setattr(kd, "decode_merge_kernel", merge)
    monkeypatch.setattr(B, "sites_enabled", lambda: True)
    dtype = torch.float16
    cache = KVCache(2, 3, 2, 300, 64, dtype=dtype, storage=storage)
    for layer in range(2):
        cache.append(layer, torch.randn(3, 2, 100, 64, dtype=dtype), torch.randn(3, 2, 100, 64, dtype=dtype))
    plan = plan_decode(cache, heads=4, query_len=1)
    plan.runner = "triton"

    def step(layer):
        q = torch.randn(3, 4, 1, 64, dtype=dtype)
        decode_attention(q, cache, layer, plan=plan)
        return q

    def launches():
        got = []
        for fn in (split, merge):
            ran = [k for k in _all_kernels(fn) if k.launches]
            assert len(ran) == 1
            got.append(ran[0].launches.pop())
        return got

    step(1)
    slow = launches()
    n_sites = len(cache._sites)
    plan = plan_decode(cache, heads=4, query_len=1)  # a plan made every step finds the cache's sites
    plan.runner = "triton"
    q = step(1)
    fast = launches()
    assert len(cache._sites) == n_sites == 2, list(cache._sites)  # the second step found both launches known
    assert all(x is None or not isinstance(x, torch.Tensor) for site in cache._sites.values() for x in site.template)
    for f, sl in zip(fast, slow):
        assert _same_but_outputs(f, sl)
    assert fast[0][9] is q
    # the same step through triton's own launch gives the bound one's arguments exactly
    B._bound.clear()
    monkeypatch.setattr(B, "sites_enabled", lambda: False)
    q2 = q.clone()
    decode_attention(q2, cache, 1, plan=plan)
    own = launches()
    assert _same_but_outputs(fast[0], own[0]) and _same_but_outputs(fast[1], own[1])
    ptrs = lambda a, skip: [t.data_ptr() for i, t in enumerate(a[9:]) if isinstance(t, torch.Tensor) and i != skip]  # noqa: E731
    assert ptrs(fast[0], 0) == ptrs(own[0], 0)  # every tensor but the query: the same memory
    assert ptrs(fast[1], 2) == ptrs(own[1], 2)  # every tensor but the fresh output
    step(0)  # another layer: another pair of sites (its own pools)
    launches()


@pytest.mark.parametrize("storage", ["native", "fp8", "int4"])
def test_an_append_launched_from_its_site_runs_triton_s_kernel_with_triton_s_arguments(fake_gpu, monkeypatch, storage):
    """KVCache.append's launch, found once per layer and layout (bound.site_launch): the second
    append of one token launches on triton's compiled kernel with the arguments triton's own launch
    gives the same append (its key and value in their slots)."""
    import adaattn.kernels.kv_append as ka
    from adaattn.kv import KVCache

    fn = fake_gpu(ka.append_kernel)
    monkeypatch.setattr(ka, "append_kernel", fn)
    cache = KVCache(1, 3, 2, 300, 64, dtype=torch.float16, storage=storage)
    cache.append_runner = "triton"
    tok = lambda: (torch.randn(3, 2, 1, 64, dtype=torch.float16), torch.randn(3, 2, 1, 64, dtype=torch.float16))  # noqa: E731

    def launched():
        (k,) = [k for k in _all_kernels(fn) if k.launches]
        return k.launches.pop()

    monkeypatch.setattr(B, "sites_enabled", lambda: True)
    cache.append(0, *tok())
    launched()
    key, value = tok()
    cache.append(0, key, value)
    fast = launched()
    assert len(cache._sites) == 1 and fast[9] is key and fast[10] is value
    # a site first met with one tensor as both key and value never hands a later append's value
    # in as its key (the review's repro): the aliasing is checked, and such a call goes through triton
    cache._sites.clear()
    x = tok()[0]
    cache.append(0, x, x)
    launched()
    key2, value2 = tok()
    cache.append(0, key2, value2)
    after = launched()
    assert after[9] is key2 and after[10] is value2
    monkeypatch.setattr(B, "sites_enabled", lambda: False)
    cache.reset()
    for _ in range(2):
        cache.append(0, *tok())
        launched()
    # the same third append (lengths now 2, as they were) through triton's own launch
    cache.reset()
    monkeypatch.setattr(B, "sites_enabled", lambda: True)
    cache.append(0, *tok())
    launched()
    monkeypatch.setattr(B, "sites_enabled", lambda: False)
    cache.append(0, key, value)
    own = launched()
    assert _normal(fast[:6] + fast[9:]) == _normal(own[:6] + own[9:])


def test_a_site_whose_arguments_hold_an_object_other_than_a_tensor_or_a_scalar_is_never_kept(fake_gpu,
                                                                                               monkeypatch):
    """A tensor descriptor (or any object) among a launch's arguments may hold this call's tensor,
    which a site's template would keep for every later call: such a site is not kept, and each
    call launches through triton."""
    class Stub:
        def key(self, args, kw):
            return ("k",), list(args)

    launched = []

    class Fn:  # triton's own launch: records it, returns the compiled kernel's stand-in
        def __getitem__(self, grid):
            return lambda *a, **k: launched.append(a) or _Kernel("k")

    stub = Stub()
    monkeypatch.setattr(B, "_kernel_of", lambda fn: stub)
    monkeypatch.setattr(B, "sites_enabled", lambda: True)
    monkeypatch.setattr(B, "_state", lambda fn: ())
    x = torch.zeros(4)
    sites: dict = {}
    B.site_launch(sites, "plain", Fn(), (1,), (x,), lambda: ((x, 3, 2.0, "s", None), {}))
    assert len(sites) == 1 and len(launched) == 1  # tensors and scalars: kept, after triton's own launch
    holder = type("Descriptor", (), {"base": x})()
    for _ in range(2):
        B.site_launch(sites, "descriptor", Fn(), (1,), (x,), lambda: ((x, holder), {}))
    assert len(sites) == 1 and len(launched) == 3  # not kept: each call through triton's own launch


def test_site_launches_are_on_by_default_off_with_the_environment_and_never_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(B, "_sites", None)
    monkeypatch.setattr(B, "interpreting", lambda: False)
    monkeypatch.delenv("ADAATTN_TRITON_SITES", raising=False)
    assert B.sites_enabled()
    monkeypatch.setattr(B, "_sites", None)
    monkeypatch.setenv("ADAATTN_TRITON_SITES", "0")
    assert not B.sites_enabled()
    monkeypatch.setattr(B, "_sites", None)
    monkeypatch.delenv("ADAATTN_TRITON_SITES")
    monkeypatch.setattr(B, "interpreting", lambda: True)
    assert not B.sites_enabled()
    B.set_sites_enabled(True)
    assert not B.sites_enabled()  # (set_sites_enabled cannot turn them on under the interpreter either)
    monkeypatch.setattr(B, "interpreting", lambda: False)
    monkeypatch.setattr(B, "_enabled", None)
    monkeypatch.delenv("ADAATTN_TRITON_BOUND", raising=False)
    B.set_sites_enabled(True)
    assert B.sites_enabled() and not B.enabled()  # the generic key is its own switch, off by default
    B.set_sites_enabled(False)
    assert not B.sites_enabled()
    B.set_sites_enabled(None)
