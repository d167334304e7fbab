"""Speculative decoding (`attnlab.speculative`): the same tokens as plain greedy decoding for every drafter kind, the
target's distribution at temperature > 0 (chi-square, and a wrong acceptance rule caught), specs and their errors.

A verification row computes each token as a decode step does, bit for bit, on the quantized file (native and eager,
float16 and int8 KV, full / sink / Quest targets); with float32 weights torch's matmul rounds a row of K + 1 tokens
unlike one token (~1e-3 in a logit), so greedy identity there is up to near ties: a mismatch where plain decoding's
top-2 gap is below NEAR_TIE is reported, not failed. The full 20 prompts x 128 tokens per drafter kind, path, policy
and KV dtype: benchmarks/spec_exact.py (docs/speculative.md).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from scipy.stats import chisquare

import attnlab.speculative as spec_mod
from attnlab import AttnlabError
from attnlab.batch import Batch
from attnlab.kv import make_policy
from attnlab.options import Options
from attnlab.sampling import Sampler
from attnlab.speculative import AdaptiveK, ModelDrafter, NgramDrafter, SpecStats, SpeculativeSpec, accept, decode

NEAR_TIE = 1e-3
NEW = 64
CODE = "def scale(values, factor):\n    out = []\n    for v in values:\n        out.append(v * factor)\n    return out\n"
PROMPTS = [f"Rename `values` to `items` in the following function:\n{CODE}\nThe renamed function:\n",
           "The quick brown fox jumps over the lazy dog. The quick brown fox",
           "Once upon a time, in a small village by the sea,"]


PLAIN: dict = {}


def _plain(lm, ids, policy=None):
    """Plain greedy decoding (computed once per model, prompt and policy kind)."""
    key = (id(lm), tuple(ids), type(policy).__name__)
    if key not in PLAIN:
        cache = lm.new_cache(capacity=len(ids) + NEW, policy=policy)
        PLAIN[key] = list(lm.stream(ids, cache, Sampler(0), NEW, stop_at_eos=False))
    return PLAIN[key]


def _speculative(lm, ids, spec, policy=None, drafter=None):
    cache = lm.new_cache(capacity=len(ids) + NEW, policy=policy)
    stats = SpecStats()
    logits = lm.prefill(torch.tensor([ids]), cache)
    spec = SpeculativeSpec.parse(spec)
    out = list(decode(lm, cache, ids, logits, Sampler(0), NEW, (), spec, drafter, stats))
    return out, stats


def _same_or_near_tie(lm, ids, plain, out, label):
    """Identical, or the first difference sits where plain decoding's top-2 logit gap is below NEAR_TIE."""
    if out == plain:
        return
    i = next(j for j, (a, b) in enumerate(zip(out, plain)) if a != b)
    top = lm.logits(torch.tensor([ids + plain[:i]]))[0, -1].topk(2).values
    gap = float(top[0] - top[1])
    assert gap < NEAR_TIE, f"{label}: token {i} differs from plain greedy decoding (top-2 gap {gap:.4g})"
    warnings.warn(f"{label}: plain decoding sits on a near tie at token {i} (gap {gap:.2g})")


@pytest.fixture(scope="module")
def native(smollm2):
    lm = copy.copy(smollm2)
    lm.compile_decode()
    if lm.compiled is None:
        pytest.skip("no native decode step for float32 weights here")
    return lm


