"""Parity with Hugging Face transformers on the same weights: the engine's correctness anchor."""
from __future__ import annotations

import pytest
import torch

from attnlab.engine import LM


def test_smollm2_logits_match_transformers(smollm2, hf_smollm2):
    ids = torch.randint(0, smollm2.cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    ours = smollm2.logits(ids)
    with torch.no_grad():
        ref = hf_smollm2(ids).logits
    assert (ours - ref).abs().max().item() < 1e-3


def test_smollm2_greedy_generation_matches_transformers(smollm2, hf_smollm2):
    prompt = smollm2.encode("The three witches met on the heath and")
    with torch.no_grad():
        ref = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                  eos_token_id=None, min_new_tokens=32)[0, len(prompt):].tolist()
    from attnlab.sampling import Sampler
    cache = smollm2.new_cache()
    ours = list(smollm2.stream(prompt, cache, Sampler(), 32, stop_at_eos=False))
    assert ours == ref


def test_smollm2_chunked_decode_matches_full_forward(smollm2):
    ids = torch.randint(0, smollm2.cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    full = smollm2.logits(ids)
    cache = smollm2.new_cache()
    parts = [smollm2.prefill(ids[:, :40], cache, chunk=16, all_logits=True)]
    parts += [smollm2.forward(ids[:, t:t + 1], cache) for t in range(40, 48)]
    assert (torch.cat(parts, 1) - full).abs().max().item() < 1e-3


def test_smollm2_chat_template(smollm2):
    ids = smollm2.chat_ids([{"role": "user", "content": "hi"}])
    text = smollm2.tokenizer.decode(ids)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.rstrip().endswith("<|im_start|>assistant")


def _random_hf_model(kind: str, tmp_path, shard: bool = False):
    import transformers
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                  rope_theta=5000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "llama3-scaled":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64, "rope_theta": 5000.0}
        model = transformers.LlamaConfig(**common)
        model.rope_parameters = scaling
        model = transformers.LlamaForCausalLM(model)
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():  # make the q/k/v biases non-trivial so a dropped bias shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="200KB" if shard else "5GB")
    return model.eval()


@pytest.mark.parametrize("kind,shard", [("llama", False), ("llama", True), ("qwen2", False), ("llama3-scaled", False)])
def test_random_hf_checkpoint_matches_transformers(kind, shard, tmp_path):
    ref_model = _random_hf_model(kind, tmp_path, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    lm = LM.load(tmp_path)
    assert lm.tokenizer is None and lm.cfg.n_kv_heads == 2 and not lm.cfg.tie_embeddings
    assert lm.cfg.qkv_bias == (kind == "qwen2")
    assert (lm.cfg.rope_scaling or {}).get("rope_type") == ("llama3" if kind == "llama3-scaled" else None)
    ids = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(ids).logits
    assert (lm.logits(ids) - ref).abs().max().item() < 1e-4


def test_chat_session_feeds_each_turn_once(smollm2):
    """Two turns on one cache: the cache holds exactly the rendered conversation, and its next-token
    logits equal a fresh forward over that text, so no history was lost or fed twice."""
    from attnlab.chat import ChatSession
    from attnlab.sampling import Sampler

    session = ChatSession(smollm2, Sampler(), max_new_tokens=12)
    for question in ("Name a colour.", "And another one?"):
        reply = list(session.ask(question))
        assert reply
    ids = smollm2.encode_rendered(session.fed)
    assert session.cache.seen == len(ids)
    last = torch.tensor([[reply[-1]]])
    ours = smollm2.forward(last, session.cache)[0, -1]
    ref = smollm2.logits(torch.tensor([ids + [reply[-1]]]))[0, -1]
    assert (ours - ref).abs().max().item() < 1e-3
