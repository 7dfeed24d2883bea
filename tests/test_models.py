"""adaattn.models: the byte-level GPT, its corpus, weights on disk, capture, `adaattn eval`, and
the scripts that train and time it (CPU, small sizes; the shipped weights where present)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from adaattn import Policy, cli
from adaattn.backends.reference import reference_attention
from adaattn.models import DEFAULT_WEIGHTS, GPT, GPTConfig, capture, data, load, save
from adaattn.models import evaluate as ev
from adaattn.models.capture import Capture, LayerCapture
from adaattn.models.gpt import apply_rope, rope_tables
from adaattn.models.pretrained import read
from helpers import rel_err

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TINY = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, train_seq_len=128)


def tiny_model(config: GPTConfig = TINY, seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(config, **kw)


def tokens(batch: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def script_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


# ---- the model --------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_forward_gives_logits_and_a_finite_loss_with_gradients_for_mha_gqa_and_mqa(kv_heads):
    model = tiny_model(GPTConfig(n_layer=2, n_head=4, n_kv_head=kv_heads, d_model=64))
    x = tokens(2, 50)
    logits, loss = model(x, torch.roll(x, -1, 1))
    assert logits.shape == (2, 50, 256) and logits.dtype == torch.float32
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(256)) < 0.5  # near uniform at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_adaattn_and_sdpa_attention_give_the_same_logits():
    ours, peer = tiny_model(), tiny_model(attention="sdpa")
    x = tokens(2, 77)
    torch.testing.assert_close(ours(x)[0], peer(x)[0], rtol=1e-5, atol=1e-5)


def test_a_policy_reaches_every_attention_call():
    model = tiny_model(policy=Policy(backends=("reference",)))
    from adaattn import stats

    with stats.collect() as records:
        model(tokens(1, 16))
    assert [r.backend for r in records] == ["reference"] * TINY.n_layer
    assert [r.label for r in records] == [f"layer{i}" for i in range(TINY.n_layer)]


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    plain, ckpt = tiny_model(), tiny_model(checkpoint=True)
    x = tokens(2, 40)
    y = torch.roll(x, -1, 1)
    losses = []
    for m in (plain, ckpt):
        m.train()
        _, loss = m(x, y)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1])
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_rope_rotates_pairs_by_position_and_keeps_position_zero():
    cos, sin = rope_tables(8, 16, 10000.0, "cpu", torch.float32)
    x = torch.randn(1, 8, 2, 16)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y[:, 0], x[:, 0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths
    # Scores depend on relative position only: q at i+s, k at j+s gives the same dot product.
    q, k = torch.randn(16), torch.randn(16)
    rot = lambda v, pos: apply_rope(v.view(1, 1, 1, 16).expand(1, 8, 1, 16), cos, sin)[0, pos, 0]  # noqa: E731
    assert torch.dot(rot(q, 5), rot(k, 2)).item() == pytest.approx(torch.dot(rot(q, 7), rot(k, 4)).item(), rel=1e-5)


def test_config_rejects_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_head=6, n_kv_head=4)
    with pytest.raises(ValueError, match="d_model"):
        GPTConfig(d_model=100, n_head=6, n_kv_head=2)
    with pytest.raises(ValueError, match="attention must be one of"):
        GPT(TINY, attention="flash")


# ---- the corpus -------------------------------------------------------------------------


def test_split_is_by_a_hash_of_the_relative_path_and_about_a_tenth_held_out():
    assert data.is_heldout("json/decoder.py") == data.is_heldout("json/decoder.py")
    files = data.stdlib_files()
    assert files == sorted(files) and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f.split("/") for f in files)
    held = [f for f in files if data.is_heldout(f)]
    assert 0.05 < len(held) / len(files) < 0.15


def test_corpus_is_bytes_with_one_separator_per_file():
    corpus = data.load_corpus()
    info = corpus.info
    assert corpus.train.dtype == torch.uint8 and corpus.heldout.dtype == torch.uint8
    assert int((corpus.train == data.SEPARATOR).sum()) == info["train_files"]
    assert int((corpus.heldout == data.SEPARATOR).sum()) == info["heldout_files"]
    assert info["train_bytes"] > 5 * info["heldout_bytes"] > 0
    assert info["python"] and len(info["sha256"]) == 64


def test_windows_cover_the_text_once_and_random_batches_repeat_with_the_seed():
    stream = torch.arange(100, dtype=torch.uint8)
    w = data.windows(stream, 10)
    assert w.shape == (9, 11) and w.dtype == torch.long
    assert torch.equal(w[:, 1:].flatten(), torch.arange(1, 91))  # each byte after the first is a target once
    assert torch.equal(data.windows(stream, 10, max_windows=2), w[:2])
    with pytest.raises(ValueError):
        data.windows(stream, 100)
    a = data.random_batch(stream, 10, 4, torch.Generator().manual_seed(3))
    b = data.random_batch(stream, 10, 4, torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[0][:, 1:], a[1][:, :-1])


def test_unigram_baseline_is_the_entropy_of_byte_frequencies():
    stream = torch.tensor([1, 2] * 50_000, dtype=torch.uint8)  # add-one smoothing fades
    assert data.unigram_bits_per_byte(stream, stream) == pytest.approx(1.0, abs=0.02)


# ---- weights on disk --------------------------------------------------------------------


@pytest.mark.parametrize("storage, tol", [("fp32", 0.0), ("bf16", 1e-2), ("int8", 2e-2)])
def test_stored_weights_load_back_with_config_and_meta(tmp_path, storage, tol):
    model = tiny_model()
    path = save(model, tmp_path / "w.pt", storage, meta={"command": "x", "version": torch.__version__})
    back = load(path)
    assert back.config == model.config and back.meta["command"] == "x" and back.meta["storage"] == storage
    assert not back.training
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert rel_err(b, a) <= tol, name
    x = tokens(1, 32)
    assert rel_err(back(x)[0], model(x)[0]) <= 5 * tol + 1e-6


def test_int8_storage_is_a_quarter_of_float32(tmp_path):
    model = tiny_model(GPTConfig(n_layer=2, n_head=4, n_kv_head=4, d_model=256))
    small = save(model, tmp_path / "a.pt", "int8").stat().st_size
    big = save(model, tmp_path / "b.pt", "fp32").stat().st_size
    assert small < 0.3 * big
    assert read(tmp_path / "a.pt")["tensors"]["blocks.0.attn.qkv.weight"]["q"].dtype == torch.int8


def test_loading_a_missing_or_foreign_file_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model weights"):
        load(tmp_path / "none.pt")
    torch.save({"a": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an adaattn GPT"):
        load(tmp_path / "other.pt")


# ---- capture ----------------------------------------------------------------------------


def check_layers_reproduce_exact_attention(cap):
    """MEASURING.md on every captured layer: the model's output against float64 exact attention."""
    for lc in cap.layers:
        ref = reference_attention(lc.q, lc.k, lc.v, is_causal=True)
        peer = F.scaled_dot_product_attention(lc.q, lc.k, lc.v, is_causal=True, enable_gqa=lc.gqa)
        e_model, e_peer = rel_err(lc.out, ref), rel_err(peer, ref)
        assert e_model <= 2 * e_peer + 1e-6, f"layer {lc.layer}: {e_model:.2e} vs sdpa {e_peer:.2e}"


def test_capture_keeps_post_rope_qkv_and_exact_attention_reproduces_each_layer():
    model = tiny_model()
    x = tokens(2, 96)
    cap = capture(model, x)
    assert len(cap.layers) == TINY.n_layer and cap.tokens.shape == (2, 96)
    lc = cap.layers[0]
    assert lc.q.shape == (2, 4, 96, 16) and lc.k.shape == (2, 2, 96, 16) and lc.out.shape == (2, 4, 96, 16)
    assert lc.q.is_contiguous() and lc.gqa
    # Layer 0's queries and keys recomputed by hand: projection of the normed embedding, then RoPE.
    with torch.no_grad():
        h = model.blocks[0].norm1(model.embed(x))
        q, k, _ = model.blocks[0].attn.qkv(h).split([64, 32, 32], dim=-1)
        cos, sin = rope_tables(96, 16, TINY.rope_base, "cpu", torch.float32)
        torch.testing.assert_close(lc.q, apply_rope(q.view(2, 96, 4, 16), cos, sin).transpose(1, 2))
        torch.testing.assert_close(lc.k, apply_rope(k.view(2, 96, 2, 16), cos, sin).transpose(1, 2))
    check_layers_reproduce_exact_attention(cap)
    # End to end: the model with float64 exact attention in every layer gives the same logits.
    with torch.no_grad():
        ref_model = tiny_model(policy=Policy(backends=("reference",)))
        torch.testing.assert_close(ref_model(x)[0], model(x)[0], rtol=1e-4, atol=1e-5)


