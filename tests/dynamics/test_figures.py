"""Stored theory results: every figure has its numbers beside it; a long J3 run resumes exactly."""
import json
import re
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[2] / "docs"
FIGS = DOCS / "figures" / "theory"


def test_every_theory_figure_has_its_json():
    pngs = sorted(FIGS.glob("*.png"))
    assert pngs
    for png in pngs:
        js = png.with_suffix(".json")
        assert js.exists(), f"{png.name} has no {js.name}"
        rec = json.loads(js.read_text())
        assert rec["figure"] == png.name and rec["command"].startswith("attnlab dynamics")


def test_every_stored_result_names_its_command_and_commit():
    """No number in the docs without the code that made it: every JSON under the theory and
    analysis figures names a command and a git commit, and none is marked transcribed."""
    files = sorted(FIGS.glob("*.json")) + sorted((DOCS / "figures" / "analysis").glob("*.json"))
    assert len(files) > 20
    for js in files:
        rec = json.loads(js.read_text())
        assert isinstance(rec.get("command"), str) and re.match(r"(attnlab|python -m attnlab)\b", rec["command"]), js.name
        assert re.fullmatch(r"[0-9a-f]{7,40}", str(rec.get("commit"))), f"{js.name}: commit {rec.get('commit')!r}"
        assert rec.get("source") != "transcribed", js.name


def test_publish_prunes_per_step_traces(tmp_path):
    from attnlab.dynamics.publish import prune, publish
    assert prune({"a": list(range(500)), "b": [1, 2], "c": {"d": list(range(201))}}) == {
        "a": {"omitted_list_len": 500}, "b": [1, 2], "c": {"d": {"omitted_list_len": 201}}}
    run = tmp_path / "run"
    run.mkdir()
    (run / "f.png").write_bytes(b"png")
    (run / "metrics.json").write_text(json.dumps({"figures": ["f.png"], "x": 1.5, "trace": list(range(300))}))
    publish(run, "attnlab dynamics test", tmp_path / "out", rename={"f.png": "g.png"})
    rec = json.loads((tmp_path / "out" / "g.json").read_text())
    assert (tmp_path / "out" / "g.png").read_bytes() == b"png"
    assert rec["metrics"] == {"x": 1.5, "trace": {"omitted_list_len": 300}} and rec["figure"] == "g.png"


def test_postln_run_resumes_bit_for_bit(tmp_path):
    """6 minibatches in one go == 4, stop, then extended to 6 from the checkpoint (model,
    optimiser, data order and dropout all restored)."""
    from attnlab.analysis.postln import train_postln
    kw = dict(dim=16, hidden_dim=16, vocab_size=1000, eval_batches=1, batch=4)
    torch.set_num_threads(1)
    straight = train_postln(1, 1e-3, 0, 6, [2, 4, 6], **kw)
    ck = tmp_path / "ck.pt"
    train_postln(1, 1e-3, 0, 4, [2, 4, 6], checkpoint=ck, save_every=2, **kw)
    resumed = train_postln(1, 1e-3, 0, 6, [2, 4, 6], checkpoint=ck, save_every=2, **kw)
    assert [r["step"] for r in resumed] == [0, 2, 4, 6]
    for a, b in zip(straight, resumed):
        assert a["val_loss"] == b["val_loss"] and a["entropy_val"] == b["entropy_val"]


def _verdicts(markdown: str) -> dict:
    """{experiment: verdict} from the first Markdown table in ``markdown`` with an 'exp.' and a
    'verdict' column (cells split on unescaped '|')."""
    rows = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            for line in markdown.splitlines() if line.strip().startswith("|")]
    head = rows[0]
    exp, verdict = head.index("exp."), head.index("verdict")
    return {r[exp]: r[verdict] for r in rows[2:]}


def test_readme_verdicts_equal_the_theory_page():
    """The README's theory verdicts (between <!-- verdicts --> markers) are docs/theory.md's
    verdict column word for word, experiment by experiment: no softer wording on the front page."""
    readme = (DOCS.parent / "README.md").read_text()
    assert readme.count("<!-- verdicts -->") == 1 and readme.count("<!-- /verdicts -->") == 1
    block = readme.split("<!-- verdicts -->")[1].split("<!-- /verdicts -->")[0]
    theory = (DOCS / "theory.md").read_text().split("## Verdicts")[1].split("\n## ")[0]
    ours, front = _verdicts(theory), _verdicts(block)
    assert len(ours) >= 8 and front == ours


def test_verdict_parser_reads_escaped_pipes_and_columns():
    table = "| exp. | claim | verdict |\n|---|---|---|\n| S1 | P(l\\|n) | reproduced |\n| J4 | x | not reproduced |"
    assert _verdicts("text\n" + table + "\nmore") == {"S1": "reproduced", "J4": "not reproduced"}
