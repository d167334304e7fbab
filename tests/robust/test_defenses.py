"""The perplexity filter on SmolLM2 (a random-token suffix flagged, ordinary lines not), SmoothLLM's perturbation
rate and vote, the guard spec, the suffix's attention share."""
from __future__ import annotations

import random

import pytest
import torch

from attnlab.errors import AttnlabError
from attnlab.robust.attention_share import random_suffix, suffix_share
from attnlab.robust.defenses import CALIBRATED, Guard, PerplexityFilter, SmoothLLM, perturb
from attnlab.robust.gcg import allowed_tokens, make_case

THRESHOLD = CALIBRATED["SmolLM2-135M-Instruct.Q4_1.gguf", "text"]
LINES = ["To be, or not to be, that is the question.", "Tell me about the sea.",
         "Can you summarize what you know about glaciers?", "What is the capital of France?"]


@pytest.fixture(scope="module")
def random_prompt(smollm2):
    allowed = allowed_tokens(smollm2.tokenizer, smollm2.cfg.vocab_size, "all")
    return "What is the capital of France?" + smollm2.tokenizer.decode(random_suffix(allowed, 20, 0))


@pytest.mark.parametrize("context", ["chat", "text"])
def test_perplexity_filter_flags_random_suffix_not_ordinary_lines(smollm2, random_prompt, context):
    threshold = CALIBRATED["SmolLM2-135M-Instruct.Q4_1.gguf", context]
    filt = PerplexityFilter(smollm2, threshold, context=context)
    for line in LINES:
        v = filt.check(line)
        assert not v.flagged and v.reason == "" and 0 < v.score < threshold
    v = filt.check(random_prompt)
    assert v.flagged and "perplexity filter" in v.reason and f"{threshold:g}" in v.reason
    whole = PerplexityFilter(smollm2, threshold, window=None, context=context)
    assert whole.score(random_prompt) < v.score  # the whole-prompt mean dilutes the suffix in the fluent part


@pytest.mark.parametrize("context", ["chat", "text"])
def test_window_is_the_worst_mean_of_the_users_tokens(smollm2, context):
    filt = PerplexityFilter(smollm2, 1.0, window=3, context=context)
    text = "Tell me about the sea, and about the mountains too."
    ids, [(a, b)] = filt.tokens(text)
    assert smollm2.tokenizer.decode(ids[a:b]).strip() == text  # the span is the user's text, nothing else
    if context == "chat":  # the template around it: the system prompt before, the assistant's turn after
        assert a > 5 and b < len(ids) - 2 and ids == smollm2.chat_ids([{"role": "user", "content": text}])
    else:
        assert (a, b) == (0, len(ids)) and filt.score(ids) == pytest.approx(filt.score(text))  # ids or text alike
    nll = filt.nll(ids)
    assert nll[0].isnan() and not nll[1:].isnan().any()
    scored = nll[max(a, 1):b]
    worst = max(float(scored[i:i + 3].mean()) for i in range(len(scored) - 2))
    assert filt.score(text) == pytest.approx(worst, rel=1e-5)


def test_user_spans_are_the_users_messages_not_a_reply_quoting_them():
    from attnlab.robust.defenses import user_spans

    def render(messages):
        return "".join(f"<s>{m['role']}: {m['content']}</s>" for m in messages)

    def encode(text):  # a character a token: the spans are the characters' ranges
        return list(text)
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "hi"}, {"role": "user", "content": ""}]
    text = render(messages)
    assert user_spans(messages, text, render, encode) == [(9, 17), (50, 52)]  # not the reply's "hi" at 35
    assert [text[a:b] for a, b in user_spans(messages, text, render, encode)] == ["hi there", "hi"]

    def stripping(messages):  # a template that does not copy the content verbatim: the whole prompt is checked
        return render([{**m, "content": m["content"].strip()} for m in messages])
    odd = [{"role": "user", "content": " hi "}]
    assert user_spans(odd, stripping(odd), stripping, encode) == [(0, len(stripping(odd)))]


def test_perturbation_rate():
    text = "é" * 200  # no printable character equals it: every swap shows
    out = perturb(text, 0.1, random.Random(0))
    assert len(out) == 200 and sum(a != b for a, b in zip(text, out)) == 20
    assert perturb(text, 0.1, random.Random(0)) == out  # seeded
    assert sum(a != b for a, b in zip(text, perturb(text, 0.25, random.Random(1)))) == 50


