"""What torch's fused SDPA kernels take: tensors in forms they load (16-byte rows, head dims in
whole vectors, no expanded dims) and masks in forms they answer as SDPA does (bool masks turned
additive, finfo.min floored, low and drowned rows moved, fully masked rows made zero around
cuDNN). The runners in backends/sdpa.py hand every fused launch through these."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

HALF = (torch.float16, torch.bfloat16)
FUSED = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
ALIGN_BYTES = 16  # the fused kernels' vector loads: base pointer and row strides
ALIGN_DIM = 8  # and head dims, in elements (torch's SDPA pads to this too)
F32_ALIGN_DIM = 4  # float32 head dims torch's efficient kernel takes (16-byte rows); others run its math kernel


# torch 2.11's cuDNN kernel (pinned, H200) took value head dims unlike the key's, head dims up to
# 256 and causal calls with q_len != k_len (top-left, as SDPA), at errors below its efficient
# kernel's; it is torch's own choice there. Older torch keeps the limits it was measured with.
CUDNN_WIDE = torch.__version__ >= (2, 11)  # torch's TorchVersion compares with a tuple
CUDNN_VERSION = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None


def padded_dim(dim: int, unit: int = ALIGN_DIM) -> int:
    """`dim` rounded up to what a fused kernel's rows take (multiples of `unit`)."""
    return -(-dim // unit) * unit


def dim_unit(kernel, dtype: torch.dtype) -> int:
    """The head dims a fused kernel takes as they come are multiples of this: torch's efficient
    kernel takes float32 rows of 16 bytes (4 elements) without padding; the others 8 elements."""
    return F32_ALIGN_DIM if kernel == SDPBackend.EFFICIENT_ATTENTION and dtype == torch.float32 else ALIGN_DIM


def aligned_rows(t: torch.Tensor) -> bool:
    """A 16-byte aligned base and 16-byte multiples for every stride but the last, a length-one
    dim's too: torch's fused kernels check them all ("not correctly aligned (strideM)")."""
    e = t.element_size()
    return t.data_ptr() % ALIGN_BYTES == 0 and all((st * e) % ALIGN_BYTES == 0 for st in t.stride()[:-1])


def fused_ready(t: torch.Tensor, unit: int = ALIGN_DIM) -> bool:
    """Unit last stride, a head dim of whole vectors (multiples of `unit`), aligned rows
    (aligned_rows), no expanded dim: what torch's fused kernels load without a fault, a refusal or
    a wrong gradient."""
    if t.stride(-1) != 1 or t.shape[-1] % unit or not aligned_rows(t):
        return False
    # An expanded dim (stride 0) is copied: gradients of such a view came out 2-7x torch's error.
    return all(st or n == 1 for st, n in zip(t.stride()[:-1], t.shape[:-1]))


def fused_form(t: torch.Tensor, width: int, unit: int = ALIGN_DIM) -> torch.Tensor:
    """`t` as a fused kernel takes it: itself where `fused_ready` at `width`, else a fresh copy
    with the head dim zero-padded to `width` (zeros add nothing to q.k and are sliced off the
    output), as torch's own SDPA pads. The copy moves N x D elements once, against the N^2 x D
    work of the attention it makes runnable on a fused kernel instead of the math one."""
    if t.shape[-1] == width and fused_ready(t, unit):
        return t
    if t.shape[-1] != width:  # F.pad keeps a channels-last-like layout: the last dim must be dense
        return F.pad(t, (0, width - t.shape[-1])).contiguous()
    return t.clone(memory_format=torch.contiguous_format)


# The efficient kernel scales scores and bias by log2(e): an additive mask's finfo.min (the Hugging
# Face "masked" value) overflows to -inf there, and a row masked that way gives zeros where SDPA's
# math gives uniform weights over its keys (a CUDA fuzzer, H200, torch 2.11). Below this floor a
# finite bias has the same effect as finfo.min (the scores vanish beside it) and stays finite.
MASK_FLOOR = -1e30


def finite_floor(attn_mask: torch.Tensor) -> torch.Tensor:
    """An additive mask with finite values below MASK_FLOOR raised to it (-inf stays: such keys
    take no part); the gradient passes to every element unchanged."""
    if torch.finfo(attn_mask.dtype).min >= MASK_FLOOR:  # float16: its finfo.min stays finite scaled
        return attn_mask
    low = (attn_mask < MASK_FLOOR) & (attn_mask > float("-inf"))
    floor = torch.full((), MASK_FLOOR, dtype=attn_mask.dtype, device=attn_mask.device)
    if attn_mask.requires_grad:  # the floored value, with the gradient of the identity
        floor = floor + (attn_mask - attn_mask.detach())
    return torch.where(low, floor, attn_mask)


# Rows peaking below this drown their scores in float64 (its spacing there is 128; the scores of a
# call are far below it) and in float32 alike: SDPA's weights are uniform over the keys at the peak.
# Between -1e15 and here float64 rounds the scores partly: neither answer is exact. (At -1e25 the
# common masked_fill(-1e20) rows were shifted: softmax of their scores, 2.2 relative off.)
DROWN_BELOW = -1e18
# Rows peaking below this are shifted to peak at 0 under gradients (drowned_rows).
# cuDNN's backward gave NaN dq (dk and dv too with one query) on every row of a low log-sum-exp
# (float16 below about -16, bfloat16 below about -90), masked or not, at exactly 64 keys: 2, 5, 16,
# 65, 96, 100, 128 and 256 keys stayed finite, any query count, head dims 64 and 128; torch's own
# choice alike (H200, torch 2.11; seeds 5421 #2768 and 5419 #12693, benchmarks/NOTES.md, session 45).
CUDNN_NAN_KEYS = 64
CUDNN_NAN_REASON = (f"gave NaN gradients at exactly {CUDNN_NAN_KEYS} keys on rows of a low log-sum-exp (float16 below "
                    "about -16, bfloat16 below about -90; fewer keys or more stayed finite; torch's own choice alike: "
                    "CUDA fuzzer seeds 5421 #2768 and 5419 #12693, H200, torch 2.11): it takes no gradients at that "
                    "length.")
LOW_PEAK = -1e3
# The efficient kernel's rows are shifted from here down: rows of -1e4 keep torch's own answer
# (seed 5418 #2950), rows where float32's spacing swallows the scores (8e-3 at 1e5, 64 at 1e9) move.
EFFICIENT_LOW_PEAK = -1e5
# A drowned row's query, scaled by this, gives scores that vanish against 1 in float32 (|s| < 1e5).
DROWN_EPS = 2.0 ** -40


def drowned_rows(attn_mask: torch.Tensor, low_peak: float = LOW_PEAK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An additive mask as the fused kernels' backward takes it: its low rows (peaking below
    `low_peak`) moved to peak at 0,
    and (..., Nq, 1) bool marking the drowned ones among them (None where there is none). A mask
    with no low row comes back as it is. One read of the mask, and one sync (none under
    torch.compile or CUDA-graph capture: there every low row is shifted and none is named drowned).

    - A low row (peaking below LOW_PEAK, -inf rows aside): cuDNN's backward gave inf dq for rows of
      -1e4 (seed 20261129 #132, H200, torch's own choice alike) where its forward was right.
      Softmax does not see a row's shift, so the shifted row is the same problem, in a form every
      kernel takes (its keys near the peak shift exactly: Sterbenz).
    - A drowned row (peaking below DROWN_BELOW): its scores drown, in float32 and in the float64
      reference alike (s + bias rounds to bias), so SDPA's answer is uniform weights over the keys
      at the peak. No bias gives a fused kernel that answer under gradients: as it is, the kernels
      scale the bias by log2(e) and overflow from -2.36e38 on (finfo.min: seed 5411 #339, cuDNN 0.40
      output error, inf gradients); at -1e30 the backward's weights, exp(s - lse) recomputed at 1e30,
      are exp of rounding noise (inf gradients, seed 5412); shifted to 0 the scores come back
      (softmax(s)). The caller runs such rows with their queries scaled to nothing (_run_drowned).
    Every other row keeps its values to the bit; broadcast dims stay broadcast."""
    # Broadcast dims (stride 0) once: an expanded mask stays expanded, not laid out at full size.
    # Not for a mask that takes a gradient: each of its elements has its own, stride 0 or not (one
    # slice standing for the rest gave the sum at one and zeros at the others: CPU fuzz seed 5810
    # #1516, a (4, 4, 4) leaf of strides (0, 4, 1)).
    collapsed = [st == 0 and n > 1 and not attn_mask.requires_grad
                 for st, n in zip(attn_mask.stride(), attn_mask.shape)]
    base = attn_mask[tuple(slice(0, 1) if c else slice(None) for c in collapsed)]
    top = base.detach().amax(-1, keepdim=True)
    low = (top < low_peak) & (top > float("-inf"))
    drowned = low & (top < DROWN_BELOW)
    # No read under torch.compile or CUDA-graph capture: every low row shifted, one launch. A
    # drowned row then gives softmax of its scores (finite; SDPA's answer is uniform weights, torch's
    # own kernels give inf there): two launches wherever a dtype can drown would double every
    # compiled masked training call for a row HF's masks never hold on CUDA.
    reads = not (torch.compiler.is_compiling() or (attn_mask.is_cuda and torch.cuda.is_current_stream_capturing()))
    any_drowned = False
    if reads:
        any_low, any_drowned = torch.stack((low.any(), drowned.any())).tolist()
        if not any_low:
            return attn_mask, None
    return torch.where(low, base - top, base).expand(attn_mask.shape), drowned if any_drowned else None


class _GradTimes(torch.autograd.Function):
    """A tensor as it is, its gradient times a constant."""

    @staticmethod
    def forward(ctx, t, factor):
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def efficient_bias(attn_mask: torch.Tensor, dtype: torch.dtype, kv_len: int, floor: bool = True) -> torch.Tensor:
    """A mask as the efficient kernel takes it: additive in the query dtype (a bool mask turned
    as SDPA turns it), finite values floored (finite_floor) where `floor` (else the caller has
    made its drowned rows safe: drowned_rows), keys along a unit-stride
    last dim, a 16-byte aligned base and 16-byte row strides (a mask broadcast over keys,
    transposed or at an odd offset is laid out, its rows padded as torch pads them)."""
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill_(
            ~attn_mask, float("-inf"))
    elif floor:
        attn_mask = finite_floor(attn_mask)
    if attn_mask.shape[-1] != kv_len or (attn_mask.stride(-1) != 1 and kv_len > 1) or not aligned_rows(attn_mask):
        per_row = ALIGN_BYTES // attn_mask.element_size()  # elements in 16 bytes
        width = -(-kv_len // per_row) * per_row
        laid = attn_mask.new_empty(*attn_mask.shape[:-1], width)[..., :kv_len]
        attn_mask = laid.copy_(attn_mask.expand(*attn_mask.shape[:-1], kv_len))
    return attn_mask


def live_rows(attn_mask: torch.Tensor) -> torch.Tensor:
    """(..., Nq, 1) bool: the rows of a mask that keep at least one key (bool True, or an additive
    value above -inf)."""
    keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
    return keep.any(-1, keepdim=True)


def cudnn_bias(attn_mask: torch.Tensor, dtype: torch.dtype, kv_len: int, floor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A mask as cuDNN's fused kernel takes it, and the rows that keep a key (live_rows).

    cuDNN gives a fully masked row (every key False, or -inf) non-zero output (0.4-0.7 relative,
    inf gradients: H200, torch 2.11) where SDPA's rule is zeros. Such a row goes in unmasked (any
    finite answer) and its output is multiplied by 0 after (so are its gradients, as the rule's
    constant output asks). Otherwise the mask is efficient_bias's: additive in the query dtype,
    floored where `floor`, with 16-byte rows."""
    live = live_rows(attn_mask)
    if attn_mask.dtype == torch.bool:  # efficient_bias makes a fresh additive mask: its dead rows are zeroed in place
        return efficient_bias(attn_mask, dtype, kv_len, floor=floor).masked_fill_(~live, 0.0), live
    return efficient_bias(attn_mask.masked_fill(~live, 0.0), dtype, kv_len, floor=floor), live
