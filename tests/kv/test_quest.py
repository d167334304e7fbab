"""Quest (query-aware page selection, `--attention quest:BUDGET[:PAGE[:DENSE[:CHANNELS]]]`), the eager reference.

A budget covering the context is full attention; a small one is full attention with the unselected pages
masked, the selection recomputed here from the definition; page summaries stay true under eviction; and on
SmolLM2 the bound finds a passkey that a random choice of pages (same budget) loses."""
from __future__ import annotations

import copy

import pytest
import torch

import attnlab.model.quest as quest
from attnlab import AttnlabError, Options
from attnlab.eval.passkey import passkey_prompt, retrieve
from attnlab.kernels import ops
from attnlab.kernels.reference import dequantize_int8_blocks
from attnlab.kv.pages import QuestSpec, channel_codes, summarize
from attnlab.kv.policies import make_policy
from attnlab.model.llama import attend
from attnlab.rope import apply as rope_apply
from attnlab.sampling import Sampler
from tests.conftest import tiny_lm
from tests.kv.kv_reference import _finish, _qkv



def decode_all(lm, ids, prefill, policy=None):
    """Prefill ids[:, :prefill], then feed the rest one token at a time: all logits [B, N, V] and the cache."""
    cache = lm.new_cache(ids.shape[0], policy=policy)
    outs = [lm.prefill(ids[:, :prefill], cache, chunk=prefill, all_logits=True)]
    outs += [lm.forward(ids[:, t:t + 1], cache) for t in range(prefill, ids.shape[1])]
    return torch.cat(outs, 1), cache


def test_spec_parsing_and_errors():
    assert Options(attention="quest:1024").attention == QuestSpec(1024, 16)
    assert Options(attention="quest:256:32").attention == QuestSpec(256, 32)
    assert Options(attention="full").attention is None
    assert Options(attention="quest:256:16:2").attention == QuestSpec(256, 16, 2)
    assert str(QuestSpec(256, 16, 2)) == "quest:256:16:2" and str(QuestSpec(256)) == "quest:256:16"
    assert Options(attention="quest:256:16:0:8").attention == QuestSpec(256, 16, 0, 8) == \
        QuestSpec.parse(str(QuestSpec(256, 16, 0, 8)))
    for bad, why in [("quest:16:16", "two pages"), ("quest", "quest:BUDGET"), ("sparse:64", "unknown attention"),
                     ("quest:a", "integers"), ("quest:64:0", "positive"), ("quest:64:16:-1", "dense"),
                     ("quest:64:16:0:-1", "channels"), ("quest:64:16:2:1:1", "unknown attention")]:
        with pytest.raises(AttnlabError, match=why):
            Options(attention=bad)


def test_channels_past_the_head_size_fail_clearly():
    lm = tiny_lm()  # head size 16
    assert lm.with_attention("quest:16:4:0:16").options.attention.channels == 16
    with pytest.raises(AttnlabError, match="head size 16"):
        lm.with_attention("quest:16:4:0:17")


def test_every_model_command_takes_attention(capsys):
    """--attention sits with the model options (add_model_args): each command that loads a model parses it."""
    import argparse

    from attnlab.cli import build_parser
    from tests.test_cli import run
    parser = build_parser()
    commands = [name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
                for name, sub in action.choices.items()
                if any("--kv-dtype" in a.option_strings for a in sub._actions)]
    assert "generate" in commands and "passkey" in commands
    args = parser.parse_args(["generate", "--prompt", "x", "--attention", "quest:64:8"])
    assert Options.from_args(args).attention == QuestSpec(64, 8)
    for name in commands:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        assert any("--attention" in a.option_strings for a in sub._actions), name
    code, _, err = run(capsys, "generate", "--prompt", "x", "--attention", "quest:8")
    assert code == 2 and "two pages" in err


