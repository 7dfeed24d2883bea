"""Gemma 2 (logit soft-capping) and gpt-oss (attention sinks) through attn_implementation="adaattn",
against transformers' own eager attention: logits, parameter gradients on unpadded positions and
greedy generation, with and without adaattn's Cache (tiny random models, CPU)."""

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

transformers = pytest.importorskip("transformers")
from packaging.version import Version  # noqa: E402

if Version(transformers.__version__) < Version("4.56"):
    pytest.skip("Gemma 2 and gpt-oss with attention-function kwargs need transformers>=4.56", allow_module_level=True)

import adaattn  # noqa: E402
from adaattn.integrations import hf  # noqa: E402


def _gemma2():
    return transformers.Gemma2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, query_pre_attn_scalar=16,
        attn_logit_softcapping=1.5, final_logit_softcapping=30.0, sliding_window=6, initializer_range=0.3,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _gpt_oss():
    return transformers.GptOssConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128, initializer_range=0.3,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)


MODELS = {"gemma2": _gemma2, "gpt_oss": _gpt_oss}


def _model(arch, dtype=torch.float32):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODELS[arch](), attn_implementation="eager")
    if arch == "gpt_oss":
        with torch.no_grad():  # sinks that matter: logits of the size the scores have
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape) * 2)
    return model.to(dtype).eval()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :4] = 0
    mask[0, :4] = 0  # left padding
    return ids, mask


def _logits_and_grads(model, ids, mask):
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    loss = torch.nn.functional.cross_entropy(logits[keep][:-1].float(), ids[keep][1:])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach()[keep].float(), grads


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_logits_and_gradients_match_eager_in_float32(arch):
    model = _model(arch)
    ids, mask = _batch()
    ref_logits, ref_grads = _logits_and_grads(model, ids, mask)
    model.set_attn_implementation("adaattn")
    with adaattn.stats.collect() as records:
        logits, grads = _logits_and_grads(model, ids, mask)
    assert {r.backend for r in records} == {"mods.torch"}
    assert _rel(logits, ref_logits) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert _rel(g, ref_grads[name]) < 1e-4, name
    if arch == "gpt_oss":
        assert any("sinks" in n for n in grads)  # the sinks learn through adaattn too


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_bfloat16_logits_are_as_close_to_float32_as_eager_in_bfloat16(arch):
    ids, mask = _batch()
    with torch.no_grad():  # float32 eager as the exact logits (float64 eager adds two finfo.min masks to -inf)
        exact = _model(arch)(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        model = _model(arch, torch.bfloat16)
        eager = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        model.set_attn_implementation("adaattn")
        ours = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    assert _rel(ours, exact) <= 2 * _rel(eager, exact) + 1e-6


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("cache", [False, True], ids=["transformers_cache", "adaattn_cache"])
def test_greedy_generation_of_16_tokens_matches_eager(arch, cache):
    model = _model(arch)
    ids, mask = _batch()
    kw = dict(attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    model.set_attn_implementation("adaattn")
    if cache:
        kw["past_key_values"] = hf.Cache(64)
    with adaattn.stats.collect() as records:
        got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    assert {r.backend for r in records} == {"mods.torch"}
