"""The RULER runner on a tiny random model: batched decoding is exact, units resume, the table and
figure come out, and the CLI refuses bad options in one line."""
from __future__ import annotations

import json

import pytest
import torch

from attnlab.eval import ruler_run
from attnlab.eval.ruler_run import budget_for, cells, generate_batch, plot, run_ruler, table
from tests.conftest import tiny_lm
from tests.eval.test_lmeval import CharTokenizer


class Tok(CharTokenizer):
    def encode(self, text, add_special_tokens=False):
        return super().encode(text)


@pytest.fixture(scope="module")
def lm():
    m = tiny_lm(context_length=1024)
    m.tokenizer = Tok()
    return m


def test_left_padded_batch_decodes_like_each_prompt_alone(lm):
    prompts = [lm.encode("To be, or not to be: that is"), lm.encode("the question")]
    alone = [generate_batch(lm, [p], [10])[0] for p in prompts]
    assert generate_batch(lm, prompts, [10, 10]) == alone
    # and a greedy row is the argmax chain of LM.logits
    ids = list(prompts[1])
    for _ in range(3):
        ids.append(int(lm.logits(torch.tensor([ids]))[0, -1].argmax()))
    assert alone[1].startswith(lm.tokenizer.decode(ids[-3:]))


def test_budget_is_the_kept_share():
    assert budget_for(1024, 0.75) == 256 and budget_for(2048, 0.5) == 1024
    with pytest.raises(ValueError):
        budget_for(1024, 1.0)


