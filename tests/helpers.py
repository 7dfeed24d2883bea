"""Shared test helpers: the MEASURING.md error standard and an independent SDPA equivalent."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

# Where the Triton kernels of a test run: the GPU, or else the interpreter (conftest.py sets
# TRITON_INTERPRET=1 before anything imports triton where there is no CUDA).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEEDS_CUDA_OR_INTERPRETER = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or TRITON_INTERPRET=1")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; 0/0 counts as 0 and x/0 as inf."""
    out, ref = out.double(), ref.double()
    num = (out - ref).norm().item()
    den = ref.norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def keep_mask(q_len, kv_len, causal, window, device=None, bottom_right=False):
    """Written independently of adaattn.backends.masks: True where query i may see key j
    (bottom_right: query i sits at position i + kv_len - q_len). (Whole-matrix comparisons: an
    element-by-element loop took hours at the GPT shape's 8192.)"""
    i = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len if bottom_right else 0)
    j = torch.arange(kv_len, device=device)[None, :]
    keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if causal:
        keep = keep & ~(j > i)
    if window is not None:
        left, right = window
        if left is not None:
            keep = keep & ~(j < i - left)
        if right is not None:
            keep = keep & ~(j > i + right)
    return keep


def sdpa_equivalent(q, k, v, attn_mask=None, is_causal=False, scale=None, window=None, enable_gqa=False):
    """torch SDPA on (B, H, N, D) inputs with causal/window turned into an explicit mask."""
    if window is not None or (is_causal and attn_mask is not None):
        keep = keep_mask(q.shape[-2], k.shape[-2], is_causal, window, q.device)
        if attn_mask is None:
            attn_mask = keep
        elif attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & keep
        else:
            attn_mask = attn_mask.masked_fill(~keep, float("-inf"))
        is_causal = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )


def assert_within_standard(ours, ref64, torch_out, what="output"):
    """MEASURING.md: err(ours) <= 2 * err(torch) + 1e-6 against the float64 reference."""
    e_ours, e_torch = rel_err(ours, ref64), rel_err(torch_out, ref64)
    assert e_ours <= 2 * e_torch + 1e-6, f"{what}: err(ours)={e_ours:.3e} > 2*err(torch)={2 * e_torch:.3e} + 1e-6"


def decode_reference(q, k, v):
    """float64 attention of q (Hq, T, D) against k/v (Hkv, N, D), GQA, bottom-right causal (query
    row i of T sits at position N - T + i), as a KV cache's decode computes it."""
    hq, t, d = q.shape
    g = hq // k.shape[0]
    k, v = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    s = q.double() @ k.transpose(-1, -2) / d ** 0.5
    n = k.shape[1]
    visible = torch.arange(n, device=q.device)[None, :] <= (n - t + torch.arange(t, device=q.device))[:, None]
    return torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v


def gluon_here() -> bool:
    """Whether the Gluon kernels run on this machine's GPU (Hopper, a triton with Gluon)."""
    from adaattn.backends.triton import common

    return torch.cuda.is_available() and common.gluon_fwd_here(torch.zeros(1, device="cuda"))


def break_gluon(monkeypatch, module, launcher: str) -> None:
    """Make module.launcher (a Gluon kernel's launch) fail as a compile failure would, with no
    Gluon failure recorded before it in this process."""
    from adaattn.backends.triton import common

    def broken(*args, **kwargs):
        raise RuntimeError("compile failure")

    monkeypatch.setattr(module, launcher, broken)
    monkeypatch.setattr(common, "_GLUON_BROKEN", [])
