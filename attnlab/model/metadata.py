"""A checkpoint's configuration from its metadata alone: no tensor is read or dequantised.

`attnlab info` needs only the architecture, which the GGUF header or config.json plus the
safetensors headers give in milliseconds; loading the weights took 10-20 s. The values
(and defaults) are those `loaders.read_gguf` / `read_hf_folder` build; a test checks that
both routes give the same ModelConfig.
"""
from __future__ import annotations

from pathlib import Path

from attnlab.model import validate
from attnlab.model.llama import ModelConfig


def read_config(spec: str | Path) -> tuple[ModelConfig, Path]:
    """-> (ModelConfig, source path), checked like a full load up to (not including) the weights."""
    from attnlab.model.loaders import read_hf_header, resolve
    path = resolve(spec)
    if path.is_dir():
        hf, files = read_hf_header(path)
        arch = hf["model_type"]
        d = validate.check_hf(path, hf, files)
        eos = hf.get("eos_token_id")
        params = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or (params or None)
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        extra = dict(norm_eps=hf.get("rms_norm_eps", 1e-6),
                     rope_base=float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0),
                     rope_scaling=scaling, context_length=hf.get("max_position_embeddings", 2048),
                     bos_token_id=hf.get("bos_token_id"),
                     eos_token_ids=list(eos) if isinstance(eos, list) else ([eos] if eos is not None else []))
    else:
        head = validate.scan_gguf(path)
        d = validate.check_gguf(path, head)
        meta = head.meta
        arch = meta["general.architecture"]

        def key(name, default=None):
            return meta.get(f"{arch}.{name}", default)
        scaling = None
        if key("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        eos, bos = meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.bos_token_id")
        extra = dict(norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
                     rope_base=float(key("rope.freq_base", 10000.0)), rope_scaling=scaling,
                     context_length=int(key("context_length", 2048)), bos_token_id=bos,
                     eos_token_ids=[eos] if eos is not None else [])
    cfg = ModelConfig(vocab_size=d.vocab, dim=d.dim, n_layers=d.layers, n_heads=d.heads, n_kv_heads=d.kv_heads,
                      hidden_dim=d.hidden, head_dim=d.head_dim, qkv_bias=d.qkv_bias, tie_embeddings=d.tied,
                      arch=arch, **extra)
    return cfg, path
