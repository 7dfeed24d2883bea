"""Bugs of issue 13, each pinned by a test: empty keys in the Triton forward, approximate runners
in an exact plan, unchecked varlen offsets, unknown backend names, and the CLI's error paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import adaattn
from adaattn import Policy, stats

from helpers import DEVICE, NEEDS_CUDA_OR_INTERPRETER, assert_within_standard

# Before issue 13's fix the Triton forward asserted 'shape must be positive' on kv_len 0 (bf16/fp16,
# D=64, its tensor descriptors), then the call ran on triton.quant with a warning.


def _not_interpreter(ws):
    """Warnings other than numpy's from inside the Triton interpreter."""
    return [w for w in ws if "triton" + os.sep + "runtime" not in (w.filename or "")]


# ------------------------------------------------------------------ Triton forward, kv_len == 0


def _empty_cases():
    out = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for d in (64, 32):
            out.append(pytest.param(dtype, d, id=f"{str(dtype)[6:]}-D{d}"))
    return out


@pytest.mark.parametrize("dtype,d", _empty_cases())
def test_triton_policy_with_empty_keys_gives_sdpa_zeros_without_a_launch_or_a_warning(dtype, d):
    """No key to attend: SDPA's zeros, decided before any runner (attention's no-keys rule), with one
    stats record saying no runner ran, and no warning."""
    from adaattn.api.attention import NO_KEYS

    torch.manual_seed(1)
    q = torch.randn(2, 2, 9, d, dtype=dtype, device=DEVICE)
    k = torch.randn(2, 2, 0, d, dtype=dtype, device=DEVICE)
    v = torch.randn(2, 2, 0, d, dtype=dtype, device=DEVICE)
    theirs = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(theirs, torch.zeros_like(theirs))  # SDPA: rows with no key give zeros
    with warnings.catch_warnings(record=True) as ws, stats.collect() as recs:
        warnings.simplefilter("always")
        ours = adaattn.attention(q, k, v, policy=Policy(backends=("triton",)))
    assert not _not_interpreter(ws), [str(w.message) for w in ws]
    assert len(recs) == 1 and recs[0].backend == NO_KEYS and not recs[0].fallbacks, recs
    assert ours.shape == theirs.shape and ours.dtype == dtype
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("grad", [False, True])
def test_empty_query_broadcast_against_the_keys_batch_keeps_its_own_leading_dims(grad):
    """seed 20261129 #462 (--broadcast, H200): a query of q_len 0 with batch 1 against keys of batch
    2 gave (2, 2, 0, D) on CUDA, the runners' broadcast form; torch's SDPA gives the query's own
    leading dims. Decided before any runner, on every device, with zero gradients."""
    from adaattn.api.attention import NO_KEYS

    q = torch.randn(1, 2, 0, 16, device=DEVICE, requires_grad=grad)
    k, v = (torch.randn(2, 1, 5, 16, device=DEVICE, requires_grad=grad) for _ in range(2))
    theirs = F.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu(), enable_gqa=True)
    with stats.collect() as recs:
        ours = adaattn.attention(q, k, v, enable_gqa=True)
    assert ours.shape == theirs.shape == (1, 2, 0, 16)
    assert len(recs) == 1 and recs[0].backend == NO_KEYS
    if grad:
        dq, dk, dv = torch.autograd.grad(ours.sum(), (q, k, v))
        assert dq.shape == q.shape and torch.equal(dk, torch.zeros_like(k)) and torch.equal(dv, torch.zeros_like(v))


def _triton_attention():
    # A moved module fails here, never skips: these regressions must keep running.
    fn = getattr(adaattn, "triton_attention", None)
    if fn is None:
        from adaattn.backends.triton.runner import triton_attention as fn
    return fn


@NEEDS_CUDA_OR_INTERPRETER
@pytest.mark.parametrize("dtype,d", _empty_cases())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_attention_function_with_empty_keys_gives_zeros(dtype, d, causal):
    fn = _triton_attention()
    torch.manual_seed(2)
    q = torch.randn(1, 4, 7, d, dtype=dtype, device=DEVICE)
    k = torch.randn(1, 2, 0, d, dtype=dtype, device=DEVICE)  # GQA too
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        ours = fn(q, k, k, is_causal=causal)
    assert not _not_interpreter(ws), [str(w.message) for w in ws]
    theirs = F.scaled_dot_product_attention(q, k, k, is_causal=causal, enable_gqa=True)
    assert ours.shape == theirs.shape and torch.equal(ours, theirs)


