"""`adaattn info` and `adaattn explain` print what the issue says they print."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from adaattn.cli import main
from adaattn.planner import REGISTRY

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_info_prints_versions_devices_and_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out
    assert "triton" in out and "CUDA" in out
    if not torch.cuda.is_available():
        assert "GPUs: none" in out
    for name in ("sdpa.cpu", "sdpa.cudnn", "sdpa.flash", "sdpa.efficient", "sdpa.math", "flash_attn", "reference"):
        assert name in out
    assert "sdpa.cpu         available" in out


def test_info_json_has_device_fields(capsys):
    import json

    assert main(["info", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert {"torch", "triton", "cuda", "devices", "backends"} <= rep.keys()
    for d in rep["devices"]:
        assert {"name", "capability", "sm_count", "memory_gib", "tensor_core_precisions"} <= d.keys()


def test_explain_shows_every_backend_its_reasons_and_the_choice(capsys):
    assert main(["explain", "--shape", "2,16,4096,128", "--device", "cpu", "--causal", "--window", "256,0"]) == 0
    out = capsys.readouterr().out
    assert "B=2 Hq=16 Hkv=16 Nq=4096 Nk=4096 D=128" in out and "window=(256, 0)" in out
    assert re.search(r"sdpa.cpu +CHOSEN", out)
    assert re.search(r"sdpa.flash +no: runs on cuda tensors only, got cpu.", out)
    for name in ("triton.ws", "triton.tma", "triton.ptr", "varlen.triton", "triton.quant.ws", "triton.quant.general", "meta"):
        assert re.search(rf"^  {re.escape(name)} +(no|ok|CHOSEN)", out, re.M), name
    assert "chosen: sdpa.cpu" in out


def test_explain_auto_policy_says_which_levels_and_why(capsys, monkeypatch):
    # Under the CPU interpreter (as in CI) the quantized kernels run, so every level is offered.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["explain", "--shape", "1,4,256,64", "--device", "cpu", "--dtype", "bf16", "--causal",
                 "--mode", "auto", "--tolerance", "3e-2"]) == 0
    out = capsys.readouterr().out
    assert "chosen: triton.quant" in out and "one of (exact, qk8, fp8) under tolerance 0.03" in out
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert main(["explain", "--shape", "1,4,256,64", "--device", "cpu", "--dtype", "bf16", "--mode", "auto"]) == 0
    out = capsys.readouterr().out
    assert "chosen: sdpa.cpu" in out and "quantized kernels run on CUDA GPUs" in out and "it runs exact" in out
    assert main(["explain", "--shape", "1,4,256,64", "--mode", "auto", "--precisions", "native,int4"]) == 2
    assert "Policy.precisions entries must be from" in capsys.readouterr().err


def test_explain_takes_the_policy_defaults_of_adaattn_policy(capsys):
    import json

    from adaattn import Policy

    shape = ["explain", "--shape", "1,4,256,64", "--device", "cpu", "--json"]
    for extra, want in (([], Policy()), (["--mode", "auto"], Policy(mode="auto")),
                        (["--mode", "auto", "--tolerance", "0.05"], Policy(mode="auto", tolerance=0.05)),
                        (["--mode", "auto", "--precisions", "native,int8"], Policy(mode="auto", precisions=("native", "int8"))),
                        (["--mode", "auto", "--approximations", "skip"], Policy(mode="auto", approximations=("skip",)))):
        main(shape + extra)
        assert json.loads(capsys.readouterr().out)["policy"] == repr(want), extra
    assert main(shape + ["--mode", "auto", "--tolerance", "2"]) == 2
    assert capsys.readouterr().err == ("adaattn explain: Policy.tolerance must be in (0, 1) (a relative error, "
                                       "exclusive), got 2.0\n")


def _priority_and_runner_lines(out):
    head = next(line for line in out.splitlines() if line.startswith("priority ("))
    runners = dict(re.findall(r"^  (\S+) +(.*)$", out, re.M))
    listed = re.findall(r"[a-z_]+(?:\.[a-z_]+)*", head.split(": ", 1)[1].replace("(approximate, mode='auto')", "")
                        .replace("(named in Policy.backends)", ""))
    return head, listed, runners


def test_explain_priority_line_is_the_list_that_applies_and_runner_lines_agree(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the quantized runners take the call under mode auto)
    cases = [([], "priority (cpu/cpu, medium sequences): sdpa.cpu"),
             (["--mode", "auto"], "priority (cpu/cpu, medium sequences): triton.quant.ws > triton.quant.general "
                                  "(approximate, mode='auto') > sdpa.cpu"),
             (["--backends", "sdpa,reference"], "priority (cpu/cpu, medium sequences): sdpa.cpu > sdpa.cudnn > "
                                                "sdpa.flash > sdpa.efficient > sdpa.math > reference (named in "
                                                "Policy.backends)")]
    for extra, want in cases:
        assert main(["explain", "--shape", "2,16,1024,64", "--causal", "--device", "cpu"] + extra) == 0
        head, listed, runners = _priority_and_runner_lines(capsys.readouterr().out)
        assert head == want, extra
        assert set(runners) == set(REGISTRY) and set(listed) <= set(runners)
        for name, status in runners.items():  # "not in the priority list": said of every exact runner the line
            if name in listed:                # leaves out (and Policy.backends admits), and of no other
                assert "not in the priority list" not in status, (extra, name, status)
            elif REGISTRY[name].exact and "excluded by Policy.backends" not in status:
                assert "not in the priority list for cpu/cpu" in status, (extra, name, status)
            else:
                assert status.startswith("no: ") and "not in the priority list" not in status, (extra, name, status)


def test_explain_with_unsatisfiable_backends_exits_nonzero(capsys):
    assert main(["explain", "--shape", "1,4,128,64", "--device", "cpu", "--backends", "sdpa.flash"]) == 1
    assert "no runner can run" in capsys.readouterr().out


def test_python_dash_m_runs():
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "adaattn", "explain", "--shape", "1,2,64,32", "--device", "cpu"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "chosen: sdpa.cpu" in r.stdout


def test_explain_ring_lists_every_block_runner_with_its_reasons(capsys, monkeypatch):
    """`adaattn explain --ring`: the planner's choice for a block of ring_attention, each runner
    with its reasons; a named kernel that cannot run says why (exit 2)."""
    from adaattn.cli import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # on the CPU proper, Triton declines
    assert main(["explain", "--ring", "--shape", "1,32,16384,128", "--kv-heads", "8", "--causal", "--device", "cpu",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "ring_block" and data["runner"] == "ring.torch"
    assert set(data["reasons"]) == {"ring.torch", "ring.triton", "ring.cudnn"}
    assert data["reasons"]["ring.torch"] == [] and data["reasons"]["ring.cudnn"]
    assert main(["explain", "--ring", "--shape", "1,8,64,64", "--device", "cpu", "--kernel", "cudnn"]) == 2
    assert "kernel='cudnn' cannot run these tensors" in capsys.readouterr().err
    assert main(["explain", "--ring", "--decode", "--shape", "1,8,64,64", "--device", "cpu"]) == 2
