"""The ring's block engines, as runners the planner chooses among (planner.choose("ring_block", ...)).

A block is one rank's local queries against one visiting K/V shard, cut into bands the kernels
take (distributed/bands.py); an engine returns each band's (out, lse), merges partial results by
log-sum-exp and runs a band's backward from the GLOBAL out and lse of its rows.

    ring.torch   torch math in float32 (float64 for float64 inputs): correct on every device
    ring.triton  our Triton forward and backward kernels (natural-log lse, fp32)
    ring.cudnn   cuDNN's fused kernel for full and square causal bands, our Triton kernels for the
                 others

`ring_block_problem` builds the RingBlockProblem of a call from the shard's tensors (the one place
that makes one); each runner says what its kernel cannot take (`supports`), why it runs when chosen
(`why`), and makes the engine the ring drives (`engine`). The planner orders them for
kernel="auto" (planner._ring_block_order). What only the planner may ask of its own runners comes
in as functions when it makes these runners (ring_block_runners): sdpa.cudnn's limits for a dense
call of the shard's shape, and which of our Triton forward variants takes a band.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..policy import Policy
from ..problem import Problem, default_scale, tma_aligned
from .masks import position_keep
from .sdpa_forms import CUDNN_NAN_KEYS
from .triton.backward import launch_bwd
from .triton.forward import launch_fwd
from .triton.launch import make_launch
from .triton.merge import merge_into
from .triton.runner import triton_reasons

KERNELS = ("auto", "cudnn", "triton", "torch")
# Errors a fallback cannot help: torch math needs more memory; a broken context stays broken.
NOT_RECOVERABLE = tuple(t for t in (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", None)) if t)


# ----------------------------------------------------------------------------- the facts of a block


@dataclass(frozen=True)
class RingBlockProblem:
    """What choosing a block engine needs: the shard's device, dtype and dims (n: the local
    length, every rank the same), the call's mask and gradient needs, the reasons our Triton
    kernels decline these tensors, and `kernel`, what the caller asked for ("auto", "torch",
    "triton" or "cudnn")."""

    device_type: str
    device_index: Optional[int]
    dtype: torch.dtype
    q_heads: int
    kv_heads: int
    n: int
    head_dim: int
    value_dim: int
    causal: bool
    needs_grad: bool
    deterministic: bool
    triton_reasons: tuple[str, ...]
    kernel: str = "auto"
    softcap: float = 0.0  # logit soft-capping c of every block's scores (problem.Modifiers), 0.0: none

    def describe(self) -> str:
        device = self.device_type + (f":{self.device_index}" if self.device_index is not None else "")
        parts = [f"ring block on {device}", str(self.dtype).replace("torch.", ""),
                 f"Hq={self.q_heads} Hkv={self.kv_heads}", f"shard n={self.n}", f"D={self.head_dim}"]
        if self.value_dim != self.head_dim:
            parts.append(f"Dv={self.value_dim}")
        parts.append("causal" if self.causal else "full")
        if self.needs_grad:
            parts.append("grad")
        if self.deterministic:
            parts.append("deterministic")
        if self.softcap:
            parts.append(f"softcap={self.softcap:g}")
        parts.append(f"kernel={self.kernel!r}")
        return ", ".join(parts)

    def shard(self) -> Problem:
        """A dense shard-against-shard call of this class, as the planner sees one."""
        return _shard_problem(self.device_type, self.device_index, self.dtype, self.q_heads, self.kv_heads, self.n,
                              self.head_dim, self.value_dim, self.causal, self.needs_grad)


def ring_block_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, kernel: str = "auto",
                       deterministic: bool = False, softcap: float = 0.0) -> RingBlockProblem:
    """The RingBlockProblem of one rank's shards q (B, Hq, n, D), k (B, Hkv, n, D), v (B, Hkv, n, Dv):
    gradients are needed where grad mode is on and an input requires grad; the backward is
    deterministic where `deterministic` or torch's deterministic algorithms are on."""
    return RingBlockProblem(
        device_type=q.device.type, device_index=q.device.index, dtype=q.dtype, q_heads=q.shape[1],
        kv_heads=k.shape[1], n=q.shape[2], head_dim=q.shape[-1], value_dim=v.shape[-1], causal=bool(causal),
        needs_grad=torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
        deterministic=bool(deterministic) or torch.are_deterministic_algorithms_enabled(),
        triton_reasons=tuple(triton_reasons(q.device.type, q.device.index, q.dtype, q.shape[-1], v.shape[-1])),
        kernel=kernel, softcap=float(softcap or 0.0))


