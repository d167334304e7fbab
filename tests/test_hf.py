"""attnlab.hf: our policies and presses inside transformers' `model.generate`, token for token equal to our
engine (random Llama, Qwen2 and Mistral models exported with `save_hf_folder`); a broken score is caught."""
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from attnlab.errors import AttnlabError
from attnlab.hf import PolicyCache
from attnlab.kv import H2O, make_policy, make_press
from attnlab.model.export import save_hf_folder
from tests.conftest import tiny_lm

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")  # 5.24's name; 5.0-5.2 know no other

PROMPT, NEW, BUDGET = 24, 110, 16
ARCHS = {"llama": {}, "qwen2": {"qkv_bias": True}, "mistral": {}}


def make_pair(arch, tmp_path_factory):
    lm = tiny_lm(11, arch=arch, eos_token_ids=[], context_length=512, **ARCHS[arch])
    path = save_hf_folder(lm.model, tmp_path_factory.mktemp(arch))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    ids = torch.randint(1, 97, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    return lm, hf, ids


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tmp_path_factory):
    """(our LM, the same weights in transformers with eager attention, a prompt)."""
    return make_pair(request.param, tmp_path_factory)


def engine_tokens(lm, ids, policy=None, press=None) -> list[int]:
    cache = lm.new_cache(1, capacity=PROMPT + NEW + 2, policy=policy, positions="original")
    logits = lm.prefill(ids, cache, chunk=PROMPT, press=press)
    out = []
    for _ in range(NEW):
        token = logits.argmax(-1)
        out.append(int(token))
        logits = lm.forward(token[:, None], cache)[:, -1]
    return out


def hf_tokens(hf, ids, **cache_kw) -> list[int]:
    cache = PolicyCache(hf, **cache_kw)
    with torch.no_grad():
        out = hf.generate(ids, past_key_values=cache, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    kv = cache.layers[0].kv
    if cache.policy is not None:  # the cache really was bounded the whole way
        assert kv.n <= BUDGET + 1 and cache.layers[0].seen == PROMPT + NEW - 1
    return out[0, PROMPT:].tolist()


def policy(name):
    return make_policy(name, BUDGET, positions="original", n_sink=4, chunk=PROMPT)


@pytest.mark.parametrize("name", ["sink", "h2o", "sink_h2o", "tova"])
def test_generate_with_a_policy_equals_the_engine(pair, name):
    lm, hf, ids = pair
    want = engine_tokens(lm, ids, policy(name))
    assert len(want) >= 100
    assert hf_tokens(hf, ids, policy=policy(name)) == want
    if name == "sink":  # and the policy matters: the full cache says something else
        assert engine_tokens(lm, ids) != want


@pytest.mark.parametrize("name", ["sink", "h2o"])
def test_mistral_too(tmp_path_factory, name):
    lm, hf, ids = make_pair("mistral", tmp_path_factory)
    assert hf_tokens(hf, ids, policy=policy(name)) == engine_tokens(lm, ids, policy(name))


@pytest.mark.parametrize("name", ["knorm", "streaming_llm", "snapkv", "tova", "expected_attention", "h2o",
                                  "snapkv:window_size=8:page=4"])
def test_generate_with_a_press_equals_the_engine(pair, name):
    lm, hf, ids = pair
    kw = {"window_size": 8} if name == "snapkv" else {"n_future": 32} if name == "expected_attention" else {}
    press = make_press(name, 0.5, **kw)
    want = engine_tokens(lm, ids, press=press)
    assert hf_tokens(hf, ids, press=press) == want


@dataclass
class BrokenH2O(H2O):
    """H2O with its score upside down: keeps the tokens that got the least attention."""
    name: ClassVar[str] = "h2o"

    def score(self, kv):
        return -super().score(kv)


def test_a_broken_score_is_caught(pair):
    lm, hf, ids = pair
    want = engine_tokens(lm, ids, policy("h2o"))
    broken = BrokenH2O(budget=BUDGET, positions="original", chunk=PROMPT)
    assert hf_tokens(hf, ids, policy=broken) != want


def test_errors(pair, tmp_path):
    lm, hf, ids = pair
    with pytest.raises(AttnlabError, match="original"):
        PolicyCache(hf, policy=make_policy("sink", BUDGET, positions="cache"))
    with pytest.raises(AttnlabError, match="not both"):
        PolicyCache(hf, policy=policy("sink"), press=make_press("knorm"))
    sdpa = transformers.AutoModelForCausalLM.from_pretrained(str(save_hf_folder(lm.model, tmp_path)),
                                                             attn_implementation="sdpa", dtype=torch.float32)
    with pytest.raises(AttnlabError, match="eager"):
        sdpa.generate(ids, past_key_values=PolicyCache(sdpa, policy=policy("h2o")), max_new_tokens=2, do_sample=False)


def test_export_command(tmp_path, capsys):
    """`attnlab export`: a folder transformers loads to the same logits (float16 storage: to its rounding)."""
    from safetensors import safe_open

    from attnlab.cli import main
    lm = tiny_lm(2, eos_token_ids=[], context_length=512)
    src = save_hf_folder(lm.model, tmp_path / "src")
    out = tmp_path / "out"
    assert main(["export", str(src), str(out), "--dtype", "float16"]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(1, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = hf(ids).logits
    want = lm.logits(ids)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    capsys.readouterr()
    assert main(["export", str(src), str(out)]) == 2 and "not empty" in capsys.readouterr().err