@pytest.mark.parametrize("prompt", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("spec", ["ngram:3:4", "self:sink:16:4", "self:quest:32:3"])
def test_greedy_speculative_decoding_is_plain_greedy_decoding(smollm2, spec, prompt):
    ids = smollm2.encode(PROMPTS[prompt])
    out, stats = _speculative(smollm2, ids, spec)
    _same_or_near_tie(smollm2, ids, _plain(smollm2, ids), out, f"{spec} on prompt {prompt}")
    assert stats.tokens == NEW and stats.accepted <= stats.drafted and stats.steps <= NEW
    assert stats.tokens_per_step == pytest.approx(NEW / stats.steps)


def test_a_second_model_drafting_gives_the_targets_tokens(smollm2):
    """draft: the quantized file (other numerics, a realistic draft) drafting for the float32 target."""
    import attnlab
    draft = attnlab.load("smollm2-135m", kv_dtype="float16", tokenizer=False)
    ids = smollm2.encode(PROMPTS[0])
    out, stats = _speculative(smollm2, ids, "draft:unused:4", drafter=ModelDrafter(draft))
    _same_or_near_tie(smollm2, ids, _plain(smollm2, ids), out, "draft")
    assert stats.accepted > stats.drafted / 2  # the same model in another format agrees mostly


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["ngram:3:4", "self:sink:16:4"])
def test_native_step_and_a_sink_target_keep_plain_greedy_tokens(native, spec):
    """The native decode step (plain) against eager verification rows; a sink target policy whose eviction the rows
    never cross (each row shortened to fit before it), so every cut is allowed."""
    for prompt in PROMPTS[:2]:
        ids = native.encode(prompt)
        out, _ = _speculative(native, ids, spec)
        _same_or_near_tie(native, ids, _plain(native, ids), out, f"native {spec}")
    ids = native.encode(PROMPTS[0])

    def sink():
        return make_policy("sink", 48, n_sink=4, block=8, chunk=64)
    out, stats = _speculative(native, ids, spec, policy=sink())
    _same_or_near_tie(native, ids, _plain(native, ids, sink()), out, f"sink target {spec}")
    assert stats.steps < NEW


@pytest.fixture(scope="module")
def file_lm():
    """The default load (the file's own quantized weights), the native step on one thread."""
    import attnlab
    lm = attnlab.load("smollm2-135m", threads=1)
    if lm.compiled is None:
        pytest.skip("no native decode step here (C++ kernels unavailable)")
    return lm


def _view(lm, native: bool, kv: str, attention=None):
    view = copy.copy(lm.with_attention(attention))
    view.kv_dtype = {"float16": torch.float16, "int8": torch.int8}[kv]
    view.compiled = lm.compiled if native else None
    return view


@pytest.mark.parametrize("native", [True, False], ids=["native", "eager"])
@pytest.mark.parametrize("kv", ["float16", "int8"])
@pytest.mark.parametrize("target", ["full", "sink", "quest"])
def test_a_verification_row_computes_each_token_bit_for_bit_as_a_decode_step(file_lm, native, kv, target):
    """Row.verify: K + 1 tokens in one step, each token's logits the very bits of decoding them one by one (the
    quantized file, where a prompt chunk's kernels differ by ~0.5 in a logit), the native step covering the row in
    one call."""
    lm = _view(file_lm, native, kv, "quest:32" if target == "quest" else None)
    policy = make_policy("sink", 48, n_sink=4, block=8, chunk=64) if target == "sink" else None
    cache = lm.new_cache(capacity=128, policy=policy)
    ids = lm.encode(PROMPTS[0])[:40]
    logits, seen, singles, toks = lm.prefill(torch.tensor([ids]), cache), cache.seen, [], []
    for _ in range(6):
        toks.append(int(logits[0].argmax()))
        logits = lm.step(Batch.one([[toks[-1]]], cache))[0][:, -1]
        singles.append(logits[0])
    cache.truncate(seen)
    calls = dict(lm.compiled.calls) if native else None
    rows = lm.step(Batch.one([toks], cache, "all", verify=True))[0][0]
    assert all(torch.equal(a, b) for a, b in zip(singles, rows))
    if native:
        assert lm.compiled.calls["native"] == calls["native"] + 1 and lm.compiled.calls["eager"] == calls["eager"]
    for wants in ("last", "none"):  # the native step makes the head's rows that are asked for only
        cache.truncate(seen)
        got = lm.step(Batch.one([toks], cache, wants, verify=True))[0]
        assert got is None if wants == "none" else torch.equal(got[0, -1], rows[-1])
    if native:  # the row's tokens share one binding of their cache (a sequence id), not one each
        assert len(lm.compiled._bound) == 1
    cache.truncate(seen)
    chunk = lm.step(Batch.one([toks], cache, "all"))[0][0]  # a chunk of sampled tokens: the prompt kernels
    assert not torch.equal(chunk, rows)


