"""The theory lab's verdicts, decided from the stored result files by one set of numeric rules.

``python -m attnlab.dynamics.verdicts`` prints the verdict table; ``--write`` puts it into
docs/theory.md (between ``<!-- verdict-table -->`` markers, with the rules above it, and the
table of stored files with their commands and commits between ``<!-- files-table -->``) and the
README (between ``<!-- verdicts -->`` markers, the claim and verdict columns only). A test checks
both equal this module's output, so no verdict is written by hand. The per-experiment reading of
the files is in ``verdict_claims.py``; the rules are here, once.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

MIN_RUNS = 3      # seeds / draws / models a claim needs before it can be "reproduced"
BAND = 0.2        # ranges agree if they overlap once ours is widened by 20 % of the authors' midpoint
K_SE = 2.0        # means with spreads agree within 2 combined standard errors
EFFECT = 0.1      # a drop or rebound counts from 0.1 nats
ORTH = 1.5        # near-orthogonal: |cos| within 1.5 x sqrt(2 / (pi d))

RULES = f"""**Verdict rules** (applied by `python -m attnlab.dynamics.verdicts`, which writes the table below
and the README's from the result files; nothing in either is typed by hand). A claim is split into
*shape* checks (a sign, an ordering, a drop or rebound of at least {EFFECT} nats, a control beaten)
and *size* checks against the authors' numbers. Sizes agree when our range over runs, widened on
each side by {BAND:.0%} of the authors' midpoint, overlaps the authors' range; where both sides give a
mean and a spread over seeds (S2), when every cell differs by at most {K_SE:g} combined standard errors.
- **reproduced**: every shape check holds on every run, there are at least {MIN_RUNS} runs (seeds,
  draws or models), and every size check agrees;
- **reproduced in kind**: every shape check holds on more than half of the runs, but a size check
  misses or there are fewer than {MIN_RUNS} runs;
- **not reproduced**: a shape check fails on half of the runs or more; for a claim that training
  produces an effect, beating its controls (untrained model, shuffled labels) is one of the shape
  checks;
- **pending**: the run the claim needs is not stored (its command is given); **not tested**: the
  stored run does not exercise the claim.
For orthogonality the shape check is that co-occurring |cos| stays within {ORTH}x sqrt(2/(pi d)).
An experiment's verdict lists each of its claims; the weakest run decides each claim."""


@dataclass
class Claim:
    """One checkable part of a paper's claim: shape checks passed out of runs, size agreements."""
    name: str
    evidence: str
    passed: int = 0
    runs: int = 0
    sizes: list = field(default_factory=list)  # one bool per size comparison
    status: str = ""  # "pending" / "not tested" overrides the rules
    seeds: int = 0    # independent seeds behind the runs, when fewer than the runs (settings of one seed)

    @property
    def verdict(self) -> str:
        if self.status:
            return self.status
        if self.runs == 0 or 2 * self.passed <= self.runs:
            return "not reproduced"
        if self.passed == self.runs and (self.seeds or self.runs) >= MIN_RUNS and all(self.sizes):
            return "reproduced"
        return "reproduced in kind"

    def cell(self, alone: bool) -> str:
        head = self.verdict if alone or not self.name else f"{self.name} {self.verdict}"
        return f"{head} ({self.evidence})"


def band_agrees(ours: list[float], theirs: list[float]) -> bool:
    """Ranges overlap once ours is widened by BAND of the authors' midpoint on each side."""
    mid = (min(theirs) + max(theirs)) / 2
    w = BAND * abs(mid)
    return min(ours) - w <= max(theirs) and max(ours) + w >= min(theirs)


def se_agrees(m_o: float, s_o: float, n_o: int, m_a: float, s_a: float, n_a: int) -> bool:
    return abs(m_o - m_a) <= K_SE * (s_o ** 2 / n_o + s_a ** 2 / n_a) ** 0.5


@dataclass
class Row:
    exp: str
    claim: str
    setup: str
    ours: str
    claims: list

    @property
    def verdict(self) -> str:
        return "; ".join(c.cell(len(self.claims) == 1) for c in self.claims)


def _esc(s: str) -> str:
    return s.replace("|", "\\|")


def theory_table(rows: list[Row]) -> str:
    head = "| exp. | paper's claim | authors' setup | ours | verdict |\n|---|---|---|---|---|\n"
    return head + "\n".join(f"| {r.exp} | {_esc(r.claim)} | {_esc(r.setup)} | {_esc(r.ours)} | {_esc(r.verdict)} |"
                            for r in rows)


def readme_table(rows: list[Row]) -> str:
    head = "| exp. | paper's claim | verdict |\n|---|---|---|\n"
    return head + "\n".join(f"| {r.exp} | {_esc(r.claim)} | {_esc(r.verdict)} |" for r in rows)


def table_cells(markdown: str) -> dict:
    """{exp.: (claim, verdict)} from the first Markdown table with 'exp.', 'paper's claim' and
    'verdict' columns (cells split on unescaped '|')."""
    rows = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            for line in markdown.splitlines() if line.strip().startswith("|")]
    for i, head in enumerate(rows):
        if {"exp.", "paper's claim", "verdict"} <= set(head):
            e, c, v = head.index("exp."), head.index("paper's claim"), head.index("verdict")
            body = []
            for r in rows[i + 2:]:
                if len(r) != len(head):
                    break
                body.append(r)
            return {r[e]: (r[c], r[v]) for r in body}
    return {}


THEORY_MARK, README_MARK = "<!-- verdict-table -->", "<!-- verdicts -->"


def between(text: str, mark: str) -> str:
    end = mark.replace("<!-- ", "<!-- /")
    if text.count(mark) != 1 or text.count(end) != 1:
        raise ValueError(f"expected one {mark} ... {end} block")
    return text.split(mark)[1].split(end)[0]


def replace_between(text: str, mark: str, body: str) -> str:
    end = mark.replace("<!-- ", "<!-- /")
    before, rest = text.split(mark)
    return before + mark + "\n" + body.strip("\n") + "\n" + end + rest.split(end)[1]


def theory_block(rows: list[Row]) -> str:
    return RULES + "\n\n" + theory_table(rows)


FILES_MARK = "<!-- files-table -->"


def files_table(figs: Path) -> str:
    """Every JSON of docs/figures/theory with its figure, command and commit, read from the file (a
    backfilled record says so)."""
    import json
    lines = ["| numbers | figure | command | commit |", "|---|---|---|---|"]
    for js in sorted(figs.glob("*.json")):
        rec = json.loads(js.read_text())
        prov = rec.get("provenance") if isinstance(rec.get("provenance"), dict) else None
        if prov and "note" in prov:
            command, commit = prov["command"], f"backfilled: added in {prov['commit'][:7]}"
        else:
            command, commit = rec.get("command", ""), str(rec.get("commit", ""))[:7] + (" (dirty)" if rec.get("dirty") else "")
        png = js.with_suffix(".png")
        fig = f"[{png.name}](figures/theory/{png.name})" if png.exists() else ""
        lines.append(f"| [{js.name}](figures/theory/{js.name}) | {fig} | `{_esc(command)}` | {commit} |")
    return "\n".join(lines)


def check_docs(theory: str, readme: str, rows: list[Row], figs: Path | None = None) -> list[str]:
    """Problems: theory.md's block or the README's differs from the script's, or a README claim or
    verdict cell differs from theory.md's."""
    problems = []
    if figs is not None and between(theory, FILES_MARK).strip() != files_table(figs).strip():
        problems.append("docs/theory.md's file table is not the files' records")
    if between(theory, THEORY_MARK).strip() != theory_block(rows).strip():
        problems.append("docs/theory.md's verdict block is not the script's output")
    if between(readme, README_MARK).strip() != readme_table(rows).strip():
        problems.append("README's verdict table is not the script's output")
    ours, front = table_cells(between(theory, THEORY_MARK)), table_cells(between(readme, README_MARK))
    for exp in sorted(set(ours) | set(front)):
        if ours.get(exp) is None or front.get(exp) is None:
            problems.append(f"{exp}: in one table only")
            continue
        for what, a, b in zip(("claim", "verdict"), ours[exp], front[exp]):
            if a != b:
                problems.append(f"{exp}: README {what} cell differs from docs/theory.md")
    return problems


def main(argv=None) -> int:
    from .verdict_claims import build_rows
    argv = list(sys.argv[1:] if argv is None else argv)
    root = Path(__file__).resolve().parents[2]
    rows = build_rows()
    if "--write" not in argv:
        print(theory_block(rows))
        return 0
    from attnlab.io import write_text
    from .verdict_claims import FIGS
    for name, mark, body in (("docs/theory.md", THEORY_MARK, theory_block(rows)),
                             ("docs/theory.md", FILES_MARK, files_table(FIGS)),
                             ("README.md", README_MARK, readme_table(rows))):
        path = root / name
        write_text(path, replace_between(path.read_text(), mark, body))
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
