"""The controllers of call sites: one registry for every adaptive runner's (precision in
adaptive/controller.py, rank in adaptive/rank.py), so that find, forget and reset cover them all.
A site is an `AdaAttention` module, a `label`, or one shape class of anonymous calls under one
policy."""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_controllers: dict[str, Any] = {}


def get(site: str, factory):
    """The controller of `site`, made by factory() on first use."""
    c = _controllers.get(site)
    if c is None:
        with _lock:
            c = _controllers.get(site)
            if c is None:
                c = factory()
                _controllers[site] = c
    return c


def find(site_or_label: str) -> Any:
    """The controller whose site is, or starts with, this label (None if no call made one)."""
    c = _controllers.get(site_or_label)
    if c is not None:
        return c
    for site, c in list(_controllers.items()):
        if site.startswith(site_or_label + "|"):
            return c
    return None


def forget(label: str) -> None:
    """Drop the controllers of one label (an AdaAttention module drops its own when collected)."""
    with _lock:
        for site in [s for s in _controllers if s == label or s.startswith(label + "|")]:
            del _controllers[site]


def controllers() -> dict[str, Any]:
    return dict(_controllers)


def reset() -> None:
    """Forget every controller (levels start from predictions again)."""
    with _lock:
        _controllers.clear()
