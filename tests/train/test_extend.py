"""Context extension by fine-tuning: the export writes what the loader reads (and transformers
too), an extended run reloads to identical logits with its scaling, and resume is exact."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

import attnlab
from attnlab.model.export import save_hf_folder
from attnlab.train.extend import extend


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A random Llama on SmolLM2's vocabulary, with SmolLM2's tokenizer files."""
    from attnlab.model.loaders import resolve
    from attnlab.model.tokenizer import load_tokenizer
    path = tmp_path_factory.mktemp("tiny")
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    load_tokenizer(resolve("smollm2-135m")).save_pretrained(str(path))
    return path


def _ids(T):
    return torch.randint(0, 49152, (1, T), generator=torch.Generator().manual_seed(T))


def test_export_roundtrip_and_transformers_reads_it(tiny_folder, tmp_path):
    lm = attnlab.load(tiny_folder, rope="linear:2")
    save_hf_folder(lm.model, tmp_path)
    back = attnlab.load(tmp_path)
    ids = _ids(100)
    assert back.cfg.rope_scaling["factor"] == 2.0
    assert torch.equal(back.logits(ids), lm.logits(ids))
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert (ref(ids).logits - lm.logits(ids)).abs().max().item() < 1e-4


def test_extend_reloads_with_its_scaling(tiny_folder, tmp_path):
    out = tmp_path / "pi"
    lm, rows = extend(str(tiny_folder), out, factor=2, method="pi", steps=3, context=128, text="shakespeare:hamlet",
                      lr=1e-2, warmup=0, eval_batches=1)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 64}
    assert config["max_position_embeddings"] == 128
    back = attnlab.load(out)
    ids = _ids(128)
    assert back.tokenizer is not None and torch.equal(back.logits(ids), lm.logits(ids))
    before = attnlab.load(tiny_folder, rope="linear:2")
    assert (before.logits(ids) - back.logits(ids)).abs().max().item() > 1e-3  # the weights were trained
    assert rows[-1]["step"] == 3 and rows[-1]["val_loss"] < rows[0]["val_loss"]


def test_extend_resume_is_exact(tiny_folder, tmp_path):
    kw = dict(factor=2, method="yarn", context=64, text="shakespeare:hamlet", lr=1e-2, warmup=0, eval_batches=1)
    whole, _ = extend(str(tiny_folder), tmp_path / "a", steps=4, **kw)
    extend(str(tiny_folder), tmp_path / "b", steps=2, **kw)
    resumed, _ = extend(str(tiny_folder), tmp_path / "b", steps=4, resume=True, **kw)
    ids = _ids(64)
    assert (whole.logits(ids) - resumed.logits(ids)).abs().max().item() < 1e-6
    with pytest.raises(ValueError, match="already holds a run"):
        extend(str(tiny_folder), tmp_path / "b", steps=4, **kw)


def test_lora_starts_at_the_model_trains_only_adapters_and_merges_exactly(tiny_folder):
    from attnlab.train.lora import LoRALinear, add_lora, merge_lora
    lm = attnlab.load(tiny_folder)
    ids = _ids(32)
    before = lm.logits(ids)
    model = add_lora(lm.model, rank=2)
    assert torch.equal(lm.logits(ids), before)  # B = 0: the adapted network is the pretrained one
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".A", ".B")) for n in trainable)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.B.normal_(std=0.05)
    adapted = lm.logits(ids)
    base = model.layers[0].attn.wqkv.base.weight.clone()
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(lm.logits(ids), adapted, atol=1e-5, rtol=1e-5)
    assert torch.linalg.matrix_rank(model.layers[0].attn.wqkv.weight - base) == 2  # a rank-2 update


def test_extend_with_lora_trains_resumes_and_reloads(tiny_folder, tmp_path):
    kw = dict(factor=2, method="pi", context=64, text="shakespeare:hamlet", lr=1e-2, warmup=0, eval_batches=1, lora=2)
    whole, rows = extend(str(tiny_folder), tmp_path / "a", steps=4, **kw)
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]
    extend(str(tiny_folder), tmp_path / "b", steps=2, **kw)
    resumed, _ = extend(str(tiny_folder), tmp_path / "b", steps=4, resume=True, **kw)
    ids = _ids(64)
    assert (whole.logits(ids) - resumed.logits(ids)).abs().max().item() < 1e-6
    assert torch.equal(attnlab.load(tmp_path / "a").logits(ids), whole.logits(ids))
    ref = attnlab.load(tiny_folder, rope="linear:2").model
    delta = whole.model.layers[1].mlp.w2.weight - ref.layers[1].mlp.w2.weight
    assert torch.linalg.matrix_rank(delta) <= 2 and delta.abs().max() > 0  # only a low-rank update was learned
    assert torch.equal(whole.model.embed.weight, ref.embed.weight)  # everything else frozen