@functools.lru_cache(maxsize=256)
def _shard_problem(device_type, device_index, dtype, q_heads, kv_heads, n, head_dim, value_dim, causal,
                   needs_grad) -> Problem:
    return Problem(batch=1, q_heads=q_heads, kv_heads=kv_heads, q_len=n, kv_len=n, head_dim=head_dim,
                   value_dim=value_dim, dtype=dtype, device_type=device_type, device_index=device_index,
                   causal=causal, window_left=-1, window_right=-1, mask_kind="none", dropout_p=0.0,
                   scale=default_scale(head_dim), needs_grad=needs_grad, gqa=q_heads != kv_heads, tma_aligned=True)


@functools.lru_cache(maxsize=256)
def _band_problem(device_type, device_index, dtype, head_dim, value_dim, windowed, aligned, positive) -> Problem:
    """A band of this class as our Triton forward variants' limits read it."""
    return Problem(batch=1, q_heads=1, kv_heads=1, q_len=1, kv_len=1, head_dim=head_dim, value_dim=value_dim,
                   dtype=dtype, device_type=device_type, device_index=device_index, causal=True,
                   window_left=0 if windowed else -1, window_right=-1, mask_kind="none", dropout_p=0.0,
                   scale=1.0 if positive else -1.0, needs_grad=False, tma_aligned=aligned)


class BandVariants:
    """The fastest of our Triton forward variants that takes a band, by band class (cached):
    `choose(band Problem) -> "ws" | "tma" | "ptr"` is the planner's (it asks its Triton runners)."""

    def __init__(self, choose: Callable[[Problem], str]):
        self.choose = choose
        self.cache: dict = {}

    def __call__(self, q, k, v, scale, left, right) -> str:
        key = (q.device.type, q.device.index, q.dtype, q.shape[-1], v.shape[-1], left >= 0 or right > 0,
               tma_aligned(q, k, v), scale > 0)
        got = self.cache.get(key)
        if got is None:
            if len(self.cache) >= 256:
                self.cache.clear()
            got = self.cache[key] = self.choose(_band_problem(*key))
        return got


# ----------------------------------------------------------------------------- the runners


class TorchRingBlocks:
    name = "ring.torch"
    exact = True

    def supports(self, problem: RingBlockProblem, policy: Optional[Policy] = None) -> list[str]:
        return []

    def why(self, problem: RingBlockProblem) -> str:
        if problem.device_type != "cuda":
            return (f"torch math on {problem.device_type} tensors (our Triton kernels run off CUDA only in the "
                    "interpreter, for tests)")
        return "our Triton kernels decline these tensors: " + " ".join(problem.triton_reasons)

    def engine(self, problem: RingBlockProblem) -> "TorchBlocks":
        return TorchBlocks(problem.dtype, problem.softcap)


class TritonRingBlocks:
    name = "ring.triton"
    exact = True

    def __init__(self, variants: BandVariants):
        self.variants = variants

    def supports(self, problem: RingBlockProblem, policy: Optional[Policy] = None) -> list[str]:
        return list(problem.triton_reasons)

    def why(self, problem: RingBlockProblem) -> str:
        return ("our Triton forward and backward kernels take every band (cuDNN's go first only where the planner "
                "runs sdpa.cudnn for a dense call of the shard's shape)")

    def engine(self, problem: RingBlockProblem) -> "TritonBlocks":
        return TritonBlocks(problem.dtype, problem.deterministic, self.variants, problem.softcap)


