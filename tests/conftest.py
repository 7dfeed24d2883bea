import os

import pytest
import torch

# Triton kernels run in the interpreter where there is no GPU (CI); set before triton imports.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fresh_planner():
    from adaattn import planner

    planner.reset()
    yield
    planner.reset()