def test_chat_replies_are_plain_replies_turn_after_turn(file_lm):
    """ChatSession (`attnlab chat --speculative`): each turn's reply is plain decoding's, the drafter kept across
    turns, and the session's cache holds exactly what plain decoding's does between turns."""
    from attnlab.chat import ChatSession
    spec_lm = copy.copy(file_lm)
    spec_lm.options = file_lm.options.but(speculative="ngram")
    runs = []
    for lm in (file_lm, spec_lm):
        chat = ChatSession(lm, Sampler(0), 24)
        chat.stats = SpecStats()
        runs.append(([list(chat.ask(q)) for q in ("Repeat: one two three four.", "Again, twice.")], chat.session.ids))
    assert runs[0] == runs[1] and chat.stats.steps > 0


def test_a_reply_closed_early_keeps_only_what_was_yielded_but_the_last(file_lm):
    ids = file_lm.encode(PROMPTS[1])
    cache = file_lm.new_cache()
    logits = file_lm.prefill(torch.tensor([ids]), cache)
    gen = decode(file_lm, cache, ids, logits, Sampler(0), 32, (), SpeculativeSpec.parse("ngram:3:4"))
    got = [next(gen) for _ in range(6)]
    gen.close()
    assert cache.seen == len(ids) + 5
    assert list(file_lm.stream(ids, file_lm.new_cache(), Sampler(0), 6, stop_at_eos=False)) == got


def test_stream_and_generate_take_the_option(smollm2):
    ids = smollm2.encode(PROMPTS[1])
    plain = smollm2.generate(PROMPTS[1], max_new_tokens=16)
    stats = SpecStats()
    assert smollm2.generate(PROMPTS[1], max_new_tokens=16, speculative="ngram", stats=stats) == plain
    assert stats.tokens == 16 and stats.steps < 16
    with pytest.raises(AttnlabError, match="one prompt"):
        smollm2.generate([PROMPTS[1], PROMPTS[2]], max_new_tokens=4, speculative="ngram")
    cache = smollm2.new_cache(policy=make_policy("h2o", 64))
    with pytest.raises(AttnlabError, match="scoring by attention"):
        list(smollm2.stream(ids, cache, Sampler(0), 4, speculative="ngram"))


def test_a_draft_model_with_another_vocabulary_is_refused(tiny):
    with pytest.raises(AttnlabError, match="vocabulary"):
        spec_mod.make_drafter(tiny, SpeculativeSpec.parse("draft:smollm2-135m"))


@pytest.mark.parametrize("text,want", [("ngram", ("ngram", 8, 3, True)), ("ngram:2", ("ngram", 8, 2, True)),
                                       ("ngram:2:6", ("ngram", 6, 2, False)), ("ngram:2:a5", ("ngram", 5, 2, True)),
                                       ("self:sink:64", ("self", 8, 3, True)),
                                       ("self:quest:1024:5", ("self", 5, 3, False)),
                                       ("draft:a/b.gguf:2", ("draft", 2, 3, False)),
                                       ("draft:a/b.gguf:a3", ("draft", 3, 3, True)),
                                       ("draft:C:/m.gguf", ("draft", 8, 3, True))])
def test_specs_parse(text, want):
    s = Options(speculative=text).speculative
    assert (s.kind, s.k, s.n, s.adaptive) == want and SpeculativeSpec.parse(str(s)) == s


@pytest.mark.parametrize("text", ["medusa", "ngram:x", "ngram:1:2:3", "self:h2o:64", "self:sink", "draft:",
                                  "ngram:0", "self:sink:16:0", "ngram:3:a", "ngram:3:a0", "self:sink:8:ax"])
def test_bad_specs_are_one_line_errors(text):
    with pytest.raises(AttnlabError) as e:
        Options(speculative=text)
    assert "\n" not in str(e.value)


def _simulate(a: AdaptiveK, steps: int, accept_all: bool, t0: float, t1: float, d: float) -> list[int]:
    """The K a chooses over steps whose drafts are all kept (or all rejected), with costs t0 + t1 k and d per draft."""
    ks = []
    for _ in range(steps):
        k = a.choose(8)
        a.update(k, k if accept_all else 0, d * k, k, t0 + t1 * k)
        ks.append(k)
    return ks


def test_adaptive_k_drafts_most_when_drafts_are_kept_and_checking_them_is_cheap():
    assert _simulate(AdaptiveK(8), 40, True, 0.010, 0.001, 0.0)[-10:] == [8] * 10


