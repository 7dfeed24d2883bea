"""torch's scaled_dot_product_attention, each of its kernels addressable on its own.

`sdpa.cpu` lets torch choose on the CPU; on CUDA each of `sdpa.cudnn`, `sdpa.flash`,
`sdpa.efficient` and `sdpa.math` pins one kernel, so the dispatcher (not torch's heuristics)
decides, from measured data, which one runs.

Where a call needs no mask, window, dropout or GQA, the pinned kernel is called as the aten
op SDPA itself would call: `sdpa_kernel(...)` costs tens of microseconds per call, which is
more than the whole kernel at short lengths.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import hardware
from .base import Declined, Runner, no_keys
from ..problem import SMALL_SCORES
from .masks import fold_positions
from .sdpa_forms import (CUDNN_NAN_KEYS, CUDNN_NAN_REASON, CUDNN_VERSION, CUDNN_WIDE, DROWN_EPS, EFFICIENT_LOW_PEAK,
                         F32_ALIGN_DIM, FUSED, HALF, LOW_PEAK, _GradTimes, cudnn_bias, dim_unit, drowned_rows,
                         efficient_bias, fused_form, fused_ready, padded_dim)


_CAN_USE = {
    SDPBackend.CUDNN_ATTENTION: "can_use_cudnn_attention",
    SDPBackend.FLASH_ATTENTION: "can_use_flash_attention",
    SDPBackend.EFFICIENT_ATTENTION: "can_use_efficient_attention",
}


def _direct_dims(problem) -> bool:
    """Head dims the aten ops take as they come: equal, multiples of 8."""
    return problem.head_dim % 8 == 0 and problem.value_dim == problem.head_dim


# cuDNN's float16 backward with a mask or window gave non-finite gradients from scale 0.5 up (2 of
# 16 random inputs at 0.5, 1-12 of 16 at 0.7 to 1.7) and none at 0.1 to 0.35 (6 forms, benchmarks/
# NOTES.md, "Session 40"; seed 5415 #16352, H200). Under this scale it runs them, as torch's default
# does, whose gradients there are 2.8x more accurate than the efficient kernel's (seed 5200 #3423:
# dq 2.3e-4 against 6.5e-4).
CUDNN_HALF_MASKED_GRAD_SCALE = 0.25


class _Route:
    """A planned SDPA call's route (SdpaRunner.prepare)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"sdpa route {self.name}"


DIRECT, PLAIN = _Route("direct"), _Route("plain")


