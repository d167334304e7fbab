"""Write a `Transformer` back out as a Hugging Face folder (config.json + model.safetensors).

The inverse of `loaders.build`: fused q/k/v and gate/up projections split again, q/k rows
back to the half-split layout, RoPE scaling and sliding window into config.json. It is how
a fine-tuned model (e.g. `attnlab extend`) becomes a checkpoint that `attnlab.load`, and
transformers for the standard scalings, read back with its context extension.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from attnlab.model.llama import Transformer


def deinterleave_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `attnlab.rope.interleave_rows`: pairs (2i, 2i + 1) back to (i, i + D/2), per head."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_state(model: Transformer) -> dict[str, torch.Tensor]:
    """Hugging Face-named float32 tensors of the network (tied head omitted)."""
    cfg = model.cfg
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    for i in range(cfg.n_layers):
        a, p = f"layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q, k, v = sd[a + f"attn.wqkv.{kind}"].split([q_size, kv_size, kv_size])
            out[p + f"self_attn.q_proj.{kind}"] = deinterleave_rows(q, cfg.n_heads)
            out[p + f"self_attn.k_proj.{kind}"] = deinterleave_rows(k, cfg.n_kv_heads)
            out[p + f"self_attn.v_proj.{kind}"] = v
        out[p + "self_attn.o_proj.weight"] = sd[a + "attn.wo.weight"]
        gate, up = sd[a + "mlp.w13.weight"].split(cfg.hidden_dim)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = sd[a + "mlp.w2.weight"]
        out[p + "input_layernorm.weight"] = sd[a + "attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[a + "mlp_norm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(model: Transformer, dtype: torch.dtype = torch.float32) -> dict:
    cfg = model.cfg
    arch = cfg.arch if cfg.arch in ("llama", "mistral", "qwen2") else "llama"
    out = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM"}[arch]],
        "model_type": arch, "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base, "max_position_embeddings": cfg.context_length,
        "rope_scaling": cfg.rope_scaling, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias and arch != "qwen2", "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else (cfg.eos_token_ids or None),
    }
    if arch == "mistral":
        out["sliding_window"] = cfg.sliding_window
    return out


def save_hf_folder(model: Transformer, path: str | Path, tokenizer=None, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json, model.safetensors (float32 or float16) and (if given) the tokenizer into path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(dtype).contiguous() for k, v in hf_state(model).items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(model, dtype), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
