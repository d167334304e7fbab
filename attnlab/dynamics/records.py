"""What a stored result must say about how it was made, checked file by file.

Every JSON under docs/figures carries either a **run record**, taken when the run started
(``attnlab.io.run_record``): a ``command``, the ``commit`` of the code, ``dirty`` (did the
package differ from that commit) and the ``seed`` (null for a deterministic run); or, for a
file written before runs recorded themselves, a **backfilled** ``provenance`` record: the
command as the docs give it, the commit that added the file (``git log --diff-filter=A``: the
code that ran is at or before it) and a ``note`` that says so. Files that are not JSON objects
(lists) are recorded in ``docs/figures/provenance.json`` under their path.

A record is rejected when its commit is not an ancestor of HEAD, when ``dirty`` is true without
a note, when the seed is missing, or when it says it was transcribed or carried over (numbers
typed in, or kept from an older run under a newer run's name). ``python -m
attnlab.dynamics.records check`` prints every problem; ``backfill`` adds the backfilled records.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "docs" / "figures"
REGISTRY = FIGURES / "provenance.json"  # records of the JSON files that are not objects
HEX = re.compile(r"[0-9a-f]{7,40}")
UNTRUSTED = re.compile(r"transcri|carried over|carried-over", re.I)


def git_available(root: Path = ROOT) -> bool:
    """True when git runs and ``root`` is inside a work tree (the ancestry check needs both)."""
    if shutil.which("git") is None:
        return False
    r = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=root, capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip() == "true"


def is_ancestor(commit: str, root: Path = ROOT, head: str = "HEAD") -> bool:
    """True when ``commit`` names a commit that HEAD contains (a made-up or foreign hash is not)."""
    r = subprocess.run(["git", "merge-base", "--is-ancestor", commit, head], cwd=root, capture_output=True)
    return r.returncode == 0


def _untrusted(rec: dict) -> str | None:
    """Why ``rec`` says it is transcribed or carried over, or None."""
    for key in ("transcribed", "carried_over"):
        if rec.get(key):
            return f"marked {key}"
    for key in ("source", "note"):
        if isinstance(rec.get(key), str) and UNTRUSTED.search(rec[key]):
            return f"its {key} says {UNTRUSTED.search(rec[key]).group(0)!r}"
    return None


def check_record(rec, name: str, git: bool = True, root: Path = ROOT) -> list[str]:
    """Problems of one stored result (``rec``: the parsed JSON, or its registry entry); [] if none.

    ``git`` False skips the ancestry check (no git, or not a checkout)."""
    if not isinstance(rec, dict):
        return [f"{name}: not a JSON object and not in {REGISTRY.name}"]
    problems = []
    prov = rec.get("provenance") if isinstance(rec.get("provenance"), dict) else None
    backfilled = prov is not None and "note" in prov and "commit" in prov
    for r in (rec, prov) if backfilled else (rec,):
        why = _untrusted(r)
        if why:
            problems.append(f"{name}: {why}")
    if backfilled:
        src, what = prov, "provenance"
        if not (isinstance(prov["note"], str) and prov["note"].strip()):
            problems.append(f"{name}: backfilled provenance without a note")
    else:
        src, what = rec, "record"
        if "dirty" not in rec or not isinstance(rec["dirty"], bool):
            problems.append(f"{name}: no dirty flag (true/false) taken when the run started")
        elif rec["dirty"] and not str(rec.get("dirty_note") or "").strip():
            problems.append(f"{name}: dirty is true and no dirty_note says what differed")
        if "seed" not in rec:
            problems.append(f"{name}: no seed")
    command, commit = src.get("command"), src.get("commit")
    if not (isinstance(command, str) and command.strip()):
        problems.append(f"{name}: {what} names no command")
    if not (isinstance(commit, str) and HEX.fullmatch(commit)):
        problems.append(f"{name}: {what} names no commit ({commit!r})")
    elif git and not is_ancestor(commit, root):
        problems.append(f"{name}: commit {commit} is not an ancestor of HEAD")
    return problems


def stored_results(figures: Path = FIGURES) -> list[Path]:
    return sorted(p for p in figures.rglob("*.json") if p != figures / REGISTRY.name)


def check_tree(figures: Path = FIGURES, git: bool = True, root: Path = ROOT) -> list[str]:
    """Problems of every JSON under ``figures`` (lists looked up in its provenance.json)."""
    registry_file = figures / REGISTRY.name
    registry = json.loads(registry_file.read_text()) if registry_file.exists() else {"records": {}}
    problems = check_record(registry, registry_file.name, git, root) if registry_file.exists() else []
    for path in stored_results(figures):
        rel = str(path.relative_to(figures))
        try:
            rec = json.loads(path.read_text())
        except ValueError as e:
            problems.append(f"{rel}: not JSON ({e})")
            continue
        if not isinstance(rec, dict):
            rec = registry["records"].get(rel, rec)
            rec = {"provenance": rec} if isinstance(rec, dict) else rec
        problems += check_record(rec, rel, git, root)
    return problems


# ---- backfill: records for files written before runs recorded themselves ----------------------

def introducing_commit(path: Path, root: Path = ROOT) -> str:
    """The short hash of the commit that added ``path`` (its oldest add, following no renames)."""
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "--", str(path)], cwd=root,
                         capture_output=True, text=True, check=True).stdout.split()
    if not out:
        raise ValueError(f"{path} was never committed")
    return out[-1]


BACKFILL_NOTE = ("written before runs recorded their own provenance: the commit is the one that added this "
                 "file to the repository (the code that ran is at or before it, exact commit unknown), the "
                 "command is {how}; no dirty flag or seed was recorded by the run")


def backfill_record(path: Path, command: str, how: str, root: Path = ROOT, extra: str = "") -> dict:
    note = BACKFILL_NOTE.format(how=how) + (f"; {extra}" if extra else "")
    return {"command": command, "commit": introducing_commit(path, root), "dirty": None, "seed": None, "note": note}


def with_provenance(text: str, rec: dict, back: dict) -> str:
    """``text`` (the JSON of ``rec``) with ``back`` added as its "provenance", changing nothing else:
    appended before the closing brace in the file's own layout, or merged into an existing
    "provenance" object with the file re-written in its own indentation."""
    old = rec.get("provenance")
    if old is None:
        body, multiline = text.rstrip(), "\n" in text.strip()
        return body[:-1].rstrip() + (",\n  " if multiline else ", ") + '"provenance": ' + json.dumps(back) + (
            "\n}" if multiline else "}") + "\n"
    merged = {**rec, "provenance": {**old, **back} if isinstance(old, dict) else back}
    style = next(((i, a) for i in (None, 1, 2, 4) for a in (True, False)
                  if json.dumps(rec, indent=i, ensure_ascii=a).strip() == text.strip()), (2, True))
    return json.dumps(merged, indent=style[0], ensure_ascii=style[1]) + "\n"


# (path prefix under docs/figures, command the docs give for it, page that gives its arguments); first match wins
DOCUMENTED = [
    ("bench/i43_qwen_load", "python benchmarks/load.py", "docs/benchmarks/decode.md"),
    ("bench/", "python benchmarks/decode_speed.py", "docs/benchmarks/decode.md"),
    ("dejavu/teal/ops-teal", "python benchmarks/dejavu.py --out runs/dejavu --ops", "docs/dejavu.md"),
    ("dejavu/teal/bench-", "python benchmarks/dejavu.py --out runs/dejavu --teal", "docs/dejavu.md"),
    ("dejavu/teal/teal-check", "attnlab dejavu calibrate --out runs/dejavu", "docs/dejavu.md"),
    ("dejavu/teal/", "attnlab dejavu eval --out runs/dejavu", "docs/dejavu.md"),
    ("dejavu/bench-", "python benchmarks/dejavu.py --out runs/dejavu", "docs/dejavu.md"),
    ("dejavu/profile", "python benchmarks/dejavu.py --out runs/dejavu", "docs/dejavu.md"),
    ("dejavu/concentration", "attnlab dejavu collect --out runs/dejavu", "docs/dejavu.md"),
    ("dejavu/", "attnlab dejavu eval --out runs/dejavu", "docs/dejavu.md"),
    ("kv/quest-ruler/int8-keys-t", "python -P benchmarks/quest_pages_oracle.py", "docs/kv.md"),
    ("kv/quest-ruler", "python -P benchmarks/quest_ruler.py", "docs/kv.md"),
    ("quant/decode_kl", "python benchmarks/decode_kl.py", "docs/quant.md"),
    ("quant/decode_speed", "python benchmarks/decode_speed.py", "docs/quant.md"),
    ("quant/streaming", "python benchmarks/streaming.py", "docs/quant.md"),
    ("rope/passkey", "attnlab passkey", "docs/rope.md"),
    ("serve/soak", "python benchmarks/serve.py --clients 4 --turns 100 --passage-words 50 --max-tokens 8 --budget 512 "
                   "--policies sink --block 64 --quant int4:32", "docs/serve.md"),
    ("press-anchor/", "python benchmarks/kvpress_anchor.py --write-samples samples.json", "docs/press.md"),
]


def _documented(rel: str) -> tuple[str, str]:
    for prefix, command, page in DOCUMENTED:
        if rel.startswith(prefix):
            return command, page
    raise ValueError(f"no documented command for {rel}: add it to DOCUMENTED")


def backfill(figures: Path = FIGURES, root: Path = ROOT, skip: tuple = (), extra: dict | None = None) -> list[str]:
    """Add a backfilled ``provenance`` record to every stored result that has no run record (lists go
    to provenance.json); never touches a number. ``extra``: {path: what else the note must say}.
    Returns the paths it recorded."""
    from attnlab.io import provenance, write_json, write_text
    registry_file = figures / REGISTRY.name
    registry = json.loads(registry_file.read_text()) if registry_file.exists() else {}
    records, done = registry.get("records", {}), []
    for path in stored_results(figures):
        rel = str(path.relative_to(figures))
        if rel.startswith(skip):
            continue
        rec = json.loads(path.read_text())
        target = rec.get("provenance") if isinstance(rec, dict) else records.get(rel)
        if isinstance(rec, dict) and not check_record({k: v for k, v in rec.items() if k != "provenance"}, rel, False):
            continue  # a run record already
        if isinstance(target, dict) and "note" in target and "commit" in target:
            continue  # backfilled already
        own = rec.get("command") if isinstance(rec, dict) else None
        command, how = (own, "the one the file itself names") if own else (
            _documented(rel)[0], f"the one {_documented(rel)[1]} gives beside this file (arguments there)")
        back = backfill_record(path, command, how, root, (extra or {}).get(rel, ""))
        if isinstance(rec, dict):
            write_text(path, with_provenance(path.read_text(), rec, back))
        else:
            records[rel] = back
        done.append(rel)
    if records:
        record = {**provenance(None), "command": "python -m attnlab.dynamics.records backfill", "seed": None,
                  "what": "provenance records of the stored results that are JSON lists (see attnlab/dynamics/records.py)",
                  "records": records}
        if registry.get("records") != records or not registry_file.exists():
            write_json(registry_file, record)
    return done


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["backfill"]:  # backfill [PREFIX_TO_SKIP ...]
        print("\n".join(backfill(skip=tuple(argv[1:]))))
        return 0
    if argv[:1] != ["check"]:
        print("usage: python -m attnlab.dynamics.records check|backfill")
        return 2
    problems = check_tree(git=git_available())
    print("\n".join(problems) or f"all {len(stored_results())} stored results carry their provenance")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