def test_adaptive_k_falls_back_to_plain_steps_where_fixed_k_loses():
    """Drafts rejected, or a drafter as slow as the target: plain steps (k = 0), a one-draft probe every PROBE."""
    for accept_all, d in ((False, 0.0), (True, 0.010)):
        ks = _simulate(AdaptiveK(8), 64, accept_all, 0.010, 0.003, d)[-32:]
        assert set(ks) <= {0, 1} and ks.count(1) <= 32 // AdaptiveK.PROBE + 1, (accept_all, ks)


def test_adaptive_k_recovers_when_drafts_start_being_kept():
    a = AdaptiveK(8)
    _simulate(a, 40, False, 0.010, 0.002, 0.0)
    assert _simulate(a, 80, True, 0.010, 0.002, 0.0)[-5:] == [8] * 5


def test_ngram_proposes_what_followed_the_longest_latest_match():
    d = NgramDrafter(3)
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 2, None) == ([7, 5], None)  # 2,3 last seen before 7
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3, 7, 4, 1, 2, 3], 3, None)[0] == [7, 5, 2]  # longest: 1,2,3
    assert NgramDrafter(2).propose([4, 5, 6], 3, None) == ([], None)


# ---------------------------------------------------------------- speculative sampling: the target's distribution

V = 4
P1 = torch.tensor([0.5, 0.3, 0.15, 0.05])
P2 = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.4, 0.1, 0.4, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
Q1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
Q2 = torch.tensor([[0.4, 0.2, 0.2, 0.2], [0.1, 0.1, 0.1, 0.7], [0.6, 0.2, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
UNIFORM = torch.full((V,), 1 / V)


def _two_tokens(gen, one_hot: bool) -> tuple[int, int]:
    """The first two tokens of speculative sampling with k = 2: drafts from q (or fixed, q one-hot), one `accept`
    per verification step, as `decode` runs it."""
    def draft(q):
        return int(torch.multinomial(q, 1, generator=gen))
    d1 = 2 if one_hot else draft(Q1)
    d2 = 1 if one_hot else draft(Q2[d1])
    q = None if one_hot else torch.stack([Q1, Q2[d1]])
    n, nxt = accept(torch.stack([P1, P2[d1], UNIFORM]), [d1, d2], q, gen)
    if n == 2:
        return d1, d2
    if n == 1:
        return d1, nxt
    d2 = 1 if one_hot else draft(Q2[nxt])
    kept, second = accept(torch.stack([P2[nxt], UNIFORM]), [d2], None if one_hot else Q2[nxt][None], gen)
    return nxt, d2 if kept else second


def _chi_square(one_hot: bool, draws: int = 2000) -> float:
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(V, V)
    for _ in range(draws):
        a, b = _two_tokens(gen, one_hot)
        counts[a, b] += 1
    expected = (P1[:, None] * P2).flatten() * draws
    return float(chisquare(counts.flatten().numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-q", "one-hot-q"])
def test_speculative_sampling_draws_the_targets_next_two_tokens(one_hot):
    assert _chi_square(one_hot) > 0.01


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-q", "one-hot-q"])
def test_a_wrong_acceptance_rule_fails_the_same_test(monkeypatch, one_hot):
    monkeypatch.setattr(spec_mod, "residual", lambda p, q: p)  # resample from p, not max(0, p - q)
    assert _chi_square(one_hot) < 0.01


def test_sampled_speculative_decoding_keeps_top_k(smollm2):
    """At temperature > 0 through the model: every token is one of the target's top 2 at its position."""
    ids = smollm2.encode(PROMPTS[1])
    cache = smollm2.new_cache()
    logits = smollm2.prefill(torch.tensor([ids]), cache)
    out = list(decode(smollm2, cache, ids, logits, Sampler(1.0, top_k=2, seed=0), 24, (),
                      SpeculativeSpec.parse("ngram")))
    full = smollm2.logits(torch.tensor([ids + out]))[0, len(ids) - 1:-1]
    top2 = full.topk(2).indices
    assert all(t in top2[i].tolist() for i, t in enumerate(out))


def test_cli_generate_speculative_prints_the_same_text_and_its_stats(capsys):
    from attnlab.cli import main
    args = ["generate", "--prompt", PROMPTS[1], "--max-new-tokens", "12", "--threads", "1", "--dtype", "float32"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculative", "ngram:2:3", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out == plain and "drafted" in err and "tokens_per_step" in err
    assert main([*args, "--speculative", "ngram:x"]) != 0
    assert "bad speculative spec" in capsys.readouterr().err
