"""`adaattn bench --suite NAME`: the cpu suite end to end, GPU suites refusing a CPU, argument handling."""

from __future__ import annotations

import json

import pytest
import torch

from adaattn import cli
from adaattn.bench import table
from adaattn.bench.suites import SUITES

TINY = ["--rep-ms", "1", "--warmup-ms", "1", "--no-progress"]
CUDA = torch.device("cuda", 0)


def test_cpu_suite_writes_math_fused_and_adaattn_rows_with_spread_and_ratio(tmp_path, capsys):
    rc = cli.main(["bench", "--suite", "cpu", "--device", "cpu", "--seq-lens", "32,64", "--heads", "2",
                   "--head-dim", "16", "--dtype", "fp32", "--no-overhead", *TINY, "--out", str(tmp_path)])
    assert rc == 0
    (path,) = tmp_path.glob("cpu-bench-*.json")
    data = json.loads(path.read_text())
    assert {"gpu", "torch", "triton", "git_commit", "rows", "method"} <= set(data)
    rows = data["rows"]
    assert {r["peer"] for r in rows} == {"math", "fused", "adaattn"}
    assert len(rows) == 3 * 2 * 2  # peers x lengths x causal
    for r in rows:
        assert r["error"] is None, r["error"]
        assert 0 < r["ms_min"] <= r["ms"] <= r["ms_max"]
        assert r["baseline"] == "math" and r["x_baseline"] > 0
        assert r["rel_error"] < 1e-5
    assert all(r["x_baseline"] == pytest.approx(1.0) for r in rows if r["peer"] == "math")
    out = capsys.readouterr().out.strip().splitlines()
    assert "x math" in "\n".join(out) and out[-1].split()[0] == "adaattn"  # the table comes last


@pytest.mark.parametrize("name", [s.name for s in SUITES.values() if s.needs_cuda])
def test_gpu_suites_on_a_cpu_exit_nonzero_with_one_line(name, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--suite", name]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"adaattn bench: --suite {name} needs a CUDA GPU and none is available here "
                   "(--suite cpu runs on the CPU)"]


def test_tick_labels_read_as_sizes():
    assert [table.size_label(n) for n in (128, 1024, 4096, 65536, 1000, 1 << 20)] == \
        ["128", "1k", "4k", "64k", "1000", "1M"]


def _cases(argv: list[str], device=CUDA):
    args = cli.build_parser().parse_args(["bench", *argv])
    return SUITES[args.suite].cases(args, device)


def test_prefill_is_the_yardstick_with_every_peer_named_and_full_adds_1k_and_64k():
    cases = _cases(["--suite", "prefill"])
    assert [(c.x, c.fields["causal"]) for c in cases] == [(4096, False), (16384, False), (4096, True), (16384, True)]
    assert all(c.baseline == "cuDNN" and c.figure == "TFLOP/s" for c in cases)
    assert cases[0].fields == {"batch": 2, "heads": 16, "kv_heads": 16, "seq_len": 4096, "head_dim": 128,
                               "dtype": "bfloat16", "causal": False, "pass": "fwd"}
    assert cases[0].work == 4 * 2 * 16 * 4096 * 4096 * 128 and cases[2].work == cases[0].work / 2
    assert sorted({c.x for c in _cases(["--suite", "prefill", "--full"])}) == [1024, 4096, 16384, 65536]
    assert {c.x for c in _cases(["--suite", "prefill", "--seq-lens", "1k", "--causal", "yes"])} == {1024}


def test_train_counts_three_and_a_half_forward_flops_of_causal_attention():
    cases = _cases(["--suite", "train"])
    assert [c.x for c in cases] == [4096, 16384]
    assert all(c.fields["causal"] and c.fields["pass"] == "fwd+bwd" for c in cases)
    assert cases[0].work == 3.5 * 2 * 2 * 16 * 4096 * 4096 * 128


def test_train_times_the_deterministic_backward_beside_the_default_one():
    from adaattn.bench.peers import Call
    from adaattn.bench.suites import train

    q = torch.zeros(1, 2, 8, 16, requires_grad=True)
    names = [p.name for p in train.train_peers(Call(q, q, q, causal=True, backward=True))]
    assert names[-2:] == ["triton", "triton deterministic"] and "adaattn" in names