class SdpaRunner(Runner):
    """One SDPA kernel. `kernel` None means torch's own choice (used on the CPU)."""

    def __init__(
        self,
        name: str,
        kernel: SDPBackend | None,
        device_type: str,
        dtypes: tuple[torch.dtype, ...],
        min_capability: tuple[int, int] = (0, 0),
        max_head_dim: int | None = None,
        masks: bool = True,
        dropout: bool = True,
        native_gqa: bool = True,
        causal_unequal: bool = True,
        value_dim_differs: bool = True,
        empty: bool = True,
        direct=None,
        masks_reason: str = "takes no attn_mask.",
        gqa_masks_reason: str | None = None,
    ):
        self.name = name
        self.kernel = kernel
        self.takes_call_form = kernel is None and device_type == "cpu"
        self.device_type = device_type
        self.dtypes = dtypes
        self.min_capability = min_capability
        self.max_head_dim = max_head_dim
        self.masks = masks
        self.dropout = dropout
        self.native_gqa = native_gqa
        self.causal_unequal = causal_unequal
        self.value_dim_differs = value_dim_differs
        self.empty = empty
        self.direct = direct
        self.masks_reason = masks_reason
        self.gqa_masks_reason = gqa_masks_reason

    def supports(self, problem, policy) -> list[str]:
        reasons = []
        if problem.device_type != self.device_type:
            reasons.append(f"runs on {self.device_type} tensors only, got {problem.device_type}.")
            return reasons
        if problem.dtype not in self.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            reasons.append(f"dtype {str(problem.dtype).replace('torch.', '')} not supported (takes {names}).")
        if self.device_type == "cuda" and self.min_capability > (0, 0):
            if not hardware.capability_at_least(problem.device_index, *self.min_capability):
                need = "sm{}{}".format(*self.min_capability)
                reasons.append(f"needs compute capability {need} or newer, this GPU is "
                               f"{hardware.arch('cuda', problem.device_index)}.")
        if self.max_head_dim is not None and max(problem.head_dim, problem.value_dim) > self.max_head_dim:
            reasons.append(f"head_dim {max(problem.head_dim, problem.value_dim)} exceeds its limit {self.max_head_dim}.")
        if not self.value_dim_differs and problem.value_dim != problem.head_dim:
            reasons.append("value head_dim differs from query/key head_dim.")
        if not self.masks:
            if problem.mask_kind != "none":
                reasons.append(self.masks_reason)
            if problem.window is not None:
                reasons.append("has no sliding window, and cannot take the mask that would emulate one.")
        # At a scale <= 0 torch's flash and cuDNN kernels give NaN; its efficient kernel stays finite
        # (pinned at -0.5 and 0, causal or not, H200, torch 2.11). In float32 it is torch's own choice
        # there (math's dk was 3.1x its error: seed 5200 #17645). In half precision torch's choice is
        # flash or cuDNN, whose NaN leaves its math kernel as the answer; the efficient kernel's
        # gradients were 2.4x math's there (seed 20261127 #410, #1965), so math runs.
        efficient_f32 = self.kernel == SDPBackend.EFFICIENT_ATTENTION and problem.dtype == torch.float32
        if self.kernel in FUSED and not efficient_f32 and not problem.scale > 0:
            reasons.append("needs a positive scale (the efficient kernel, in float32, takes any): torch's flash and "
                           "cuDNN kernels gave NaN outputs and gradients at a scale <= 0, and in half precision the "
                           "efficient kernel's gradients there were 2.4x math's (a CUDA fuzzer, H200, torch 2.11).")
        if self.kernel == SDPBackend.CUDNN_ATTENTION and problem.mask_grad:
            reasons.append("gives no gradient for an attn_mask (its backward returns dq, dk and dv only).")
        if self.kernel == SDPBackend.CUDNN_ATTENTION and problem.needs_grad:
            # Both refusals surface only in the backward, after the forward ran: no fallback there.
            if problem.q_len == 1 and problem.kv_len == 1:
                reasons.append("has no backward for one query against one key (cuDNN: 's_q = s_kv = 1 is not "
                               "supported'; a CUDA fuzzer, H200, torch 2.11).")
            if (problem.dtype == torch.float16 and (problem.mask_kind != "none" or problem.window is not None)
                    and problem.scale >= CUDNN_HALF_MASKED_GRAD_SCALE):
                reasons.append(f"gave inf gradients in float16 with a mask or window from scale 0.5 up (2-12 of 16 "
                               f"random inputs; none at 0.35 and below; torch's own choice alike; bfloat16 and "
                               f"unmasked calls stayed finite: CUDA fuzzer seed 5415 #16352, H200, torch 2.11): it "
                               f"takes such calls at scales under {CUDNN_HALF_MASKED_GRAD_SCALE:g} (here "
                               f"{problem.scale:.3g}).")
            if problem.kv_len == CUDNN_NAN_KEYS:
                reasons.append(CUDNN_NAN_REASON)
            if CUDNN_VERSION in (91000, 91001):
                reasons.append("has no half-precision backward on cuDNN 9.10.0 and 9.10.1 (known bugs; cuDNN "
                               "refuses the graph): upgrade to 9.10.2 or newer.")
        if self.kernel == SDPBackend.EFFICIENT_ATTENTION and problem.mask_grad:
            reasons.append("gives no safe gradient for an attn_mask: its backward faulted (illegal memory access) "
                           "on broadcast masks, and raised where q, k and v need none (a CUDA fuzzer, H200, "
                           "torch 2.11).")
        unit = dim_unit(self.kernel, problem.dtype)
        padded = problem.head_dim % unit or problem.value_dim % unit
        if self.kernel in FUSED and problem.needs_grad and padded:
            reasons.append(f"takes gradients at head dims that are multiples of {unit} only: at others torch runs "
                           "its math kernel, and this kernel's gradients on padded copies were 2-10x its error (a "
                           "CUDA fuzzer, H200, torch 2.11).")
        if self.kernel in FUSED and problem.needs_grad and problem.out_lead is not None:
            reasons.append("takes 4-D tensors: for other ranks torch runs its math kernel, whose gradients were "
                           "2-4x more accurate than this kernel's on the flattened call (a CUDA fuzzer, H200, "
                           "torch 2.11).")
        elif self.kernel in FUSED and problem.out_lead is not None and problem.scores <= SMALL_SCORES:
            # Above SMALL_SCORES the fused kernel's speed and memory pay, at its usual error.
            reasons.append(f"takes 4-D tensors, or calls of more than {SMALL_SCORES} scores: for other ranks torch "
                           "runs its math kernel, whose half-precision outputs were 2.4-3.2x more accurate than this "
                           "kernel's on the flattened call (a CUDA fuzzer, H200, torch 2.11).")
        if self.kernel == SDPBackend.EFFICIENT_ATTENTION and problem.dtype == torch.float32 and (
                problem.gqa or problem.out_lead is not None
                or problem.head_dim % F32_ALIGN_DIM or problem.value_dim % F32_ALIGN_DIM):
            reasons.append(f"takes float32 only as torch does: 4-D, without GQA, head dims multiples of {F32_ALIGN_DIM} "
                           "(its 16-byte rows). Elsewhere torch runs its math kernel, whose float32 outputs and "
                           "gradients were 3-600x more accurate than this kernel's on repeated heads, a flattened call "
                           "or padded head dims (a CUDA fuzzer, H100 and H200, torch 2.11).")
        if self.gqa_masks_reason and problem.gqa and (problem.mask_kind != "none" or problem.window is not None):
            reasons.append(self.gqa_masks_reason)
        if not self.dropout and problem.dropout_p > 0:
            reasons.append("does not implement dropout.")
        if not self.causal_unequal and problem.causal and problem.q_len != problem.kv_len:
            reasons.append("causal with q_len != k_len would not be top-left aligned as SDPA defines it.")
        if not self.empty and (problem.q_len == 0 or problem.kv_len == 0):
            reasons.append("does not take empty sequences.")
        if not self.empty and (problem.head_dim == 0 or problem.value_dim == 0):
            reasons.append("does not take head_dim 0.")
        if (self.kernel is not None and problem.mask_dtype is not None and problem.mask_dtype != problem.dtype
                and self.kernel != SDPBackend.MATH):
            reasons.append("takes an additive mask in the query dtype only.")
        if problem.varlen:
            reasons.append("takes dense (B, H, N, D) tensors, not packed sequences.")
        return reasons

    def prepare(self, problem, policy):
        """The route of a planned call, decided once from the problem (run's checks all read the
        problem alone): DIRECT (the aten op SDPA itself would call, on the tensors as they are),
        PLAIN (torch's own SDPA on the CPU, the tensors and arguments as they are) or None (run
        decides each call: folds, fused forms, copies). A plan serves its whole shape class, so the
        route reads only what the class fixes (an empty sequence is one flag there: either side's)."""
        if problem.kv_len == 0 or problem.q_len == 0:
            return None
        if self.kernel is None:
            plain = (self.device_type == "cpu" and problem.out_lead is None and problem.window is None
                     and not (problem.causal and (problem.mask_kind != "none" or problem.scale <= 0))
                     and not (problem.needs_grad and problem.mask_kind == "additive"))  # drowned rows: _run
            return PLAIN if plain else None
        if self.kernel in FUSED and self._loadable(problem) and self._direct_ok(problem, _direct_dims(problem)):
            return DIRECT
        return None

    def run(self, query, key, value, attn_mask, problem, launch, label=None):
        if self.kernel is None and attn_mask is not None and attn_mask.dtype == torch.float32 \
                and query.dtype == torch.float64:
            # torch's fused CPU kernel takes a float32 mask with float64 queries and answers wrongly
            # (1.6 relative against float64 on plain random inputs, torch 2.13; CPU fuzz seed 5833
            # #64792: 1.0 and inf gradients, where its math kernel is right). The mask goes in as
            # float64, exactly the same values.
            attn_mask = attn_mask.to(torch.float64)
        # The steady path: a route decided at planning (prepare); under torch.compile, the checks below.
        if launch is DIRECT and not torch.compiler.is_compiling():
            return self._direct(query, key, value, problem)
        if launch is PLAIN:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=problem.dropout_p,
                                                  is_causal=problem.causal, scale=problem.scale,
                                                  enable_gqa=problem.gqa)
        if problem.kv_len == 0:  # no key: every row is zero (see base.NoKeys)
            return no_keys(query, key, value, attn_mask)
        # torch on the CPU runs its math kernel for inputs that are not plain 4-D (or broadcast
        # along a leading dim): the fused CPU kernel needs equal 4-D shapes. Those inputs come
        # here flattened to 4-D, where torch would pick the fused one, whose half-precision
        # gradients are 2-200x less accurate: keep torch's choice (a fuzzer compared the two).
        # Likewise causal calls at a scale <= 0, which torch's fused CPU kernel answers with NaN
        # (its math kernel is the answer torch can give; they reach us with a folded mask).
        # With a mask or a window as well, causal goes in folded into the mask, which the fused
        # kernel takes at any scale: torch's choice for that mask (seed 4700 #51284: math's float32
        # dk was 2.4x the fused kernel's at logits x100).
        if self.kernel == SDPBackend.MATH and not torch.compiler.is_compiling() and not problem.tma_aligned:
            # torch's SDPA runs its math kernel on views its fused kernels cannot load; the same
            # call on aligned copies (what the fused kernels take) gave float32 gradients 8x more
            # accurate at logits x100 (seed 5300 #19290): math runs on such copies too.
            query, key, value = (t if fused_ready(t) else t.clone(memory_format=torch.contiguous_format)
                                 for t in (query, key, value))
        causal_alone = problem.causal and problem.mask_kind == "none" and problem.window is None
        math_like_torch = self.kernel is None and query.device.type == "cpu" and (
            problem.out_lead is not None or (causal_alone and problem.scale <= 0))
        if math_like_torch:
            with sdpa_kernel(SDPBackend.MATH):
                return self._run(query, key, value, attn_mask, problem)
        # Under torch.compile data pointers cannot be read (problem.tma_aligned is False there):
        # the compiled graph's tensors go to the kernel as they are.
        if self.kernel in FUSED and not self._loadable(problem) and not torch.compiler.is_compiling():
            return self._run_fused_form(query, key, value, attn_mask, problem)
        if self._direct_ok(problem, _direct_dims(problem)):
            return self._direct(query, key, value, problem)
        return self._run(query, key, value, attn_mask, problem)

    def _loadable(self, problem) -> bool:
        """Whether the fused kernel loads q, k and v as they are (aligned views, head dims of whole
        rows for it): else it runs on fused_form copies."""
        unit = dim_unit(self.kernel, problem.dtype)
        return problem.tma_aligned and problem.head_dim % unit == 0 and problem.value_dim % unit == 0

    def _direct_ok(self, problem, dims_ok: bool) -> bool:
        """Whether the call may go to the aten op SDPA itself would call (no mask, window, GQA or
        dropout; `dims_ok`: head dims the op takes as they come)."""
        return (self.direct is not None and problem.mask_kind == "none" and problem.window is None
                and not problem.gqa and problem.dropout_p == 0.0 and dims_ok  # (the scale: supports)
                and not torch.compiler.is_compiling())  # dynamo cannot wrap these ops' SymInt outputs

    def _direct(self, query, key, value, problem):
        try:  # (as _refusals_decline, without a context manager's cost: this is the steady path)
            return self.direct(query, key, value, problem)
        except RuntimeError as e:
            if any(w in str(e) for w in KERNEL_SELECTION_REFUSALS):
                raise Declined(f"{self.name}: {e}") from e
            raise

    @contextlib.contextmanager
    def _refusals_decline(self):
        """A refusal of the kernel's host-side selection (KERNEL_SELECTION_REFUSALS) becomes Declined."""
        try:
            yield
        except RuntimeError as e:
            if any(w in str(e) for w in KERNEL_SELECTION_REFUSALS):
                raise Declined(f"{self.name}: {e}") from e
            raise

    def _run_fused_form(self, query, key, value, attn_mask, problem):
        """A call whose q, k or v a fused kernel cannot load as they are (a last-dim slice at an
        odd offset, a transposed last dim, a head dim of part vectors): run it on `fused_form`
        copies, the value's padding sliced off the output."""
        unit = dim_unit(self.kernel, problem.dtype)
        width, value_width = padded_dim(problem.head_dim, unit), padded_dim(problem.value_dim, unit)
        if not self.value_dim_differs:
            width = value_width = max(width, value_width)
        q, k, v = (fused_form(query, width, unit), fused_form(key, width, unit),
                   fused_form(value, value_width, unit))
        direct = self._direct_ok(problem, width == value_width)
        out = self._direct(q, k, v, problem) if direct else self._run(q, k, v, attn_mask, problem)
        return out[..., :problem.value_dim] if value_width != problem.value_dim else out

    def _check(self, query, key, value, attn_mask, dropout_p, causal, gqa):
        """torch's own checks for the pinned kernel, on these tensors (strides, alignment, the mask's
        layout: what a Problem does not hold), before the launch: where they say no, the next runner
        takes the call (Declined) instead of a refusal at launch and a warning."""
        import torch.backends.cuda as tbc

        if torch.compiler.is_compiling():  # not traceable; a compiled graph keeps its tensors' layouts
            return
        can_use = getattr(tbc, _CAN_USE[self.kernel], None)
        if can_use is None or not hasattr(tbc, "SDPAParams"):
            return
        try:
            params = tbc.SDPAParams(query, key, value, attn_mask, dropout_p, causal, gqa)
        except TypeError:  # a torch whose SDPAParams takes other arguments: the launch decides
            return
        if not can_use(params, False):
            raise Declined(f"{self.name}: torch's checks refuse these tensors")

    def _run(self, query, key, value, attn_mask, problem):
        causal = problem.causal
        # A non-positive scale with is_causal gives NaN in torch's kernels (CPU math and fused,
        # torch 2.13): the causal mask goes in as a boolean mask instead.
        # The efficient kernel takes is_causal at any scale (see supports).
        scale_folds = problem.scale <= 0 and self.kernel != SDPBackend.EFFICIENT_ATTENTION
        if problem.window is not None or (causal and (attn_mask is not None or scale_folds)):
            attn_mask = fold_positions(
                attn_mask, problem.q_len, problem.kv_len, causal, problem.window, query.device, query.dtype
            )
            causal = False
        if problem.needs_grad and attn_mask is not None and attn_mask.dtype != torch.bool \
                and self._lse_backward(query, key, value, attn_mask, problem):
            # With gradients, finite values are not floored (finite_floor): the kernel's backward
            # recomputes the weights from the row's log-sum-exp, which a floored row loses (inf
            # gradients in bfloat16, 3x torch's error in float32: a CUDA fuzzer, H100). On the CPU,
            # torch's own gradients of rows of finfo.min were 2.7-4.6 relative (float32, bfloat16).
            # Under torch.compile drowned_rows shifts without a read and names no drowned row.
            # The efficient kernel's backward took rows of -1e4 as they are (torch's own, #132); shifted
            # to peak at 0, one query against one key of -1e4 gave float32 dv 16x torch's error (its
            # backward recomputed the score an ulp off the forward's, at a weight of exactly 1: seed
            # 5418 #2950, H200). Its rows move from EFFICIENT_LOW_PEAK down, where float32 loses the
            # scores beside the bias (at -1e9 a spacing of 64: uniform weights, lse without log n).
            low_peak = EFFICIENT_LOW_PEAK if self.kernel == SDPBackend.EFFICIENT_ATTENTION else LOW_PEAK
            shifted, rows = drowned_rows(attn_mask, low_peak)
            if rows is not None:
                return self._run_drowned(query, key, value, shifted, rows, problem)
            if (shifted is not attn_mask and self.kernel is None and query.dtype in HALF
                    and not torch.compiler.is_compiling()):
                # On the CPU torch's fused kernel gives NaN on the unshifted low rows, so SDPA's answer
                # there is its math kernel's (float32 inside). On the shifted mask the fused kernel is
                # finite but rounds in half: a finfo.min row of float16 scores near 200 gave dq 2.1x
                # math's error (CPU fuzz seed 5910 #90046). Math runs the shifted mask instead.
                with sdpa_kernel(SDPBackend.MATH):
                    return self._launch(query, key, value, shifted, problem, causal)
            attn_mask = shifted
        return self._launch(query, key, value, attn_mask, problem, causal)

    def _lse_backward(self, query, key, value, attn_mask, problem) -> bool:
        """Whether this call's kernel recomputes its backward's weights from a log-sum-exp (cuDNN,
        efficient, torch's fused CPU kernel where torch chooses it), so that low and drowned rows
        need drowned_rows."""
        if self.kernel in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            return True
        return self.kernel is None and query.device.type == "cpu" and _torch_cpu_runs_fused(
            query, key, value, attn_mask, problem)

    def _run_drowned(self, query, key, value, attn_mask, rows, problem):
        """A call under gradients whose mask has drowned rows (drowned_rows: SDPA's answer there is
        uniform weights over the keys at the row's peak), as two launches on the mask with those
        rows moved to peak at 0:
        - the first with their queries zeroed: scores 0, uniform weights, exact log-sum-exp. Its
          output is the call's, and its gradients are SDPA's, except the drowned rows' part of dk
          (dS q with q zeroed);
        - the second gives that part: their queries scaled by DROWN_EPS (scores still vanish, weights
          uniform), only their output gradient, and dk times 1 / DROWN_EPS.
        Twice the kernel's time, only in calls whose mask drowns a row."""
        rows = rows.to(query.dtype)
        zeroed = query - (query.detach() * rows)  # 0 in drowned rows, the query elsewhere; dq passes whole
        dropout = problem.dropout_p > 0
        if dropout:  # the second launch must draw the first's dropout mask (seed 5803 review: dk 0.75 off)
            gen = _generator_state(query.device)
        out = self._launch(zeroed, key, value, attn_mask, problem, False)
        if not key.requires_grad:
            return out
        # float16 cannot hold a query scaled by 2^-40, nor a dk that small: that launch runs in float32
        # (seed 5803 #1283, CPU: float16 queries against a float32 mask of finfo.min, dk 0.44 off).
        wide = torch.float32 if query.dtype == torch.float16 else query.dtype
        eps = torch.where(rows.bool(), torch.full((), DROWN_EPS, dtype=wide, device=query.device),
                          torch.ones((), dtype=wide, device=query.device))
        k_part = _GradTimes.apply(key.to(wide), 1.0 / DROWN_EPS)  # dk times 2^40 before any cast back
        if dropout:
            after = _generator_state(query.device)
            _set_generator_state(query.device, gen)
        try:
            part = self._launch(query.detach().to(wide) * eps, k_part, value.detach().to(wide),
                                attn_mask.detach().to(wide) if attn_mask.dtype == torch.float16 else attn_mask.detach(),
                                problem, False)
        finally:
            if dropout:
                _set_generator_state(query.device, after)
        return out + (part - part.detach()).to(out.dtype) * rows

    def _launch(self, query, key, value, attn_mask, problem, causal):
        if self.kernel == SDPBackend.EFFICIENT_ATTENTION and attn_mask is not None:
            attn_mask = efficient_bias(attn_mask, query.dtype, problem.kv_len, floor=not problem.needs_grad)
        live = None
        if self.kernel == SDPBackend.CUDNN_ATTENTION and attn_mask is not None:
            attn_mask, live = cudnn_bias(attn_mask, query.dtype, problem.kv_len, floor=not problem.needs_grad)
        gqa = problem.gqa
        if gqa and not self.native_gqa:
            key = key.repeat_interleave(problem.gqa_groups, dim=1)
            value = value.repeat_interleave(problem.gqa_groups, dim=1)
            gqa = False
        if self.kernel in FUSED:
            self._check(query, key, value, attn_mask, problem.dropout_p, causal, gqa)
        if self.kernel is None:
            return F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=problem.dropout_p,
                is_causal=causal, scale=problem.scale, enable_gqa=gqa,
            )
        with sdpa_kernel(self.kernel), self._refusals_decline():
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=problem.dropout_p,
                is_causal=causal, scale=problem.scale, enable_gqa=gqa,
            )
        return out if live is None else out * live


