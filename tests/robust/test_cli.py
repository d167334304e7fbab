"""`attnlab guard`: exit codes (0 none flagged, 1 some, 2 user errors before any model load) and its JSON."""
from __future__ import annotations

import json

import pytest

from attnlab.cli import main


def test_guard_cli(tmp_path, capsys):
    ok = tmp_path / "ok.txt"
    ok.write_text("Tell me about the sea.\nWhat is the capital of France?\n")
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps("Tell me about the sea.") + "\n"
                     + json.dumps({"text": "Name a fruit.zx}{ qwv]]plt@@ Rolfe mbx?? okq^ vv$#mlq"}) + "\n")
    assert main(["guard", "--prompts", str(ok), "--guard", "ppl:10.5"]) == 0
    out = capsys.readouterr().out
    assert "0 of 2 flagged" in out
    assert main(["guard", "--prompts", str(mixed), "--json"]) == 1
    res = json.loads(capsys.readouterr().out)
    assert res["flagged"] == 1 and res["window"] == 10 and res["command"].startswith("attnlab guard")
    first, second = res["prompts"]
    assert not first["flagged"] and second["flagged"] and second["score"] > res["threshold"] > first["score"]
    assert "perplexity filter" in second["reason"] and {"commit", "dirty"} <= set(res)


def test_guard_cli_user_errors(tmp_path, capsys):
    assert main(["guard", "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "no such prompts file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["guard", "--prompts", str(bad)]) == 2
    ok = tmp_path / "ok.txt"
    ok.write_text("hello\n")
    assert main(["guard", "--prompts", str(ok), "--guard", "perplexity"]) == 2
    assert "unknown guard" in capsys.readouterr().err
    assert main(["guard"]) == 2


def test_serve_guard_option_is_checked_before_loading(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--guard", "perplexity"])
    assert e.value.code == 2 and "unknown guard" in capsys.readouterr().err
