"""A user's own GGUF file: written here the way llama.cpp's converter writes one, then loaded back.

The q/k rows are permuted as llama.cpp does for `llama` (not for `qwen2`), so a loader that
forgot to undo the permutation, or mis-read a tensor type, fails against transformers.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from attnlab.engine import LM

_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:  # llama.cpp convert_hf_to_gguf.py
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, arch: str, qtype, path, extra=None) -> None:
    """extra(writer): adds more metadata or tensors (e.g. RoPE scaling) before the file is written."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    if extra is not None:
        extra(w)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            _, _, i, *rest = name.split(".")
            g = f"blk.{i}.{_BLOCK['.'.join(rest[:-1])]}.{rest[-1]}"
            if arch == "llama" and rest[-2] in ("q_proj", "k_proj"):
                a = _permute(a, c.num_attention_heads if rest[-2] == "q_proj" else c.num_key_value_heads)
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(g, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(g, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,qtype", [("llama", "F32"), ("llama", "Q8_0"), ("qwen2", "F16")])
def test_own_gguf_matches_transformers(arch, qtype, tmp_path):
    qtype = gguf.GGMLQuantizationType[qtype]
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    cfg_cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    model = cls(cfg_cls(**common)).eval()
    with torch.no_grad():  # the reference sees the same rounding the file stores
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            if p.dim() == 2 and qtype != gguf.GGMLQuantizationType.F32:
                q = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, qtype).reshape(p.shape).astype(np.float32)))
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(model, arch, qtype, path)
    lm = LM.load(path, dtype="float32")  # the file's weights exactly (by default Q8_0 stays int8 and the
    # kernels round activations); no tokenizer metadata in this file: weights load, text calls explain why not
    with pytest.raises(ValueError, match="no tokenizer"):
        lm.encode("hello")
    assert lm.cfg.arch == arch and lm.cfg.n_kv_heads == 2 and lm.cfg.qkv_bias == (arch == "qwen2")
    ids = torch.randint(0, 96, (1, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    assert (lm.logits(ids) - ref).abs().max().item() < 1e-4
