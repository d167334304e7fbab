"""Quantized checkpoints on disk: one safetensors file of codes and scales + config.json.

A folder written here loads straight back into QuantLinear layers (no float copy, no
re-quantisation, identical logits). config.json carries the network's ModelConfig and
each layer's format under the key "attnlab", which is how the loaders tell such a
folder from a Hugging Face one.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from attnlab.errors import AttnlabError
from attnlab.io import write_atomic, write_text
from attnlab.quant.formats import Packed
from attnlab.quant.linear import QuantEmbedding, QuantLinear, linear_names

FORMAT = 1
_PARTS = ("q", "qs", "scale", "min", "codebook")


def is_quantized_folder(path: Path) -> bool:
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        return "attnlab" in json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def save_quantized(lm, out: str | Path) -> Path:
    """Write lm (quantized) to folder out: model.safetensors, config.json and the tokenizer."""
    from safetensors.torch import save_file

    model = lm.model
    if model.quant is None:
        raise AttnlabError("the model is not quantized; load it with quant=... first")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    layers = {}
    for name in linear_names(model):
        m = model.get_submodule(name)
        layers[name] = {"kind": m.kind, "group": m.group, "bits": m.bits, "fused": m.fused}
    meta = {"attnlab": {"format": FORMAT, "quant": model.quant, "layers": layers,
                        "config": dataclasses.asdict(model.cfg)}}
    write_atomic(out / "model.safetensors", lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    write_text(out / "config.json", json.dumps(meta, indent=2) + "\n")
    if lm.tokenizer is not None:
        lm.tokenizer.save_pretrained(str(out))
    return out


def load_quantized(path: Path, dtype: torch.dtype = torch.float32):
    """The Transformer saved by save_quantized, its QuantLinear layers rebuilt from the stored codes."""
    from safetensors.torch import load_file

    from attnlab.model.llama import ModelConfig, Transformer
    from attnlab.model.loaders import ModelLoadError

    meta = json.loads((path / "config.json").read_text())["attnlab"]
    if meta.get("format") != FORMAT:
        raise ModelLoadError(f"{path}: unknown attnlab checkpoint format {meta.get('format')!r}")
    try:
        cfg = ModelConfig(**meta["config"])
        tensors = load_file(str(path / "model.safetensors"))
    except Exception as e:
        raise ModelLoadError(f"cannot read quantized checkpoint {path}: {type(e).__name__}: {e}") from None
    with torch.device("meta"):
        model = Transformer(cfg)
    for name, info in meta["layers"].items():
        parts = {p: tensors.pop(f"{name}.{p}") for p in _PARTS if f"{name}.{p}" in tensors}
        first = parts.get("q", parts.get("qs"))
        if first is None:
            raise ModelLoadError(f"{path}: no codes for layer {name}")
        K = first.shape[1] * (1 if info["kind"] == "int8" else 2)
        packed = Packed(info["kind"], (first.shape[0], K), info["group"], info["bits"], **parts)
        bias = tensors.pop(f"{name}.bias", None)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, QuantLinear(packed, bias, info["fused"]))
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.embed = QuantEmbedding(model.lm_head)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"{path}: checkpoint does not fill {missing[0]}")
    model.quant = meta["quant"]
    return model.eval().requires_grad_(False)
