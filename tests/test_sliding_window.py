"""Mistral's sliding window: each query attends to the last W positions only, in a full
forward and through the KV cache, equal to transformers' MistralForCausalLM."""
from __future__ import annotations

import pytest
import torch
import transformers

import attnlab

W = 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    cfg = transformers.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     sliding_window=W, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).eval()
    with torch.no_grad():  # larger q/k weights: sharp attention, so a missing window shows clearly
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0, 0.3)
            layer.self_attn.k_proj.weight.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("mistral")
    model.save_pretrained(path, safe_serialization=True)
    return model, attnlab.load(path, compile=False, kv_dtype="float32")  # the fp32 reference path


def _ids(T, seed=0):
    return torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(seed))


def test_full_forward_matches_transformers(mistral):
    ref, lm = mistral
    assert lm.cfg.sliding_window == W
    ids = _ids(32)
    with torch.no_grad():
        expect = ref(ids).logits
    assert (lm.logits(ids) - expect).abs().max().item() < 1e-4
    lm.model.cfg.sliding_window = None  # without the window the same weights diverge past W tokens
    try:
        assert (lm.logits(ids) - expect)[:, W:].abs().max().item() > 1e-2
        assert (lm.logits(ids) - expect)[:, :W].abs().max().item() < 1e-4
    finally:
        lm.model.cfg.sliding_window = W


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_cached_decode_matches_transformers(mistral, positions):
    """Chunked prefill then token-by-token decode, windowed by token distance in both conventions."""
    ref, lm = mistral
    ids = _ids(32, seed=1)
    with torch.no_grad():
        expect = ref(ids).logits
    cache = lm.new_cache(capacity=8, positions=positions)
    parts = [lm.prefill(ids[:, :20], cache, chunk=6, all_logits=True)]
    parts += [lm.forward(ids[:, t:t + 1], cache) for t in range(20, 32)]
    assert (torch.cat(parts, 1) - expect).abs().max().item() < 1e-4


def test_left_padded_batch_is_windowed_per_row(mistral):
    _, lm = mistral
    a, b = _ids(20, seed=2)[0].tolist(), _ids(14, seed=3)[0].tolist()
    from attnlab.sampling import Sampler
    batch = lm.generate_ids([a, b], 6, Sampler())
    assert batch == [lm.generate_ids([a], 6, Sampler())[0], lm.generate_ids([b], 6, Sampler())[0]]