class CudnnRingBlocks:
    name = "ring.cudnn"
    exact = True

    def __init__(self, sdpa_cudnn_reasons: Callable[[Problem], list], variants: BandVariants):
        self.sdpa_cudnn_reasons = sdpa_cudnn_reasons  # the planner's sdpa.cudnn runner's reasons for a Problem
        self.variants = variants
        self._cudnn: dict = {}

    def _cudnn_reasons(self, shard: Problem, deterministic: bool) -> tuple[str, ...]:
        """Why cuDNN's fused op cannot run blocks of this class: the sdpa.cudnn runner's declared
        limits for a dense shard-sized call, and what the aten op the blocks call adds (cached)."""
        got = self._cudnn.get((shard, deterministic))
        if got is None:
            reasons = [f"sdpa.cudnn {r}" for r in self.sdpa_cudnn_reasons(shard)]
            if shard.head_dim % 8:
                reasons.append(f"cuDNN's fused op takes head dims in multiples of 8, not {shard.head_dim}.")
            if deterministic:
                reasons.append("a deterministic backward was asked for; cuDNN's is not documented as one.")
            if len(self._cudnn) >= 256:
                self._cudnn.clear()
            got = self._cudnn[(shard, deterministic)] = tuple(reasons)
        return got

    def supports(self, problem: RingBlockProblem, policy: Optional[Policy] = None) -> list[str]:
        """cuDNN's limits for a dense shard-sized call, and our Triton kernels' (they take the
        bands cuDNN does not)."""
        reasons = list(self._cudnn_reasons(problem.shard(), problem.deterministic))
        if problem.softcap:
            reasons.append("cuDNN's fused op applies no softcap (score modifiers).")
        return reasons + [f"The Triton blocks (for the other bands): {r}" for r in problem.triton_reasons]

    def why(self, problem: RingBlockProblem) -> str:
        return ("the planner runs sdpa.cudnn for a dense call of the shard's shape: cuDNN's fused kernel takes the "
                "full and square causal bands, our Triton kernels the others")

    def engine(self, problem: RingBlockProblem) -> "CudnnBlocks":
        return CudnnBlocks(problem.dtype, problem.deterministic, self.variants)


def ring_block_runners(sdpa_cudnn_reasons: Callable[[Problem], list], triton_variant: Callable[[Problem], str]) -> list:
    """ring.torch, ring.triton and ring.cudnn. sdpa_cudnn_reasons(problem): the sdpa.cudnn runner's
    reasons; triton_variant(band problem): the first of our Triton forward variants that takes it."""
    variants = BandVariants(triton_variant)
    return [TorchRingBlocks(), TritonRingBlocks(variants), CudnnRingBlocks(sdpa_cudnn_reasons, variants)]


# ----------------------------------------------------------------------------- the engines


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def band_keep(n: int, m: int, left: int, right: int, device) -> Optional[torch.Tensor]:
    """Bool (n, m), True where key j is visible to row i (-left <= j - i <= right, -1: unbounded);
    None: all."""
    return position_keep(n, m, False, (None if left < 0 else left, None if right < 0 else right), device)


def lse_merge(out, lse, block_out, block_lse):
    """Exact log-sum-exp merge of two partial results (rows with lse = -inf on both stay 0)."""
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(torch.isneginf(new), 0.0)
    out = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return out, new


