"""A GGUF load holds one matrix's row layout at a time, never the model's (the peak-RSS goal of issue 28)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.model_files import TINY, tiny_tensors, write_gguf

LAYERS = 4


@pytest.fixture(scope="module", params=["tied", "untied"])
def q4_file(tmp_path_factory, request):
    tensors = tiny_tensors(layers=LAYERS, tied=request.param == "tied")
    return write_gguf(tmp_path_factory.mktemp("load") / "m.gguf", tensors, {"block_count": LAYERS}, qtype="Q4_1")


def test_row_layouts_alive_while_building(q4_file, monkeypatch):
    """Every Packed the reader or the row concatenation makes is tracked; when each QuantLinear is built,
    at most the one it is built from is still alive (the model's earlier matrices were dropped)."""
    from attnlab.model import loaders
    from attnlab.quant import formats

    made, alive_at_build = [], []

    def tracked(fn):
        def run(*args, **kwargs):
            out = fn(*args, **kwargs)
            made.append(weakref.ref(out))
            return out
        return run

    def quant_linear(p, bias):
        gc.collect()
        alive_at_build.append(sum(r() is not None for r in made))
        return real(p, bias)

    real = loaders._quant_linear
    monkeypatch.setattr(formats, "from_gguf", tracked(formats.from_gguf))
    monkeypatch.setattr(formats, "cat_rows", tracked(formats.cat_rows))
    monkeypatch.setattr(loaders, "_quant_linear", quant_linear)
    model, cfg, _ = loaders.load_model(q4_file)
    assert model.quant == "int4:32" and cfg.n_layers == LAYERS
    assert len(alive_at_build) == 4 * LAYERS + 1  # four matrices per layer and the head
    assert max(alive_at_build) == 1, alive_at_build
    heads = 1 if cfg.tie_embeddings else 2  # the embedding (and the head)
    assert len(made) == 7 * LAYERS + heads + 2 * LAYERS  # q k v o gate up down per layer, 2 concatenations
    gc.collect()
    assert sum(r() is not None for r in made) == 0  # the network keeps only its own layout


def test_same_network_as_the_expanded_load(q4_file):
    """The per-matrix build gives the network the old whole-model build gave: the file's formats kept
    (int4:32 blocks), and under --dtype float32 the same values expanded."""
    from attnlab.model.loaders import load_model
    native, _, _ = load_model(q4_file)
    expanded, _, _ = load_model(q4_file, dtype=torch.float32)
    for name, layer in native.named_modules():
        if hasattr(layer, "dequantize") and name != "embed":
            torch.testing.assert_close(layer.dequantize(), expanded.get_submodule(name).weight, rtol=0, atol=0)
    ids = torch.arange(TINY["vocab"])[None, :16]
    with torch.inference_mode():
        assert torch.isfinite(native(ids)).all()


def test_ggml_type_table_matches_the_gguf_package():
    """The header scan's own table of ggml types (no gguf import on the load path) is the gguf package's."""
    import gguf

    from attnlab.model.gguf_header import GGML_TYPES, ggml_type
    for type_id, (name, block, size) in GGML_TYPES.items():
        kind = gguf.GGMLQuantizationType(type_id)
        assert (kind.name, *gguf.GGML_QUANT_SIZES[kind]) == (name, block, size)
    iq4 = gguf.GGMLQuantizationType.IQ4_NL  # not in the table: asked of the package
    assert ggml_type(int(iq4)) == ("IQ4_NL", *gguf.GGML_QUANT_SIZES[iq4])
