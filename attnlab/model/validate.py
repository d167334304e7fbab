"""Validation at the edge: model files are checked for sense before anything is allocated.

A checkpoint is untrusted input. One changed byte can make a header claim a billion
layers, a 2^60-element array or a tensor past the end of the file, and the readers
(and the network built from the config) would then hang or exhaust memory, or load
and compute NaN. So, before any tensor is read:

- a GGUF header is walked (`gguf_header.scan_gguf`) with every count and length checked
  against the bytes left in the file (the `gguf` reader would build whatever it claims);
- every config value has the right type and a sane range (`field`: the builders in
  `metadata.py` read every value through it, at every level, so `5`, `null`, a string
  for an int or an array for a scalar is a clean error), and caps bound what a header
  may claim;
- every tensor the network needs exists with the shape the config implies, and a GGUF
  tensor's data lies inside the file;

and after reading, weights must be finite and in range (a tiny probe forward must
give finite logits). Every rejection is a `ModelLoadError` naming the file and field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from attnlab.model.files import _GGUF_BLOCK, _GGUF_NAMES, GGUF_ARCHS
from attnlab.model.gguf_header import GGUFArray, GGUFHeader, error, scan_gguf  # noqa: F401  (scan_gguf re-exported)

# Caps on what a header may claim: far above any released Llama-family model, far below
# what would take minutes or gigabytes to build.
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_DIM = 1 << 17
MAX_HIDDEN = 1 << 19
MAX_HEAD_DIM = 1024
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 24
MAX_WEIGHT = 65504.0  # fp16's largest value; trained weights are orders of magnitude smaller


# ---------------------------------------------------------------- config values

def _number(path, where: str, value, kind: type, lo=None, hi=None, required: bool = True):
    """value checked to be an int (or a finite number for float) within [lo, hi]."""
    if value is None:
        if required:
            raise error(path, f"{where} is missing")
        return None
    ok = type(value) is int if kind is int else type(value) in (int, float) and math.isfinite(value)
    if not ok:
        raise error(path, f"{where} must be {'an integer' if kind is int else 'a finite number'}, got {shown(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise error(path, f"{where} = {value} is out of range [{lo}, {hi}]")
    return kind(value)


@dataclass
class Dims:
    """The sizes the network is built from, validated."""
    layers: int
    dim: int
    heads: int
    kv_heads: int
    hidden: int
    head_dim: int
    vocab: int
    qkv_bias: bool
    tied: bool


def _dims(path, get, names: dict, vocab: int, qkv_bias: bool, tied: bool) -> Dims:
    layers = _number(path, names["layers"], get("layers"), int, 1, MAX_LAYERS)
    dim = _number(path, names["dim"], get("dim"), int, 1, MAX_DIM)
    heads = _number(path, names["heads"], get("heads"), int, 1, MAX_HEADS)
    kv = _number(path, names["kv_heads"], get("kv_heads"), int, 1, MAX_HEADS, required=False) or heads
    hidden = _number(path, names["hidden"], get("hidden"), int, 1, MAX_HIDDEN)
    head_dim = _number(path, names["head_dim"], get("head_dim"), int, 0, MAX_HEAD_DIM, required=False) or 0
    if not head_dim:
        if dim % heads:
            raise error(path, f"{names['dim']} = {dim} is not divisible by {names['heads']} = {heads}")
        head_dim = dim // heads
    if head_dim % 2:
        raise error(path, f"head dimension {head_dim} is odd (RoPE rotates pairs)")
    if heads % kv:
        raise error(path, f"{names['heads']} = {heads} is not a multiple of {names['kv_heads']} = {kv}")
    _number(path, "vocabulary size", vocab, int, 1, MAX_VOCAB)
    return Dims(layers, dim, heads, kv, hidden, head_dim, vocab, qkv_bias, tied)


def expected_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape for every tensor the network is built from."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = {"model.embed_tokens.weight": (d.vocab, d.dim), "model.norm.weight": (d.dim,)}
    if not d.tied:
        out["lm_head.weight"] = (d.vocab, d.dim)
    for i in range(d.layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, d.dim), p + "self_attn.k_proj.weight": (kv, d.dim),
                    p + "self_attn.v_proj.weight": (kv, d.dim), p + "self_attn.o_proj.weight": (d.dim, q),
                    p + "mlp.gate_proj.weight": (d.hidden, d.dim), p + "mlp.up_proj.weight": (d.hidden, d.dim),
                    p + "mlp.down_proj.weight": (d.dim, d.hidden), p + "input_layernorm.weight": (d.dim,),
                    p + "post_attention_layernorm.weight": (d.dim,)})
        if d.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
    return out


def check_shapes(path, d: Dims, shapes: dict[str, tuple[int, ...]], file_name=lambda hf: hf) -> None:
    """Every needed tensor present with the shape the config implies (file_name: the name messages show)."""
    for hf, want in expected_shapes(d).items():
        got = shapes.get(hf)
        if got is None:
            raise error(path, f"missing tensor {file_name(hf)}")
        if tuple(got) != want:
            raise error(path, f"tensor {file_name(hf)} has shape {list(got)}, the config implies {list(want)}")


def shown(value) -> str:
    """A JSON/GGUF value's type as a message names it."""
    if isinstance(value, (GGUFArray, list)):
        return "an array"
    return {type(None): "null", dict: "an object"}.get(type(value), type(value).__name__)


