"""backends/launcher.py: the direct launch path's key holds everything Triton specializes on."""

from __future__ import annotations

import torch

from adaattn.backends import launcher


def test_the_key_tells_apart_what_triton_specializes_on():
    base = torch.zeros(64)
    spec = launcher._spec
    assert spec(base) != spec(base.to(torch.float16))  # dtype
    assert spec(base) != spec(base[1:])  # 16-byte alignment (4 bytes off)
    assert spec(base) == spec(base[4:])  # aligned again: the same specialization
    assert spec(1) != spec(2) and spec(16) != spec(17) and spec(32) == spec(48)  # ==1, divisible by 16
    assert spec(2 ** 31) != spec(2 ** 31 - 16)  # wider than int32
    assert spec(True) != spec(1) and spec(None) is None and spec(0.5) == spec(2.0)


def test_on_the_cpu_and_in_the_interpreter_it_is_the_ordinary_launch():
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    launcher.launch(Kernel(), (3,), torch.zeros(2), 5, B=4)
    assert calls == [((3,), calls[0][1], {"B": 4})] and not launcher._CACHE
