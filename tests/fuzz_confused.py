"""Type-confused mutations for the model-file fuzzer (tests/test_fuzz_models.py): valid JSON and valid
GGUF metadata of the wrong shape, which byte flips almost never produce.

A config.json that is `5` or `null`; any value at any depth (rope_scaling's fields, eos lists,
attnlab's layer entries) replaced by another JSON type carrying the same content (`[v]`, `"v"`,
`{"value": v}`, a nested null, a bool, a float for an int); GGUF metadata written with the wrong
type (an array or a string where llama.cpp writes a number, a number for the architecture);
rope_freqs of the wrong length or values. Each base config first takes a valid variant (YaRN,
Llama 3, Mistral's window, Qwen2 biases, transformers 5's rope_parameters) so nested fields exist.
"""
from __future__ import annotations

import copy
import json
import random
import struct
import tempfile
from pathlib import Path

HF_VARIANTS = [
    {},
    {"model_type": "mistral", "sliding_window": 16},
    {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
                      "beta_slow": 1.0, "truncate": True}},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, "rope_theta": None},
    {"eos_token_id": [0, 2], "bos_token_id": 1, "attention_bias": False, "head_dim": 8, "mlp_bias": False},
    {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 32},  # with the bias tensors
]
GGUF_VARIANTS = [
    {},
    {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 16,
     "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0, "rope.scaling.attn_factor": 1.0},
    {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
    {"tokenizer.ggml.bos_token_id": 1, "attention.key_length": 8, "attention.value_length": 8},
]
NOT_OBJECTS = [5, None, [], "llama", True, 1.5, 0, -1, "", [None], [{}]]


def bases(tmp: Path) -> dict:
    from tests.model_files import tiny_tensors, write_hf
    qwen = write_hf(tmp / "qwen2", tiny_tensors(bias=True))
    return {"st_bias": (qwen / "model.safetensors").read_bytes()}


def quantized_base(tmp: str) -> dict:
    """A folder written by `attnlab quantize` (int8, from a Q8_0 GGUF); run in a fuzz worker."""
    from attnlab.engine import LM
    from attnlab.quant.store import save_quantized
    from tests.model_files import write_gguf
    lm = LM.load(write_gguf(Path(tmp) / "base_q8.gguf", qtype="Q8_0"), tokenizer=False, quant="int8")
    out = save_quantized(lm, Path(tmp) / "quantized")
    return {"q_config": json.loads((out / "config.json").read_text()), "q_st": (out / "model.safetensors").read_bytes()}


def confuse(value, rng: random.Random):
    """value as another JSON type with the same content, or a nested null."""
    options = [[value], [value, value], str(value), {"value": value}, None, [], {}, True, False, "", [[value]], [None]]
    if isinstance(value, bool):
        options += [int(value), str(value).lower()]
    elif isinstance(value, int):
        options += [float(value), str(value), value + 0.5]
    elif isinstance(value, float):
        options += [int(value) if value == value and abs(value) < 1e18 else 0, str(value)]
    return rng.choice(options)


def confuse_somewhere(tree, rng: random.Random) -> None:
    """Replace one value at a random depth of a JSON tree (dicts and lists) by a confused one."""
    node = tree
    while True:
        keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            return
        key = rng.choice(keys)
        child = node[key]
        if isinstance(child, (dict, list)) and child and rng.random() < 0.65:
            node = child
            continue
        node[key] = confuse(child, rng)
        return


def hf_case(base: dict, rng: random.Random) -> dict[str, bytes]:
    variant = rng.choice(HF_VARIANTS)
    st = base["st_bias" if variant.get("model_type") == "qwen2" else "st"]
    if rng.random() < 0.15:
        config = rng.choice(NOT_OBJECTS + [[base["config"]]])
    else:
        config = {**copy.deepcopy(base["config"]), **copy.deepcopy(variant)}
        for _ in range(rng.choice([1, 1, 1, 2])):
            confuse_somewhere(config, rng)
    return {"hf/config.json": json.dumps(config).encode(), "hf/model.safetensors": st}


def quantized_case(base: dict, rng: random.Random) -> dict[str, bytes]:
    config, st = copy.deepcopy(base["q_config"]), bytearray(base["q_st"])
    how = rng.random()
    if how < 0.1:
        config = rng.choice(NOT_OBJECTS)
    elif how < 0.8:
        for _ in range(rng.choice([1, 1, 2])):
            confuse_somewhere(config, rng)
    else:  # the tensors: a header or data byte, or a truncation
        header = 8 + struct.unpack_from("<Q", st, 0)[0]
        at = rng.randrange(8, header) if rng.random() < 0.7 else rng.randrange(header, len(st))
        if rng.random() < 0.1:
            del st[at:]
        else:
            st[at] = rng.randrange(256)
    return {"hf/config.json": json.dumps(config).encode(), "hf/model.safetensors": bytes(st)}


def _gguf_confuse(value, rng: random.Random):
    """value as another GGUF type: an array of it, its text, a float for an int, a number for a string."""
    options = [[value], [value, value], str(value), [str(value)], True, None, 7, 2.5, "llama"]
    if isinstance(value, int) and not isinstance(value, bool):
        options += [float(value), -1.0]
    if isinstance(value, float):
        options += [int(value)]
    return rng.choice(options)


def gguf_case(base: dict, rng: random.Random) -> dict[str, bytes]:
    import numpy as np

    from tests.model_files import TINY, write_gguf
    meta = dict(rng.choice(GGUF_VARIANTS))
    keys = ["block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
            "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base",
            "tokenizer.ggml.eos_token_id", "general.architecture", "general.alignment"] + list(meta)
    defaults = {"block_count": TINY["layers"], "context_length": TINY["context"], "embedding_length": TINY["dim"],
                "feed_forward_length": TINY["hidden"], "attention.head_count": TINY["heads"],
                "attention.head_count_kv": TINY["kv_heads"], "attention.layer_norm_rms_epsilon": 1e-5,
                "rope.freq_base": 10000.0, "tokenizer.ggml.eos_token_id": 0, "general.architecture": "llama",
                "general.alignment": 32, **meta}
    extra = {}
    if rng.random() < 0.15:  # Llama 3.1's per-frequency divisors, of a random length and values
        n = rng.choice([1, 3, 4, 4, 4, 5, 8])
        extra["rope_freqs.weight"] = np.array([rng.choice([1.0, 2.0, 8.0, 0.0, -1.0, np.nan, np.inf, 1e30, 1e-30])
                                               for _ in range(n)], dtype=np.float32)
    else:
        for _ in range(rng.choice([1, 1, 2])):
            key = rng.choice(keys)
            meta[key] = _gguf_confuse(defaults[key], rng)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return {"m.gguf": write_gguf(Path(tmp) / "x.gguf", meta=meta, extra_tensors=extra).read_bytes()}
        except Exception:  # the writer refused (e.g. -1 as uint32, a mixed array): the valid file instead
            return {"m.gguf": write_gguf(Path(tmp) / "x.gguf").read_bytes()}
