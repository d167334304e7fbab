"""attnlab.eval.decode_kl on a tiny random model: the decode path equals the prefill path in fp32, a format
scored against itself has KL 0 and full agreement, int4 does not, rows resume, and llama-perplexity's
output parses."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from attnlab.errors import AttnlabError
from attnlab.eval import decode_kl
from tests.conftest import tiny_lm

IDS = torch.randint(1, 97, (2 * 48,), generator=torch.Generator().manual_seed(0))


def int4(lm):
    from attnlab.quant import quantize_model
    q = copy.deepcopy(lm)
    quantize_model(q.model, "int4:32")
    return q


def test_decode_path_matches_prefill_path_in_fp32():
    lm = tiny_lm()
    chunk = IDS[:48]
    dec, pre = decode_kl.scored_logprobs(lm, chunk, "decode"), decode_kl.scored_logprobs(lm, chunk, "prefill")
    assert dec.shape == (23, 97)  # positions 24 .. 46 of a 48-token chunk, as llama-perplexity scores
    r = decode_kl.compare(pre, dec, chunk[25:])
    assert r["kl"] < 1e-6 and r["top1"] == 1.0
    assert r["ppl"] == pytest.approx(r["ppl_ref"], rel=1e-5)


def test_self_is_zero_int4_is_not_and_rows_resume(tmp_path):
    lm = tiny_lm()
    loads = []

    def load(f):
        return lambda: loads.append(f) or f(lm)

    formats = {"fp32": (load(lambda m: m), "decode"), "int4:32": (load(int4), "decode")}
    rows = decode_kl.evaluate(lm, formats, IDS, tmp_path, n_ctx=48, chunks=2, ident={"model": "tiny"})
    by = {r["format"]: r for r in rows}
    assert by["fp32"]["kl"] < 1e-6 and by["fp32"]["top1"] == 1.0 and by["fp32"]["tokens"] == 46
    assert by["int4:32"]["kl"] > 1e-4 and by["int4:32"]["ppl"] != by["int4:32"]["ppl_ref"]
    saved = json.loads(next(tmp_path.glob("decode_kl-*.json")).read_text())
    assert [r["format"] for r in saved["rows"]] == ["fp32", "int4:32"]
    again = decode_kl.evaluate(lm, formats, IDS, tmp_path, n_ctx=48, chunks=2, ident={"model": "tiny"})
    assert again == rows and len(loads) == 2  # finished formats are read back, not recomputed


def test_too_little_text_is_one_clear_error():
    with pytest.raises(AttnlabError, match="at least 48 tokens"):
        decode_kl.chunks_of(IDS[:40], 48)


LLAMA_OUT = """
chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1      15.0244 ±    0.5968      -0.00058 ±    0.00377       0.01171 ±    0.00042       1.234 ±  0.123 %    95.112 ±  0.674 %
====== Perplexity statistics ======
Mean PPL(Q)                   :  15.024433 ±   0.596814
Mean PPL(base)                :  15.033157 ±   0.597426
====== KL divergence statistics ======
Mean    KLD:   0.011713 ±   0.000419
Maximum KLD:   0.513218
99.9%   KLD:   0.324108
99.0%   KLD:   0.109922
Median  KLD:   0.006045
====== Token probability statistics ======
Same top p: 95.112 ± 0.674 %
"""


def test_parse_llama_perplexity():
    r = decode_kl.parse_llama_perplexity(LLAMA_OUT)
    assert r == {"ppl": 15.024433, "ppl_ref": 15.033157, "kl": 0.011713, "kl_se": 0.000419, "kl_median": 0.006045,
                 "kl_p99": 0.109922, "top1": pytest.approx(0.95112)}
    assert decode_kl.parse_llama_perplexity("[1]15.1,\nFinal estimate: PPL = 15.0244 +/- 0.59681\n") == {"ppl": 15.0244}