@NEEDS_CUDA_OR_INTERPRETER
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_triton_policy_with_empty_queries_gives_an_empty_output(dtype):
    torch.manual_seed(3)
    q = torch.randn(2, 2, 0, 64, dtype=dtype, device=DEVICE)
    k = torch.randn(2, 2, 9, 64, dtype=dtype, device=DEVICE)
    from adaattn.api.attention import NO_KEYS

    with stats.collect() as recs:
        ours = adaattn.attention(q, k, k, policy=Policy(backends=("triton",)))
    # Answered before any runner (attention's no-keys rule covers an empty query too: seed 20261129
    # #462), so no Triton launch either.
    assert ours.shape == (2, 2, 0, 64) and recs[0].backend == NO_KEYS and not recs[0].fallbacks


# ------------------------------------------------------------------ exact plans stay exact


def _is_approximate(name: str) -> bool:
    if "quant" in name:
        return True
    for where in ("adaattn.backends", "adaattn.planner"):
        try:
            registry = getattr(__import__(where, fromlist=["REGISTRY"]), "REGISTRY", None)
        except ImportError:
            registry = None
        if registry is not None and name in registry:
            return getattr(registry[name], "exact", True) is False
    return False


@NEEDS_CUDA_OR_INTERPRETER
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_exact_triton_policy_plans_no_approximate_runner(dtype, d, causal):
    q = torch.randn(1, 2, 32, d, dtype=dtype, device=DEVICE)
    for policy in (Policy(backends=("triton",)), Policy(mode="exact", backends=("triton",))):
        exp = adaattn.explain(q, q, q, is_causal=causal, policy=policy)
        assert exp.plan is not None, exp.error
        approximate = [c for c in exp.plan.candidates if _is_approximate(c)]
        assert not approximate, f"exact plan lists approximate runners {approximate}: {exp.plan.candidates}"
        assert exp.as_dict()["chosen"] in ("triton.ws", "triton.ptr")


@NEEDS_CUDA_OR_INTERPRETER
def test_auto_triton_policy_may_plan_the_quantized_runner():
    q = torch.randn(1, 2, 32, 64, dtype=torch.float16, device=DEVICE)
    policy = Policy(mode="auto", precisions=("native", "int8", "fp8"), backends=("triton",))
    exp = adaattn.explain(q, q, q, policy=policy)
    assert exp.plan is not None, exp.error
    assert exp.chosen.startswith("triton")
    assert {"triton.quant.ws", "triton.quant.general"} <= set(exp.as_dict()["backends"])  # considered


# ------------------------------------------------------------------ varlen offsets

TOKENS = 31
GOOD = [0, 5, 22, 31]
BAD_OFFSETS = {
    "non_monotonic": [0, 5, 3, 31],
    "past_the_tensor": [0, 5, 22, 40],
    "first_not_zero": [1, 5, 22, 31],
}


def _varlen_call(device, dtype, case, side):
    """Runs varlen_attention with one bad offsets tensor; returns (exception type name, message)."""
    x = torch.randn(TOKENS, 2, 16, device=device, dtype=dtype)
    good = torch.tensor(GOOD, dtype=torch.int32, device=device)
    if case in BAD_OFFSETS:
        bad = torch.tensor(BAD_OFFSETS[case], dtype=torch.int32, device=device)
    elif case == "float":
        bad = good.float()
    elif case == "other_device":
        bad = good.to("meta")
    else:
        raise AssertionError(case)
    cu_q, cu_k = (bad, good) if side == "q" else (good, bad)
    try:
        adaattn.varlen_attention(x, x, x, cu_q, cu_k, 26, 26)
    except Exception as e:  # noqa: BLE001 - the caller judges it
        return type(e).__name__, str(e)
    return None, None