# The efficient kernel picks one of its instantiations on the host, before any launch; where none
# fits (float32 head dims and lengths its can_use check passes, seen on an H100 with torch 2.11) it
# raises these. torch's own SDPA raises them too; the next runner takes the call.
KERNEL_SELECTION_REFUSALS = ("no kernel found to launch", "is not correctly aligned")


def _cudnn(q, k, v, problem):
    return torch._scaled_dot_product_cudnn_attention(
        q, k, v, None, problem.needs_grad, 0.0, problem.causal, False, scale=problem.scale
    )[0]


def _flash(q, k, v, problem):
    return torch._scaled_dot_product_flash_attention(q, k, v, 0.0, problem.causal, False, scale=problem.scale)[0]


def _efficient(q, k, v, problem):
    return torch._scaled_dot_product_efficient_attention(
        q, k, v, None, problem.needs_grad, 0.0, problem.causal, scale=problem.scale
    )[0]


def sdpa_runners() -> list[SdpaRunner]:
    all_float = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    return [
        SdpaRunner("sdpa.cpu", None, "cpu", all_float),
        SdpaRunner(
            "sdpa.cudnn", SDPBackend.CUDNN_ATTENTION, "cuda", HALF, min_capability=(8, 0),
            max_head_dim=256 if CUDNN_WIDE else 128, dropout=False, native_gqa=True,
            causal_unequal=CUDNN_WIDE, value_dim_differs=CUDNN_WIDE, empty=False, direct=_cudnn,
        ),
        SdpaRunner(
            "sdpa.flash", SDPBackend.FLASH_ATTENTION, "cuda", HALF, min_capability=(8, 0),
            max_head_dim=256, masks=False, native_gqa=True, causal_unequal=False,
            value_dim_differs=False, empty=False, direct=_flash,
        ),
        SdpaRunner(
            "sdpa.efficient", SDPBackend.EFFICIENT_ATTENTION, "cuda",
            (torch.float16, torch.bfloat16, torch.float32), min_capability=(5, 0),
            native_gqa=False, empty=False, direct=_efficient,
            gqa_masks_reason="takes no mask or window with GQA: torch runs its math kernel there, and this "
            "kernel on repeated heads gave finfo.min rows zeros instead of SDPA's uniform weights, and "
            "gradients 2.5-3x torch's error (a CUDA fuzzer, H200, torch 2.11).",
        ),
        SdpaRunner("sdpa.math", SDPBackend.MATH, "cuda", all_float),
    ]


def _generator_state(device: torch.device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_generator_state(device: torch.device, state) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _torch_cpu_runs_fused(query, key, value, attn_mask, problem) -> bool:
    """Whether torch's CPU SDPA runs its fused kernel on these tensors (its own choice), whose
    backward drowns as the CUDA ones do; its math kernel answers drowned rows as SDPA's rule says,
    and two launches there only add a rounding (CPU fuzz seed 5811 #11195: dk 2.05x math's)."""
    if torch.compiler.is_compiling():
        return True  # the shift without a read (drowned_rows); no choice is read under compile
    try:
        choice = torch._fused_sdp_choice(query, key, value, attn_mask, problem.dropout_p, False,
                                         scale=problem.scale, enable_gqa=problem.gqa)
    except (RuntimeError, TypeError, AttributeError):  # a torch that answers otherwise: assume fused
        return True
    return choice != int(SDPBackend.MATH)
