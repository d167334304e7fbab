"""One config builder per checkpoint format: GGUF metadata, Hugging Face config.json, attnlab's quantized folder.

`attnlab info` and the loaders both build their ModelConfig here, so what `info` reports is
what a load runs (two copies used to disagree: `info` knew only linear RoPE scaling and
dropped Mistral's window). Only metadata is read (the GGUF header, config.json, safetensors
headers, and GGUF's small rope_freqs vector), milliseconds where loading weights takes
seconds. Every value goes through `validate.field`, so a config of the wrong shape (`5`,
`null`, a string where an int belongs, an array for a scalar) ends in one ModelLoadError
naming the file and the field.
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from functools import partial
from pathlib import Path

import numpy as np

from attnlab.model import validate
from attnlab.model.files import HF_ARCHS, resolve
from attnlab.model.gguf_header import GGUFHeader, error
from attnlab.model.llama import ModelConfig
from attnlab.rope import NEEDS_ORIGINAL, scaling_type



def read_config(spec: str | Path) -> tuple[ModelConfig, Path]:
    """-> (ModelConfig, source path) of any supported checkpoint, checked like a full load up to the weights."""
    path = resolve(spec)
    if not path.is_dir():
        return gguf_config(path, validate.scan_gguf(path)), path
    hf = read_json(path)
    if "attnlab" in hf:
        return quantized_config(path, hf), path
    return hf_config(path, hf), path


# ---------------------------------------------------------------- GGUF

def gguf_config(path: Path, head: GGUFHeader) -> ModelConfig:
    """A scanned GGUF header -> ModelConfig (llama.cpp's key names; rope.scaling.* and rope_freqs -> rope_scaling)."""
    d = validate.check_gguf(path, head)
    meta = head.meta
    arch = meta["general.architecture"]

    def key(name: str, kind: type, default=None, lo=None, hi=None):
        return validate.field(path, meta, f"{arch}.{name}", kind, default, lo, hi)

    eps = validate.within(path, f"{arch}.attention.layer_norm_rms_epsilon",
                          key("attention.layer_norm_rms_epsilon", float, 1e-5), 0, 1)
    base = validate.within(path, f"{arch}.rope.freq_base", key("rope.freq_base", float, 10000.0), 1, 1e12)
    ctx = key("context_length", int, 2048, 1, validate.MAX_CONTEXT)
    scaling = _gguf_scaling(path, key, ctx, _rope_freqs(path, head))
    validate.check_rope_scaling(path, scaling, d.head_dim, base)
    bos = validate.field(path, meta, "tokenizer.ggml.bos_token_id", int, None, 0, d.vocab - 1)
    eos = validate.field(path, meta, "tokenizer.ggml.eos_token_id", int, None, 0, d.vocab - 1)
    return _config(d, arch, norm_eps=eps, rope_base=base, rope_scaling=scaling, context_length=ctx,
                   bos_token_id=bos, eos_token_ids=[eos] if eos is not None else [])


def _rope_freqs(path: Path, head: GGUFHeader) -> list[float] | None:
    """Llama 3.1's per-frequency divisors, read from the file (a few hundred bytes; no other tensor is read)."""
    info = head.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    with open(path, "rb") as f:
        f.seek(head.data_offset + info.offset)
        raw = np.frombuffer(f.read(info.nbytes), dtype=np.uint8)
    floats = {0: np.float32, 1: np.float16}  # what files hold it as; the gguf package reads anything else
    try:
        if info.ggml_type in floats and raw.size % np.dtype(floats[info.ggml_type]).itemsize == 0:
            values = raw.view(floats[info.ggml_type])
        else:
            import gguf
            values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(info.ggml_type))
    except (NotImplementedError, ValueError) as e:
        raise error(path, f"tensor rope_freqs.weight cannot be read: {type(e).__name__}: {e}") from None
    return [float(x) for x in np.asarray(values, dtype=np.float32).reshape(-1)]


