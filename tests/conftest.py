"""Shared fixtures: one SmolLM2 load per test session, tiny random models for everything else."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)


def pytest_sessionstart(session):
    """With ATTNLAB_REQUIRE_KERNELS set (CI sets it), a run without the C++ kernels fails at once: the kernel
    tests would otherwise skip and the rest would pass on the pure-torch fallbacks."""
    if os.environ.get("ATTNLAB_REQUIRE_KERNELS", "").strip() not in ("", "0"):
        from attnlab.errors import AttnlabError
        from attnlab.kernels import build
        try:
            build.load()
        except AttnlabError as e:
            pytest.exit(str(e), returncode=3)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tests that set threads (CLI --threads) must not leak them into the next test."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2():
    import attnlab
    # the reference parity tests compare with: float32 weights and cache, the eager network
    return attnlab.load("smollm2-135m", dtype="float32", compile=False, kv_dtype="float32")


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
