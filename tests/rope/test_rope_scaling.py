"""RoPE scaling registry: inverse frequencies and attention factors equal transformers' rope-init
functions, and whole models with each rope_scaling type equal transformers' logits."""
from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import attnlab
from attnlab.rope import Rope, parse_rope, rope_parameters

HEAD_DIM, BASE, MAX_POS = 16, 5000.0, 64
HF_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAX_POS},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAX_POS,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def _hf_config(scaling: dict | None):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
                                   tie_word_embeddings=False, rope_theta=BASE)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": BASE, **(scaling or {})}
    return cfg


def _ours(scaling: dict) -> dict:
    s = dict(scaling)
    s.setdefault("original_max_position_embeddings", MAX_POS)  # what the loader fills in from config.json
    return s


@pytest.mark.parametrize("name", list(HF_SCALINGS))
@pytest.mark.parametrize("seq_len", [None, 200])
def test_frequencies_and_attention_factor_match_transformers(name, seq_len):
    scaling = HF_SCALINGS[name]
    hf_inv, hf_attn = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](_hf_config(scaling), "cpu", seq_len=seq_len)
    inv, attn = rope_parameters(HEAD_DIM, BASE, _ours(scaling), seq_len=seq_len)
    torch.testing.assert_close(inv.float(), hf_inv.float(), rtol=1e-6, atol=0)
    assert attn == pytest.approx(hf_attn, rel=1e-12)
    if name.startswith("yarn"):
        assert attn != 1.0  # the factor is really there, not a vacuous 1 == 1


def test_ntk_is_the_default_rope_at_the_larger_base():
    """NTK-aware scaling (no transformers init function of its own) = default RoPE, base * F^(d/(d-2))."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    inv, attn = rope_parameters(HEAD_DIM, BASE, {"rope_type": "ntk", "factor": 4.0})
    cfg = _hf_config(None)
    cfg.rope_parameters["rope_theta"] = BASE * 4.0 ** (HEAD_DIM / (HEAD_DIM - 2))
    ref = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)[0]
    torch.testing.assert_close(inv.float(), ref.float(), rtol=1e-6, atol=0)
    assert attn == 1.0 and inv[0] == 1.0 and inv[-1] < rope_parameters(HEAD_DIM, BASE)[0][-1]


@pytest.mark.parametrize("name", ["linear", "ntk", "dynamic", "yarn", "llama3"])
def test_factor_one_leaves_logits_unchanged(name, tiny):
    """(dynamic NTK at factor 1 still rescales past its original length, in transformers' formula
    too: base * (L / orig)^(d/(d-2)); so it is checked inside that length.)"""
    ids = torch.randint(0, tiny.cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    ref = tiny.logits(ids)
    tiny.model.rope = Rope(tiny.cfg.head_dim, tiny.cfg.rope_base, parse_rope(f"{name}:1", 128))
    T = 128 if name == "dynamic" else 300
    assert (tiny.logits(ids[:, :T]) - ref[:, :T]).abs().max().item() < 1e-5
    tiny.model.rope = Rope(tiny.cfg.head_dim, tiny.cfg.rope_base, parse_rope(f"{name}:4", 128))
    assert (tiny.logits(ids) - ref).abs().max().item() > 1e-2  # and a real factor changes them


def test_linear_equals_positions_divided(tiny):
    """linear:4 at positions 4p gives exactly the unscaled model at positions p."""
    ids = torch.randint(0, tiny.cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(64)[None]
    with torch.no_grad():
        ref = tiny.logits(ids, pos=pos)
        tiny.model.rope = Rope(tiny.cfg.head_dim, tiny.cfg.rope_base, parse_rope("linear:4", 128))
        out = tiny.logits(ids, pos=4 * pos)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", list(HF_SCALINGS))
def test_hf_checkpoint_with_rope_scaling_matches_transformers(name, tmp_path):
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(_hf_config(HF_SCALINGS[name])).eval()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    lm = attnlab.load(tmp_path)
    assert lm.cfg.rope_scaling["rope_type"] == HF_SCALINGS[name]["rope_type"]
    for T in (40, 200):  # inside and beyond max_position_embeddings (dynamic NTK rescales past 64)
        ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            expect = ref(ids).logits
        assert (lm.logits(ids) - expect).abs().max().item() < 1e-4


def test_yarn_attention_factor_scales_logits_and_cache_agrees(tiny):
    """YaRN's factor reaches the attention (q and k both scaled) and decoding with a cache,
    under both position conventions, equals the full forward."""
    lm = tiny
    ids = torch.randint(0, lm.cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(2))
    lm.model.rope = Rope(lm.cfg.head_dim, lm.cfg.rope_base, parse_rope("yarn:8", 16))
    assert lm.model.rope.attention_factor == pytest.approx(0.1 * math.log(8) + 1)
    full = lm.logits(ids)
    for positions in ("original", "cache"):
        cache = lm.new_cache(positions=positions)
        parts = [lm.prefill(ids[:, :40], cache, chunk=16, all_logits=True)]
        parts += [lm.forward(ids[:, t:t + 1], cache) for t in range(40, 48)]
        assert (torch.cat(parts, 1) - full).abs().max().item() < 1e-4


def test_rope_override_from_api_and_errors(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_hf_config(None)).save_pretrained(tmp_path, safe_serialization=True)
    lm = attnlab.load(tmp_path, rope="yarn:4")
    assert lm.cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAX_POS}
    assert lm.model.rope.attention_factor > 1
    assert attnlab.load(tmp_path, rope="none").cfg.rope_scaling is None
    for bad in ("warp:2", "yarn", "yarn:-1", "linear:x"):
        with pytest.raises(ValueError):
            attnlab.load(tmp_path, rope=bad)


def test_unsupported_scaling_in_config_raises(tmp_path):
    import json
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_hf_config(None)).save_pretrained(tmp_path, safe_serialization=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "longrope", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="longrope"):
        attnlab.load(tmp_path)


def test_tables_are_built_once_and_lazily():
    rope = Rope(HEAD_DIM, BASE)
    assert rope.cis.shape[0] == 0
    rope.tables(torch.arange(20000)[None])  # past any preset cap
    assert rope.cis.shape[0] == 20000


def test_cli_rope_option(tmp_path, capsys):
    from tests.test_cli import run
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_hf_config(None)).save_pretrained(tmp_path, safe_serialization=True)
    code, out, _ = run(capsys, "info", str(tmp_path), "--rope", "ntk:2")
    assert code == 0 and "'rope_type': 'ntk'" in out
    code, _, err = run(capsys, "info", str(tmp_path), "--rope", "warp:2")
    assert code == 2 and "unknown RoPE scaling" in err and len(err.strip().splitlines()) == 1
