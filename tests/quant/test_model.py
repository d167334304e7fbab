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


# ---------------------------------------------------------------- layers whose parts keep their own formats

def mixed_qkv(lm, promoted: bool = False):
    """lm quantized int4:32, then every wqkv as a Q4_K_M file's use_more_bits layers hold it: q and k in
    int4:32 beside a v in int8 groups of 16 (Q6_K's format, requantised from its int4 values). Each part
    in its own format, or (promoted) the whole matrix in the one format all fit (int8:16+min)."""
    import dataclasses

    from attnlab.quant.formats import cat_rows, quantize_int8
    cfg = lm.model.cfg
    quantize_model(lm.model, "int4:32")
    n = (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim
    for b in lm.model.layers:
        p = b.attn.wqkv.packed
        qk = dataclasses.replace(p.map_rows(lambda t: t[:n]), shape=(n, cfg.dim))
        v = quantize_int8(p.dequantize()[n:], 16)
        b.attn.wqkv = QuantLinear(cat_rows([qk, v]) if promoted else [qk, v], b.attn.wqkv.bias)
    return lm


def _blocks():
    from attnlab.quant.formats import quantize_int4, quantize_int8
    g = torch.Generator().manual_seed(0)
    return [quantize_int4(torch.randn(64, 128, generator=g)), quantize_int4(torch.randn(32, 128, generator=g)),
            quantize_int8(torch.randn(32, 128, generator=g), 16)]


def test_a_layer_of_parts_equals_its_promoted_form_and_is_smaller():
    """q, k int4:32 and v int8:16: q and k are concatenated, v stays its own part; every view of the layer
    (dequantize, packed, state dict, rows) is the promoted matrix's, the product equals it to float rounding
    of the row sums (measured <= 3e-7 of the largest output; the dequantised fallback: bit for bit)."""
    from attnlab.kernels import ops
    from attnlab.quant import Packed
    from attnlab.quant.formats import cat_rows
    blocks = _blocks()
    parts, promoted = QuantLinear(blocks), QuantLinear(cat_rows(blocks))
    assert [p.packed.format for p in parts.parts] == ["int4:32", "int8:16"] and promoted.parts is None
    assert parts.spans == [(0, 96, parts.parts[0].row_align), (96, 128, parts.parts[1].row_align)]
    assert (parts.kind, parts.group, parts.has_min, parts.packed.format) == ("int8", 16, True, "int8:16+min")
    assert parts.nbytes < 0.7 * promoted.nbytes  # measured 14336 against 24576 bytes
    assert torch.equal(parts.dequantize(), promoted.dequantize())
    state, want = parts.state_dict(), promoted.state_dict()
    assert list(state) == list(want) == ["q", "scale", "min"] and all(torch.equal(state[k], want[k]) for k in want)
    back = QuantLinear(Packed("int8", (128, 128), 16, 8, **state))
    g = torch.Generator().manual_seed(1)
    for m in (1, 3, 20) if parts.parts[0].repacked else (1, 3):  # from 8 rows a row layout part dequantises
        x = torch.randn(m, 128, generator=g)
        ref = promoted(x)
        assert ((parts(x) - ref).abs().max() <= 1e-6 * ref.abs().max()) and torch.equal(back(x), ref)
        with ops.disabled():
            assert torch.equal(parts(x), promoted(x))
    ids = torch.tensor([[0, 95, 96, 127, 3]])
    assert torch.equal(parts.embed_rows(ids), parts.dequantize()[ids])
    assert all(torch.equal(a, b) for a, b in zip(parts.row_operands(), promoted.row_operands()) if torch.is_tensor(a))
    with pytest.raises(ValueError, match="one part"):
        parts.kernel((80, 112))  # rows of two parts: no single kernel call
    assert QuantLinear(blocks[:2]).parts is None  # one format: one matrix, as cat_rows makes it


def test_a_network_of_mixed_layers_runs_saves_and_reloads(tmp_path):
    """Logits of the parts against the promoted network; saved in the promoted form, it reloads to exactly
    the promoted network."""
    parts, promoted = mixed_qkv(tiny_lm(dim=64, hidden_dim=128)), mixed_qkv(tiny_lm(dim=64, hidden_dim=128), True)
    assert parts.model.layers[0].attn.wqkv.parts is not None
    assert model_bytes(parts.model) < model_bytes(promoted.model)  # measured 91520 against 101760 bytes
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = promoted.logits(ids)
    got = parts.logits(ids)
    assert (got - ref).norm() / ref.norm() < 0.05 and (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    back = LM.load(save_quantized(parts, tmp_path / "q"))
    assert back.model.layers[0].attn.wqkv.parts is None and torch.equal(back.logits(ids), ref)