class TorchBlocks:
    """A block in torch math, in float32 (float64 for float64 inputs): correct on every device."""

    name = ran = "torch"

    def __init__(self, dtype: torch.dtype, softcap: float = 0.0):
        self.cdt = _compute_dtype(dtype)
        self.softcap = softcap  # scores c * tanh(s / c) before the band's mask (0.0: none)

    def _scores(self, q, k, scale, left, right):
        b, hq, n, d = q.shape
        hk = k.shape[1]
        qg = q.to(self.cdt).reshape(b, hk, hq // hk, n, d)
        s = torch.matmul(qg, k.to(self.cdt).unsqueeze(2).transpose(-2, -1)) * scale
        if self.softcap:
            s = torch.tanh(s / self.softcap) * self.softcap
        mask = band_keep(n, k.shape[2], left, right, q.device)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return qg, s

    def forward(self, q, k, v, scale, left, right):
        """(out, lse) of q (B, Hq, n, D) against k/v (B, Hkv, m, D/Dv), lse in natural log;
        a row that sees no key gives out 0 and lse -inf."""
        b, hq, n, _ = q.shape
        _, s = self._scores(q, k, scale, left, right)
        row_max = s.amax(dim=-1, keepdim=True)
        row_max = row_max.masked_fill(torch.isneginf(row_max), 0.0)
        p = torch.exp(s - row_max)
        denom = p.sum(dim=-1, keepdim=True)
        out = torch.matmul(p, v.to(self.cdt).unsqueeze(2)) / denom.masked_fill(denom == 0, 1.0)
        lse = (row_max + torch.log(denom)).squeeze(-1)
        return out.reshape(b, hq, n, v.shape[-1]), lse.reshape(b, hq, n)

    def merge(self, out, lse, block_out, block_lse) -> None:
        """out/lse (views of the accumulators) become their merge with the block's, in place."""
        new_out, new_lse = lse_merge(out, lse, block_out.to(self.cdt), block_lse.to(self.cdt))
        out.copy_(new_out)
        lse.copy_(new_lse)

    def backward(self, q, k, v, dout, out, lse, scale, left, right):
        """(dq, dk, dv) of the block from the GLOBAL lse and out of its rows: delta =
        rowsum(dout * out), P = exp(S*scale - lse), dS = P * (dout @ v^T - delta); dk/dv summed
        over each group."""
        b, hq, n, d = q.shape
        hk, dv_dim = k.shape[1], v.shape[-1]
        g = hq // hk
        delta = (dout.to(self.cdt) * out.to(self.cdt)).sum(-1)
        qg, s = self._scores(q, k, scale, left, right)
        lse_g = lse.to(self.cdt).reshape(b, hk, g, n, 1)
        lse_g = lse_g.masked_fill(torch.isneginf(lse_g), float("inf"))
        p = torch.exp(s - lse_g)
        dog = dout.to(self.cdt).reshape(b, hk, g, n, dv_dim)
        dv = torch.matmul(p.transpose(-2, -1), dog).sum(2)
        dp = torch.matmul(dog, v.to(self.cdt).unsqueeze(2).transpose(-2, -1))
        ds = p * (dp - delta.reshape(b, hk, g, n, 1))
        if self.softcap:  # through the cap: 1 - tanh^2 (masked scores have p = 0)
            t = torch.where(torch.isfinite(s), s / self.softcap, 0.0)
            ds = ds * (1.0 - t * t)
        dq = torch.matmul(ds, k.to(self.cdt).unsqueeze(2)).reshape(b, hq, n, d) * scale
        dk = torch.matmul(ds.transpose(-2, -1), qg).sum(2) * scale
        return dq, dk, dv


def _fail_once(engine: type, error: BaseException, what: str, then: str) -> None:
    """A block engine's run-time failure: re-raised where no fallback can mend it, else one
    warning per engine class, which then hands its blocks on for the rest of the process."""
    if isinstance(error, NOT_RECOVERABLE):
        raise error
    if not engine.failed:
        engine.failed = True
        warnings.warn(f"adaattn.distributed: {what} failed ({type(error).__name__}: {str(error).strip()[:200]}); "
                      f"blocks run in {then} from now on", RuntimeWarning, stacklevel=5)


class TritonBlocks:
    """A block through our Triton forward and backward kernels (natural-log lse, fp32); a kernel
    that fails hands that block, and the rest of the process's blocks, to torch math with one
    warning."""

    name = "triton"
    failed = False

    def __init__(self, dtype: torch.dtype, deterministic: bool, variants: BandVariants, softcap: float = 0.0):
        self.cdt = torch.float32
        self.deterministic = deterministic
        self.variants = variants  # the forward variant of each band
        self.softcap = softcap  # (the pointer kernels apply it: bands then run on them)
        self.fallback = TorchBlocks(dtype, softcap)

    @property
    def ran(self) -> str:
        """The engine that runs this one's blocks now (after a failure, its fallback's)."""
        return self.fallback.ran if TritonBlocks.failed else self.name

    def _launch(self, q, k, v, scale, left, right):
        variant = "ptr" if self.softcap else self.variants(q, k, v, scale, left, right)
        return make_launch(variant, scale, right == 0, left, -1 if right == 0 else right, False,
                           self.deterministic, self.softcap)

    def _failed(self, error: BaseException) -> None:
        _fail_once(TritonBlocks, error, "the Triton block kernels", "torch math")

    def forward(self, q, k, v, scale, left, right):
        if not TritonBlocks.failed:
            try:
                return launch_fwd(q, k, v, None, None, None, q.shape[2], k.shape[2],
                                  self._launch(q, k, v, scale, left, right))
            except Exception as e:  # a kernel failure: fall back, once, loudly
                self._failed(e)
        return self.fallback.forward(q, k, v, scale, left, right)

    def merge(self, out, lse, block_out, block_lse) -> None:
        if not TritonBlocks.failed:
            try:
                return merge_into(out, lse, block_out, block_lse)
            except Exception as e:
                self._failed(e)
        self.fallback.merge(out, lse, block_out, block_lse)

    def backward(self, q, k, v, dout, out, lse, scale, left, right):
        if not TritonBlocks.failed:
            try:
                return launch_bwd(dout, q, k, v, out, lse.contiguous(), None, None, None, q.shape[2], k.shape[2],
                                  self._launch(q, k, v, scale, left, right))
            except Exception as e:
                self._failed(e)
        return self.fallback.backward(q, k, v, dout, out, lse, scale, left, right)


class CudnnBlocks:
    """Blocks through cuDNN's fused attention (torch's `_scaled_dot_product_cudnn_attention` op,
    which returns the natural-log lse, and its backward, which takes a pair's GLOBAL out and lse
    as the Triton backward does). cuDNN takes a full block or a square causal one; every other
    band (windows, trimmed causal bands) goes to the Triton blocks. A cuDNN failure hands that
    block, and the rest of the process's cuDNN blocks, to the Triton blocks with one warning.
    GQA goes in natively where the op takes it, else with K/V repeated to the query heads for
    the block (a copy of one shard's K/V, small against the block's work)."""

    name = "cudnn"
    failed = False
    # Whether the op takes Hq != Hkv, learned on the first GQA block of the process, forward and
    # backward apart.
    native_gqa: dict = {"fwd": None, "bwd": None}

    def __init__(self, dtype: torch.dtype, deterministic: bool, variants: BandVariants):
        self.cdt = torch.float32
        self.triton = TritonBlocks(dtype, deterministic, variants)

    @property
    def ran(self) -> str:
        return self.triton.ran if CudnnBlocks.failed else self.name

    @staticmethod
    def _takes(q, k, v, scale, left, right) -> bool:
        """A full or square causal block, with a positive scale (torch's fused kernels give NaN for
        is_causal with a scale <= 0, as backends/sdpa.py notes), and equal q/v head dims."""
        full = left < 0 and right < 0
        square_causal = left < 0 and right == 0 and q.shape[2] == k.shape[2]
        return ((full or square_causal) and scale > 0 and q.shape[2] > 0 and k.shape[2] > 0
                and v.shape[-1] == q.shape[-1])

    def _failed(self, error: BaseException) -> None:
        _fail_once(CudnnBlocks, error, "the cuDNN block kernel", "our Triton kernels")

    def _gqa(self, kind: str, fn, q, k, v):
        """fn(q, k, v) with K/V as cuDNN takes them: natively where it can, else repeated (a
        backward's dk/dv are then summed back over each group). kind: "fwd" or "bwd"."""
        group = q.shape[1] // k.shape[1]
        if group == 1:
            return fn(q, k, v)
        native = CudnnBlocks.native_gqa
        if native[kind] is not False:
            try:
                got = fn(q, k, v)
                native[kind] = True
                return got
            except RuntimeError as e:
                if native[kind] or isinstance(e, NOT_RECOVERABLE):  # not a refusal of GQA
                    raise
                native[kind] = False
        got = fn(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        if kind == "bwd":
            dq, dk, dv = got
            b, _, m, d = dk.shape
            return dq, dk.view(b, -1, group, m, d).sum(2), dv.view(b, -1, group, m, dv.shape[-1]).sum(2)
        return got

    @staticmethod
    def _fwd(q, k, v, scale, causal):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        return out, lse.reshape(q.shape[:3]).contiguous()

    @staticmethod
    def _bwd(q, k, v, dout, out, lse, scale, causal):
        seed = torch.empty((), dtype=torch.long, device=q.device)
        return tuple(torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.contiguous().unsqueeze(-1), seed, seed, None, None, None, q.shape[2],
            k.shape[2], 0.0, causal, scale=scale))

    def forward(self, q, k, v, scale, left, right):
        if not CudnnBlocks.failed and self._takes(q, k, v, scale, left, right):
            try:
                return self._gqa("fwd", lambda a, b, c: self._fwd(a, b, c, scale, right == 0), q, k, v)
            except Exception as e:  # a kernel failure: fall back, once, loudly
                self._failed(e)
        return self.triton.forward(q, k, v, scale, left, right)

    def merge(self, out, lse, block_out, block_lse) -> None:
        self.triton.merge(out, lse, block_out, block_lse)

    def backward(self, q, k, v, dout, out, lse, scale, left, right):
        # At exactly CUDNN_NAN_KEYS keys cuDNN's backward gave NaN dq on rows of a low log-sum-exp
        # (sdpa_forms): such blocks (a zigzag shard of 128 splits into 64-key blocks) take ours.
        if (not CudnnBlocks.failed and k.shape[2] != CUDNN_NAN_KEYS
                and self._takes(q, k, v, scale, left, right)):
            try:
                return self._gqa("bwd", lambda a, b, c: self._bwd(a, b, c, dout, out, lse, scale, right == 0),
                                 q, k, v)
            except Exception as e:
                self._failed(e)
        return self.triton.backward(q, k, v, dout, out, lse, scale, left, right)
