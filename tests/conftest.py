import os

# Under pytest-xdist (the README's command runs one worker per core) each worker keeps to one thread
# for torch's intra-op pool and for numpy's BLAS (OpenBLAS spins a thread per core in each process:
# the interpreter's tl.dot is a numpy matmul). Set before torch imports numpy, which reads them once.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run in the interpreter where there is no GPU (CI); set before triton imports.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _skip_repeated_interpreter_patches() -> None:
    """triton's interpreter patches triton.language again on every call of a @triton.jit helper
    inside a kernel (a scan of the language's members, about 2 ms a call: 28% of an INT8 attention
    launch's time under the interpreter), though the launch patched it already. Within one launch, a
    helper whose language modules the launch, or an earlier helper, patched skips the scan: the
    patches it would make are the ones in place, and the launch's own restore is unchanged. Where
    the interpreter's internals differ (another triton), nothing is changed."""
    try:
        import inspect
        import threading

        from triton.runtime import interpreter as interp

        tl, grid_call, fn_call = interp.tl, interp.GridExecutor.__call__, interp.InterpretedFunction.__call__
        interp._patch_lang, interp.InterpreterError  # noqa: B018 - the names the wrappers rely on
    except (ImportError, AttributeError):
        return
    state, seen = threading.local(), {}

    def langs(fn) -> frozenset:
        key = seen.get(id(fn))
        if key is None or key[0] is not fn:
            mods = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
            key = seen[id(fn)] = (fn, mods)
        return key[1]

    def launch(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.patched = set(langs(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state.patched = outer

    def helper(self, *args, **kwargs):
        patched = getattr(state, "patched", None)
        mods = langs(self.fn)
        if patched is None or not mods <= patched:
            if patched is not None:
                patched |= mods
            return fn_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    interp.GridExecutor.__call__ = launch
    interp.InterpretedFunction.__call__ = helper


def _no_overflow_sanitizer() -> None:
    """triton's interpreter checks every 32-bit integer add, sub and mul for overflow (each one
    recomputed in int64 and compared: about 30% of an interpreted attention launch's time). The
    suite's calls are small, its offsets far from 2^31, and the compiled kernels on the GPU do not
    check (sanitize_overflow asserts only under debug). The fuzzer's interpreter runs
    (python -m tests.fuzz) keep the check. Where the interpreter's internals differ, nothing changes."""
    try:
        from dataclasses import replace

        from triton.runtime import interpreter as interp

        builder = interp.interpreter_builder
        builder.options = replace(builder.options, sanitize_overflow=False)
    except (ImportError, AttributeError, TypeError):
        return


def _np_dtypes_once() -> None:
    """triton's interpreter maps a triton dtype to numpy's through a dict it builds on every call
    (about 10,000 calls in one small attention backward); the same map, built once. Anything it
    does not hold goes to the original."""
    try:
        import numpy as np
        from triton.runtime import interpreter as interp

        original, tl = interp._get_np_dtype, interp.tl
        known = {t: original(t) for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8,
                                            tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
                                            tl.bfloat16)}
    except (ImportError, AttributeError, KeyError, TypeError):
        return
    u64 = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return u64
        if isinstance(tt_dtype, tl.block_type):
            element = tt_dtype.element_ty
            if isinstance(element, tl.pointer_type):
                return u64
            got = known.get(element)
        else:
            got = known.get(tt_dtype)
        return got if got is not None else original(tt_dtype)

    interp._get_np_dtype = get_np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _skip_repeated_interpreter_patches()
    _np_dtypes_once()
    if os.environ.get("ADAATTN_TEST_OVERFLOW_CHECKS", "") != "1":
        _no_overflow_sanitizer()

# Under pytest-xdist (the README's command runs one worker per core) each worker keeps to one
# intra-op thread: two workers of two threads each on two cores ran slower than one of two.
if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_planner():
    from adaattn import planner

    planner.reset()
    yield
    planner.reset()


@pytest.fixture
def cost_file(tmp_path, monkeypatch):
    """write(entries): a user cost file of our own (adaattn.costs entries), read at once; the
    package's own costs come back afterwards."""
    from adaattn import costs, planner

    path = tmp_path / "costs.json"
    monkeypatch.setenv("ADAATTN_COSTS", str(path))

    def write(entries):
        costs.write(path, entries, merge=False)
        costs.load(force=True)
        planner.reset()

    yield write
    monkeypatch.delenv("ADAATTN_COSTS")
    costs.load(force=True)
    planner.reset()
