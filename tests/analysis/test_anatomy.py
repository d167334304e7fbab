"""Anatomy numbers vs a direct computation from full attention maps built from the weights."""
import math

import pytest
import torch

from attnlab.analysis.anatomy import analyze_ids, attention_maps, frequency_relation, head_stats
from attnlab.model.llama import ModelConfig, Transformer
from attnlab.rope import apply as rope_apply


def tiny(seed=0, layers=2, heads=4, kv=2):
    torch.manual_seed(seed)
    m = Transformer(ModelConfig(vocab_size=61, dim=32, n_layers=layers, n_heads=heads, n_kv_heads=kv, hidden_dim=48))
    return m.eval()


def reference_maps(model, ids):
    """Attention maps [H, T, T] per layer, written out from the weights with an explicit softmax."""
    T = ids.numel()
    cfg = model.cfg
    x = model.embed(ids[None])
    rot = model.rope.rotation(torch.arange(T)[None])
    maps = []
    G = cfg.n_heads // cfg.n_kv_heads
    for layer in model.layers:
        a = layer.attn
        h = layer.attn_norm(x)
        q, k, v = a.wqkv(h).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = rope_apply(q.view(1, T, cfg.n_heads, cfg.head_dim).transpose(1, 2), rot)
        k = rope_apply(k.view(1, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2), rot)
        v = v.view(1, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        s = q @ k.transpose(-1, -2) / math.sqrt(cfg.head_dim)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        p = s.softmax(-1)
        maps.append(p[0])
        out = (p @ v).transpose(1, 2).reshape(1, T, -1)
        x = x + a.wo(out)
        x = x + layer.mlp(layer.mlp_norm(x))
    return maps


@torch.no_grad()
def test_recorded_maps_match_reference():
    model, ids = tiny(), torch.randint(0, 61, (40,), generator=torch.Generator().manual_seed(1))
    got = attention_maps(model, ids)
    ref = reference_maps(model, ids)
    assert len(got) == 2
    for g, r in zip(got, ref):
        torch.testing.assert_close(g[0], r, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_statistics_match_direct_loops():
    model = tiny(seed=3)
    ids = torch.randint(0, 61, (48,), generator=torch.Generator().manual_seed(2))
    res = analyze_ids(model, ids, sinks=(1, 4), map_layer=1, map_head=2, min_query=16)
    ref = reference_maps(model, ids)
    T = ids.numel()
    torch.testing.assert_close(res.attention_map, ref[1][2], atol=1e-5, rtol=1e-4)
    for li, P in enumerate(ref):
        for h in range(P.shape[0]):
            a = P[h].double()
            for k in (1, 4):
                direct = sum(float(a[t, :k].sum()) for t in range(k, T)) / (T - k)
                assert res.stats[f"sink_mass_{k}"][li, h] == pytest.approx(direct, abs=1e-5)
            ent = [-sum(float(p * math.log(p + 1e-8)) for p in a[t, :t + 1]) for t in range(T)]
            assert res.stats["entropy"][li, h] == pytest.approx(sum(ent) / T, abs=1e-4)
            norm = [ent[t] / math.log(t + 1) for t in range(1, T)]
            assert res.stats["entropy_normalised"][li, h] == pytest.approx(sum(norm) / len(norm), abs=1e-4)
            for frac, key in ((0.05, "top5_share"), (0.20, "top20_share")):
                shares = []
                for t in range(16, T):
                    row = sorted(a[t, :t + 1].tolist(), reverse=True)
                    shares.append(sum(row[:max(1, math.ceil(frac * (t + 1)))]))
                assert res.stats[key][li, h] == pytest.approx(sum(shares) / len(shares), abs=1e-5)
            first = []
            for t in range(16, T):
                row = sorted(a[t, :t + 1].tolist(), reverse=True)
                first.append(float(a[t, 0]) >= row[max(1, math.ceil(0.05 * (t + 1))) - 1])
            assert res.stats["first_in_top5"][li, h] == pytest.approx(sum(first) / len(first))
        received = torch.stack([P[:, j:, j].mean(-1) for j in range(T)], -1).mean(0)
        torch.testing.assert_close(res.received[li], received, atol=1e-5, rtol=1e-4)


def test_uniform_attention_has_log_entropy():
    T = 35
    probs = torch.ones(T, T).tril()
    probs = (probs / probs.sum(-1, keepdim=True))[None, None]
    s = head_stats(probs)
    assert float(s["entropy"][0]) == pytest.approx(sum(math.log(t) for t in range(1, T + 1)) / T, abs=1e-4)
    assert float(s["entropy_normalised"][0]) == pytest.approx(1.0, abs=1e-4)
    assert float(s["top20_share"][0]) >= 0.2


def test_frequency_relation_runs():
    rec = torch.rand(2, 60)
    ids = torch.randint(0, 10, (60,))
    r = frequency_relation(rec, ids, ids.tolist(), skip=4, window=8)
    assert len(r["spearman_frequency_per_layer"]) == 2
    assert -1 <= r["spearman_cooccurrence_all_layers"] <= 1
