"""Quantized networks: GGUF blocks loaded directly, saved checkpoints (the native decode step: tests/test_native_step.py)."""
import gguf
import pytest
import torch
import transformers

from attnlab.engine import LM
from attnlab.model.loaders import build, read_gguf
from attnlab.quant import QuantLinear, model_bytes, quantize_model
from attnlab.quant.store import save_quantized
from tests.conftest import tiny_lm
from tests.test_gguf_files import _write_gguf


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A tiny llama GGUF with every matrix in Q4_1, the type of SmolLM2's layers."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf"
    _write_gguf(model, "llama", gguf.GGMLQuantizationType.Q4_1, path)
    return path, model


def test_gguf_blocks_load_directly_equal_dequantise_then_requantise(gguf_file):
    path, _ = gguf_file
    direct = LM.load(path, quant="int4:32", tokenizer=False)
    cfg, tensors = read_gguf(path)  # every tensor dequantised to float
    model = build(cfg, tensors)
    quantize_model(model, "int4:32")
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(direct.logits(ids), LM(model).logits(ids), atol=1e-5, rtol=1e-5)
    layer = direct.model.layers[0].mlp.w13
    assert isinstance(layer, QuantLinear) and layer.kind == "int4" and layer.group == 32
    # Q4_1 on the same grid is lossless: the codes are the file's codes
    assert torch.equal(layer.dequantize(), model.layers[0].mlp.w13.dequantize())


@pytest.mark.parametrize("spec", ["int8", "int4:64", "kmeans:3"])
def test_saved_checkpoint_reloads_to_identical_logits(tmp_path, spec):
    lm = tiny_lm(dim=64, hidden_dim=128)
    quantize_model(lm.model, spec)
    out = save_quantized(lm, tmp_path / "q")
    back = LM.load(out)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(back.logits(ids), lm.logits(ids))
    assert back.quant == spec and model_bytes(back.model) == model_bytes(lm.model)
    with pytest.raises(ValueError, match="holds"):
        LM.load(out, quant="int8" if spec != "int8" else "int4")


def test_quantized_model_is_smaller_and_close(gguf_file):
    path, _ = gguf_file
    ref = LM.load(path, tokenizer=False, dtype="float32")
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    base = ref.logits(ids)
    for spec, tol in [("int8", 0.05), ("int4:32", 0.05)]:
        lm = LM.load(path, quant=spec, tokenizer=False)
        assert model_bytes(lm.model) < model_bytes(ref.model) / 2.5
        assert (lm.logits(ids) - base).abs().max() < tol * base.abs().max()


def test_smollm2_int4_loads_from_its_blocks_and_tracks_fp32(smollm2):
    """The embedded GGUF (Q4_1 layers, tied Q8_0 embedding): int4 group 32 takes the file's codes, the
    tied head becomes int8 and the embedding reads its rows; next-token choices barely move."""
    lm = LM.load("smollm2-135m", quant="int4:32", tokenizer=False)
    assert lm.model.lm_head.kind == "int8" and lm.model.lm_head.group == 32  # the Q8_0 blocks, copied
    assert type(lm.model.embed).__name__ == "QuantEmbedding"
    ids = torch.tensor([smollm2.encode("To be, or not to be, that is the question: whether 'tis nobler in the mind")])
    ref, got = smollm2.logits(ids), lm.logits(ids)
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean() >= 0.9
    assert model_bytes(lm.model) < 115e6 < 500e6 < model_bytes(smollm2.model)  # the GGUF file: 105 MB