_KINDS = {bool: "true or false", str: "a string", dict: "an object"}


def field(path, src: dict, key: str, kind: type, default=None, lo=None, hi=None, where: str | None = None):
    """src[key] checked to be of type kind (numbers also within [lo, hi]); default when absent or null.

    Every config value a builder reads comes through here, so a value of the wrong JSON or GGUF
    type (an array for a number, a string for an int, an object for a flag) is one ModelLoadError
    naming the file and the field, never a TypeError further in.
    """
    value = src.get(key)
    if value is None:
        return default
    if kind in (int, float):
        return _number(path, where or key, value, kind, lo, hi)
    if type(value) is not kind:
        raise error(path, f"{where or key} must be {_KINDS[kind]}, got {shown(value)}")
    return value


def within(path, where: str, value: float, lo: float, hi: float) -> float:
    """value in the open interval (lo, hi)."""
    if not lo < value < hi:
        raise error(path, f"{where} = {value!r} is out of range ({lo:g}, {hi:g})")
    return value


def token_ids(path, where: str, value, vocab: int) -> list[int]:
    """A token id or a list of them (Hugging Face's eos_token_id may be either) -> ids inside the vocabulary."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    if None in values:
        raise error(path, f"{where} must hold integers, got null")
    return [_number(path, where, v, int, 0, vocab - 1) for v in values]


# The keys of a rope_scaling / rope_parameters object the loaders read, with their types.
SCALING_FIELDS = {"rope_type": str, "type": str, "factor": float, "original_max_position_embeddings": int,
                  "low_freq_factor": float, "high_freq_factor": float, "beta_fast": float, "beta_slow": float,
                  "attention_factor": float, "mscale": float, "mscale_all_dim": float, "truncate": bool,
                  "rope_theta": float}


def scaling_fields(path, raw, where: str) -> dict | None:
    """A rope_scaling-like object (or null) with every key the RoPE code reads of the right type."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise error(path, f"{where} must be an object, got {shown(raw)}")
    for key, kind in SCALING_FIELDS.items():
        lo = 1 if key == "original_max_position_embeddings" else None
        field(path, raw, key, kind, lo=lo, hi=MAX_CONTEXT if lo else None, where=f"{where}.{key}")
    factors = raw.get("factors")
    if factors is not None and not (isinstance(factors, list) and all(type(x) in (int, float) for x in factors)):
        raise error(path, f"{where}.factors must be an array of numbers")
    return raw


def check_rope_scaling(path, scaling, head_dim: int, base: float = 10000.0) -> None:
    """The scaling a config will run with must give finite, positive frequencies."""
    if scaling is None:
        return
    scaling_fields(path, scaling, "rope_scaling")
    from attnlab.rope import inv_frequencies
    brief = {k: v for k, v in scaling.items() if k != "factors"}  # rope_freqs' values would fill the line
    try:
        inv = inv_frequencies(head_dim, base, scaling)
    except (ValueError, TypeError, KeyError, ZeroDivisionError, OverflowError) as e:
        raise error(path, f"rope_scaling {brief!r} is not usable: {type(e).__name__}: {e}") from None
    if not bool(inv.isfinite().all()) or not bool((inv > 0).all()):
        raise error(path, f"rope_scaling {brief!r} gives non-finite or non-positive frequencies")


# ---------------------------------------------------------------- per format

def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{parts[3]}"
    return None


def _gguf_name(hf_name: str) -> str:
    fixed = {v: k for k, v in _GGUF_NAMES.items()}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, i, *rest = hf_name.split(".")
    return f"blk.{i}.{ {v: k for k, v in _GGUF_BLOCK.items()}['.'.join(rest[:-1])]}.{rest[-1]}"


