"""attnlab's quantized checkpoint folders (written by `attnlab.quant.store.save_quantized`), read back.

A folder is recognised by the "attnlab" key of its config.json; its layers are rebuilt from the
stored codes as QuantLinear layers, every entry and tensor checked against the format first.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from attnlab.model import metadata, validate
from attnlab.model.files import ModelLoadError
from attnlab.model.llama import Transformer
from attnlab.quant.formats import Packed
from attnlab.quant.kinds import KINDS
from attnlab.quant.linear import QuantEmbedding, QuantLinear, linear_names
from attnlab.quant.store import PARTS, FORMAT


def is_quantized_folder(path: Path) -> bool:
    """A folder whose config.json is an object with an "attnlab" key (anything else goes to the HF loader,
    which names what is wrong with it)."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        meta = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(meta, dict) and "attnlab" in meta



def load_quantized(path: Path, dtype: torch.dtype = torch.float32):
    """The Transformer saved by save_quantized, its QuantLinear layers rebuilt from the stored codes.

    config.json is checked for shape (`metadata.quantized_config`), every layer's entry for type
    and every stored tensor for the shape and dtype its layer's format implies, so a tampered
    folder ends in one ModelLoadError rather than a crash in the first forward.
    """
    from safetensors.torch import load_file

    stored = metadata.read_json(path)
    cfg = metadata.quantized_config(path, stored)
    meta = stored["attnlab"]
    if meta.get("format") != FORMAT:
        raise ModelLoadError(f"{path}: unknown attnlab checkpoint format {meta.get('format')!r}")
    quant = validate.field(path, meta, "quant", str, where="attnlab.quant")
    layers = validate.field(path, meta, "layers", dict, where="attnlab.layers")
    if quant is None or layers is None:
        raise ModelLoadError(f"{path}: attnlab.quant and attnlab.layers are required")
    try:
        tensors = load_file(str(path / "model.safetensors"))
    except Exception as e:
        raise ModelLoadError(f"cannot read quantized checkpoint {path}: {type(e).__name__}: {e}") from None
    with torch.device("meta"):
        model = Transformer(cfg)
    names = linear_names(model)
    if sorted(layers) != sorted(names):
        extra = sorted(set(layers) ^ set(names))[0]
        raise ModelLoadError(f"{path}: attnlab.layers does not match the network (layer {extra!r})")
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        want = tuple(getattr(owner, leaf).weight.shape)
        packed = _packed(path, name, layers[name], tensors, want)
        bias = tensors.pop(f"{name}.bias", None)
        if (bias is not None) != (cfg.qkv_bias and name.endswith("wqkv")) or \
                (bias is not None and (tuple(bias.shape) != want[:1] or not bias.is_floating_point())):
            raise ModelLoadError(f"{path}: {name}.bias does not fit the config (qkv_bias {cfg.qkv_bias}, [{want[0]}])")
        setattr(owner, leaf, QuantLinear(packed, bias, layers[name]["fused"]))
    params = dict(model.named_parameters())
    for k, v in tensors.items():
        if k not in params or tuple(v.shape) != tuple(params[k].shape) or not v.is_floating_point():
            raise ModelLoadError(f"{path}: unexpected tensor {k} {list(v.shape)} {v.dtype}")
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True)
    if cfg.tie_embeddings:
        if not model.lm_head.fmt.embeds:
            raise ModelLoadError(f"{path}: a tied embedding needs an lm_head of "
                                 f"{'/'.join(k for k, f in KINDS.items() if f.embeds)}, got {model.lm_head.kind}")
        model.embed = QuantEmbedding(model.lm_head)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"{path}: checkpoint does not fill {missing[0]}")
    model.quant = quant
    return model.eval().requires_grad_(False)


def _packed(path, name: str, info, tensors: dict, want: tuple[int, int]) -> Packed:
    """One layer's stored codes and scales, checked against its format and the network's [N, K]."""
    where = f"attnlab.layers.{name}"
    if not isinstance(info, dict):
        raise ModelLoadError(f"{path}: {where} must be an object, got {validate.shown(info)}")
    kind = validate.field(path, info, "kind", str, where=where + ".kind")
    N, K = want
    group = validate.field(path, info, "group", int, None, 1, K, where + ".group")
    bits = validate.field(path, info, "bits", int, None, 2, 8, where + ".bits")
    validate.field(path, info, "fused", bool, where=where + ".fused")
    if kind not in KINDS or group is None or bits is None or "fused" not in info or K % group:
        raise ModelLoadError(f"{path}: {where} needs kind {'/'.join(KINDS)}, a group dividing {K}, bits and fused")
    expect = KINDS[kind].stored(N, K, group)
    if KINDS[kind].min_optional and f"{name}.min" in tensors:  # GGUF K-quants' min (Q5_K), or a promoted layer of parts
        expect["min"] = ((N, K // group), None)
    parts = {}
    for part, (shape, dt) in expect.items():
        t = tensors.pop(f"{name}.{part}", None)
        if t is None:
            raise ModelLoadError(f"{path}: missing tensor {name}.{part}")
        if tuple(t.shape) != shape or (t.dtype != dt if dt is not None else not t.is_floating_point()):
            raise ModelLoadError(f"{path}: tensor {name}.{part} is {list(t.shape)} {t.dtype}, "
                                 f"{kind} group {group} of [{N}, {K}] needs {list(shape)}")
        parts[part] = t
    for part in PARTS:
        if f"{name}.{part}" in tensors:
            raise ModelLoadError(f"{path}: tensor {name}.{part} does not belong to a {kind} layer")
    return Packed(kind, (N, K), group, bits, **parts)
