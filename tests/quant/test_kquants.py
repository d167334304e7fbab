"""GGUF K-quant and 5-bit blocks kept on the file's own grid: dequantisation equals the `gguf` package's,
mixed formats concatenate exactly, and a mixed-format file (a Q4_K_M-like mix) runs in its own formats."""
import contextlib
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

from attnlab.engine import LM
from attnlab.kernels import ops
from attnlab.model.loaders import build, read_gguf
from attnlab.quant import QuantLinear
from attnlab.quant.kinds import kind as format_entry
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
@pytest.mark.parametrize("native", [True, False])
def test_dequantisation_equals_the_gguf_package(kind, seed, native):
    """Both decoders (the C++ one of Q4_K and Q6_K used at load, and the torch forms) give the file's values and
    the same fields, K-quant factors included."""
    if native and not ops.load():
        pytest.skip("no C++ kernels")
    rng = np.random.default_rng(seed)
    rows, cols = 3 + seed, 256 * (1 + seed)
    raw = random_blocks(kind, rows, cols, rng, spread=[0.02, 1.0, 300.0][seed])
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(rows, cols)
    with contextlib.nullcontext() if native else ops.disabled():
        p = from_gguf(raw, kind, (rows, cols))
    assert p.shape == (rows, cols) and p.scale.dtype == torch.float32
    assert np.array_equal(p.dequantize().numpy(), ref)  # bit for bit: the file's grid, nothing requantised
    if native:
        with ops.disabled():
            slow = from_gguf(raw, kind, (rows, cols))
        for name, t in slow.tensors().items():
            assert torch.equal(p.tensors()[name], t), name
        for name in ("sc", "d", "m", "dmin"):
            a, b = (getattr(k, name, None) if k is not None else None for k in (p.kscale, slow.kscale))
            assert (a is None and b is None) or torch.equal(a, b), name


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
    from attnlab.kernels import repack
    if ops.load():  # the K-quants alone in a layer keep the file's factors: Q6_K's w2 and head, Q4_K's w2
        assert m.layers[0].mlp.w2.layout == m.lm_head.layout == repack.KQ
        assert not m.layers[1].mlp.w2.repacked or m.layers[1].mlp.w2.layout == repack.KQ
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


# ---------------------------------------------------------------- K-quant superblocks (repack.KQ)