def test_decode_figure_is_the_bytes_of_k_and_v():
    everything = _cases(["--suite", "decode"])
    cases = _cases(["--suite", "decode", "--decode-parts", "dense"])
    sparse = _cases(["--suite", "decode", "--decode-parts", "sparse"])
    storage = _cases(["--suite", "decode", "--decode-parts", "storage"])
    assert [c.label for c in everything] == [c.label for c in cases + sparse + storage]
    # storage per head: the whole model's K/V (8 layers, B=16, Hkv=8, D=64, bf16) against cuDNN
    (whole,) = storage
    assert whole.work == 8 * 2 * 16 * 8 * 32768 * 64 * 2 and whole.baseline == "cuDNN" and whole.figure == "TB/s"
    assert whole.fields["tolerance"] == 5e-2 and whole.fields["window"] == 512
    random, generation, layers = sparse[0], sparse[1], sparse[2:]
    assert [c.x for c in layers] == list(range(8)) and all(c.baseline == "kv bf16" for c in layers)
    assert layers[0].work == 2 * 16 * 8 * 32768 * 64 * 2 and layers[0].fields["taus"] == [1e-2, 5e-2]
    assert random.fields["workload"] == "random" and random.work == layers[0].work and random.baseline == "kv bf16"
    # generation: the whole model's K/V (8 layers, B=16, Hkv=2, D=64, bf16) after the prompt and the steps
    n = 30000 + 256
    assert generation.fields["workload"] == "generation" and generation.work == 8 * 2 * 16 * 2 * n * 64 * 2
    assert generation.baseline == "model decode attention, dense" and generation.figure == "TB/s"
    assert [c.x for c in cases] == [8192, 32768, 32768] and all(c.figure == "TB/s" for c in cases)
    assert cases[0].work == 2 * 16 * 8 * 8192 * 128 * 2
    assert cases[0].fields["heads"] == 32 and cases[0].fields["q_len"] == 1
    ragged = cases[2]  # 16 lengths spread over 1k..32k: the figure counts each sequence's own keys
    lens = ragged.fields["kv_lens"]
    assert len(lens) == 16 and min(lens) == 1024 and max(lens) == 32768 and len(set(lens)) == 16
    assert ragged.work == 2 * 8 * sum(lens) * 128 * 2 and ragged.baseline == "kv bf16"


def test_window_sizes_follow_the_length_and_the_option():
    cases = _cases(["--suite", "window"])
    assert [(c.x, c.fields["window"][0], c.fields["pass"]) for c in cases] == [
        (16384, 1024, "fwd"), (16384, 1024, "fwd+bwd"), (65536, 4096, "fwd"), (65536, 4096, "fwd+bwd")]
    assert all(c.baseline == "flex" for c in cases)
    assert {c.fields["window"][0] for c in _cases(["--suite", "window", "--window-size", "256"])} == {256}


def test_varlen_packs_documents_and_quant_takes_tolerances():
    cases = _cases(["--suite", "varlen", "--documents", "4", "--doc-len", "2048"])
    assert [(c.fields["documents"], c.fields["doc_len"]) for c in cases] == [(4, 2048), (4, 2048)]
    assert cases[0].baseline == "cuDNN (batch)" and cases[0].work == 2 * 4 * 16 * 2048 * 2048 * 128
    quant = _cases(["--suite", "quant", "--tolerances", "2e-2"])
    # The four yardsticks, GQA 32/8 at 8k causal, decode at 8k and 32k of KV: each against the default call too.
    assert [c.x for c in quant] == [4096, 16384, 4096, 16384, 8192, 8192, 32768]
    assert all(c.also == ("adaattn exact",) for c in quant)
    assert quant[4].fields["kv_heads"] == 8 and quant[5].fields["q_len"] == 1
    assert len(_cases(["--suite", "quant", "--seq-lens", "1024"])) == 2  # a grid given: the grid alone
    with pytest.raises(SystemExit):
        _cases(["--suite", "quant", "--tolerances", "2"])


def test_hf_and_gpt_options_shape_their_cases():
    hf = _cases(["--suite", "hf", "--seq-lens", "64,128", "--new-tokens", "4"], torch.device("cpu"))
    assert [(c.fields["phase"], c.x) for c in hf] == [("prefill", 64), ("prefill", 128), ("generate", 64),
                                                       ("generate", 128)]
    assert all(c.baseline == "sdpa" and c.figure == "tokens/s" for c in hf) and hf[2].work == 4
    gpt = _cases(["--suite", "gpt", "--gpt-parts", "step,heldout", "--gpt-size", "medium", "--batch", "2"])
    assert [c.series for c in gpt] == ["GPT medium training step", "GPT shipped held-out"]
    assert gpt[0].fields["n_layer"] == 24 and gpt[0].work == 2 * 8192
    with pytest.raises(SystemExit):
        _cases(["--suite", "gpt", "--gpt-parts", "nonesuch"])


