"""Hostile model files end in one ModelLoadError naming the file and the field, fast, before allocation."""
from __future__ import annotations

import json
import struct
import time

import numpy as np
import pytest
import torch

from attnlab.engine import LM
from attnlab.model.loaders import ModelLoadError
from tests.model_files import tiny_tensors, write_gguf, write_hf


def _load(path):
    start = time.perf_counter()
    try:
        lm = LM.load(path, tokenizer=False)
    finally:
        assert time.perf_counter() - start < 10
    return lm


@pytest.mark.parametrize("kind", ["gguf", "gguf-q8", "hf"])
def test_valid_tiny_files_load(kind, tmp_path):
    path = (write_hf(tmp_path / "hf") if kind == "hf" else
            write_gguf(tmp_path / "m.gguf", qtype="Q8_0" if kind == "gguf-q8" else "F32"))
    lm = _load(path)
    assert lm.cfg.n_layers == 2 and lm.cfg.n_kv_heads == 2 and lm.cfg.vocab_size == 48
    assert torch.isfinite(lm.logits(torch.arange(20)[None])).all()


@pytest.mark.parametrize("meta,field", [
    ({"block_count": 10**9}, "llama.block_count"),     # would build a billion layers
    ({"block_count": 0}, "llama.block_count"),         # a 0-layer model "generates"
    ({"block_count": 3}, "missing tensor blk.2.attn_q.weight"),  # more layers than tensors
    ({"attention.head_count": 3}, "llama.embedding_length = 32 is not divisible"),
    ({"attention.head_count_kv": 3}, "not a multiple"),
    ({"attention.head_count_kv": 0}, "llama.attention.head_count_kv"),
    ({"feed_forward_length": 96}, "blk.0.ffn_gate.weight has shape"),
    ({"embedding_length": None}, "llama.embedding_length is missing"),
    ({"block_count": 2.5}, "llama.block_count must be an integer"),
    ({"context_length": 0}, "llama.context_length = 0 is out of range"),
])
def test_gguf_bad_config_names_field(meta, field, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", meta=meta)
    with pytest.raises(ModelLoadError, match="m.gguf") as e:
        _load(path)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_gguf_architecture_as_array_is_rejected_quickly(tmp_path):
    """The issue's one-byte mutation: the architecture value's type set to array (was 4.5 GB in 45 s)."""
    path = write_gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    at = data.index(b"general.architecture") + len(b"general.architecture")
    assert struct.unpack_from("<I", data, at)[0] == 8  # string
    struct.pack_into("<I", data, at, 9)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="general.architecture"):
        _load(path)


@pytest.mark.parametrize("offset,value,expect", [
    (8, 2**40, "tensors"), (16, 2**40, "metadata entries"), (4, 7, "version 7"),
])
def test_gguf_huge_header_counts(offset, value, expect, tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q" if offset > 4 else "<I", data, offset, value)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=expect):
        _load(path)


def test_gguf_truncated_data_is_caught_from_header(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF file: tensor .* lies outside the file"):
        _load(path)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e30])
def test_non_finite_or_absurd_weight_names_tensor(bad, tmp_path):
    t = tiny_tensors()
    t["model.layers.1.mlp.up_proj.weight"][3, 5] = bad
    with pytest.raises(ModelLoadError, match=r"m.gguf: tensor model.layers.1.mlp.up_proj.weight has"):
        _load(write_gguf(tmp_path / "m.gguf", t))
    with pytest.raises(ModelLoadError, match=r"hf: tensor model.layers.1.mlp.up_proj.weight has"):
        _load(write_hf(tmp_path / "hf", t))


def test_probe_forward_catches_what_the_range_check_lets_through(tmp_path, monkeypatch):
    """The last line of defence: logits on a probe input must be finite (range check disabled here)."""
    from attnlab.model import validate
    monkeypatch.setattr(validate, "MAX_WEIGHT", float("inf"))
    t = tiny_tensors()
    t["lm_head.weight"][:] = 3e38
    with pytest.raises(ModelLoadError, match="non-finite logits"):
        _load(write_hf(tmp_path / "hf", t))


@pytest.mark.parametrize("config,field", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers = 1000000000 is out of range"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_attention_heads": "4"}, "num_attention_heads must be an integer, got str"),
    ({"hidden_size": True}, "hidden_size must be an integer, got bool"),
    ({"vocab_size": 49}, "model.embed_tokens.weight has shape [48, 32], the config implies [49, 32]"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"head_dim": 7}, "odd"),
    ({"rms_norm_eps": -1}, "rms_norm_eps = -1.0 is out of range"),
    ({"rope_theta": "big"}, "rope_theta must be a finite number, got str"),
    ({"rope_scaling": [1, 2]}, "rope_scaling must be an object"),
    ({"rope_parameters": 7}, "rope_parameters must be an object, got int"),  # found by the fuzzer
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling"),
    ({"eos_token_id": 48}, "eos_token_id = 48 is out of range"),
    ({"max_position_embeddings": None}, "max_position_embeddings is null"),
    ({"rope_theta": None, "head_dim": None}, None),  # defaults apply: loads
])
def test_hf_bad_config_names_field(config, field, tmp_path):
    path = write_hf(tmp_path / "hf", config=config)
    if field is None:
        cfg = _load(path).cfg
        assert cfg.rope_base == 10000.0 and cfg.head_dim == 8
        return
    with pytest.raises(ModelLoadError, match="hf: ") as e:
        _load(path)
    assert field in str(e.value)


@pytest.mark.parametrize("text", ["[1, 2]", '"llama"', "\xff\xfe{}"])
def test_hf_config_not_an_object(text, tmp_path):
    path = write_hf(tmp_path / "hf")
    (path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ModelLoadError):
        _load(path)


def test_hf_missing_tensor_named(tmp_path):
    t = tiny_tensors()
    del t["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ModelLoadError, match="missing tensor model.layers.1.self_attn.k_proj.weight"):
        _load(write_hf(tmp_path / "hf", t))
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="vocab_size is missing"):
        _load(tmp_path / "hf")


@pytest.mark.parametrize("kind", ["gguf", "hf", "smollm2"])
def test_metadata_only_config_equals_loaded_config(kind, tmp_path, request):
    """`attnlab info` reads no weights; what it reports must be what a full load builds."""
    from attnlab.model.metadata import read_config
    if kind == "smollm2":
        lm = request.getfixturevalue("smollm2")
        path = lm.source
    else:
        path = write_hf(tmp_path / "hf", config={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}) \
            if kind == "hf" else write_gguf(tmp_path / "m.gguf")
        lm = _load(path)
    start = time.perf_counter()
    cfg, source = read_config(path)
    assert time.perf_counter() - start < 2 and source == lm.source
    assert cfg == lm.cfg


@pytest.mark.parametrize("quant", [None, "int8"])
def test_nan_scale_in_quantized_tensor_is_named(quant, tmp_path):
    """A Q8_0 block scale set to NaN: caught whether the tensor is dequantised or kept packed (--quant)."""
    from attnlab.model.validate import scan_gguf
    path = write_gguf(tmp_path / "q.gguf", qtype="Q8_0")
    head = scan_gguf(path)
    data = bytearray(path.read_bytes())
    at = head.data_offset + head.tensors["blk.0.attn_q.weight"].offset
    data[at:at + 2] = np.array([np.nan], dtype=np.float16).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"tensor model.layers.0.self_attn.q_proj.weight .*NaN"):
        LM.load(path, tokenizer=False, quant=quant)
