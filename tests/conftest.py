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


if os.environ.get("TRITON_INTERPRET") == "1":
    _skip_repeated_interpreter_patches()

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
