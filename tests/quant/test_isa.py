"""Kernel variants per ISA and weights repacked into 16-row blocks.

Each variant runs in its own process (one extension per process, `ATTNLAB_ISA` forces it) and must
equal the reference arithmetic (int8-rounded activations times the weights, min terms included)
on ragged shapes. The floor (avx2) and the machine's best variant, the two an install builds, run by default;
the variants in between run in the slow suite where they were built (ATTNLAB_BUILD_ISA=all make kernels).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab.errors import AttnlabError
from attnlab.kernels import build, isa, ops, repack
from attnlab.quant import QuantLinear, QuantSpec, quantize_model
from attnlab.quant.formats import Packed
from tests.conftest import tiny_lm

ROOT = Path(__file__).resolve().parents[2]


def _variants():
    ok = isa.supported()
    fast = set(isa.to_build("auto"))
    return [pytest.param(v, marks=() if v in fast else (pytest.mark.slow,)) for v in ok]


@pytest.mark.parametrize("variant", _variants())
def test_every_variant_equals_the_reference_on_ragged_shapes(variant):
    if variant not in isa.to_build("auto") and variant not in build.built():
        pytest.skip(f"{variant} not built (ATTNLAB_BUILD_ISA=all make kernels)")
    env = {**os.environ, "ATTNLAB_ISA": variant, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("ATTNLAB_NO_KERNELS", None)
    got = subprocess.run([sys.executable, "-m", "tests.quant.isa_check", variant], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    assert f"ok {variant}" in got.stdout


def test_forcing_a_variant_the_cpu_lacks_is_a_one_line_error(monkeypatch):
    missing = [v for v in isa.LEVELS if v not in isa.supported()]
    monkeypatch.setenv("ATTNLAB_ISA", "sse2")
    with pytest.raises(AttnlabError, match="not one of"):
        isa.best()
    if missing:
        monkeypatch.setenv("ATTNLAB_ISA", missing[0])
        with pytest.raises(AttnlabError, match="lacks|does not grant"):
            isa.best()
    monkeypatch.delenv("ATTNLAB_ISA")
    assert isa.best() == (isa.supported() or [None])[-1]
    assert isa.cpu_model() in isa.describe()


def test_repack_round_trips_and_takes_rows():
    g = torch.Generator().manual_seed(0)
    N, K = 37, 128
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    s, m = torch.rand(N, K // 16, generator=g), torch.randn(N, K // 16, generator=g)
    qs = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    for half in (False, True):
        s_, m_ = (s.half().float(), m.half().float()) if half else (s, m)
        wp, fmt = repack.pack_q8(q, s_, 16, m_)
        assert fmt == (repack.HALF if half else 0) and wp.shape == (3, K // 16, 16 * 16 + 2 * (32 if half else 64))
        got = repack.unpack_q8(wp, N, K, 16, True, fmt)
        assert all(torch.equal(a, b) for a, b in zip(got, (q, s_, m_)))
        for sym, mn in ((False, m_[:, :2]), (True, -8 * s_[:, :2])):
            wp, fmt = repack.pack_q4(qs, s_[:, :2], mn, 64)
            assert fmt == (repack.HALF if half else 0) | (repack.SYM if sym else 0)
            assert wp.shape[2] == 2 * 256 + (1 if sym else 2) * (32 if half else 64)  # Q4_0: 18 bytes per 32
            got = repack.unpack_q4(wp, N, K, 64, fmt)
            assert all(torch.equal(a, b) for a, b in zip(got, (qs, s_[:, :2], mn)))


def test_layout_is_decided_by_every_value_of_the_layer():
    s = torch.rand(20, 2, generator=torch.Generator().manual_seed(0)).half().float()
    assert repack.q4_layout(s, -8 * s) == repack.HALF | repack.SYM and repack.q8_layout(s) == repack.HALF
    off = s.clone()
    off[19, 1] += 2 ** -20  # one value that float16 cannot hold: the whole layer stays float32
    assert repack.q8_layout(off) == 0 and repack.q4_layout(off, -8 * off) == repack.SYM
    assert repack.q4_layout(s, -8 * off) == 0  # one min not -8 * scale: mins are stored
    assert repack.q8_layout(s, torch.full_like(s, 1e5)) == 0  # beyond float16's range
    qs = torch.zeros(20, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not float16"):
        repack.pack_q4(qs, off, -8 * off, 32, repack.HALF)
    with pytest.raises(ValueError, match="-8"):
        repack.pack_q4(qs, s, -8 * off, 32, repack.SYM)


def _layers(model):
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def _load(source: str, tie: bool, tmp_path):
    """A tiny network: int4:32 by our quantizer, or a GGUF file's Q4_0 / Q4_1 blocks in their own format."""
    if source == "int4:32":
        lm = tiny_lm(tie_embeddings=tie)  # head: 97 rows, not a multiple of 16
        quantize_model(lm.model, "int4:32")
        return lm, 97
    from attnlab.engine import LM
    from tests.model_files import tiny_tensors, write_gguf
    path = tmp_path / f"{source}.gguf"
    if not path.exists():
        write_gguf(path, tiny_tensors(tied=tie, vocab=41, dim=64, hidden=96), qtype=source,
                   meta={"embedding_length": 64, "feed_forward_length": 96})
    return LM.load(path, tokenizer=False), 41


