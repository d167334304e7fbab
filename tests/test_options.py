"""One options object: every bad value fails at construction (before a load), and the engine uses what it holds."""
import argparse

import pytest
import torch

from attnlab import AttnlabError, Options, PolicySpec
from attnlab.cli import build_parser
from attnlab.sparsity.plan import SparsitySpec
from tests.conftest import tiny_lm


@pytest.mark.parametrize("fields,expect", [
    ({"dtype": "float8"}, "unknown dtype"),
    ({"kv_dtype": "int3"}, "KV-cache dtype"),
    ({"threads": 0}, "threads"),
    ({"quant": "int5"}, "--quant"),
    ({"sparsity": "magic@x:0.5"}, "unknown method"),
    ({"rope": "yarn:-1"}, "factor"),
    ({"policy": "sink:2"}, "must exceed n_sink"),
    ({"policy": "nope:64"}, "unknown policy"),
])
def test_bad_options_fail_at_construction(fields, expect):
    with pytest.raises(AttnlabError, match=expect):
        Options(**fields)


def test_specs_are_parsed_once():
    o = Options(quant="int4", sparsity="oracle:0.3", policy="h2o:0.25")
    assert str(o.quant) == "int4:32" and o.sparsity == SparsitySpec("oracle", None, 0.3, 0.0)
    assert o.policy == PolicySpec("h2o", "0.25") and o.policy.fractional
    with pytest.raises(AttnlabError, match="in tokens"):
        o.new_policy()  # a fraction of an unknown stream length
    assert o.new_policy(length=400).tokens == 100
    args = argparse.Namespace(dtype="float32", threads=1, rope=None, policy="sink,h2o", budget="64", n_sink=4,
                              positions="cache", block=1)
    assert Options.from_args(args).policy is None  # a comma list (stream) builds its own policies per run


def test_cli_options_become_one_object():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--quant", "int8", "--policy", "sink",
                                      "--budget", "64", "--n-sink", "2", "--sparsity", "oracle:0.2"])
    o = Options.from_args(args)
    assert str(o.quant) == "int8" and o.policy == PolicySpec("sink", "64", 2) and o.sparsity.sparsity == 0.2
    assert o.new_policy().capacity == 64 + 512


@torch.inference_mode()
def test_generate_uses_the_options_policy():
    lm = tiny_lm()
    lm.options = Options(policy=PolicySpec("sink", 8, n_sink=2, chunk=4))
    seen = []
    real = lm.new_cache
    lm.new_cache = lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1]
    lm.tokenizer = type("T", (), {"encode": lambda self, t, add_special_tokens=True: [3, 4, 5, 6, 7, 8, 9, 10, 11],
                                  "decode": lambda self, ids, skip_special_tokens=True: " ".join(map(str, ids)),
                                  "eos_token_id": None})()
    lm.generate("anything", max_new_tokens=12)
    cache = seen[0]
    assert cache.policy is not None and cache.seen > 8 and len(cache) <= 8 + 4


def test_the_fast_path_is_the_default(tmp_path):
    """No flags: the native step and a float16 cache wherever they apply; compile=False and kv_dtype='float32'
    keep the eager reference; where the step cannot run, one warning says why and decoding stays eager."""
    from attnlab.engine import LM
    from attnlab.kernels import ops
    from attnlab.model.export import save_hf_folder
    folder = save_hf_folder(tiny_lm(dim=64, hidden_dim=128).model, tmp_path / "tiny")
    fast = LM.load(folder, tokenizer=False)
    assert fast.options.compile is None and fast.new_cache().layers[0].k.dtype == torch.float16
    assert (fast.compiled is not None) == ops.load()
    ref = LM.load(folder, tokenizer=False, compile=False, kv_dtype="float32")
    assert ref.compiled is None and ref.new_cache().layers[0].k.dtype == torch.float32
    with pytest.warns(UserWarning, match="native decode step cannot run .*bfloat16"):
        half = LM.load(folder, tokenizer=False, dtype="bfloat16")
    assert half.compiled is None and half.new_cache().layers[0].k.dtype == torch.bfloat16
    ids = torch.tensor([[5, 6, 7, 8]])
    a, b = fast.new_cache(), ref.new_cache()
    fast.prefill(ids, a), ref.prefill(ids, b)
    got, want = fast.forward(torch.tensor([[9]]), a), ref.forward(torch.tensor([[9]]), b)
    assert torch.allclose(got, want, atol=1e-2, rtol=1e-2)  # the float16 cache rounds K/V, nothing else differs
    args = build_parser().parse_args(["generate", "--prompt", "x", "--eager", "--kv-dtype", "float32"])
    assert Options.from_args(args).compile is False and Options.from_args(args).torch_kv_dtype == torch.float32
    assert Options.from_args(build_parser().parse_args(["generate", "--prompt", "x"])).compile is None