def test_hf_suite_runs_a_tiny_llama_on_the_cpu(tmp_path):
    pytest.importorskip("transformers")
    rc = cli.main(["bench", "--suite", "hf", "--device", "cpu", "--prompt-len", "8", "--new-tokens", "2", *TINY,
                   "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads(next(tmp_path.glob("hf-bench-*.json")).read_text())["rows"]
    assert {(r["phase"], r["peer"]) for r in rows if r["error"] is None} == {
        *((p, i) for p in ("prefill", "generate") for i in ("sdpa", "eager", "adaattn")),
        ("generate", "adaattn + Cache"), ("generate", "adaattn + Cache fp8"),
        ("generate", "adaattn + Cache (uncompiled)"), ("generate", "sdpa + StaticCache")}
    same = {r["peer"]: r.get("tokens_equal_to_eager") for r in rows if r["phase"] == "generate"}
    assert same["sdpa"] == same["adaattn"] == same["adaattn + Cache"] == 1.0, same


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["prefill", "decode", "quant", "window", "varlen", "train"])
def test_gpu_suite_runs_small(name, tmp_path):
    sizes = {"decode": ["--seq-lens", "1k"], "window": ["--seq-lens", "2k", "--window-size", "128"],
             "varlen": ["--documents", "2", "--doc-len", "1024"]}.get(name, ["--seq-lens", "1k"])
    rc = cli.main(["bench", "--suite", name, *sizes, *TINY, "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads(next(tmp_path.glob(f"{name}-bench-*.json")).read_text())["rows"]
    base = [r for r in rows if r["peer"] == r["baseline"]]
    assert base and all(r["error"] is None and r["ms_min"] <= r["ms"] <= r["ms_max"] for r in base)


def test_paired_ratio_cancels_drift_between_rounds():
    """Clocks that slow every call of a round alike leave the paired ratio at the true one; the
    ratio of medians moves with the drift."""
    from adaattn.bench.cases import paired_ratio

    drift = [1.0, 1.0, 1.3, 1.3, 1.3]  # the last three rounds ran at lower clocks
    base = [10.0 * d for d in drift]
    peer = [10.0 * d * 1.01 for d in drift[:4]] + [10.0]  # 1% slower in every round but one ended before the drift
    assert paired_ratio(base, peer[:4]) == pytest.approx(1 / 1.01)
    assert paired_ratio(None, peer) is None
    assert paired_ratio(base, [0.0, 10.0]) == pytest.approx(1.0)


def test_distributed_suite_on_the_cpu_times_ring_at_world_size_one(tmp_path):
    import torch.distributed as dist

    try:
        rc = cli.main(["bench", "--suite", "distributed", "--device", "cpu", "--seq-lens", "64", "--heads", "2",
                       "--kv-heads", "1", "--head-dim", "16", "--dtype", "fp32", *TINY, "--out", str(tmp_path)])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert rc == 0
    (path,) = tmp_path.glob("distributed-bench-*.json")
    data = json.loads(path.read_text())
    rows = {(r["pass"], r["peer"]): r for r in data["rows"]}
    for what in ("fwd", "fwd+bwd"):
        for peer in ("adaattn", "ring (world 1)"):
            r = rows[(what, peer)]
            assert r["error"] is None and r["rel_error"] < 1e-5 and r["x_baseline_paired"] > 0, r
    cases = data["summary"]["cases"]
    assert len(cases) == 2 and all(c["ring_over_adaattn"] is not None for c in cases)


def test_cp_suite_under_torchrun_on_two_cpu_processes_checks_the_ring_against_float64(tmp_path):
    """benchmarks/cp.sh's command on gloo with two processes: rank 0 writes the JSON, ours runs at
    every pass with an error within the standard, the ideal is one GPU's share of the heads, and
    torch's context_parallel (no CPU kernel for its sharded SDPA) is reported as not run with why."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "adaattn",
           "bench", "--suite", "cp", "--seq-lens", "128", *TINY, "--out", str(tmp_path), "--commit", "test"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp_path.glob("cp-bench-*.json")
    assert not (tmp_path / "cp-partial-rows.json").exists()
    data = json.loads(path.read_text())
    rows = {(r["pass"], r["peer"]): r for r in data["rows"]}
    for what in ("fwd", "fwd+bwd"):
        ours, ideal = rows[(what, "adaattn.distributed")], rows[(what, "ideal")]
        assert ours["world_size"] == 2 and ours["ms"] > 0 and ours["error_ok"] is True, ours
        assert ours["rel_error"] < 1e-5
        assert "2 of 4 query heads" in ideal["note"] and ideal["ms"] > 0
        assert rows[(what, "torch cp allgather")]["ms"] is None and "not run" in rows[(what, "torch cp allgather")]["note"]
    assert data["summary"]["longest"] == 128 and data["summary"]["errors_ok"] is True
    assert "efficiency" in done.stdout
