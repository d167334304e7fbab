"""One config builder per file format: `attnlab info` (metadata only) and a full load build the same
ModelConfig, for the configs the two used to disagree on (YaRN and rope_freqs GGUFs, Mistral's
sliding window, Llama 3 scaling, Qwen2 biases, attnlab's quantized folder)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from attnlab.engine import LM
from attnlab.model.metadata import read_config
from tests.model_files import TINY, tiny_tensors, write_gguf, write_hf

HEAD_DIM = TINY["dim"] // TINY["heads"]
FREQS = np.array([1.0, 2.0, 4.0, 8.0][: HEAD_DIM // 2], dtype=np.float32)  # Llama 3.1-style divisors

CASES = {
    "gguf-plain": lambda p: write_gguf(p / "m.gguf"),
    "gguf-yarn": lambda p: write_gguf(p / "m.gguf", meta={
        "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 16,
        "rope.scaling.yarn_beta_fast": 16.0, "rope.scaling.attn_factor": 1.5, "context_length": 64,
        "tokenizer.ggml.bos_token_id": 1}),
    "gguf-linear": lambda p: write_gguf(p / "m.gguf", meta={"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}),
    "gguf-rope-freqs": lambda p: write_gguf(p / "m.gguf", extra_tensors={"rope_freqs.weight": FREQS}),
    "hf-mistral-window": lambda p: write_hf(p / "hf", config={"model_type": "mistral", "sliding_window": 16}),
    "hf-llama3": lambda p: write_hf(p / "hf", config={"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}, "eos_token_id": [0, 2]}),
    "hf-yarn-rope-parameters": lambda p: write_hf(p / "hf", config={  # transformers 5 spelling
        "rope_theta": None, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 5e5}}),
    "hf-qwen2-bias": lambda p: write_hf(p / "hf", tiny_tensors(bias=True),
                                        config={"model_type": "qwen2", "sliding_window": 32, "use_sliding_window": False}),
    "hf-tied": lambda p: write_hf(p / "hf", tiny_tensors(tied=True), config={"tie_word_embeddings": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_info_and_load_build_the_same_config(case, tmp_path):
    path = CASES[case](tmp_path)
    loaded = LM.load(path, tokenizer=False).cfg
    cfg, source = read_config(path)
    assert cfg == loaded and source == path
    expect = {"gguf-yarn": ("yarn", None), "gguf-linear": ("linear", None), "gguf-rope-freqs": ("freq_factors", None),
              "hf-llama3": ("llama3", None), "hf-yarn-rope-parameters": ("yarn", None),
              "hf-mistral-window": (None, 16)}.get(case, (None, None))
    assert (cfg.rope_scaling or {}).get("rope_type") == expect[0] and cfg.sliding_window == expect[1]
    if case == "gguf-rope-freqs":
        assert cfg.rope_scaling["factors"] == FREQS.tolist()
    if case == "gguf-yarn":
        assert cfg.rope_scaling["original_max_position_embeddings"] == 16 and cfg.rope_scaling["beta_fast"] == 16.0
        assert cfg.rope_scaling["attention_factor"] == pytest.approx(1.5 * (0.1 * np.log(4.0) + 1))
        assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [0]
    if case == "hf-qwen2-bias":
        assert cfg.qkv_bias and cfg.sliding_window is None
    if case == "hf-llama3":
        assert cfg.eos_token_ids == [0, 2]
    if case == "hf-yarn-rope-parameters":
        assert cfg.rope_base == 5e5 and cfg.rope_scaling["original_max_position_embeddings"] == TINY["context"]


def test_quantized_folder_config_is_the_saved_one(tmp_path):
    from attnlab.quant.store import save_quantized
    lm = LM.load(write_gguf(tmp_path / "m.gguf", qtype="Q8_0"), tokenizer=False, quant="int8")
    out = save_quantized(lm, tmp_path / "q")
    cfg, _ = read_config(out)
    assert cfg == lm.cfg == LM.load(out, tokenizer=False).cfg


@pytest.mark.parametrize("case", ["gguf-rope-freqs", "hf-mistral-window"])
def test_info_reads_no_weights(case, tmp_path, monkeypatch, capsys):
    """`attnlab info` reads headers only: the weight readers are made to fail, and info still answers."""
    import gguf
    import safetensors.torch

    from attnlab.cli import main
    path = CASES[case](tmp_path)

    def refuse(*a, **k):
        raise AssertionError("info read the weights")
    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert ("freq_factors" in out) if case.startswith("gguf") else ("mistral" in out and re.search(r"sliding window +16\n", out) is not None)
