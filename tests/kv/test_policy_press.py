"""One scorer per KV method: the method a policy evicts with is the one a press compresses with, so on the same
prefix and quota, defined alike, they keep the same slots; specs and defaults of the methods."""
import pytest
import torch

from attnlab.errors import AttnlabError
from attnlab.kv import POLICIES, PRESSES, make_policy, make_press, scorers
from attnlab.options import PolicySpec
from tests.conftest import tiny_lm
from tests.kv.kv_reference import NEVER, cache_reference, original_reference, run
from tests.kv.test_press import RATIO, T, ids, lm  # noqa: F401 (fixtures: the press tests' model and prompt)

BOTH = [("sink", "streaming_llm"), ("h2o", "h2o"), ("sink_h2o", "sink_h2o"), ("tova", "tova"), ("snapkv", "snapkv"),
        ("snapkv:window_size=16:kernel_size=3", "snapkv:window_size=16:kernel_size=3"), ("knorm", "knorm")]


def kept(layer) -> torch.Tensor:
    """The positions a layer holds, per row and KV head, ascending: [B, H, n]."""
    pos = layer.pos[:, :, layer.first:layer.n]
    return pos[pos >= 0].view(*pos.shape[:2], -1).sort(-1).values


@pytest.mark.parametrize("ratio", [0.25, RATIO, 0.75])
@pytest.mark.parametrize("positions", ["original", "cache"])
@pytest.mark.parametrize("policy_name, press_name", BOTH)
def test_policy_keeps_what_the_press_keeps(lm, ids, policy_name, press_name, positions, ratio):
    """Alike means: the same method and fields (asserted), the policy's budget equal to the press's quota
    int(T * (1 - ratio)), one row, no pages, and the whole T-token prefix fed in one forward
    (chunk >= T), so the policy's one and only eviction comes after every prefix query has been observed, as the
    press reads the whole prompt. (With smaller chunks a policy evicts between chunks, on part of the evidence.)
    The attention a policy scores with comes from the forward pass and the press recomputes its window's from the
    recorded queries: equal up to float rounding, which moves no kept slot here. The policy's positions do not
    matter before its first eviction (under `cache` a key's slot is its position until then)."""
    keep = int(T * (1 - ratio))
    policy = make_policy(policy_name, keep, positions=positions, chunk=T)
    press = make_press(press_name, ratio)
    assert policy.method == press.method
    cache = lm.new_cache(1, policy=policy)
    lm.prefill(ids, cache, chunk=T)
    pressed = lm.new_cache(1, capacity=T + 4)
    lm.prefill(ids, pressed, chunk=T, press=press)
    recent = torch.arange(T - keep, T)
    scored = False
    for layer, ref in zip(cache.layers, pressed.layers):
        got, want = kept(layer), kept(ref)
        assert got.shape[-1] == keep and torch.equal(got, want), (policy_name, got, want)
        scored |= not torch.equal(want, recent.expand_as(want))
    assert scored or policy_name == "sink"  # the method's score chose something other than the latest tokens


def test_every_method_that_is_a_press_and_a_policy_is_tested():
    both = {p.scorer.name for p in POLICIES.values() if p.scorer is not None} & set(PRESSES)
    assert both == {make_press(name).method.name for _, name in BOTH}


def test_snapkv_has_kvpress_defaults():
    """One SnapKV, kvpress's defaults (window 64, kernel 5, average pool), for the policy and the press alike."""
    assert make_policy("snapkv").method == make_press("snapkv").method == scorers.SnapKV(64, 5)


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_knorm_policy_equals_masked_full_attention(positions):
    """knorm, a press method, evicts as a policy too: the logits are full attention with the evicted keys masked."""
    torch.manual_seed(0)
    lm = tiny_lm(5)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    steps = [8, 8] + [1] * 24
    logits, evicted, sizes, _ = run(lm, ids, make_policy("knorm", 12, positions=positions, chunk=8), steps)
    assert (evicted < NEVER).any() and max(sizes) <= 12
    reference = original_reference if positions == "original" else cache_reference
    torch.testing.assert_close(logits, reference(lm, ids, evicted, steps), atol=1e-4, rtol=1e-4)


def test_policy_specs():
    p = make_policy("snapkv:window_size=32:kernel_size=7", 256)
    assert (p.method.window_size, p.method.kernel_size, p.n_recent(256)) == (32, 7, 32)
    assert p.describe() == "snapkv(budget=256, positions=cache, window_size=32, kernel_size=7)"  # what a result names
    assert make_policy("sink", 64, n_sink=2).n_sink(64) == 2 and make_policy("sink:n_sink=8", 64, n_sink=2).n_sink(64) == 8
    assert make_policy("window", 64, n_sink=2).n_sink(64) == 0  # --n-sink sets the sinks of a method that keeps some
    assert make_policy("h2o", "25%", length=100).tokens == 25
    assert PolicySpec.parse("snapkv:window_size=32:512").build().method.window_size == 32
    assert PolicySpec.parse("sink:1024").build().tokens == 1024
    for bad, match in (("snapkv:nope=3", "nope"), ("snapkv:window_size", "field=number"),
                       ("snapkv:kernel_size=4", "odd"), ("h2o:recent_ratio=2", "recent_ratio"), ("sink:n_sink=-1", ">= 0"),
                       ("tova:window_size=3", "window_size")):
        with pytest.raises(AttnlabError, match=match):
            make_policy(bad, 64)
    assert make_press("expected_attention:use_vnorm=0").method.use_vnorm is False  # a flag as kvpress_anchor writes it
    with pytest.raises(AttnlabError, match="flag"):
        make_press("expected_attention:use_vnorm=2")
    with pytest.raises(AttnlabError, match="must exceed n_sink"):
        make_policy("h2o", "1%", length=100)  # a resolved budget is checked against the method too