_CHILD = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
import test_regressions as t
device = sys.argv[2]
# The cases that may crash today's kernels come last, so the others are reported first.
for case in ("float", "other_device", "first_not_zero", "non_monotonic", "past_the_tensor"):
    for dtype in (torch.float16, torch.float32):
        for side in ("q", "k"):
            exc, msg = t._varlen_call(device, dtype, case, side)
            print(json.dumps({"key": [str(dtype)[6:], case, side], "exc": exc, "msg": msg}), flush=True)
"""


@pytest.fixture(scope="module")
def triton_varlen_results():
    """Triton-path offset checks, run in one child process: today's kernels read and write past
    the tensors for bad offsets (a 'double free or corruption' abort was seen), which must not
    take pytest down with them."""
    env = dict(os.environ)
    src = str(Path(adaattn.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(Path(__file__).parent), DEVICE], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)
        rc = proc.returncode
    except subprocess.TimeoutExpired:  # a corrupted heap can hang as well as abort
        proc.kill()
        out, err = proc.communicate()
        rc = "killed after 60 s"
    results = {}
    for line in out.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            results[tuple(d["key"])] = (d["exc"], d["msg"])
    return results, rc, err[-600:]


VARLEN_PATHS = [
    pytest.param("triton", torch.float16, marks=NEEDS_CUDA_OR_INTERPRETER, id="triton-fp16"),
    pytest.param("triton", torch.float32, marks=NEEDS_CUDA_OR_INTERPRETER, id="triton-fp32"),
    pytest.param("fallback", torch.float64, id="sdpa_fallback-fp64"),  # float64: per-sequence SDPA
]


def _varlen_result(request, path, dtype, case, side):
    if path == "fallback":
        return _varlen_call(DEVICE, dtype, case, side)
    results, rc, err = request.getfixturevalue("triton_varlen_results")
    key = (str(dtype)[6:], case, side)
    assert key in results, f"the child process died before this case (rc={rc}): ...{err}"
    return results[key]


def _assert_names(result, side, types=(ValueError,)):
    exc, msg = result
    names = tuple(t.__name__ for t in types)
    assert exc is not None, "no error raised"
    assert exc in names, f"raised {exc}: {msg}"
    assert f"cu_seqlens_{side}" in msg, f"message does not name cu_seqlens_{side}: {msg}"


@pytest.mark.parametrize("path,dtype", VARLEN_PATHS)
@pytest.mark.parametrize("side", ["q", "k"])
def test_varlen_rejects_non_monotonic_offsets(request, path, dtype, side):
    _assert_names(_varlen_result(request, path, dtype, "non_monotonic", side), side)


@pytest.mark.parametrize("path,dtype", VARLEN_PATHS)
@pytest.mark.parametrize("side", ["q", "k"])
def test_varlen_rejects_offsets_past_the_tensor(request, path, dtype, side):
    _assert_names(_varlen_result(request, path, dtype, "past_the_tensor", side), side)


@pytest.mark.parametrize("path,dtype", VARLEN_PATHS)
@pytest.mark.parametrize("side", ["q", "k"])
def test_varlen_rejects_a_first_offset_other_than_zero(request, path, dtype, side):
    _assert_names(_varlen_result(request, path, dtype, "first_not_zero", side), side)


@pytest.mark.parametrize("path,dtype", VARLEN_PATHS)
@pytest.mark.parametrize("side", ["q", "k"])
def test_varlen_rejects_float_offsets_naming_them(request, path, dtype, side):
    _assert_names(_varlen_result(request, path, dtype, "float", side), side, (TypeError, ValueError))


@pytest.mark.parametrize("path,dtype", VARLEN_PATHS)
@pytest.mark.parametrize("side", ["q", "k"])
def test_varlen_rejects_offsets_on_another_device_naming_them(request, path, dtype, side):
    _assert_names(_varlen_result(request, path, dtype, "other_device", side), side)


@pytest.mark.parametrize("path,dtype", VARLEN_PATHS)
def test_varlen_with_good_offsets_matches_per_sequence_sdpa(path, dtype):
    """The checks above must not refuse good offsets (including an empty sequence)."""
    torch.manual_seed(4)
    cu = [0, 5, 5, 22, 31]
    q, k, v = (torch.randn(TOKENS, 2, 16, device=DEVICE, dtype=dtype) for _ in range(3))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    ours = adaattn.varlen_attention(q, k, v, cu_t, cu_t, 17, 17, is_causal=True)
    ref64 = torch.zeros(TOKENS, 2, 16, dtype=torch.float64, device=DEVICE)
    theirs = torch.zeros(TOKENS, 2, 16, dtype=dtype, device=DEVICE)
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            theirs[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
            ref64[a:b] = F.scaled_dot_product_attention(qs.double(), ks.double(), vs.double(),
                                                        is_causal=True).transpose(0, 1)
    assert ours.shape == theirs.shape
    assert_within_standard(ours, ref64, theirs)


def test_varlen_reads_a_checked_offsets_tensor_back_once_until_it_changes(monkeypatch):
    """A model passes one cu_seqlens tensor to every layer: its values are read back once, not per
    call. A tensor changed in place is checked again (bad values raise); so are other bounds."""
    from adaattn.backends import varlen as varlen_backend

    reads = []
    real = varlen_backend._offsets_bad
    monkeypatch.setattr(varlen_backend, "_offsets_bad", lambda *a: reads.append(a[1:]) or real(*a))
    x = torch.randn(TOKENS, 2, 16, dtype=torch.float64)
    cu = torch.tensor(GOOD, dtype=torch.int32)
    cu_k = cu.clone()
    for _ in range(3):
        adaattn.varlen_attention(x, x, x, cu, cu_k, 26, 26)
    assert reads == [(TOKENS, 26), (TOKENS, 26)]  # q's and k's offsets, once
    adaattn.varlen_attention(x, x, x, cu, cu_k, 17, 26, is_causal=True)  # other bounds: checked again
    assert len(reads) == 3 and reads[-1] == (TOKENS, 17)
    cu_k[2] = 3  # in place: non-monotonic now
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        adaattn.varlen_attention(x, x, x, cu, cu_k, 26, 26)
    cu_k.copy_(cu)
    adaattn.varlen_attention(x, x, x, cu, cu_k, 26, 26)
    adaattn.varlen_attention(x, x, x, cu, cu_k, 26, 26)
    assert len(reads) == 5  # k's offsets read again once after each change, q's not at all
    with pytest.raises(ValueError, match="cu_seqlens_q"):  # bounds too small for the checked tensor
        adaattn.varlen_attention(x, x, x, cu, cu_k, 5, 26)
    with torch.inference_mode():  # no version counter: read every time
        cu_i = torch.tensor(GOOD, dtype=torch.int32)
        for _ in range(2):
            adaattn.varlen_attention(x, x, x, cu_i, cu_k, 26, 26)
    assert len(reads) == 8


VARLEN_RULES = [  # (offsets, max_seqlen, the message after "cu_seqlens_X ")
    ([1, 5, 22, 31], 26, "must start at 0, got cu_seqlens_{s}[0]=1 (cu_seqlens_{s}=[1, 5, 22, 31])"),
    ([0, 5, 3, 31], 28, "must never decrease, got cu_seqlens_{s}[1]=5 > cu_seqlens_{s}[2]=3 "
                        "(cu_seqlens_{s}=[0, 5, 3, 31])"),
    ([0, 5, 22, 40], 26, "must end at most at the packed length 31 ({s}.shape[0]), got cu_seqlens_{s}[-1]=40 "
                         "(cu_seqlens_{s}=[0, 5, 22, 40])"),
    ([0, 5, 22, 31], 16, "must hold no sequence longer than max_seqlen_{s}=16, got sequence 1 of 17 tokens "
                         "(cu_seqlens_{s}=[0, 5, 22, 31])"),
]


@pytest.mark.parametrize("side", ["q", "k"])
@pytest.mark.parametrize("offsets,longest,message", VARLEN_RULES, ids=["start", "decrease", "end", "longest"])
def test_varlen_offsets_error_names_the_rule_and_the_tensor_that_broke_it(side, offsets, longest, message):
    x = torch.randn(TOKENS, 2, 16, dtype=torch.float64)
    bad, good = torch.tensor(offsets), torch.tensor(GOOD)
    cu_q, cu_k = (bad, good) if side == "q" else (good, bad)
    with pytest.raises(ValueError) as e:
        adaattn.varlen_attention(x, x, x, cu_q, cu_k, *((longest, 26) if side == "q" else (26, longest)))
    assert str(e.value) == f"cu_seqlens_{side} " + message.format(s=side)


def test_varlen_offsets_error_lists_every_rule_broken_after_one_flag_read(monkeypatch):
    """The good path reads the offsets' per-rule flags back in one read; the error path reads the
    offsets themselves once more, to quote them."""
    from adaattn.backends.varlen import check_varlen

    x = torch.randn(TOKENS, 2, 16, dtype=torch.float64)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(tuple(t.shape)) or real(t))
    for name in ("item", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, lambda t, name=name: pytest.fail(f"a {name}() read"))
    check_varlen(x, x, x, torch.tensor(GOOD), torch.tensor(GOOD), 26, 26, True)
    assert reads == [(2, 4)]  # both tensors' four flags, one read
    reads.clear()
    with pytest.raises(ValueError) as e:
        check_varlen(x, x, x, torch.tensor(GOOD), torch.tensor([2, 1, 40, 45]), 26, 26, True)
    assert reads == [(2, 4), (4,)]
    assert str(e.value) == ("cu_seqlens_k must start at 0, got cu_seqlens_k[0]=2; and must never decrease, got "
                            "cu_seqlens_k[0]=2 > cu_seqlens_k[1]=1; and must end at most at the packed length 31 "
                            "(k.shape[0]), got cu_seqlens_k[-1]=45; and must hold no sequence longer than "
                            "max_seqlen_k=26, got sequence 1 of 39 tokens (cu_seqlens_k=[2, 1, 40, 45])")


# ------------------------------------------------------------------ backend names


@pytest.mark.parametrize("name", ["nosuch", "sdpa.nosuch"])
def test_policy_with_an_unknown_backend_name_raises_listing_known_names(name):
    with pytest.raises(ValueError) as e:
        Policy(backends=(name,))
    msg = str(e.value)
    assert name in msg
    assert "sdpa.cpu" in msg or "reference" in msg, msg


@pytest.mark.parametrize("names", [("sdpa",), ("triton",), ("sdpa.cpu",), ("reference",), ("sdpa", "reference"),
                                   ("flash_attn",)])
def test_policy_accepts_known_backend_names_and_prefixes(names):
    assert Policy(backends=names).backends == names


def test_auto_policy_accepts_the_quantized_runner_by_name():
    Policy(mode="auto", precisions=("native", "int8"), backends=("triton.quant", "triton"))


# ------------------------------------------------------------------ CLI error paths


def _cli(argv, capsys):
    from adaattn.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_explain_with_an_unknown_backend_exits_2_with_one_line(capsys):
    rc, out, err = _cli(["explain", "--shape", "1,2,16,16", "--device", "cpu", "--backends", "nosuch"], capsys)
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "nosuch" in lines[0], err


def test_cli_explain_with_an_unknown_device_exits_2_with_one_line(capsys):
    rc, out, err = _cli(["explain", "--shape", "1,2,16,16", "--device", "tpu"], capsys)
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "tpu" in lines[0] and "--device" in lines[0], err


def test_cli_version_prints_the_package_version(capsys):
    rc, out, err = _cli(["--version"], capsys)
    assert rc == 0, (rc, out, err)
    assert out.strip() == f"adaattn {adaattn.__version__}" == "adaattn 0.1.0"


# ------------------------------------------- fuzzer finds: inputs that are not plain 4-D, CPU


@pytest.mark.parametrize("shapes", [((2, 4, 48, 64), (1, 4, 48, 64)), ((4, 48, 64), (4, 48, 64)),
                                    ((2, 2, 4, 48, 64), (2, 2, 4, 48, 64))], ids=["kv-batch-1", "3-D", "5-D"])
def test_cpu_calls_on_broadcast_or_non_4d_inputs_are_as_accurate_as_sdpa_on_them(shapes):
    # torch runs its math kernel for such inputs on the CPU; adaattn flattens them to 4-D, where
    # torch would pick its fused kernel, whose bf16 gradients were up to 200x less accurate.
    shq, shk = shapes
    g = torch.Generator().manual_seed(5)
    q = torch.randn(shq, generator=g).bfloat16()
    k, v = (torch.randn(shk, generator=g).bfloat16() for _ in range(2))
    v = v * 100
    out_shape = torch.broadcast_shapes(shq[:-2], shk[:-2]) + shq[-2:]
    dout = torch.randn(out_shape, generator=g).bfloat16()
    got = {}
    for name, fn in (("ours", adaattn.attention), ("sdpa", F.scaled_dot_product_attention)):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o = fn(qq, kk, vv, scale=10.0)
        got[name] = [o] + list(torch.autograd.grad(o, (qq, kk, vv), dout))
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    o = torch.softmax(qq @ kk.transpose(-1, -2) * 10.0, -1) @ vv
    ref = [o] + list(torch.autograd.grad(o, (qq, kk, vv), dout.double()))
    for name, ours, peer, r in zip(("out", "dq", "dk", "dv"), got["ours"], got["sdpa"], ref):
        assert_within_standard(ours, r.detach(), peer, name)


@pytest.mark.parametrize("shapes", [((1, 8, 187, 192), (1, 2, 0, 192)), ((2, 4, 9, 64), (2, 4, 0, 64)),
                                    ((3, 9, 32), (3, 0, 32)), ((2, 1, 4, 5, 16), (1, 3, 1, 0, 16))])
def test_no_keys_give_zero_rows_and_zero_gradients_for_large_half_precision_queries(shapes):
    """seed 5501 #7292 (CPU fuzzer): float16 queries of magnitude >= 100 against zero keys. torch's
    CPU kernels return NaN; the answer is zeros, as SDPA's math gives for ordinary queries, and
    zero gradients."""
    qs, ks = shapes
    q = (torch.randn(*qs) * 100).half().requires_grad_()
    k = torch.zeros(*ks, dtype=torch.float16, requires_grad=True)
    v = torch.zeros(*ks, dtype=torch.float16, requires_grad=True)
    gqa = len(qs) >= 3 and qs[-3] != ks[-3]
    out = adaattn.attention(q, k, v, enable_gqa=gqa)
    want_shape = F.scaled_dot_product_attention((q.detach() / 1000).float(), k.detach().float(), v.detach().float(),
                                                enable_gqa=gqa).shape  # (the query's shape, whatever the keys')
    assert out.shape == want_shape and out.dtype == torch.float16
    assert torch.equal(out, torch.zeros_like(out))
    dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_no_keys_give_zeros_in_the_query_s_shape_as_sdpa_whichever_runner_is_named(layout):
    """torch's SDPA answers a call with no key by zeros in the query's shape, leading dims as the
    query gives them (not broadcast against the key's, as any other call's are); a runner's
    (B, H, N, D) form would broadcast them (the reference runner gave (2, 2, 3, 5) here, on any
    device). Gradients are zeros, for the score modifiers too."""
    q = torch.randn(2, 1, 3, 4, requires_grad=True)
    k, v = torch.randn(1, 2, 0, 4, requires_grad=True), torch.randn(1, 2, 0, 5, requires_grad=True)
    theirs = F.scaled_dot_product_attention(q, k, v)
    t = (lambda x: x.transpose(1, 2)) if layout == "bshd" else (lambda x: x)
    for backends in (None, ("reference",), ("sdpa.cpu",)):
        policy = None if backends is None else Policy(backends=backends)
        ours = adaattn.attention(t(q), t(k), t(v), layout=layout, policy=policy)
        assert t(ours).shape == theirs.shape and not ours.any(), backends
        grads = torch.autograd.grad(ours.sum(), (q, k, v))
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and not any(g.any() for g in grads)
    sinks = torch.randn(2, requires_grad=True)
    q2, k2 = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 0, 4)
    out = adaattn.attention(q2, k2, k2, sinks=sinks)
    (ds,) = torch.autograd.grad(out.sum(), sinks)
    assert out.shape == (1, 2, 3, 4) and not out.any() and torch.equal(ds, torch.zeros(2))