def test_units_resume_and_tables(lm, tmp_path, monkeypatch):
    args = dict(tasks=["niah_single", "fwe"], lengths=[512], policies=["sink", "h2o"], ratios=[0.5, 0.75], samples=1,
                out=tmp_path, identity={"model": "tiny"}, chunk=64)
    units = run_ruler(lm, **args)
    assert len(units) == 5 and len(list((tmp_path / "units").glob("*.json"))) == 5
    rows = cells(units)
    assert {(r["policy"], r["ratio"]) for r in rows} == {("full", 0.0), ("sink", 0.5), ("sink", 0.75), ("h2o", 0.5),
                                                         ("h2o", 0.75)}
    assert all(0 <= r["score"] <= 100 and r["samples"] == 1 for r in rows)
    assert next(u for u in units if u["policy"] == "sink" and u["ratio"] == 0.75)["budget"] == 128

    def boom(*a, **k):
        raise AssertionError("a finished unit was recomputed")
    monkeypatch.setattr(ruler_run, "run_unit", boom)
    assert run_ruler(lambda: boom(), **args) == units  # nothing to compute: the model is not even loaded
    # one more sample adds only the new index; a changed option recomputes
    monkeypatch.undo()
    (tmp_path / "units" / next((tmp_path / "units").glob("512-sink-0.5-*")).name).unlink()
    calls = []
    real = ruler_run.run_unit
    monkeypatch.setattr(ruler_run, "run_unit", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    run_ruler(lm, **{**args, "samples": 2})
    assert calls.count("sink") == 3 and len(calls) == 6
    text = table(cells(run_ruler(lm, **{**args, "samples": 2})))
    assert text.splitlines()[2].startswith("full") and "single" in text.splitlines()[0]
    assert plot(rows, tmp_path / "r.png") and (tmp_path / "r.png").stat().st_size > 1000


def test_question_protocol(lm):
    """Feeding the question after the prefill (token by token, rows of unequal questions in one batch) is
    exact: with nothing pressed it decodes like the whole prompt; pressed, each row as it would alone."""
    from attnlab.kv import make_press
    prompts = [lm.encode("To be, or not to be: that is the question"), lm.encode("Whether tis nobler in the mind")]
    context = [len(prompts[0]) - 9, len(prompts[1]) - 4]
    assert generate_batch(lm, prompts, [8, 8], press=make_press("knorm", 0.0), context=context) == \
        generate_batch(lm, prompts, [8, 8])
    press = make_press("snapkv", 0.5, window_size=8)
    batch = generate_batch(lm, prompts, [8, 8], press=press, context=context)
    assert batch == [generate_batch(lm, [p], [8], press=press, context=[c])[0] for p, c in zip(prompts, context)]


def test_question_in_answers_only_from_the_pressed_cache(lm):
    """--question in presses all but the prompt's last token and feeds that one after, so no answer token is
    read from the prefill's logits (which saw the whole, unpressed cache)."""
    from attnlab.eval.ruler_run import answer_batch, run_unit
    from attnlab.kv import make_press
    ids = lm.encode("To be, or not to be: that is the question: whether tis nobler in the mind to suffer")
    s = {"task": "niah_single", "length": len(ids), "index": 0, "ids": ids, "context_tokens": len(ids) - 9,
         "answers": ["x"], "max_new": 8, "tokens": len(ids)}
    unit = run_unit(lm, [s], "press:knorm", 0.75, 128, "original", 4, question="in")
    cache = lm.new_cache(1, capacity=len(ids) + 16, positions="original")
    lm.prefill(torch.tensor([ids[:-1]]), cache, press=make_press("knorm", 0.75))
    assert all(layer.n == int((len(ids) - 1) * 0.25) for layer in cache.layers)  # the last token not in yet
    assert unit["results"][0]["pred"] == answer_batch(lm, cache, torch.zeros(1, lm.cfg.vocab_size), [ids[-1:]], [8])[0]


def test_context_tokens_split_before_the_question(lm):
    from attnlab.eval.ruler import make_sample
    for task in ("niah_single", "vt", "cwe", "fwe"):
        s = make_sample(task, lm.encode, 4096)  # characters: the list tasks need room
        question = lm.tokenizer.decode(s["ids"][s["context_tokens"]:]).lstrip()
        assert question.startswith("What" if task.startswith("niah") else "Question:"), (task, question[:30])
        assert 10 < s["tokens"] - s["context_tokens"] < 400  # characters here


def test_press_cells_run_and_table(lm, tmp_path):
    args = dict(tasks=["niah_single"], lengths=[512], policies=["press:knorm", "press:snapkv", "press:tova:page=16"],
                ratios=[0.5], samples=1, out=tmp_path, identity={"model": "tiny"}, chunk=128)
    units = run_ruler(lm, **args, question="out")
    assert {u["policy"] for u in units} == {"full", "press:knorm", "press:snapkv", "press:tova:page=16"}
    assert all(u["question"] == "out" for u in units if u["policy"] != "full")
    assert len(run_ruler(lm, **args, question="in")) == 4 and len(list((tmp_path / "units").glob("*.json"))) == 7
    assert "press:snapkv" in table(cells(units))


@pytest.mark.parametrize("argv,message", [
    (["ruler", "--presses", "nope"], "unknown press"),
    (["ruler", "--presses", "snapkv:window_size"], "field=number"),
    (["ruler", "--lengths", "100"], "at least 512"),
    (["ruler", "--tasks", "qa"], "unknown RULER task"),
    (["ruler", "--ratios", "1.2"], "--ratios"),
    (["ruler", "--policies", "nope"], "unknown policy"),
    (["report", "/nonexistent/run"], "no such file"),
])
def test_cli_errors_are_one_line(argv, message, capsys):
    from attnlab.cli import main
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_summary_json_is_what_the_report_reads(tmp_path):
    from attnlab.eval.report import collect
    rows = [{"task": "niah_single", "length": 512, "policy": p, "ratio": r, "samples": 1, "score": s}
            for p, r, s in (("full", 0.0, 100.0), ("sink", 0.5, 0.0))]
    (tmp_path / "summary.json").write_text(json.dumps({"command": "attnlab ruler x", "tasks": ["niah_single"],
                                                       "lengths": [512], "ratios": [0.5], "samples": 1, "seed": 0,
                                                       "cells": rows}))
    (s,) = collect([tmp_path])
    assert s.kind == "ruler" and s.command == "attnlab ruler x" and "sink" in s.text


def test_cli_summary_names_the_code_that_ran(tmp_path):
    """The summary records the commit, dirty flag and seed of this session's code, taken when the run starts."""
    from attnlab.cli import main
    out = tmp_path / "r"
    assert main(["ruler", "--tasks", "niah_single", "--lengths", "512", "--samples", "1", "--seed", "3",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["command"].startswith("attnlab ruler") and summary["seed"] == 3
    assert summary["commit"] not in ("", None) and summary["dirty"] in (True, False, None)
    assert summary["wall_s"] >= 0 and summary["cells"]