def test_budget_covering_the_context_is_full_attention():
    lm = tiny_lm()
    ids = torch.randint(1, 97, (2, 48))
    full, _ = decode_all(lm, ids, 20)
    for spec in ("quest:48:4", "quest:64:16"):
        got, cache = decode_all(lm.with_attention(spec), ids, 20)
        assert torch.equal(got, full)
        assert cache.layers[0].page_min.shape[2] == -(-48 // int(spec.split(":")[2]))


def reference_logits(lm, ids, prefill, budget, page, channels=0):
    """Brute force from the definition: one causal pass over all tokens where each decode query t sees only
    its chosen pages (per KV head: bound = max over the group's heads of sum_c max(q_c min_c, q_c max_c) over
    the page's keys 0..t; the first and last page, then the highest bounds, budget // page pages). channels:
    a page's score is instead the largest (sum_g q_g) . k over its keys, on the `channels` channels of largest
    |sum_g q_g| only, each key rounded to int8 against its largest |channel|."""
    model, cfg = lm.model, lm.cfg
    B, N = ids.shape
    G = cfg.n_heads // cfg.n_kv_heads
    x = model.embed(ids)
    rot = model.rope.rotation(torch.arange(N).expand(B, -1))
    chosen_any = False
    for layer in model.layers:
        q, k, v = _qkv(layer, x, cfg)
        q, k = rope_apply(q, rot), rope_apply(k, rot)
        mask = torch.ones(N, N, dtype=torch.bool).tril().expand(B, cfg.n_kv_heads, N, N).clone()
        for t in range(prefill, N):
            n_pages = t // page + 1
            if n_pages <= budget // page:
                continue
            for b in range(B):
                for h in range(cfg.n_kv_heads):
                    bounds = []
                    heads = range(h * G, (h + 1) * G)
                    summed = [sum(float(q[b, g, t, c]) for g in heads) for c in range(cfg.head_dim)]
                    chosen = sorted(range(cfg.head_dim), key=lambda c: (-abs(summed[c]), c))[:channels]
                    for p in range(n_pages):
                        keys = k[b, h, p * page:min((p + 1) * page, t + 1)]
                        if channels:
                            scale = [float(keys[j].abs().max()) / 127 for j in range(keys.shape[0])]
                            codes = [[round(float(keys[j, c]) / scale[j]) if scale[j] else 0 for c in chosen]
                                     for j in range(keys.shape[0])]
                            bounds.append(max(scale[j] * sum(summed[c] * x for c, x in zip(chosen, codes[j]))
                                              for j in range(keys.shape[0])))
                            continue
                        lo, hi = keys.min(0).values, keys.max(0).values
                        bounds.append(max(float(torch.maximum(q[b, g, t] * lo, q[b, g, t] * hi).sum())
                                          for g in heads))
                    middle = sorted(range(1, n_pages - 1), key=lambda p: -bounds[p])[:budget // page - 2]
                    keep = torch.zeros(N, dtype=torch.bool)
                    for p in [0, n_pages - 1, *middle]:
                        keep[p * page:(p + 1) * page] = True
                    mask[b, h, t] &= keep
                    chosen_any = True
        out, _ = attend(q, k, v, mask)
        x = _finish(layer, x, out)
    assert chosen_any  # the budget really cut pages
    return model.lm_head(model.norm(x)).float()


@pytest.mark.parametrize("budget,page,channels", [(16, 4, 0), (24, 8, 0), (16, 4, 3), (24, 8, 5)])
def test_small_budget_equals_masked_full_attention(budget, page, channels):
    lm = tiny_lm(seed=1)
    ids = torch.randint(1, 97, (2, 56))
    got, _ = decode_all(lm.with_attention(f"quest:{budget}:{page}:0:{channels}"), ids, 12)
    ref = reference_logits(lm, ids, 12, budget, page, channels)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    full, _ = decode_all(lm, ids, 12)
    assert (got[:, 12 + budget:] - full[:, 12 + budget:]).abs().max() > 1e-2  # the selection changed the output


def test_dense_first_layers_read_every_key():
    """quest:B:P:D leaves layers 0 .. D-1 dense: D = all layers is full attention, D = 1 sits between."""
    lm = tiny_lm(seed=1, n_layers=2)
    ids = torch.randint(1, 97, (1, 56))
    full, _ = decode_all(lm, ids, 12)
    sparse, _ = decode_all(lm.with_attention("quest:16:4"), ids, 12)
    assert torch.equal(decode_all(lm.with_attention("quest:16:4:2"), ids, 12)[0], full)
    one, _ = decode_all(lm.with_attention("quest:16:4:1"), ids, 12)
    assert (one - full).abs().max() > 1e-3 and (one - sparse).abs().max() > 1e-3


def test_observers_see_probabilities_over_the_whole_cache():
    """A pass that records attention (an H2O policy, the analysis recorders) gets [B, Hq, 1, n] probabilities:
    zero outside the read pages, summing to one, and the step's logits do not change."""
    lm = tiny_lm(seed=2)
    view = lm.with_attention("quest:16:4")
    ids = torch.randint(1, 97, (1, 41))
    seen = []
    recorder = type("R", (), {"needs_probs": True,
                              "record": lambda self, i, name, t: seen.append(t) if name == "probs" else None})()

    def step(observers):
        cache = view.new_cache()
        view.prefill(ids[:, :40], cache)
        return view.forward(ids[:, 40:], cache, observers=observers)

    torch.testing.assert_close(step((recorder,)), step(()), atol=1e-5, rtol=1e-5)
    probs = seen[-1]  # the last layer's, [1, 4, 1, 41]
    assert probs.shape == (1, 4, 1, 41)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 4, 1))
    # 41 slots in pages of 4: three whole pages (the first among them) and the last page, slot 40 alone
    assert ((probs > 0).sum(-1) == 13).all() and (probs[..., :4] > 0).all() and (probs[..., 40] > 0).all()