def test_capture_on_heldout_text_picks_layers_and_restores_the_model():
    model = tiny_model(attention="sdpa")
    model.train()
    cap = capture(model, seq_len=64, batch=2, layers=[1])
    assert [lc.layer for lc in cap.layers] == [1] and cap.tokens.shape == (2, 64)
    assert cap.bits_per_byte is not None and 6 < cap.bits_per_byte < 10  # untrained: about 8 bits
    assert model.attention == "sdpa" and model.training
    assert all(b.attn.recorder is None for b in model.blocks)
    with pytest.raises(ValueError, match="layers must be in"):
        capture(model, seq_len=16, layers=[5])
    with pytest.raises(ValueError, match="int64"):
        capture(model, torch.zeros(1, 8, dtype=torch.int32))


# ---- decoding over a KV cache -------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cached_forward_continues_a_sequence_as_the_full_forward_computes_it(kv_heads):
    model = tiny_model(GPTConfig(n_layer=2, n_head=4, n_kv_head=kv_heads, d_model=64))
    model.eval()
    x = tokens(2, 40, seed=3)
    full, _ = model(x)
    cache = model.make_cache(2, 48)
    logits = [model(x[:, :17], cache=cache)[0]]  # the prompt
    for a, b in ((17, 18), (18, 23), (23, 40)):  # one token, then chunks against the cache
        logits.append(model(x[:, a:b], cache=cache)[0])
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-4, atol=1e-4)
    assert [cache.length(s, layer) for s in range(2) for layer in range(2)] == [40] * 4
    with pytest.raises(ValueError, match="do not fit"):
        model(x[:, :9], cache=cache)
    with pytest.raises(ValueError, match="batch is 2"):
        model(x[:1, :1], cache=cache)


def test_greedy_generate_with_a_cache_gives_the_tokens_of_recomputing_and_of_sdpa():
    model, peer = tiny_model(), tiny_model(attention="sdpa")
    prompt = tokens(3, 21, seed=4)
    want = peer.generate(prompt, 12, use_cache=False)
    assert want.shape == (3, 33) and torch.equal(want[:, :21], prompt)
    assert torch.equal(model.generate(prompt, 12), want)
    assert torch.equal(model.generate(prompt, 12, use_cache=False), want)
    assert torch.equal(peer.generate(prompt, 12), want)  # sdpa over the cache (decode runner "sdpa")
    cache = model.make_cache(3, 40, storage="int8")
    assert (model.generate(prompt, 12, cache=cache) == want).float().mean() > 0.8  # quantized: near-ties may flip
    with pytest.raises(ValueError, match="must be empty"):
        model.generate(prompt, 2, cache=cache)
    g = torch.Generator().manual_seed(0)
    sampled = model.generate(prompt, 12, temperature=1.0, top_k=5, generator=g)
    assert sampled.shape == (3, 33) and not torch.equal(sampled, want)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 2, temperature=-1.0)


@pytest.mark.parametrize("storage", ["native", "fp8", "int8"])
def test_bits_per_byte_through_the_cache_match_the_forward_within_the_storage_error(storage):
    model = tiny_model()
    wins = ev.heldout_windows(48, max_windows=2)
    exact = ev.score_windows(model, wins, batch=2)["bits_per_byte"]
    got = ev.score_windows(model, wins, 2, kv_cache=storage, chunk=7)
    assert got["bytes"] == 2 * 48 and got["storage"] == storage
    tol = {"native": 1e-5, "fp8": 2e-2, "int8": 5e-3}[storage]
    assert got["bits_per_byte"] == pytest.approx(exact, rel=tol)


# ---- evaluation -------------------------------------------------------------------------


def test_heldout_bits_per_byte_is_the_models_mean_loss():
    model = tiny_model()
    wins = ev.heldout_windows(32, max_windows=3)
    got = ev.score_windows(model, wins, batch=2)
    _, loss = model(wins[:, :-1], wins[:, 1:])
    assert got["bytes"] == 3 * 32 and got["windows"] == 3
    assert got["bits_per_byte"] == pytest.approx(loss.item() / math.log(2), rel=1e-5)


