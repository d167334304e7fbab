"""Passkey retrieval on the embedded SmolLM2 at 256 tokens: full attention finds the key
anywhere; a sink cache finds it only while the needle is still in its recent window."""
from __future__ import annotations

import json

from attnlab.eval.passkey import NEEDLE, passkey_eval, passkey_prompt
from attnlab.kv.policies import make_policy


def test_prompt_length_and_depth(smollm2):
    for depth in (0.1, 0.9):
        ids = passkey_prompt(smollm2, 512, depth, "12345")
        assert 480 <= len(ids) <= 512
        text = smollm2.tokenizer.decode(ids)
        where = text.index(NEEDLE.format(key="12345")) / len(text)
        assert abs(where - depth) < 0.1


def test_full_retrieves_and_sink_loses_the_evicted_key(smollm2):
    full = passkey_eval(smollm2, [256], [0.1], trials=1)
    assert full[0]["accuracy"] == 1.0
    sink = make_policy("sink", 64, chunk=32)  # 4 sinks + 60 recent tokens: the early needle is evicted
    thinned = passkey_eval(smollm2, [256], [0.1, 0.9], trials=1, policy=sink, chunk=32)
    assert [r["accuracy"] for r in thinned] == [0.0, 1.0]


def test_cli_json(capsys):
    from tests.test_cli import run
    code, out, _ = run(capsys, "passkey", "--lengths", "128", "--depths", "0.5", "--trials", "1", "--json")
    assert code == 0
    row = json.loads(out)["results"][0]
    assert row["length"] == 128 and row["accuracy"] == 1.0 and row["answers"][0]["tokens"] <= 128
    code, _, err = run(capsys, "passkey", "--depths", "1.5")
    assert code == 2 and "depths" in err