def _gguf_scaling(path, key, ctx: int, rope_freqs: list[float] | None) -> dict | None:
    """llama.cpp's rope.scaling.* metadata (and rope_freqs tensor) -> a scaling dict of attnlab.rope."""
    kind = key("rope.scaling.type", str) or "none"
    if rope_freqs is not None:
        if kind != "none":
            raise error(path, f"rope_freqs together with rope.scaling.type {kind!r} is not supported")
        return {"rope_type": "freq_factors", "factors": rope_freqs}
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise error(path, f"unsupported rope.scaling.type {kind!r}; supported: none, linear, yarn, rope_freqs")
    factor = key("rope.scaling.factor", float, 0.0, hi=1e6)
    if factor <= 0:
        raise error(path, f"rope.scaling.type {kind!r} without a positive rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    orig = key("rope.scaling.original_context_length", int, 0, 0, validate.MAX_CONTEXT) or int(ctx / factor)
    out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
    for gguf_key, ours in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = key(f"rope.scaling.{gguf_key}", float)
        if value is not None:
            out[ours] = value
    attn = key("rope.scaling.attn_factor", float, 1.0) or 1.0
    if attn != 1.0:  # llama.cpp multiplies its own 0.1 ln(factor) + 1 by attn_factor
        out["attention_factor"] = attn * (0.1 * math.log(factor) + 1.0)
    return out


# ---------------------------------------------------------------- Hugging Face folder

def read_json(path: Path) -> dict:
    """config.json of a folder, parsed and checked to hold an object (not `5`, `null`, a list or a string)."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise error(path, "not a Hugging Face checkpoint folder: no config.json")
    try:
        hf = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise error(cfg_file, f"not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise error(cfg_file, f"config.json must hold a JSON object, got {validate.shown(hf)}")
    return hf


def hf_files(path: Path) -> list[Path]:
    """The safetensors files of a folder (pickled weights are never loaded)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        hint = " (pickled .bin weights are not loaded: convert them to safetensors)" if list(path.glob("*.bin")) else ""
        raise error(path, f"no *.safetensors weights{hint}")
    return files


def hf_config(path: Path, hf: dict) -> ModelConfig:
    """config.json (+ safetensors headers, for shapes and tying) -> ModelConfig. Mistral keeps its sliding window."""
    if not isinstance(hf, dict):
        raise error(path, f"config.json must hold a JSON object, got {validate.shown(hf)}")
    arch = hf.get("model_type")
    if arch not in HF_ARCHS:
        shown = arch if isinstance(arch, str) or arch is None else validate.shown(arch)
        raise error(path, f"unsupported architecture {shown!r}; supported: {', '.join(HF_ARCHS)}")
    d = validate.check_hf(path, hf, hf_files(path))
    get = partial(validate.field, path, hf)
    params = validate.scaling_fields(path, hf.get("rope_parameters"), "rope_parameters") or {}
    raw = validate.scaling_fields(path, hf.get("rope_scaling"), "rope_scaling") or params or None
    eps = validate.within(path, "rms_norm_eps", get("rms_norm_eps", float, 1e-6), 0, 1)
    base = get("rope_theta", float)
    if base is None:
        base = validate.field(path, params, "rope_theta", float, 10000.0, where="rope_parameters.rope_theta")
    base = validate.within(path, "rope_theta", base, 1, 1e12)
    ctx = get("max_position_embeddings", int, 2048, 1, validate.MAX_CONTEXT)
    if get("mlp_bias", bool, False):
        raise error(path, "mlp_bias (biased MLP projections) is not supported")
    window = None
    if arch == "mistral":  # Qwen2 carries a sliding_window it does not use unless use_sliding_window
        window = get("sliding_window", int, None, 0, validate.MAX_CONTEXT) or None
    elif arch == "qwen2" and get("use_sliding_window", bool, False):
        raise error(path, "Qwen2's per-layer sliding window (use_sliding_window) is not supported")
    scaling = _hf_scaling(path, raw, ctx)
    validate.check_rope_scaling(path, scaling, d.head_dim, base)
    return _config(d, arch, norm_eps=eps, rope_base=float(base), rope_scaling=scaling, context_length=ctx,
                   sliding_window=window, bos_token_id=get("bos_token_id", int, None, 0, d.vocab - 1),
                   eos_token_ids=validate.token_ids(path, "eos_token_id", hf.get("eos_token_id"), d.vocab))


def _hf_scaling(path, raw: dict | None, max_pos: int) -> dict | None:
    """rope_scaling (transformers 4) or rope_parameters (5), type-checked -> a scaling dict, or None."""
    if not raw:
        return None
    s = {k: v for k, v in raw.items() if k not in ("type", "rope_theta")}
    s["rope_type"] = raw.get("rope_type", raw.get("type")) or "default"
    try:
        kind = scaling_type(s)
    except ValueError as e:
        raise error(path, str(e)) from None
    if kind == "default":
        return None
    if kind == "dynamic":  # transformers sizes dynamic NTK from max_position_embeddings
        s["original_max_position_embeddings"] = max_pos
    elif kind in NEEDS_ORIGINAL:
        s["original_max_position_embeddings"] = s.get("original_max_position_embeddings") or max_pos
    if kind == "yarn" and s.get("factor") is None:
        s["factor"] = max_pos / s["original_max_position_embeddings"]
    return s


# ---------------------------------------------------------------- attnlab's quantized folder

def quantized_config(path: Path, stored: dict) -> ModelConfig:
    """config.json written by `attnlab quantize` (`{"attnlab": {"config": ModelConfig fields, ...}}`) -> ModelConfig."""
    meta = validate.field(path, stored, "attnlab", dict, where="attnlab")
    raw = validate.field(path, meta or {}, "config", dict, where="attnlab.config")
    if raw is None:
        raise error(path, "attnlab.config is missing")
    known = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise error(path, f"attnlab.config has unknown field {unknown[0]!r}")
    hints = typing.get_type_hints(ModelConfig)
    for name in known:
        kind = hints[name]
        if isinstance(kind, types.UnionType):  # X | None
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        elif name in raw and raw[name] is None:
            raise error(path, f"attnlab.config.{name} is null")
        kind = typing.get_origin(kind) or kind
        if kind is list:
            validate.token_ids(path, f"attnlab.config.{name}", raw.get(name), 1 << 62)
        elif name != "rope_scaling":
            validate.field(path, raw, name, kind, where=f"attnlab.config.{name}")
    sizes = {"layers": "n_layers", "dim": "dim", "heads": "n_heads", "kv_heads": "n_kv_heads", "hidden": "hidden_dim",
             "head_dim": "head_dim"}
    d = validate._dims(path, lambda k: raw.get(sizes[k]), {k: f"attnlab.config.{v}" for k, v in sizes.items()},
                       raw.get("vocab_size"), False, False)
    where = "attnlab.config."
    validate.within(path, where + "norm_eps", raw.get("norm_eps", 1e-5), 0, 1)
    base = validate.within(path, where + "rope_base", raw.get("rope_base", 10000.0), 1, 1e12)
    validate.field(path, raw, "context_length", int, None, 1, validate.MAX_CONTEXT, where + "context_length")
    validate.field(path, raw, "sliding_window", int, None, 1, validate.MAX_CONTEXT, where + "sliding_window")
    validate.token_ids(path, where + "bos_token_id", raw.get("bos_token_id"), d.vocab)
    validate.token_ids(path, where + "eos_token_ids", raw.get("eos_token_ids"), d.vocab)
    scaling = validate.scaling_fields(path, raw.get("rope_scaling"), where + "rope_scaling")
    validate.check_rope_scaling(path, scaling, d.head_dim, float(base))
    try:
        return ModelConfig(**raw)
    except (TypeError, ValueError) as e:  # ModelConfig's own checks (AttnlabError) or a missing field
        raise error(path, f"attnlab.config: {e}") from None


def _config(d: validate.Dims, arch: str, **extra) -> ModelConfig:
    return ModelConfig(vocab_size=d.vocab, dim=d.dim, n_layers=d.layers, n_heads=d.heads, n_kv_heads=d.kv_heads,
                       hidden_dim=d.hidden, head_dim=d.head_dim, qkv_bias=d.qkv_bias, tie_embeddings=d.tied,
                       arch=arch, **extra)