def test_k_factors_follow_row_operations():
    """from_gguf keeps Q4_K's / Q6_K's factors; row permutations carry them, concatenation keeps them only
    where every part has them in one format, and promotion drops them (the products stay exact)."""
    rng = np.random.default_rng(3)
    q4k, q6k = (from_gguf(random_blocks(k, 32, 512, rng), k, (32, 512)) for k in ("Q4_K", "Q6_K"))
    for p, rep in ((q4k, 8), (q6k, 16)):
        ks = p.kscale
        assert ks.d.dtype == torch.float16 and ks.d.shape == (32, 2) and ks.sc.shape == (32, 512 // (256 // rep))
        assert torch.equal(ks.d.float().repeat_interleave(rep, 1) * ks.sc.float(), p.scale)
    assert q4k.kscale.sc.dtype == torch.uint8 and int(q4k.kscale.sc.max()) <= 63 and int(q4k.kscale.m.max()) <= 63
    assert torch.equal(-(q4k.kscale.dmin.float().repeat_interleave(8, 1) * q4k.kscale.m.float()), q4k.min)
    assert q6k.kscale.sc.dtype == torch.int8 and q6k.kscale.m is None
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    moved = q4k.map_rows(lambda t: t[perm])
    assert torch.equal(moved.kscale.sc, q4k.kscale.sc[perm]) and torch.equal(moved.kscale.dmin, q4k.kscale.dmin[perm])
    both = cat_rows([q4k, moved])
    assert both.kscale is not None and torch.equal(both.kscale.m, torch.cat([q4k.kscale.m, moved.kscale.m]))
    q41 = from_gguf(random_blocks("Q4_1", 32, 512, rng), "Q4_1", (32, 512))
    assert cat_rows([q4k, q41]).kscale is None and cat_rows([q4k, q6k]).kscale is None
    assert promote(q4k, "int4", 32, True) is q4k and promote(q4k, "int8", 32, True).kscale is None


@pytest.mark.parametrize("N,K", [(37, 256), (16, 512), (5, 768), (50, 1024)])
def test_q4_k_superblocks_give_the_float32_layouts_bits(N, K):
    """Q4_K in its superblocks (KQ: 4.625 bits per weight) equals, bit for bit, the int4:32 float32 layout
    of the same weights: the same float32 scales made in-register, the same sums in the same order."""
    from attnlab.kernels import repack
    rng = np.random.default_rng(N)
    p = from_gguf(random_blocks("Q4_K", N, K, rng), "Q4_K", (N, K))
    if ops.load():  # the C++ repacking is byte for byte the torch reference
        assert torch.equal(repack.pack_q4(p.qs, p.scale, p.min, 32, kscale=p.kscale)[0],
                           repack.pack_q4(p.qs, p.scale, p.min, 32, kscale=p.kscale, reference=True)[0])
    wp, fmt = repack.pack_q4(p.qs, p.scale, p.min, 32, kscale=p.kscale, reference=True)
    assert fmt == repack.KQ and wp.shape == (-(-N // 16), K // 256, 2368)
    assert all(torch.equal(a, b) for a, b in zip(repack.unpack_q4(wp, N, K, 32, fmt), (p.qs, p.scale, p.min)))
    ks = format_entry("int4").kscales(wp, N, K)
    assert all(torch.equal(getattr(ks, n), getattr(p.kscale, n)) for n in ("sc", "d", "m", "dmin"))
    with pytest.raises(ValueError, match="products"):  # factors that do not make these scales are refused
        repack.pack_q4(p.qs, p.scale * 1.5, p.min, 32, kscale=p.kscale)
    if not ops.load():
        return
    flat, _ = repack.pack_q4(p.qs, p.scale, p.min, 32, fmt=0)
    g = torch.Generator().manual_seed(K)
    for M in (1, 3, 9):
        x = torch.randn(M, K, generator=g)
        assert torch.equal(torch.ops.attnlab.q4x_mm(x, wp, N, 32, fmt), torch.ops.attnlab.q4x_mm(x, flat, N, 32, 0))


def test_q4_k_layer_holds_superblocks_and_gives_back_its_rows():
    """A Q4_K QuantLinear (where layers repack) keeps the factors: 148 bytes per 256 weights (the file's 144
    plus the 6-bit scales as bytes), its row layout and factors rebuilt exactly, embed_rows = dequantize()."""
    from attnlab.kernels import repack
    N, K = 75, 512
    p = from_gguf(random_blocks("Q4_K", N, K, np.random.default_rng(5)), "Q4_K", (N, K))
    layer = QuantLinear(p)
    ids = torch.tensor([[74, 0, 16, 16], [31, 15, 64, 3]])
    assert torch.equal(layer.embed_rows(ids), p.dequantize()[ids])
    if not layer.repacked:
        pytest.skip("this machine keeps the row layout")
    assert layer.layout == repack.KQ and "Q4_K superblocks" in repr(layer)
    assert layer.nbytes == N * K * 148 // 256 and layer.nbytes * 6 < p.nbytes * 5  # was 24 bytes per 32 weights
    back = layer.packed
    assert torch.equal(back.qs, p.qs) and torch.equal(back.scale, p.scale) and torch.equal(back.min, p.min)
    assert torch.equal(back.kscale.sc, p.kscale.sc) and torch.equal(back.kscale.dmin, p.kscale.dmin)
    assert set(layer.state_dict()) == {"qs", "scale", "min"}  # checkpoints hold the products
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(0))
    flat = QuantLinear(replace(p, kscale=None))
    assert flat.layout == 0 and torch.equal(layer(x), flat(x))
    op, args = layer.kernel(rows=(16, 48))
    assert torch.equal(getattr(torch.ops.attnlab, op)(x, *args), layer(x)[:, 16:48])


@pytest.mark.parametrize("N,K", [(37, 256), (16, 512), (5, 768), (50, 1024)])
def test_q6_k_superblocks_give_the_int8_layouts_bits(N, K):
    """Q6_K in its superblocks (KQ: the file's 6.5625 bits per weight) equals, bit for bit, the int8:16
    float32 layout of the same weights (exact integer sums, the same float32 scales), and its rows are
    dequantize()'s."""
    from attnlab.kernels import repack
    rng = np.random.default_rng(N)
    p = from_gguf(random_blocks("Q6_K", N, K, rng), "Q6_K", (N, K))
    if ops.load():
        assert torch.equal(repack.pack_q8(p.q, p.scale, 16, kscale=p.kscale)[0],
                           repack.pack_q8(p.q, p.scale, 16, kscale=p.kscale, reference=True)[0])
    wp, fmt = repack.pack_q8(p.q, p.scale, 16, kscale=p.kscale, reference=True)
    assert fmt == repack.KQ and wp.shape == (-(-N // 16), K // 256, 3360)
    q, scale, mn = repack.unpack_q8(wp, N, K, 16, False, fmt)
    assert torch.equal(q, p.q) and torch.equal(scale, p.scale) and mn is None
    ks = format_entry("int8").kscales(wp, N, K)
    assert torch.equal(ks.sc, p.kscale.sc) and torch.equal(ks.d, p.kscale.d)
    c = p.q[0, :32].to(torch.int16) + 32  # the high bits' byte layout, spelled out for row 0, pair 1, byte 2
    assert wp[0, 0, 256 + 64 + 2].item() == sum(int(c[i] >> 4) << s for i, s in ((10, 0), (26, 2), (14, 4), (30, 6)))
    with pytest.raises(ValueError, match="Q6_K"):  # codes outside -32..31 do not fit 6 bits
        repack.pack_q8(p.q * 2, p.scale, 16, fmt=repack.KQ, kscale=p.kscale)
    if not ops.load():
        return
    flat, _ = repack.pack_q8(p.q, p.scale, 16, fmt=0)
    g = torch.Generator().manual_seed(K)
    for M in (1, 3, 9):
        x = torch.randn(M, K, generator=g)
        assert torch.equal(torch.ops.attnlab.q8x_mm(x, wp, N, 16, False, fmt),
                           torch.ops.attnlab.q8x_mm(x, flat, N, 16, False, 0))
    ids = torch.tensor([N - 1, 0, N // 2, N - 1])
    assert torch.equal(torch.ops.attnlab.q8x_rows(wp, ids, K, 16, False, fmt), p.dequantize()[ids])


def test_q6_k_head_holds_superblocks_and_embeds():
    """A tied Q6_K head (a Q4_K_M file's token_embd): 210 bytes per 256 weights held (was 320), the same
    logits as the int8:16 layout, its embedding rows dequantize()'s bit for bit (in C++ and without)."""
    from attnlab.kernels import repack
    N, K = 75, 512
    p = from_gguf(random_blocks("Q6_K", N, K, np.random.default_rng(6)), "Q6_K", (N, K))
    layer = QuantLinear(p)
    ids = torch.tensor([[74, 0, 16, 16], [31, 15, 64, 3]])
    assert torch.equal(layer.embed_rows(ids), p.dequantize()[ids])
    with ops.disabled():
        assert torch.equal(layer.embed_rows(ids), p.dequantize()[ids])
    if not layer.repacked:
        pytest.skip("no C++ kernels on this machine")
    assert layer.layout == repack.KQ and "Q6_K superblocks" in repr(layer)
    assert layer.nbytes == N * K * 210 // 256
    back = layer.packed
    assert torch.equal(back.q, p.q) and torch.equal(back.scale, p.scale) and torch.equal(back.kscale.sc, p.kscale.sc)
    assert set(layer.state_dict()) == {"q", "scale"}
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(0))
    flat = QuantLinear(replace(p, kscale=None))
    assert flat.layout == 0 and torch.equal(layer(x), flat(x))
    op, args = layer.kernel(rows=(16, 48))
    assert torch.equal(getattr(torch.ops.attnlab, op)(x, *args), layer(x)[:, 16:48])
    with pytest.raises(RuntimeError, match="outside"):
        layer.embed_rows(torch.tensor([80]))


@pytest.mark.parametrize("threads", [1, 2])
def test_native_step_runs_the_superblocks(mixed_file, threads):
    """The native decode step, its threads cutting every layer (Q4_K / Q6_K superblocks included) in
    16-row slices, gives eager's logits on the K-quant mix."""
    if not ops.load():
        pytest.skip("no C++ kernels on this machine")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        eager, fast = LM.load(mixed_file, tokenizer=False), LM.load(mixed_file, tokenizer=False)
        fast.compile_decode()
        ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
        got = []
        for lm in (eager, fast):
            cache = lm.new_cache(capacity=32)
            lm.prefill(ids[:, :4], cache)
            got.append(torch.cat([lm.forward(ids[:, t:t + 1], cache) for t in range(4, 16)], 1))
    finally:
        torch.set_num_threads(before)
    assert fast.compiled.calls == {"native": 12, "eager": 0}
    assert ((got[1] - got[0]).norm() / got[0].norm()) < 1e-4


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
            fast.threads = n  # the engine's own count, which its native step is built with
            fast.compile_decode()
            _close(_decode(fast, ids), ref, "int4:32")
            assert fast.compiled.threads == n and fast.compiled.calls == {"native": 16, "eager": 0}
    finally:
        torch.set_num_threads(before)
