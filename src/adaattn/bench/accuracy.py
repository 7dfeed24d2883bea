"""Relative error against the float64 reference, on a sample of query rows at large N (the
functions live beside the reference itself, backends/reference.py, for models/ too)."""

from __future__ import annotations

from ..backends.reference import CHUNK_BYTES, relative_error, sample_rows, sampled_reference

__all__ = ["CHUNK_BYTES", "relative_error", "sample_rows", "sampled_reference"]
