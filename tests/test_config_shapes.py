"""Type-confused but valid configs: a config.json that is `5` or `null`, a string where an int belongs,
an array for a scalar, an object for a flag, nested nulls, GGUF metadata of the wrong type. Each ends in
one ModelLoadError (an AttnlabError) naming the file and the field, from `attnlab info`'s route and from a
full load alike, never a TypeError or AttributeError."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import attnlab
from attnlab.engine import LM
from attnlab.errors import AttnlabError
from attnlab.model.loaders import ModelLoadError
from attnlab.model.metadata import read_config
from tests.model_files import tiny_tensors, write_gguf, write_hf


def rejected(path, field: str, info: bool = True) -> str:
    """Both routes (metadata only, full load) raise one ModelLoadError line naming path and field."""
    for route in ([read_config] if info else []) + [lambda p: LM.load(p, tokenizer=False)]:
        with pytest.raises(ModelLoadError) as e:
            route(path)
        msg = str(e.value)
        assert str(path) in msg and field in msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("text,shown", [("5", "int"), ("null", "null"), ("[]", "an array"), ('"llama"', "str"),
                                        ("true", "bool"), ("1.5", "float"), ('[{"model_type": "llama"}]', "an array")])
def test_config_json_not_an_object(text, shown, tmp_path):
    path = write_hf(tmp_path / "hf")
    (path / "config.json").write_text(text)
    rejected(path, f"config.json must hold a JSON object, got {shown}")


@pytest.mark.parametrize("text", ["5", "null"])
def test_issue_files_give_our_error_and_a_one_line_cli_exit(text, tmp_path, capsys):
    """The fuzzer's two files (issue 26): TypeError in is_quantized_folder before; now our error type."""
    from tests.test_cli import run
    from tests.test_cli_errors import one_line_error
    path = write_hf(tmp_path / "hf")
    (path / "config.json").write_text(text)
    with pytest.raises(AttnlabError, match="config.json must hold a JSON object"):
        attnlab.load(path)
    code, _, err = run(capsys, "ppl", str(path), "--threads", "1")
    one_line_error(code, err, "config.json must hold a JSON object")


