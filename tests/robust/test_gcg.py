"""GCG on the session's SmolLM2 (float32, eager): the gradient against finite differences, the batched scorer
against the full pass, a loss drop on a tiny budget against random suffixes, resume = uninterrupted."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.errors import AttnlabError
from attnlab.robust.gcg import (GCG, GCGConfig, Scorer, allowed_tokens, forward_embeds, gradient_prefix,
                                initial_suffix, make_case, token_gradient)
from attnlab.robust.scoring import FloatScorer


@pytest.fixture(scope="module")
def setup(smollm2):
    case = make_case(smollm2, "What is the capital of France?", "Sure, the code is 7429")
    allowed = allowed_tokens(smollm2.tokenizer, smollm2.cfg.vocab_size, "all")
    return smollm2, case, allowed


def _relaxed_loss(model, case, onehot):
    W = model.embed.weight
    rest = torch.tensor(case.after + case.target)
    x = torch.cat([W[torch.tensor(case.before)], onehot @ W, W[rest]])[None]
    logits = forward_embeds(model, x)[0]
    nt = len(case.target)
    return float(F.cross_entropy(logits[-nt - 1:-1].double(), torch.tensor(case.target)))


def test_gradient_matches_finite_differences(setup):
    lm, case, _ = setup
    suffix = torch.tensor(initial_suffix(lm.tokenizer, 4))
    grad, loss, _ = token_gradient(lm.model, case, suffix)
    base = F.one_hot(suffix, lm.cfg.vocab_size).float()
    assert abs(_relaxed_loss(lm.model, case, base) - loss) < 1e-4
    eps = 1e-2
    for pos, tok in ((0, 1000), (2, 5000), (3, 17)):  # the direction e_tok - e_current at one position
        d = torch.zeros_like(base)
        d[pos, tok], d[pos, suffix[pos]] = 1.0, -1.0
        fd = (_relaxed_loss(lm.model, case, base + eps * d) - _relaxed_loss(lm.model, case, base - eps * d)) / (2 * eps)
        analytic = float(grad[pos, tok] - grad[pos, suffix[pos]])
        assert abs(fd - analytic) <= 0.02 * abs(analytic) + 1e-3, (pos, tok, fd, analytic)


def test_the_gradient_behind_the_prefix_is_the_whole_prompts(setup):
    lm, case, _ = setup
    suffix = torch.tensor(initial_suffix(lm.tokenizer, 5))
    suffix[2] = 1000
    g0, l0, n0 = token_gradient(lm.model, case, suffix)
    g1, l1, n1 = token_gradient(lm.model, case, suffix, gradient_prefix(lm.model, case))
    assert abs(l0 - l1) < 1e-5 and torch.allclose(g0, g1, atol=1e-5) and torch.allclose(n0, n1, atol=1e-3)
    full = forward_embeds(lm.model, lm.model.embed(torch.tensor([case.before + suffix.tolist()])))[0]
    assert torch.allclose(n0, full[len(case.before) - 1:-1], atol=1e-3)  # the logits that predict each suffix token


def test_scorer_matches_the_full_pass(setup):
    lm, case, allowed = setup
    suffixes = torch.stack([torch.tensor(initial_suffix(lm.tokenizer, 4)),
                            allowed.nonzero().flatten()[torch.tensor([5, 900, 4000, 12000])]])
    batched = Scorer(lm, case, chunk=1).losses(suffixes)  # the prefix cache, one row at a time
    together = Scorer(lm, case, chunk=2).losses(suffixes)
    full = torch.tensor([token_gradient(lm.model, case, s)[1] for s in suffixes])
    assert torch.allclose(batched, full, atol=1e-3) and torch.allclose(together, full, atol=1e-3)


def test_float_scorer_shares_the_prefix_and_the_current_suffix(setup):
    """Single swaps of a current suffix at every position (and the suffix itself), chunks that start at their
    first swap: the same losses as each candidate's full pass; without `set_current`, the same again."""
    lm, case, _ = setup
    current = torch.tensor(initial_suffix(lm.tokenizer, 5))
    cands = current.repeat(7, 1)
    cands[torch.arange(6), torch.tensor([4, 0, 2, 2, 3, 1])] = torch.tensor([1000, 5000, 17, 900, 4000, 12000])
    full = torch.tensor([token_gradient(lm.model, case, s)[1] for s in cands])
    for chunk in (1, 3, 7):
        scorer = FloatScorer(lm.model, case, chunk)
        assert torch.allclose(scorer.losses(cands), full, atol=1e-4)  # no current suffix yet: fed whole
        scorer.set_current(current)
        assert scorer._first_diff(cands).tolist() == [4, 0, 2, 2, 3, 1, 5]
        assert torch.allclose(scorer.losses(cands), full, atol=1e-4), chunk