def test_smoothllm_vote_and_calls(smollm2):
    s = SmoothLLM(None, judge=lambda r: r.startswith("yes"), copies=3)
    assert s.vote(["yes a", "no", "yes b"]) == (True, [True, False, True])
    assert s.vote(["yes", "no"])[0] is False  # a tie is not a majority
    judge_calls = []
    s = SmoothLLM(smollm2, judge=lambda r: judge_calls.append(r) or True, copies=3, max_new=3)
    reply, verdict = s.reply("What is the capital of France?")
    assert s.calls == 3 and len(judge_calls) == 3 and verdict.flagged and verdict.score == 1.0
    assert reply in judge_calls and "3 of 3" in verdict.reason
    with pytest.raises(AttnlabError):
        SmoothLLM(None, judge=bool, rate=0)


def test_guard_spec(smollm2):
    assert Guard.parse("ppl") == Guard("ppl", None, None)
    assert Guard.parse("ppl:7.5") == Guard("ppl", 7.5, 7.5)  # one threshold for chat messages and raw prompts
    assert Guard.parse("ppl:7.5:9") == Guard("ppl", 7.5, 9.0) and Guard.parse("ppl::9") == Guard("ppl", None, 9.0)
    for bad in ("ppl:x", "ppl:-1", "smooth", "ppl:9:x", "ppl:1:2:3"):
        with pytest.raises(AttnlabError):
            Guard.parse(bad)
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    chat, text = Guard.parse("ppl::9").build(smollm2, "chat"), Guard.parse("ppl::9").build(smollm2, "text")
    assert (chat.threshold, chat.context, text.threshold, text.context) == (CALIBRATED[name, "chat"], "chat", 9, "text")


def test_suffix_share_is_a_share_per_layer(smollm2):
    case = make_case(smollm2, "What is the capital of France?", "Sure")
    shares = suffix_share(smollm2, case, smollm2.tokenizer.encode(" ! ! ! !", add_special_tokens=False))
    assert len(shares) == smollm2.cfg.n_layers and all(0 <= s <= 1 for s in shares)
    assert smollm2.tokenizer.decode(case.before[case.prompt_start:]) == "What is the capital of France?"


def test_calibration_fits_one_half_and_counts_the_other():
    from attnlab.robust.evaluate import calibrate

    class Scores:  # a filter whose score is the prompt's number: the split and the quantile are what is tested
        threshold = 0.0

        def score(self, text):
            return float(text)
    rows = [{"source": "a" if i % 2 else "b", "text": str(i / 10)} for i in range(2000)]
    filt = Scores()
    out = calibrate(filt, rows, quantile=0.9, seed=3)
    assert out["fit_prompts"] == out["held_out"] == 1000
    scores = [r["score"] for r in rows]
    order = list(range(2000))
    random.Random(3).shuffle(order)
    fit_scores = torch.tensor([scores[i] for i in order[:1000]])
    assert filt.threshold == pytest.approx(round(int(float(fit_scores.quantile(0.9)) * 10 + 1) / 10, 1))
    above = sum(scores[i] > filt.threshold for i in order[1000:])
    assert out["false_positive_rate"] == above / 1000 and 0.05 < out["false_positive_rate"] < 0.15
    assert sum(s["held_out"] for s in out["by_source"].values()) == 1000
    assert sum(s["flagged"] for s in out["by_source"].values()) == above


def test_ordinary_prompts_hold_out_a_thousand(smollm2):
    from attnlab.robust.pairs import ordinary_prompts
    rows = ordinary_prompts(smollm2.encode, ruler=7)
    assert {r["source"] for r in rows} == {"plays", "chat", "ruler"}
    assert sum(r["source"] == "plays" for r in rows) == 1400 and sum(r["source"] == "chat" for r in rows) == 520
    assert len({r["text"] for r in rows if r["source"] != "ruler"}) > 1900  # drawn lines, few repeats
    assert rows == ordinary_prompts(smollm2.encode, ruler=7)  # deterministic in its seed


def test_attacked_prompts_of_ours_and_of_nanogcg():
    from attnlab.robust.evaluate import attacked_prompts
    from attnlab.robust.pairs import PAIRS
    ours = attacked_prompts([{"pair": 3, "prompt": "Q?", "target": "T", "suffix": " x y", "success": True,
                              "tokens": "punct"}])
    assert ours == [{"pair": 3, "text": "Q? x y", "target": "T", "success": True, "variant": "punct"}]
    peer = attacked_prompts([{"pair": 3, "suffix": " x y", "success": False}], "nanogcg")
    assert peer == [{"pair": 3, "text": PAIRS[3][0] + " x y", "target": PAIRS[3][1], "success": False,
                     "variant": "nanogcg"}]