@pytest.mark.parametrize("config,field", [
    ({"rope_scaling": 5}, "rope_scaling must be an object, got int"),
    ({"eos_token_id": {"a": 1}}, "eos_token_id must be an integer, got an object"),
    ({"num_hidden_layers": "30"}, "num_hidden_layers must be an integer, got str"),
    ({"hidden_size": [32]}, "hidden_size must be an integer, got an array"),
    ({"vocab_size": 48.0}, "vocab_size must be an integer, got float"),
    ({"rms_norm_eps": [1e-5]}, "rms_norm_eps must be a finite number, got an array"),
    ({"rope_theta": {"base": 1}}, "rope_theta must be a finite number, got an object"),
    ({"max_position_embeddings": "64"}, "max_position_embeddings must be an integer, got str"),
    ({"model_type": ["llama"]}, "unsupported architecture 'an array'"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got str"),
    ({"attention_bias": 1}, "attention_bias must be true or false, got int"),
    ({"bos_token_id": [1]}, "bos_token_id must be an integer, got an array"),
    ({"eos_token_id": [0, None]}, "eos_token_id must hold integers, got null"),
    ({"eos_token_id": [[0]]}, "eos_token_id must be an integer, got an array"),
    ({"rope_scaling": {"rope_type": ["yarn"], "factor": 2.0}}, "rope_scaling.rope_type must be a string, got an array"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": "2"}}, "rope_scaling.factor must be a finite number, got str"),
    ({"rope_scaling": {"rope_type": "linear", "factor": None}}, "rope_scaling"),  # nested null: no factor
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": "16"}},
     "rope_scaling.original_max_position_embeddings must be an integer, got str"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": [32]}},
     "rope_scaling.beta_fast must be a finite number, got an array"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "truncate": "no"}},
     "rope_scaling.truncate must be true or false, got str"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
     "rope_parameters.rope_theta must be a finite number, got str"),
    ({"rope_parameters": [{"rope_theta": 1e4}]}, "rope_parameters must be an object, got an array"),
    ({"model_type": "mistral", "sliding_window": "4096"}, "sliding_window must be an integer, got str"),
    ({"model_type": "mistral", "sliding_window": [16]}, "sliding_window must be an integer, got an array"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_hf_field_of_the_wrong_type(config, field, tmp_path):
    rejected(write_hf(tmp_path / "hf", config=config), field)


@pytest.mark.parametrize("config", [
    {"rope_scaling": None, "rope_parameters": None, "bos_token_id": None, "eos_token_id": None},
    {"model_type": "mistral", "sliding_window": None},
    {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": None, "attention_factor": None}},
])
def test_hf_nested_nulls_mean_defaults(config, tmp_path):
    path = write_hf(tmp_path / "hf", config=config)
    cfg = LM.load(path, tokenizer=False).cfg
    assert cfg == read_config(path)[0] and cfg.sliding_window is None


def test_qwen2_use_sliding_window_type(tmp_path):
    path = write_hf(tmp_path / "hf", tiny_tensors(bias=True), config={"model_type": "qwen2", "use_sliding_window": "no"})
    rejected(path, "use_sliding_window must be true or false, got str")


@pytest.mark.parametrize("meta,field", [
    ({"block_count": "2"}, "llama.block_count must be an integer, got str"),
    ({"block_count": [2]}, "llama.block_count must be an integer, got an array"),
    ({"attention.head_count_kv": True}, "llama.attention.head_count_kv must be an integer, got bool"),
    ({"context_length": "64"}, "llama.context_length must be an integer, got str"),
    ({"attention.layer_norm_rms_epsilon": "1e-5"}, "llama.attention.layer_norm_rms_epsilon must be a finite number"),
    ({"rope.freq_base": [10000.0]}, "llama.rope.freq_base must be a finite number, got an array"),
    ({"attention.value_length": "8"}, "llama.attention.value_length must be an integer, got str"),
    ({"rope.scaling.type": 5}, "llama.rope.scaling.type must be a string, got int"),
    ({"rope.scaling.type": ["yarn"]}, "llama.rope.scaling.type must be a string, got an array"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": "4"}, "llama.rope.scaling.factor must be a finite number, got str"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 16.5},
     "llama.rope.scaling.original_context_length must be an integer, got float"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.attn_factor": [1.0]},
     "llama.rope.scaling.attn_factor must be a finite number, got an array"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_beta_fast": "32"},
     "llama.rope.scaling.yarn_beta_fast must be a finite number, got str"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": True}, "llama.rope.scaling.factor must be a finite number, got bool"),
    ({"tokenizer.ggml.eos_token_id": [0, 1]}, "tokenizer.ggml.eos_token_id must be an integer, got an array"),
    ({"tokenizer.ggml.bos_token_id": "1"}, "tokenizer.ggml.bos_token_id must be an integer, got str"),
    ({"general.architecture": 7}, "general.architecture must be a string, got int"),
    ({"general.architecture": ["llama"]}, "general.architecture must be a string, got an array"),
])
def test_gguf_metadata_of_the_wrong_type(meta, field, tmp_path):
    rejected(write_gguf(tmp_path / "m.gguf", meta=meta), field)


@pytest.mark.parametrize("freqs,field", [
    (np.ones(3, dtype=np.float32), "rope_freqs has 3 entries, expected 4"),
    (np.array([1, 2, np.nan, 4], dtype=np.float32), "non-finite or non-positive"),
    (np.array([1, 2, 0, 4], dtype=np.float32), "non-finite or non-positive"),
])
def test_gguf_rope_freqs_checked(freqs, field, tmp_path):
    rejected(write_gguf(tmp_path / "m.gguf", extra_tensors={"rope_freqs.weight": freqs}), field)


# ---------------------------------------------------------------- attnlab's quantized folder

@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from attnlab.quant.store import save_quantized
    tmp = tmp_path_factory.mktemp("q")
    lm = LM.load(write_gguf(tmp / "m.gguf", qtype="Q8_0"), tokenizer=False, quant="int8")
    return save_quantized(lm, tmp / "q")


def _mutate(quantized, tmp_path, fn):
    path = tmp_path / "q"
    shutil.copytree(quantized, path)
    meta = json.loads((path / "config.json").read_text())
    fn(meta)
    (path / "config.json").write_text(json.dumps(meta))
    return path


@pytest.mark.parametrize("mutation,field", [
    (lambda m: m.update(attnlab=5), "attnlab must be an object, got int"),
    (lambda m: m["attnlab"].update(config=[]), "attnlab.config must be an object, got an array"),
    (lambda m: m["attnlab"]["config"].update(n_layers="2"), "attnlab.config.n_layers must be an integer, got str"),
    (lambda m: m["attnlab"]["config"].update(norm_eps=None), "attnlab.config.norm_eps is null"),
    (lambda m: m["attnlab"]["config"].update(rope_scaling=[1]), "attnlab.config.rope_scaling must be an object"),
    (lambda m: m["attnlab"]["config"].update(eos_token_ids=[{}]), "attnlab.config.eos_token_ids must be an integer"),
    (lambda m: m["attnlab"]["config"].update(surprise=1), "unknown field 'surprise'"),
    (lambda m: m["attnlab"].update(layers=[]), "attnlab.layers must be an object, got an array"),
    (lambda m: m["attnlab"]["layers"].update(lm_head=5), "attnlab.layers.lm_head must be an object, got int"),
    (lambda m: m["attnlab"]["layers"]["lm_head"].update(group="32"), "attnlab.layers.lm_head.group must be an integer"),
    (lambda m: m["attnlab"]["layers"]["layers.0.attn.wo"].update(kind="int4"), "tensor layers.0.attn.wo.qs"),
    (lambda m: m["attnlab"]["layers"].pop("layers.1.mlp.w2"), "attnlab.layers does not match the network"),
    (lambda m: m["attnlab"].update(quant=["int8"]), "attnlab.quant must be a string, got an array"),
])
def test_quantized_folder_type_confusion(mutation, field, quantized, tmp_path):
    assert LM.load(quantized, tokenizer=False).cfg.n_layers == 2  # the unmutated folder loads
    # `info` reads attnlab.config; the layers' formats (and their tensors) are checked when loading
    rejected(_mutate(quantized, tmp_path, mutation), field, info="attnlab.layers" not in field and "tensor" not in field
             and "attnlab.quant" not in field)
