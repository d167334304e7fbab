"""Tiny random checkpoints written the way users' files are: a GGUF (gguf.GGUFWriter) and a Hugging Face folder.

Shared by the validation tests and the fuzz harness, which mutate them. The weights are
random (no transformers model needed): these files test the loaders' defences, while
test_gguf_files.py and test_parity.py test their numerics.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TINY = dict(vocab=48, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, context=64)
_GGUF_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def tiny_tensors(seed: int = 0, tied: bool = False, bias: bool = False, **kw) -> dict[str, np.ndarray]:
    """Hugging Face-named float32 weights of a tiny llama (bias: Qwen2's q/k/v biases)."""
    from attnlab.model.validate import Dims, expected_shapes
    c = {**TINY, **kw}
    d = Dims(c["layers"], c["dim"], c["heads"], c["kv_heads"], c["hidden"], c["dim"] // c["heads"], c["vocab"],
             bias, tied)
    rng = np.random.default_rng(seed)
    return {name: (1.0 + 0.05 * rng.standard_normal(shape) if len(shape) == 1 else 0.2 * rng.standard_normal(shape))
            .astype(np.float32) for name, shape in expected_shapes(d).items()}


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, i, *rest = hf.split(".")
    return f"blk.{i}.{_GGUF_BLOCK['.'.join(rest[:-1])]}.{rest[-1]}"


def write_gguf(path: Path, tensors: dict | None = None, meta: dict | None = None, qtype: str = "F32",
               extra_tensors: dict | None = None) -> Path:
    """A llama GGUF; meta overrides config values by GGUF key suffix (e.g. {'block_count': 3}), or by full
    key for general.* and tokenizer.* keys; a value's Python type picks the GGUF type (int: uint32, float:
    float32, str, bool, list: array), so tests can write values of the wrong type. None drops the key.
    extra_tensors: GGUF-named tensors written as they are (e.g. rope_freqs.weight)."""
    import gguf
    c = {"block_count": TINY["layers"], "context_length": TINY["context"], "embedding_length": TINY["dim"],
         "feed_forward_length": TINY["hidden"], "attention.head_count": TINY["heads"],
         "attention.head_count_kv": TINY["kv_heads"], "attention.layer_norm_rms_epsilon": 1e-5,
         "rope.freq_base": 10000.0, "tokenizer.ggml.eos_token_id": 0}
    c.update(meta or {})
    arch = c.pop("general.architecture", "llama")
    w = gguf.GGUFWriter(str(path), "llama")
    if arch != "llama":  # the writer already added general.architecture = "llama": rewrite it, any type
        w.kv_data[0].pop("general.architecture")
        if arch is not None:
            _add(w, "general.architecture", arch)
    for key, value in c.items():
        if value is not None:
            _add(w, key if key.startswith(("general.", "tokenizer.")) else f"llama.{key}", value)
    q = gguf.GGMLQuantizationType[qtype]
    for name, a in (extra_tensors or {}).items():
        w.add_tensor(name, a)
    for name, a in (tensors if tensors is not None else tiny_tensors()).items():
        if a.ndim == 2 and q != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add(w, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))


def write_hf(folder: Path, tensors: dict | None = None, config: dict | None = None) -> Path:
    """A llama config.json + model.safetensors folder."""
    import torch
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": TINY["vocab"],
           "hidden_size": TINY["dim"], "intermediate_size": TINY["hidden"], "num_hidden_layers": TINY["layers"],
           "num_attention_heads": TINY["heads"], "num_key_value_heads": TINY["kv_heads"],
           "max_position_embeddings": TINY["context"], "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "eos_token_id": 0, "bos_token_id": 1}
    cfg.update(config or {})
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = tensors if tensors is not None else tiny_tensors()
    save_file({k: torch.from_numpy(v) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder
