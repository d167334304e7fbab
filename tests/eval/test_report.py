"""`attnlab report`: every kind of run is recognised and shown with its command, table and figures, on a
page that needs nothing but itself (and, in Chromium, loads, renders every figure and fetches nothing)."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from attnlab.eval.report import collect, render

REPO = Path(__file__).resolve().parents[2]


def _png(path: Path, label: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1, 2], [1, 0.5, 0.8], label=label)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=60)
    plt.close(fig)


@pytest.fixture
def runs(tmp_path) -> Path:
    r = tmp_path / "runs"
    stream = r / "stream" / "smollm2-shakespeare_test"
    stream.mkdir(parents=True)
    for policy, budget, ppl in (("full", 512, 20.0), ("sink", 64, 22.0)):
        (stream / f"{policy}.json").write_text(json.dumps({
            "policy": policy, "budget": budget, "positions": "cache", "tokens": 511, "ppl": ppl, "nll": 3.0,
            "tokens_per_s": 50.0, "mode": "decode", "model": "smollm2-135m", "text": "shakespeare:test",
            "stream_tokens": 512, "streams": 1, "chunk": 1, "nll_tokens": [[3.0] * 511]}))
    _png(stream / "positions.png", "stream")
    (r / "passkey.json").write_text(json.dumps({"model": "m", "policy": "sink(budget=64)", "rope": None, "trials": 2,
                                                "seed": 0, "results": [
        {"length": 1024, "depth": d, "trials": 2, "correct": 1, "accuracy": 0.5, "answers": []} for d in (0.1, 0.9)]}))
    ruler = r / "ruler" / "m"
    ruler.mkdir(parents=True)
    (ruler / "summary.json").write_text(json.dumps({
        "command": "attnlab ruler m --lengths 512", "tasks": ["niah_single"], "lengths": [512], "ratios": [0.5],
        "samples": 1, "seed": 0, "cells": [{"task": "niah_single", "length": 512, "policy": p, "ratio": x,
                                            "samples": 1, "score": s} for p, x, s in (("full", 0.0, 100.0),
                                                                                      ("sink", 0.5, 0.0))]}))
    _png(ruler / "ruler.png", "ruler")
    lm = r / "lm-eval" / "full"
    lm.mkdir(parents=True)
    (lm / "attnlab_summary.json").write_text(json.dumps({
        "command": "attnlab lm-eval --tasks attnlab_nextline", "model_args": "policy=sink,budget=64",
        "results": {"attnlab_nextline": {"alias": "attnlab_nextline", "acc,none": 0.4, "acc_stderr,none": 0.05}}}))
    (lm / "model").mkdir()
    (lm / "model" / "results_2026.json").write_text(json.dumps({"results": {}, "versions": {}}))
    _png(r / "loose" / "extra.png", "loose")
    (r / "notes.json").write_text("{not json")
    return r


def test_every_kind_is_recognised_with_command_table_and_figure(runs):
    sections = {s.kind: s for s in collect([runs])}
    assert set(sections) == {"stream", "passkey", "ruler", "lm-eval", "figures"}
    st = sections["stream"]
    assert st.command.startswith("attnlab stream smollm2-135m --text shakespeare:test --tokens 512")
    assert ["sink", 64] == st.rows[1][:2] and st.rows[1][5] == "1.100x" and st.figures[0].name == "positions.png"
    assert sections["passkey"].rows == [[1024, "0.5", "0.5"]]
    assert sections["ruler"].command == "attnlab ruler m --lengths 512" and sections["ruler"].figures
    assert sections["lm-eval"].rows == [["attnlab_nextline", "acc", "0.4", "0.05"]]
    assert [f.name for f in sections["figures"].figures] == ["extra.png"]
    assert all(s.note for s in sections.values())


def test_page_is_self_contained(runs):
    page = render(collect([runs]))
    assert page.count("<img") == 3 and page.count("src=\"data:image/png;base64,") == 3
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", page)
    assert "What to look for" in page and "attnlab ruler m --lengths 512" in page


def test_cli_writes_the_page(runs, tmp_path, capsys):
    from attnlab.cli import main
    out = tmp_path / "r.html"
    assert main(["report", str(runs), "--out", str(out)]) == 0
    assert "5 runs" in capsys.readouterr().out and out.read_text().startswith("<!doctype html>")
    assert main(["report", str(runs), "--out", str(tmp_path / "r.txt")]) == 2


@pytest.mark.browser
def test_page_renders_in_chromium(runs, tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("needs chromium and chromium-driver (make browser-deps)")
    from selenium.webdriver.chrome.service import Service

    from attnlab.eval.report import build_report
    # the real runs shipped in the repository (docs/figures/eval holds a RULER and an lm-eval run)
    page, n = build_report([REPO / "docs" / "figures"], tmp_path / "report.html")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1200,900"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    b = webdriver.Chrome(service=Service(driver), options=opts)
    try:
        b.get(page.as_uri())
        assert b.title == "attnlab runs"
        assert b.execute_script("return document.readyState") == "complete"
        sizes = b.execute_script("return [...document.images].map(i => [i.complete, i.naturalWidth])")
        assert len(sizes) >= 20 and all(done and width > 0 for done, width in sizes)
        assert len(b.find_elements("css selector", "section")) == n
        # nothing fetched but the page itself: every network request is the file or an inline image
        urls = [json.loads(e["message"])["message"].get("params", {}).get("request", {}).get("url", "")
                for e in b.get_log("performance")]
        assert page.as_uri() in urls  # the log does see requests
        fetched = [u for u in urls if u and not u.startswith(("data:", page.as_uri()))]
        assert fetched == []
        shot = tmp_path / "report.png"
        b.save_screenshot(str(shot))
        if os.environ.get("ATTNLAB_SCREENSHOT"):
            shutil.copy(shot, os.environ["ATTNLAB_SCREENSHOT"])
    finally:
        b.quit()