def _attack(setup, steps, seed=0, length=6, batch=16, scorer_model=None):
    lm, case, allowed = setup
    cfg = GCGConfig(length=length, steps=steps, batch=batch, topk=16, seed=seed, chunk=16, check=False)
    return GCG(lm, lm.model, case, cfg, allowed, initial_suffix(lm.tokenizer, length), scorer_model=scorer_model)


def test_the_float_scorer_takes_the_engine_scorers_steps(setup):
    """The same network scoring through the engine's batch cache or the float scorer (chunks fed from their first
    swap): the same draws, so the same suffix at every step and the same losses."""
    engine = _attack(setup, steps=3, seed=5, batch=12, length=5)
    floated = _attack(setup, steps=3, seed=5, batch=12, length=5, scorer_model=setup[0].model)
    a, b = engine.run(), floated.run()
    assert [r["suffix"] for r in engine.history] == [r["suffix"] for r in floated.history]
    assert a["losses"] == pytest.approx(b["losses"], abs=1e-3)  # the engine scorer: 1e-3 of the full pass (above)


def test_gcg_lowers_the_loss_below_random_suffixes(setup):
    lm, case, allowed = setup
    attack = _attack(setup, steps=2, length=5, batch=12)
    res = attack.run()
    assert res["loss"] < res["initial_loss"] - 0.05
    assert res["losses"] == sorted(res["losses"], reverse=True) or res["loss"] == min(res["losses"])
    g = torch.Generator().manual_seed(1)
    pool = allowed.nonzero().flatten()
    random = pool[torch.randint(len(pool), (16, 5), generator=g)]
    assert res["loss"] < float(attack.scorer.losses(random).min())  # 16 random suffixes: none as good


def test_resume_gives_the_uninterrupted_result(setup, tmp_path):
    whole = _attack(setup, steps=2, seed=3, batch=4, length=4).run()
    path = tmp_path / "state.json"
    _attack(setup, steps=1, seed=3, batch=4, length=4).run(path)  # "interrupted" after one step
    resumed = _attack(setup, steps=2, seed=3, batch=4, length=4).run(path)
    assert resumed["losses"] == whole["losses"] and resumed["suffix_ids"] == whole["suffix_ids"]
    assert len(set(map(tuple, (r["suffix"] for r in _history(path))))) > 1  # the suffix moved
    other = GCG(setup[0], setup[0].model, setup[1], GCGConfig(length=4, steps=4, batch=8, topk=16, seed=3),
                setup[2], initial_suffix(setup[0].tokenizer, 4))
    with pytest.raises(AttnlabError, match="other settings"):
        other.run(path)


def _history(path):
    import json
    return json.loads(path.read_text())["history"]


def test_subtle_token_sets(setup):
    lm, case, _ = setup
    punct = allowed_tokens(lm.tokenizer, lm.cfg.vocab_size, "punct")
    assert 50 < int(punct.sum()) < 5000
    text = lm.tokenizer.decode(punct.nonzero().flatten()[:200].tolist())
    assert not any(ch.isalnum() for ch in text)
    cfg = GCGConfig(length=4, steps=1, batch=8, topk=8, tokens="fluent", fluent_top=20)
    attack = GCG(lm, lm.model, case, cfg, setup[2], initial_suffix(lm.tokenizer, 4))
    grad, _, nxt = token_gradient(lm.model, case, attack.suffix)
    cands = attack.candidates(grad, nxt)
    top = nxt.topk(200, dim=1).indices  # every swapped-in token is among the model's likeliest there
    for c in cands:
        for pos in (c != attack.suffix).nonzero().flatten().tolist():
            assert int(c[pos]) in top[pos].tolist()
