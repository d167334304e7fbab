"""Checkpoint loaders: GGUF files, Hugging Face folders and the embedded default.

Both formats are read into Hugging Face tensor names and layout first, so the
network is built one way whatever the source. The ModelConfig comes from the
format's builder in `metadata.py`, the one `attnlab info` uses, before any tensor data
is read. Nothing is unpickled: folders must hold safetensors; GGUF tensors are
dequantised with the `gguf` package.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from attnlab.model import metadata, validate
from attnlab.model.files import ModelLoadError, resolve  # noqa: F401  (part of the loaders' API)
from attnlab.model.llama import ModelConfig, Transformer
from attnlab.rope import interleave_rows, parse_rope


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving (its RoPE rotates adjacent pairs, HF rotates halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(tuple(w.shape))


def read_gguf(path: Path, packed_types: tuple[str, ...] = ()):
    """-> (ModelConfig, {hf_name: float32 tensor or Packed}) from a GGUF file.

    Tensors of packed_types ("Q4_0", "Q4_1", "Q8_0") stay quantized (`attnlab.quant.Packed`),
    with no float copy: lower peak memory and load time when the model runs quantized anyway.
    """
    import gguf

    from attnlab.quant import formats

    cfg = metadata.gguf_config(path, validate.scan_gguf(path))  # before the reader builds what the header claims
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises many types on truncated or garbled files
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {type(e).__name__}: {e}") from None
    arch, n_heads, n_kv = cfg.arch, cfg.n_heads, cfg.n_kv_heads
    tensors = {}
    for t in reader.tensors:
        hf = validate.hf_name(t.name)
        if hf is None:  # rope_freqs (already in cfg) and tensors the network does not use
            continue
        shape = [int(d) for d in reversed(t.shape)]
        kind = t.tensor_type.name
        try:
            if kind in packed_types and len(shape) == 2:
                raw = np.require(np.asarray(t.data), requirements=["C", "W"])
                data = formats.from_gguf_q8_0(raw, tuple(shape)) if kind == "Q8_0" else \
                    formats.from_gguf_q4(raw, kind, tuple(shape))
            else:
                data = gguf.quants.dequantize(t.data, t.tensor_type)
                data = np.asarray(data, dtype=np.float32).reshape(shape)
        except Exception as e:
            raise ModelLoadError(f"cannot read tensor {t.name} of {path}: {type(e).__name__}: {e}") from None
        block = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if arch == "llama" and block in ("attn_q", "attn_k"):
            heads = n_heads if block == "attn_q" else n_kv
            data = data.map_rows(lambda a: _unpermute(a, heads)) if isinstance(data, formats.Packed) \
                else _unpermute(data, heads)
        if not isinstance(data, formats.Packed):
            data = torch.from_numpy(np.require(data, requirements=['C', 'W']))  # copies read-only maps
        tensors[hf] = data
    if "model.embed_tokens.weight" not in tensors:
        raise ModelLoadError(f"GGUF file {path} has no token_embd.weight")
    return cfg, tensors


def read_hf_folder(path: Path):
    """-> (ModelConfig, {hf_name: tensor}) from config.json + *.safetensors (sharded or not)."""
    from safetensors.torch import load_file

    cfg = metadata.hf_config(path, metadata.read_json(path))  # types, ranges and tensor shapes before any data is read
    tensors = {}
    for f in metadata.hf_files(path):
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:
            raise ModelLoadError(f"cannot read {f}: {type(e).__name__}: {e}") from None
    return cfg, tensors


# ---------------------------------------------------------------- assembly

def build(cfg: ModelConfig, tensors: dict, dtype: torch.dtype = torch.float32, quant=None) -> Transformer:
    """Create the network and copy Hugging Face-named tensors into its fused layout.

    With quant (a QuantSpec or its text) the linear layers become QuantLinear; matrices that
    arrive already quantized (`Packed`, from GGUF blocks) are permuted and concatenated as
    codes and never expanded to float.
    """
    from attnlab.quant import Packed, quantize_model
    from attnlab.quant.formats import cat_rows

    def rows(fn, t):
        return t.map_rows(fn) if isinstance(t, Packed) else fn(t)

    def cat(parts):
        if all(isinstance(t, Packed) for t in parts):
            return cat_rows(parts)
        return torch.cat([t.dequantize() if isinstance(t, Packed) else t for t in parts])

    with torch.device("meta"):
        model = Transformer(cfg)
    state = {"embed.weight": tensors["model.embed_tokens.weight"], "norm.weight": tensors["model.norm.weight"]}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = tensors["lm_head.weight"]
    elif quant is not None:  # the head is the embedding; the embedding then reads the quantized head
        state["lm_head.weight"] = state.pop("embed.weight")
    for i in range(cfg.n_layers):
        p, a = f"model.layers.{i}.", f"layers.{i}."
        try:
            for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                q, k, v = (tensors[p + f"self_attn.{n}_proj.{kind}"] for n in "qkv")
                state[a + f"attn.wqkv.{kind}"] = cat(  # the network rotates adjacent pairs
                    [rows(lambda w: interleave_rows(w, cfg.n_heads), q), rows(lambda w: interleave_rows(w, cfg.n_kv_heads), k), v])
            state[a + "attn.wo.weight"] = tensors[p + "self_attn.o_proj.weight"]
            state[a + "mlp.w13.weight"] = cat([tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]])
            state[a + "mlp.w2.weight"] = tensors[p + "mlp.down_proj.weight"]
            state[a + "attn_norm.weight"] = tensors[p + "input_layernorm.weight"]
            state[a + "mlp_norm.weight"] = tensors[p + "post_attention_layernorm.weight"]
        except KeyError as e:
            raise ModelLoadError(f"checkpoint is missing tensor {e.args[0]}") from None
    if isinstance(state.get("embed.weight"), Packed):  # an untied embedding is looked up, not multiplied
        state["embed.weight"] = state["embed.weight"].dequantize()
    packed = {k.removesuffix(".weight"): v for k, v in state.items() if isinstance(v, Packed)}
    if quant is None:
        packed = {k: v.dequantize() for k, v in packed.items()}
        state.update({k + ".weight": v for k, v in packed.items()})
        packed = {}
    state = {k: v.to(dtype) for k, v in state.items() if k.removesuffix(".weight") not in packed}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings and quant is None:
        model.lm_head.weight = model.embed.weight
    if quant is not None:
        quantize_model(model, quant, packed)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"checkpoint does not fill {missing[0]}")
    return model.eval().requires_grad_(False)


def load_model(spec: str | Path, dtype: torch.dtype = torch.float32, quant=None, rope: str | None = None):
    """-> (Transformer, ModelConfig, source path) for any supported checkpoint (quantized if quant).

    rope: a context-extension override such as "yarn:4" (see `attnlab.rope.parse_rope`),
    replacing the checkpoint's own scaling; "none" removes it.
    """
    from attnlab.quant import QuantSpec
    from attnlab.model.quantized import is_quantized_folder, load_quantized

    path = resolve(spec)
    quant = QuantSpec.parse(quant) if quant is not None else None
    if path.is_dir() and is_quantized_folder(path):
        model = load_quantized(path, dtype)
        if quant is not None and str(quant) != model.quant:
            raise ModelLoadError(f"{path} holds {model.quant} weights; load it without --quant or with --quant {model.quant}")
        return model, model.cfg, path
    if path.is_dir():
        cfg, tensors = read_hf_folder(path)
    else:
        keep = () if quant is None else ("Q8_0",) + (("Q4_0", "Q4_1") if quant.method == "int4" and quant.group == 32 else ())
        cfg, tensors = read_gguf(path, keep)
    if rope is not None:
        cfg.rope_scaling = parse_rope(rope, _trained_length(cfg))
    validate.check_weights(path, tensors)
    model = build(cfg, tensors, dtype, quant)
    validate.check_model(path, model)
    return model, cfg, path


def _trained_length(cfg: ModelConfig) -> int:
    """The context the weights were trained at: an extended checkpoint's original length, else its own."""
    return int((cfg.rope_scaling or {}).get("original_max_position_embeddings") or cfg.context_length)
