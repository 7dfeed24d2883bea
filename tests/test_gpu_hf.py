"""adaattn's transformers Cache on a CUDA GPU: generate() compiles its decode steps (torch.compile,
CUDA graphs) over the cache, and gives the tokens and scores of the uncompiled steps and of
"sdpa" with transformers' own cache."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")

import adaattn.integrations.hf  # noqa: E402,F401  (registers "adaattn")
from adaattn.integrations import hf  # noqa: E402


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").cuda().eval()


def _generate(model, ids, mask, cache=None):
    kw = {} if cache is None else {"past_key_values": cache}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("storage,paged,padded", [("native", False, False), ("fp8", True, False),
                                                  ("native", False, True)])
def test_compiled_decode_steps_give_the_uncompiled_tokens_and_scores(storage, paged, padded):
    torch._dynamo.reset()
    model = _llama()
    ids = torch.randint(3, 512, (2, 100), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :7], mask[0, :7] = 0, 0
    want, want_scores = _generate(model, ids, mask)  # sdpa, transformers' DynamicCache
    model.set_attn_implementation("adaattn")
    plain, plain_scores = _generate(model, ids, mask, hf.Cache(128, storage, paged, 16, compile=False))
    cache = hf.Cache(128, storage, paged, 16)
    got, scores = _generate(model, ids, mask, cache)  # compiles the decode step
    again, again_scores = _generate(model, ids, mask, (cache.reset(), cache)[1])  # replays it
    other, _ = _generate(model, ids, mask, hf.Cache(128, storage, paged, 16))  # a new cache: recorded again
    assert torch.equal(got, plain) and torch.equal(again, got) and torch.equal(other, got)
    torch.testing.assert_close(scores, plain_scores, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(again_scores, scores, atol=0, rtol=0)
    if storage == "native":
        assert torch.equal(got, want)
        finite = want_scores.isfinite()
        torch.testing.assert_close(scores[finite], want_scores[finite], atol=2e-3, rtol=2e-3)
    if not padded:
        assert "compiled step" in cache.explain() and "kv.triton" in cache.explain()
    assert int(cache.get_seq_length()) == 100 + 23
    cache._sync()  # the host mirrors, read back from the device after compiled steps
    assert cache.kvs[0].length(cache.seqs[0]) == 123


def test_compiled_steps_past_max_cache_len_are_reported():
    torch._dynamo.reset()
    model = _llama()
    model.set_attn_implementation("adaattn")
    ids = torch.randint(3, 512, (1, 100), generator=torch.Generator().manual_seed(2)).cuda()
    cache = hf.Cache(112)
    _generate(model, ids, torch.ones_like(ids), cache)  # 123 tokens into 112 (no page past the cache's own)
    with pytest.raises(ValueError, match="max_cache_len=112 was too short for the last generate"):
        cache.reset()
    _generate(model, ids[:, :80], torch.ones_like(ids[:, :80]), cache)  # reset and usable: 80 + 23 tokens fit
    assert int(cache.get_seq_length()) == 103
