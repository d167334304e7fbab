"""Local lm-eval tasks over the held-out plays (nothing to download): the JSONL files behind the
YAMLs in `attnlab/eval/tasks/`, regenerated bit for bit by `write_tasks` (a test checks it).

* attnlab_nextline (multiple choice): four lines of verse, then which of four lines comes
  next -- the true one or three lines from elsewhere in the same play (acc, acc_norm);
* attnlab_cloze (LAMBADA-style): a passage whose last word is to be predicted (acc = the
  word is the greedy continuation, and its perplexity);
* attnlab_plays_ppl (rolling log-likelihood): whole passages of about 2,000 characters
  (word and byte perplexity, bits per byte), the test split `attnlab ppl` measures.
The plays are the test split (hamlet, macbeth, a-midsummer-night-s-dream), never trained on.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

from attnlab.io import write_text

TASK_DIR = Path(__file__).parent / "tasks"
FILES = {"nextline": "nextline.jsonl", "cloze": "cloze.jsonl", "plays_ppl": "plays_ppl.jsonl"}


def _verse(play: str) -> list[list[str]]:
    """Speeches as lists of lines (speaker prefix removed; stage directions and headings dropped)."""
    from attnlab.data import play_text
    speeches = []
    for block in play_text(play).split("\n\n"):
        lines = block.split("\n")
        first = re.match(r"^[A-Z][A-Z' .-]+: (.*)$", lines[0])
        if not first:
            continue
        body = [first.group(1)] + lines[1:]
        body = [x for x in body if x and not x.startswith("[")]
        if body:
            speeches.append(body)
    return speeches


def nextline_docs(n: int, seed: int = 0) -> list[dict]:
    from attnlab.data import plays
    rng, docs = random.Random(seed), []
    pools = {p: [s for s in _verse(p) if len(s) >= 5] for p in plays("test")}
    while len(docs) < n:
        play = sorted(pools)[len(docs) % len(pools)]
        speech = rng.choice(pools[play])
        at = rng.randrange(4, len(speech))
        gold = speech[at]
        others = [x for s in pools[play] for x in s if x != gold and len(x.split()) >= 4]
        if len(gold.split()) < 4:
            continue
        choices = rng.sample(others, 3) + [gold]
        rng.shuffle(choices)
        docs.append({"play": play, "context": "\n".join(speech[at - 4:at]) + "\n", "choices": choices,
                     "gold": choices.index(gold)})
    return docs


def cloze_docs(n: int, seed: int = 0) -> list[dict]:
    from attnlab.data import plays
    rng, docs = random.Random(seed + 1), []
    pools = {p: [s for s in _verse(p) if len(s) >= 4] for p in plays("test")}
    while len(docs) < n:
        play = sorted(pools)[len(docs) % len(pools)]
        speech = rng.choice(pools[play])
        end = rng.randrange(3, len(speech) + 1)
        text = "\n".join(speech[max(0, end - 6):end])
        m = re.search(r"^(.*\S)\s+([A-Za-z']{3,})[.,;:!?]*$", text, re.S)
        if not m:
            continue
        docs.append({"play": play, "context": m.group(1), "target": " " + m.group(2)})
    return docs


def ppl_docs(n: int, size: int = 2000) -> list[dict]:
    """n passages, evenly spread over the test plays, cut at line ends."""
    from attnlab.data import plays, play_text
    per = -(-n // len(plays("test")))
    docs = []
    for play in plays("test"):
        text = play_text(play)
        for i in range(per):
            start = text.find("\n", i * (len(text) - size) // per) + 1
            end = text.rfind("\n", start, start + size)
            docs.append({"play": play, "text": text[start:end]})
    return docs[:n]


def write_tasks(folder: str | Path = TASK_DIR, n_nextline: int = 300, n_cloze: int = 300, n_ppl: int = 24,
                seed: int = 0) -> list[Path]:
    folder = Path(folder)
    out = []
    for name, docs in (("nextline", nextline_docs(n_nextline, seed)), ("cloze", cloze_docs(n_cloze, seed)),
                       ("plays_ppl", ppl_docs(n_ppl))):
        out.append(write_text(folder / FILES[name], "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)))
    return out


def load(name: str):
    """A `datasets.DatasetDict` with one `test` split read from the shipped JSONL (for the YAMLs)."""
    import datasets
    rows = [json.loads(line) for line in (TASK_DIR / FILES[name]).read_text().splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
