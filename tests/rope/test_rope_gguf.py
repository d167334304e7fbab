"""GGUF files carrying RoPE scaling the way llama.cpp writes it: rope.scaling.* metadata (YaRN)
and the rope_freqs tensor of Llama-3.1 conversions; both load to transformers' logits."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import attnlab
from tests.test_gguf_files import _write_gguf


def _model(scaling: dict):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, rope_theta=10000.0)
    cfg.rope_parameters = {"rope_theta": 10000.0, **scaling}
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _check(model, path):
    lm = attnlab.load(path)
    ids = torch.randint(0, 96, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    assert (lm.logits(ids) - ref).abs().max().item() < 1e-4
    plain = _model({"rope_type": "default"})
    with torch.no_grad():  # ignoring the scaling would miss by 10x the tolerance (small random init)
        assert (plain(ids).logits - ref).abs().max().item() > 1e-3
    return lm


def test_gguf_yarn_metadata(tmp_path):
    model = _model({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})

    def extra(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)

    _write_gguf(model, "llama", gguf.GGMLQuantizationType.F32, tmp_path / "yarn.gguf", extra)
    lm = _check(model, tmp_path / "yarn.gguf")
    assert lm.cfg.rope_scaling["rope_type"] == "yarn" and lm.model.rope.attention_factor > 1


def test_gguf_rope_freqs_tensor(tmp_path):
    """llama.cpp's converter stores Llama 3.1's scaling as per-frequency divisors; no metadata type."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    model = _model(scaling)
    default = ROPE_INIT_FUNCTIONS["linear"](_model({"rope_type": "linear", "factor": 1.0}).config, "cpu")[0]
    scaled = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")[0]
    factors = (default.double() / scaled.double()).float().numpy()

    def extra(w):
        w.add_tensor("rope_freqs.weight", factors.astype(np.float32))

    _write_gguf(model, "llama", gguf.GGMLQuantizationType.F32, tmp_path / "freqs.gguf", extra)
    lm = _check(model, tmp_path / "freqs.gguf")
    assert lm.cfg.rope_scaling["rope_type"] == "freq_factors"


def test_gguf_unsupported_scaling_raises(tmp_path):
    model = _model({"rope_type": "default"})

    def extra(w):
        w.add_string("llama.rope.scaling.type", "longrope")
        w.add_rope_scaling_factor(4.0)

    _write_gguf(model, "llama", gguf.GGMLQuantizationType.F32, tmp_path / "bad.gguf", extra)
    with pytest.raises(ValueError, match="longrope"):
        attnlab.load(tmp_path / "bad.gguf")
