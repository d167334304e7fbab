"""`attnlab ppl --scoring llamacpp` on a tiny random model: the number is llama-perplexity's formula (second
halves of n_ctx chunks, BOS in front of each), the decode path gives the prefill path's number, and the rules
llama-perplexity enforces hold."""
from __future__ import annotations

import math

import pytest
import torch

from attnlab.errors import AttnlabError
from attnlab.eval.perplexity import adds_bos, llamacpp_perplexity
from tests.conftest import tiny_lm

IDS = torch.randint(1, 97, (2 * 48 + 30,), generator=torch.Generator().manual_seed(1))


def by_hand(lm, ids, n_ctx, bos=None):
    """exp(mean NLL) of tokens n_ctx/2+1 .. n_ctx-1 of each whole chunk, each chunk one uncached causal pass."""
    nll = []
    for c in range(len(ids) // n_ctx):
        chunk = ids[c * n_ctx:(c + 1) * n_ctx].clone()
        if bos is not None:
            chunk[0] = bos
        logp = torch.log_softmax(lm.logits(chunk[None])[0].float(), -1)
        nll += [-float(logp[i, chunk[i + 1]]) for i in range(n_ctx // 2, n_ctx - 1)]
    return math.exp(sum(nll) / len(nll)), len(nll)


@pytest.mark.parametrize("bos", [None, 3])
def test_scores_the_second_half_of_each_chunk_like_llama_perplexity(bos):
    lm = tiny_lm()
    ppl, n = by_hand(lm, IDS, 48, bos)
    pre = llamacpp_perplexity(lm, IDS, 48, path="prefill", bos=bos)
    dec = llamacpp_perplexity(lm, IDS, 48, path="decode", bos=bos)
    assert pre["tokens"] == dec["tokens"] == n == 2 * 23 and pre["chunks"] == 2  # the last 30 tokens: no chunk
    assert pre["ppl"] == pytest.approx(ppl, rel=1e-5) and dec["ppl"] == pytest.approx(ppl, rel=1e-5)


def test_bos_replaces_each_chunks_first_token_and_chunks_limits():
    lm = tiny_lm()
    plain, with_bos = llamacpp_perplexity(lm, IDS, 48), llamacpp_perplexity(lm, IDS, 48, bos=3)
    assert plain["ppl"] != pytest.approx(with_bos["ppl"], rel=1e-6)  # the BOS is context for every scored token
    one = llamacpp_perplexity(lm, IDS, 48, chunks=1)
    assert one["tokens"] == 23 and one["ppl"] == pytest.approx(by_hand(lm, IDS[:48], 48)[0], rel=1e-5)


def test_needs_two_chunks_of_text_as_llama_perplexity_does():
    with pytest.raises(AttnlabError, match="at least 2 \\* n_ctx = 96 tokens"):
        llamacpp_perplexity(tiny_lm(), IDS[:95], 48)


class Tok:
    def __init__(self, adds, bos=7):
        self.adds, self.bos_token_id = adds, bos

    def encode(self, text, add_special_tokens=True):
        return ([self.bos_token_id] if add_special_tokens and self.adds else []) + [ord(c) for c in text]


def test_bos_only_where_the_tokenizer_adds_one():
    assert adds_bos(Tok(True)) == 7 and adds_bos(Tok(False)) is None and adds_bos(Tok(True, None)) is None


def test_cli_llamacpp_scoring_on_the_embedded_model(capsys):
    import json

    from attnlab.cli import main
    assert main(["ppl", "--text", "shakespeare:hamlet", "--tokens", "256", "--scoring", "llamacpp", "--window", "64",
                 "--n-chunks", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["chunks"] == 3 and r["tokens"] == 3 * 31 and r["n_ctx"] == 64 and 1 < r["ppl"] < 1000
    assert main(["ppl", "--scoring", "llamacpp", "--window", "63"]) == 2
    assert "even number" in capsys.readouterr().err
    assert main(["ppl", "--text", "shakespeare:hamlet", "--tokens", "100", "--scoring", "llamacpp",
                 "--window", "64"]) == 2
    assert "at least 2 * window = 128 tokens" in capsys.readouterr().err
