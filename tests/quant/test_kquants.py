"""GGUF K-quant and 5-bit blocks kept on the file's own grid: dequantisation equals the `gguf` package's,
mixed formats concatenate exactly, and a mixed-format file (a Q4_K_M-like mix) runs in its own formats."""
import gguf
import numpy as np
import pytest
import torch

from attnlab.engine import LM
from attnlab.kernels import ops
from attnlab.model.loaders import build, read_gguf
from attnlab.quant import QuantLinear
from attnlab.quant.formats import _BLOCK_BYTES, GGUF_PACKED, cat_rows, from_gguf, promote, quantize_int4, quantize_int8

# where each block type keeps its fp16 numbers (d, and dmin or m); the other bytes are codes and scales
_HALVES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2],
           "Q6_K": [208]}


def random_blocks(kind: str, rows: int, cols: int, rng, spread: float = 0.02) -> np.ndarray:
    """Valid random blocks of a GGUF type for a [rows, cols] matrix: any code and scale bytes, finite fp16s."""
    size, nbytes = _BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, size=(rows * cols // size, nbytes), dtype=np.uint8)
    for at in _HALVES[kind]:
        half = rng.normal(0, spread, size=raw.shape[0]).astype(np.float16)
        raw[:, at:at + 2] = half.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", GGUF_PACKED)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dequantisation_equals_the_gguf_package(kind, seed):
    rng = np.random.default_rng(seed)
    rows, cols = 3 + seed, 256 * (1 + seed)
    raw = random_blocks(kind, rows, cols, rng, spread=[0.02, 1.0, 300.0][seed])
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(rows, cols)
    p = from_gguf(raw, kind, (rows, cols))
    assert p.shape == (rows, cols) and p.scale.dtype == torch.float32
    assert np.array_equal(p.dequantize().numpy(), ref)  # bit for bit: the file's grid, nothing requantised


def test_formats_are_the_agreed_ones():
    rng = np.random.default_rng(0)
    got = {k: from_gguf(random_blocks(k, 2, 256, rng), k, (2, 256)).format for k in GGUF_PACKED}
    assert got == {"Q4_0": "int4:32", "Q4_1": "int4:32", "Q4_K": "int4:32", "Q8_0": "int8:32", "Q5_0": "int8:32",
                   "Q5_1": "int8:32+min", "Q5_K": "int8:32+min", "Q6_K": "int8:16"}


def test_mixed_rows_meet_in_the_smallest_exact_format():
    rng = np.random.default_rng(1)
    parts = [from_gguf(random_blocks(k, 4, 256, rng), k, (4, 256)) for k in ("Q4_K", "Q6_K", "Q5_K")]
    fused = cat_rows(parts)
    assert fused.format == "int8:16+min"
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert cat_rows(parts[:1] + [from_gguf(random_blocks("Q4_1", 4, 256, rng), "Q4_1", (4, 256))]).format == "int4:32"
    assert cat_rows([parts[0], from_gguf(random_blocks("Q8_0", 4, 256, rng), "Q8_0", (4, 256))]).format == "int8:32+min"
    with pytest.raises(ValueError, match="does not fit"):
        promote(parts[1], "int8", 32, False)  # groups of 16 do not fit groups of 32


def test_int8_with_min_kernel_path_matches_reference():
    rng = np.random.default_rng(2)
    for kind in ("Q5_K", "Q6_K", "Q5_1"):
        layer = QuantLinear(from_gguf(random_blocks(kind, 24, 512, rng), kind, (24, 512)))
        x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
        ref = x @ layer.dequantize().T
        with ops.disabled():
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.dequantize()))
        torch.testing.assert_close(layer(x), ref, atol=2e-2 * ref.abs().max().item(), rtol=0)  # int8 activations