# int4:32 of our quantizer: float32 scales and mins; Q4_0: float16 scales, min -8 * scale; Q4_1: float16 both
LAYOUTS = {"int4:32": 0, "Q4_0": repack.HALF | repack.SYM, "Q4_1": repack.HALF}


@pytest.mark.parametrize("source,tie", [("int4:32", False), ("int4:32", True), ("Q4_0", False), ("Q4_1", True)])
def test_repacked_weights_give_the_row_layout_logits(monkeypatch, tmp_path, source, tie):
    if not ops.load():
        pytest.skip("no C++ kernels on this machine")
    lms = {}
    for flag in "01":
        monkeypatch.setenv("ATTNLAB_REPACK", flag)
        lm, vocab = _load(source, tie, tmp_path)
        assert [m.repacked for m in _layers(lm.model)] == [flag == "1"] * len(_layers(lm.model))
        lms[flag] = lm
    assert {m.layout for m in _layers(lms["1"].model)} == {LAYOUTS[source]}
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(0))
    with ops.disabled():  # dequantised matrices: the row layout is rebuilt exactly
        assert torch.equal(lms["0"].logits(ids), lms["1"].logits(ids))
    for a, b in zip(_layers(lms["0"].model), _layers(lms["1"].model)):
        assert torch.equal(a.dequantize(), b.dequantize())
        assert a.state_dict().keys() == b.state_dict().keys()
        assert all(torch.equal(t, b.state_dict()[k]) for k, t in a.state_dict().items())
        floats = 1 if b.kind == "int8" or b.layout & repack.SYM else 2  # bytes per 32 weights: Q4_0's 18, Q4_1's 20
        per32 = (16 if b.kind == "int4" else 32) + floats * (2 if b.layout & repack.HALF else 4)
        assert b.nbytes == b.out_features * b.in_features * per32 // 32
        assert (b.nbytes == a.nbytes) == (b.layout == 0) and b.nbytes <= a.nbytes  # a: the row layout, float32
    if tie:  # a tied head's lookup from the repacked blocks
        assert torch.equal(lms["0"].model.embed(ids), lms["1"].model.embed(ids))
    # decode-sized inputs and a prefill (the fused kernels), each layer fed what it sees in the model: the same sums in
    # another order. (Whole-model logits are not compared: a 1e-6 difference that flips one activation's
    # int8 rounding moves this random tiny model's logits by ~0.1, as much as the rounding itself.)
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append((m, i[0], o))) for m in _layers(lms["0"].model)]
    lms["0"].logits(ids[:, :6])
    lms["0"].logits(ids)
    for h in hooks:
        h.remove()
    twin = dict(zip(_layers(lms["0"].model), _layers(lms["1"].model)))
    assert len(seen) == 2 * len(twin)
    for m, x, _ in seen:  # the row layout's kernel at any M (the layer itself dequantises from 9 rows on)
        name, args = m.kernel()
        y = getattr(torch.ops.attnlab, name)(x.reshape(-1, m.in_features).contiguous(), *args)
        torch.testing.assert_close(twin[m](x).reshape(y.shape), y, atol=1e-5 * y.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("group,has_min", [(16, False), (32, True), (16, True)])
def test_int8_with_min_and_group_16(group, has_min):
    """GGUF K-quants' shapes (Q6_K: int8 group 16; Q5_K: int8 group 32 with a min): w = q * s (+ m)."""
    g = torch.Generator().manual_seed(1)
    N, K = 45, 192
    q = torch.randint(-32, 32, (N, K), dtype=torch.int8, generator=g)
    s = torch.rand(N, K // group, generator=g) * 0.02
    m = -torch.rand(N, K // group, generator=g) * 0.1 if has_min else None
    layer = QuantLinear(Packed("int8", (N, K), group, 8, q=q, scale=s, min=m))
    w = (q.float().view(N, -1, group) * s[..., None] + (0 if m is None else m[..., None])).view(N, K)
    torch.testing.assert_close(layer.dequantize(), w)
    x = torch.randn(20, K, generator=g)
    with ops.disabled():  # the fallback: the dequantised matrix
        torch.testing.assert_close(layer(x), x @ w.T, atol=1e-5, rtol=1e-5)
    if not ops.load():
        return
    assert layer.repacked and layer.kernel()[0] == "q8x_mm"
    from attnlab.kernels.reference import round_activations
    torch.testing.assert_close(layer(x), round_activations(x) @ w.T, atol=1e-4, rtol=1e-4)
    saved = layer.state_dict()
    assert torch.equal(saved["q"], q) and torch.equal(saved["scale"], s)
    assert (m is None) == ("min" not in saved)


def test_repacked_kernels_split_rows_across_threads_without_changing_the_sums():
    """Threads own whole 16-row blocks: any thread count gives the same bits. 1100 rows: at 2 threads each share
    is 34-35 blocks, read as four streams (`kTeamStreams`) and a ragged tail. 97 activation rows: a prompt's rows
    are rounded to int8 by both threads (tiles for 96 of them with AMX, the vector path for the last)."""
    if not ops.load():
        pytest.skip("no C++ kernels on this machine")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1100, 576, generator=g)
    layers = [QuantLinear(QuantSpec.parse(s).quantize(w)) for s in ("int4:32", "int8:32")]
    layers.append(QuantLinear(Packed("int8", (1100, 576), 16, 8, q=torch.randint(-32, 32, (1100, 576), dtype=torch.int8,
                                                                              generator=g),
                                     scale=torch.rand(1100, 36, generator=g), min=torch.randn(1100, 36, generator=g))))
    xs = [torch.randn(3, 576, generator=g), torch.randn(97, 576, generator=g)]
    before = torch.get_num_threads()
    try:
        ys = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            ys.append([getattr(torch.ops.attnlab, n)(x, *a) for n, a in (m.kernel() for m in layers) for x in xs])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*ys))


@pytest.mark.parametrize("fmt", ["int4", "int8:16+min"])
def test_embedding_rows_of_a_head_in_any_layout(fmt):
    """A tied head's lookup (`embed_rows`) reads the rows asked for, whichever layout holds the weight."""
    g = torch.Generator().manual_seed(1)
    N, K = 37, 64
    if fmt == "int4":
        qs = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
        p = Packed("int4", (N, K), 32, 4, qs=qs, scale=torch.rand(N, 2, generator=g), min=torch.randn(N, 2, generator=g))
    else:
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
        p = Packed("int8", (N, K), 16, 8, q=q, scale=torch.rand(N, 4, generator=g), min=torch.randn(N, 4, generator=g))
    layer = QuantLinear(p)
    ids = torch.tensor([[0, 36], [17, 16]])
    assert torch.equal(layer.embed_rows(ids), p.dequantize()[ids])
