import os

import pytest
import torch

# Triton kernels run in the interpreter where there is no GPU (CI); set before triton imports.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