def test_entropy_of_a_uniform_head_is_the_uniform_figure_and_of_a_sharp_head_near_zero():
    n = 64
    q = torch.zeros(1, 1, n, 8)
    k = torch.randn(1, 1, n, 8)
    uniform = Capture(torch.zeros(1, n, dtype=torch.long), [LayerCapture(0, q, k, k, q)])
    s = ev.attention_structure(uniform)
    assert s["entropy_bits"][0][0] == pytest.approx(ev.uniform_entropy_bits(n), rel=1e-5)
    assert s["mean_distance"][0][0] == pytest.approx((n - 1) / 4, rel=1e-5)  # mean of i/2 over rows
    # Each query matches only its own key (orthogonal keys, large scale): entropy ~ 0, distance ~ 0.
    eye = torch.eye(n).view(1, 1, n, n) * 100.0
    sharp = Capture(torch.zeros(1, n, dtype=torch.long), [LayerCapture(0, eye, eye, eye, eye)])
    s = ev.attention_structure(sharp)
    assert s["entropy_bits"][0][0] < 1e-3 and s["mean_distance"][0][0] < 1e-3 and s["max_weight"][0][0] > 0.999


def test_policy_errors_are_tiny_for_exact_attention_and_name_every_head():
    cap = capture(tiny_model(), seq_len=64)
    errors = ev.policy_errors(cap, None, error_rows=16)
    assert [e["layer"] for e in errors] == [0, 1]
    for e in errors:
        assert e["policy"] <= 2 * e["sdpa"] + 1e-6 and len(e["policy_per_head"]) == 4 and e["error_rows"] == 16