# A two-layer llama whose matrices span every packed type, as a Q4_K_M file of a small model mixes them
# (q/k Q4_K with v Q6_K, Q5_0/Q8_0 fallbacks), written as raw blocks.
_MIX = [{"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
         "ffn_up": "Q5_K", "ffn_down": "Q6_K"},
        {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q5_K", "ffn_down": "Q4_K"}]
DIM, HIDDEN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 64


def write_mixed_gguf(path, embed: str = "Q6_K") -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(len(_MIX))
    w.add_context_length(128)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(HIDDEN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    kv = DIM // HEADS * KV_HEADS
    shapes = {"attn_q": (DIM, DIM), "attn_k": (kv, DIM), "attn_v": (kv, DIM), "attn_output": (DIM, DIM),
              "ffn_gate": (HIDDEN, DIM), "ffn_up": (HIDDEN, DIM), "ffn_down": (DIM, HIDDEN)}

    def add(name, kind, rows, cols):
        w.add_tensor(name, random_blocks(kind, rows, cols, rng, 0.003), raw_dtype=gguf.GGMLQuantizationType[kind])

    add("token_embd.weight", embed, VOCAB, DIM)  # tied: also the head
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32))
    for i, mix in enumerate(_MIX):
        for name, kind in mix.items():
            add(f"blk.{i}.{name}.weight", kind, *shapes[name])
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kq") / "tiny-mixed.gguf"
    write_mixed_gguf(path)
    return path


def test_mixed_file_runs_in_its_own_formats_with_the_gguf_packages_logits(mixed_file):
    lm = LM.load(mixed_file, tokenizer=False)  # --quant unset: the file's formats
    m = lm.model
    assert isinstance(m.layers[0].attn.wqkv, QuantLinear) and m.layers[0].attn.wqkv.packed.format == "int8:16+min"
    # ... as a view: each part keeps its own format (q, k Q4_K concatenated; v Q6_K; gate Q4_K, up Q5_K)
    assert [p.packed.format for p in m.layers[0].attn.wqkv.parts] == ["int4:32", "int8:16"]
    assert [p.packed.format for p in m.layers[0].mlp.w13.parts] == ["int4:32", "int8:32+min"]
    assert m.layers[0].attn.wo.parts is None and lm.quant == "gguf: int4:32, int8:16, int8:32, int8:32+min"
    assert m.layers[0].mlp.w13.packed.format == "int8:32+min" and m.layers[1].mlp.w13.packed.format == "int8:32+min"
    assert m.layers[1].attn.wqkv.packed.format == "int8:32+min" and m.layers[1].attn.wo.packed.format == "int4:32"
    assert m.lm_head.packed.format == "int8:16" and not any(p.dtype == torch.float32 and p.dim() == 2
                                                             for p in m.parameters())  # no float matrix
    cfg, tensors = read_gguf(mixed_file, packed_types=())  # every matrix dequantised by the gguf package
    ref = LM(build(cfg, tensors))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with ops.disabled():
        assert torch.equal(lm.logits(ids), ref.logits(ids))
    want = ref.logits(ids)
    torch.testing.assert_close(lm.logits(ids[:, :1]), want[:, :1], atol=0.05 * want.abs().max().item(), rtol=0)
    expanded = LM.load(mixed_file, tokenizer=False, dtype="float32")  # --dtype float32: full float weights
    assert expanded.quant is None and torch.equal(expanded.logits(ids), want)


def test_quant_option_still_requantises(mixed_file):
    lm = LM.load(mixed_file, tokenizer=False, quant="int4:32")
    assert lm.quant == "int4:32" and {lm.model.layers[i].mlp.w2.kind for i in range(2)} == {"int4"}


def test_packed_embedding_rows_equal_the_table():
    head = QuantLinear(quantize_int4(torch.randn(10, 64)))
    from attnlab.quant.linear import QuantEmbedding
    ids = torch.tensor([[3, 0, 9]])
    assert torch.equal(QuantEmbedding(head)(ids), head.dequantize()[ids])
    head8 = QuantLinear(quantize_int8(torch.randn(10, 64), 32))
    assert torch.equal(QuantEmbedding(head8)(ids), head8.dequantize()[ids])


def test_mixed_file_decodes_natively(mixed_file):
    """The native step runs the layers of parts (a segment per thread and part) and follows eager
    (measured 1e-7 relative at 1 and 2 threads)."""
    if not ops.load():
        pytest.skip("no C++ kernels on this machine")
    from tests.test_native_step import _close, _decode
    eager, fast = LM.load(mixed_file, tokenizer=False), LM.load(mixed_file, tokenizer=False)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = _decode(eager, ids)
    before = torch.get_num_threads()
    try:
        for n in (1, 2) if torch.classes.attnlab.DecodeStep.openmp() else (1,):
            torch.set_num_threads(n)
            fast.compile_decode()
            _close(_decode(fast, ids), ref, "int4:32")
            assert fast.compiled.threads == n and fast.compiled.calls == {"native": 16, "eager": 0}
    finally:
        torch.set_num_threads(before)
