"""The calls a suite times side by side: torch SDPA pinned to one kernel, FlexAttention,
SageAttention and flash_attn where they import, and adaattn under a policy."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import stats
from ..api import attention
from ..policy import Policy
from .cases import Peer, unavailable

TOLERANCES = (1e-2, 3e-2, 8e-2)
SDPA_KERNELS = {  # row name -> the kernel torch's sdpa_kernel pins
    "cuDNN": SDPBackend.CUDNN_ATTENTION,
    "FA2": SDPBackend.FLASH_ATTENTION,  # on the CPU: torch's fused CPU flash kernel ("fused")
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
HOW = {
    "cuDNN / FA2 / efficient / math": "torch.nn.functional.scaled_dot_product_attention inside "
    "torch.nn.attention.sdpa_kernel(<that kernel>), the context entered around the timed loop",
    "fused": "the same with SDPBackend.FLASH_ATTENTION on the CPU: torch's fused CPU flash kernel",
    "flex": "torch.compile(flex_attention) with a create_block_mask block mask (built once, not timed)",
    "SageAttention": "sageattention.sageattn(q, k, v, tensor_layout='HND', is_causal=...)",
    "flash_attn": "flash_attn.flash_attn_func on (B, N, H, D) copies made before timing",
    "adaattn": "adaattn.attention(q, k, v, ...) with the default (exact) policy: dispatch included",
    "triton": "adaattn.attention(..., policy=Policy(backends=('triton',))): our Triton kernels pinned",
    "auto T": "adaattn.attention(..., policy=Policy(mode='auto', precisions=('native', 'int8', 'fp8'), "
    "tolerance=T)), warmed 5 calls before timing, verification at the policy's rate included",
    "auto int8 T": "the same with precisions=('native', 'int8')",
    "kv <storage> [paged]": "adaattn.kv.decode_attention(q, cache, 0, plan=plan) on a KVCache (or a PagedKVCache "
    "with page 64) filled before timing; the plan (plan_decode) made once before timing, as a serving loop makes it "
    "once per step for all layers",
    "... graph": "the same call captured in a torch.cuda.CUDAGraph and replayed",
    "efficient (padded, mask)": "SDPA's efficient kernel on the ragged batch padded to its longest, with a length "
    "mask",
}


@dataclass
class Call:
    """The inputs of one case in (B, H, N, D) and what the call computes."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    backward: bool = False

    @property
    def gqa(self) -> bool:
        return self.q.shape[1] != self.k.shape[1]

    def peer(self, name: str, forward: Callable[[], torch.Tensor], **kw) -> Peer:
        """A peer of this call; with `backward` its timed call is forward and backward."""
        timed = with_backward(forward, (self.q, self.k, self.v)) if self.backward else None
        return Peer(name, forward, timed=timed, **kw)


def with_backward(forward: Callable, inputs: tuple[torch.Tensor, ...]) -> Callable:
    """() -> gradients of inputs: forward, then backward of a fixed random output gradient."""
    grad: list[torch.Tensor] = []

    def step():
        out = forward()
        if not grad:
            grad.append(torch.randn_like(out))
        return torch.autograd.grad(out, inputs, grad[0])

    return step


def sdpa(call: Call, name: str, kernel: SDPBackend | None = None, mask: torch.Tensor | None = None) -> Peer:
    """torch SDPA pinned to `kernel` (default: the row name's); a mask replaces causal."""
    pinned = kernel if kernel is not None else SDPA_KERNELS[name]
    causal = call.causal and mask is None
    extra = {"enable_gqa": True} if call.gqa else {}
    q, k, v = call.q, call.k, call.v
    return call.peer(name, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **extra),
                     context=lambda: sdpa_kernel(pinned))


def adaattn(call: Call, name: str = "adaattn", policy: Policy | None = None, warm: int = 1) -> Peer:
    q, k, v = call.q, call.k, call.v
    kw = {"policy": policy} if policy is not None else {}
    return call.peer(name, lambda: attention(q, k, v, is_causal=call.causal, enable_gqa=call.gqa,
                                             window=call.window, **kw), warm=warm)


def triton(call: Call) -> Peer:
    return adaattn(call, "triton", Policy(backends=("triton",)))


def auto(call: Call, tolerances=TOLERANCES, precisions=("native", "int8", "fp8"), prefix: str = "auto") -> list[Peer]:
    """mode="auto" at each tolerance; each row also reports the per-head levels of one call."""
    out = []
    for tol in tolerances:
        policy = Policy(mode="auto", precisions=precisions, tolerance=tol)
        peer = adaattn(call, f"{prefix} {tol:g}", policy, warm=5)
        peer.info = _levels(peer.forward)
        out.append(peer)
    return out


def _levels(forward: Callable) -> Callable[[], dict]:
    """Per-head levels and measured errors of one call, as adaattn.stats records them."""

    def info() -> dict:
        with stats.collect() as records:
            forward()
        if not records:
            return {}
        decisions = records[-1].as_dict()["decisions"]
        levels = next((v for k, v in decisions.items() if "levels" in k and isinstance(v, list)), None)
        counts = None if levels is None else {lv: levels.count(lv) for lv in dict.fromkeys(levels)}
        errors = next((v for k, v in decisions.items() if "error" in k and isinstance(v, list)), None)
        return {"head_levels": counts, "head_errors": errors, "decisions": decisions}

    return info


def flex(call: Call, mask_mod: Callable, name: str = "flex") -> Peer:
    """FlexAttention with a block mask of `mask_mod` (compiled once; the mask is built before timing)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as e:
        return unavailable(name, f"torch.nn.attention.flex_attention does not import ({type(e).__name__})")
    if call.q.device.type != "cuda":
        return unavailable(name, "FlexAttention is timed on CUDA only here")
    n, m = call.q.shape[2], call.k.shape[2]
    block_mask = torch.compile(create_block_mask)(mask_mod, None, None, n, m, device=call.q.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    q, k, v = call.q, call.k, call.v
    return call.peer(name, lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=call.gqa))


def optional_module(name: str):
    try:
        return importlib.import_module(name), ""
    except Exception as e:
        return None, f"{name} does not import here ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"


def sage(call: Call) -> Peer:
    mod, why = optional_module("sageattention")
    if mod is None:
        return unavailable("SageAttention", why)
    if call.window is not None or call.backward:
        return unavailable("SageAttention", "takes no window and has no backward")
    q, k, v = call.q, call.k, call.v
    return Peer("SageAttention", lambda: mod.sageattn(q, k, v, tensor_layout="HND", is_causal=call.causal))


def flash_attn(call: Call) -> Peer:
    mod, why = optional_module("flash_attn")
    if mod is None:
        return unavailable("flash_attn", why)
    left, right = call.window if call.window is not None else (None, None)
    size = (-1 if left is None else left, -1 if right is None else right)
    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_(call.backward) for t in (call.q, call.k, call.v))

    def forward():
        return mod.flash_attn_func(q, k, v, causal=call.causal, window_size=size).transpose(1, 2)

    timed = with_backward(forward, (q, k, v)) if call.backward else None
    return Peer("flash_attn", forward, timed=timed)


def gpu_peers(call: Call, sdpa_names=("cuDNN", "FA2")) -> list[Peer]:
    """The peers of every dense GPU case: SDPA kernels, flash_attn, adaattn default and triton."""
    return [*(sdpa(call, n) for n in sdpa_names), flash_attn(call), adaattn(call), triton(call)]