@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_page_summaries_follow_growth_and_eviction(kv_dtype):
    """Summaries kept up to date step by step (and rebuilt after a policy compacts the cache, keys turned to
    their new slots) equal summaries computed from scratch over what the cache holds."""
    lm = tiny_lm(dim=128, n_heads=4, n_kv_heads=2)  # head size 32: what an int8 cache needs
    lm.kv_dtype = getattr(torch, kv_dtype)
    view = lm.with_attention("quest:16:4")
    ids = torch.randint(1, 97, (1, 70))
    for policy in (None, make_policy("sink_h2o", 40, positions="cache", n_sink=4, chunk=8)):
        for v in (view, view.with_attention("quest:16:4:0:8")):
            _, cache = decode_all(v, ids, 9, policy)
            assert policy is None or len(cache) < 70  # eviction happened
            assert_summaries_fresh(cache, 4)


def test_a_saved_cache_gets_its_summaries_back():
    from attnlab.kv.cache import cache_state, load_cache_state
    view = tiny_lm().with_attention("quest:16:4")
    _, cache = decode_all(view, torch.randint(1, 97, (1, 30)), 10)
    fresh = view.new_cache()
    load_cache_state(fresh, cache_state(cache))
    for a, b in zip(cache.layers, fresh.layers):
        assert torch.equal(a.page_min, b.page_min) and torch.equal(a.page_max, b.page_max)


def test_load_decodes_natively_without_a_warning():
    """Quest runs in the native step (tests/kv/test_quest_native.py); compile=False keeps eager, the reference."""
    import warnings

    import attnlab
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lm = attnlab.load("smollm2-135m", attention="quest:64", tokenizer=False)
    assert (lm.compiled is not None) == ops.enabled() and lm.new_cache().layers[0].page == 16
    assert attnlab.load("smollm2-135m", attention="quest:64", tokenizer=False, compile=False).compiled is None


def test_bound_finds_the_passkey_a_random_selection_loses(smollm2, monkeypatch):
    """SmolLM2, a 500-token passkey prompt, the needle early: quest at 64 tokens (1/8 of the context) answers,
    the same budget over random pages (sink and recent page still in) does not. One exact prefill for both."""
    view = smollm2.with_attention("quest:64")
    key = "58203"
    ids = torch.tensor([passkey_prompt(smollm2, 512, 0.1, key)])
    cache = view.new_cache(capacity=ids.shape[1] + 8)
    logits = view.prefill(ids, cache)

    def answer(cache):
        out = [int(t) for t in view.decode(cache, logits, Sampler(), 7)]
        return smollm2.tokenizer.decode(out).strip()

    assert answer(copy.deepcopy(cache)).startswith(key)
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(quest, "page_bounds", lambda q, lo, hi: torch.rand(lo.shape[:3], generator=g))
    assert not answer(cache).startswith(key)


@pytest.mark.slow
def test_passkey_beyond_a_sink_window(monkeypatch):
    """2,000 tokens, needle 1,800 back: quest:256 finds it; random pages at 256 and sink:1024 do not."""
    import attnlab
    lm = attnlab.load("smollm2-135m", compile=False, attention="quest:256")
    ids = passkey_prompt(lm, 2048, 0.1, "58203")
    assert retrieve(lm, ids, "58203")[0]
    assert not retrieve(lm.with_attention(None), ids, "58203", policy=make_policy("sink", 1024))[0]
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(quest, "page_bounds", lambda q, lo, hi: torch.rand(lo.shape[:3], generator=g))
    assert not retrieve(lm, ids, "58203")[0]


def assert_summaries_fresh(cache, page: int) -> None:
    """Every layer's page summaries equal those recomputed from the keys it holds (as stored: int8 dequantised)."""
    for layer in cache.layers:
        n = layer.n
        keys = layer.k[:, :, :n].float() if layer.k_scale is None else \
            dequantize_int8_blocks(layer.k[:, :, :n], layer.k_scale[:, :, :n])
        lo, hi = summarize(keys, layer.pos[:, :, :n] >= 0, page)
        assert torch.equal(layer.page_min, lo) and torch.equal(layer.page_max, hi)
        if layer.keys_t is not None:  # Quest's CHANNELS: the keys channel-major in int8, a scale per key
            codes, scale = channel_codes(keys, layer.pos[:, :, :n] >= 0)
            assert torch.equal(layer.keys_t[..., :n], codes) and torch.equal(layer.keys_s[..., :n], scale)


def test_float16_summaries_round_outward():
    """Stored page minima never exceed, maxima never undercut the float32 keys (the bound stays an upper bound),
    and each is the nearest float16 that does so; out of float16's range a maximum becomes inf."""
    from attnlab.kv.pages import outward
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * 10.0 ** torch.randint(-9, 5, (4000,), generator=g).float(),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 65504.0, 70000.0, -70000.0, 1e-8, -1e-8])])
    lo, hi = outward(x, up=False), outward(x, up=True)
    assert lo.dtype == hi.dtype == torch.float16
    assert (lo.float() <= x).all() and (hi.float() >= x).all()
    up, down = torch.full_like(lo, float("inf")), torch.full_like(lo, float("-inf"))
    assert (torch.nextafter(lo, up).float() > x).all() and (torch.nextafter(hi, down).float() < x).all()
    assert hi[-4] == float("inf") and lo[-4] == 65504.0
