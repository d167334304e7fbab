"""The lm-eval backend: its numbers are our evaluators' numbers (perplexity windows, LM.logits, stream_nll)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from attnlab.eval.lmeval import AttnlabLM  # noqa: E402
from attnlab.eval.perplexity import perplexity  # noqa: E402
from attnlab.eval.streaming import stream_nll  # noqa: E402
from attnlab.kv.policies import make_policy  # noqa: E402
from tests.conftest import tiny_lm  # noqa: E402

TEXT = ("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer the slings and arrows "
        "of outrageous fortune, or to take arms against a sea of troubles and by opposing end them.")


class CharTokenizer:
    """One token per character (ids 1..96), EOS 0: enough to drive the tiny random model through lm-eval."""
    eos_token_id, bos_token_id = 0, None

    def encode(self, text, add_special_tokens=False):
        return [1 + (ord(c) - 32) % 96 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + (i - 1) % 96) for i in ids if i)


class Req:
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def lm():
    m = tiny_lm(context_length=64)
    m.tokenizer = CharTokenizer()
    return m


def backend(lm, **kw):
    return AttnlabLM(lm=lm, **kw)


def test_rolling_equals_ppl_windows(lm):
    """lm-eval's disjoint windows of max_length tokens are `attnlab ppl`'s windows on [prefix] + tokens.
    (Only a partial last window differs: lm-eval gives it a full window of context, ppl does not.)"""
    b = backend(lm, max_length=48)
    text = TEXT[:3 * 48]  # one token a character: three whole windows
    ids = [b.prefix_token_id] + b.tok_encode(text)
    got = b.loglikelihood_rolling([Req(text)])[0]
    ref = perplexity(lm, ids, window=48, chunk=16)
    assert ref["tokens"] == len(ids) - 1
    assert got == pytest.approx(-ref["nll"] * ref["tokens"], rel=1e-5)


def test_loglikelihood_equals_logits(lm):
    b = backend(lm, batch_size=3)
    pairs = [("The sea", " of troubles"), ("To be, or not", " to be"), ("Whether", " 'tis nobler"), ("a", "b")]
    got = b.loglikelihood([Req(c, x) for c, x in pairs])
    for (ctx, cont), (logp, greedy) in zip(pairs, got):
        c, x = b.tok_encode(ctx), b.tok_encode(cont)
        ids = torch.tensor([c + x])
        lp = F.log_softmax(lm.logits(ids[:, :-1])[0].float(), -1)[len(c) - 1:]
        want = lp.gather(-1, torch.tensor(x)[:, None]).sum()
        assert logp == pytest.approx(float(want), abs=1e-4)
        assert greedy == bool((lp.argmax(-1) == torch.tensor(x)).all())
    # a continuation that is the argmax reads as greedy
    c = b.tok_encode("The sea")
    top = int(lm.logits(torch.tensor([c]))[0, -1].argmax())
    assert b.loglikelihood([Req("The sea", b.tok_decode([top]))])[0][1] is True


@pytest.mark.parametrize("name,chunk", [("sink", 1), ("h2o", 1), ("window", 8)])
def test_policy_numbers_equal_stream_nll(lm, name, chunk):
    b = backend(lm, policy=name, budget="24", n_sink=2, chunk=chunk)
    ids = [b.prefix_token_id] + b.tok_encode(TEXT[:90])
    pol = make_policy(name, 24, n_sink=2, chunk=chunk)
    ref = stream_nll(lm, torch.tensor(ids), pol, mode="decode" if chunk == 1 else "chunk", chunk=chunk)["nll"][0]
    got = b.loglikelihood_rolling([Req(TEXT[:90])])[0]
    assert got == pytest.approx(-float(ref.sum()), rel=1e-5)
    # a continuation's log-likelihood is the tail of the stream of context + continuation (no prefix token)
    ctx, cont = TEXT[:69], TEXT[69:90]  # the space opens the continuation, as lm-eval would move it
    logp, _ = b.loglikelihood([Req(ctx, cont)])[0]
    ref = stream_nll(lm, torch.tensor(ids[1:]), pol, mode="decode" if chunk == 1 else "chunk", chunk=chunk)["nll"][0]
    assert logp == pytest.approx(-float(ref[-len(b.tok_encode(cont)):].sum()), rel=1e-5)
    # and the policy is live: the full cache scores the same tokens differently
    full = backend(lm).loglikelihood([Req(ctx, cont)])[0][0]
    assert abs(full - logp) > 1e-3


def test_policy_within_budget_equals_full(lm):
    short = backend(lm, policy="sink", budget="200", chunk=4)
    full = backend(lm)
    assert short.loglikelihood([Req("To be", " or not")])[0][0] == pytest.approx(
        full.loglikelihood([Req("To be", " or not")])[0][0], abs=1e-4)


def test_generate_until_stops_at_the_stop_string(lm):
    b = backend(lm)
    ctx = "To be, or not"
    free = b.generate_until([Req(ctx, {"until": ["\x7f"], "max_gen_toks": 12})])[0]
    assert len(free) == 12
    stop = free[5]
    cut = b.generate_until([Req(ctx, {"until": [stop], "max_gen_toks": 12})])[0]
    assert cut == free.split(stop)[0]
    # greedy decoding is the argmax chain of LM.logits
    ids = b.tok_encode(ctx)
    for _ in range(4):
        ids.append(int(lm.logits(torch.tensor([ids]))[0, -1].argmax()))
    assert free.startswith(b.tok_decode(ids[-4:]))


def test_bad_policy_is_one_clear_error(lm):
    from attnlab.errors import AttnlabError
    with pytest.raises(AttnlabError, match="unknown policy"):
        backend(lm, policy="nope")
    assert math.isfinite(backend(lm).loglikelihood_rolling([Req("x y")])[0])


def test_shipped_task_files_are_what_the_generator_writes(tmp_path):
    from attnlab.eval.lmeval_tasks import FILES, TASK_DIR, write_tasks
    write_tasks(tmp_path)
    for name in FILES.values():
        assert (tmp_path / name).read_bytes() == (TASK_DIR / name).read_bytes(), name
    import json
    docs = [json.loads(x) for x in (TASK_DIR / FILES["nextline"]).read_text().splitlines()]
    assert len(docs) == 300 and all(len(d["choices"]) == 4 and 0 <= d["gold"] < 4 for d in docs)
    assert {d["play"] for d in docs} == {"hamlet", "macbeth", "a-midsummer-night-s-dream"}  # held out


@pytest.mark.slow
def test_parity_on_smollm2(smollm2):
    """The same checks on the embedded model: rolling = `attnlab ppl`'s windows, loglikelihood = LM.logits."""
    from attnlab.data import corpus
    b = AttnlabLM(lm=smollm2, max_length=256)
    ids = b.tok_encode(corpus("shakespeare:test")[:6000])[:2 * 256]
    text = b.tok_decode(ids)
    tokens = b.tok_encode(text)
    assert len(tokens) % 256 == 0 or pytest.skip("decode/encode round trip changed the token count")
    got = b.loglikelihood_rolling([Req(text)])[0]
    ref = perplexity(smollm2, [b.prefix_token_id] + tokens, window=256, chunk=128)
    assert got == pytest.approx(-ref["nll"] * ref["tokens"], rel=1e-5)
    ctx, cont = text[:400], text[400:460]
    (logp, _), = b.loglikelihood([Req(ctx, cont)])
    c, x = b._encode_pair(ctx, cont)
    lp = F.log_softmax(smollm2.logits(torch.tensor([c + x])[:, :-1])[0].float(), -1)[len(c) - 1:]
    assert logp == pytest.approx(float(lp.gather(-1, torch.tensor(x)[:, None]).sum()), abs=1e-3)


