"""Quantized networks: GGUF blocks loaded directly, saved checkpoints, the compiled decode step."""
import gguf
import pytest
import torch
import transformers

from attnlab.engine import LM
from attnlab.kv import make_policy
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


@pytest.mark.parametrize("spec,kv", [(None, None), ("kmeans-naive:4", None), ("int4:32", None), (None, torch.int8)])
def test_compiled_decode_step_equals_eager(spec, kv):
    """The compiled single-token step against eager, with a block-evicting sink cache in `cache`
    positions (keys re-rotated on eviction), through enough steps to evict several times.

    Float paths agree to rounding. The fused int4 path rounds activations to int8 and an int8 cache
    rounds keys and values, a step function: the 1e-7 differences of compiled elementwise code flip
    an occasional code, which this deliberately sharp random model amplifies; there the check is
    closeness, not equality."""
    torch._dynamo.reset()
    shape = dict(dim=64, hidden_dim=128, head_dim=32 if kv == torch.int8 else 0)
    eager, fast = tiny_lm(**shape), tiny_lm(**shape)
    for lm in (eager, fast):
        lm.kv_dtype = kv
        if spec:
            quantize_model(lm.model, spec)
    fast.compile_decode(fullgraph=True)  # a graph break would raise here
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    outs = []
    for lm in (eager, fast):
        policy = make_policy("sink", 12, positions="cache", n_sink=2, chunk=8, block=4)
        cache = lm.new_cache(policy=policy)
        lm.prefill(ids[:, :8], cache)
        outs.append(torch.cat([lm.forward(ids[:, t:t + 1], cache) for t in range(8, 40)], 1))
        assert len(cache) <= 12 + 3
    assert fast.compiled.calls["direct"] >= 24  # past the first steps, dynamo's guards are skipped
    if spec != "int4:32" and kv is None:
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-5)
    else:
        assert (outs[1] - outs[0]).norm() / outs[0].norm() < 0.05
        assert (outs[1].argmax(-1) == outs[0].argmax(-1)).float().mean() >= 0.9


def test_compiled_step_skips_dynamo_only_where_it_recorded_the_inputs():
    """The guard-free path must follow every change dynamo would have caught: a new (grown) cache,
    a fresh conversation, the last-only head, and a module swapped after compiling (3-bit codebooks
    where 4-bit ones were: same paths, tensors of other shapes), each time with the eager logits."""
    torch._dynamo.reset()
    eager, fast = tiny_lm(dim=64, hidden_dim=128), tiny_lm(dim=64, hidden_dim=128)
    for lm in (eager, fast):
        quantize_model(lm.model, "kmeans-naive:4")  # a float path: compiled and eager agree to rounding
    fast.compile_decode()
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(1))

    def decode(lm, cache, a, b, last_only=False):
        return torch.cat([lm.forward(ids[:, t:t + 1], cache, last_only=last_only) for t in range(a, b)], 1)

    caches = {}
    for lm in (eager, fast):
        caches[lm] = lm.new_cache(capacity=8)  # grows to 16 and 32 on the way
        lm.prefill(ids[:, :4], caches[lm])
    calls = fast.compiled.calls
    torch.testing.assert_close(decode(fast, caches[fast], 4, 20), decode(eager, caches[eager], 4, 20),
                               atol=2e-5, rtol=1e-5)
    assert calls["direct"] >= 8 and calls["dynamo"] >= 3  # first steps, then one per capacity
    assert calls["compiles"] == 2  # the slot is a size from the first step; the capacity once the cache grows
    for lm in (eager, fast):  # a new conversation, read through the last-only head
        caches[lm] = lm.new_cache(capacity=64)
        lm.prefill(ids[:, :4], caches[lm])
    before = dict(calls)
    torch.testing.assert_close(decode(fast, caches[fast], 4, 12, True), decode(eager, caches[eager], 4, 12, True),
                               atol=2e-5, rtol=1e-5)
    assert calls["dynamo"] > before["dynamo"] and calls["direct"] > before["direct"]
    donor = tiny_lm(dim=64, hidden_dim=128)
    quantize_model(donor.model, "kmeans-naive:3")
    for lm in (eager, fast):
        lm.model.layers[1].mlp.w13 = donor.model.layers[1].mlp.w13
    before = dict(calls)
    torch.testing.assert_close(decode(fast, caches[fast], 12, 20, True), decode(eager, caches[eager], 12, 20, True),
                               atol=2e-5, rtol=1e-5)
    assert calls["dynamo"] > before["dynamo"]


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
