"""Shared fixtures: one SmolLM2 load per test session, tiny random models for everything else."""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tests that set threads (CLI --threads) must not leak them into the next test."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2():
    import attnlab
    return attnlab.load("smollm2-135m", dtype="float32")  # fp32 weights: the reference parity tests compare with


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(smollm2.source.parent), gguf_file=smollm2.source.name,
                                                dtype=torch.float32).eval()


def tiny_config(**kw):
    from attnlab.model.llama import ModelConfig
    base = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, rope_base=10000.0,
                context_length=256, eos_token_ids=[0])
    base.update(kw)
    return ModelConfig(**base)


def tiny_lm(seed: int = 0, **kw):
    """A random Llama-family LM (GQA) with weights large enough to give peaked attention."""
    from attnlab.engine import LM
    from attnlab.model.llama import Transformer
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**kw))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2 if p.dim() > 1 else 0.05)
        if p.dim() == 1:
            p.data += 1.0 if p.shape[0] == model.cfg.dim else 0.0
    return LM(model.eval().requires_grad_(False))


@pytest.fixture
def tiny():
    return tiny_lm()