def test_local_tasks_run_through_lm_eval(lm):
    """The shipped YAMLs load from the include path and lm-eval's evaluator scores them with the backend."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from attnlab.eval.lmeval_tasks import TASK_DIR
    from lm_eval.api.registry import get_model
    assert get_model("attnlab") is AttnlabLM  # simple_evaluate(model="attnlab", ...) finds it by name
    tm = TaskManager(include_path=[str(TASK_DIR)], include_defaults=False)
    assert {"attnlab_nextline", "attnlab_cloze", "attnlab_plays_ppl", "attnlab_shakespeare"} <= set(tm.all_tasks)
    res = lm_eval.simple_evaluate(model=backend(lm, max_length=64), tasks=["attnlab_nextline", "attnlab_plays_ppl"],
                                  task_manager=tm, limit=3, bootstrap_iters=0, log_samples=False)
    assert 0 <= res["results"]["attnlab_nextline"]["acc,none"] <= 1
    assert res["results"]["attnlab_plays_ppl"]["word_perplexity,none"] > 1


@pytest.mark.parametrize("argv,message", [
    (["lm-eval", "--tasks", "nope"], "unknown lm-eval task 'nope'"),
    (["lm-eval", "--model-args", "policy"], "key=value"),
    (["lm-eval", "--include-path", "/nonexistent/tasks"], "not a folder"),
    (["lm-eval", "--tasks", ","], "--tasks is empty"),
])
def test_cli_errors_are_one_line(argv, message, capsys):
    from attnlab.cli import main
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