def check_gguf(path, head: GGUFHeader) -> Dims:
    """Config sense and tensor shapes of a scanned GGUF, before the gguf reader sees the file."""
    arch = head.meta.get("general.architecture")
    if not isinstance(arch, str):
        raise error(path, f"general.architecture must be a string, got {shown(arch)}")
    if arch not in GGUF_ARCHS:
        raise error(path, f"unsupported architecture {arch!r}; supported: {', '.join(GGUF_ARCHS)}")
    meta = head.meta
    shapes = {}
    for gname, info in head.tensors.items():
        parts = gname.split(".")
        if parts[0] == "blk" and (len(parts) != 4 or not parts[1].isdigit()):
            raise error(path, f"malformed tensor name {gname!r}")
        hf = hf_name(gname)
        if hf is not None:
            shapes[hf] = info.shape
    embed = shapes.get("model.embed_tokens.weight")
    if embed is None or len(embed) != 2:
        raise error(path, "missing tensor token_embd.weight (or it is not a matrix)")
    keys = {"layers": "block_count", "dim": "embedding_length", "heads": "attention.head_count",
            "kv_heads": "attention.head_count_kv", "hidden": "feed_forward_length", "head_dim": "attention.key_length"}
    full = {k: f"{arch}.{v}" for k, v in keys.items()}
    d = _dims(path, lambda k: meta.get(full[k]), full, embed[0],
              "model.layers.0.self_attn.q_proj.bias" in shapes, "lm_head.weight" not in shapes)
    value_len = field(path, meta, f"{arch}.attention.value_length", int)
    if value_len is not None and value_len != d.head_dim:
        raise error(path, f"{arch}.attention.value_length = {value_len!r} differs from the key length {d.head_dim}")
    check_shapes(path, d, shapes, _gguf_name)
    return d


def safetensors_shapes(path, files) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors headers only (no data read)."""
    from safetensors import safe_open
    shapes = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as s:
                for k in s.keys():
                    shapes[k] = tuple(s.get_slice(k).get_shape())
        except Exception as e:  # the reader raises several types on a corrupt header
            raise error(f, f"cannot read safetensors header: {type(e).__name__}: {e}") from None
    return shapes


def check_hf(path, hf, files) -> Dims:
    """config.json's sizes (types and ranges), then tensor shapes from the safetensors headers, before any data is read.

    The other fields are read, type-checked, by `metadata.hf_config`.
    """
    if not isinstance(hf, dict):
        raise error(path, f"config.json must hold a JSON object, got {shown(hf)}")
    for key in ("max_position_embeddings", "rms_norm_eps", "vocab_size"):
        if key in hf and hf[key] is None:
            raise error(path, f"{key} is null in config.json")
    shapes = safetensors_shapes(path, files)
    names = {"layers": "num_hidden_layers", "dim": "hidden_size", "heads": "num_attention_heads",
             "kv_heads": "num_key_value_heads", "hidden": "intermediate_size", "head_dim": "head_dim"}
    vocab = _number(path, "vocab_size", hf.get("vocab_size"), int, 1, MAX_VOCAB)
    bias = hf.get("model_type") == "qwen2" or field(path, hf, "attention_bias", bool, False)
    tied = field(path, hf, "tie_word_embeddings", bool, False) or "lm_head.weight" not in shapes
    d = _dims(path, lambda k: hf.get(names[k]), names, vocab, bias, tied)
    check_shapes(path, d, shapes)
    return d


# ---------------------------------------------------------------- after reading

def check_weights(path, tensors: dict) -> None:
    """Reject NaN, inf and absurd magnitudes, naming the tensor (one min/max pass per tensor, no copies)."""
    import torch
    parts = []
    for name, t in tensors.items():  # a quantized tensor kept packed: its float parts (scales, codebooks)
        parts += [(name, t)] if isinstance(t, torch.Tensor) else [(f"{name} ({k})", v) for k, v in t.tensors().items()]
    for name, t in parts:
        if not t.is_floating_point() or t.numel() == 0:
            continue
        lo, hi = torch.aminmax(t)
        lo, hi = float(lo), float(hi)
        if not (-MAX_WEIGHT <= lo and hi <= MAX_WEIGHT):  # NaN fails both comparisons
            bad = "NaN" if math.isnan(lo) or math.isnan(hi) else f"values in [{lo:.3g}, {hi:.3g}]"
            raise error(path, f"tensor {name} has {bad} (finite weights within +-{MAX_WEIGHT:g} expected)")


def check_model(path, model) -> None:
    """A probe forward on a few tokens must give finite logits: catches weights that overflow together."""
    import torch
    n = min(model.cfg.vocab_size, 8)
    with torch.inference_mode():
        logits = model(torch.arange(n)[None])
    if not bool(torch.isfinite(logits).all()):
        raise error(path, "the weights give non-finite logits on a probe input (values out of range)")
