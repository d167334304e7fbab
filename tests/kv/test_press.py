"""Presses (compress once, after the prompt): kept indices against brute-force references written from
the papers' and kvpress's definitions, and the pressed cache's attention against full attention with the
dropped positions masked out."""
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.errors import AttnlabError
from attnlab.kv import make_press, make_policy
from attnlab.kv.press import PRESSES, choose, whole_pages
from attnlab.model.llama import attend
from attnlab.rope import apply as rope_apply
from tests.conftest import tiny_lm

T, CHUNK, RATIO = 72, 32, 0.5
KW = {"snapkv": {"window_size": 16, "kernel_size": 5}, "expected_attention": {"n_future": 64}}


@pytest.fixture(scope="module")
def lm():
    return tiny_lm(3)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, 97, (1, T), generator=torch.Generator().manual_seed(2))


class Tap:
    """Records every layer's pre-RoPE queries and (optionally) attention probabilities of a full pass."""
    needs_probs = True

    def __init__(self):
        self.q, self.probs = {}, {}

    def record(self, i, name, t):
        if name == "q":
            self.q[i] = t.clone()
        elif name == "probs":
            self.probs[i] = t.clone()


def full_state(lm, ids):
    """Keys, values (per layer, [B, H, T, D]), pre-RoPE queries and probs of a plain prefill."""
    cache = lm.new_cache(ids.shape[0], capacity=ids.shape[1] + 4)
    tap = Tap()
    lm.prefill(ids, cache, chunk=ids.shape[1], observers=[tap])
    kv = [(layer.k[:, :, :layer.n].clone(), layer.v[:, :, :layer.n].clone()) for layer in cache.layers]
    return kv, tap


