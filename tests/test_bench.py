"""`adaattn bench`: the rows it measures, the error yardstick it samples, and the files it writes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaattn import cli, planner
from adaattn import policy as policy_mod
from adaattn.backends.base import Runner
from adaattn.backends.reference import reference_attention
from adaattn import version
from adaattn.bench import accuracy, overhead, report
from adaattn.bench.grid import Shape, parse_seq_lens
from adaattn.bench.suite import Settings, run_suite

SRC = Path(__file__).resolve().parents[1] / "src"
CPU = torch.device("cpu")
REQUIRED_KEYS = {"gpu", "cpu", "torch", "triton", "git_commit", "config", "method", "rows", "overhead", "date"}


def tiny_shapes(causal=(False, True), seq_lens=(16, 100)) -> list[Shape]:
    return [Shape(1, 2, 2, n, 16, torch.float32, c) for c in causal for n in seq_lens]


def fast_settings(**kw) -> Settings:
    return Settings(device=CPU, rep_ms=2.0, progress=False, **kw)


def test_tiny_grid_rows_have_finite_times_and_float32_sdpa_cpu_error_below_1e5():
    shapes = tiny_shapes()
    rows = run_suite(shapes, fast_settings())
    assert len(rows) == 3 * len(shapes)
    for shape in shapes:
        mine = [r for r in rows if r["seq_len"] == shape.seq_len and r["causal"] == shape.causal]
        assert [r["backend"] for r in mine] == ["torch", "sdpa.cpu", "adaattn"]
        for r in mine:
            assert r["error"] is None
            assert math.isfinite(r["ms"]) and r["ms"] > 0
            assert r["tflops"] == pytest.approx(shape.flops() / (r["ms"] * 1e-3) / 1e12)
            assert r["peak_mib"] is None  # memory is a CUDA figure
            assert r["error_within_2x_torch"] is True
        cpu_row = next(r for r in mine if r["backend"] == "sdpa.cpu")
        assert 0 < cpu_row["rel_error"] < 1e-5
        assert cpu_row["error_rows"] == shape.seq_len  # small N: every row is checked
        assert next(r for r in mine if r["backend"] == "adaattn")["picked"] == "sdpa.cpu"


def test_backward_rows_count_three_and_a_half_forward_flops():
    shape = Shape(1, 2, 2, 32, 16, torch.float32, True)
    rows = run_suite([shape], fast_settings(backward=True))
    assert {r["backend"] for r in rows} == {"torch", "sdpa.cpu", "adaattn"}
    for r in rows:
        assert r["error"] is None and r["ms"] > 0
        assert r["tflops"] == pytest.approx(3.5 * shape.flops() / (r["ms"] * 1e-3) / 1e12)
        assert r["rel_error"] < 1e-5


def test_flops_follow_measuring_md():
    full = Shape(2, 16, 16, 1024, 128, torch.bfloat16, False)
    causal = Shape(2, 16, 16, 1024, 128, torch.bfloat16, True)
    assert full.flops() == 4 * 2 * 16 * 1024 * 1024 * 128
    assert causal.flops() == full.flops() / 2
    assert causal.flops(backward=True) == 3.5 * causal.flops()


def test_sample_rows_spread_evenly_and_take_every_row_when_few():
    rows = accuracy.sample_rows(1000, 256)
    assert len(rows) == 256 and rows[0] == 0 and rows[-1] == 999
    assert torch.all(rows[1:] > rows[:-1])
    assert torch.equal(accuracy.sample_rows(100, 256), torch.arange(100))


@pytest.mark.parametrize("causal", [False, True])
def test_sampled_reference_equals_full_reference_on_sampled_rows(causal, monkeypatch):
    monkeypatch.setattr(accuracy, "CHUNK_BYTES", 1)  # force one kv head per chunk
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 300, 16, generator=gen)
    k = torch.randn(2, 2, 300, 16, generator=gen)
    v = torch.randn(2, 2, 300, 24, generator=gen)
    rows = accuracy.sample_rows(300, 17)
    got = accuracy.sampled_reference(q, k, v, rows, causal)
    full = reference_attention(q, k, v, None, causal)
    assert got.shape == (2, 4, len(rows), 24) and got.dtype == torch.float64
    torch.testing.assert_close(got, full[:, :, rows], rtol=1e-12, atol=1e-12)
    # An output wrong on a sampled row shows; one wrong only off the sample does not.
    out = full.float().clone()
    assert accuracy.relative_error(out, got, rows) < 1e-6
    out[:, :, rows[1]] += 1.0
    assert accuracy.relative_error(out, got, rows) > 1e-2


class ExplodingRunner(Runner):
    name = "exploding"

    def supports(self, problem, policy):
        return []

    def run(self, query, key, value, attn_mask, problem, launch, label=None):
        raise RuntimeError("kernel exploded")


def test_a_backend_that_raises_is_reported_in_its_row_and_the_run_goes_on(monkeypatch):
    monkeypatch.setitem(planner.REGISTRY, "exploding", ExplodingRunner())
    monkeypatch.setattr(policy_mod, "known_runners", {*policy_mod.known_runners, "exploding"})
    planner.reset()
    rows = run_suite(tiny_shapes(causal=(False,), seq_lens=(16,)), fast_settings())
    by_name = {r["backend"]: r for r in rows}
    assert by_name["exploding"]["error"] == "RuntimeError: kernel exploded"
    assert by_name["exploding"]["ms"] is None
    assert by_name["sdpa.cpu"]["error"] is None and by_name["sdpa.cpu"]["ms"] > 0
    assert by_name["adaattn"]["picked"] == "sdpa.cpu"  # not in the priority list, so never dispatched
    table = report.format_table(rows)
    assert "kernel exploded" in table


def test_table_prints_one_line_per_shape_and_backend():
    rows = run_suite(tiny_shapes(), fast_settings())
    lines = [ln for ln in report.format_table(rows).splitlines()[2:] if ln.strip()]
    assert len(lines) == len(rows)
    assert sum("adaattn" in ln and "picked sdpa.cpu" in ln for ln in lines) == 4


def test_overhead_row_compares_adaattn_with_the_same_kernel_called_directly():
    row = overhead.measure_shape(Shape(1, 2, 2, 32, 16, torch.float32, False), CPU, repeats=3, target_ms=2)
    assert row["error"] is None and row["picked"] == "sdpa.cpu"
    assert set(row["per_call_us"]) == {"adaattn", "backend.run", "sdpa"}
    assert row["baseline"] == "sdpa"  # on the CPU torch's own choice is the kernel sdpa.cpu runs
    us = row["per_call_us"]
    assert all(t > 0 for t in us.values())
    assert row["overhead_us"] == pytest.approx(us["adaattn"] - us["sdpa"])
    assert row["overhead_pct"] == pytest.approx(100 * row["overhead_us"] / us["sdpa"])


def test_out_writes_json_with_versions_config_and_every_row(tmp_path):
    rc = cli.main(["bench", "--device", "cpu", "--seq-lens", "32,64", "--heads", "2", "--head-dim", "16", "--causal", "yes",
                   "--rep-ms", "2", "--no-overhead", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    (path,) = tmp_path.glob("bench-*.json")
    data = json.loads(path.read_text())
    assert REQUIRED_KEYS <= set(data)
    assert data["torch"] == torch.__version__
    assert data["gpu"] is None and data["cpu"]
    assert data["git_commit"] is None or len(data["git_commit"]) == 40
    assert data["config"]["mode"] == "custom"
    assert data["config"]["grid"]["seq_lens"] == [32, 64] and data["config"]["grid"]["causal"] == "yes"
    assert "error_rows" in data["method"]
    assert len(data["rows"]) == 2 * 3 and data["overhead"] == []
    assert all(r["causal"] and r["error"] is None and r["ms"] > 0 for r in data["rows"])


def test_backends_option_restricts_rows_and_rejects_unknown_names(tmp_path, capsys):
    assert cli.main(["bench", "--backends", "nonesuch"]) == 2
    assert "unknown nonesuch" in capsys.readouterr().err
    rc = cli.main(["bench", "--device", "cpu", "--seq-lens", "16", "--heads", "2", "--head-dim", "16", "--causal", "no",
                   "--backends", "sdpa,torch", "--rep-ms", "2", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    (path,) = tmp_path.glob("bench-*.json")
    assert [r["backend"] for r in json.loads(path.read_text())["rows"]] == ["torch", "sdpa.cpu"]


def test_seq_lens_take_k_suffixes():
    assert parse_seq_lens("1k,4096,16k") == (1024, 4096, 16384)
    with pytest.raises(ValueError):
        parse_seq_lens("12x")


def test_git_commit_read_from_the_git_files_matches_git():
    here = SRC / "adaattn" / "bench"
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
    except OSError:
        pytest.skip("git is not installed")
    if res.returncode != 0:
        pytest.skip("not a git checkout")
    assert version._read_head(here) == res.stdout.strip()
    assert report.git_commit() == res.stdout.strip()


def test_quick_on_a_cpu_runs_the_cpu_suite_with_its_overhead_and_prints_the_table_last(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, "-m", "adaattn", "bench", "--quick", "--device", "cpu", "--threads", "1",
         "--rep-ms", "1", "--warmup-ms", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert "dispatch overhead" in res.stdout
    assert lines[-1].split()[0] == "adaattn"  # the table comes last
    (path,) = tmp_path.glob("cpu-bench-*.json")
    data = json.loads(path.read_text())
    assert data["suite"] == "cpu"
    assert {r["peer"] for r in data["rows"]} == {"math", "fused", "adaattn"}
    assert {r["x"] for r in data["rows"]} == {128, 512, 1024, 2048}
    assert [o["seq_len"] for o in data["overhead"]] == [128, 512]
    assert all(o["error"] is None and o["picked"] == "sdpa.cpu" for o in data["overhead"])


def test_a_graphed_peer_that_fails_to_build_reports_in_its_row_and_its_case_still_runs():
    """graphed(): a warm call or capture that raises (a kernel's OutOfResources on an H200 took
    every row of the decode suite's cases with it) becomes that peer's row error; the other peers
    of the case are timed."""
    from adaattn.bench import cases as cases_mod

    def broken():
        raise RuntimeError("out of resource: shared memory")

    x = torch.ones(4)

    def make():
        return [cases_mod.Peer("ok", lambda: x * 2), cases_mod.graphed("broken graph", broken)], None

    case = cases_mod.Case("t", "t", 4, {}, "ok", "TB/s", 4.0, make)
    rows = {r["peer"]: r for r in cases_mod.run_cases([case], cases_mod.Settings(device=CPU, rep_ms=2.0,
                                                                                   progress=False))}
    assert rows["ok"]["error"] is None and rows["ok"]["ms"] is not None
    assert "out of resource" in rows["broken graph"]["error"] and rows["broken graph"]["ms"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_peer_keeps_what_its_capture_reads_alive():
    """A graphed peer's replay reads the tensors its capture read: the peer keeps them alive. It
    once dropped them, and a decode cache made only for that peer was freed, then unmapped by the
    next capture's empty_cache(): its replay raised an illegal memory access (decode suite, H200)."""
    import gc
    import weakref

    from adaattn.bench.cases import graphed

    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    alive = weakref.ref(x)
    peer = graphed("twice", lambda x=x: x * 2)
    del x
    gc.collect()
    other = graphed("later capture", lambda: torch.ones(4, device="cuda") + 1)  # empty_cache() on entering
    assert alive() is not None, "the captured input was freed while the peer can still replay it"
    torch.testing.assert_close(peer.forward(), torch.arange(1 << 20, dtype=torch.float32, device="cuda") * 2)
    torch.testing.assert_close(other.forward(), torch.full((4,), 2.0, device="cuda"))