def test_eval_command_reports_bits_per_byte_errors_and_entropy(tmp_path, capsys):
    path = save(tiny_model(), tmp_path / "w.pt", "int8", meta={"corpus": {"python": "3.x"}})
    out = tmp_path / "eval.json"
    rc = ev.cli(["--weights", str(path), "--context", "64", "--device", "cpu", "--max-windows", "3",
                 "--error-rows", "8", "--kv-cache", "native,int8", "--kv-chunk", "9", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "held-out bits per byte at context 64" in text and "attention entropy" in text
    result = json.loads(out.read_text())
    assert result["heldout"]["windows"] == 3 and len(result["errors"]) == 2
    assert len(result["structure"]["entropy_bits"]) == 2 and len(result["structure"]["entropy_bits"][0]) == 4
    assert 4 < result["unigram_bits_per_byte"] < 6
    assert "through an adaattn KV cache (int8, 9 bytes a step)" in text
    assert abs(result["kv_cache"]["native"]["relative_to_forward"]) < 1e-5
    assert result["kv_cache"]["int8"]["chunk"] == 9 and abs(result["kv_cache"]["int8"]["relative_to_forward"]) < 1e-2
    assert ev.cli(["--weights", str(tmp_path / "none.pt"), "--device", "cpu"]) == 2


def test_eval_command_takes_the_policy_defaults_of_adaattn_policy(tmp_path, capsys):
    from adaattn import Policy

    path = save(tiny_model(), tmp_path / "w.pt", "int8")
    out = tmp_path / "eval.json"
    args = ["--weights", str(path), "--context", "32", "--device", "cpu", "--max-windows", "1", "--error-rows", "4",
            "--no-structure", "--json", str(out)]
    for extra, want in ((["--mode", "auto"], Policy(mode="auto")),
                        (["--mode", "auto", "--precisions", "int8"], Policy(mode="auto", precisions=("int8",))),
                        ([], Policy())):
        assert ev.cli(args + extra) == 0
        assert json.loads(out.read_text())["policy"] == repr(want), extra
    assert ev.cli(args + ["--mode", "auto", "--tolerance", "1"]) == 2
    assert "Policy.tolerance must be in (0, 1)" in capsys.readouterr().err


def test_eval_command_repeats_the_scoring_and_reports_each_pass(tmp_path, capsys):
    # --repeat scores the same windows again through the same call sites: the bits per byte do not
    # move, and each pass's wall time is reported (the later passes are the warm cost).
    path = save(tiny_model(), tmp_path / "w.pt", "int8")
    out = tmp_path / "eval.json"
    args = ["--weights", str(path), "--context", "32", "--device", "cpu", "--max-windows", "2", "--error-rows", "4",
            "--no-structure", "--json", str(out)]
    assert ev.cli(args + ["--repeat", "3"]) == 0
    repeated = json.loads(out.read_text())["heldout"]
    assert ev.cli(args) == 0
    once = json.loads(out.read_text())["heldout"]
    assert len(repeated["passes_s"]) == 3 and all(t > 0 for t in repeated["passes_s"]) and len(once["passes_s"]) == 1
    assert repeated["bits_per_byte"] == once["bits_per_byte"]
    assert "s); unigram baseline" in capsys.readouterr().out
    assert ev.cli(args + ["--repeat", "0"]) == 2


def test_bench_gpt_workload_times_backends_on_captured_inputs(tmp_path):
    path = save(tiny_model(), tmp_path / "w.pt")
    rc = cli.main(["bench", "--workload", "gpt", "--weights", str(path), "--device", "cpu", "--seq-lens", "32",
                   "--gpt-layers", "all", "--backends", "sdpa,torch", "--rep-ms", "2", "--no-overhead",
                   "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    (res,) = tmp_path.glob("bench-*.json")
    record = json.loads(res.read_text())
    assert record["config"]["workload"]["layers"] == [0, 1]
    rows = record["rows"]
    assert [(r["layer"], r["backend"]) for r in rows] == [(0, "torch"), (0, "sdpa.cpu"), (1, "torch"), (1, "sdpa.cpu")]
    assert all(r["workload"] == "gpt" and r["heads"] == 4 and r["kv_heads"] == 2 and r["head_dim"] == 16
               and r["causal"] and r["error"] is None and r["rel_error"] < 1e-5 for r in rows)
    assert cli.main(["bench", "--workload", "gpt", "--weights", str(path), "--heads", "8", "--device", "cpu"]) == 2


# ---- the shipped weights ----------------------------------------------------------------


@pytest.mark.skipif(not DEFAULT_WEIGHTS.is_file(), reason=f"no shipped weights at {DEFAULT_WEIGHTS}")
def test_shipped_weights_capture_at_1024_and_exact_attention_reproduces_the_forward():
    model = load()
    # Made by the training script when it lived at benchmarks/train_gpt.py (now adaattn.models.train).
    assert model.meta.get("command", "").startswith("PYTHONPATH=src python3 benchmarks/train_gpt.py")
    assert DEFAULT_WEIGHTS.stat().st_size <= 25 * 10**6
    t0 = time.perf_counter()
    cap = capture(model, seq_len=1024)
    seconds = time.perf_counter() - t0
    assert len(cap.layers) == model.config.n_layer
    assert cap.layers[0].q.shape[2] == 1024
    assert seconds < 30, f"capture at N=1024 took {seconds:.1f} s on the CPU"
    check_layers_reproduce_exact_attention(cap)
    # A trained model: far below the unigram baseline (about 4.6 bits) on held-out bytes.
    assert cap.bits_per_byte < 3.0


# ---- the scripts ------------------------------------------------------------------------


@pytest.mark.slow
def test_train_script_runs_both_kinds_and_writes_log_plots_weights_and_eval(tmp_path):
    cmd = [sys.executable, "-m", "adaattn.models.train", "--both", "--out", str(tmp_path),
           "--layers", "2", "--d-model", "32", "--heads", "2", "--kv-heads", "1", "--seq-len", "64", "--batch", "2",
           "--steps", "6", "--eval-windows", "2", "--final-eval-windows", "2", "--eval-context", "64",
           "--log-every", "2", "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=script_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert [r["attention"] for r in log["runs"]] == ["adaattn", "sdpa"]
    assert all(r["steps"] == 6 and len(r["log"]) == 3 for r in log["runs"])
    # Same seed and batches, exact attention both ways: the same curve on the CPU.
    assert log["runs"][0]["log"][-1]["loss"] == pytest.approx(log["runs"][1]["log"][-1]["loss"], rel=1e-4)
    assert log["comparison"]["within_1_percent"] and log["corpus"]["python"]
    model = load(tmp_path / "gpt_stdlib.pt")
    assert model.config.d_model == 32 and model.meta["command"].startswith("python3 -m adaattn.models.train")
    assert "heldout_bits_per_byte" in model.meta
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["context"] == 64 and result["structure"]["entropy_bits"]


def test_attention_spec_parses_the_four_forms_and_rejects_others():
    from adaattn import Policy
    from adaattn.models.gpt import parse_attention

    assert parse_attention("sdpa") == ("sdpa", None)
    assert parse_attention("adaattn") == ("adaattn", None)
    assert parse_attention("adaattn:triton") == ("adaattn", Policy(backends=("triton",)))
    assert parse_attention("auto:0.03") == ("adaattn", Policy(mode="auto", precisions=("native", "int8", "fp8"),
                                                               tolerance=0.03))
    for bad in ("flash", "adaattn:", "", "auto:x"):
        with pytest.raises(ValueError, match="attention spec"):
            parse_attention(bad)