def reference_scores(name, lm, k, v, q_pre, probs, n_kept, n_sink=4):
    """kvpress-style scores [B, H, n] of one layer, written from scratch (+inf where kvpress pads with max)."""
    B, H, n, D = k.shape
    Hq = q_pre.shape[1]
    G = Hq // H
    rope = lm.model.rope
    pos = torch.arange(n)
    kr = k.repeat_interleave(G, dim=1)  # repeat_kv

    def window_attention(w):
        q = rope_apply(q_pre[:, :, -w:], rope.tables(pos[-w:])[None, None])
        a = q @ kr.transpose(2, 3) / math.sqrt(D)
        a = a + torch.full_like(a, float("-inf")).triu(n - w + 1)
        return a.softmax(-1)[..., :-w]

    if name == "knorm":
        return -k.norm(dim=-1)
    if name == "streaming_llm":
        s = torch.ones(B, H, n)
        s[:, :, n_sink:n_sink + n - n_kept] = 0
        return s
    if name == "snapkv":
        w, ks = KW["snapkv"]["window_size"], KW["snapkv"]["kernel_size"]
        s = F.avg_pool1d(window_attention(w).mean(-2), ks, 1, ks // 2)
        return F.pad(s.view(B, H, G, n - w).mean(2), (0, w), value=float("inf"))
    if name == "tova":
        s = window_attention(1).mean(1).repeat(1, H, 1)
        return F.pad(s, (0, 1), value=float("inf"))
    if name == "expected_attention":
        fut = KW["expected_attention"]["n_future"]
        h = q_pre[:, :, n_sink:].double()
        mu = h.mean(2)
        cov = (h - mu[:, :, None]).transpose(-1, -2) @ (h - mu[:, :, None]) / h.shape[2]
        ang = torch.arange(n, n + fut, dtype=torch.float64)[:, None] * rope.inv_freq.double()[None]
        R = torch.zeros(fut, D, D, dtype=torch.float64)
        for i in range(D // 2):
            R[:, 2 * i, 2 * i], R[:, 2 * i, 2 * i + 1] = ang[:, i].cos(), -ang[:, i].sin()
            R[:, 2 * i + 1, 2 * i], R[:, 2 * i + 1, 2 * i + 1] = ang[:, i].sin(), ang[:, i].cos()
        R = R.mean(0)
        mu, cov = mu @ R.T, R @ cov @ R.T
        kk = kr[:, :, n_sink:].double()
        s = (kk @ mu[..., None])[..., 0] / math.sqrt(D) + torch.einsum("bhnd,bhde,bhne->bhn", kk, cov, kk) / D / 2
        s = s.softmax(-1).view(B, H, G, -1).mean(2) * v[:, :, n_sink:].double().norm(dim=-1)
        return F.pad(s.float(), (n_sink, 0), value=float("inf"))
    # h2o / sink_h2o: attention summed over every prompt query, group-averaged, H2O's forced slots
    acc = probs.view(B, H, G, n, n).mean(2).sum(2)
    policy = make_policy(name, n_kept, positions="original", n_sink=n_sink)
    forced = (pos < policy.n_sink(n_kept)) | (pos > n - 1 - policy.n_recent(n_kept))
    return acc.masked_fill(forced, float("inf"))


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_kept_indices_match_reference(lm, ids, name):
    (kv_full, tap) = full_state(lm, ids)
    cache = lm.new_cache(1, capacity=T + 4)
    lm.prefill(ids, cache, chunk=CHUNK, press=make_press(name, RATIO, **KW.get(name, {})))
    n_kept = int(T * (1 - RATIO))
    for i, layer in enumerate(cache.layers):
        assert layer.n == n_kept
        k, v = kv_full[i]
        ref = reference_scores(name, lm, k, v, tap.q[i], tap.probs[i], n_kept)
        want = ref.topk(n_kept, dim=-1).indices.sort(-1).values
        got = layer.pos[:, :, :layer.n]
        assert torch.equal(got, want), (name, i)
        torch.testing.assert_close(layer.k[:, :, :n_kept], torch.gather(k, 2, want[..., None].expand(-1, -1, -1, k.shape[-1])))


def masked_step(lm, kv_full, keep_masks, token, position):
    """One token through the network by hand, each layer attending to the full prompt's K/V with the
    dropped slots masked out (keep_masks[i]: [B, H, n] bool)."""
    model = lm.model
    x = model.embed(token)
    rot = model.rope.rotation(torch.tensor([[position]]))
    for i, block in enumerate(model.layers):
        a = block.attn
        h = block.attn_norm(x)
        qkv = a.wqkv(h).view(1, 1, a.n_heads + 2 * a.n_kv, a.head_dim).transpose(1, 2)
        q, k, v = qkv.split([a.n_heads, a.n_kv, a.n_kv], dim=1)
        q, k = rope_apply(q, rot), rope_apply(k, rot)
        K, V = torch.cat([kv_full[i][0], k], 2), torch.cat([kv_full[i][1], v], 2)
        mask = torch.cat([keep_masks[i], torch.ones(1, a.n_kv, 1, dtype=torch.bool)], -1)[:, :, None]
        out, _ = attend(q, K, V, mask)
        x = x + a.wo(out.transpose(1, 2).reshape(1, 1, -1))
        x = x + block.mlp(block.mlp_norm(x))
    return model.lm_head(model.norm(x)).float()


@pytest.mark.parametrize("name", ["knorm", "snapkv", "expected_attention", "sink_h2o"])
def test_pressed_attention_is_full_attention_masked(lm, ids, name):
    kv_full, _ = full_state(lm, ids)
    cache = lm.new_cache(1, capacity=T + 4)
    lm.prefill(ids, cache, chunk=CHUNK, press=make_press(name, 0.75, **KW.get(name, {})))
    masks = [torch.zeros(1, kv.k.shape[1], T, dtype=torch.bool).scatter_(-1, kv.pos[:, :, :kv.n], True)
             for kv in cache.layers]
    token = torch.tensor([[7]])
    got = lm.forward(token, cache)[:, -1]
    want = masked_step(lm, kv_full, masks, token, T)[:, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    full = lm.logits(torch.cat([ids, token], 1))[:, -1]
    assert (got - full).abs().max() > 1e-3  # dropping three quarters does change the next token's logits


@pytest.mark.parametrize("name", ["knorm", "streaming_llm", "snapkv", "tova", "expected_attention", "h2o"])
def test_padded_batch_rows_equal_single_rows(lm, name):
    """A left-padded batch: every row keeps its own quota, the same slots as alone, and decodes the same."""
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(1, 97, (n,), generator=gen) for n in (70, 58, 64)]
    press = make_press(name, 0.6, **KW.get(name, {}))
    width = max(len(r) for r in rows)
    batch = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    cache = lm.new_cache(3, capacity=width + 4, pad=[width - len(r) for r in rows])
    lm.prefill(batch, cache, chunk=CHUNK, press=press)
    out = lm.forward(torch.tensor([[3], [3], [3]]), cache)[:, -1]
    for b, r in enumerate(rows):
        one = lm.new_cache(1, capacity=width + 4)
        lm.prefill(r[None], one, chunk=CHUNK, press=press)
        for layer, single in zip(cache.layers, one.layers):
            p = layer.pos[b]
            kept = p[(p >= 0) & (p < len(r))].view(p.shape[0], -1)  # the prompt's slots (not the token fed after)
            assert kept.shape[-1] == int(len(r) * (1 - 0.6)) == single.n
            assert torch.equal(kept.sort(-1).values, single.pos[0, :, :single.n])
        torch.testing.assert_close(out[b], lm.forward(torch.tensor([[3]]), one)[0, -1], atol=1e-4, rtol=1e-4)


def reference_pages(score, page, n_kept, agg=torch.max):
    """Whole pages by their best score (ties: the lower page), positions in order, the last page cut short."""
    B, H, n = score.shape
    out = torch.empty(B, H, n_kept, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            best = [agg(score[b, h, p:p + page].nan_to_num(posinf=1e9)).item() for p in range(0, n, page)]
            order = sorted(range(len(best)), key=lambda p: (-best[p], p))
            kept = [i for p in order for i in range(p * page, min(n, (p + 1) * page))][:n_kept]
            out[b, h] = torch.tensor(sorted(kept))
    return out


@pytest.mark.parametrize("name", ["knorm", "snapkv", "tova", "h2o"])
def test_pages_are_kept_whole(lm, ids, name):
    """page=8: the kept positions are the reference's whole pages (ranked by their best pair), per layer and KV
    head: 4 pages and the first 4 positions of a fifth."""
    (kv_full, tap) = full_state(lm, ids)
    cache = lm.new_cache(1, capacity=T + 4)
    lm.prefill(ids, cache, chunk=CHUNK, press=make_press(name, RATIO, page=8, **KW.get(name, {})))
    n_kept = int(T * (1 - RATIO))
    for i, layer in enumerate(cache.layers):
        k, v = kv_full[i]
        ref = reference_scores(name, lm, k, v, tap.q[i], tap.probs[i], n_kept)
        got = layer.pos[:, :, :layer.n]
        assert torch.equal(got, reference_pages(ref, 8, n_kept)), (name, i)
        for row in got.flatten(0, 1):
            pages = (row // 8).bincount()
            assert sorted(pages[pages > 0].tolist()) == [4, 8, 8, 8, 8]


def test_whole_pages_rank_by_the_best_pair():
    """One sharp pair outranks a page of middling ones (ChunkKV's mean would keep the middling page); ties go
    to the lower page; padding stays out; a page with an always-kept pair ranks first."""
    pos = torch.tensor([[[-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]])
    score = torch.tensor([[[9.0, 0.0, 0.9, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.9, 0, 0, 0]]])
    idx, alive = choose(pos, whole_pages(score, pos, 4), torch.tensor([9]))
    assert pos[0, 0, idx[0, 0]].tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11] and alive.all()  # pages 0, 2, then 1 cut
    assert reference_pages(score[..., 1:], 4, 4, torch.mean).tolist() == [[[4, 5, 6, 7]]]
    score[0, 0, 12] = float("inf")
    assert pos[0, 0, choose(pos, whole_pages(score, pos, 4), torch.tensor([4]))[0][0, 0]].tolist() == [8, 9, 10, 11]


def test_press_specs():
    assert make_press("snapkv:window_size=32:page=16", 0.25) == make_press("snapkv", 0.25, window_size=32, page=16)
    assert make_press("tova:page=4").page == 4 and make_press("knorm").page == 1
    for bad, match in (("snapkv:window_size", "field=number"), ("snapkv:=3", "field=number"),
                       ("snapkv:window_size=x", "field=number"), ("snapkv:nope=3", "nope"),
                       ("tova:page=0", "page"), ("tova:page=1.5", "page")):
        with pytest.raises(AttnlabError, match=match):
            make_press(bad)


def test_choose_quota_and_surplus():
    pos = torch.tensor([[[-1, 0, 1, 2, 3]], [[0, 1, 2, 3, 4]]])
    score = torch.tensor([[[9.0, 1, 5, 2, 4]], [[1.0, 2, 3, 4, 5]]])
    idx, alive = choose(pos, score, torch.tensor([1, 3]))
    assert idx.tolist() == [[[2, 3, 4]], [[2, 3, 4]]]
    assert alive.tolist() == [[[True, False, False]], [[True, True, True]]]


def test_errors(lm, ids):
    with pytest.raises(AttnlabError, match="unknown press"):
        make_press("nope")
    with pytest.raises(AttnlabError, match="ratio"):
        make_press("knorm", 1.0)
    cache = lm.new_cache(1, capacity=T, policy=make_policy("sink", 16, positions="original", chunk=CHUNK))
    with pytest.raises(AttnlabError, match="eviction policy"):
        lm.prefill(ids, cache, chunk=CHUNK, press=make_press("knorm"))
    cache = lm.new_cache(1, capacity=T)
    lm.prefill(ids, cache, chunk=CHUNK, press=make_press("knorm"))
    with pytest.raises(AttnlabError, match="already pressed"):
        lm.prefill(ids[:, :4], cache, press=make_press("knorm"))
