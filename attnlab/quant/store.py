"""Quantized checkpoints on disk: one safetensors file of codes and scales + config.json.

A folder written here loads straight back into QuantLinear layers (no float copy, no
re-quantisation, identical logits; the loader is `attnlab.model.quantized`, beside the other
model-file readers). config.json carries the network's ModelConfig and each layer's format
under the key "attnlab", which is how the loaders tell such a folder from a Hugging Face one.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from attnlab.errors import AttnlabError
from attnlab.io import write_atomic, write_text
from attnlab.quant.linear import linear_names

FORMAT = 1
PARTS = ("q", "qs", "scale", "min", "codebook")


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
